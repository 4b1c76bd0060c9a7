"""Where ElasticTrainer's steady step loses against plain DDP: the same model and batch, one process per GPU,
variants run one after another in the same processes (same machine, same minute), each against plain DDP.

Variants (``--variants``, comma-separated; every one with ``broadcast_buffers=False`` so buffers never differ):

ddp          DDP on ``init_process_group``'s group, DDP's own allreduce (the baseline)
ddp+pyhook   the same plus torch's own Python comm hook (``default_hooks.allreduce_hook``: divide, SUM, ``.then``)
ddp+elastic  the same group with ``elastic_allreduce_hook`` (no telemetry)
pgw          DDP over a ``ProcessGroupWrapper`` group (eager connect, ``NCCL_RUNTIME_CONNECT=0``), own allreduce
pgw+pyhook   that group with torch's Python hook
pgwlazy+...  a wrapper group whose communicator a first allreduce makes (no eager connect)
pgw+elastic  that group with ``elastic_allreduce_hook`` (no telemetry): the trainer's wrap
pgw+tel      the same with Telemetry (one step in ``time_every`` timed with CUDA events)
trainer      ElasticTrainer itself at a fixed size (auto commit schedule, telemetry), the templates' loop

Per variant: ``--warm`` steps, a device sync, ``--steps`` steps with no sync between them, a device sync;
``mean`` = window / steps; ``median`` of host periods; host ms inside ``backward()``. Ratio = variant / ddp.

Run: ``python3 bench/ddp_hook_ab.py --gpus 2 --model resnet50`` (``--device cpu`` runs it on gloo).
"""
from __future__ import annotations

import argparse
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

import inspect  # noqa: E402
BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters \
    else "broadcast_buffers"  # as the trainer wraps (elastic_launcher/epochs.py)
ALL = "ddp,ddp+pyhook,ddp+elastic,pgw,pgw+elastic,pgw+tel,trainer"


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


def _timed(step, dev, warm: int, steps: int) -> dict:
    for _ in range(warm):
        step()
    sync(dev)
    periods, bwd = [], []
    t0 = last = time.perf_counter()
    for _ in range(steps):
        bwd.append(step())
        now = time.perf_counter()
        periods.append(now - last)
        last = now
    sync(dev)
    return {"mean_ms": 1e3 * (time.perf_counter() - t0) / steps, "median_ms": 1e3 * statistics.median(periods),
            "backward_host_ms": 1e3 * statistics.median(bwd)}


