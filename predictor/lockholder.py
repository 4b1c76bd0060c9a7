"""The thread that holds SQLite's write lock in a process that yields the CPU (issue #24, item 11).

The side pool's processes run at nice 10 so that, on a busy host, their parsing, credential checks and fits yield
the CPU to the plan pool. But a write they make holds the database's one write lock, and the hook's /v1/plan
waits for that lock to store its decision: a lock holder at nice 10 beside one busy task at nice 0 gets about a
tenth of a core, so a 4096-row write held the lock 330-450 ms instead of 55-76 ms, and the plan waited all of it
(a priority inversion; #24.11's 20,480 rows of one job took the victim's p99 to 102.8 ms on a loaded host).

On Linux the nice value belongs to each thread, and a thread inherits its creator's. So a side pool worker
starts this module's one thread before it lowers its priority (`start`, then `os.nice`): every later thread, the
request threads and the refit thread, and what they run, are niced; this one is not. The store runs each write
transaction an untrusted client can size (observations, profiles, decisions) in it (`current().run`), so the
lock is held at the plan pool's priority while everything else the side pool does still yields. The request
thread prepares the rows (JSON) before handing the transaction over, so the handover adds only a queue hop.

One thread serving a queue would take the lock again the instant it let go, while a writer of another process
(the hook's decision) polls for it only every `store.WRITE_POLL_S`: under a stream of writes the plan could miss
every release (item 13's four writers: victim p99 up to 212 ms). So when another transaction is already queued,
the holder waits `YIELD_S` (two polls) before taking the lock again: a waiting writer elsewhere gets it in between.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")

YIELD_S = 0.004   # between two queued transactions: two of store.WRITE_POLL_S, a waiting writer's poll interval


class LockHolder:
    """One daemon thread that runs the callables handed to `run`, one at a time, in the order given."""

    def __init__(self, name: str = "sqlite-lock-holder", yield_s: float = YIELD_S,
                 sleep: Callable[[float], None] = time.sleep):
        self.yield_s, self._sleep = yield_s, sleep
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        """The thread's kernel id (its nice value: /proc/self/task/<id>/stat)."""
        return self._thread.native_id

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed back to the caller, which raises it
                    future.set_exception(exc)
            if not self._jobs.empty():       # back to back: leave another process's waiting writer the lock
                self._sleep(self.yield_s)

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the holder's thread; returns its result or raises what it raised. Called from the holder's
        own thread (a transaction inside one), runs it there at once."""
        if threading.get_ident() == self._thread.ident:
            return fn()
        future: Future = Future()
        self._jobs.put((fn, future))
        return future.result()


_holder: tuple[int, LockHolder] | None = None     # (the pid that started it, the holder): a fork has no thread


def start() -> LockHolder:
    """This process's lock holder, started now if it has none; call it before lowering the process's priority."""
    global _holder
    if _holder is None or _holder[0] != os.getpid():
        _holder = (os.getpid(), LockHolder())
    return _holder[1]


def current() -> LockHolder | None:
    """The lock holder `start` gave this process, or None (the store then writes in the calling thread)."""
    return _holder[1] if _holder is not None and _holder[0] == os.getpid() else None
