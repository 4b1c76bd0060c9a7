"""Hostile clients against a real `elastic-predictor serve` (issue #14, items 4-6): what unauthenticated requests
make a worker draw, hold in memory and write to disk.

Run: `python bench/hostile_clients.py [--workers 2] [--attack-s 20] [--root CHECKOUT] [--output FILE]`
Starts `python -m predictor.cli serve` from `--root` (default: this checkout; another checkout, e.g. the code
before a fix, runs the same attacks against it) on a loopback port over a temporary database seeded with the
resnet50 profile and a small H200 history (imported through the CLI, as an operator would), then runs:

- plots: one POST of 400 step records on GPU names G0..G399 (with the tool token), then two clients GET
  `/admin/plots/scaling.png` back to back for `--attack-s` seconds (unfiltered; then `?gpu=G<i>` over all 400
  names), while a third sends POST /v1/plan at 20 req/s and times each from its scheduled send (open loop);
- /v1/predict: 80 distinct requests of 320 candidates with 4096-node layouts; then 80 distinct requests at the
  per-request cap (16 candidates x 4096 nodes), worker RSS before and after;
- /v1/plan: 150 posts of a 3.9 MB `reused` object of junk keys; 150 posts of a valid plan padded with 3.9 MB
  of whitespace; 200 posts of the largest valid request (4096 reused decision ids, 15 KB of directive lines), the
  database file (+ WAL) before and after.

The service runs with its defaults except ELASTIC_PREDICTOR_TOKEN (for the seeding POSTs) and, to show the
decision retention within a short run, ELASTIC_PREDICTOR_DECISIONS_MAX_BYTES=16 MiB (default 512 MiB).
Worker RSS is the largest of the gunicorn workers' (the leaf processes of the service's process tree).
Clients are threads of this process on the same cores as the service. Prints a markdown table and writes it to
--output (default bench/results/hostile_clients.md).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import http.client
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TOKEN = "bench-token"
DECISIONS_MAX_BYTES = 16 * 1024 * 1024   # the served instances' ELASTIC_PREDICTOR_DECISIONS_MAX_BYTES
P99_TARGET_MS = 100.0                    # a legitimate client's /v1/plan p99 during any attack (#24, "Done when")
STALENESS_TARGET_S = 5.0                 # a new legitimate write is reflected within this long (#24, "Done when")
PLAN = {"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=1-8", "#ELASTIC per_gpu_batch=64"],
        "job": {"min_nodes": 1, "tres_per_node": "gres:gpu:4", "partition": "debug", "user": "bench"}}
PLAN_RATE = 20.0
REQUEST_TIMEOUT_S = 90.0


# --- the service ------------------------------------------------------------------------------------------------
def profile_record(root: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", "import json; from predictor.profiles import profile_from_spec; "
                          "print(json.dumps(profile_from_spec('resnet50').to_dict()))"],
                         cwd=root, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout), kind="profile")


def seed(root: Path, db: Path, steps: list[dict] | None = None) -> None:
    """Imports ResNet-50's profile, ``steps`` (default: five layouts of it) and all-reduce sweeps into ``db``."""
    lines = [profile_record(root)]
    if steps is None:
        steps = []
        for layout in ([1], [2], [4], [2, 2], [4, 4]):
            step = {"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": layout, "intra_link": "nvlink",
                    "per_gpu_batch": 64, "iter_s": 0.03 * (1 + 0.05 * len(layout) + 0.01 * sum(layout))}
            if len(layout) > 1:
                step["inter_link"] = "ib"
            steps.append(step)
    lines += steps
    for link, bandwidth in (("nvlink", 3e11), ("ib", 2.5e10)):
        for world in (2, 4, 8):
            for size in (1 << 20, 1 << 24, 1 << 27):
                lines.append({"kind": "collective", "op": "allreduce", "link": link, "world": world, "bytes": size,
                              "seconds": 2e-5 + 2 * (world - 1) / world * size / bandwidth})
    jsonl = db.with_suffix(".jsonl")
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    subprocess.run([sys.executable, "-m", "predictor.cli", "import", "--db", str(db), str(jsonl)], cwd=root,
                   check=True, stdout=subprocess.DEVNULL)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree[ppid].append(int(entry))
    return tree


