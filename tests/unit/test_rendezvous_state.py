"""The membership record (#27.1): its transitions, the recovery decision on the latest record, and the
compare-and-set that fences every change. Pure parts first (no store, no clock), then the store backend, then
survivors recovering on a real store with clocks the test steps."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_launcher.errors import InvalidPlan, LeftGroup, ResizeConflict
from elastic_launcher.membership import Coordinator, Membership
from elastic_launcher.peer_watch import BeatClock
from elastic_launcher.rendezvous_state import (Liveness, MembershipRecord, Plan, RecordStore, Recovery,
                                               RecoveryStepKind, decide_recovery_step)

A, D, U = Liveness.ALIVE, Liveness.DEAD, Liveness.UNKNOWN


def _started(*members: str) -> MembershipRecord:
    return MembershipRecord().started(members)


# ---- transitions ------------------------------------------------------------------------------------------------
def test_every_transition_bumps_the_version_and_round_trips():
    r0 = _started("a", "b")
    r1 = r0.resized(["a", "b", "c"], base=r0.epoch.id)
    r2 = r1.switched(r1.pending.id)
    r3 = r2.arrived(r2.epoch.id, "b")
    r4 = r3.recovered(r3.epoch.id, ["b"])
    assert [r.version for r in (r0, r1, r2, r3, r4)] == [1, 2, 3, 4, 5]
    assert (r2.epoch, r2.prev, r2.pending) == (r1.pending, r0.epoch, None)
    assert r3.recovery == Recovery(r2.epoch.id, ("b",))
    assert (r4.epoch.members, r4.epoch.prev, r4.epoch.kind, r4.prev, r4.recovery) == \
        (("b",), r2.epoch.id, "recovery", r2.epoch, None)
    assert len({r.epoch.id for r in (r0, r2, r4)}) == 3 and r4.seq == r4.epoch.id
    for r in (r0, r1, r2, r3, r4):
        assert MembershipRecord.from_json(r.to_json()) == r


def test_a_resize_is_refused_while_one_is_pending_or_a_recovery_is_under_way():
    r0 = _started("a", "b")
    r1 = r0.resized(["a", "b", "c"], r0.epoch.id)
    with pytest.raises(ResizeConflict, match=f"epoch {r0.epoch.id} already has successor plan {r1.pending.id}"):
        r1.resized(["a"], r0.epoch.id)
    with pytest.raises(ResizeConflict):
        r0.arrived(r0.epoch.id, "a").resized(["a"], r0.epoch.id)
    with pytest.raises(InvalidPlan, match="keeps no member"):
        r0.resized(["x"], r0.epoch.id)
    with pytest.raises(InvalidPlan, match="has a plan already"):
        r0.started(["a"])
    assert r0.switched(99) is r0  # nothing pending: nothing to note


def test_a_recovery_supersedes_a_pending_resize_and_notes_a_switch_it_proves():
    r0 = _started("a", "b")
    r1 = r0.resized(["a", "b", "c"], r0.epoch.id)
    # a failure before the switch: the resize is dropped
    assert r1.arrived(r0.epoch.id, "a").pending is None
    # a failure after the switch, before its rank 0 noted it (it died): the arrival notes the switch first
    r2 = r1.arrived(r1.pending.id, "c")
    assert (r2.epoch, r2.prev, r2.pending, r2.recovery) == (r1.pending, r0.epoch, None, Recovery(r1.pending.id, ("c",)))


# ---- the recovery decision ---------------------------------------------------------------------------------------
FAILED = ("a", "b", "c", "d")


@pytest.mark.parametrize("arrived, seen, kind, survivors", [
    ((), {}, RecoveryStepKind.ARRIVE, None),                                   # first to come: opens it
    (("b",), {}, RecoveryStepKind.ARRIVE, None),                               # opened by b: joins it
    (("a",), {"b": U, "c": D, "d": D}, RecoveryStepKind.WAIT, None),          # b neither alive nor dead yet
    (("a", "b"), {"b": U, "c": D, "d": D}, RecoveryStepKind.WAIT, None),      # b arrived, no beat since
    (("a", "b"), {"b": A, "c": D, "d": D}, RecoveryStepKind.DECIDE, ("a", "b")),
    (("d", "a", "c"), {"b": D, "c": A, "d": A}, RecoveryStepKind.DECIDE, ("a", "c", "d")),  # the failed order
    (("b", "a"), {"b": D, "c": D, "d": D}, RecoveryStepKind.DECIDE, ("a",)),  # b opened it and died
])
def test_decide_recovery_step(arrived, seen, kind, survivors):
    rec = _started(*FAILED)
    failed = rec.epoch
    for w in arrived:
        rec = rec.arrived(failed.id, w)
    step = decide_recovery_step(rec, failed, "a", seen)
    assert step.kind is kind
    if kind is RecoveryStepKind.ARRIVE:
        assert "a" in step.record.recovery.arrived
    if survivors is not None:
        assert step.record.epoch.members == survivors and step.record.epoch.prev == failed.id


def test_a_decided_recovery_is_adopted_by_its_survivors_and_leaves_the_others_out():
    rec = _started(*FAILED)
    failed = rec.epoch
    done = rec.arrived(failed.id, "a").arrived(failed.id, "b").recovered(failed.id, ["a", "b"])
    step = decide_recovery_step(done, failed, "b", {})
    assert step.kind is RecoveryStepKind.ADOPT and step.plan == done.epoch
    assert decide_recovery_step(done, failed, "c", {}).kind is RecoveryStepKind.OUT  # came too late: dead
    later = done.arrived(done.epoch.id, "a").recovered(done.epoch.id, ["a"])  # and the next epoch failed too
    assert decide_recovery_step(later, failed, "b", {}).kind is RecoveryStepKind.OUT


# ---- the backend: compare-and-set on the version -----------------------------------------------------------------
@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server
    del server


def test_a_write_over_an_old_version_loses_and_hands_back_the_latest(store):
    rs = RecordStore(store)
    first, token0 = rs.get()
    assert first == MembershipRecord() and token0 == b""
    mine, token, won = rs.set(first.started(["a", "b"]), token0)
    assert won and mine.version == 1
    other = mine.resized(["a", "b", "c"], mine.epoch.id)
    assert rs.set(other, token)[2]
    latest, _, won = rs.set(mine.arrived(mine.epoch.id, "a"), token)  # decided on version 1: fenced off
    assert not won and latest == other
    # update() re-decides on the latest: the arrival now drops the pending resize it did not know of
    after = rs.update(lambda r: r.arrived(r.epoch.id, "a"))
    assert after.version == 3 and after.pending is None and after.recovery.arrived == ("a",)


def test_concurrent_writers_each_land_exactly_once(store):
    rs = RecordStore(store)
    failed = rs.update(lambda r: r.started([f"w{i}" for i in range(8)])).epoch
    threads = [threading.Thread(target=lambda i=i: RecordStore(dist.TCPStore(
        "127.0.0.1", store.port, is_master=False)).update(lambda r: r.arrived(failed.id, f"w{i}"))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    rec, _ = rs.get()
    assert sorted(rec.recovery.arrived) == [f"w{i}" for i in range(8)] and rec.version == 9


# ---- survivors on a real store, clocks stepped by the test ---------------------------------------------------------
class _Host:
    """A worker's membership whose beats the test writes (``wall``: its wall clock, set off by an offset) and whose
    monotonic clock the test steps; its recovery runs on a thread."""

    def __init__(self, store, wid: str, now: list, offset: float = 0.0) -> None:
        self.m = Membership(lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False),
                            wid, timeout=timedelta(seconds=30), heartbeat_interval=timedelta(seconds=0.01),
                            heartbeat_timeout=timedelta(seconds=5), wall_clock=lambda: time.time() + offset)
        self.m.beats = BeatClock(clock=lambda: now[0])
        self.result: dict = {}

    def recover(self, failed: Plan) -> threading.Thread:
        def run():
            try:
                self.result["plan"] = self.m.recover(failed)
            except LeftGroup as e:
                self.result["left"] = e
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


@pytest.mark.parametrize("offset", [30.0, -30.0])
def test_a_peer_30_s_off_is_neither_dead_nor_alive_by_its_wall_clock(store, offset):
    # #27: a peer's beat says its own wall time; only whether it changes counts, on each observer's clock.
    # skewed beats and recovers (alive, its clock 30 s off); stale wrote a beat 30 s in the future and died
    # (alive for 30 s to a reader that compares wall clocks); both observers judge them alike.
    now = [0.0]
    coord = Coordinator(store)
    failed = coord.start(["a", "skewed", "stale", "b"])
    store.set("elastic/hb/stale", repr(time.time() + offset))
    hosts = {w: _Host(store, w, now, offset if w == "skewed" else 0.0) for w in ("a", "skewed", "b")}
    for h in hosts.values():
        h.m.start()
    try:
        threads = [h.recover(failed) for h in hosts.values()]
        for t in range(1, 20):          # up to 4.75 s of the observers' clock: stale may still be alive
            now[0] = t * 0.25
            time.sleep(0.02)            # the survivors' turn; missing some changes nothing
        assert all(t.is_alive() for t in threads), "decided before stale was silent for the heartbeat timeout"
        deadline = time.monotonic() + 30

        def beats():
            return [store.get(f"elastic/hb/{w}") for w in hosts]
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            seen = beats()   # the clock steps only once every live host has beaten since the last step: a beat
            while any(x == y for x, y in zip(beats(), seen)) and time.monotonic() < deadline:   # thread starved
                time.sleep(0.01)   # on a loaded host is not a silence on the observers' clock
            now[0] += 0.25              # stale's silence grows; skewed's beat keeps changing, so it never is silent
            time.sleep(0.05)
        plans = {w: h.result.get("plan") for w, h in hosts.items()}
        assert plans["a"] is not None and plans["a"].members == ("a", "skewed", "b"), plans
        assert plans["a"] == plans["skewed"] == plans["b"]
        assert now[0] > 5.0  # stale counted dead only after 5 s of silence on the observers' clocks
    finally:
        for h in hosts.values():
            h.m.stop()


# ---- a switch that split the survivors (#27.1 review): one recovery of whichever of E and P the record holds -----
def _split(grow: bool) -> tuple[MembershipRecord, Plan, Plan]:
    """Epoch E and its pending resize P (grow: a, b, c -> + d; shrink: a, b, c, d -> a, b)."""
    rec = _started("a", "b", "c") if grow else _started("a", "b", "c", "d")
    rec = rec.resized(["a", "b", "c", "d"] if grow else ["a", "b"], rec.epoch.id)
    return rec, rec.epoch, rec.pending


def _run_steps(rec: MembershipRecord, calls) -> tuple[MembershipRecord, dict]:
    """Applies each (wid, plan it recovers from, seen) in turn; returns the record and each worker's step kinds."""
    kinds: dict = {}
    for wid, failed, seen in calls:
        step = decide_recovery_step(rec, failed, wid, seen)
        kinds.setdefault(wid, []).append(step.kind)
        if step.record is not None:
            rec = step.record
    return rec, kinds


