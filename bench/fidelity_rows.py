"""Replay a fidelity run's Slurm rows (the JSON `compare` dumps: tests/integration/test_replay_fidelity.py) at
several release_s values, and with release_s fitted on them (the test's `fitted_release`): how many jobs agree one
by one and how far the average JCT is, per value. The right-sized rows are replayed as submitted at the sizes Slurm
ran them, which is what the hook chose.

    python bench/fidelity_rows.py RUN_DIR [RUN_DIR ...] [--release 0.3 0.5 0.7 1.0]

RUN_DIR holds plain.json (and sized.json): the fidelity test's tmp directory, e.g. its --basetemp's
test_slice_as_submitted_and_ri0.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from predictor.replay import Params, Replay  # noqa: E402
from tests.integration import test_replay_fidelity as F  # noqa: E402


def score(rows: dict, t0: float, jobs: list, cluster, truth, release: float) -> tuple[int, float]:
    sim = Replay(jobs, cluster, truth, "as-submitted", Params(release_s=release)).run(sample_s=60.0).jobs()
    agree = sum(not F.disagreeing(rows[j.name], sim[j.name], t0) for j in jobs)
    measured = np.mean([r["end"] - r["submit"] for r in rows.values()])
    return agree, float(np.mean([s["jct"] for s in sim.values()]) / measured - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--release", nargs="*", type=float, default=[0.3, 0.5, 0.7, 0.9, 1.1])
    args = ap.parse_args()
    truth = F.PolluxTruth()
    cluster = F.lab_cluster(4, 4)
    slice_jobs = F.make_slice(truth, F.SLICE_JOBS, 16)
    print("| run | rows | release_s | jobs agreeing | average JCT, simulated vs Slurm |\n|---|---|---|---|---|")
    for run in args.runs:
        for name in ("plain", "sized"):
            path = run / f"{name}.json"
            if not path.exists():
                continue
            dump = json.loads(path.read_text())
            rows, t0 = dump["slurm"], dump["t0"]
            jobs = F.as_run(rows, slice_jobs)
            fitted = F.fitted_release(rows, slice_jobs, truth, cluster)
            for release in [*args.release, fitted]:
                agree, jct = score(rows, t0, jobs, cluster, truth, release)
                tag = " (fitted on these rows)" if release == fitted else ""
                print(f"| {run} | {name} | {release:.2f}{tag} | {agree} / {len(jobs)} | {jct:+.1%} |", flush=True)

if __name__ == "__main__":
    main()
