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
from elastic_launcher.rendezvous_state import RecordStore
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


class _Stepped:
    """Watcher `a` (0.3 s timeout) over an epoch of a and `peers`, whose beats the test writes, on a clock the test
    steps (#26.7: no real-time window; a host too loaded to run the watcher's thread for a while only delays it):
    a peer's beat changes with every step it beats in, and the watcher's clock moves only with the steps, so a
    beating peer is never silent for longer than one step however rarely the watcher runs."""

    def __init__(self, store, peers, reports, start: float = 0.0):
        from elastic_launcher.peer_watch import BeatClock
        self.store, self.peers, self.reports, self.now, self.n, self.start = store, peers, reports, 0.0, 0, start
        self.plan = Coordinator(store).start(["a", *peers])
        self.beat(peers)
        self.a = _member(store, "a", heartbeat_timeout=timedelta(seconds=0.3), on_peer_failure=reports)
        self.a.beats = BeatClock(clock=lambda: self.now)
        self.a.start()
        self.a.watch(self.plan)

    def beat(self, peers) -> None:
        self.n += 1
        for p in peers:
            self.store.set(f"elastic/hb/{p}", repr(self.start + self.n))

    def steps(self, n: int, beating, until_reports: int | None = None) -> None:
        """``n`` steps of 0.1 s with ``beating`` beating in each (stops early once ``until_reports`` came)."""
        for _ in range(n):
            if until_reports is not None and len(self.reports.calls) >= until_reports:
                return
            self.beat(beating)
            self.now += 0.1
            time.sleep(0.01)   # the watcher's turn (it checks every 0.02 s; missing some changes nothing)


def test_a_peer_that_stops_beating_is_reported_once_per_epoch(store):
    reports = _Reports()
    w = _Stepped(store, ["b", "c"], reports)
    try:
        w.steps(10, ["b", "c"])
        assert reports.calls == []  # everyone beats
        w.steps(200, ["b"], until_reports=1)        # c stops: reported once 0.3 s of steps passed without its beat
        (epoch, reason), = reports.wait(1)
        assert epoch == w.plan.id and reason.startswith("worker c has not beaten for")
        w.steps(10, [])                             # b stops too
        assert len(reports.calls) == 1  # the epoch is failed already
    finally:
        w.a.stop()


def test_a_leaver_is_not_reported_and_a_recovery_begun_elsewhere_is(store):
    reports = _Reports()
    w = _Stepped(store, ["b", "c"], reports)
    try:
        store.set("elastic/left/c", "1")            # c left at a commit point, then stopped beating
        w.steps(20, ["b"])
        assert reports.calls == []
        RecordStore(store).update(lambda r: r.arrived(w.plan.id, "b"))  # b's vote failed: it opens the recovery
        (epoch, reason), = reports.wait(1)
        assert (epoch, reason) == (w.plan.id, f"a recovery of epoch {w.plan.id} has begun")
    finally:
        w.a.stop()


def test_beats_are_judged_by_this_hosts_clock_not_the_peers(store):
    """A peer whose clock is an hour behind still beats: its value changes, so it is alive."""
    reports = _Reports()
    w = _Stepped(store, ["b"], reports, start=time.time() - 3600)
    try:
        w.steps(20, ["b"])
        assert reports.calls == []
        w.steps(200, [], until_reports=1)
        (epoch, reason), = reports.wait(1)
        assert epoch == w.plan.id and "worker b" in reason
    finally:
        w.a.stop()


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