@pytest.mark.parametrize("switch_noted_first", [True, False], ids=["switch-recorded-first", "old-epoch-first"])
def test_a_switch_that_split_the_survivors_is_one_recovery(switch_noted_first):
    # E = a, b, c; P = E + newcomer d. c dies during the switch's buffer broadcast: a (rank 0, the state source)
    # switched to P, b recovers from E. Before the fix: (a) b got OUT and raised LeftGroup; (b) a's arrival at P
    # raised InvalidPlan (P was dropped by b's arrival).
    rec, E, P = _split(grow=True)
    if switch_noted_first:
        rec = rec.switched(P.id)  # a's heartbeat thread noted the switch
        order = [("b", E), ("a", P)]
    else:
        order = [("b", E), ("a", P)]
    rec, kinds = _run_steps(rec, [(w, f, {}) for w, f in order])
    assert kinds == {"b": [RecoveryStepKind.ARRIVE], "a": [RecoveryStepKind.ARRIVE]}
    assert set(rec.recovery.arrived) == {"a", "b"} and rec.recovery.members == ("a", "b", "c")
    # d (a newcomer that never trained) is out of it; c is still to be judged
    assert decide_recovery_step(rec, P, "d", {}).kind is RecoveryStepKind.OUT
    assert decide_recovery_step(rec, P, "a", {"b": A}).waiting_for == ("c",)
    # either survivor decides, on either plan it recovers from: the same survivors, the one with E's state first
    for wid, failed, seen in (("a", P, {"b": A, "c": D}), ("b", E, {"a": A, "c": D})):
        step = decide_recovery_step(rec, failed, wid, seen)
        assert step.kind is RecoveryStepKind.DECIDE and step.record.epoch.members == ("a", "b")
    done = decide_recovery_step(rec, P, "a", {"b": A, "c": D, "d": A}).record
    assert done.recovery is None and done.pending is None
    for wid, failed in (("a", P), ("b", E)):
        step = decide_recovery_step(done, failed, wid, {})
        assert step.kind is RecoveryStepKind.ADOPT and step.plan == done.epoch, (wid, step)
    assert decide_recovery_step(done, P, "d", {}).kind is RecoveryStepKind.OUT
    assert MembershipRecord.from_json(rec.to_json()) == rec


