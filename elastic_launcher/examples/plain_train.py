"""A plain torchrun-style DDP script, the stand-in for "your existing train.py" in the wrapper template.

It knows nothing of elastic-launch: `init_process_group()` reads RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT from the environment, as under torchrun. It fits y = 3 * sum(x) + 1 with a linear model.

    torchrun --nproc-per-node 2 -m elastic_launcher.examples.plain_train --steps 50
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 3 + 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 20 == 0 or step == args.steps):
            print(f"step {step}/{args.steps}  world {world}  loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
