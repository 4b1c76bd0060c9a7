"""A tiny CPU training script for the launcher's end-to-end tests, written against ElasticTrainer.

It stands in for a GPU job on the CPU testbed: each step "computes" for `--compute-ms` (a sleep that models
the device time of one local batch, so measured throughput scales with the worker count the way it does
on GPUs; the real CPU work of the tiny model is negligible next to it), then runs a real forward/backward
with a gloo all-reduce through the runtime. `--slow-node NODE --slow-factor F` makes the workers on one
node F times slower (a straggler). `--emulate-gpu-types` makes a step's compute proportional to the rank's
local batch and to its node's GPU type's STEP_FACTOR (the lab's emulated types; the rank's speed comes from
elastic-launch, `ELASTIC_SPEED`, into `ElasticTrainer(speed=...)`).

Accounting: once a commit point covers a step every rank appends one JSON line to `<out>/samples-<wid>.jsonl`:
`{"step", "epoch", "idx": [...], "world", "plan", "t", "node", "gpu"}` (its dataset indices of that step). The test checks
that, per epoch, no index is seen twice and that the number of committed samples is exact.

Entry point: the only place that reads the environment (what elastic-launch passes to each worker).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.committed import CommittedSteps
from elastic_launcher.errors import LeftGroup
from elastic_launcher.gpu_speeds import GPU_TYPE_ENV, worker_speed
from elastic_launcher.process_group import StoreAddr, connect_store
from elastic_launcher.sampler import ElasticSampler
from elastic_launcher.telemetry import Telemetry
from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
from elastic_launcher.workers import ProgressReporter, worker_identity
from slurm_plugin.lab.gpu_types import STEP_FACTOR


class Squares(torch.utils.data.Dataset):
    """y = 3x + 1 with noise-free targets; the index is returned so ranks can log what they saw."""

    def __init__(self, size: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) * 3 + 1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True, help="global steps to train")
    p.add_argument("--per-gpu-batch", type=int, default=4)
    p.add_argument("--dataset-size", type=int, default=1000)
    p.add_argument("--compute-ms", type=float, default=150.0, help="simulated device time per step")
    p.add_argument("--slow-node", default=None)
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--emulate-gpu-types", action="store_true",
                   help="emulate the lab's GPU types (the testbed has no GPUs): a step computes --compute-ms times "
                        "its local batch over --per-gpu-batch times the STEP_FACTOR of the node's type "
                        "(slurm_plugin/lab/gpu_types.py; ELASTIC_GPU_TYPE from elastic-launch)")
    p.add_argument("--out", type=Path, required=True, help="directory for the per-rank sample logs")
    p.add_argument("--save", type=Path, default=None,
                   help="checkpoint-and-restart baseline: rank 0 saves the state here after the last step")
    p.add_argument("--resume", type=Path, default=None, help="start from a checkpoint written by --save")
    args = p.parse_args(argv)

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps every thread's stack
    env = os.environ
    wid, store_text = worker_identity(env)
    node = env.get("ELASTIC_NODE", "?")
    slow = args.slow_factor if args.slow_node == node else 1.0
    gpu_type = env.get(GPU_TYPE_ENV)
    factor = STEP_FACTOR.get(gpu_type or "", 1.0) if args.emulate_gpu_types else None
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = TrainerConfig(timeout=timedelta(seconds=20), heartbeat_timeout=timedelta(seconds=4))
    # the trainer reports progress after every committed step and hands its observation records over
    reporter = ProgressReporter(connect_store(StoreAddr.parse(store_text), timedelta(seconds=30)), wid, node)
    et = ElasticTrainer(model, optimizer, store_addr=store_text, worker_id=wid,
                        policy=BatchPolicy(per_gpu_batch=args.per_gpu_batch, lr_scaling="none"), config=config,
                        telemetry=Telemetry(profile="tiny"), progress=reporter, speed=worker_speed(env)).join()
    if args.resume is not None:  # baseline only: what a restarted job does before its first step
        ckpt = torch.load(args.resume, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optim"])
        et.sampler = ElasticSampler(args.dataset_size, seed=config.seed)
        et.sampler.load_state_dict(ckpt["sampler"])
        et.state.sampler = et.sampler
        et.state.counters["step"] = ckpt["step"]
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"samples-{wid}.jsonl", "a", buffering=1)
    dataset = Squares(args.dataset_size)
    loss_fn = torch.nn.MSELoss()
    loss = torch.tensor(float("nan"))
    steps = CommittedSteps()
    try:
        for x, y, idx in et.loader(dataset, max_steps=args.steps):
            before, epoch, world, plan = et.step, et.sampler.epoch, et.world_size, et.plan.id
            mine = list(et.batch_indices)
            if factor is None:
                time.sleep(args.compute_ms / 1000.0 * slow)
            else:   # compute proportional to the local batch, at the emulated type's pace
                time.sleep(args.compute_ms / 1000.0 * slow * factor * len(mine) / args.per_gpu_batch)
            loss = loss_fn(et.model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            went_on = et.commit()
            steps.add(before, {"step": before + 1, "epoch": epoch, "idx": mine, "world": world, "plan": plan,
                               "t": round(time.time(), 4), "node": node, "gpu": gpu_type})
            for rec in steps.ready(et.step, et.committed_step):  # a rollback takes back the steps after a commit
                log.write(json.dumps(rec) + "\n")
            if not went_on:
                break
        for rec in steps.rest():  # a clean end: the steps after the last commit point stand
            log.write(json.dumps(rec) + "\n")
        if args.save is not None and et.rank == 0 and et.step == args.steps:
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                        "sampler": et.sampler.state_dict(), "step": et.step}, args.save)
    except LeftGroup as exc:
        print(f"{wid}: {exc}", file=sys.stderr)
        return 3
    finally:
        et.close()
    print(f"{wid}: done at step {et.step} (left={et.left}, loss={loss.item():.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
