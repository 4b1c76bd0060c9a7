"""Where aborted process groups go: kept alive while the process trains, torn down off the caller's thread.

Tearing a gloo group down (its destructor or ``shutdown()``) blocks the calling thread until the group's pending
work ends, up to the collective timeout, and the last reference to a backend can go away on any thread at any
time (a DDP wrapper sits in a reference cycle, so the cyclic garbage collector frees its reducer, which holds
the group, wherever an allocation triggers a collection). So ``ProcessGroupWrapper.abort`` *retires* a group
here instead of destroying it (see ``_Graveyard``).
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Optional

logger = logging.getLogger("elastic_launcher.process_group")

__all__ = ["retire", "abort_nccl", "drain_reaper", "release_retired", "abandon_retired", "retired_groups",
           "give_up_build", "drain_given_up_builds", "before_exit"]


class _Reaper:
    """Tears groups down off the caller's thread (NCCL abort at once; gloo only on :func:`release_retired`)."""

    def __init__(self) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.pending = 0

    def submit(self, backend: str, impl) -> None:
        with self._lock:
            self.pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="elastic-pg-reaper", daemon=True)
                self._thread.start()
        self._q.put((backend, impl))

    def _loop(self) -> None:
        while True:
            backend, impl = self._q.get()
            try:
                if backend == "nccl":
                    impl.abort()
                else:
                    impl.shutdown()
            except Exception as e:  # noqa: BLE001 - a broken group may refuse a clean teardown
                logger.debug("teardown raised %s", e)
            del impl  # the last reference unless someone else (a retired group, DDP) holds it
            with self._lock:
                self.pending -= 1

    def drain(self, timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.pending == 0


class _Graveyard:
    """Keeps aborted groups alive while the process trains.

    Why: the last reference to a backend can go away on any thread, at any time (a DDP wrapper sits in a
    reference cycle, so its reducer, which holds the group, is freed by the cyclic garbage collector wherever
    an allocation triggers it). The gloo backend's destructor and ``shutdown()`` block the calling thread until
    the group's pending work ends, up to the collective timeout: the training thread then misses its commit
    points, or the heartbeat thread stops beating, and the peers declare the worker dead. So no gloo group is
    torn down during training; NCCL communicators are aborted at once (off the caller's
    thread), but their objects are kept too. :func:`release_retired` tears the retired groups down (for a
    process that goes on after training); :func:`abandon_retired` leaves them to the process exit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: list = []

    def retire(self, backend: str, pg, impl, aborted: bool = False) -> None:
        with self._lock:
            self._groups.append((backend, pg, impl))
        if backend == "nccl" and not aborted:
            _REAPER.submit(backend, impl)

    def take(self) -> list:
        with self._lock:
            groups, self._groups = self._groups, []
        return groups

    def __len__(self) -> int:
        return len(self._groups)


_REAPER = _Reaper()
_GRAVEYARD = _Graveyard()
_ABANDONED: list = []


def drain_reaper(timeout: timedelta = timedelta(seconds=10)) -> bool:
    """Waits until submitted teardowns finished; False if some teardown is still blocked after ``timeout``."""
    return _REAPER.drain(timeout)


def retired_groups() -> int:
    """Number of aborted groups kept alive (see :func:`release_retired`)."""
    return len(_GRAVEYARD)


def release_retired(timeout: timedelta = timedelta(seconds=10)) -> bool:
    """Tears every retired group down on the reaper thread and waits up to ``timeout``.

    Call only where a blocked teardown cannot hurt (training over, heartbeat stopped): a gloo teardown can
    block the caller until its collective timeout. Returns False if some teardown is still running.
    """
    for backend, pg, impl in _GRAVEYARD.take():
        del pg  # the wrapper's reference; the backend's last one goes with the reaper's item
        if backend == "nccl":
            continue  # aborted when retired; its objects are dropped here
        _REAPER.submit(backend, impl)
    return _REAPER.drain(timeout)


def abandon_retired() -> int:
    """Leaves the retired groups to the process exit (the OS closes their sockets); returns how many.

    For a worker that is about to exit: tearing gloo groups down (here or in the interpreter's final cleanup)
    could block for a collective timeout and delay the exit, and with it the release of the node. The
    references are pinned so that the interpreter's module cleanup never runs the destructors.
    """
    groups = _GRAVEYARD.take()
    if groups:
        _ABANDONED.append(groups)
        if len(_ABANDONED) == 1:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(_ABANDONED))  # never freed, not even at exit
    return len(groups)


def retire(backend: str, pg, impl, aborted: bool = False) -> None:
    """Keeps an aborted group alive (NCCL: aborted now, on the reaper thread, unless `aborted` says
    :func:`abort_nccl` did it already: a communicator is aborted once). Never blocks."""
    _GRAVEYARD.retire(backend, pg, impl, aborted)


def abort_nccl(impl) -> None:
    """Aborts an NCCL backend on the reaper thread while its group is still held (a peer died): its pending
    collectives end with an error instead of waiting for their timeout. Never blocks."""
    _REAPER.submit("nccl", impl)


class _GivenUpBuilds:
    """Threads still building a group that their worker gave up on (a member died mid-build, see
    ``EpochExecutor._build_watched``). Such a thread cannot be interrupted: it ends on its own when the backend's
    store wait or connect times out. A worker that exits meanwhile must wait for it: a daemon thread that comes
    back from C++ while the interpreter finalises is unwound by ``pthread_exit`` through C++ frames, and the
    process dies of SIGABRT ("terminate called without an active exception") after training finished (seen
    with gloo, whose store waits end at the collective timeout, on a loaded host)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def add(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def drain(self, timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            return not self._threads


_GIVEN_UP = _GivenUpBuilds()


def give_up_build(thread: threading.Thread) -> None:
    """Records a group build's thread that its worker gave up on (it ends on its own; see ``_GivenUpBuilds``)."""
    _GIVEN_UP.add(thread)


def drain_given_up_builds(timeout: timedelta = timedelta(seconds=10)) -> bool:
    """Waits up to ``timeout`` for the given-up builds' threads to end; False if one still runs."""
    return _GIVEN_UP.drain(timeout)


def before_exit(timeout: timedelta = timedelta(seconds=10)) -> None:
    """What a worker does before it exits: waits up to ``timeout`` in all for the NCCL aborts and for the group
    builds it gave up on (the process must not exit under one), then :func:`abandon_retired`."""
    t0 = time.monotonic()
    if not drain_reaper(timeout):
        logger.warning("group teardown still blocked after %s", timeout)
    left = max(timedelta(0), timeout - timedelta(seconds=time.monotonic() - t0))
    if not drain_given_up_builds(left):
        logger.warning("a group build given up on still runs after %s: the process may abort at exit", timeout)
    abandon_retired()
