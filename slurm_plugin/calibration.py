"""The calibration job's sbatch script (`elastic-predictor calibrate`, issue #38.2).

The job runs `python -m elastic_launcher.calibrate` on every rank under `srun` (its docstring says what it
measures and posts); this renders the script around it, here in the core so that both the service's CLI and the
lab's demo write the same one (docs/design.md, "Import order": neither may import the runtime's module for it).
"""
from __future__ import annotations

import shlex
import sys
from typing import Optional, Sequence

# The job's defaults (the CLI's and `python -m elastic_launcher.calibrate`'s): about a minute in all
SWEEP_BUDGET_S = 12.0     # seconds of each link's all-reduce sweep
ROUNDS = 7                # rounds of (plain, DDP) timing windows per probe and world size
WINDOW_S = 0.15           # target seconds of one timing window

def job_script(predictor: Optional[str], nodes: int, ranks_per_node: int, gpus_per_node: int,
               python: str = sys.executable, partition: Optional[str] = None, time_limit: str = "00:10:00",
               output: str = "elastic-calibrate-%j.out", out: Optional[str] = "elastic-calibrate-%j.jsonl",
               sweep_budget_s: float = SWEEP_BUDGET_S, rounds: int = ROUNDS, window_s: float = WINDOW_S,
               extra_sbatch: Sequence[str] = ()) -> str:
    """The calibration job's sbatch script (see the module docstring): `nodes` nodes of `ranks_per_node` ranks,
    one GPU each where `gpus_per_node` > 0, else CPU ranks with gloo."""
    lines = ["#!/bin/bash",
             "# elastic-predictor calibrate: all-reduce sweeps per link and DDP's host overhead (probe models",
             "# with and without DDP, at 1 and all ranks), posted to the prediction service signed for this job.",
             "#SBATCH --job-name=elastic-calibrate", f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={ranks_per_node}", f"#SBATCH --time={time_limit}",
             f"#SBATCH --output={output}"]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [f"#SBATCH {a}" for a in extra_sbatch]
    py = shlex.quote(python)
    argv = ["-m", "elastic_launcher.calibrate", "--device", "auto" if gpus_per_node else "cpu",
            "--sweep-budget-s", f"{sweep_budget_s:g}", "--rounds", str(rounds), "--window-s", f"{window_s:g}"]
    if predictor:
        argv += ["--predictor", predictor]
    if out:
        argv += ["--out", out.replace("%j", "${SLURM_JOB_ID}")]
    lines += ["set -eu",
              'export MASTER_ADDR="$(hostname)"',
              f'export MASTER_PORT="$({py} -m elastic_launcher.calibrate --free-port)"',
              f"srun --kill-on-bad-exit=1 {py} " + " ".join(map(_quote_keep_var, argv)),
              ""]
    return "\n".join(lines)


def _quote_keep_var(arg: str) -> str:
    """Shell-quote `arg`, leaving `${SLURM_JOB_ID}` to expand."""
    if "${SLURM_JOB_ID}" in arg:
        return '"' + arg.replace('"', '\\"') + '"'
    return shlex.quote(arg)
