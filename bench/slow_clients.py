"""Slow and idle clients against the served app (issue #14, item 3): does /v1/plan stay within the hook's 100 ms?

Run: `python bench/slow_clients.py [--servers nginx,gunicorn-sync,...] [--output bench/results/slow_clients.md]`

For each server option it starts the service the way `elastic-predictor serve` does (bench/service_bench.py's
`seed` and `start_server`: a temporary database with two profiles and a synthetic H200 history), then, for each
variant and K in {0, 2, 8, 200}, holds K misbehaving connections open while a polite client sends 200 POST
/v1/plan requests paced at 50/s (a new connection each, as the job_submit hook does; latency timed from the
scheduled send, so queueing counts; a request not answered within --probe-timeout counts at that value) and one
GET /healthz. The variants:
- `headers`: `POST /v1/plan HTTP/1.1` and one header line, then nothing (the headers are never finished);
- `body`: complete headers announcing a 100,000-byte body, then one body byte a second per connection;
- `unread`: a 1 KiB receive buffer, one `GET /v1/openapi.json` (a 43 KB answer) sent, the answer never read;
- `pipelined` (not a slow client but a flood, shown for what it is): the same with 64 requests pipelined on each
  connection, none read: up to K x 64 requests of work for a server that answers them while its socket buffers
  take the answers.
Every misbehaving connection comes from `SLOW_ADDRESS`, the probes from 127.0.0.1 (another client).
A connection the server closes (a deadline, a killed worker) is opened again at once, as a persistent slow
client would (column `reopened`), except `unread` and `pipelined`. Then, per server, the polite figures: bench/service_bench.py's
flat-out (8 client threads) and paced (200/s) runs, and the paced /v1/plan probes while observations are posted
once a second (the fitter worker refits on new data, at most every 5 s: what a fit does to the other requests).

Server options: `nginx` (`elastic-predictor serve`: nginx in front of gunicorn, predictor/front_nginx.py),
`gunicorn-sync` and `gunicorn-gthread` (gunicorn alone on the port, threads 1 / 4: the default before any front
end, and its threaded mode), `gunicorn-gevent` (gunicorn's gevent worker, monkey-patched) and `waitress` (one
process, 8 threads, connection_limit 1000): all but nginx are started by this script (`--serve-as`), they are not
options of `serve`; gevent and waitress are not dependencies of the package (`pip install gevent waitress` to
measure them, or leave them out of --servers). The buffered asyncio front end measured in earlier results
(predictor/server.py) was deleted in #46.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import platform
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from service_bench import bodies, run as polite_run, seed, start_server  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BUDGET_MS = 100.0
KS = (0, 2, 8, 200)
VARIANTS = ("headers", "body", "unread", "pipelined")
PROBES = 200
RATE = 50.0
# the misbehaving connections' own address: the probes (127.0.0.1) are another client. nginx caps each address's
# connections and requests in progress (a body still arriving holds its own address's slots, #41.5), so a probe
# from the slow clients' own address would measure that address's cap, not what they do to everyone else
SLOW_ADDRESS = "127.0.0.9"
PLAN = {"source": "job_submit", "job": {"min_nodes": 1, "tres_per_node": "gres:gpu:4", "partition": "debug",
                                        "user": "bench"},
        "directives": ["#ELASTIC model=resnet50 gpus=1-8", "#ELASTIC per_gpu_batch=64"]}

SELF = [sys.executable, str(Path(__file__).resolve()), "--serve-as"]
SERVERS = {
    # name: (launcher or None for `elastic-predictor serve`, extra options, threads)
    "nginx": (None, (), 1),
    "gunicorn-sync": ([*SELF, "gunicorn"], (), 1),
    "gunicorn-gthread": ([*SELF, "gunicorn"], (), 4),
    "gunicorn-gevent": ([*SELF, "gevent"], (), 1),
    "waitress": ([*SELF, "waitress"], (), 8),
}


# ---------------------------------------------------------------------------------------------------------------
# the candidates serve itself does not offer
def serve_as(kind: str, argv: list[str]) -> None:
    """Run the app under gunicorn alone (sync or gthread workers), gevent workers or waitress, with `serve`'s
    options (--host --port --db --workers --threads)."""
    ap = argparse.ArgumentParser()
    for name in ("--host", "--db"):
        ap.add_argument(name)
    for name in ("--port", "--workers", "--threads"):
        ap.add_argument(name, type=int)
    args = ap.parse_args(argv)
    from predictor.app import create_app
    from predictor.cli import _config, _open_store

    config = _config(args.db)
    _open_store(config.db_path, writable=True).close()
    if kind in ("gunicorn", "gevent"):
        from predictor.front_nginx import gunicorn_application

        gunicorn_application(lambda: create_app(config), bind=f"{args.host}:{args.port}", workers=args.workers,
                             threads=args.threads if kind == "gunicorn" else 1, timeout=30,
                             worker_class="gevent" if kind == "gevent" else None).run()
    elif kind == "waitress":
        import waitress

        waitress.serve(create_app(config), host=args.host, port=args.port, threads=args.threads,
                       connection_limit=1000, channel_timeout=120, _quiet=True)
    else:
        raise SystemExit(f"unknown --serve-as {kind}")


# ---------------------------------------------------------------------------------------------------------------
class Holders:
    """K misbehaving connections, kept open (reopened when the server closes one) by one thread."""

    def __init__(self, port: int, variant: str, count: int):
        self.port, self.variant, self.count = port, variant, count
        self.socks: dict[socket.socket, int] = {}      # socket -> body bytes sent
        self.reopened = 0
        self.failed_opens = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        sock = socket.socket()
        if self.variant in ("unread", "pipelined"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.settimeout(2)
        try:
            sock.bind((SLOW_ADDRESS, 0))
            sock.connect(("127.0.0.1", self.port))
            if self.variant == "headers":
                sock.sendall(b"POST /v1/plan HTTP/1.1\r\nHost: x\r\n")
            elif self.variant == "body":
                sock.sendall(b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100000\r\n\r\n{")
            else:
                sock.sendall(b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * (64 if self.variant == "pipelined" else 1))
        except OSError:
            self.failed_opens += 1
            sock.close()
            return
        sock.setblocking(False)
        self.socks[sock] = 1

    def start(self) -> "Holders":
        for _ in range(self.count):
            self._open()
        self._thread.start()
        return self

    def _run(self) -> None:
        last_byte = time.monotonic()
        while not self._stop.wait(0.1):
            if self.variant in ("unread", "pipelined"):
                continue
            sel = selectors.DefaultSelector()
            for sock in self.socks:
                sel.register(sock, selectors.EVENT_READ)
            closed = set()
            for key, _ in sel.select(0):
                try:
                    data = key.fileobj.recv(65536)
                except OSError:
                    data = b""
                if not data or data.startswith(b"HTTP/"):     # closed, or answered (a 408): the server let go
                    closed.add(key.fileobj)
            sel.close()
            if self.variant == "body" and time.monotonic() - last_byte >= 1.0:
                last_byte = time.monotonic()
                for sock in self.socks:
                    if sock in closed:
                        continue
                    try:
                        sock.send(b" ")
                        self.socks[sock] += 1
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError:
                        closed.add(sock)
            for sock in closed:
                del self.socks[sock]
                sock.close()
                self.reopened += 1
                self._open()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for sock in self.socks:
            sock.close()
        self.socks.clear()


# ---------------------------------------------------------------------------------------------------------------
def probe_plan(port: int, body: bytes, timeout: float) -> float | None:
    """One POST /v1/plan on a new connection; seconds, or None when it failed or timed out."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/plan", body, {"Content-Type": "application/json", "Connection": "close"})
        response = conn.getresponse()
        response.read()
        return 0.0 if response.status == 200 else None
    except (http.client.HTTPException, OSError):
        return None
    finally:
        conn.close()


