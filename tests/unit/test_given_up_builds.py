"""A group build that a recovery gave up on runs on until the backend's timeout; the worker's close() waits for it.

Before: the thread was left alone, and on a loaded host it came back from gloo's store wait while the worker's
interpreter finalised; pthread_exit unwound it through C++ frames and the worker died of SIGABRT after training
(test_runtime_elastic's "dies before the recovered group is built", 3 copies at once: w1, w2 exit -6).
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

from elastic_launcher.epochs import EpochExecutor
from elastic_launcher.process_group import drain_given_up_builds


def _executor(build_done: threading.Event, silent: list[str]) -> EpochExecutor:
    ex = EpochExecutor.__new__(EpochExecutor)  # only what _build_watched and _round_watch read
    ex.new_group = lambda plan: build_done.wait(10) and SimpleNamespace(abort=lambda: None)  # a stand-in group
    ex.membership = SimpleNamespace(silent_members=lambda plan: silent, recovery_begun=lambda plan: False,
                                    heartbeat_interval=timedelta(seconds=0.02), arrival_timeout=timedelta(seconds=60),
                                    clock=time.monotonic)
    return ex


def _build(ex: EpochExecutor, plan):
    return ex._build_watched(plan, ex._round_watch(plan, time.monotonic() + 30))


def test_a_build_given_up_on_is_waited_for_until_its_thread_ends():
    done = threading.Event()
    group, why = _build(_executor(done, ["w0"]), SimpleNamespace(id=7))
    assert group is None and why == "silent: w0"
    assert drain_given_up_builds(timedelta(seconds=0.1)) is False  # still in the (stand-in) backend
    done.set()
    assert drain_given_up_builds(timedelta(seconds=10)) is True


def test_a_build_that_finishes_is_not_waited_for():
    done = threading.Event()
    done.set()
    group, why = _build(_executor(done, []), SimpleNamespace(id=8))
    assert group is not None and why == ""
    assert drain_given_up_builds(timedelta(0)) is True  # nothing given up: nothing to wait for
