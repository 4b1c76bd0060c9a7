"""The image "best recipe" arm of bench/vs_torchrun.py (#39): ResNet-50 as torchvision's reference recipe trains it.

Written for this bench in the style of torchvision's references/classification/train.py (not copied from it):
``torchvision.models.get_model``, SGD (momentum 0.9, weight decay 1e-4), ``cudnn.benchmark``, DDP, a
DistributedSampler + DataLoader over ``torchvision.datasets.ImageFolder`` with the reference's training preset
(RandomResizedCrop, RandomHorizontalFlip, PILToTensor, ToDtype, Normalize; Pillow decode in the loader's workers),
and its ``train_one_epoch`` loop with autocast. Two speed habits the reference lacks but its users add are
options: ``--channels-last`` and ``--compile``. Without ``--data`` the batches are already on the GPU (random
images made there once, cycled): the GPU-bound rate of the same model, the ceiling of the loader's rows.

    python -m torch.distributed.run --standalone --nproc_per_node=1 bench/recipe_torchvision.py --data DIR
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torchvision.transforms import v2 as T


def train_one_epoch(model, criterion, optimizer, batches, device, args, state):
    model.train()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()
    for image, target in batches:
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        if args.channels_last == "on":
            image = image.contiguous(memory_format=torch.channels_last)
        with amp:
            output = model(image)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        state["step"] += 1
        step = state["step"]
        if state["rank"] == 0 and (step % args.log_every == 0 or step == args.steps):
            t, done = time.perf_counter(), step * args.per_gpu_batch * state["world"]
            rate = (done - state["done"]) / (t - state["t"])
            state["t"], state["done"] = t, done
            print(f"step {step}/{args.steps}  workers {state['world']}  global batch "
                  f"{args.per_gpu_batch * state['world']}  loss {loss.item():.4f}  {rate:.1f} samples/s", flush=True)
        if step >= args.steps:
            return


def on_gpu_batches(args, device, pool: int = 8):
    """Batches already on the GPU: ``pool`` random batches made there once, cycled (the GPU-bound rate)."""
    g = torch.Generator(device).manual_seed(0)
    images = torch.randn(pool, args.per_gpu_batch, 3, 224, 224, generator=g, device=device)
    labels = torch.randint(0, 1000, (pool, args.per_gpu_batch), generator=g, device=device)
    i = 0
    while True:
        yield images[i % pool], labels[i % pool]
        i += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None, help="ImageFolder root (default: batches already on the GPU)")
    p.add_argument("--per-gpu-batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--steps", type=int, default=360)
    p.add_argument("--log-every", type=int, default=60)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--channels-last", choices=("on", "off"), default="on")
    p.add_argument("--compile", choices=("on", "off"), default="off")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, local, world = dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.get_model("resnet50", weights=None, num_classes=1000).to(device)
    if args.channels_last == "on":
        model = model.to(memory_format=torch.channels_last)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    if args.compile == "on":
        model = torch.compile(model)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    state = {"step": 0, "rank": rank, "world": world, "t": time.perf_counter(), "done": 0}
    if args.data is None:
        train_one_epoch(model, criterion, optimizer, on_gpu_batches(args, device), device, args, state)
    else:
        preset = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(0.5), T.PILToTensor(),
                            T.ToDtype(torch.float, scale=True),
                            T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))])
        dataset = torchvision.datasets.ImageFolder(str(args.data), preset)
        sampler = torch.utils.data.distributed.DistributedSampler(dataset)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.per_gpu_batch, sampler=sampler,
                                             num_workers=args.workers, pin_memory=True, drop_last=True)
        epoch = 0
        while state["step"] < args.steps:
            sampler.set_epoch(epoch)
            train_one_epoch(model, criterion, optimizer, loader, device, args, state)
            epoch += 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
