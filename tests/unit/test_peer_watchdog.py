"""The peer watchdog: the heartbeat thread fails an epoch whose peer stopped beating (what wakes an NCCL
collective stuck on a dead peer; GPU check in tests/gpu/test_nccl_rebuild.py). CPU parts: who is reported,
when, how often; what failing a group does; which group the trainer fails."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch

from elastic_launcher.errors import PeerFailure
from elastic_launcher.membership import Coordinator
from elastic_launcher.process_group import ProcessGroupWrapper
from elastic_launcher.epochs import PeerFailureRelay
from tests.unit.test_runtime_units import _member, store  # noqa: F401 - store is a fixture


def _three(store, reports):
    """Epoch of a, b, c, all beating; a watches its peers (0.3 s timeout) and reports to `reports`."""
    plan = Coordinator(store).start(["a", "b", "c"])
    a = _member(store, "a", heartbeat_timeout=timedelta(seconds=0.3), on_peer_failure=reports)
    b, c = _member(store, "b"), _member(store, "c")
    for m in (a, b, c):
        m.start()
    a.watch(plan)
    return plan, a, b, c


class _Reports:
    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    def __call__(self, epoch, reason):
        self.calls.append((epoch, reason))

    def wait(self, n: int, timeout: float = 5.0) -> list:
        deadline = time.monotonic() + timeout
        while len(self.calls) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.calls


def test_a_peer_that_stops_beating_is_reported_once_per_epoch(store):
    reports = _Reports()
    plan, a, b, c = _three(store, reports)
    try:
        time.sleep(0.8)
        assert reports.calls == []  # everyone beats
        c.stop()
        (epoch, reason), = reports.wait(1)  # within wait's 5 s; the delay: bench/unit_timings.py
        assert epoch == plan.id and reason.startswith("worker c has not beaten for")
        b.stop()
        time.sleep(0.8)
        assert len(reports.calls) == 1  # the epoch is failed already
    finally:
        a.stop(), b.stop(), c.stop()


def test_a_leaver_is_not_reported_and_a_recovery_begun_elsewhere_is(store):
    reports = _Reports()
    plan, a, b, c = _three(store, reports)
    try:
        c.mark_left()
        c.stop()
        time.sleep(1.0)
        assert reports.calls == []
        store.set(f"elastic/recover/{plan.id}/leader", "b")  # b's vote failed: it leads the recovery
        (epoch, reason), = reports.wait(1)
        assert (epoch, reason) == (plan.id, f"a recovery of epoch {plan.id} has begun")
    finally:
        a.stop(), b.stop(), c.stop()


def test_beats_are_judged_by_this_hosts_clock_not_the_peers(store):
    """A peer whose clock is an hour behind still beats: its value changes, so it is alive."""
    plan = Coordinator(store).start(["a", "b"])
    reports = _Reports()
    a = _member(store, "a", heartbeat_timeout=timedelta(seconds=0.3), on_peer_failure=reports)
    a.start()
    stop = threading.Event()

    def skewed_beats():
        while not stop.wait(0.05):
            store.set("elastic/hb/b", repr(time.time() - 3600))

    beater = threading.Thread(target=skewed_beats)
    beater.start()
    try:
        a.watch(plan)
        time.sleep(1.0)
        assert reports.calls == []
        stop.set()
        beater.join()
        (epoch, reason), = reports.wait(1)
        assert epoch == plan.id and "worker b" in reason
    finally:
        stop.set()
        a.stop()


def test_watching_a_new_epoch_rearms_the_report(store):
    coord = Coordinator(store)
    first = coord.start(["a", "b"])
    reports = _Reports()
    a = _member(store, "a", heartbeat_timeout=timedelta(seconds=0.2), on_peer_failure=reports)
    b = _member(store, "b")
    a.start(), b.start()
    try:
        a.watch(first)
        b.stop()
        reports.wait(1)
        second = coord.request_resize(["a", "b"])  # b is still a member: its silence is reported again
        a.watch(second)
        calls = reports.wait(2)
        assert [e for e, _ in calls] == [first.id, second.id]
    finally:
        a.stop(), b.stop()


def test_failing_a_gloo_group_records_the_error_and_keeps_it_usable_for_abort(store):
    w = ProcessGroupWrapper("gloo", timeout=timedelta(seconds=5), connect_timeout=timedelta(seconds=5))
    w.configure(f"127.0.0.1:{store.port}/fail", 0, 1)
    err = PeerFailure("epoch 3: worker b has not beaten for 5.1 s")
    w.fail(err)
    assert w.errored() is err and w.configured  # gloo: recorded only, the group object stays
    t = torch.ones(1)
    w.allreduce([t]).wait()  # a world of one still answers; the vote reads errored() anyway
    w.abort()
    assert not w.configured and w.errored() is err
    w.fail(err)  # on a group already given up: records only, never raises


class _Group:
    """Records what failing it was asked to record (``ProcessGroupWrapper.fail``'s interface)."""

    def __init__(self):
        self.failed: list[BaseException] = []

    def fail(self, err):
        self.failed.append(err)


def test_the_relay_fails_only_the_group_of_the_reported_epoch():
    relay, group = PeerFailureRelay(), _Group()
    relay(7, "worker b has not beaten for 3.0 s")  # before any epoch is entered: nothing to fail
    relay.watch(7, group)
    relay(6, "worker b has not beaten for 3.0 s")  # an epoch already left
    assert group.failed == []
    relay(7, "worker b has not beaten for 3.0 s")
    (err,) = group.failed
    assert isinstance(err, PeerFailure) and str(err) == "epoch 7: worker b has not beaten for 3.0 s"


def test_a_failing_peer_watch_turns_itself_off_and_the_beat_goes_on(store, monkeypatch):
    from elastic_launcher.peer_watch import PeerWatch

    def broken(self, k, epoch, members):
        raise RuntimeError("multi_get not supported")

    monkeypatch.setattr(PeerWatch, "check", broken)
    reports = _Reports()
    plan, a, b, c = _three(store, reports)
    try:
        first = store.get("elastic/hb/a")
        time.sleep(0.3)
        assert store.get("elastic/hb/a") != first and reports.calls == []
    finally:
        a.stop(), b.stop(), c.stop()


def test_a_vote_an_aborted_communicator_hands_back_untouched_counts_as_failed():
    from elastic_launcher.trainer import VoteTally
    # 4 ranks, all fine, all ready for epoch 9, proposing 8 steps to the next commit point: SUM of [9, 1, 1, 1, 8]
    assert VoteTally.read([36, 4, 4, 4, 32], 4, 9) == VoteTally(True, True, True, True, 32)
    # the same vote on an aborted NCCL communicator: the buffer comes back as this rank sent it
    untouched = VoteTally.read([9, 1, 1, 1, 8], 4, 9)
    assert not untouched.counted and not untouched.collectives_ok and not untouched.ready
    # one rank saw a collective fail; one rank had a local error; one rank not ready yet
    assert VoteTally.read([36, 3, 4, 4, 32], 4, 9).collectives_ok is False
    assert VoteTally.read([36, 4, 3, 4, 32], 4, 9) == VoteTally(True, True, False, True, 32)
    assert VoteTally.read([27, 4, 4, 4, 32], 4, 9).ready is False
    assert VoteTally.read([0, 4, 4, 4, 32], 4, 0).ready is False  # nothing prepared: no switch
    assert VoteTally.read([1, 1, 1, 1, 3], 1, 1) == VoteTally(True, True, True, True, 3)  # a world of one
