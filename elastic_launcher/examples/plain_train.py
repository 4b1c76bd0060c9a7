"""A plain torchrun-style DDP script, the stand-in for "your existing train.py" in the wrapper template.

It knows nothing of elastic-launch: `init_process_group()` reads RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT from the environment, as under torchrun. It fits y = 3 * sum(x) + 1 with a linear model.

Checkpoints are torch.distributed.checkpoint's stock pattern, collective over the default group: every
`--checkpoint-every` steps, on SIGTERM (scancel, the time limit: the ranks agree to stop at the same step) and
at the end, into `--checkpoint-dir DIR/step-N` with `DIR/latest` naming the newest; `--resume` loads it at
whatever world size the job has now (the state is replicated).

    torchrun --nproc-per-node 2 -m elastic_launcher.examples.plain_train --steps 50 --checkpoint-dir ck --resume
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    args = parser.parse_args(argv)
    stop = torch.zeros(1)
    signal.signal(signal.SIGTERM, lambda *_: stop.fill_(1))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = 0
    latest = args.checkpoint_dir / "latest" if args.checkpoint_dir else None
    if args.resume and latest is not None and latest.exists():
        state = app_state(model, optimizer, 0)
        dcp.load(state, checkpoint_id=args.checkpoint_dir / latest.read_text().strip())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from step {start} on {world} ranks", flush=True)

    def save(step: int) -> None:
        name = f"step-{step:08d}"
        dcp.save(app_state(model, optimizer, step), checkpoint_id=args.checkpoint_dir / name)  # collective
        if rank == 0:
            (args.checkpoint_dir / "latest.tmp").write_text(name + "\n")
            (args.checkpoint_dir / "latest.tmp").replace(latest)

    for step in range(start + 1, args.steps + 1):
        x = torch.randn(args.batch, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 3 + 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 20 == 0 or step == args.steps):
            print(f"step {step}/{args.steps}  world {world}  loss {loss.item():.4f}", flush=True)
        agreed = stop.clone()
        dist.all_reduce(agreed)  # every rank stops after the same step once any rank was signalled
        if args.checkpoint_dir is not None and (agreed.item() or step % args.checkpoint_every == 0 or
                                                step == args.steps):
            save(step)
        if agreed.item():
            if rank == 0:
                print(f"stopped by SIGTERM after step {step}" +
                      (f"; checkpoint in {args.checkpoint_dir}" if args.checkpoint_dir else ""), flush=True)
            dist.destroy_process_group()
            return 128 + signal.SIGTERM
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks", flush=True)
    return 0


def app_state(model, optimizer, step: int) -> dict:
    """What a checkpoint holds: torch's FQN-keyed model and optimizer state, and the step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}


if __name__ == "__main__":
    sys.exit(main())
