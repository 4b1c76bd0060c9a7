"""Test seams shipped with the package: a fake group, a fault plan and a throughput model.

``FaultPlan().fail_at(rank, step)`` makes the worker that has rank ``rank`` at global step ``step`` kill itself
with SIGKILL in the middle of that step's backward pass (inside the communication hook, before the first
bucket's allreduce), or raise :class:`InjectedFault` when ``mode="raise"``. Pass it as
``ElasticTrainer(..., fault=plan)``. ``fail_at(rank, step, after_s=0.1)`` kills it that long after the step's
backward began instead (on a timer, wherever the worker is by then). ``fail_in_recovery("opened")`` kills the worker
right after its arrival opened a recovery (the survivor that once led it; #27.1), ``fail_in_recovery("adopted")``
right after it learnt the survivors' plan, before it builds that plan's group; ``fail_in_recovery("adopted", hang_s=30)``
sleeps there instead (hung but beating). ``fail_in_switch("vote")`` makes the
worker read the vote of the first commit point that switches to a resize as failed (as when its allreduce, or the
buffer broadcast after it, failed while its peers' finished): it recovers from the old epoch while they switch, so
the survivors split between the two plans. ``fail_in_switch("join")`` kills a newcomer as it starts receiving the
switch's state broadcast.

:class:`FakeProcessGroupWrapper` is a one-rank stand-in with the wrapper's interface: collectives complete at
once, ``fail_next()`` makes the next collective raise (to test error recording and votes without peers).

:class:`LinearThroughput` is the controller's throughput model for CPU testbeds, where nothing really scales
(``Controller(throughput=LinearThroughput())``, or ``elastic-launch --test-throughput linear``).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Optional

import torch

from elastic_launcher.errors import ElasticError, NotConfiguredError

__all__ = ["FaultPlan", "InjectedFault", "FakeProcessGroupWrapper", "LinearThroughput"]


class InjectedFault(ElasticError):
    """Raised by a :class:`FaultPlan` in ``raise`` mode."""


class FaultPlan:
    """Where to inject failures: a set of (rank, step) pairs.

    Args:
        mode: ``kill`` (SIGKILL this process) or ``raise``.
    """

    def __init__(self, mode: str = "kill") -> None:
        if mode not in ("kill", "raise"):
            raise ValueError(f"fault mode {mode!r} is not kill or raise")
        self.mode = mode
        self._at: set[tuple[int, int]] = set()
        self._after: dict[tuple[int, int], float] = {}
        self._in_recovery: set[str] = set()
        self._hang_in_recovery: dict[str, float] = {}
        self._in_switch: set[str] = set()
        self.fired = 0

    def fail_at(self, rank: int, step: int, after_s: float = 0.0) -> "FaultPlan":
        """Adds a failure of rank ``rank`` at global step ``step`` (``after_s`` later: kill mode only, on a timer);
        returns self for chaining."""
        if after_s and self.mode != "kill":
            raise ValueError("a delayed fault kills: use mode='kill'")
        self._at.add((rank, step))
        if after_s:
            self._after[(rank, step)] = after_s
        return self

    def fail_in_recovery(self, event: str, hang_s: float = 0.0) -> "FaultPlan":
        """Kills this worker at a recovery step: ``opened`` (its arrival opened the recovery) or ``adopted`` (it has
        the survivors' plan, before building its group); with ``hang_s`` its training thread sleeps that long there
        instead, once, while its heartbeat beats on (hung but beating). Returns self for chaining."""
        if event not in ("opened", "adopted") or self.mode != "kill" or hang_s < 0:
            raise ValueError(f"fail_in_recovery({event!r}, hang_s={hang_s!r}) in mode {self.mode!r}: expected "
                             "opened or adopted, kill, hang_s >= 0")
        if hang_s:
            self._hang_in_recovery[event] = hang_s
        else:
            self._in_recovery.add(event)
        return self

    def fail_in_switch(self, event: str) -> "FaultPlan":
        """At the first switch to a resize: ``vote`` (this worker reads the vote as failed and recovers from the old
        epoch, once) or ``join`` (kill mode: a newcomer dies as the state broadcast begins); returns self."""
        if event not in ("vote", "join") or (event == "join" and self.mode != "kill"):
            raise ValueError(f"fail_in_switch({event!r}) in mode {self.mode!r}: expected vote, or join in kill mode")
        self._in_switch.add(event)
        return self

    def on_switch(self, event: str) -> bool:
        """The trainer's seam at a switch (``vote``: True = read the vote as failed) and the executor's (``join``);
        each event fires once."""
        if event not in self._in_switch:
            return False
        self._in_switch.discard(event)
        self.fired += 1
        if event == "join":
            os.kill(os.getpid(), signal.SIGKILL)
        return True

    def on_recovery(self, event: str, epoch: int) -> None:
        """The membership's seam (``Membership(on_recovery=...)``)."""
        hang = self._hang_in_recovery.pop(event, 0.0)
        if hang:
            self.fired += 1
            time.sleep(hang)
        if event in self._in_recovery:
            self.fired += 1
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_fail(self, rank: int, step: int) -> None:
        """Fails if (rank, step) is planned; each pair fires once."""
        if (rank, step) not in self._at:
            return
        self._at.discard((rank, step))
        self.fired += 1
        after = self._after.pop((rank, step), 0.0)
        if after:
            threading.Timer(after, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"injected fault at rank {rank} step {step}")


class _DoneWork:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._t = tensors

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        f: torch.futures.Future = torch.futures.Future()
        f.set_result(self._t)
        return f


class FakeProcessGroupWrapper:
    """A world of one with the :class:`ProcessGroupWrapper` interface (no store, no peers)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        self.timeout = timeout
        self.backend = "fake"
        self.device = torch.device("cpu")
        self.configure_count = 0
        self._configured = False
        self._fail_next = False
        self._error: Optional[Exception] = None

    def configure(self, store_addr, rank: int, world_size: int, timeout: Optional[timedelta] = None) -> None:
        if world_size != 1 or rank != 0:
            raise ValueError(f"fake group is a world of one, got rank {rank}/{world_size}")
        self.configure_count += 1
        self._configured, self._error = True, None

    def fail_next(self) -> None:
        """Makes the next collective raise."""
        self._fail_next = True

    def _run(self, tensors: list[torch.Tensor]) -> _DoneWork:
        if not self._configured:
            raise NotConfiguredError("fake group used before configure()")
        if self._fail_next:
            self._fail_next = False
            raise RuntimeError("injected collective failure")
        return _DoneWork(tensors)

    def allreduce(self, tensors, op=None):
        return self._run(tensors)

    def broadcast(self, tensors, src: int):
        return self._run(tensors)

    def abort(self) -> None:
        self._configured = False

    shutdown = abort

    def report_error(self, e: Exception) -> None:
        self._error = self._error or e

    fail = report_error  # nothing to abort in a fake

    def errored(self) -> Optional[Exception]:
        return self._error

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    @property
    def configured(self) -> bool:
        return self._configured


class LinearThroughput:
    """A throughput model (``steering.ThroughputModel``) for CPU testbeds, where nothing really scales: samples/s
    linear in workers from the first measurement (scaling efficiency 1.0), so a test can exercise grow. Injected
    with ``Controller(throughput=LinearThroughput())`` or ``elastic-launch --test-throughput linear``; never for
    production."""

    def samples_per_s(self, measured: float, workers: int, history) -> float:
        if not history:
            return measured
        base = history[0]
        return base.samples_per_s / base.workers * workers
