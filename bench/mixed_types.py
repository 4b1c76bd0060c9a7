"""Mixed GPU types inside one job on the testbed: measured samples/s against the balanced prediction.

    python -m bench.mixed_types --lab /var/tmp/es-mixed [--steps 120] [--compute-ms 100] [--per-gpu-batch 8]

The testbed has no GPUs, so the GPU types are EMULATED: every job runs tests/integration/train_tiny.py with
`--emulate-gpu-types`, whose step sleeps `compute-ms x local batch / per-GPU batch x STEP_FACTOR[type]` (the
lab's A100 1.8x slower than its H100, slurm_plugin/lab/gpu_types.py), where the type is what elastic-launch read
from Slurm's GRES of the worker's node. Real sbatch, real slurmctld, real elastic-launch, gloo between CPU
workers, 1 worker per node. Four jobs, in this order (the first two side by side, on disjoint nodes):

    h100 x2        partition h100 (node[1-2]), equal batches
    a100 x2        partition a100 (node[3-4]), equal batches
    mixed balanced partition debug, --constraint=[h100*1&a100*1]; the launcher asks the lab's predictor (seeded with
                   the model's synthetic history on both types) for each type's compute time, so ranks get
                   ELASTIC_SPEED and ElasticTrainer(speed=) splits the global batch by it
    mixed equal    the same, the predictor unreachable: equal speeds, equal batches (the unbalanced job)

Prediction: predictor.mixed.balanced() with each type's compute seconds per step and the sync seconds measured in
the two single-type jobs of this same run (what the planner does with the predictor's per-type step times).
Samples/s are the median of the launcher's measurement records (records.jsonl) after its warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from predictor.mixed import balanced
from predictor.profiles import profile_from_spec
from slurm_plugin.lab.demo_services import PredictorService
from slurm_plugin.lab.gpu_types import STEP_FACTOR
from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.testbed_conf import TestbedConfig, recorded_port_base

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "integration" / "train_tiny.py"
MODEL = "resnet50"          # the profile the lab's predictor has seeded history of on H100 and A100


def job_script(work: Path, name: str, args, predictor: str, token: str) -> str:
    train = [sys.executable, str(TRAIN), "--steps", str(args.steps), "--per-gpu-batch", str(args.per_gpu_batch),
             "--dataset-size", "100000", "--compute-ms", str(args.compute_ms), "--emulate-gpu-types",
             "--out", str(work / name / "samples")]
    return f"""#!/bin/bash
#ELASTIC model={MODEL} gpus=2 per_gpu_batch={args.per_gpu_batch}
export ELASTIC_PREDICTOR_TOKEN={token} PYTHONPATH={ROOT}
exec {sys.executable} -m elastic_launcher.cli --script "$0" --workers-per-node 1 --run-dir {work / name / 'run'} \\
    --predictor {predictor} --intra-link shm --inter-link socket --no-autoscale --straggler-ratio 1000 \\
    --measure-steps {args.measure_steps} --warmup-steps 4 -- {' '.join(train)}
