"""What a user compares (issue 23): their own torchrun script (A) against the template's script under the launcher
(B), on the same model, data, batch, precision, optimizer and DataLoader worker count.

A: ``bench/torchrun_plain.py`` under ``torch.distributed.run`` (DDP defaults, DistributedSampler, DataLoader), with
   ``OMP_NUM_THREADS=1`` at every size as B's process has (``--plain-omp-threads default``: torchrun's own, which
   leaves it unset for one process a node).
B: ``python -m elastic_launcher.examples.<task>``, the command the template runs, under the launcher's fixed-size
   start without Slurm: this process hosts the job's store, posts the first plan (``Coordinator.start``) and
   starts one process per GPU with the environment ``elastic-launch`` gives a step's tasks (``worker_env``,
   ``SLURM_LOCALID``); the script picks its own DataLoader worker count (``--workers`` left to the template).
C: the field's best recipe as its users run it (#39), under ``torch.distributed.run``: ``bench/recipe_nanogpt.py``
   for the language model (nanoGPT's style: compile, fused AdamW, flash attention, memmapped tokens) and
   ``bench/recipe_torchvision.py`` for ResNet-50 (torchvision's reference recipe: Pillow decode and its preset in
   the loader's workers, channels_last; on the synthetic row its batches are already on the GPU). The image rows
   are read against the GPU-bound rate: the faster of the synthetic row's C and B (B makes its images on the GPU;
   since session 29 its compiled step, replayed as CUDA graphs, is the faster).
Each run is a fresh process set; rounds alternate A, B then B, A. Samples/s is the harmonic mean of rank 0's
progress windows after the first ``--skip`` windows (equal steps each, so it is total samples over total time).

    python bench/vs_torchrun.py --data synthetic,jpeg,tokens --precision bf16,fp32 --gpus 1,2 --rounds 3
    python bench/vs_torchrun.py --data tokens,synthetic,jpeg --precision bf16 --gpus 1 --rounds 2 --arms A,C  # #39
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RATE = re.compile(r"^step (\d+)/\d+ .* ([0-9.]+) samples/s", re.M)
WORKERS = re.compile(r"(\d+) DataLoader worker")
TASK = {"synthetic": "resnet50", "jpeg": "resnet50", "tokens": "gpt-lm"}
# (steps, log every). GPT-LM runs 300 steps: with 60 (4 timed windows of 10 steps) B/A at 4 GPUs read 0.937
# (0.898-0.984, session 12), over 300 steps the same code 0.989-0.992 (session 13, bench/results/gpu_runs/
# 2026-11-28_session13): short windows hold the commit points of the schedule's ramp (steps 1, 3, 7, 15, 31, ...);
# a run's whole wall time, start included, is printed beside its rate.
STEPS = {"resnet50": (120, 20), "gpt-lm": (300, 50)}


def write_jpegs(root: Path, n: int = 3000, classes: int = 10, total: int = 0) -> Path:
    """``n`` JPEG photo-like images of 500x375 in ``classes`` folders (smooth gradients plus noise, quality 90),
    then hard links to them up to ``total`` files: every file is decoded as its own, and an epoch is long enough
    that no epoch boundary falls inside a run (a plain DataLoader restarts its prefetch at each epoch, the elastic
    sampler's projection runs across; with 3000 images at 2x64 an epoch is 23 steps and that alone made B 1.5x A)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:375, 0:500]
    bases = [(np.sin(xx / rng.uniform(20, 80)) + np.cos(yy / rng.uniform(20, 80)))[..., None] * 60 + 128
             for _ in range(classes)]
    noise = rng.normal(0, 20, (375, 500, 3))
    for i in range(n):
        d = root / f"c{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        img = (bases[i % classes] + np.roll(noise, 7 * i, axis=1)).clip(0, 255).astype(np.uint8)
        Image.fromarray(img).save(d / f"{i}.jpg", quality=90)
    for i in range(n, total):
        src = i % n
        d = root / f"c{src % classes}"  # the copy keeps its source's class
        os.link(d / f"{src}.jpg", d / f"{i}.jpg")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def harmonic_rate(out: str, skip: int) -> tuple[float, int]:
    rates = [float(r) for _, r in RATE.findall(out)][skip:]
    if not rates:
        raise RuntimeError(f"no progress windows after the first {skip}:\n{out[-3000:]}")
    return len(rates) / sum(1 / r for r in rates), len(rates)


BATCH: dict[str, int] = {}  # --per-gpu-batch: every arm's, per task (default: each script's own)


def task_args(task: str, data: str, jpeg_dir: Path, precision: str, profile: Optional[Path] = None) -> list[str]:
    steps, every = STEPS[task]
    args = ["--steps", str(steps), "--log-every", str(every), "--precision", precision]
    if task in BATCH:
        args += ["--per-gpu-batch", str(BATCH[task])]
    if profile is not None:
        args += ["--torch-profile", str(profile)]
    if data == "jpeg":
        args += ["--data", str(jpeg_dir)]
    return args


def plain_env(omp_threads: Optional[int]) -> dict[str, str]:
    """A's environment. ``torch.distributed.run`` sets ``OMP_NUM_THREADS=1`` only for 2 or more processes a node, so
    a 1-GPU torchrun script trains with one intra-op thread per CPU, while the template's process runs one
    (``--threads 1``): at 1 GPU the two sides then differ in a setting, not in the runtime (session 17's 1-GPU image
    rows, B/A 0.91-1.34, were taken so). ``omp_threads`` sets it on A at every size (the bench's default, 1, B's
    own setting); None leaves torchrun's default."""
    env = dict(os.environ)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


# The arms beside B: "A" is the user's script as written (DDP defaults); "A-nobcast" the same with DDP's per-forward
# buffer broadcast off (the trainer's setting), a diagnostic arm: how much of B - A that one setting explains;
# "C" the best recipe (its script per task in RECIPES)
ARMS = {"A": [], "A-nobcast": ["--broadcast-buffers", "off"], "C": []}
RECIPES = {"gpt-lm": "recipe_nanogpt.py", "resnet50": "recipe_torchvision.py"}


def matmul_peak(n: int = 8192, reps: int = 10) -> float:
    """TFLOP/s of an n x n x n bf16 matrix product on random data (mean of ``reps`` after 3 warm-ups): the peak
    that MFU is read against (KINDS.md: 769-798 on an H200 here)."""
    import torch
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def gpt_flops_per_sample() -> float:
    """Model FLOPs of one GPT-2-small training sample (forward and backward), as nanoGPT's and PaLM's MFU count
    them: 6 N + 12 L d T per token, N the parameters without the position table (GPT-2's 50257 tokens, unpadded)."""
    import torch
    from elastic_launcher.examples import models
    size = models.GPT_SIZES["gpt2-small"]
    with torch.device("meta"):  # shapes only
        model = models.GPT(size)
    n = sum(p.numel() for p in model.parameters()) - model.positions.weight.numel()
    return (6 * n + 12 * size.layers * size.d_model * size.context) * size.context


def run_plain(task: str, data: str, gpus: int, precision: str, workers: int, jpeg_dir: Path,
              profile: Optional[Path] = None, omp_threads: Optional[int] = 1, arm: str = "A",
              extra: tuple = ()) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    if arm == "C":
        if profile is not None:
            raise SystemExit("--profile: the best-recipe arm C has no profiler option")
        cmd += [str(ROOT / "bench" / RECIPES[task]), "--workers", str(workers), *extra]
    else:
        cmd += [str(ROOT / "bench" / "torchrun_plain.py"), "--task", task, "--workers", str(workers)] + ARMS[arm]
    cmd += task_args(task, data, jpeg_dir, precision, profile)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=plain_env(omp_threads))
    if done.returncode:
        raise RuntimeError(f"plain run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def run_template(task: str, data: str, gpus: int, precision: str, jpeg_dir: Path,
                 profile: Optional[Path] = None, extra: tuple = ()) -> str:
    import torch.distributed as dist
    from elastic_launcher.membership import Coordinator
    from elastic_launcher.workers import worker_env, worker_id
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=120))
    group = f"jbench-localhost-g{int(time.time())}"
    Coordinator(dist.PrefixStore("job", server)).start([worker_id(group, s) for s in range(gpus)])
    module = {"resnet50": "resnet50", "gpt-lm": "gpt_lm"}[task]
    cmd = [sys.executable, "-m", f"elastic_launcher.examples.{module}"] + task_args(task, data, jpeg_dir, precision,
                                                                                     profile) + list(extra)
    procs = []
    for slot in range(gpus):
        env = dict(os.environ, SLURM_LOCALID=str(slot),
                   **worker_env(f"127.0.0.1:{server.port}/job", "bench", "localhost", group, gpus))
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("template run failed:\n" + "\n".join(o[-3000:] for o in outs))
    del server
    return outs[0]