def probes(port: int, timeout: float, health_timeout: float, writes: bool = False) -> dict:
    """PROBES paced /v1/plan requests (+ one /healthz at the start; + an observation a second with `writes`)."""
    body = json.dumps(PLAN).encode()
    latencies: list[float] = []
    failed = [0]
    lock = threading.Lock()
    start = time.perf_counter() + 0.05
    health: dict = {}

    def one(i: int) -> None:
        scheduled = start + i / RATE
        delay = scheduled - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        ok = probe_plan(port, body, timeout)
        elapsed = time.perf_counter() - scheduled
        with lock:
            if ok is None:
                failed[0] += 1
                latencies.append(max(elapsed, timeout))
            else:
                latencies.append(elapsed)

    def healthz() -> None:
        t0 = time.perf_counter()
        try:
            status = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=health_timeout).status_code
        except requests.RequestException:
            status = None
        health.update(status=status, seconds=time.perf_counter() - t0)

    def writer() -> None:
        seq = 0
        while time.perf_counter() < start + PROBES / RATE:
            seq += 1
            record = {"kind": "collective", "op": "allreduce", "link": "nvlink", "world": 4, "bytes": 1 << 20,
                      "seconds": 0.001 + seq * 1e-6, "gpu": "H200", "source": f"bench-{seq}"}
            try:
                requests.post(f"http://127.0.0.1:{port}/v1/observations", json=[record], timeout=10,
                              headers={"Authorization": "Bearer bench"})
            except requests.RequestException:
                pass
            time.sleep(1.0)

    side = [threading.Thread(target=healthz, daemon=True)]
    if writes:
        side.append(threading.Thread(target=writer, daemon=True))
    for t in side:
        t.start()
    with cf.ThreadPoolExecutor(128) as pool:
        list(pool.map(one, range(PROBES)))
    side[0].join(health_timeout + 1)
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return {"p50": pct(0.50), "p99": pct(0.99), "max": ordered[-1] * 1000,
            "over": sum(1 for x in ordered if x * 1000 > BUDGET_MS), "failed": failed[0],
            "health_s": health.get("seconds"), "health_status": health.get("status")}


