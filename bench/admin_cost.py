"""/admin, /healthz and /metrics against a store of many observation rows (#41.3: /admin went from 59 ms to 1.9 s
after one job's 102,400 collective rows; target: /admin p50 < 100 ms with 1,000,000 rows).

Run: `python bench/admin_cost.py [--rows 1000000] [--db PATH] [--requests 30] [--output FILE]`

It fills a store through `Store.write_observations` (batches of 4096 rows, the API's bound: half step rows of one
profile over 6 layouts, half collectives over 2 links), unless `--db` names one already filled, then times GET
/admin (a fresh render each time: the page cache is cleared before every request), /healthz and /metrics through
the Flask app of the code on PYTHONPATH (no model is fitted: the model terms of the page do not grow with the rows).
For a before/after pair, run it with PYTHONPATH on an export of the older commit against the same `--db` first
(the newer code then builds its summary once, at its migration: that time is printed too).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

LAYOUTS = ([1], [2], [4], [2, 2], [4, 4], [4, 4, 4, 4])
BATCH = 4096


def fill(db: str, rows: int) -> float:
    from predictor.store import Store

    store = Store(db)
    store.migrate()
    t0 = time.perf_counter()
    written = 0
    while written < rows:
        batch = []
        for i in range(min(BATCH, rows - written)):
            n = written + i
            if n % 2:
                layout = LAYOUTS[n % len(LAYOUTS)]
                row = {"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": layout,
                       "intra_link": "nvlink", "per_gpu_batch": 64, "iter_s": 0.03 * (1 + 0.001 * (n % 97)),
                       "job_id": 1000 + n // 10000}
                if len(layout) > 1:
                    row["inter_link"] = "ib"
            else:
                row = {"kind": "collective", "op": "allreduce", "link": ("ib", "nvlink")[n % 4 == 0], "world": 8,
                       "bytes": 1 << (20 + n % 6), "seconds": 1e-4 * (1 + n % 13), "job_id": 1000 + n // 10000}
            batch.append(row)
        store.write_observations(batch)
        written += len(batch)
    store.close()
    return time.perf_counter() - t0


def timed(client, path: str, count: int, before=None) -> list[float]:
    out = []
    for _ in range(count):
        if before:
            before()
        t0 = time.perf_counter()
        response = client.get(path)
        out.append(time.perf_counter() - t0)
        assert response.status_code == 200, (path, response.status_code, response.get_data(as_text=True)[:300])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--db", default=None, help="a store to use (filled with --rows when it does not exist yet)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args(argv)
    import tempfile

    from predictor.app import create_app
    from predictor.config import Config

    db = args.db or str(Path(tempfile.mkdtemp(prefix="admin-cost-")) / "h.db")
    fill_s = fill(db, args.rows) if not Path(db).exists() else None
    t0 = time.perf_counter()
    app = create_app(Config(db_path=db), start_refit=False)   # migrates (the summary, once, on newer code)
    open_s = time.perf_counter() - t0
    client = app.test_client()
    pages = app.extensions.get("elastic_predictor_admin_pages")

    def fresh():
        cache = app.extensions.get("elastic_predictor_admin_pages")
        if cache:
            cache[0].clear()

    load = os.getloadavg()[0]
    results = {path: timed(client, path, args.requests, fresh if path == "/admin" else None)
               for path in ("/admin", "/healthz", "/metrics")}
    counts = json.loads(client.get("/healthz").get_data())["observations"]
    app.extensions["elastic_predictor"].plots.stop()
    lines = [f"{args.rows if fill_s is not None else sum(counts.values())} observation rows ({counts}); "
             + (f"filled in {fill_s:.0f} s; " if fill_s is not None else "")
             + f"app start (migrations) {open_s:.1f} s; {args.requests} requests each, load average {load:.2f}, "
             f"Python {platform.python_version()}, {date.today().isoformat()}", "",
             "| request | p50 ms | p90 ms | max ms |", "|---|---:|---:|---:|"]
    for path, seconds in results.items():
        ordered = sorted(seconds)
        lines.append(f"| GET {path} | {statistics.median(ordered) * 1000:.1f} | "
                     f"{ordered[int(0.9 * (len(ordered) - 1))] * 1000:.1f} | {ordered[-1] * 1000:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)
    del pages
    return 0


if __name__ == "__main__":
    sys.exit(main())
