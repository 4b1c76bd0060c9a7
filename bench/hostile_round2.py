"""Hostile clients, round 2 (issue #24): what one user, job or anonymous client does to everyone else, against a
real `elastic-predictor serve` (the same service and seeding as bench/hostile_clients.py: tool token, 2 workers).

Run: `python bench/hostile_round2.py [--root CHECKOUT] [--profiles 300] [--output FILE]`

Each attack runs while a legitimate client POSTs /v1/plan at 20/s (open loop, timed from the scheduled send),
and prints: that client's p99 and how many of its plans took over 100 ms, the attack's 5xx (or unanswered)
count, worker RSS and database growth, and the attack's own check:

- #24.7: 3000 requests with random method names; `/metrics` series before and after (target: <= 20 added).
- #24.2: one job's 300 profiles (`--profiles`) and 4 step rows each (the rows name one job id: a launcher
  without munge posts them with the token), then a legitimate step row of the seeded model: the seconds until
  every answer reflects it (`/healthz` model generation; target <= 5 s) and the fit's time.
- #24.12: an anonymous `/v1/plan` that names the attacking job's id with `current`: whether the answer came from
  that job's own step rows (`basis` measured; target: no).
- #24.14: a step row with `iter_s` 1e-300 (target: 400 naming the field).
"""
from __future__ import annotations

import argparse
import json
import random
import string
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import hostile_clients as hc  # noqa: E402

AUTH = {"Authorization": f"Bearer {hc.TOKEN}"}
JOB = 4242


def metrics_series(port: int) -> set[str]:
    status, body = hc.request(port, "GET", "/metrics")
    assert status == 200, status
    return {line.rsplit(" ", 1)[0] for line in body.decode().splitlines()
            if line and not line.startswith("#") and 'endpoint="/metrics"' not in line}   # not the scrapes' own


def families(series: set[str]) -> str:
    """The label sets of ``series``, buckets folded (``name{labels}``)."""
    out = set()
    for s in series:
        name, _, labels = s.partition("{")
        labels = ",".join(x for x in labels.rstrip("}").split(",") if x and not x.startswith("le="))
        out.add(f"{name.removesuffix('_bucket').removesuffix('_count').removesuffix('_sum')}{{{labels}}}")
    return ", ".join(sorted(out))


def fresh_after(port: int, body: bytes, timeout_s: float = 120.0) -> tuple[float, dict]:
    """POSTs ``body`` (step rows) and returns the seconds until /healthz shows a model of that data, and /healthz."""
    status, answer = hc.request(port, "POST", "/v1/observations", body, AUTH)
    assert status == 201, answer[:300]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        status, answer = hc.request(port, "GET", "/healthz")
        health = json.loads(answer)
        if status == 200 and health.get("model_generation") == health["generation"]:
            return time.perf_counter() - t0, health
        time.sleep(0.05)
    return float("inf"), health


def attack(service: hc.Service, label: str, run) -> dict:
    """Runs ``run(tally) -> check`` (or ``(check, measures)``: the issue's columns it fills, as round 3's) while
    /v1/plan is paced; returns the row."""
    tally, stop, latencies, statuses = hc.Tally(), threading.Event(), [], []
    rss, db = service.worker_rss_mb(), hc.db_mb(service.db)
    pacer = threading.Thread(target=hc.paced_plans, args=(service.port, stop, latencies, statuses))
    pacer.start()
    try:
        check = run(tally)
    finally:
        stop.set()
        pacer.join()
    check, measures = check if isinstance(check, tuple) else (check, {})
    row = {"attack": label, "tally": tally, "rss": (rss, service.worker_rss_mb()), "db": (db, hc.db_mb(service.db)),
           "plan_p99": (hc.p99_ms(latencies), len(latencies)), "over_100ms": sum(x > 0.1 for x in latencies),
           "plan_errors": sum(1 for c in statuses if c >= 500 or c == 0), "check": check, "measures": measures}
    print(label, tally.summary(), f"plan p99 {row['plan_p99'][0]:.1f} ms", check, file=sys.stderr, flush=True)
    return row


def random_methods(service: hc.Service, n: int = 3000):
    def run(tally):
        time.sleep(1.0)   # the legitimate client's own first series are not the attack's
        before = metrics_series(service.port)
        rng = random.Random(0)
        for _ in range(n):
            method = "".join(rng.choice(string.ascii_uppercase) for _ in range(8))
            hc.send(service.port, tally, method, "/v1/plan")
        added = metrics_series(service.port) - before
        return f"{len(added):+d} /metrics series (target <= 20; a histogram's buckets count): {families(added)}"
    return run