def tree_pids(root_pid: int) -> list[int]:
    """`root_pid` and every process below it, parents before their children."""
    tree = _children()
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Service:
    """`elastic-predictor serve` from a checkout, on a free loopback port, in its own process group; ``extra_env``
    is added to its environment (an admin token, munge on)."""

    def __init__(self, root: Path, db: Path, workers: int, log: Path, extra_env: dict | None = None,
                 args: tuple[str, ...] = ()):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_PREDICTOR_")}
        env.update(ELASTIC_PREDICTOR_TOKEN=TOKEN, ELASTIC_PREDICTOR_DECISIONS_MAX_BYTES=str(DECISIONS_MAX_BYTES),
                   **(extra_env or {}))
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--db", str(db), "--workers", str(workers), *args],
                                     cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.workers = workers
        self.db = db

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Every worker answers from a model fitted on the current data (requests land on any worker)."""
        deadline = time.monotonic() + timeout_s
        fresh = 0
        while fresh < 4 * self.workers:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the service did not come up (see its log)")
            try:
                status, body = request(self.port, "GET", "/healthz", timeout=5)
                health = json.loads(body)
                fresh = fresh + 1 if status == 200 and health.get("model_generation") == health["generation"] else 0
            except (OSError, ValueError, http.client.HTTPException):
                fresh = 0
            time.sleep(0.2)

    def worker_pids(self) -> list[int]:
        tree = _children()
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            kids = tree.get(pid, [])
            if not kids and pid != self.proc.pid:
                out.append(pid)
            todo.extend(kids)
        return out

    def worker_rss_mb(self) -> float:
        return max((_rss_mb(pid) for pid in self.worker_pids()), default=0.0)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = REQUEST_TIMEOUT_S, source: str | None = None) -> tuple[int, bytes]:
    """One request on a fresh connection (``source``: the local address to send from, e.g. 127.0.0.2)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def db_mb(db: Path) -> float:
    return sum(p.stat().st_size for p in (db, Path(f"{db}-wal")) if p.exists()) / 2**20


# --- attacks ----------------------------------------------------------------------------------------------------
class Tally:
    """Status codes of an attack's requests (0: no answer: timeout or connection error)."""

    def __init__(self):
        self.codes: collections.Counter = collections.Counter()
        self.busy = 0          # 429s the service means (plot queue full, Retry-After), among `codes`
        self._lock = threading.Lock()

    def add(self, code: int, busy: bool = False) -> None:
        with self._lock:
            self.codes[code] += 1
            self.busy += busy

    @property
    def total(self) -> int:
        return sum(self.codes.values())

    @property
    def server_errors(self) -> int:
        return sum(n for code, n in self.codes.items() if code >= 500 or code == 0)

    def summary(self) -> str:
        return ", ".join(f"{code or 'no answer'}: {n}" for code, n in sorted(self.codes.items()))


