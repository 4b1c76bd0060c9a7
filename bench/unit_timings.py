"""Times that unit tests used to assert on (issue #15), measured here instead, on CPU, without Slurm:

    hook      one `slurm_job_submit` call of job_submit.lua (lua5.1, stub `slurm` table, budget 100 ms, breaker
              never opening) against the fake predictor of tests/unit/test_lua_hook.py in each failure mode:
              the call must end near the budget whatever the service does (was: elapsed < 0.15 s in
              test_service_failure_accepts_unchanged_within_budget)
    watchdog  a peer stops beating (heartbeat timeout 0.3 s): the delay from its stop to the watcher's report
              (was: < 2.0 s in test_peer_watchdog.py::test_a_peer_that_stops_beating_is_reported_once_per_epoch)
    abort     aborting a gloo group with an unmatched allreduce pending (collective timeout 2 s): how long abort
              takes, and the longest stall of another thread meanwhile (was: < 0.5 s and < 1.0 s in
              test_runtime_units.py::test_abort_never_tears_a_gloo_group_down_on_the_caller)

The survivors' pause on a grow whose newcomers warm up late (was: pause_s < 1.5 in test_runtime_elastic.py)
is reported by bench/gpu_transition.py (`--device cpu --models tiny` on CPU).

Usage: python bench/unit_timings.py [--reps 20] [--out bench/results/unit_timings.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastic_launcher.process_group import ProcessGroupWrapper, release_retired  # noqa: E402
from tests.unit.test_lua_hook import Predictor, install, job, kinds, run_hook  # noqa: E402
from tests.unit.test_peer_watchdog import _three  # noqa: E402

BUDGET_MS = 100
HOOK_MODES = ["500", "garbage", "badnodes", "sleep", "drip", "down"]


def _stats(xs: list[float], scale: float = 1000.0) -> tuple[str, str, str]:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]
    return f"{statistics.median(xs) * scale:.2f}", f"{p90 * scale:.2f}", f"{xs[-1] * scale:.2f}"


def hook_calls(reps: int) -> dict[str, list[float]]:
    """Seconds per call, one lua5.1 process per mode (module state as in slurmctld)."""
    server = Predictor()
    out = {}
    try:
        for mode in HOOK_MODES:
            with tempfile.TemporaryDirectory() as tmp:
                url = "http://127.0.0.1:9" if mode == "down" else server.url
                conf = install(Path(tmp), url, budget_ms=BUDGET_MS, failures=10 ** 6)
                results = run_hook(conf, [{"job_desc": job("rewrite" if mode == "down" else mode)}] * reps)
            for r in results:
                [msg] = kinds(r, "user_msg")
                assert r["rc"] == 0 and msg.startswith("elastic: prediction skipped ("), (mode, msg)
            out[mode] = [r["elapsed"] for r in results]
    finally:
        server.close()
    return out


def watchdog_delays(reps: int) -> list[float]:
    """Seconds from a peer's last beat (its stop) to the watcher's report."""
    delays = []
    for _ in range(reps):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        reported = threading.Event()
        at: list[float] = []

        def report(epoch, reason, at=at, reported=reported):
            at.append(time.monotonic())
            reported.set()

        plan, a, b, c = _three(store, report)
        try:
            time.sleep(0.5)
            assert not at, "reported while everyone beats"
            t0 = time.monotonic()
            c.stop()
            assert reported.wait(10), "no report within 10 s"
            delays.append(at[0] - t0)
        finally:
            a.stop(), b.stop(), c.stop()
            del store
    return delays


def gloo_aborts(reps: int) -> tuple[list[float], list[float]]:
    """(abort seconds, the longest gap of a 10 ms ticker thread meanwhile) per repetition."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    took, stalls = [], []
    for i in range(reps):
        w = ProcessGroupWrapper("gloo", timeout=timedelta(seconds=2), connect_timeout=timedelta(seconds=5))
        peer = ProcessGroupWrapper("gloo", timeout=timedelta(seconds=2), connect_timeout=timedelta(seconds=5))
        t = threading.Thread(target=peer.configure, args=(f"127.0.0.1:{store.port}/bench{i}", 1, 2))
        t.start()
        w.configure(f"127.0.0.1:{store.port}/bench{i}", 0, 2)
        t.join()
        w.allreduce([torch.ones(1)])  # unmatched: the peer never joins it
        ticks: list[float] = []
        stop = threading.Event()
        ticker = threading.Thread(target=lambda: [ticks.append(time.monotonic())
                                                  for _ in iter(lambda: stop.wait(0.01), True)])
        ticker.start()
        t0 = time.monotonic()
        w.abort()
        peer.abort()
        took.append(time.monotonic() - t0)
        time.sleep(0.3)
        stop.set()
        ticker.join()
        stalls.append(max(b - a for a, b in zip(ticks, ticks[1:])))
        assert release_retired(timedelta(seconds=10))
    return took, stalls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, help="also write the markdown table here")
    args = ap.parse_args()

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    hook = hook_calls(args.reps)
    delays = watchdog_delays(max(3, args.reps // 2))
    took, stalls = gloo_aborts(max(3, args.reps // 2))

    lines = [f"# unit_timings: times the unit tests no longer assert on ({platform.node()}, {os.cpu_count()} cores, "
             f"load average {load:.2f} at the start, {started})", "",
             f"Run: `python bench/unit_timings.py --reps {args.reps}`.", "",
             "| what | n | median ms | p90 ms | max ms | reference |", "|---|---:|---:|---:|---:|---|"]
    for mode, xs in hook.items():
        lines.append(f"| job_submit.lua call, service {mode} | {len(xs)} | {' | '.join(_stats(xs))} | "
                     f"budget {BUDGET_MS} ms |")
    lines.append(f"| peer watchdog: stop to report | {len(delays)} | {' | '.join(_stats(delays))} | "
                 "heartbeat timeout 300 ms |")
    lines.append(f"| gloo abort with an allreduce pending | {len(took)} | {' | '.join(_stats(took))} | "
                 "collective timeout 2000 ms |")
    lines.append(f"| longest stall of another thread during it | {len(stalls)} | {' | '.join(_stats(stalls))} | "
                 "ticker every 10 ms |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
