"""A plain torchrun-style DDP script, the stand-in for "your existing train.py" in the wrapper template.

It knows nothing of elastic-launch: `init_process_group()` reads RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT from the environment, as under torchrun. It fits y = 3 * sum(x) + 1 with a linear model.

Checkpoints are torch.distributed.checkpoint's stock pattern, collective over the default group: every
`--checkpoint-every` steps, on SIGTERM (scancel, the time limit, torchrun's agent restarting the workers: the
ranks agree to stop at the same step), on SIGUSR1 (a checkpoint now, then training goes on: what
`elastic-launch --restart` sends before a planned resize, as Lightning's Slurm requeue does) and at the end,
into `--checkpoint-dir DIR/step-N` with `DIR/latest` naming the newest; `--resume` loads it at whatever world
size the job has now (the state is replicated). Rank 0 prints `step N/M  world W  loss L` every `--log-every`
steps.

    torchrun --nproc-per-node 2 -m elastic_launcher.examples.plain_train --steps 50 --checkpoint-dir ck --resume
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    parser.add_argument("--log-every", type=int, default=20, help="rank 0 prints a step line this often")
    parser.add_argument("--step-s", type=float, default=0.0,
                        help="seconds each step also sleeps (a stand-in for a real model's compute: tests, bench)")
    parser.add_argument("--ignore-sigusr1", action="store_true",
                        help="behave as a script without a SIGUSR1 handler (tests: it must still resume)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    flags = torch.zeros(2)   # [stop (SIGTERM), checkpoint now (SIGUSR1)]
    signal.signal(signal.SIGTERM, lambda *_: flags[0].fill_(1))
    if not args.ignore_sigusr1:
        signal.signal(signal.SIGUSR1, lambda *_: flags[1].fill_(1))
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
        if args.step_s:
            time.sleep(args.step_s)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step}/{args.steps}  world {world}  loss {loss.item():.4f}", flush=True)
        agreed = flags.clone()
        dist.all_reduce(agreed)  # every rank stops (checkpoints) after the same step once any rank was signalled
        if agreed[1].item():
            flags[1].fill_(0)
        if args.checkpoint_dir is not None and (agreed.sum().item() or step % args.checkpoint_every == 0 or
                                                step == args.steps):
            save(step)
            if agreed[1].item() and rank == 0:
                print(f"checkpoint at step {step} (SIGUSR1)", flush=True)
        if agreed[0].item():
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
