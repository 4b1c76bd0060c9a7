"""Service benchmark: /v1/predict and /v1/plan latency and throughput against the production server.

Run: `python bench/service_bench.py [--requests 2000] [--workers 2] [--quick]`
Starts `elastic-predictor serve` (gunicorn) on a loopback port over a temporary database seeded with the
resnet50 and bert-base profiles and synthetic H200 step/collective history, then sends requests from
concurrent client threads in this process (the clients share the machine's 2 cores with the server):
- flat out: C client threads, each sending its next request when the previous one returns;
- paced: an open loop at a fixed rate (200 req/s); latency is measured from each request's scheduled send
  time, so queueing behind a slow request counts (no coordinated omission).
Each scenario runs with the prediction cache on and off (`ELASTIC_PREDICTOR_CACHE_SIZE=0`), half /v1/predict
(candidates enumerated by the service) and half /v1/plan (stores a decision per request). Bodies cycle
through 24 distinct jobs. Prints a table and writes bench/results/service.md.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def seed(db: str) -> None:
    """Profiles and a synthetic H200 history, imported through the CLI (as an operator would)."""
    from predictor.profiles import profile_from_spec

    lines = []
    for spec in ("resnet50", "bert-base-uncased"):
        try:
            lines.append(dict(profile_from_spec(spec).to_dict(), kind="profile"))
        except Exception as exc:  # noqa: BLE001 - a missing built-in only narrows the workload
            print(f"skipping profile {spec}: {exc}", file=sys.stderr)
    names = [p["name"] for p in lines]
    for name, base in zip(names, (0.030, 0.080)):
        for batch in (32, 64):
            for layout in ([1], [2], [4], [2, 2], [4, 4], [1, 1, 1, 1]):
                step = {"kind": "step", "profile": name, "gpu": "H200", "layout": layout, "intra_link": "nvlink",
                        "per_gpu_batch": batch, "iter_s": base * batch / 64 * (1 + 0.05 * len(layout) + 0.01 * sum(layout))}
                if len(layout) > 1:
                    step["inter_link"] = "ib"
                lines.append(step)
    for link, bandwidth in (("nvlink", 3e11), ("ib", 2.5e10)):
        for world in (2, 4, 8, 16):
            for size in (1 << 20, 1 << 24, 1 << 27):
                lines.append({"kind": "collective", "op": "allreduce", "link": link, "world": world, "bytes": size,
                              "seconds": 2e-5 + 2 * (world - 1) / world * size / bandwidth})
    path = Path(db).with_suffix(".jsonl")
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    subprocess.run([sys.executable, "-m", "predictor.cli", "import", "--db", db, str(path)], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)


def bodies(names: list[str]) -> list[tuple[str, dict]]:
    out = []
    for i in range(24):
        name = names[i % len(names)]
        batch = (32, 64)[i // 2 % 2]
        if i % 2 == 0:
            out.append(("/v1/predict", {"profile": name, "gpu": "H200", "per_gpu_batch": batch, "max_gpus": 4 + 4 * (i % 4)}))
        else:
            objective = ("throughput", "efficiency", "cost")[i % 3]
            out.append(("/v1/plan", {"source": "job_submit", "job": {"min_nodes": 1, "tres_per_node": "gres:gpu:4",
                                                                      "partition": "debug", "user": "bench"},
                                     "directives": [f"#ELASTIC model={name} gpus={1 + i % 4}-{8 + 4 * (i % 3)}",
                                                    f"#ELASTIC per_gpu_batch={batch} objective={objective}"]}))
    return out


def start_server(db: str, workers: int, threads: int, cache: bool, extra_args: tuple[str, ...] = (),
                 launcher: list[str] | None = None, log=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """`elastic-predictor serve` (or `launcher`, given the same options) on a free loopback port, once every
    worker answers from a fitted model; `extra_args` are appended to its options."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, ELASTIC_PREDICTOR_TOKEN="bench", ELASTIC_PREDICTOR_CACHE_SIZE="4096" if cache else "0")
    proc = subprocess.Popen([*(launcher or [sys.executable, "-m", "predictor.cli", "serve"]), "--host", "127.0.0.1",
                             "--port", str(port), "--db", db, "--workers", str(workers), "--threads", str(threads),
                             *extra_args], env=env, cwd=ROOT, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    fitted = 0
    while fitted < workers * 3:          # every worker fitted (requests land on any worker)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not come up")
        try:
            fitted += 1 if requests.get(f"{base}/healthz", timeout=2).json().get("model_version") else 0
        except requests.RequestException:      # not up yet, or a slow first answer
            pass
        time.sleep(0.2)
    return proc, base


class Client:
    """A lean HTTP/1.1 client (http.client; keep-alive when the server allows it): less client CPU than requests."""

    def __init__(self, base: str):
        host, port = base.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, payload: bytes) -> int:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
            try:
                self.conn.request("POST", path, payload, {"Content-Type": "application/json"})
                response = self.conn.getresponse()
                response.read()
                if response.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return response.status
            except (http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        return 0


def run(base: str, work: list[tuple[str, bytes]], total: int, clients: int, rate: float | None) -> dict:
    local = threading.local()
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    start = time.perf_counter() + 0.05

    def one(i: int) -> None:
        if not hasattr(local, "client"):
            local.client = Client(base)
        path, body = work[i % len(work)]
        scheduled = start + i / rate if rate else None
        if scheduled is not None:
            delay = scheduled - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        sent = time.perf_counter()
        try:
            ok = local.client.post(path, body) == 200
        except (http.client.HTTPException, OSError):
            ok = False
        done = time.perf_counter()
        with lock:
            latencies.append(done - (scheduled if scheduled is not None else sent))
            errors[0] += 0 if ok else 1

    with cf.ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(total)))
    elapsed = time.perf_counter() - start
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return {"requests": total, "req_s": total / elapsed, "p50_ms": pct(0.50), "p90_ms": pct(0.90), "p99_ms": pct(0.99),
            "max_ms": ordered[-1] * 1000, "mean_ms": statistics.fmean(ordered) * 1000, "errors": errors[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--paced-clients", type=int, default=4, help="client threads of the paced run")
    ap.add_argument("--cache", choices=("both", "on", "off"), default="both")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--output", default=str(RESULTS / "service.md"), help="where to write the markdown table")
    ap.add_argument("--serve-args", default="", help="more `elastic-predictor serve` options, e.g. '--side-workers 0'")
    ap.add_argument("--cpus", default=None, help="note on the CPUs used, printed in the header (e.g. 'taskset -c 0,1')")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "bench.db")
        seed(db)
        names = sorted({json.loads(l)["name"] for l in Path(db).with_suffix(".jsonl").read_text().splitlines()
                        if json.loads(l).get("kind") == "profile"})
        work = [(path, json.dumps(body).encode()) for path, body in bodies(names)]
        for cache in {"both": (True, False), "on": (True,), "off": (False,)}[args.cache]:
            proc, base = start_server(db, args.workers, args.threads, cache, tuple(shlex.split(args.serve_args)))
            try:
                run(base, work, 200, args.clients, None)                      # warm-up, not reported
                for label, clients, rate in (("flat out", args.clients, None), (f"paced {args.rate:g}/s", args.paced_clients, args.rate)):
                    load = os.getloadavg()[0]
                    result = run(base, work, args.requests, clients, rate)
                    rows.append({"scenario": label, "cache": "on" if cache else "off", "clients": clients,
                                 "load": load, **result})
                    print(rows[-1], file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(30)
    header = (f"Service benchmark: {args.requests} requests per row, half POST /v1/predict (enumerated candidates) and "
              f"half POST /v1/plan (decision stored), 24 distinct bodies; gunicorn {args.workers} worker(s) x "
              f"{args.threads} thread(s){' (serve ' + args.serve_args + ')' if args.serve_args else ''}; clients are threads in the same process on the same "
              f"{len(os.sched_getaffinity(0))} usable cores{' (' + args.cpus + ')' if args.cpus else ''}, Python "
              f"{platform.python_version()}. Paced rows time latency from the scheduled send.")
    table = ["| scenario | cache | clients | load avg before | req/s | p50 ms | p90 ms | p99 ms | max ms | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['scenario']} | {r['cache']} | {r['clients']} | {r['load']:.1f} | {r['req_s']:.0f} | {r['p50_ms']:.2f} | "
                     f"{r['p90_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.1f} | {r['errors']} |")
    text = header + "\n\n" + "\n".join(table) + "\n\nTarget: p99 <= 10 ms at 200 req/s.\n"
    print(text)
    if not args.no_write:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "python bench/service_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        out.write_text(f"# Service benchmark\n\nCommand: `{command.strip()}`\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