def send(port: int, tally: Tally, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    try:
        status, answer = request(port, method, path, body, headers)
    except (OSError, http.client.HTTPException):
        status, answer = 0, b""
    tally.add(status, busy=status == 429 and b"too many plots" in answer)
    return status


def paced_plans(port: int, stop: threading.Event, latencies: list[float], statuses: list[int] | None = None) -> None:
    """POST /v1/plan at PLAN_RATE until `stop`, each timed from its scheduled send (its status, 0 for no answer,
    appended to `statuses` when given)."""
    body = json.dumps(PLAN).encode()
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(16) as pool:
        i = 0
        while not stop.is_set():
            scheduled = start + i / PLAN_RATE
            delay = scheduled - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

            def one(at=scheduled):
                try:
                    status = request(port, "POST", "/v1/plan", body)[0]
                except (OSError, http.client.HTTPException):
                    status = 0
                latencies.append(time.perf_counter() - at)
                if statuses is not None:
                    statuses.append(status)

            pool.submit(one)
            i += 1


def p99_ms(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000 if ordered else float("nan")


def plot_attack(service: Service, paths: list[str], seconds: float) -> tuple[Tally, float, int]:
    """Two clients GET `paths` (cycling) back to back for `seconds`, while /v1/plan is paced; returns the GETs'
    tally, the plans' p99 (ms) and how many plans were answered or timed."""
    tally, stop, latencies = Tally(), threading.Event(), []
    plans = threading.Thread(target=paced_plans, args=(service.port, stop, latencies))
    plans.start()
    counter = iter(range(10**9))
    lock = threading.Lock()

    def attacker():
        while not stop.is_set():
            with lock:
                path = paths[next(counter) % len(paths)]
            send(service.port, tally, "GET", path)

    attackers = [threading.Thread(target=attacker) for _ in range(2)]
    for thread in attackers:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in attackers + [plans]:
        thread.join()
    return tally, p99_ms(latencies), len(latencies)


def wide_predict(seed_: int, candidates: int, nodes: int) -> bytes:
    body = {"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 64,
            "candidates": [{"layout": [1 + (seed_ + c) % 8] * (nodes - (seed_ % 7)), "intra_link": "nvlink",
                            "inter_link": "ib"} for c in range(candidates)]}
    return json.dumps(body, separators=(",", ":")).encode()


def junk_reused(i: int) -> bytes:
    key = f"{i:06d}" + "x" * (3_900_000 - 6)
    return json.dumps({**PLAN, "reused": {key: 1}}).encode()


def padded_plan(i: int) -> bytes:
    return json.dumps({**PLAN, "job": {**PLAN["job"], "name": f"pad-{i}"}}).encode() + b" " * 3_900_000


def largest_plan(i: int) -> bytes:
    reused = {f"d-{10**17 + i * 5000 + k}": 2**31 for k in range(4096)}
    comment = "  # " + "x" * 3000
    directives = [line + comment for line in ("#ELASTIC model=resnet50", "#ELASTIC gpus=1-8", "#ELASTIC per_gpu_batch=64",
                                              "#ELASTIC min_efficiency=0.5", "#ELASTIC objective=throughput")]
    return json.dumps({**PLAN, "directives": directives, "reused": reused}).encode()


def sequential(service: Service, label: str, method: str, path: str, bodies, headers=None) -> dict:
    tally = Tally()
    rss_before, db_before = service.worker_rss_mb(), db_mb(service.db)
    for body in bodies:
        send(service.port, tally, method, path, body, headers)
    return {"attack": label, "tally": tally, "rss": (rss_before, service.worker_rss_mb()),
            "db": (db_before, db_mb(service.db)), "plan_p99": None}


def run(root: Path, workers: int, attack_s: float, work: Path) -> list[dict]:
    db = work / "hostile.db"
    seed(root, db)
    service = Service(root, db, workers, work / "serve.log")
    rows = []
    try:
        service.wait_ready()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        steps = [{"kind": "step", "profile": "resnet50", "gpu": f"G{i}", "layout": [1 + i % 4], "intra_link": "nvlink",
                  "per_gpu_batch": 64, "iter_s": 0.03 + i * 1e-5} for i in range(400)]
        status, answer = request(service.port, "POST", "/v1/observations", json.dumps(steps).encode(), auth)
        assert status == 201, answer[:300]
        service.wait_ready()
        for label, paths in (("GET /admin/plots/scaling.png, 2 clients back to back (400 GPU names)",
                              ["/admin/plots/scaling.png"]),
                             ("GET /admin/plots/scaling.png?gpu=G<i>, 2 clients over 400 names",
                              [f"/admin/plots/scaling.png?gpu=G{i}" for i in range(400)])):
            rss_before, db_before = service.worker_rss_mb(), db_mb(db)
            tally, p99, plans = plot_attack(service, paths, attack_s)
            rows.append({"attack": label, "tally": tally, "rss": (rss_before, service.worker_rss_mb()),
                         "db": (db_before, db_mb(db)), "plan_p99": (p99, plans)})
            print(rows[-1]["attack"], tally.summary(), f"plan p99 {p99:.1f} ms over {plans}", file=sys.stderr)
        rows.append(sequential(service, "POST /v1/predict, 320 candidates x 4096 nodes, distinct", "POST",
                               "/v1/predict", (wide_predict(i, 320, 4096) for i in range(80))))
        rows.append(sequential(service, "POST /v1/predict, 16 candidates x 4096 nodes (at the cap), distinct",
                               "POST", "/v1/predict", (wide_predict(i, 16, 4096) for i in range(80))))
        rows.append(sequential(service, "POST /v1/plan, 3.9 MB `reused` of junk keys", "POST", "/v1/plan",
                               (junk_reused(i) for i in range(150))))
        rows.append(sequential(service, "POST /v1/plan, valid plan + 3.9 MB whitespace", "POST", "/v1/plan",
                               (padded_plan(i) for i in range(150))))
        rows.append(sequential(service, "POST /v1/plan, largest valid (4096 reused ids, 15 KB of directive lines)", "POST",
                               "/v1/plan", (largest_plan(i) for i in range(200))))
        for row in rows[2:]:
            print(row["attack"], row["tally"].summary(), file=sys.stderr)
    finally:
        service.stop()
    return rows


def table(rows: list[dict]) -> str:
    out = ["| attack | requests | answers | 5xx or no answer (429 'too many plots', Retry-After, besides) | "
           "worker RSS MB before -> after | DB MB before -> after | /v1/plan p99 during (plans) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = "-" if r["plan_p99"] is None else f"{r['plan_p99'][0]:.1f} ms ({r['plan_p99'][1]})"
        out.append(f"| {r['attack']} | {r['tally'].total} | {r['tally'].summary()} | {r['tally'].server_errors} ({r['tally'].busy}) | "
                   f"{r['rss'][0]:.0f} -> {r['rss'][1]:.0f} | {r['db'][0]:.1f} -> {r['db'][1]:.1f} | {plan} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="checkout whose service is attacked (default: this one)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--attack-s", type=float, default=20.0, help="seconds each plot attack lasts")
    ap.add_argument("--label", default=None, help="what --root holds, printed in the header")
    ap.add_argument("--output", default=str(RESULTS / "hostile_clients.md"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    try:
        rows = run(root, args.workers, args.attack_s, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = (f"Hostile clients against `elastic-predictor serve` ({args.label or root}), gunicorn {args.workers} "
              f"worker(s) x 1 thread, defaults except ELASTIC_PREDICTOR_DECISIONS_MAX_BYTES=16 MiB; plot attacks "
              f"{args.attack_s:g} s each with /v1/plan paced at {PLAN_RATE:g}/s (timed from the scheduled send); "
              f"clients are threads on the same {len(os.sched_getaffinity(0))} cores; Python "
              f"{platform.python_version()}. 'no answer': timed out after {REQUEST_TIMEOUT_S:g} s or connection "
              "error.")
    text = header + "\n\n" + table(rows) + "\n"
    print(text)
    if not args.no_write:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "python bench/hostile_clients.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        out.write_text(f"# Hostile clients\n\nCommand: `{command.strip()}`\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
