"""Hostile clients, round 2 (issue #24): what one user, job or anonymous client does to everyone else, against a
real `elastic-predictor serve` (the same service and seeding as bench/hostile_clients.py: tool token, 2 workers).

Run: `python bench/hostile_round2.py [--root CHECKOUT] [--profiles 300] [--output FILE]`

Each attack runs while a legitimate client POSTs /v1/plan at 20/s (open loop, timed from the scheduled send),
and prints: that client's p99 and how many of its plans took over 100 ms, the attack's 5xx (or unanswered)
count, worker RSS and database growth with their bounds (`bounds`: from the service's own limits), the attack's own
check, and a verdict (`verdict`: the check, the client's p99 <= 100 ms and 0 5xx, both growths within bound):

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
import contextlib
import json
import random
import sqlite3
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


MB = 2 ** 20
P99_TARGET_MS = hc.P99_TARGET_MS


def model_mb(db: Path) -> float:
    """MB of the newest fitted model's pickled blob in ``db`` (0 without one)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
            row = con.execute("SELECT length(blob) FROM models ORDER BY version DESC LIMIT 1").fetchone()
    except sqlite3.Error:
        return 0.0
    return (row[0] or 0) / MB if row else 0.0


def bounds(model: float, stores: tuple[int, str] | None = None) -> dict:
    """What one attack may grow a worker's memory and the database by (MB), from the service's own limits, with
    the constants named. ``model``: the newest model's MB; ``stores``: (bytes, why) the attack's own stored rows
    may take at most (None: it stores nothing)."""
    from predictor import plotcache  # noqa: PLC0415
    from predictor.config import Config  # noqa: PLC0415
    from predictor.store import WAL_SIZE_LIMIT  # noqa: PLC0415

    cache = Config().prediction_cache_bytes / MB
    plots = plotcache.MAX_BYTES / MB
    decisions = hc.DECISIONS_MAX_BYTES / MB
    wal = WAL_SIZE_LIMIT / MB
    own, own_why = ((stores[0] / MB, stores[1]) if stores else (0.0, "the attack stores nothing"))
    return {"memory": cache + plots + 2 * model,
            "memory_why": f"{cache:.0f} MiB prediction cache (ELASTIC_PREDICTOR_CACHE_BYTES) + {plots:.0f} MiB plot "
                          f"cache (plotcache.MAX_BYTES) + 2 x the model ({model:.1f} MB: held, and the next loaded)",
            "disk": decisions + wal + 3 * model + own,
            "disk_why": f"{decisions:.0f} MiB decisions budget (ELASTIC_PREDICTOR_DECISIONS_MAX_BYTES: the legitimate "
                        f"client's plans) + {wal:.0f} MiB WAL (store.WAL_SIZE_LIMIT) + 3 x the model (the newest 3 "
                        f"kept) + {own:.1f} MB ({own_why})"}


def verdict(row: dict) -> list[str]:
    """What a round-2 row failed on (empty: PASS): its own check, the legitimate client's p99 (<= 100 ms) and
    5xx (0), the largest worker's growth and the database's within their bounds."""
    failed = [] if row["passed"] else ["check"]
    if not row["plan_p99"][0] <= P99_TARGET_MS:
        failed.append(f"p99 {row['plan_p99'][0]:.1f} ms > {P99_TARGET_MS:g}")
    if row.get("plan_errors"):
        failed.append(f"5xx {row['plan_errors']}")
    grown = row["rss"][1] - row["rss"][0]
    if not grown <= row["bounds"]["memory"]:
        failed.append(f"memory +{grown:.0f} MB > {row['bounds']['memory']:.0f}")
    grown = row["db"][1] - row["db"][0]
    if not grown <= row["bounds"]["disk"]:
        failed.append(f"disk +{grown:.1f} MB > {row['bounds']['disk']:.1f}")
    return failed


def attack(service: hc.Service, label: str, run) -> dict:
    """Runs ``run(tally) -> (check, passed[, measures])`` (``measures``: the issue's columns it fills, as round
    3's; "stores": (bytes, why) its own rows may take) while /v1/plan is paced; returns the row, its bounds
    (`bounds`) and verdict (`verdict`)."""
    tally, stop, latencies, statuses = hc.Tally(), threading.Event(), [], []
    rss, db = service.worker_rss_mb(), hc.db_mb(service.db)
    pacer = threading.Thread(target=hc.paced_plans, args=(service.port, stop, latencies, statuses))
    pacer.start()
    try:
        check, passed, *rest = run(tally)
    finally:
        stop.set()
        pacer.join()
    measures = dict(rest[0]) if rest else {}
    row = {"attack": label, "tally": tally, "rss": (rss, service.worker_rss_mb()), "db": (db, hc.db_mb(service.db)),
           "plan_p99": (hc.p99_ms(latencies), len(latencies)), "over_100ms": sum(x > 0.1 for x in latencies),
           "plan_errors": sum(1 for c in statuses if c >= 500 or c == 0), "check": check, "passed": passed,
           "measures": measures, "bounds": bounds(model_mb(service.db), measures.pop("stores", None))}
    row["failed_on"] = verdict(row)
    row["verdict"] = "FAIL" if row["failed_on"] else "PASS"
    print(label, tally.summary(), f"plan p99 {row['plan_p99'][0]:.1f} ms", check, row["verdict"], row["failed_on"],
          file=sys.stderr, flush=True)
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
        return (f"{len(added):+d} /metrics series (target <= 20; a histogram's buckets count): {families(added)}",
                len(added) <= 20)
    return run


