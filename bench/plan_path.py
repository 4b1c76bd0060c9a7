"""Cost of one POST /v1/plan with distinct bodies: before (old code) and after (this tree), same run.

Usage:
    python bench/plan_path.py [--before COMMIT] [--requests 1000] [--rounds 3] [--out bench/results/plan_path.md]
    python bench/plan_path.py --profile            # cProfile of the in-process path of this tree

`before` is this tree's predictor package with the files of the plan path (OWNED) taken from `--before`
with `git show` (everything else, e.g. the engine, is this tree's), so only the plan-path change differs.
Each variant runs in its own subprocess (PYTHONPATH picks the package), alternating before/after for
`--rounds` rounds on copies of one seeded database; the table gives the median over rounds.

Two measurements per variant:
    in-process  Flask test client: CPU (thread_time) and latency (perf_counter) per request
    server      `elastic-predictor serve --workers 1` (gunicorn sync worker, as `serve` runs it), a new
                HTTP/1.0 connection per request, sequential, like the job_submit hook: client latency and
                the worker's CPU per request (utime+stime from /proc), /healthz alongside as the floor.
Every body is distinct (`#ELASTIC min_efficiency=0.5NNNNN`), so the hook's decision cache would never hit;
the service's prediction cache does, as in bench/hook_latency.py's on-distinct phase.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = "bcd181e"   # the plan path before issue #5's change
OWNED = ["predictor/api/predict.py", "predictor/api/metrics.py", "predictor/store.py", "slurm_plugin/contracts/records.py",
         "predictor/service.py", "predictor/app.py", "predictor/planner.py"]
DIRECTIVES = ["#ELASTIC model=resnet50 gpus=2-8", "#ELASTIC per_gpu_batch=64"]
JOB = {"user": "alice", "uid": 1001, "partition": "debug", "name": "train", "min_nodes": 1, "max_nodes": 1,
       "tres_per_node": "gres:gpu:4", "time_limit_min": 5}
STEPS = [([1], 0.030), ([2], 0.031), ([4], 0.032), ([1, 1], 0.034), ([2, 2], 0.035), ([4, 4], 0.037)]


def body(n: int) -> bytes:
    """The n-th distinct request, as the job_submit hook sends it."""
    return json.dumps({"source": "job_submit", "directives": DIRECTIVES + [f"#ELASTIC min_efficiency=0.5{n:05d}"],
                       "job": JOB}).encode()


# --- worker side (runs with PYTHONPATH=<variant>:<repo>) ------------------------------------------------
def seed(db: Path) -> None:
    """resnet50 plus synthetic H200 steps, as bench/hook_latency.py seeds its service."""
    cli = [sys.executable, "-m", "predictor.cli"]
    subprocess.run(cli + ["profile", "torchvision:resnet50", "--db", str(db)], check=True, capture_output=True)
    steps = db.with_suffix(".jsonl")
    steps.write_text("".join(json.dumps(
        {"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": layout, "intra_link": "nvlink",
         "inter_link": "ib", "per_gpu_batch": 64, "iter_s": it}) + "\n" for layout, it in STEPS for _ in range(2)))
    subprocess.run(cli + ["import", "--db", str(db), str(steps)], check=True, capture_output=True)


def _app(db: Path):
    from datetime import timedelta

    from predictor.app import create_app
    from predictor.config import Config

    app = create_app(Config(db_path=str(db)))
    assert app.extensions["elastic_predictor"].models.wait_fresh(timedelta(seconds=60)), "no fit"
    return app


def in_process(db: Path, requests: int, start: int) -> dict:
    """Per-request CPU and latency through the Flask test client."""
    app = _app(db)
    client = app.test_client()
    for n in range(200):                                   # warm up (and fill the prediction cache)
        assert client.post("/v1/plan", data=body(start + n), content_type="application/json").status_code == 200
    cpu, wall = [], []
    for n in range(200, 200 + requests):
        data = body(start + n)
        c0, t0 = time.thread_time(), time.perf_counter()
        response = client.post("/v1/plan", data=data, content_type="application/json")
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        assert response.status_code == 200 and response.get_json()["action"] == "rewrite", response.data[:200]
    hcpu = []
    for _ in range(requests):
        c0 = time.thread_time()
        client.get("/healthz")
        hcpu.append(time.thread_time() - c0)
    app.extensions["elastic_predictor"].models.stop()
    return {"cpu_ms": 1e3 * statistics.mean(cpu), "p50_ms": 1e3 * statistics.median(wall),
            "p90_ms": 1e3 * statistics.quantiles(wall, n=10)[-1], "healthz_cpu_ms": 1e3 * statistics.mean(hcpu)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(port: int, method: str, path: str, data: bytes = b"") -> bytes:
    """One HTTP/1.0 request on a new connection (as the hook does); returns the whole answer."""
    head = (f"{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_pid(master: int) -> int:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == master:
                    return int(proc.name)
            except (OSError, IndexError, ValueError):
                continue
    raise RuntimeError("no gunicorn worker")


def server(db: Path, requests: int, start: int) -> dict:
    """Client latency and worker CPU per request through `serve --workers 1`."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--port", str(port), "--db", str(db),
                             "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if b'"rewrite"' in _http(port, "POST", "/v1/plan", body(start)):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("serve did not plan a rewrite within 90 s")
            time.sleep(0.3)
        worker = _worker_pid(proc.pid)
        for n in range(1, 200):
            _http(port, "POST", "/v1/plan", body(start + n))
        wall = []
        c0 = _cpu_s(worker)
        for n in range(200, 200 + requests):
            data = body(start + n)
            t0 = time.perf_counter()
            answer = _http(port, "POST", "/v1/plan", data)
            wall.append(time.perf_counter() - t0)
            assert answer.split(b"\r\n", 1)[0].endswith(b" 200 OK") and b'"rewrite"' in answer, answer[:300]
        cpu = (_cpu_s(worker) - c0) / requests
        h0 = _cpu_s(worker)
        for _ in range(requests):
            _http(port, "GET", "/healthz")
        hcpu = (_cpu_s(worker) - h0) / requests
    finally:
        proc.terminate()
        proc.wait(20)
    return {"cpu_ms": 1e3 * cpu, "p50_ms": 1e3 * statistics.median(wall),
            "p90_ms": 1e3 * statistics.quantiles(wall, n=10)[-1], "healthz_cpu_ms": 1e3 * hcpu}


