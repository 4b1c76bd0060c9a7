"""Cold-start data, measured on the GPU machine: all-reduce sweeps and DDP step times per NCCL transport.

One launch per (world size, transport); `bash bench/gpu_suite.sh coldstart` runs them all, one after another:

    python3 -m torch.distributed.run --standalone --nproc_per_node=W bench/coldstart_collect.py --out F.jsonl
    (transport by environment: none = what NCCL picks (NVLink here), NCCL_P2P_DISABLE=1 = shared memory,
     NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket = TCP sockets)

At W = 1 there is no process group and no DDP: the step is what a user's single-GPU run measures. Rank 0 writes one
JSON line per measurement, in the record shapes of docs/design.md plus bench fields:
- {"kind": "profile", ...}: the model's tensor profile (predictor.profiles.profile_from_module, DDP's bucket cap);
- {"kind": "collective", "link", "op": "allreduce", "world", "bytes", "seconds", "rep"}: mean of a window of
  back-to-back all-reduces of one fp32 tensor, two windows per size;
- {"kind": "step", "profile", "gpu", "layout": [W], "intra_link", "per_gpu_batch", "iter_s", "windows", "local_s"}:
  iter_s is the median over windows of the mean step (forward, backward with DDP's overlapped all-reduce,
  optimizer) with one device sync per window, not per step; with `--no-sync-windows`, local_s the same under `no_sync()`
  (no communication: this moment's compute, at W > 1 only);
  at W > 1 also the model's 1-GPU step measured inside the same launch, just before and between its W-GPU
  windows: `solo_s` (median of `solo_windows`), the mean step of a plain copy of the model (no DDP) on rank 0
  alone while the other ranks wait at a barrier of a side gloo group (no NCCL traffic, their GPUs idle). The
  windows are taken in rounds, `rounds` of them: solo, W-GPU, no_sync() (`solo_windows[i]`, `windows[i]`,
  `local_windows[i]` are round i, `round_t[i]` its start, seconds after the record's first round), so host
  drift between the 1-GPU and the W-GPU measurement shows in the record instead of in the comparison;
- {"kind": "links", ...}: the label the launcher's own detection gives (elastic_launcher.links on this host's
  facts and NCCL's debug output) beside the transports NCCL's debug output names.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from elastic_launcher.calibrate import agree, sweep, windows  # noqa: E402  (the calibration job's)
from elastic_launcher.links import HostFacts, links_for, nccl_transports  # noqa: E402
from gpu_common import build, pin_cpus, sync  # noqa: E402
from predictor.profiles import profile_from_module  # noqa: E402

# model -> per-GPU batch sizes measured (smallest first); the order is the order of measurement. Each ladder
# runs from host-bound (the step is the host's Python and kernel launches: on the lent H200s, ResNet-18 at 64 and
# BERT at 16 take the same time as at half the batch) to GPU-bound batches a user of an H200 would run.
# Session 7's data (bench/data/coldstart/session7/) used the lower half of each ladder only.
MODELS = {
    "resnet18": (64, 128, 256, 512), "resnet50": (64, 128, 256, 512), "vit_b_16": (32, 64, 128, 256),
    "gpt2": (4, 8, 16, 32), "bert": (16, 32, 64, 128),
}
# The held-out set (issue 25, `--set fresh`): models and batch ladders never used while the throughput model was
# developed, collected after its freeze (predictor.stepmodel.MODEL_VERSION) and scored by bench/heldout.py.
FRESH = {
    "resnet101": (48, 96, 192, 384), "regnet_y_1_6gf": (48, 96, 192, 384),
    "shufflenet_v2_x1_0": (96, 192, 384, 768), "swin_t": (24, 48, 96, 192),
    "opt125m": (6, 12, 24, 48), "t5_small": (12, 24, 48, 96),
}
# The second held-out set (`--set fresh2`), collected after tm-2026.11.27-2 (the release developed on `fresh`)
FRESH2 = {
    "densenet121": (48, 96, 192, 384), "mobilenet_v3_large": (96, 192, 384, 768),
    "efficientnet_b0": (64, 128, 256, 512), "convnext_tiny": (32, 64, 128, 256),
    "distilbert": (12, 24, 48, 96), "albert_base": (8, 16, 32, 64),
}
# The third (`--set fresh3`), collected after tm-2026.11.28-1 (the release developed on `fresh2`)
FRESH3 = {
    "resnext50_32x4d": (48, 96, 192, 384), "wide_resnet50_2": (32, 64, 128, 256),
    "mobilenet_v2": (96, 192, 384, 768), "vit_b_32": (64, 128, 256, 512),
    "bart_base": (8, 16, 32, 64), "electra_small": (16, 32, 64, 128),
}
# The fourth (`--set fresh4`), collected after tm-2026.11.28-2 (the release developed on `fresh3`)
FRESH4 = {
    "resnet152": (32, 64, 128, 256), "vgg16_bn": (32, 64, 128, 256),
    "squeezenet1_1": (128, 256, 512, 1024), "maxvit_t": (16, 32, 64, 128),
    "gpt_neo_125m": (6, 12, 24, 48), "xlm_roberta_base": (4, 8, 16, 32),
}
SETS = {"dev": MODELS, "fresh": FRESH, "fresh2": FRESH2, "fresh3": FRESH3, "fresh4": FRESH4}
CPU_MODELS = {"mlp": (16, 32, 64), "tiny": (8, 16)}


def gpu_name(device) -> str:
    """Short GPU type (`H100`, `H200`, `A100`), as the cluster's GRES type would name it; `cpu` on CPU."""
    if device.type != "cuda":
        return "cpu"
    full = torch.cuda.get_device_name(device)
    for token in full.replace("-", " ").split():
        if token[:1] in "HABLVTK" and any(c.isdigit() for c in token) and len(token) <= 6:
            return token.upper()
    return full


