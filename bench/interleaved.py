"""ElasticTrainer's steady step against plain DDP, and A/B variants of it: one model, one process per GPU, every
variant at every size built once in the same processes and run in short interleaved blocks (round-robin, the order
rotated each round), so a host that drifts by several ms a minute (bench/results/gpu_transition.md, sessions 6-8:
ResNet-50's host-bound step moved 20% between blocks a minute apart) moves every variant alike. This is where
``bench/gpu_transition.py`` takes its steady ratio from (variants ``ddp,ddp-default,trainer``: against ``ddp``
first, like for like, and ``ddp-default`` beside it).

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

Sizes (``--sizes``, default ``--gpus``): a variant at size n runs on the first n ranks (plain DDP over a
``new_group`` of them, a trainer as a job of n workers); the other ranks wait at the barrier that ends every block.

A block: ``--warm`` steps, a device sync, ``--steps`` steps with no sync between them, a device sync. Per block:
``mean`` = window / steps, and the host time of each call of the step (loader, forward, ``backward()``,
``opt.step()``, ``commit()``): in a host-bound step the calls that grew are where the time went. Per size and
variant the table gives the mean step over all its blocks, the ratio of that to the ``--baseline`` variant's (both
pooled over the same rounds), and the median (range) of the per-round ratios.

Run: ``python3 bench/interleaved.py --gpus 2 --model resnet50`` (``--device cpu --model tiny`` on gloo).
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
from gpu_common import Synthetic, build, pin_cpus, sync  # noqa: E402

BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters \
    else "broadcast_buffers"  # as the trainer wraps (elastic_launcher/epochs.py)
ALL = "ddp,ddp-default,ddp+pyhook,ddp+elastic,trainer"
PHASES = ("next", "forward", "backward", "optimizer", "commit")


class _Group:
    """The slice of ProcessGroupWrapper that ``elastic_allreduce_hook`` uses, over a plain group."""

    def __init__(self, pg) -> None:
        self.pg = pg

    def errored(self):
        return None

    def size(self) -> int:
        return self.pg.size()

    def rank(self) -> int:
        return self.pg.rank()

    def allreduce(self, tensors, op=dist.ReduceOp.SUM):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.pg.allreduce(tensors, opts)

    def report_error(self, e) -> None:
        raise e


def _train(model, batch, loss_fn, opt, watch=None) -> list[float]:
    """Forward (``watch(loss)`` after it), backward, optimizer step: the clock at the end of each."""
    loss = loss_fn(model, batch)
    if watch is not None:
        watch(loss)
    t = [time.perf_counter()]
    loss.backward()
    t.append(time.perf_counter())
    opt.step()
    opt.zero_grad(set_to_none=True)
    t.append(time.perf_counter())
    return t


class _Plain:
    """A DDP wrapper stepped on one fixed batch."""

    def __init__(self, ddp, opt, batch, loss_fn) -> None:
        self.ddp, self.opt, self.batch, self.loss_fn = ddp, opt, batch, loss_fn

    def step(self) -> list[float]:
        t0 = time.perf_counter()
        ends = _train(self.ddp, self.batch, self.loss_fn, self.opt)
        return [t0, t0, *ends, ends[-1]]  # no loader, no commit


class _Trainer:
    """ElasticTrainer's loop, resumable block by block (its loader is a generator)."""

    def __init__(self, rank, n, port, model, opt, b, batch, loss_fn, dev, name: str) -> None:
        from elastic_launcher.batch_policy import BatchPolicy
        from elastic_launcher.membership import Coordinator
        from elastic_launcher.telemetry import Telemetry
        from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        change = dict(kv.split("=") for kv in name.partition(":")[2].split(",") if "=" in kv)
        if set(change) - {"hook", "telemetry"}:
            raise SystemExit(f"unknown trainer change in {name!r}: hook=builtin, telemetry=0")
        job = f"job{n}-" + name.replace(":", "-").replace("=", "-").replace(",", "-")
        members = [f"w{i}" for i in range(n)]
        if rank == 0:
            Coordinator(dist.PrefixStore(job, store)).start(members)
        cuda = dev.type == "cuda"
        tel = Telemetry(gpu="x", intra_link="nvlink" if cuda else "shm") if change.get("telemetry") != "0" else None
        self.et = ElasticTrainer(model, opt, store_addr=f"127.0.0.1:{port}/{job}", worker_id=members[rank],
                                 policy=BatchPolicy(per_gpu_batch=b, lr_scaling="none"), device=dev,
                                 config=TrainerConfig(backend="nccl" if cuda else "gloo"), telemetry=tel).join()
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
        t += _train(et.model, self.batch, self.loss_fn, self.opt, et.watch_loss)
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
        pin_cpus(rank, max(args.sizes))
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", port, max(args.sizes), is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("default", store), rank=rank,
                            world_size=max(args.sizes), timeout=timedelta(seconds=120))
    model, opt, b, make_batch, loss_fn = build(args.model, dev)
    batch = make_batch(b)
    ids = dict(device_ids=[rank]) if cuda else {}
    runners = {}  # (size, variant) -> runner, on the ranks of that size
    for n in args.sizes:
        group = dist.new_group(list(range(n)))  # every rank calls it, in the same order
        if rank >= n:
            continue
        for v in args.variants:
            if v.partition(":")[0] == "trainer":
                runners[(n, v)] = _Trainer(rank, n, port, model, opt, b, batch, loss_fn, dev, v)
                continue
            m = DDP(model, process_group=group, init_sync=False,
                    **({} if v == "ddp-default" else {BUFFERS: False}), **ids)
            if v == "ddp+pyhook":
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
                m.register_comm_hook(group, allreduce_hook)
            elif v == "ddp+elastic":
                from elastic_launcher.telemetry import HookState, elastic_allreduce_hook
                m.register_comm_hook(HookState(_Group(group)), elastic_allreduce_hook)
            elif v not in ("ddp", "ddp-default"):
                raise SystemExit(f"unknown variant {v!r}; known: {ALL}, trainer:hook=builtin, trainer:telemetry=0")
            runners[(n, v)] = _Plain(m, opt, batch, loss_fn)
    out = []  # (round, size, variant, result)
    names = list(args.variants)
    for r in range(args.rounds):
        k = r % len(names)
        for n in args.sizes:
            for v in names[k:] + names[:k]:  # rotated: no variant always first or last
                if rank < n:
                    out.append((r, n, v, _block(runners[(n, v)], dev, args.warm, args.steps)))
                dist.barrier()
    info = {f"{n} {v}": r.close() for (n, v), r in runners.items() if isinstance(r, _Trainer)}
    if rank == 0:
        q.put((out, info))
    dist.barrier()
    dist.destroy_process_group()


