"""What a restart resize costs (#43): an unchanged torchrun script under `elastic-launch --restart` on the testbed.

    elastic-slurm testbed up --lab /var/tmp/lab-restart --port-base 17100
    python bench/restart_cost.py --lab /var/tmp/lab-restart --out bench/results/restart_cost.md

One job (elastic_launcher.examples.plain_train, the torchrun-restart template's script: 1 CPU worker a node, gloo,
a linear model, 100 ms of sleep a step standing in for compute, DCP checkpoints) starts on 1 node and is resized by
`elastic-launch ctl` through `--schedule` (default 2,4,2,1), `--rounds` times. For each resize the launcher's
record gives: `cost` = its SIGUSR1 to the first step at the new size (what /v1/plan prices the next resize with),
`checkpoint` = SIGUSR1 to the script's checkpoint (the change waits for it), `restart` = the rest (grow: helper job
start, torchrun agent start, rendezvous, workers' start and checkpoint load; shrink: the helper's end, the
survivors' failure detection, the leaver's heartbeat expiry, then the same restart), `redone` = steps trained at the
old size after the checkpoint the restart resumed from (trained again). The raw records and the job's output go
to `--raw` (default bench/results/restart_cost/).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from launcher_transitions import records, wait  # bench/: the script's folder, first on sys.path
from slurm_plugin.client import CommandBackend
from slurm_plugin.lab.testbed_conf import DEFAULT_LAB

ROOT = Path(__file__).resolve().parent.parent


def job_script(work: Path, step_s: float) -> str:
    train = [sys.executable, "-m", "elastic_launcher.examples.plain_train", "--steps", "1000000", "--checkpoint-dir",
             "ck", "--checkpoint-every", "100", "--resume", "--log-every", "1", "--step-s", f"{step_s:g}"]
    launch = [sys.executable, "-m", "elastic_launcher.cli", "--script", "$0", "--workers-per-node", "1", "--run-dir",
              "run", "--registry", "reg", "--checkpoint-dir", "ck", "--checkpoint-timeout", "30", "--no-autoscale"]
    return "\n".join([
        "#!/bin/bash", "#SBATCH --job-name=restart-cost", "#SBATCH --nodes=1", "#SBATCH --time=00:30:00",
        f"#SBATCH --output={work}/job-%j.out", f"#SBATCH --chdir={work}", "#ELASTIC gpus=1-4 mode=restart",
        f"export PYTHONPATH={shlex.quote(str(ROOT))}",
        " ".join('"$0"' if a == "$0" else shlex.quote(a) for a in launch) + " -- " + shlex.join(train)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", type=Path, default=Path(os.environ.get("ELASTIC_SLURM_LAB", str(DEFAULT_LAB))))
    parser.add_argument("--schedule", default="2,4,2,1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "restart_cost.md")
    parser.add_argument("--raw", type=Path, default=ROOT / "bench" / "results" / "restart_cost")
    args = parser.parse_args()
    env = dict(os.environ, SLURM_CONF=str(args.lab / "etc" / "slurm.conf"))
    slurm = CommandBackend(slurm_conf=args.lab / "etc" / "slurm.conf", env=env)
    work = Path(tempfile.mkdtemp(prefix="restart-cost-"))
    script = work / "job.sbatch"
    script.write_text(job_script(work, args.step_s))
    job = slurm.submit(script)
    schedule = [int(n) for n in args.schedule.split(",")] * args.rounds
    load = [os.getloadavg()[0]]
    try:
        first = work / "run" / f"worker-j{job}-node1-g1.log"
        wait(lambda: first.exists() and b"step 30/" in first.read_bytes(), 180, "the first steps")
        for i, nodes in enumerate(schedule):
            out = subprocess.run([sys.executable, "-m", "elastic_launcher.cli", "ctl", str(job), "--nodes", str(nodes),
                                  "--registry", str(work / "reg")], capture_output=True, text=True, timeout=60, env=env)
            print(f"ctl --nodes {nodes}: {out.stdout.strip() or out.stderr.strip()}", flush=True)
            wait(lambda: sum(r["kind"] in ("transition", "resize_failed") for r in records(work / "run")) > i, 300,
                 f"resize {i + 1} to {nodes} nodes")
            load.append(os.getloadavg()[0])
            time.sleep(3)   # a few steps at the new size
    finally:
        slurm.cancel(job)
        wait(lambda: slurm.job(job).state not in ("RUNNING", "COMPLETING", "PENDING"), 60, "the job's end")
    moves = [r for r in records(work / "run") if r["kind"] in ("transition", "resize_failed")]
    rows = ["| # | resize | cost (s) | checkpoint (s) | restart (s) | redone steps | checkpointed |",
            "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(moves, 1):
        if r["kind"] != "transition":
            rows.append(f"| {i} | failed: {r.get('error')} | | | | | |")
            continue
        rows.append(f"| {i} | {r['from_nodes']} -> {r['to_nodes']} | {r['cost_s']:.2f} | {r['checkpoint_s']:.2f} | "
                    f"{r['cost_s'] - r['checkpoint_s']:.2f} | {r['steps_redone']} | {r['checkpointed']} |")
    grows = [r["cost_s"] for r in moves if r["kind"] == "transition" and r["to_nodes"] > r["from_nodes"]]
    shrinks = [r["cost_s"] for r in moves if r["kind"] == "transition" and r["to_nodes"] < r["from_nodes"]]
    summary = (f"grow cost median {statistics.median(grows):.2f} s (range {min(grows):.2f}-{max(grows):.2f}, "
               f"{len(grows)} resizes); shrink cost median {statistics.median(shrinks):.2f} s (range "
               f"{min(shrinks):.2f}-{max(shrinks):.2f}, {len(shrinks)} resizes)") if grows and shrinks else "incomplete"
    text = "\n".join([f"# Restart resize cost on CPU (#43), {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "",
                      f"`python bench/restart_cost.py --schedule {args.schedule} --rounds {args.rounds} --step-s "
                      f"{args.step_s:g}`; testbed {args.lab.name} (Slurm, 1 CPU worker a node, gloo), step "
                      f"{args.step_s * 1000:.0f} ms of sleep + a linear model; load average over the run "
                      f"{min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores.", "", *rows, "", summary, ""])
    print(text)
    args.out.write_text(text)
    args.raw.mkdir(parents=True, exist_ok=True)
    shutil.copy(work / "run" / "records.jsonl", args.raw / "records.jsonl")
    for path in sorted(work.glob("job-*.out")):
        shutil.copy(path, args.raw / "job.out")
    return 0 if "incomplete" not in summary else 1


if __name__ == "__main__":
    sys.exit(main())
