"""FitLock: which process of the service fits the model, elected with an OS file lock.

The lock is an exclusive `fcntl.flock` on `<db>.fitlock` beside the SQLite database, always taken without
blocking: the process that gets it is the fitter and keeps it until it stops (or dies: the kernel drops the
lock with the process, and another worker gets it on its next try). flock locks belong to an open file
description, so two holders in one process (two ModelCaches, as the tests build them) exclude each other too.
A process forked from the holder does not inherit the right to fit: `held` is true only in the process that
took it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from datetime import timedelta
from pathlib import Path


def fit_lock_path(db_path: str) -> str:
    """`<db>.fitlock` beside the database (as `<db>.metrics/` is)."""
    path = Path(db_path)
    return str(path.with_name(path.name + ".fitlock"))


class FitLock:
    """The service-wide right to fit, held by at most one process at a time.

    Args:
        path: the lock file (created if missing; its content is the holder's pid, for admins).
    """

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None          # open while this process holds the lock
        self._pid: int | None = None         # the process that took it
        self._mutex = threading.Lock()       # the refit thread and an explicit refit() may both try

    @property
    def held(self) -> bool:
        return self._fd is not None and self._pid == os.getpid()

    def try_acquire(self, timeout: timedelta = timedelta(seconds=5)) -> bool:
        """Take the lock if no other holder has it; never waits for the other holder. True if held now.

        Args:
            timeout: how long to wait for another thread of this process that is trying at the same time.
        """
        if not self._mutex.acquire(timeout=timeout.total_seconds()):
            return False
        try:
            if self.held:
                return True
            if self._fd is not None:         # inherited by fork: drop this copy, or it would keep the
                with contextlib.suppress(OSError):   # parent's lock alive after the parent dies
                    os.close(self._fd)
                self._fd = self._pid = None
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd, self._pid = fd, os.getpid()
            return True
        finally:
            self._mutex.release()

    def release(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Give the lock up (closing the descriptor drops it); a no-op when not held."""
        if not self._mutex.acquire(timeout=timeout.total_seconds()):
            return
        try:
            if self.held:
                os.close(self._fd)
            self._fd = self._pid = None
        finally:
            self._mutex.release()