def table(out: list, baseline: str) -> list[str]:
    """Rows per (size, variant): pooled mean step, its ratio to ``baseline`` at that size, per-round ratios."""
    by: dict = {}
    for r, n, v, res in out:
        by.setdefault((n, v), {})[r] = res
    lines = [f"| GPUs | variant | mean step ms | ratio to {baseline} (pooled) | per-round ratio, median (range) | "
             "host ms: " + " / ".join(PHASES) + " |", "|---|---|---|---|---|---|"]
    for (n, v), rs in sorted(by.items(), key=lambda kv: kv[0][0]):
        base = by.get((n, baseline), {})
        common = [r for r in sorted(rs) if r in base]
        mean = statistics.mean(rs[r]["mean_ms"] for r in rs)
        pooled = (statistics.mean(rs[r]["mean_ms"] for r in common) /
                  statistics.mean(base[r]["mean_ms"] for r in common)) if common else None
        ratios = [rs[r]["mean_ms"] / base[r]["mean_ms"] for r in common]
        host = [statistics.median(rs[r]["host_ms"][i] for r in rs) for i in range(len(PHASES))]
        per_round = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
        lines.append(f"| {n} | {v} | {mean:.2f} | {'-' if pooled is None else f'{pooled:.3f}'} | {per_round} | "
                     + " / ".join(f"{h:.2f}" for h in host) + " |")
    return lines


def ratios(out: list, variant: str, baseline: str) -> dict[int, dict]:
    """Per size: ``variant``'s pooled mean step over ``baseline``'s (same rounds), and both means in seconds."""
    res = {}
    for n in sorted({n for _, n, _, _ in out}):
        a = {r: x["mean_ms"] for r, m, v, x in out if m == n and v == variant}
        z = {r: x["mean_ms"] for r, m, v, x in out if m == n and v == baseline}
        common = [r for r in a if r in z]
        if common:
            ours, plain = (statistics.mean(d[r] for r in common) / 1e3 for d in (a, z))
            res[n] = {"ratio": ours / plain, "mean_s": ours, "plain_mean_s": plain, "rounds": len(common),
                      "round_ratios": [a[r] / z[r] for r in common]}
    return res


def run(model: str, sizes: list[int], variants: list[str], device: str = "cuda", rounds: int = 8, steps: int = 40,
        warm: int = 5) -> tuple[list, dict]:
    """Spawns max(sizes) workers, runs a warm-up round (left out: clocks, allocator, cuDNN choices) and ``rounds``
    rounds of interleaved blocks; returns (blocks of rank 0 as (round, size, variant, result), trainer info)."""
    args = argparse.Namespace(model=model, sizes=sorted(sizes), variants=variants, device=device, rounds=rounds + 1,
                              steps=steps, warm=warm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(max(sizes))]
    for p in ps:
        p.start()
    try:
        out, info = q.get(timeout=1800)
    finally:
        for p in ps:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    return [(r - 1, n, v, x) for r, n, v, x in out if r > 0], info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--sizes", default="", help="comma-separated world sizes (default: --gpus)")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default=ALL)
    ap.add_argument("--baseline", default="ddp", help="the variant every ratio is against")
    ap.add_argument("--warm", type=int, default=5, help="steps before each timed block")
    ap.add_argument("--steps", type=int, default=40, help="timed steps a block")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [args.gpus]
    variants = args.variants.split(",")
    if args.baseline not in variants:
        raise SystemExit(f"--baseline {args.baseline} is not among --variants {args.variants}")
    out, info = run(args.model, sizes, variants, args.device, args.rounds, args.steps, args.warm)
    print(json.dumps({"model": args.model, "sizes": sizes, "device": args.device, "info": info, "blocks": out}))
    print(f"\n{args.model} at {'/'.join(map(str, sizes))} {'GPUs' if args.device == 'cuda' else 'gloo ranks'}: "
          f"{args.rounds} rounds of interleaved blocks (after a warm-up round, left out), {args.steps} steps a block "
          f"after {args.warm} and a device sync\n")
    print("\n".join(table(out, args.baseline)))
    for k, i in info.items():
        print(f"\n{k}: commit interval {i['commit_interval']} steps at the end")


if __name__ == "__main__":
    main()