def many_profiles(service: hc.Service, profiles: int):
    def run(tally):
        for i in range(profiles):
            body = json.dumps({"name": f"junk{i}", "tensors": [{"name": "w", "numel": 1000 + i, "dtype": "float32"}]})
            hc.send(service.port, tally, "POST", "/v1/profiles", body.encode(), AUTH)
        rows = [{"kind": "step", "profile": f"junk{i}", "gpu": "H200", "layout": layout, "intra_link": "nvlink",
                 "per_gpu_batch": 64, "iter_s": 0.01 * (1 + i % 7) * sum(layout) ** 0.1, "job_id": JOB,
                 **({"inter_link": "ib"} if len(layout) > 1 else {})}
                for i in range(profiles) for layout in ([1], [2], [4], [2, 2])]
        for k in range(0, len(rows), 400):
            hc.send(service.port, tally, "POST", "/v1/observations", json.dumps(rows[k:k + 400]).encode(), AUTH)
        legit = [{"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [2], "intra_link": "nvlink",
                  "per_gpu_batch": 64, "iter_s": 0.0325}]
        fresh_s, health = fresh_after(service.port, json.dumps(legit).encode())
        fit_s = health.get("fit_s", float("nan"))
        return (f"{profiles} profiles x 4 rows of job {JOB}; a legitimate write reflected after {fresh_s:.1f} s "
                f"(target <= 5 s: {'yes' if fresh_s <= 5 else 'no'}); last fit {fit_s:.1f} s (target < 5 s: "
                f"{'yes' if fit_s < 5 else 'no'})"), {
            "staleness": f"a legitimate write reflected after {fresh_s:.1f} s (<= 5 s); the fit {fit_s:.1f} s (< 5 s)"}
    return run


def plan_naming_a_job(service: hc.Service):
    def run(tally):
        answers = []
        for job in (JOB, JOB + 1):   # the attacking job's id, and an id with no rows
            body = json.dumps({"source": "launcher", "directives": ["#ELASTIC model=junk0 gpus=1-4 per_gpu_batch=64"],
                               "job": {"job_id": job, "partition": "debug"},
                               "current": {"layout": [2], "per_gpu_batch": 64}}).encode()
            status, answer = hc.request(service.port, "POST", "/v1/plan", body)
            tally.add(status)
            reply = json.loads(answer)
            answers.append((reply.get("predicted"), reply.get("table")))
        used = answers[0] != answers[1]
        return (f"HTTP {status}; the answer naming job {JOB} differs from one naming a job without rows (it used "
                f"{JOB}'s own rows): {'yes' if used else 'no'} (target: no)")
    return run


def tiny_iter_s(service: hc.Service):
    def run(tally):
        row = [{"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [1], "intra_link": "nvlink",
                "per_gpu_batch": 64, "iter_s": 1e-300}]
        status, answer = hc.request(service.port, "POST", "/v1/observations", json.dumps(row).encode(), AUTH)
        tally.add(status)
        return f"HTTP {status}: {answer.decode().strip()[:120]}"
    return run


def run(root: Path, profiles: int, work: Path) -> list[dict]:
    db = work / "round2.db"
    hc.seed(root, db)
    service = hc.Service(root, db, 2, work / "serve.log")
    try:
        service.wait_ready()
        return [attack(service, "#24.7 3000 requests with random method names", random_methods(service)),
                attack(service, f"#24.2 one job's {profiles} profiles, 4 rows each", many_profiles(service, profiles)),
                attack(service, "#24.12 anonymous /v1/plan naming that job's id", plan_naming_a_job(service)),
                attack(service, "#24.14 a step row with iter_s 1e-300", tiny_iter_s(service))]
    finally:
        service.stop()


def table(rows: list[dict]) -> str:
    out = ["| attack | legitimate /v1/plan p99 (over 100 ms) | 5xx / no answer | worker RSS MB | DB MB | check |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['attack']} | {r['plan_p99'][0]:.1f} ms ({r['over_100ms']} of {r['plan_p99'][1]}) | "
                   f"{r['tally'].server_errors} of {r['tally'].total} | {r['rss'][0]:.0f} -> {r['rss'][1]:.0f} | "
                   f"{r['db'][0]:.1f} -> {r['db'][1]:.1f} | {r['check']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose service is attacked")
    ap.add_argument("--profiles", type=int, default=300)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hostile-round2-") as work:
        text = table(run(args.root, args.profiles, Path(work)))
    print(text)
    if args.output:
        args.output.write_text(f"# Hostile clients, round 2 (#24)\n\nCommand: `python bench/hostile_round2.py "
                               f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