@pytest.mark.parametrize("first", ["E", "P"])
def test_a_split_switch_recorded_either_way_gives_the_same_survivors(first):
    # the E survivor arrives first (the record falls back to E), or the P survivor does (it notes the switch)
    rec, E, P = _split(grow=True)
    calls = [("b", E, {}), ("a", P, {})] if first == "E" else [("a", P, {}), ("b", E, {})]
    rec, kinds = _run_steps(rec, calls)
    assert all(k == [RecoveryStepKind.ARRIVE] for k in kinds.values()), kinds
    assert rec.recovery.failed == (E.id if first == "E" else P.id) and rec.recovery.members == ("a", "b", "c")
    done = decide_recovery_step(rec, E, "b", {"a": A, "c": D}).record
    assert done.epoch.members == ("a", "b") and done.epoch.prev == rec.recovery.failed


@pytest.mark.parametrize("switch_noted_first", [True, False], ids=["switch-recorded-first", "old-epoch-first"])
def test_a_leaver_that_missed_a_voted_shrink_leaves_and_the_new_plan_recovers_without_it(switch_noted_first):
    # E = a, b, c, d; P = a, b. d died during the broadcast; c (a leaver) recovers from E.
    rec, E, P = _split(grow=False)
    if switch_noted_first:  # P trains on: the leaver leaves, nothing else changes
        rec = rec.switched(P.id)
        step = decide_recovery_step(rec, E, "c", {})
        assert step.kind is RecoveryStepKind.OUT and step.plan == P
        return
    rec, _ = _run_steps(rec, [("c", E, {})])  # c arrived first: P dropped from the record
    rec, kinds = _run_steps(rec, [("a", P, {}), ("b", P, {})])  # a, b switched; their group is failed (see docs)
    assert kinds == {"a": [RecoveryStepKind.ARRIVE], "b": [RecoveryStepKind.ARRIVE]}
    assert rec.recovery.members == ("a", "b")
    assert decide_recovery_step(rec, E, "c", {}).kind is RecoveryStepKind.OUT
    done = decide_recovery_step(rec, P, "a", {"b": A}).record
    assert done.epoch.members == ("a", "b") and decide_recovery_step(done, P, "b", {}).kind is RecoveryStepKind.ADOPT


