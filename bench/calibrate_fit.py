"""What calibration jobs' rows say: the host constants `predictor.stepmodel.host_cost_from_probes` fits on each
job's `ddp_overhead` rows (all rows, and each world size alone), beside an unbounded least squares that adds a
per-byte term (the bounded fit has none: on CPU, DDP's copies of each gradient into its bucket and back are host
work), and each job's wall time.

    python bench/calibrate_fit.py elastic-calibrate-3.jsonl elastic-calibrate-4.jsonl ... [--elapsed 3=77,4=80]

Each file is the `--rows` file of one `elastic-predictor calibrate` job (rank 0 writes it); `--elapsed` adds
the jobs' wall times as sacct printed them (seconds). Prints one table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor.stepmodel import host_cost_from_probes  # noqa: E402


def lstsq_with_bytes(rows: list[dict]) -> tuple[float, ...]:
    """Unbounded least squares of extra_s = c_step + c_bucket m + c_tensor n + c_byte bytes (needs 4 shapes)."""
    A = np.array([[1.0, r["buckets"], r["tensors"], r["bytes"]] for r in rows])
    y = np.array([r["extra_s"] for r in rows])
    return tuple(np.linalg.lstsq(A, y, rcond=None)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", type=Path)
    ap.add_argument("--elapsed", default="", help="JOB=SECONDS,... (sacct's Elapsed of each job)")
    args = ap.parse_args()
    elapsed = dict(kv.split("=") for kv in args.elapsed.split(",") if kv)
    print(f"{'job':>5} {'rows':>9} {'wall_s':>6}  {'worlds':<6} {'c_step ms':>9} {'c_bucket us':>11} "
          f"{'c_tensor us':>11}   | unbounded with bytes: {'c_step ms':>9} {'c_bucket us':>11} {'c_tensor us':>11} "
          f"{'c_byte ns/B':>11}")
    for path in args.rows:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        probes = [r for r in rows if r["kind"] == "ddp_overhead"]
        job = str(probes[0].get("job_id", "?")) if probes else "?"
        counts = f"{sum(r['kind'] == 'collective' for r in rows)}c+{len(probes)}p"
        for label, subset in (("all", probes), *((f"{w}", [r for r in probes if r["world"] == w])
                                                   for w in sorted({r["world"] for r in probes}))):
            fit = host_cost_from_probes(subset)
            for gpu, cost in fit.items():
                free = lstsq_with_bytes(subset) if len({(r["buckets"], r["tensors"], r["bytes"])
                                                        for r in subset}) >= 4 else (float("nan"),) * 4
                print(f"{job:>5} {counts:>9} {elapsed.get(job, '-'):>6}  {label:<6} {cost.c_step * 1e3:9.3f} "
                      f"{cost.c_bucket * 1e6:11.2f} {cost.c_tensor * 1e6:11.3f}   | {'':21} {free[0] * 1e3:9.3f} "
                      f"{free[1] * 1e6:11.2f} {free[2] * 1e6:11.3f} {free[3] * 1e9:11.3f}   ({gpu})")


if __name__ == "__main__":
    main()
