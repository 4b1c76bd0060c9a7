"""Idle time of each elastic transition, next to checkpoint-and-restart of the same job (same run, same testbed).

    elastic-slurm testbed up --lab /var/tmp/lab-launch --port-base 18800
    python bench/launcher_transitions.py --lab /var/tmp/lab-launch --out bench/results/launcher_transitions.md

Elastic: one job (tests/integration/train_tiny.py, 1 CPU worker per node, 150 ms simulated device time per
step) starts on 2 nodes, grows to 4 with a helper job (autoscale), shrinks to 2 on `elastic-launch ctl`, and
loses node2's workers to SIGKILL. For each transition: `idle` = rank 0's gap between the last step before and
the first step after, minus one normal step (what the training lost); `pause` = the runtime's decision to end of
first new step (one step included); `wall` = the controller's request to first step; `slurm` = helper
allocation (grow) or node release (shrink), both off the training's critical path (the job trains on
meanwhile). An idle of 0.000 means the switch cost less than the step-time jitter (idle is clamped at 0).

Checkpoint-and-restart baseline: job A trains to step K on the old size and saves (rank 0, torch.save), job B
(`--dependency=afterok:A`) on the new size loads it and continues. `idle` = B's first step minus A's last,
minus one step; split into A's exit, Slurm starting B, and B's start-up (interpreters, imports, rendezvous,
load, first step).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from slurm_plugin.client import CommandBackend

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tests" / "integration" / "train_tiny.py"
DIRECTIVE = "#ELASTIC model=tiny gpus=1-8 per_gpu_batch=4 max_global_batch=64 min_efficiency=0.5"


def script(work: Path, name: str, nodes: int, steps: int, extra_launch: str = "", extra_train: str = "",
           dependency: int | None = None) -> str:
    dep = f"#SBATCH --dependency=afterok:{dependency}\n" if dependency else ""
    return f"""#!/bin/bash
#SBATCH --job-name={name} --nodes={nodes} --gres=gpu:1 --output={work}/{name}.out --chdir={work}
{dep}{DIRECTIVE}
export ELASTIC_LAUNCH_REGISTRY={work}/registry
exec {sys.executable} -m elastic_launcher.cli --script "$0" --workers-per-node 1 --run-dir {work}/{name} {extra_launch} \\
  -- {sys.executable} {TRAIN} --steps {steps} --compute-ms 150 --out {work}/{name}/samples {extra_train}
