"""Telemetry: per-bucket allreduce timings (a DDP communication hook), step times, tensor profile.

Everything comes out as predictor observation records in the shapes of design.md:

* ``{"kind": "collective", "op": "allreduce", "link": ..., "world": W, "bytes": B, "seconds": s, "gpu": ...}``
  one record per (world, bucket bytes), the median of the timings collected since the last :meth:`drain`;
* ``{"kind": "step", "profile": ..., "gpu": ..., "layout": [...], "intra_link": ..., "inter_link": ...,
  "per_gpu_batch": b, "iter_s": s}`` the median step time per (layout, per-rank batch);
* :func:`tensor_profile` gives the body of ``POST /v1/profiles``.

The communication hook is also where the elastic runtime weights heterogeneous batches: each rank's bucket is
scaled by ``local_samples / step_samples`` before a SUM allreduce, which gives the exact global mean gradient
for a local-mean loss (DDP's default divides by the world size, wrong when batches differ). The reduction is a SUM,
as on DDP's own path (NCCL's AVG is a suspect of the ResNet-50 gap in bench/results/gpu_transition.md); a share of
1 (a world of one) needs no scaling. A failed
allreduce is recorded on the group (``report_error``) and the bucket is returned unreduced, so backward
completes and the commit vote decides (errors recorded, then voted on).

On CUDA the hook times with events (read lazily at :meth:`drain`); on CPU with the host clock.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from elastic_launcher.process_group import ProcessGroupWrapper

__all__ = ["HookState", "elastic_allreduce_hook", "Telemetry", "tensor_profile"]


@dataclass
class Telemetry:
    """Collects timings and turns them into observation records.

    Attributes:
        profile: model profile name (``#ELASTIC model=``).
        gpu: GPU type string (e.g. ``H100``), ``cpu`` for CPU runs.
        intra_link: link class within a node (e.g. ``nvlink``, ``shm``).
        inter_link: link class between nodes (e.g. ``ib``, ``socket``).
        multi_node: the group spans several nodes (collectives are then limited by ``inter_link``).
        max_samples: keep at most this many raw timings per key between drains.
        time_every: time the gradient allreduces of one step in this many (CUDA events cost host time per
            bucket; step times are recorded for every step).

    A step record carries ``inter_link`` whenever its layout spans several nodes (the predictor requires it
    there). Under elastic-launch the controller relabels the records with the real layout and the cluster's
    links anyway (``observations.relabel``): the trainer only knows its world size.
    """

    profile: str = "unknown"
    gpu: str = "cpu"
    intra_link: str = "shm"
    inter_link: str = "socket"
    multi_node: bool = False
    max_samples: int = 256
    time_every: int = 8
    _coll: dict = field(default_factory=dict)
    _events: list = field(default_factory=list)
    _steps: dict = field(default_factory=dict)

    def record_collective(self, world: int, nbytes: int, seconds: float) -> None:
        if world < 2:  # one process: the all-reduce used no link, so it is no link's timing
            return
        xs = self._coll.setdefault((world, nbytes), [])
        if len(xs) < self.max_samples:
            xs.append(seconds)

    def record_cuda_collective(self, world: int, nbytes: int, start, end) -> None:
        if len(self._events) < self.max_samples * 16:
            self._events.append((world, nbytes, start, end))

    def record_step(self, layout: Sequence[int], per_gpu_batch: int, seconds: float) -> None:
        xs = self._steps.setdefault((tuple(layout), per_gpu_batch), [])
        if len(xs) < self.max_samples:
            xs.append(seconds)

    def drain(self) -> list[dict]:
        """Returns observation records for everything collected so far and clears it."""
        for world, nbytes, a, b in self._events:
            b.synchronize()
            self.record_collective(world, nbytes, a.elapsed_time(b) / 1000.0)
        self._events.clear()
        link = self.inter_link if self.multi_node else self.intra_link
        out = [{"kind": "collective", "op": "allreduce", "link": link, "world": w, "bytes": nb,
                "seconds": statistics.median(xs), "gpu": self.gpu}
               for (w, nb), xs in sorted(self._coll.items()) if xs]
        for (layout, b), xs in sorted(self._steps.items()):
            rec = {"kind": "step", "profile": self.profile, "gpu": self.gpu, "layout": list(layout),
                   "intra_link": self.intra_link, "per_gpu_batch": b, "iter_s": statistics.median(xs)}
            if len(layout) > 1:
                rec["inter_link"] = self.inter_link
            out.append(rec)
        self._coll.clear()
        self._steps.clear()
        return out


class HookState:
    """Per-DDP-wrap state of :func:`elastic_allreduce_hook`.

    Attributes:
        group: the wrapper whose group reduces the buckets.
        telemetry: where timings go (None: no timing).
        scale: multiplier applied to the local bucket before the SUM (set every step by the trainer).
        first_sync_t: ``time.perf_counter()`` at the step's first bucket (the local compute before any wait
            on peers ends about here); the trainer clears it when it hands out a batch.
        timed: time this step's buckets (the trainer sets it every step from ``Telemetry.time_every``).
        fault: the ``fail_at`` test seam (``maybe_fail(rank, step)``) or None.
        step_fn: returns the global step (the fault seam's clock).
    """

    def __init__(self, group: ProcessGroupWrapper, telemetry: Optional[Telemetry] = None, fault=None,
                 step_fn: Optional[Callable[[], int]] = None) -> None:
        self.group = group
        self.telemetry = telemetry
        self.fault = fault
        self.step_fn = step_fn
        self.scale = 1.0 / max(group.size(), 1)
        self.buckets: dict[int, int] = {}  # bucket index -> bytes (the model's bucket layout)
        self.first_sync_t: Optional[float] = None
        self.timed = True


def _done(buf: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def elastic_allreduce_hook(state: HookState, bucket):  # no return annotation: DDP compares it literally
    """DDP communication hook: weighted SUM allreduce with error recording and timing."""
    if state.first_sync_t is None:
        state.first_sync_t = time.perf_counter()
    buf = bucket.buffer()
    group = state.group
    if group.errored() is not None:
        return _done(buf)
    world = group.size()
    if state.scale != 1.0:  # a world of one needs no scaling
        buf.mul_(state.scale)
    nbytes = buf.numel() * buf.element_size()
    state.buckets[bucket.index()] = nbytes
    tel = state.telemetry if state.timed and world > 1 else None  # one process: no link to time
    cuda = buf.is_cuda
    t0 = time.perf_counter()
    ev0 = None
    if tel is not None and cuda:
        ev0 = torch.cuda.Event(enable_timing=True)
        ev0.record()
    try:
        fut = group.allreduce([buf]).get_future()
    except Exception as e:  # noqa: BLE001 - recorded, voted on at the commit point
        group.report_error(e)
        return _done(buf)

    def finish(f: torch.futures.Future) -> torch.Tensor:
        try:
            f.value()
        except Exception as e:  # noqa: BLE001
            group.report_error(e)
            return buf
        if tel is not None:
            if ev0 is not None:
                ev1 = torch.cuda.Event(enable_timing=True)
                ev1.record()
                tel.record_cuda_collective(world, nbytes, ev0, ev1)
            else:
                tel.record_collective(world, nbytes, time.perf_counter() - t0)
        return buf

    return fut.then(finish)


def tensor_profile(model: torch.nn.Module, name: str, bucket_bytes: Optional[Sequence[int]] = None) -> dict:
    """The ``POST /v1/profiles`` body for ``model``: every parameter's name, numel and dtype (+ DDP buckets)."""
    prof = {"name": name, "tensors": [{"name": n, "numel": p.numel(), "dtype": str(p.dtype).replace("torch.", "")}
                                      for n, p in model.named_parameters() if p.requires_grad]}
    if bucket_bytes:
        prof["buckets"] = [int(b) for b in bucket_bytes]
    return prof