def solo_copy(name: str, device, batches, rank: int):
    """Rank 0's plain (no DDP) copy of the model for the in-launch 1-GPU step; None on the other ranks."""
    if rank != 0:
        return None
    torch.manual_seed(0)
    model, opt, _, make_batch, loss_fn = build(name, device, batch=max(batches))
    return model, opt, make_batch, loss_fn


def stepper(model, opt, batch, loss_fn, no_sync=None):
    """run(n): n training steps of `model` on `batch` (under `no_sync()` of a DDP model when given)."""
    def run(n):
        ctx = no_sync() if no_sync is not None else contextlib.nullcontext()
        with ctx:
            for _ in range(n):
                opt.zero_grad(set_to_none=True)
                loss_fn(model, batch).backward()
                opt.step()
    return run


def solo_window(run_solo, device, est_s: float, args, side) -> float | None:
    """One 1-GPU window on rank 0 while every other rank waits at the side group's barrier (None elsewhere)."""
    out = None
    if run_solo is not None:
        out = windows(run_solo, device, est_s, args.window_s, 1)[0]
    if side is not None:
        dist.barrier(group=side)
    return out


def measure_model(name: str, batches, device, world: int, link: str, gpu: str, args, emit, side=None) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    try:
        model, opt, _, make_batch, loss_fn = build(name, device, batch=max(batches))
    except (ImportError, AttributeError, TypeError) as exc:  # the machine's torchvision/transformers lack it: same on every rank
        emit({"kind": "skipped", "profile": name, "why": f"cannot build: {exc}"})
        return
    profile = profile_from_module(model, name, bucket_cap_mb=25.0)
    emit({"kind": "profile", **profile.to_dict(), "source": f"module ({gpu})"})
    net = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else model
    solo = solo_copy(name, device, batches, rank) if world > 1 else None
    for b in batches:
        batch = make_batch(b)
        run_steps = stepper(net, opt, batch, loss_fn)
        run_local = stepper(net, opt, batch, loss_fn, net.no_sync) if world > 1 and args.local else None
        run_solo = None
        if solo is not None:
            s_model, s_opt, s_make, s_loss = solo
            run_solo = stepper(s_model, s_opt, s_make(b), s_loss)
        try:
            sync(device)
            t0 = time.perf_counter()
            run_steps(args.warmup)
            sync(device)
            est = agree((time.perf_counter() - t0) / args.warmup, device)
            if world == 1:
                ws = windows(run_steps, device, est, args.window_s, args.windows)
                extra = {"local_s": None}
            else:
                if run_solo is not None:
                    run_solo(args.warmup)
                sync(device)
                ws, solo_ws, local_ws, round_t = [], [], [], []
                start = time.perf_counter()
                for _ in range(args.windows):  # rounds: 1-GPU, W-GPU, no_sync(), so drift hits all three alike
                    round_t.append(time.perf_counter() - start)
                    solo_ws.append(solo_window(run_solo, device, est, args, side))
                    ws += windows(run_steps, device, est, args.window_s, 1)
                    if run_local is not None:
                        local_ws += windows(run_local, device, est, args.window_s, 1)
                extra = {"local_s": statistics.median(local_ws) if local_ws else None, "local_windows": local_ws,
                         "solo_s": statistics.median(solo_ws) if run_solo is not None else None,
                         "solo_windows": solo_ws, "rounds": args.windows, "round_t": round_t}
        except torch.OutOfMemoryError:
            emit({"kind": "skipped", "profile": name, "per_gpu_batch": b, "why": "out of memory"})
            del batch
            torch.cuda.empty_cache()
            break
        emit({"kind": "step", "profile": name, "gpu": gpu, "layout": [world], "intra_link": link,
              "inter_link": None, "per_gpu_batch": b, "iter_s": statistics.median(ws), "windows": ws,
              "warmup_s": est, **extra})
        del batch, run_steps, run_local, run_solo
    del net, model, opt, solo
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON lines file (rank 0 appends)")
    ap.add_argument("--models", default=None, help=f"comma list (default: the set's; on CPU mlp,tiny)")
    ap.add_argument("--set", dest="model_set", choices=tuple(SETS), default="dev",
                    help=f"dev: the models the throughput model was developed on ({','.join(MODELS)}); fresh: the "
                         f"held-out set of session 12 ({','.join(FRESH)}); fresh2: session 13's ({','.join(FRESH2)}); "
                         f"fresh3: session 14's ({','.join(FRESH3)}); fresh4: session 16's ({','.join(FRESH4)})")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=int, default=5, help="steps before timing (DDP rebuilds its buckets once)")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=0.5, help="target length of one timing window")
    ap.add_argument("--sweep-budget-s", type=float, default=20.0)
    ap.add_argument("--transport", default="auto", help="what the launch set up (nvlink|shm|socket), recorded")
    ap.add_argument("--no-sync-windows", dest="local", action="store_true",
                    help="also time each W-GPU row under no_sync() (local_s; a third of the launch's time)")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        pin_cpus(local, torch.cuda.device_count())  # each rank its share of the CPUs, as Slurm's task affinity
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    table = SETS[args.model_set] if device.type == "cuda" else CPU_MODELS
    names = args.models.split(",") if args.models else list(table)
    known = {k: v for s in SETS.values() for k, v in s.items()} | CPU_MODELS
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"--models: unknown {unknown}; known: {sorted(known)}")
    gpu = gpu_name(device)
    out = open(args.out, "a") if rank == 0 else None

    def emit(rec: dict) -> None:
        if out is not None:
            rec = {**rec, "world": rec.get("world", world), "transport": args.transport, "t": time.time()}
            out.write(json.dumps(rec) + "\n")
            out.flush()
            if rec["kind"] in ("step", "links", "skipped"):
                brief = {k: v for k, v in rec.items() if not k.endswith("windows") and k not in ("t", "round_t")}
                print(json.dumps(brief), flush=True)

    link = "none"
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        warm = torch.ones(1024, device=device)
        dist.all_reduce(warm)
        sync(device)
        debug = ""
        path = os.environ.get("NCCL_DEBUG_FILE", "").replace("%h", os.uname().nodename).replace("%p", str(os.getpid()))
        if path and os.path.exists(path):
            debug = Path(path).read_text(errors="replace")
        facts = HostFacts.probe(backend, gpu_index=local, nccl_debug_text=debug)
        links = links_for([world], [facts])
        link = links.intra
        emit({"kind": "links", "intra": links.intra, "source": links.source,
              "nccl_via": sorted(nccl_transports(debug)), "nvlink": facts.nvlink, "env": facts.env})
        sweep(device, world, link, args.sweep_budget_s, emit)
    # the other ranks wait for rank 0's 1-GPU windows here: a CPU barrier, no NCCL kernel spinning on a GPU
    side = dist.new_group(backend="gloo") if world > 1 else None
    from predictor.stepmodel import MODEL_VERSION
    emit({"kind": "env", "torch": torch.__version__, "gpu": gpu, "set": args.model_set,
          "model_version_at_collection": MODEL_VERSION,
          "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None})
    for name in names:
        measure_model(name, table.get(name) or known[name], device, world, link, gpu, args, emit, side)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