def many_profiles(service: hc.Service, profiles: int):
    def run(tally):
        sent = sent_bytes = 0
        for i in range(profiles):
            body = json.dumps({"name": f"junk{i}", "tensors": [{"name": "w", "numel": 1000 + i, "dtype": "float32"}]})
            hc.send(service.port, tally, "POST", "/v1/profiles", body.encode(), AUTH)
            sent, sent_bytes = sent + 1, sent_bytes + len(body)
        rows = [{"kind": "step", "profile": f"junk{i}", "gpu": "H200", "layout": layout, "intra_link": "nvlink",
                 "per_gpu_batch": 64, "iter_s": 0.01 * (1 + i % 7) * sum(layout) ** 0.1, "job_id": JOB,
                 **({"inter_link": "ib"} if len(layout) > 1 else {})}
                for i in range(profiles) for layout in ([1], [2], [4], [2, 2])]
        for k in range(0, len(rows), 400):
            batch = json.dumps(rows[k:k + 400]).encode()
            hc.send(service.port, tally, "POST", "/v1/observations", batch, AUTH)
            sent, sent_bytes = sent + 1, sent_bytes + len(batch)
        legit = [{"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [2], "intra_link": "nvlink",
                  "per_gpu_batch": 64, "iter_s": 0.0325}]
        fresh_s, health = fresh_after(service.port, json.dumps(legit).encode())
        fit_s = health.get("fit_s", float("nan"))
        limit = hc.STALENESS_TARGET_S
        from predictor.config import Config  # noqa: PLC0415
        max_body = Config().max_body_bytes
        return (f"{profiles} profiles x 4 rows of job {JOB} ({sent} writes, {sent_bytes / MB:.2f} MB sent); a "
                f"legitimate write reflected after {fresh_s:.1f} s "
                f"(target <= {limit:g} s: {'yes' if fresh_s <= limit else 'no'}); last fit {fit_s:.1f} s (target < "
                f"{limit:g} s: {'yes' if fit_s < limit else 'no'})"), fresh_s <= limit and fit_s < limit, {
            "staleness": f"a legitimate write reflected after {fresh_s:.1f} s (<= {limit:g} s); the fit {fit_s:.1f} s "
                         f"(< {limit:g} s)",
            # the tool token has no quota (a job's uid has: 32 profiles, 16 MiB): what it stores is bounded only by
            # what it sends, each accepted write at most one body
            "stores": (sent * max_body, f"{sent} writes of the tool token, no quota for tokens, x "
                                        f"ELASTIC_PREDICTOR_MAX_BODY {max_body >> 20} MiB")}
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
                f"{JOB}'s own rows): {'yes' if used else 'no'} (target: no)"), status == 200 and not used, {
            "stores": (0, "its 2 plans are decisions: in the budget above")}
    return run


def tiny_iter_s(service: hc.Service):
    def run(tally):
        row = [{"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [1], "intra_link": "nvlink",
                "per_gpu_batch": 64, "iter_s": 1e-300}]
        status, answer = hc.request(service.port, "POST", "/v1/observations", json.dumps(row).encode(), AUTH)
        tally.add(status)
        return f"HTTP {status}: {answer.decode().strip()[:120]}", status == 400 and b"iter_s" in answer
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
    out = ["| attack | legitimate /v1/plan p99 (over 100 ms) | 5xx / no answer | worker RSS MB (bound) | DB MB "
           "(bound) | check | verdict |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        failed = f" ({'; '.join(r['failed_on'])})" if r["failed_on"] else ""
        out.append(f"| {r['attack']} | {r['plan_p99'][0]:.1f} ms ({r['over_100ms']} of {r['plan_p99'][1]}) | "
                   f"{r['tally'].server_errors} of {r['tally'].total} | {r['rss'][0]:.0f} -> {r['rss'][1]:.0f} "
                   f"(+{r['bounds']['memory']:.0f}) | {r['db'][0]:.1f} -> {r['db'][1]:.1f} "
                   f"(+{r['bounds']['disk']:.1f}) | {r['check']} | **{r['verdict']}**{failed} |")
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
