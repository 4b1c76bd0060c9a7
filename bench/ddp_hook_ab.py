"""Where ElasticTrainer's steady step loses against plain DDP: one model, one process per GPU, every variant built
once in the same processes and run in short interleaved blocks (round-robin, the order rotated each round), so a
host that drifts by several ms a minute (bench/results/gpu_transition.md, session 6) moves every variant alike.

Variants (``--variants``, comma-separated; all wrap the same module, whose idle wrappers' reducers do nothing):

ddp          DDP on ``init_process_group``'s group, DDP's own C++ allreduce, ``broadcast_buffers=False`` (the
             trainer's buffer setting): the baseline every ratio is against
ddp-default  DDP with its defaults (a buffer broadcast in every forward): what a plain ``torchrun`` script runs
ddp+pyhook   ``ddp`` plus torch's own Python comm hook (``default_hooks.allreduce_hook``)
ddp+elastic  ``ddp`` plus ``elastic_allreduce_hook`` (no telemetry) over the default group
trainer      ElasticTrainer at a fixed size: its own group, loader, ``watch_loss``, ``commit()`` every step, the
             automatic commit schedule and Telemetry, as the templates run it
trainer:K=V  the same with one change (A/B only): ``hook=builtin`` (DDP's own allreduce instead of the elastic
             hook), ``telemetry=0``; every trainer variant is a job of its own (store prefix, group)

A block: ``--warm`` steps, a device sync, ``--steps`` steps with no sync between them, a device sync. Per block:
``mean`` = window / steps, and the host time of each call of the step (forward, ``backward()``, ``opt.step()``,
``commit()`` / loader): in a host-bound step the calls that grew are where the time went. Per variant the table
gives the median over ``--rounds`` of its block means and the median (range) of its ratio to the ``ddp`` block of
the same round.

Run: ``python3 bench/ddp_hook_ab.py --gpus 2 --model resnet50`` (``--device cpu --model tiny`` on gloo).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_common import Synthetic, build, sync  # noqa: E402

BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters \
    else "broadcast_buffers"  # as the trainer wraps (elastic_launcher/epochs.py)
ALL = "ddp,ddp-default,ddp+pyhook,ddp+elastic,trainer"
PHASES = ("next", "forward", "backward", "optimizer", "commit")


class _DefaultGroup:
    """The slice of ProcessGroupWrapper that ``elastic_allreduce_hook`` uses, over the default group."""

    def __init__(self) -> None:
        self.pg = dist.group.WORLD

    def errored(self):
        return None

    def size(self) -> int:
        return dist.get_world_size()

    def rank(self) -> int:
        return dist.get_rank()

    def allreduce(self, tensors, op=dist.ReduceOp.SUM):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.pg.allreduce(tensors, opts)

    def report_error(self, e) -> None:
        raise e


class _Plain:
    """A DDP wrapper stepped on one fixed batch."""

    def __init__(self, ddp, opt, batch, loss_fn) -> None:
        self.ddp, self.opt, self.batch, self.loss_fn = ddp, opt, batch, loss_fn

    def step(self) -> list[float]:
        t = [time.perf_counter()]
        t.append(t[0])  # no loader
        loss = self.loss_fn(self.ddp, self.batch)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        t.append(t[-1])  # no commit
        return t


class _Trainer:
    """ElasticTrainer's loop, resumable block by block (its loader is a generator)."""

    def __init__(self, rank, args, port, model, opt, b, batch, loss_fn, dev, name: str) -> None:
        from elastic_launcher.batch_policy import BatchPolicy
        from elastic_launcher.membership import Coordinator
        from elastic_launcher.telemetry import Telemetry
        from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        change = dict(kv.split("=") for kv in name.partition(":")[2].split(",") if "=" in kv)
        if set(change) - {"hook", "telemetry"}:
            raise SystemExit(f"unknown trainer change in {name!r}: hook=builtin, telemetry=0")
        job = "job-" + name.replace(":", "-").replace("=", "-").replace(",", "-")
        members = [f"w{i}" for i in range(args.gpus)]
        if rank == 0:
            Coordinator(dist.PrefixStore(job, store)).start(members)
        cuda = dev.type == "cuda"
        tel = Telemetry(gpu="x", intra_link="nvlink" if cuda else "shm") if change.get("telemetry") != "0" else None
        self.et = ElasticTrainer(model, opt, store_addr=f"127.0.0.1:{port}/{job}", worker_id=members[rank],
                                 policy=BatchPolicy(per_gpu_batch=b, lr_scaling="none"), device=dev,
                                 config=TrainerConfig(backend="nccl" if cuda else "gloo"), telemetry=tel)
        self.it = self.et.loader(Synthetic(10 ** 7), collate_fn=lambda items: None)
        register = DDP.register_comm_hook
        if change.get("hook") == "builtin":
            DDP.register_comm_hook = lambda self, state, hook: None
        try:
            next(self.it)  # joins: builds this trainer's DDP wrapper (with or without the hook)
        finally:
            DDP.register_comm_hook = register
        self._pending = True
        self.opt, self.batch, self.loss_fn = opt, batch, loss_fn

    def step(self) -> list[float]:
        et = self.et
        t = [time.perf_counter()]
        if not self._pending:
            next(self.it)
        self._pending = False
        t.append(time.perf_counter())
        loss = self.loss_fn(et.model, self.batch)
        et.watch_loss(loss)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        et.commit()
        t.append(time.perf_counter())
        return t

    def close(self) -> dict:
        info = {"commit_interval": self.et.schedule.interval}
        self.et.close()
        return info


