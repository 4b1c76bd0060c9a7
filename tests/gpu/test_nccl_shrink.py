"""ProcessGroupWrapper.shrink on NCCL (GPU host only): the communicator shrink path, and its fallback's signal.

N = min(4, GPUs) processes build one NCCL group; the last rank drops out and the others shrink the group without
it. Where the backend says it can shrink (``supports_shrinking``), the child group must work at once: ranks renumbered
in order, an all-reduce over the survivors only. Where it cannot, ``shrink`` must raise the ProcessGroupError that
makes recovery fall back to a fresh group. Prints which path this torch/NCCL took and how long each build took.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

N = min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 4


def _worker(rank: int, port: int, out: "mp.Queue") -> None:
    try:
        _shrink_or_leave(rank, port, out)
    except BaseException as e:  # report it, so the test fails on this error and not on a queue timeout
        out.put({"rank": rank, "crash": f"{type(e).__name__}: {e}"})
        raise


def _shrink_or_leave(rank: int, port: int, out: "mp.Queue") -> None:
    from elastic_launcher.errors import ProcessGroupError
    from elastic_launcher.process_group import ProcessGroupWrapper, StoreAddr, drain_reaper

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    t = timedelta(seconds=30)
    g = ProcessGroupWrapper("nccl", dev, t, t)
    t0 = time.perf_counter()
    g.configure(StoreAddr("127.0.0.1", port, "shrink-test"), rank, N)
    build_s = time.perf_counter() - t0
    x = torch.full((4,), float(rank + 1), device=dev)
    g.allreduce([x]).wait()
    res = {"rank": rank, "full_sum": x[0].item(), "build_s": build_s}
    if rank == N - 1:  # the excluded rank never calls shrink
        g.abort()
        assert drain_reaper(timedelta(seconds=30))
        out.put(res)
        return
    t0 = time.perf_counter()
    try:
        child = g.shrink([N - 1], abort=False)
    except ProcessGroupError as e:
        res.update(supported=False, error=str(e))
    else:
        res.update(supported=True, shrink_s=time.perf_counter() - t0, new_rank=child.rank(), new_size=child.size())
        y = torch.full((4,), float(rank + 1), device=dev)
        child.allreduce([y]).wait()
        res["child_sum"] = y[0].item()
        child.abort()
    g.abort()
    # the aborts run on the reaper thread: let them finish before the interpreter (and CUDA) shut down, as
    # ElasticTrainer.close does (an abort still running at exit ends the process with SIGABRT)
    assert drain_reaper(timedelta(seconds=30))
    out.put(res)


def test_nccl_shrink_drops_the_last_rank():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, server.port, out)) for r in range(N)]
    for p in procs:
        p.start()
    try:
        res = {r["rank"]: r for r in (out.get(timeout=120) for _ in range(N))}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert not [r["crash"] for r in res.values() if "crash" in r]
    assert [p.exitcode for p in procs] == [0] * N
    assert all(r["full_sum"] == N * (N + 1) / 2 for r in res.values())
    survivors = [res[r] for r in range(N - 1)]
    supported = {r["supported"] for r in survivors}
    assert len(supported) == 1, "ranks disagree on whether the backend can shrink"
    if supported.pop():
        assert [(r["new_rank"], r["new_size"]) for r in survivors] == [(r, N - 1) for r in range(N - 1)]
        assert all(r["child_sum"] == (N - 1) * N / 2 for r in survivors)
        print(f"ncclCommShrink {N}->{N - 1}: shrink {max(r['shrink_s'] for r in survivors):.3f} s, "
              f"fresh build {max(r['build_s'] for r in res.values()):.3f} s")
    else:
        assert all("cannot shrink" in r["error"] for r in survivors), survivors[0]["error"]
        print(f"no shrink on this torch/NCCL: {survivors[0]['error']}")