"""


def submit(bed: Testbed, work: Path, name: str, script: str, sbatch_args: list[str]) -> int:
    (work / name).mkdir(parents=True, exist_ok=True)
    path = work / name / "job.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", "-N2", "--gres=gpu:1", f"--output={work / name}/job.out",
                          f"--chdir={work / name}", f"--job-name=mixed-{name}", *sbatch_args, str(path)],
                         env={**bed.env(), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().split(";")[0])


def wait_done(bed: Testbed, jobs: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(map(str, jobs))],
                             env={**bed.env(), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True).stdout
        if not set(out.split()) & {str(j) for j in jobs}:
            return
        time.sleep(1)
    raise SystemExit(f"jobs {jobs} did not end within {timeout_s:g} s")


def records(work: Path, name: str) -> list[dict]:
    path = work / name / "run" / "records.jsonl"
    if not path.exists():
        raise SystemExit(f"{name}: no records ({path}); job output:\n{(work / name / 'job.out').read_text()[-3000:]}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(work: Path, name: str) -> dict:
    """Median samples/s, step and per-node compute seconds of the job's measurement windows, its GPU types and
    the per-rank batches it ran with (from the workers' sample logs)."""
    recs = records(work, name)
    meas = [r for r in recs if r["kind"] == "measurement"]
    if not meas:
        raise SystemExit(f"{name}: no measurement record; job output:\n{(work / name / 'job.out').read_text()[-3000:]}")
    types = next(r for r in recs if r["kind"] == "gpu_types")
    compute: dict[str, list[float]] = {}
    for r in meas:
        for node, seconds in r["compute_s_by_node"].items():
            compute.setdefault(node, []).append(seconds)
    batches: dict[str, set[int]] = {}
    for path in (work / name / "samples").glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            batches.setdefault(f"{row['node']} {row['gpu']}", set()).add(len(row["idx"]))
    return {"samples_per_s": statistics.median(r["samples_per_s"] for r in meas),
            "step_s": statistics.median(r["step_s"] for r in meas),
            "compute_s": {n: statistics.median(v) for n, v in compute.items()}, "windows": len(meas),
            "types": types, "batches": {k: sorted(v) for k, v in sorted(batches.items())}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lab", type=Path, required=True)
    p.add_argument("--work", type=Path, default=None, help="job directories (default: LAB/bench-mixed)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--measure-steps", type=int, default=8)
    p.add_argument("--compute-ms", type=float, default=100.0, help="emulated H100 compute per step at the batch")
    p.add_argument("--per-gpu-batch", type=int, default=8)
    args = p.parse_args(argv)
    bed = Testbed(TestbedConfig(lab=args.lab, port_base=recorded_port_base(args.lab) or 0))
    work = args.work or args.lab / "bench-mixed"
    service = PredictorService(bed, timeout=timedelta(seconds=60))
    service.start(fresh=True)
    try:
        service.seed_gpu_types(profile_from_spec(MODEL).to_dict())
        probe = {"profile": MODEL, "gpu": "A100", "per_gpu_batch": args.per_gpu_batch, "candidates": [
            {"layout": [1], "intra_link": "shm"}]}
        deadline = time.monotonic() + 60
        while not service.post("/v1/predict", probe).get("known"):   # the fit of the seeded history
            if time.monotonic() > deadline:
                raise SystemExit("the lab's predictor never fitted the seeded history")
            time.sleep(0.5)
        url, token, closed = service.url, service.token, "http://127.0.0.1:9"
        jobs = {"h100 x2": submit(bed, work, "h100", job_script(work, "h100", args, url, token), ["-p", "h100"]),
                "a100 x2": submit(bed, work, "a100", job_script(work, "a100", args, url, token), ["-p", "a100"])}
        wait_done(bed, list(jobs.values()), 600)
        mixed = ["-p", "debug", "--constraint=[h100*1&a100*1]"]
        jobs["mixed balanced"] = submit(bed, work, "balanced", job_script(work, "balanced", args, url, token), mixed)
        wait_done(bed, [jobs["mixed balanced"]], 600)
        jobs["mixed equal"] = submit(bed, work, "equal", job_script(work, "equal", args, closed, token), mixed)
        wait_done(bed, [jobs["mixed equal"]], 600)
    finally:
        service.stop()
    got = {label: summary(work, d) for label, d in
           (("h100 x2", "h100"), ("a100 x2", "a100"), ("mixed balanced", "balanced"), ("mixed equal", "equal"))}
    # the prediction, from this run's single-type jobs: each type's compute and the sync of its 2-node layout
    compute = {"H100": statistics.mean(got["h100 x2"]["compute_s"].values()),
               "A100": statistics.mean(got["a100 x2"]["compute_s"].values())}
    sync = max(got["h100 x2"]["step_s"] - compute["H100"], got["a100 x2"]["step_s"] - compute["A100"], 0.0)
    pred = balanced((1, 1), ("H100", "A100"), compute, args.per_gpu_batch, sync)
    predicted = {"h100 x2": 2 * args.per_gpu_batch / (compute["H100"] + sync),
                 "a100 x2": 2 * args.per_gpu_batch / (compute["A100"] + sync),
                 "mixed balanced": pred.samples_per_s, "mixed equal": pred.equal_samples_per_s}
    print(f"# Mixed GPU types on the testbed (EMULATED types: STEP_FACTOR {STEP_FACTOR}, sleep-based compute)\n")
    print(f"command: python -m bench.mixed_types --lab LAB --steps {args.steps} --compute-ms {args.compute_ms:g} "
          f"--per-gpu-batch {args.per_gpu_batch}  (2 nodes x 1 worker per job, global batch {2 * args.per_gpu_batch})\n")
    print(f"prediction inputs measured in the single-type jobs: compute H100 {compute['H100'] * 1000:.1f} ms, "
          f"A100 {compute['A100'] * 1000:.1f} ms per step at batch {args.per_gpu_batch}; sync {sync * 1000:.1f} ms; "
          f"balanced batches (H100, A100) {list(pred.batches)}\n")
    print("| job | Slurm job | speeds (source) | per-rank batches seen | predicted samples/s | measured samples/s "
          "| measured / predicted | windows |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for label, s in got.items():
        nodes = s["types"]["nodes"]
        speeds = ", ".join(f"{n} {t['gpu']} {t['speed']:.3f}" for n, t in nodes.items())
        seen = "; ".join(f"{k}: {'/'.join(map(str, v))}" for k, v in s["batches"].items())
        single = label in ("h100 x2", "a100 x2")   # their own measurements are the prediction's inputs
        print(f"| {label} | {jobs[label]} | {speeds} ({s['types']['speeds'][:90]}) | {seen} | "
              f"{predicted[label]:.1f}{' (input)' if single else ''} | {s['samples_per_s']:.1f} | "
              f"{s['samples_per_s'] / predicted[label]:.3f} | {s['windows']} |")
    b, e, h = (got[k]["samples_per_s"] for k in ("mixed balanced", "mixed equal", "h100 x2"))
    print("\nThe single-type rows' predictions are their own measured compute and sync (the inputs), so their "
          "ratio only checks the arithmetic; the mixed rows are the test.")
    print(f"\nmeasured: balanced mixed {b / e:.2f}x of the equal-batch mixed job (predicted "
          f"{pred.samples_per_s / pred.equal_samples_per_s:.2f}x), {b / h:.2f}x of h100 x2 (predicted "
          f"{pred.samples_per_s / predicted['h100 x2']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