def _block(runner, dev, warm: int, steps: int) -> dict:
    for _ in range(warm):
        runner.step()
    sync(dev)
    phases = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = runner.step()
        phases.append([b - a for a, b in zip(t, t[1:])])
    sync(dev)
    mean = (time.perf_counter() - t0) / steps
    host = [statistics.median(col) for col in zip(*phases)]
    return {"mean_ms": 1e3 * mean, "host_ms": [1e3 * h for h in host]}


def worker(rank: int, args, port: int, q) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", port, args.gpus, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("default", store), rank=rank,
                            world_size=args.gpus, timeout=timedelta(seconds=120))
    model, opt, b, make_batch, loss_fn = build(args.model, dev)
    batch = make_batch(b)
    ids = dict(device_ids=[rank]) if cuda else {}
    runners = {}
    for v in args.variants:
        if v.partition(":")[0] == "trainer":
            runners[v] = _Trainer(rank, args, port, model, opt, b, batch, loss_fn, dev, v)
            continue
        m = DDP(model, init_sync=False, **({} if v == "ddp-default" else {BUFFERS: False}), **ids)
        if v == "ddp+pyhook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            m.register_comm_hook(None, allreduce_hook)
        elif v == "ddp+elastic":
            from elastic_launcher.telemetry import HookState, elastic_allreduce_hook
            m.register_comm_hook(HookState(_DefaultGroup()), elastic_allreduce_hook)
        elif v not in ("ddp", "ddp-default"):
            raise SystemExit(f"unknown variant {v!r}; known: {ALL}")
        runners[v] = _Plain(m, opt, batch, loss_fn)
    out = []  # (round, variant, result)
    names = list(runners)
    for r in range(args.rounds):
        k = r % len(names)
        for v in names[k:] + names[:k]:  # rotated: no variant always first or last
            out.append((r, v, _block(runners[v], dev, args.warm, args.steps)))
    info = {v: r.close() for v, r in runners.items() if isinstance(r, _Trainer)}
    if rank == 0:
        q.put((out, info))
    dist.barrier()
    dist.destroy_process_group()


def table(out: list, rounds: int) -> list[str]:
    by = {}
    for r, v, res in out:
        by.setdefault(v, {})[r] = res
    base = by.get("ddp", {})
    lines = ["| variant | mean step ms (median of rounds) | ratio to ddp, median (range) | host ms: "
             + " / ".join(PHASES) + " |", "|---|---|---|---|"]
    for v, rs in by.items():
        means = [rs[r]["mean_ms"] for r in sorted(rs)]
        ratios = [rs[r]["mean_ms"] / base[r]["mean_ms"] for r in sorted(rs) if r in base]
        host = [statistics.median(rs[r]["host_ms"][i] for r in rs) for i in range(len(PHASES))]
        ratio = (f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-")
        lines.append(f"| {v} | {statistics.median(means):.2f} | {ratio} | "
                     + " / ".join(f"{h:.2f}" for h in host) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default=ALL)
    ap.add_argument("--warm", type=int, default=5, help="steps before each timed block")
    ap.add_argument("--steps", type=int, default=40, help="timed steps a block")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(args.gpus)]
    for p in ps:
        p.start()
    out, info = q.get(timeout=1800)
    for p in ps:
        p.join()
    print(json.dumps({"model": args.model, "gpus": args.gpus, "device": args.device, "info": info,
                      "blocks": out}))
    print(f"\n{args.model} at {args.gpus} {'GPUs' if args.device == 'cuda' else 'gloo ranks'}: {args.rounds} rounds "
          f"of interleaved blocks, {args.steps} steps a block after {args.warm} and a device sync\n")
    print("\n".join(table(out, args.rounds)))
    for v, i in info.items():
        print(f"\n{v}: commit interval {i['commit_interval']} steps at the end")


if __name__ == "__main__":
    main()