def recover(port: int, limit: float = 90.0) -> None:
    """Wait until /healthz answers quickly again (a stalled server drains once the slow connections are gone)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200 and \
                    time.monotonic() - t0 < 0.2:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)


def fmt_ms(value: float, timeout: float) -> str:
    return f">= {timeout * 1000:.0f}" if value >= timeout * 1000 else f"{value:.1f}"


def bench_server(name: str, db: str, workers: int, probe_timeout: float, health_timeout: float, ks, variants,
                 polite: int, log) -> tuple[list[dict], list[dict]]:
    launcher, extra, threads = SERVERS[name]
    proc, base = start_server(db, workers, threads, True, tuple(extra), launcher, log=log)
    port = int(base.rsplit(":", 1)[1])
    rows, polite_rows = [], []
    try:
        names = ["resnet50", "bert-base-uncased"]
        work = [(path, json.dumps(body).encode()) for path, body in bodies(names)]
        polite_run(base, work, 200, 8, None)      # warm-up
        cases = [("-", 0)] if 0 in ks else []
        cases += [(v, k) for v in variants for k in ks if k]
        for variant, k in cases:
            holders = Holders(port, variant, k).start() if k else None
            time.sleep(1.0 if k else 0.0)          # let them land (and stall what they stall)
            result = probes(port, probe_timeout, health_timeout)
            if holders:
                held = len(holders.socks)
                holders.stop()
                result.update(reopened=holders.reopened, held=held, failed_opens=holders.failed_opens)
            rows.append({"server": name, "variant": variant, "k": k, **result})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            recover(port)
        if polite:
            for label, clients, rate in (("flat out", 8, None), ("paced 200/s", 4, 200.0)):
                r = polite_run(base, work, polite, clients, rate)
                polite_rows.append({"server": name, "scenario": label, **r})
                print(json.dumps(polite_rows[-1]), file=sys.stderr, flush=True)
            before = requests.get(f"{base}/healthz", timeout=10).json().get("model_generation")
            w = probes(port, probe_timeout, health_timeout, writes=True)
            time.sleep(3.0)                        # the last write's refit
            after = requests.get(f"{base}/healthz", timeout=10).json().get("model_generation")
            polite_rows.append({"server": name, "scenario": "plan probes 50/s + 1 write/s", "plan": w,
                                "model": f"g{before} -> g{after}"})
            print(json.dumps(polite_rows[-1]), file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:  # noqa: BLE001
            proc.kill()
            proc.wait(10)
    return rows, polite_rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-as"]:
        serve_as(argv[1], argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--probe-timeout", type=float, default=2.0, help="a /v1/plan probe not answered by then fails")
    ap.add_argument("--health-timeout", type=float, default=40.0)
    ap.add_argument("--polite", type=int, default=1000, help="requests per polite row (0: none)")
    ap.add_argument("--output", default=None, help="also write the tables (markdown) to this file")
    ap.add_argument("--log", default=None, help="the servers' output goes here (default: discarded)")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    variants = args.variants.split(",")
    rows, polite_rows = [], []
    log = open(args.log, "ab") if args.log else None
    started = time.time()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "bench.db")
        seed(db)
        for name in args.servers.split(","):
            r, p = bench_server(name, db, args.workers, args.probe_timeout, args.health_timeout, ks, variants,
                                args.polite, log or subprocess.DEVNULL)
            rows += r
            polite_rows += p
    t = args.probe_timeout
    lines = [f"{PROBES} POST /v1/plan probes paced at {RATE:g}/s (new connection each; latency from the scheduled "
             f"send; a probe unanswered after {t:g} s counts as {t * 1000:.0f} ms and `failed`), one GET /healthz "
             f"(timeout {args.health_timeout:g} s) at the start, while K slow connections are held. {args.workers} "
             f"gunicorn workers where the server has workers. {len(os.sched_getaffinity(0))} usable cores, Python "
             f"{platform.python_version()}, {date.today().isoformat()}, {time.time() - started:.0f} s in all; load average "
             f"(1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after.", "",
             f"| server | variant | K | plan p50 ms | plan p99 ms | plan max ms | > {BUDGET_MS:.0f} ms | failed | "
             "/healthz s | reopened |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hs = r["health_s"]
        health = "-" if hs is None else (f"> {args.health_timeout:g} (timeout)" if r["health_status"] is None
                                         else f"{hs:.3f}")
        lines.append(f"| {r['server']} | {r['variant']} | {r['k']} | {fmt_ms(r['p50'], t)} | {fmt_ms(r['p99'], t)} | "
                     f"{fmt_ms(r['max'], t)} | {r['over']} | {r['failed']} | {health} | {r.get('reopened', '-')} |")
    if polite_rows:
        lines += ["", "Polite load, no slow connections (bench/service_bench.py's run: half /v1/predict, half "
                  "/v1/plan, cache on; flat out = 8 client threads; paced = 4 threads at 200/s, latency from the "
                  "scheduled send); and the /v1/plan probes above while an observation is posted every second "
                  "(the fitter worker refits on new data, at most every 5 s: a fit lands in the 4 s window; `model "
                  "gA -> gB` is the version answered before and 3 s after).", "",
                  "| server | scenario | requests | req/s | p50 ms | p99 ms | max ms | errors |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in polite_rows:
            if "plan" in r:
                w = r["plan"]
                lines.append(f"| {r['server']} | {r['scenario']} (model {r['model']}) | "
                             f"{PROBES} | {RATE:g} | {fmt_ms(w['p50'], t)} | {fmt_ms(w['p99'], t)} | "
                             f"{fmt_ms(w['max'], t)} | {w['failed']} (> {BUDGET_MS:.0f} ms: {w['over']}) |")
            else:
                lines.append(f"| {r['server']} | {r['scenario']} | {r['requests']} | {r['req_s']:.0f} | "
                             f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.1f} | {r['errors']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        command = "python bench/slow_clients.py " + " ".join(argv)
        Path(args.output).write_text(f"# Slow and idle clients (issue #14, item 3)\n\nCommand: `{command.strip()}`"
                                     f"\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