def _profile(step, dev, show: bool) -> dict:
    """Host time by op over 10 steps (torch.profiler, CPU activities): a blocking call shows as self time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])  # + runtime API calls
    with profile(activities=acts) as prof:
        for _ in range(10):
            step()
        sync(dev)
    if show:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    return {"mean_ms": 0.0, "median_ms": 0.0, "backward_host_ms": 0.0}


def _make_lazy():
    from elastic_launcher.process_group import ProcessGroupWrapper

    class LazyWrapper(ProcessGroupWrapper):
        """A wrapper whose NCCL communicator is made by a first tiny allreduce (no eager connect)."""

        def _warm_up(self, pg, impl) -> None:
            pg.allreduce([torch.ones(1, device=self.device)]).wait()
            sync(self.device)
    return LazyWrapper


def worker(rank: int, args, port: int, q) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    store = dist.TCPStore("127.0.0.1", port, args.gpus, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(backend, store=dist.PrefixStore("default", store), rank=rank,
                            world_size=args.gpus, timeout=timedelta(seconds=120))
    global _LazyWrapper
    _LazyWrapper = _make_lazy()
    model, opt, b, make_batch, loss_fn = build(args.model, dev)
    batch = make_batch(b)
    ids = dict(device_ids=[rank]) if cuda else {}
    out = []  # (variant, result) in run order

    def plain_step(m):
        def step():
            loss = loss_fn(m, batch)
            t = time.perf_counter()
            loss.backward()
            t = time.perf_counter() - t
            opt.step()
            opt.zero_grad(set_to_none=True)
            return t
        return step

    for v in args.variants.split(","):
        dist.barrier()
        if v == "trainer":
            out.append((v, _trainer(rank, args, port, model, opt, b, batch, loss_fn, dev)))
            continue
        if v.startswith("pgw"):
            from elastic_launcher.process_group import ProcessGroupWrapper
            g = (_LazyWrapper if v.startswith("pgwlazy") else ProcessGroupWrapper)(backend, dev)
            g.configure(f"127.0.0.1:{port}/pgw-{v}", rank, args.gpus)
            pg = g.pg
        else:
            g, pg = _DefaultGroup(), None
        m = DDP(model, process_group=pg, init_sync=False, **{BUFFERS: False}, **ids)
        if v.endswith("+pyhook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            m.register_comm_hook(pg, allreduce_hook)
        elif v.endswith("+elastic") or v == "pgw+tel":
            from elastic_launcher.telemetry import HookState, Telemetry, elastic_allreduce_hook
            st = HookState(g, Telemetry(gpu="x", intra_link="nvlink") if v == "pgw+tel" else None)
            m.register_comm_hook(st, elastic_allreduce_hook)
            if v == "pgw+tel":
                base = plain_step(m)
                k = [0]

                def step(base=base, st=st):  # the trainer's per-step hook settings
                    k[0] += 1
                    st.timed = k[0] % 8 == 0
                    st.first_sync_t = None
                    return base()
                out.append((v, _timed(step, dev, args.warm, args.steps)))
                st.telemetry.drain()
                del m
                g.abort()
                continue
        out.append((v, _timed(plain_step(m), dev, args.warm, args.steps)))
        if v in args.profile.split(","):  # every rank steps (collectives), rank 0 prints
            out.append((v + " profile", _profile(plain_step(m), dev, rank == 0)))
        del m
        if v.startswith("pgw"):
            g.abort()
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _trainer(rank, args, port, model, opt, b, batch, loss_fn, dev) -> dict:
    import threading
    from elastic_launcher.batch_policy import BatchPolicy
    from elastic_launcher.membership import Coordinator
    from elastic_launcher.telemetry import Telemetry
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    members = [f"w{i}" for i in range(args.gpus)]
    if rank == 0:
        Coordinator(dist.PrefixStore("job", store)).start(members)
    cuda = dev.type == "cuda"
    et = ElasticTrainer(model, opt, store_addr=f"127.0.0.1:{port}/job", worker_id=members[rank],
                        policy=BatchPolicy(per_gpu_batch=b, lr_scaling="none"), device=dev,
                        config=TrainerConfig(backend="nccl" if cuda else "gloo"),
                        telemetry=Telemetry(gpu="x", intra_link="nvlink" if cuda else "shm"))
    periods, bwd, n = [], [], 0
    t0 = last = None
    total = args.warm + args.steps
    for _ in et.loader(Synthetic(10 ** 6), collate_fn=lambda items: None):
        loss = loss_fn(et.model, batch)
        et.watch_loss(loss)
        t = time.perf_counter()
        loss.backward()
        t = time.perf_counter() - t
        opt.step()
        opt.zero_grad(set_to_none=True)
        et.commit()
        n += 1
        if n == args.warm:
            sync(dev)
            t0 = last = time.perf_counter()
        elif n > args.warm:
            now = time.perf_counter()
            periods.append(now - last)
            bwd.append(t)
            last = now
        if n >= total:
            break
    sync(dev)
    res = {"mean_ms": 1e3 * (time.perf_counter() - t0) / args.steps, "median_ms": 1e3 * statistics.median(periods),
           "backward_host_ms": 1e3 * statistics.median(bwd), "commit_interval": et.schedule.interval,
           "threads": sorted(t.name for t in threading.enumerate())}
    et.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default=ALL)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", default="", help="variants to profile (host time by op, rank 0) after timing")
    ap.add_argument("--repeat", type=int, default=1, help="run the variant list this many times")
    args = ap.parse_args()
    args.variants = ",".join([args.variants] * args.repeat)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(args.gpus)]
    for p in ps:
        p.start()
    out = q.get(timeout=1800)
    for p in ps:
        p.join()
    print(json.dumps({"model": args.model, "gpus": args.gpus, "device": args.device, "results": out}))
    print(f"\n{args.model} at {args.gpus} {'GPUs' if args.device == 'cuda' else 'gloo ranks'}: {args.steps} steps a "
          "variant after a device sync; ratio of means against ddp\n")
    print("| variant | mean ms | median ms | host ms in backward() | ratio |")
    print("|---|---|---|---|---|")
    base = None
    for v, r in out:
        base = r["mean_ms"] if v == "ddp" else base  # the latest ddp run before this one
        if v.endswith(" profile"):
            continue
        ratio = f"{r['mean_ms'] / base:.3f}" if base else "-"
        print(f"| {v} | {r['mean_ms']:.2f} | {r['median_ms']:.2f} | {r['backward_host_ms']:.2f} | {ratio} |")
    for v, r in out:
        if v == "trainer":
            print(f"\ntrainer threads: {r['threads']}; commit interval {r['commit_interval']}")


if __name__ == "__main__":
    main()
