"""The baseline of bench/vs_torchrun.py: a plain torchrun training script, as users write it.

DDP with its defaults, ``DistributedSampler`` + ``DataLoader`` (worker processes, pinned memory, persistent
workers), ``torch.autocast`` (a GradScaler for fp16). It trains the same model on the same dataset with the same
optimizer and loss as the template's script (it imports them from ``elastic_launcher.examples``) and prints the
same progress lines (``step N/M ... X samples/s``), so the bench reads both alike.

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/torchrun_plain.py \\
        --task resnet50 --workers 8 --precision bf16 --steps 120
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic_launcher.examples import gpt_lm, models, resnet50  # noqa: E402
from elastic_launcher.examples.common import StepProfiler  # noqa: E402


def build(args):
    """(model, make_optimizer, dataset, loss_of) exactly as the template's script builds them."""
    if args.task == "resnet50":
        # the template's data and model as a plain script has them: images made/decoded by the loader's workers,
        # default memory format, no compile (the template's fast paths are its own, #39)
        ns = resnet50.build_parser().parse_args(["--seed", "0", "--gpu-data", "off", "--channels-last", "off"]
                                                + (["--data", str(args.data)] if args.data else []))
        dataset, classes = resnet50.build_dataset(ns)
        model = models.build_resnet(ns.arch, classes)
        return model, (lambda p: torch.optim.SGD(p, lr=ns.lr, momentum=0.9, weight_decay=1e-4)), dataset, \
            resnet50.loss_of
    ns = gpt_lm.build_parser().parse_args(["--vocab-multiple", "1"])  # GPT-2's own vocabulary, as users write it
    model, dataset = gpt_lm.build_model_and_data(ns)
    return model, (lambda p: torch.optim.AdamW(p, lr=ns.lr, weight_decay=0.1)), dataset, gpt_lm.loss_of


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=("resnet50", "gpt-lm"), default="resnet50")
    p.add_argument("--data", type=Path, default=None, help="image folder (resnet50; default synthetic)")
    p.add_argument("--per-gpu-batch", type=int, default=None)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--torch-profile", type=Path, default=None, help="as the template's --torch-profile (local rank 0)")
    p.add_argument("--broadcast-buffers", choices=("on", "off"), default="on",
                   help="DDP's buffer broadcast in every forward (on: DDP's default, what users run; off: the "
                   "trainer's setting, a diagnostic arm of bench/vs_torchrun.py)")
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, make_opt, dataset, loss_of = build(args)
    model = model.to(device)
    opt = make_opt(model.parameters())
    # the keyword as the trainer passes it (elastic_launcher/epochs.py: renamed in newer torch)
    buffers = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters \
        else "broadcast_buffers"
    ddp = DDP(model, device_ids=[local], **{buffers: args.broadcast_buffers == "on"})
    parser = resnet50.build_parser() if args.task == "resnet50" else gpt_lm.build_parser()
    batch = args.per_gpu_batch or parser.get_default("script_per_gpu_batch")  # the template's default
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, world, rank, shuffle=True, seed=0)
    kw = dict(persistent_workers=True, prefetch_factor=4) if args.workers else {}
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=args.workers,
                                         pin_memory=True, drop_last=True, **kw)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.precision]
    scaler = torch.amp.GradScaler("cuda") if dtype is torch.float16 else None
    amp = (lambda: torch.autocast("cuda", dtype=dtype)) if dtype is not None else contextlib.nullcontext
    profiler = StepProfiler(args.torch_profile if local == 0 else None, f"plain-{rank}")
    step, epoch, window = 0, 0, (time.perf_counter(), 0)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with amp():
                loss = loss_of(ddp, (x, y))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            profiler.step()
            if rank == 0 and (step % args.log_every == 0 or step == args.steps):
                t, done = time.perf_counter(), step * batch * world
                rate = (done - window[1]) / max(t - window[0], 1e-9)
                window = (t, done)
                print(f"step {step}/{args.steps}  workers {world}  global batch {batch * world}"
                      f"  loss {loss.item():.4f}  {rate:.1f} samples/s", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    profiler.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