@pytest.mark.parametrize("switch_noted_first", [True, False], ids=["switch-recorded-first", "old-epoch-first"])
def test_survivors_split_by_a_switch_recover_together_on_a_real_store(store, switch_noted_first):
    # Membership.recover end to end: a recovers from P (it switched), b from E (it missed the vote); c died (its beat
    # never changes); d, P's newcomer, beats on but is never waited for: it is no member of both plans.
    now = [0.0]
    coord = Coordinator(store)
    E = coord.start(["a", "b", "c"])
    P = coord.request_resize(["a", "b", "c", "d"], E)
    store.set("elastic/hb/c", "0.0")
    if switch_noted_first:
        RecordStore(store).update(lambda r: r.switched(P.id))
    hosts = {w: _Host(store, w, now) for w in ("a", "b", "d")}
    for h in hosts.values():
        h.m.start()
    try:
        threads = [hosts["b"].recover(E), hosts["a"].recover(P)]
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            now[0] += 0.25  # c's silence grows; a, b, d beat on
            time.sleep(0.05)
        plans = {w: hosts[w].result.get("plan") for w in ("a", "b")}
        assert plans["a"] is not None and plans["a"] == plans["b"] and plans["a"].members == ("a", "b"), \
            {w: h.result for w, h in hosts.items()}
        t = hosts["d"].recover(P)
        t.join(10)
        assert isinstance(hosts["d"].result.get("left"), LeftGroup)  # the newcomer never trained: it leaves
    finally:
        for h in hosts.values():
            h.m.stop()