"""


def records(run: Path) -> list[dict]:
    path = run / "records.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait(fn, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"bench: timed out after {seconds:g} s waiting for {what}")


def transition(run: Path, action: str):
    return next((r for r in records(run) if r["kind"] == "transition" and r["action"] == action), None)


def done(slurm: CommandBackend, job: int) -> bool:
    try:
        return slurm.job(job).state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")
    except Exception:
        return True


def worker_pids(job: int, node: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if f"ELASTIC_JOB_ID={job}".encode() in env and f"ELASTIC_NODE={node}".encode() in env:
            out.append(int(entry.name))
    return out


def step_times(run: Path) -> dict[int, float]:
    """step -> the earliest time any rank logged it as committed."""
    times: dict[int, float] = {}
    for path in (run / "samples").glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            times[row["step"]] = min(times.get(row["step"], row["t"]), row["t"])
    return times


def median_step(times: dict[int, float]) -> float:
    steps = sorted(times)
    return statistics.median(times[b] - times[a] for a, b in zip(steps, steps[1:]) if b == a + 1)


def elastic_run(slurm: CommandBackend, work: Path) -> list[dict]:
    run = work / "elastic"
    job = slurm.submit(script(work, "elastic", 2, 450, "--measure-steps 8 --warmup-steps 2"))
    grow = wait(lambda: transition(run, "grow"), 180, "the grow")
    time.sleep(3)
    ctl = subprocess.run([sys.executable, "-m", "elastic_launcher.cli", "ctl", str(job), "--nodes", "2"],
                         env={**os.environ, "ELASTIC_LAUNCH_REGISTRY": str(work / "registry")},
                         capture_output=True, text=True, timeout=60)
    if ctl.returncode != 0:
        raise SystemExit(f"bench: ctl failed: {ctl.stderr}")
    shrink = wait(lambda: transition(run, "shrink"), 120, "the operator shrink")
    time.sleep(3)
    for pid in wait(lambda: worker_pids(job, "node2"), 10, "node2's workers"):
        os.kill(pid, signal.SIGKILL)
    failure = wait(lambda: transition(run, "failure"), 120, "the recovery")
    wait(lambda: done(slurm, job), 300, "the elastic job to finish")
    rows = []
    for rec, what in ((grow, "grow 2->4 (helper job)"), (shrink, "shrink 4->2 (ctl)"),
                      (failure, "node2 killed 2->1")):
        slurm_s = rec.get("allocate_s") if rec["action"] == "grow" else rec.get("release_s")
        rows.append({"transition": what, "mechanism": "elastic in-process", "idle_s": rec.get("idle_s"),
                     "step_s": (rec.get("stats") or {}).get("step_s"),
                     "pause_s": rec.get("pause_s"), "wall_s": rec.get("wall_s"), "slurm_s": slurm_s,
                     "detail": "" if rec["action"] != "failure" else "includes failure detection"})
    return rows


def restart_run(slurm: CommandBackend, work: Path, name: str, before: int, after: int, at: int) -> dict:
    ckpt = work / f"{name}.pt"
    first = slurm.submit(script(work, f"{name}-a", before, at, "--no-autoscale", f"--save {ckpt}"))
    second = slurm.submit(script(work, f"{name}-b", after, at + 30, "--no-autoscale", f"--resume {ckpt}",
                                 dependency=first))
    wait(lambda: done(slurm, first) and done(slurm, second), 300, f"the {name} restart pair")
    a, b = step_times(work / f"{name}-a"), step_times(work / f"{name}-b")
    if at not in a or at + 1 not in b:
        raise SystemExit(f"bench: restart pair {name} did not resume at step {at + 1} (see {work})")
    step = median_step(a)
    a_end = next(r["t"] for r in records(work / f"{name}-a") if r["kind"] == "end")
    b_start = next(r["t"] for r in records(work / f"{name}-b") if r["kind"] == "start")
    return {"transition": f"{'grow' if after > before else 'shrink'} {before}->{after}",
            "mechanism": "checkpoint-and-restart", "idle_s": round(b[at + 1] - a[at] - step, 3),
            "step_s": round(step, 3),
            "pause_s": None, "wall_s": None, "slurm_s": round(b_start - a_end, 3),
            "detail": f"save+exit {a_end - a[at]:.2f} s, Slurm starts B {b_start - a_end:.2f} s, "
                      f"B start-up+load+first step {b[at + 1] - b_start:.2f} s"}


def table(rows: list[dict]) -> str:
    def f(x):
        return "" if x is None else f"{x:.3f}"
    lines = ["| transition | mechanism | idle (s) | normal step (s) | runtime pause (s) | request to first step (s) "
             "| Slurm (s) | notes |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['transition']} | {r['mechanism']} | {f(r['idle_s'])} | {f(r['step_s'])} | {f(r['pause_s'])} "
              f"| {f(r['wall_s'])} "
              f"| {f(r['slurm_s'])} | {r['detail']} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lab", type=Path, default=Path(os.environ.get("ELASTIC_SLURM_LAB", "/var/tmp/elastic-slurm-lab")))
    p.add_argument("--work", type=Path, default=Path("/var/tmp/elastic-bench-launcher"))
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args()
    slurm = CommandBackend(slurm_conf=args.lab / "etc" / "slurm.conf",
                           env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    work = args.work / stamp
    work.mkdir(parents=True)
    rows = elastic_run(slurm, work)
    rows.append(restart_run(slurm, work, "restart-grow", 2, 4, 40))
    rows.append(restart_run(slurm, work, "restart-shrink", 4, 2, 40))
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            f"# Launcher transitions: idle time, elastic vs checkpoint-and-restart\n\n"
            f"Run {stamp} on the local Slurm 22.05 testbed (4 slurmd on one 2-core VM, CPU workers over gloo, "
            f"1 worker per node, 150 ms simulated device time per step; no GPU).\n"
            f"Command: `python bench/launcher_transitions.py --lab {args.lab} --out {args.out}`\n\n"
            f"{text}\n\n{__doc__.split(chr(10) + chr(10), 2)[2]}\n")


if __name__ == "__main__":
    main()