def table(rows: list, arms: list[str]) -> str:
    """The Markdown table of the runs: per row, each side's samples/s per round, B over the first arm per round
    and its median, and B over each further arm (median)."""
    extra = arms[1:]
    lines = [f"| data | precision | GPUs | loader workers | {arms[0]}: torchrun script, samples/s | "
             + "".join(f"{x}, samples/s | " for x in extra)
             + f"B: template under the launcher | B/{arms[0]} per round | B/{arms[0]} (median) |"
             + "".join(f" B/{x} (median) |" for x in extra),
             "|---" * (8 + 2 * len(extra)) + "|"]
    for data, precision, gpus, workers, res, ratios in rows:
        cells = [", ".join(f"{x:.0f}" for x in res[arm]) for arm in arms]
        others = [statistics.median(b / x for b, x in zip(res["B"], res[arm])) for arm in extra]
        lines.append(f"| {data} | {precision} | {gpus} | {workers} | " + " | ".join(cells) + " | "
                     f"{', '.join(f'{x:.0f}' for x in res['B'])} | {', '.join(f'{x:.3f}' for x in ratios)} | "
                     f"**{statistics.median(ratios):.3f}** |" + "".join(f" {x:.3f} |" for x in others))
    return "\n".join(lines)


def utilisation(rows: list, peak: float, flops: float) -> str:
    """Per row and arm, the range over rounds: MFU for the language model (model FLOPs a second and GPU over the
    measured matrix-product peak), and for images the rate over the GPU-bound rate: the faster of the synthetic
    row's C and B at the same precision and GPU count (medians over rounds), the fastest way measured to train the
    model on batches already on the GPU (C's batches are there; B makes its images there)."""
    bound = {(p, g): max(statistics.median(res[arm]) for arm in ("B", "C") if arm in res)
             for d, p, g, _, res, _ in rows if d == "synthetic" and "C" in res}
    lines = ["| data | precision | GPUs | arm | samples/s (rounds) | utilisation (rounds) |",
             "|---|---|---|---|---|---|"]
    for data, precision, gpus, _, res, _ in rows:
        for arm, rates in res.items():
            if data == "tokens":
                util = ", ".join(f"{r * flops / gpus / 1e12 / peak:.1%}" for r in rates) + f" MFU of {peak:.0f} TFLOP/s"
            elif (precision, gpus) in bound:
                util = ", ".join(f"{r / bound[precision, gpus]:.1%}" for r in rates) + " of the GPU-bound rate"
            else:
                util = "(no synthetic C row: GPU-bound rate not measured)"
            lines.append(f"| {data} | {precision} | {gpus} | {arm} | {', '.join(f'{r:.0f}' for r in rates)} | {util} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="synthetic,jpeg,tokens")
    ap.add_argument("--precision", default="bf16,fp32")
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", type=int, default=2, help="progress windows to leave out at the start")
    ap.add_argument("--jpeg-dir", type=Path, default=None)
    ap.add_argument("--steps", default="", help="steps of a run per task, e.g. gpt-lm=200,resnet50=120 (logged "
                    "every sixth; default " + ",".join(f"{t}={s}" for t, (s, _) in STEPS.items()) + ")")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="both sides profile steps 100-110 of every run (the scripts' --torch-profile), under DIR/<run>/")
    ap.add_argument("--plain-omp-threads", default="1", metavar="N|default",
                    help="OMP_NUM_THREADS of A's processes (default 1, B's --threads; 'default' leaves "
                    "torchrun's own: 1 for 2+ processes a node, unset for one)")
    ap.add_argument("--arms", default="A", help="A's arms besides B, comma-separated, the first the baseline of the "
                    "ratio: " + ", ".join(ARMS) + " (A-nobcast: DDP's buffer broadcast off, a diagnostic)")
    ap.add_argument("--per-gpu-batch", default="", help="every arm's batch per task, e.g. gpt-lm=16 (default: the "
                    "scripts' own, the template's default)")
    ap.add_argument("--template-args", default="", help="more options of the template's script (B), e.g. "
                    "'--compile off' (space-separated; a fast path turned off, to measure it)")
    ap.add_argument("--recipe-args", default="", help="more options of the best-recipe script (C), likewise")
    ap.add_argument("--devices", default="", help="CUDA_VISIBLE_DEVICES of both sides' processes (default: as set); "
                    "on a 4-GPU host, two benches on disjoint GPUs run side by side")
    a = ap.parse_args()
    if a.plain_omp_threads != "default" and not a.plain_omp_threads.isdigit():
        raise SystemExit(f"--plain-omp-threads {a.plain_omp_threads!r}: want a positive count or 'default'")
    omp_threads = None if a.plain_omp_threads == "default" else int(a.plain_omp_threads)
    arms = a.arms.split(",")
    if not arms or any(x not in ARMS for x in arms):
        raise SystemExit(f"--arms {a.arms!r}: want a comma-separated subset of {', '.join(ARMS)}")
    for item in filter(None, a.steps.split(",")):
        task, _, n = item.partition("=")
        if task not in STEPS or not n.isdigit() or int(n) < 6 * (a.skip + 1):
            raise SystemExit(f"--steps {item!r}: want TASK=N with TASK in {sorted(STEPS)} and N >= {6 * (a.skip + 1)}")
        STEPS[task] = (int(n), int(n) // 6)
    for item in filter(None, a.per_gpu_batch.split(",")):
        task, _, n = item.partition("=")
        if task not in STEPS or not n.isdigit():
            raise SystemExit(f"--per-gpu-batch {item!r}: want TASK=N with TASK in {sorted(STEPS)}")
        BATCH[task] = int(n)
    if a.devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = a.devices  # inherited by both sides' processes
    import torch
    from elastic_launcher.examples.common import WorkerEnv, default_workers
    from elastic_launcher.workers import worker_env
    jpeg_dir = a.jpeg_dir or Path(tempfile.mkdtemp(prefix="vs_torchrun_jpeg_"))
    datas = a.data.split(",")
    gpus_max = max(int(g) for g in a.gpus.split(","))
    total = int(1.1 * STEPS["resnet50"][0] * 64 * gpus_max)  # no epoch boundary inside a run (write_jpegs)
    if "jpeg" in datas and sum(1 for _ in jpeg_dir.rglob("*.jpg")) < total:
        t = time.perf_counter()
        write_jpegs(jpeg_dir, total=total)
        print(f"# wrote 3000 JPEGs (500x375) and hard links to {total} files in {jpeg_dir} in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    peak = matmul_peak()
    print(f"# bf16 matrix product 8192^3: {peak:.0f} TFLOP/s (the MFU peak)", flush=True)
    print(f"# {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES="
          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}), torch {torch.__version__}, "
          f"{len(os.sched_getaffinity(0))} CPUs, steps {STEPS}, A's OMP_NUM_THREADS "
          f"{omp_threads if omp_threads is not None else 'torchrun default'}", flush=True)
    flops = gpt_flops_per_sample()
    rows = []
    for data in datas:
        task = TASK[data]
        for precision in a.precision.split(","):
            for gpus in [int(g) for g in a.gpus.split(",")]:
                # the count the template picks for itself (B), given to the plain script (A) too
                env = WorkerEnv.from_environ({**worker_env("", "bench", "localhost", "g", gpus), "SLURM_LOCALID": "0"})
                workers = default_workers(env, torch.device("cuda"))
                res = {side: [] for side in arms + ["B"]}
                order = arms + ["B"]
                for r in range(a.rounds):
                    for side in (order if r % 2 == 0 else order[::-1]):
                        t0 = time.perf_counter()
                        prof = a.profile / f"{data}-{precision}-g{gpus}-r{r}-{side}" if a.profile else None
                        if side != "B":
                            out = run_plain(task, data, gpus, precision, workers, jpeg_dir, prof, omp_threads, side,
                                            tuple(a.recipe_args.split()))
                        else:
                            out = run_template(task, data, gpus, precision, jpeg_dir, prof,
                                               tuple(a.template_args.split()))
                        rate, n = harmonic_rate(out, a.skip)
                        used = WORKERS.findall(out)
                        res[side].append(rate)
                        windows = " ".join(f"{float(x):.0f}" for _, x in RATE.findall(out))
                        mfu = f", MFU {rate * flops / gpus / 1e12 / peak:.1%}" if task == "gpt-lm" else ""
                        print(f"{data:9s} {precision} gpus={gpus} round {r} {side}: {rate:8.1f} samples/s{mfu} "
                              f"({n} windows, {time.perf_counter() - t0:.0f} s"
                              f"{', template workers ' + used[0] if used else ''}; every window: {windows})",
                              flush=True)
                ratios = [b / x for b, x in zip(res["B"], res[arms[0]])]
                rows.append((data, precision, gpus, workers, res, ratios))
    print("\n" + table(rows, arms))
    print("\n" + utilisation(rows, peak, flops))

if __name__ == "__main__":
    main()