def profile(db: Path, requests: int) -> None:
    import cProfile
    import pstats

    app = _app(db)
    client = app.test_client()
    for n in range(200):
        client.post("/v1/plan", data=body(n), content_type="application/json")
    prof = cProfile.Profile()
    prof.enable()
    for n in range(200, 200 + requests):
        client.post("/v1/plan", data=body(n), content_type="application/json")
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    app.extensions["elastic_predictor"].models.stop()


# --- driver ---------------------------------------------------------------------------------------------
def variant_tree(commit: str, into: Path) -> Path:
    """This tree's predictor package with the OWNED files as of `commit`."""
    shutil.copytree(ROOT / "predictor", into / "predictor", ignore=shutil.ignore_patterns("__pycache__"))
    for path in OWNED:
        old = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"], check=True, capture_output=True).stdout
        (into / path).write_bytes(old)
    return into


def run_variant(tree: Path, mode: str, db: Path, requests: int, start: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]), PYTHONDONTWRITEBYTECODE="1")
    for key in [k for k in env if k.startswith("ELASTIC_PREDICTOR_")]:
        del env[key]                                     # open writes, default TTL, the db given here
    out = subprocess.run([sys.executable, __file__, "--worker", mode, "--db", str(db), "--requests", str(requests),
                          "--start", str(start)], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"{mode} worker of {tree.name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BASE)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--worker", choices=("in-process", "server"))
    parser.add_argument("--db", type=Path)
    parser.add_argument("--start", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        result = (in_process if args.worker == "in-process" else server)(args.db, args.requests, args.start)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(prefix="plan-path-") as tmp:
        tmp = Path(tmp)
        seed_db = tmp / "seed.db"
        seed(seed_db)
        if args.profile:
            profile(seed_db, args.requests)
            return
        trees = {"before": variant_tree(args.before, tmp / "before"), "after": tmp / "after"}
        shutil.copytree(ROOT / "predictor", trees["after"] / "predictor", ignore=shutil.ignore_patterns("__pycache__"))
        results: dict[tuple[str, str], list[dict]] = {}
        serial = 0
        for rnd in range(args.rounds):
            for mode in ("in-process", "server"):
                for name in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
                    db = tmp / f"{name}-{mode}-{rnd}.db"
                    shutil.copy(seed_db, db)
                    serial += 1
                    results.setdefault((mode, name), []).append(
                        run_variant(trees[name], mode, db, args.requests, serial * (args.requests + 400)))
                    print(f"round {rnd + 1} {mode} {name}: {results[(mode, name)][-1]}", file=sys.stderr)
    table = render(results, args)
    print(table)
    if args.out:
        args.out.write_text(table)


def render(results: dict, args) -> str:
    def med(mode, name, key):
        return statistics.median(r[key] for r in results[(mode, name)])

    lines = [f"# POST /v1/plan with distinct bodies: before ({args.before}) and after, same run",
             "",
             f"Run: `python bench/plan_path.py --requests {args.requests} --rounds {args.rounds}` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()}-core shared host "
             f"(load {os.getloadavg()[0]:.1f}). Medians over {args.rounds} rounds of {args.requests} requests each; "
             "CPU is per request (in-process: the request thread; server: the gunicorn worker, utime+stime).",
             "",
             "| path | metric | before | after | after / before |",
             "|---|---|---:|---:|---:|"]
    for mode in ("in-process", "server"):
        for key, label in (("cpu_ms", "CPU ms / plan"), ("p50_ms", "latency p50 ms"), ("p90_ms", "latency p90 ms"),
                           ("healthz_cpu_ms", "CPU ms / healthz (floor)")):
            b, a = med(mode, "before", key), med(mode, "after", key)
            lines.append(f"| {mode} | {label} | {b:.3f} | {a:.3f} | {a / b:.2f} |")
        b, a = (statistics.median(r["cpu_ms"] - r["healthz_cpu_ms"] for r in results[(mode, name)])
                for name in ("before", "after"))
        lines.append(f"| {mode} | CPU ms / plan above healthz (the plan path's own) | {b:.3f} | {a:.3f} | {a / b:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
