"""Membership protocol: who is in which epoch, over one TCPStore hosted by the controller.

The controller (``elastic-launch``) hosts a ``TCPStore`` server that outlives every worker. Who trains in which
epoch is one versioned document, the membership record (:mod:`elastic_launcher.rendezvous_state`: the plan being
trained, the one it followed, a pending resize, a recovery under way), changed only by compare-and-set on its
version. An *epoch* is one :class:`Plan`: a unique integer id and the ordered list of worker ids (the order is the
rank order). Process groups of an epoch use the store prefix ``epoch/<id>``, so every membership change gets a
fresh prefix. Reports beside the record (``hb/<wid>``, ``joined``, ``switched/<id>``, ``left/<wid>``) are written by
one party each and change no membership (:mod:`elastic_launcher.store_keys`).

Controller side (:class:`Coordinator`): ``start(members)`` writes the first plan; ``request_resize(members)``
writes the pending successor of the current epoch (grow: newcomers appended after the survivors; shrink: leavers
omitted); ``wait_switched(plan)`` blocks until the new epoch has completed its first step; ``joined()`` and
``alive()`` tell which workers are ready / beating. Newcomers must be started (srun / helper job) with their
worker id before or after ``request_resize``; they prepare (imports, model build, communicator) and the
survivors switch at the first commit point at which everyone of the plan is ready. Leavers exit at that same
commit point, after which the controller may release their nodes (``left/<wid>`` is set just before exit).

Worker side (:class:`Membership`): a heartbeat/poll thread beats ``hb/<wid>``, reads the record (a pending
successor of the watched epoch, a recovery of it begun elsewhere) so that commit points read a local variable, not
the store, and notes a switch in the record for the new epoch's rank 0 (off the training thread). A newcomer
calls :meth:`Membership.wait_for_plan`. After a collective failure, survivors call :meth:`Membership.recover`:
each re-decides on the latest record (``rendezvous_state.decide_recovery_step``: arrive, wait, decide, adopt)
until the survivors' plan is written, so any survivor finishes a recovery or a switch a dead one began; there is
no leader. A member counts as alive when it arrived and its beat changed after that, as dead when its beat has not
changed for ``heartbeat_timeout``, both by the observer's own monotonic clock. A recovery supersedes a pending
resize of the same epoch; its newcomers give their waits for the start and the state up as it begins
(``EpochExecutor.entry_watch``) and end, and the controller re-requests the resize. A switch that reached
some ranks only (its vote failed on the others) is one recovery of whichever of the two plans the record holds,
among the members of both (``rendezvous_state.resolve_failed``).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.errors import InvalidPlan, LeftGroup, RendezvousTimeout
from elastic_launcher.peer_watch import BeatClock, PeerWatch
from elastic_launcher.rendezvous_state import (Liveness, MembershipRecord, Plan, RecordStore, RecoveryStepKind,
                                               decide_recovery_step, recovery_members, resolve_failed,
                                               validate_members)

logger = logging.getLogger("elastic_launcher.membership")

ARRIVAL_TIMEOUT = timedelta(seconds=30)  # default arrival deadline of a recovery round (Membership.arrival_timeout)


def backoff(failures: int, interval: float) -> float:
    """The wait before the next try after ``failures`` store errors in a row: an eighth of the heartbeat interval,
    doubled each time, at most one interval."""
    return min(interval, interval / 8 * 2 ** (failures - 1))

__all__ = ["Plan", "Coordinator", "Membership"]


class _Keys:
    """The reports beside the record (all keys under ``elastic/``) and the record itself."""

    def __init__(self, store: dist.Store, timeout: timedelta) -> None:
        self.store = dist.PrefixStore(keys.RUNTIME, store)
        self.record = RecordStore(store, timeout)
        self.timeout = timeout

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def get(self, key: str) -> str:
        return self.store.get(key).decode()

    def wait_get(self, key: str, timeout: timedelta, what: str) -> str:
        try:
            self.store.wait([key], timeout)
        except Exception as e:  # noqa: BLE001 - the store raises a generic error on timeout
            raise RendezvousTimeout(f"waited {timeout.total_seconds():.1f}s for {what} (store key {key})") from e
        return self.get(key)

    def latest(self, timeout: timedelta, what: str) -> MembershipRecord:
        """The record once it holds a plan (waits up to ``timeout`` for the first one).

        Raises:
            RendezvousTimeout: no plan within ``timeout``.
        """
        rec, _ = self.record.get()
        if rec.epoch is None:
            self.wait_get(keys.STATE, timeout, what)
            rec, _ = self.record.get()
        return rec


class Coordinator:
    """Controller-side API (one per job, in the process that hosts the store).

    Args:
        store: a client or the server of the job's TCPStore.
        timeout: default bound for the blocking calls (``wait_switched``).
        heartbeat_timeout: a worker whose heartbeat has not changed for this long (by this process's clock) is
            reported dead by :meth:`alive`.
    """

    def __init__(self, store: dist.Store, timeout: timedelta = timedelta(seconds=120),
                 heartbeat_timeout: timedelta = timedelta(seconds=10)) -> None:
        self._k = _Keys(store, timeout)
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.beats = BeatClock()

    def start(self, members: Sequence[str]) -> Plan:
        """Writes the first plan; its members then start training together.

        Raises:
            InvalidPlan: bad members, or the job has a plan already.
        """
        return self._k.record.update(lambda r: r.started(members)).epoch

    def record(self) -> MembershipRecord:
        """The membership record as it is now (no wait; an empty record before :meth:`start`)."""
        return self._k.record.get()[0]

    def current(self) -> Plan:
        """The epoch the workers train in now (moves at each switch and recovery).

        Raises:
            RendezvousTimeout: :meth:`start` was not called within ``timeout``.
        """
        return self._k.latest(self.timeout, "the first plan").epoch

    def request_resize(self, members: Sequence[str], base: Optional[Plan] = None) -> Plan:
        """Writes the pending successor of ``base`` (default: the current epoch) with ``members`` in rank order.

        Survivors should come first in their current order so that rank 0 (the state source) survives.
        Takes effect at the first commit point after every member of the new plan is ready.

        Raises:
            InvalidPlan: empty or duplicate members, or none of ``base``'s kept.
            ResizeConflict: ``base`` is not the epoch any more or already has a successor (another resize, or a
                failure recovery under way).
        """
        base = base or self.current()
        plan = self._k.record.update(lambda r: r.resized(members, base.id)).pending
        logger.info("resize requested: epoch %d %s -> %d %s", base.id, list(base.members), plan.id,
                    list(plan.members))
        return plan

    def wait_switched(self, plan: Plan, timeout: Optional[timedelta] = None) -> dict:
        """Blocks until ``plan``'s rank 0 reports its first completed step; returns its stats record
        (``{"epoch", "world", "pause_s", ...}``).

        Raises:
            RendezvousTimeout: not switched within ``timeout``.
        """
        return json.loads(self._k.wait_get(keys.switched(plan.id), timeout or self.timeout, f"switch to {plan.id}"))

    def switched(self, plan: Plan) -> Optional[dict]:
        """``plan``'s switch record if its rank 0 reported its first step already, else None (no wait)."""
        key = keys.switched(plan.id)
        return json.loads(self._k.get(key)) if self._k.has(key) else None

    def joined(self) -> list[str]:
        """Worker ids that announced themselves (newcomers preparing, or members), sorted."""
        if not self._k.has(keys.JOINED_LIST):
            return []
        return sorted({w for w in self._k.get(keys.JOINED_LIST).split(",") if w})

    def alive(self, wids: Sequence[str]) -> dict[str, bool]:
        """For each worker id, whether it has a heartbeat that changed within ``heartbeat_timeout`` by this
        process's monotonic clock (a worker first asked about now counts as just beaten; #27: no comparison with
        the timestamps other hosts wrote)."""
        out = {}
        for w in wids:
            key = keys.beat(w)
            out[w] = self._k.has(key) and \
                self.beats.silent_for(w, self._k.get(key)) < self.heartbeat_timeout.total_seconds()
        return out

    def has_left(self, wid: str) -> bool:
        """True once ``wid`` left at a resize (its node may be released)."""
        return self._k.has(keys.left(wid))



class Membership:
    """Worker-side view: heartbeat, polling the record, newcomer wait, switch notes, failure recovery.

    Args:
        store_factory: returns a fresh client of the job's store (one per thread).
        wid: this worker's id (unique in the job, no '/').
        timeout: bound for waiting on a plan / recovery decision.
        heartbeat_interval: period of heartbeats and of reading the record.
        heartbeat_timeout: a peer whose beat has not changed for this long (by this host's monotonic clock:
            `peer_watch.BeatClock`) is dead to the peer watch and to a recovery.
        wall_clock: the time a beat writes (for people reading the store; tests give one set off by some seconds).
        on_peer_failure: if given, the heartbeat thread also watches the peers of the watched epoch and calls
            ``on_peer_failure(epoch, reason)`` once per epoch when one of them has not beaten for
            ``heartbeat_timeout`` (on this host's clock, from when its beat last changed, so clock skew between
            nodes does not matter) or when a recovery of that epoch has begun. It runs on the heartbeat thread and
            must not block.
        on_recovery: test seam (``FaultPlan.fail_in_recovery``): called as ``on_recovery("opened", failed_id)``
            right after this worker's arrival opened a recovery, and ``on_recovery("adopted", plan_id)`` once it
            has the survivors' plan (before it builds the plan's group).
        arrival_timeout: a recovery's arrival deadline (torchelastic's last call, torchft's quorum timeout): a
            member of the failed plan that has not arrived this long after this observer saw the recovery open is
            fenced out (judged dead) even though it still beats, and the survivors go on without it.
        on_end: called once, on the heartbeat thread, with the reason when the beat could not be written for
            ``heartbeat_timeout`` (the peers judge this worker dead by then): the worker must end (``ended``).
        clock: this host's monotonic clock (beat failures, arrival deadlines, peers' beats); tests step their own.

    Store errors in the heartbeat thread are retried with backoff (a fresh client after two failures in a row);
    only a beat that cannot be written for ``heartbeat_timeout`` ends the thread.
    """

    def __init__(self, store_factory: Callable[[], dist.Store], wid: str,
                 timeout: timedelta = timedelta(seconds=120),
                 heartbeat_interval: timedelta = timedelta(seconds=0.2),
                 heartbeat_timeout: timedelta = timedelta(seconds=5),
                 on_peer_failure: Optional[Callable[[int, str], None]] = None,
                 wall_clock: Callable[[], float] = time.time,
                 on_recovery: Optional[Callable[[str, int], None]] = None,
                 arrival_timeout: Optional[timedelta] = None,
                 on_end: Optional[Callable[[str], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        validate_members([wid])
        self.wid = wid
        self.wall_clock = wall_clock  # what a beat says (for people reading the store); liveness never reads it
        self.clock = clock  # this host's monotonic clock: beat failures, arrival deadlines (tests step their own)
        self.beats = BeatClock(clock)  # when each peer's beat last changed here: the peer watch's and recovery's
        self.arrival_timeout = arrival_timeout if arrival_timeout is not None else ARRIVAL_TIMEOUT
        self.on_end = on_end
        self.ended: Optional[str] = None  # why the heartbeat gave up (its beat could not be written for too long)
        self._opened: dict[int, float] = {}  # failed plan id -> when this observer first saw its recovery open
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.on_peer_failure = on_peer_failure
        self.on_recovery = on_recovery
        self._factory = store_factory
        self._k = _Keys(store_factory(), timeout)
        self._watch_epoch: Optional[int] = None
        self._watch_members: tuple[str, ...] = ()
        self._watch_prev = 0  # the watched epoch's predecessor (a recovery of it may supersede a split switch)
        self._next: Optional[Plan] = None
        self._switch_note: Optional[int] = None  # a switch this rank 0 made, for the heartbeat thread to note
        self._arrival_beats: dict[tuple[int, str], Optional[bytes]] = {}  # (failed, m) -> m's beat when seen arrived
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- background heartbeat and poll ----------------------------------------------------------------------
    def start(self) -> None:
        """Starts the heartbeat/poll thread (idempotent)."""
        self._k.store.set(keys.beat(self.wid), repr(self.wall_clock()))
        if self._thread is None:
            self._k.store.set(keys.joined(self.wid), repr(time.time()))
            self._k.store.append(keys.JOINED_LIST, f"{self.wid},")
            self._thread = threading.Thread(target=self._loop, name=f"elastic-hb-{self.wid}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        k: Optional[_Keys] = None
        peers: Optional[PeerWatch] = PeerWatch(self.wid, self.heartbeat_timeout.total_seconds(), self.beats)
        interval = self.heartbeat_interval.total_seconds()
        last_ok, failures, wait = self.clock(), 0, interval
        while not self._stop.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if k is None:
                    k = _Keys(self._factory(), self.timeout)
                k.store.set(keys.beat(self.wid), repr(self.wall_clock()))
                last_ok, failures, wait = self.clock(), 0, interval
                ep, members, prev = self._watch_epoch, self._watch_members, self._watch_prev
                note = self._switch_note
                if note is not None:
                    k.record.update(lambda r: r.switched(note))
                    self._switch_note = None if self._switch_note == note else self._switch_note
                rec, _ = k.record.get()
                self._see(rec, ep)
            except Exception as e:  # noqa: BLE001 - a store error: retried until the beat is too old
                failures += 1
                silent = self.clock() - last_ok
                if silent >= self.heartbeat_timeout.total_seconds():
                    self._end(f"worker {self.wid}: heartbeat not written for {silent:.1f} s "
                              f"(heartbeat_timeout {self.heartbeat_timeout.total_seconds():g} s); last store error: "
                              f"{type(e).__name__}: {e}")
                    return
                if failures >= 2:
                    k = None  # the client may be broken for good: connect again at the next try
                wait = backoff(failures, interval)
                logger.warning("worker %s: store error in the heartbeat (%d in a row, retry in %.2f s): %s",
                               self.wid, failures, wait, e)
                continue
            if self.on_peer_failure is not None and ep is not None and peers is not None:
                try:
                    reason = peers.check(k, ep, members, _recovering(rec, ep, prev))
                except Exception as e:  # noqa: BLE001 - the watch is a help; it never stops the beat
                    logger.warning("worker %s: peer watch off: %s", self.wid, e)
                    peers = None
                    continue
                if reason is not None:
                    self._report_peer_failure(ep, reason)

    def _end(self, reason: str) -> None:
        self.ended = reason
        logger.error("%s: the worker ends", reason)
        if self.on_end is not None:
            try:
                self.on_end(reason)
            except Exception:  # noqa: BLE001 - the thread ends anyway
                logger.exception("on_end raised")

    def _see(self, rec: MembershipRecord, ep: Optional[int]) -> None:
        """Keeps the pending successor of the watched epoch ``ep`` for :meth:`next_plan`."""
        nxt = rec.pending
        if ep is None or self._next is not None or nxt is None or nxt.prev != ep:
            return
        with self._lock:
            if self._watch_epoch == ep:
                self._next = nxt

    def _report_peer_failure(self, epoch: int, reason: str) -> None:
        logger.warning("worker %s: epoch %d: %s", self.wid, epoch, reason)
        try:
            self.on_peer_failure(epoch, reason)
        except Exception:  # noqa: BLE001 - the heartbeat must go on
            logger.exception("on_peer_failure raised")

    def watch(self, plan: Plan) -> None:
        """Sets the epoch whose successor the poll thread looks for (call after each switch)."""
        with self._lock:
            self._watch_epoch, self._watch_members, self._next = plan.id, tuple(plan.members), None
            self._watch_prev = plan.prev

    def next_plan(self) -> Optional[Plan]:
        """The pending successor of the watched epoch, if any (no store access)."""
        return self._next

    def stop(self) -> None:
        """Stops the heartbeat thread and waits for it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ---- plans ------------------------------------------------------------------------------------------------
    def wait_for_plan(self, timeout: Optional[timedelta] = None) -> Plan:
        """Blocks until the record holds a plan that includes this worker (initial, pending or recovered);
        returns it.

        Raises:
            RendezvousTimeout: no such plan within ``timeout``.
        """
        t = timeout or self.timeout
        deadline = time.monotonic() + t.total_seconds()
        rec = self._k.latest(t, "the first plan")
        while True:
            plan = rec.plan_for(self.wid)
            if plan is not None:
                return plan
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"worker {self.wid}: no plan includes it after {t.total_seconds():.0f}s")
            time.sleep(self.heartbeat_interval.total_seconds() / 2)
            rec, _ = self._k.record.get()

    def plan(self, pid: int) -> Plan:
        """Plan ``pid`` as the record holds it (the epoch, the one it followed, or the pending one).

        Raises:
            InvalidPlan: the record no longer holds it (two transitions later).
        """
        plan = self._k.record.get()[0].plan(pid)
        if plan is None:
            raise InvalidPlan(f"plan {pid} is no longer in the membership record")
        return plan

    def note_switched(self, plan: Plan) -> None:
        """Marks ``plan`` as the epoch being trained (called by its rank 0 on entering it). The heartbeat thread
        writes it to the record at once, off the training thread; a survivor recovering from ``plan`` writes it
        too (``MembershipRecord.arrived``), so a rank 0 that dies first leaves nothing unfinished."""
        self._switch_note = plan.id
        self._wake.set()

    def report_switched(self, plan: Plan, stats: dict) -> None:
        """Writes the switch stats record the controller waits for (rank 0 of ``plan``)."""
        self._k.store.set(keys.switched(plan.id), json.dumps(stats))

    def mark_left(self) -> None:
        self._k.store.set(keys.left(self.wid), repr(time.time()))

    # ---- failure recovery -------------------------------------------------------------------------------------
    def recover(self, failed: Plan, timeout: Optional[timedelta] = None) -> Plan:
        """Agrees with the other survivors of ``failed`` on the recovery plan (survivors in old order).

        ``failed`` may be the epoch this worker trained in or the resize it had switched to: when a switch split
        the survivors (some switched, some did not), both recover together whichever of the two the record holds
        (``rendezvous_state.resolve_failed``), among the members of both plans.

        Re-decides on the latest record after every read and every write (``decide_recovery_step``): arrive,
        wait until every member is alive (arrived, its beat changed since) or dead (beat unchanged for
        ``heartbeat_timeout``), write the survivors' plan, or adopt the one another survivor wrote first. Any
        survivor can take any step, so one that dies midway delays the others by its ``heartbeat_timeout`` at most.

        Preconditions: the caller's group for ``failed`` is broken or aborted.

        Raises:
            LeftGroup: the record moved on without this worker (it was declared dead), or a switch split the
                survivors and this worker is a newcomer of the resize (it never trained) or a leaver of it.
            RendezvousTimeout: no decision within ``timeout``.
            InvalidPlan: the record holds neither ``failed`` nor a plan it recovers with (never a survivor's plan).
        """
        t = timeout or self.timeout
        deadline = time.monotonic() + t.total_seconds()
        rec, token = self._k.record.get()
        while True:
            step = decide_recovery_step(rec, failed, self.wid, self._judge(rec, failed))
            if step.kind is RecoveryStepKind.ADOPT:
                logger.warning("recovery of epoch %d: dead %s, new epoch %d", failed.id,
                               [m for m in failed.members if m not in step.plan.members], step.plan.id)
                if self.on_recovery is not None:
                    self.on_recovery("adopted", step.plan.id)
                return step.plan
            if step.kind is RecoveryStepKind.OUT:
                raise LeftGroup(f"worker {self.wid}: epoch {failed.id} was recovered without it "
                                f"(epoch {step.plan.id} of {list(step.plan.members)}; "
                                f"judged: {list(recovery_members(rec, resolve_failed(rec, failed)[0]))})")
            if step.kind is RecoveryStepKind.WAIT:
                if time.monotonic() > deadline:
                    raise RendezvousTimeout(f"recovery of epoch {failed.id}: members {list(step.waiting_for)} "
                                            f"neither alive nor dead after {t.total_seconds():g} s")
                time.sleep(self.heartbeat_interval.total_seconds() / 4)
                rec, token = self._k.record.get()
                continue
            rec, token, won = self._k.record.set(step.record, token)
            if won and step.kind is RecoveryStepKind.ARRIVE:
                self._wake.set()  # beat now: the others count this survivor once its beat changes after arriving
                if rec.recovery.arrived == (self.wid,) and self.on_recovery is not None:
                    self.on_recovery("opened", failed.id)

    def _judge(self, rec: MembershipRecord, failed: Plan) -> dict[str, Liveness]:
        """This observer's view of the other members the recovery of ``failed`` judges (by its own clock since
        their beats changed)."""
        failed, split = resolve_failed(rec, failed)
        others = [m for m in split or recovery_members(rec, failed) if m != self.wid]
        opened = rec.recovery is not None and rec.recovery.failed == failed.id
        arrived = rec.recovery.arrived if opened else ()
        late = opened and self.clock() - self._opened.setdefault(failed.id, self.clock()) > \
            self.arrival_timeout.total_seconds()
        limit = self.heartbeat_timeout.total_seconds()
        seen = {}
        for m, beat in zip(others, self._beats(others)):
            if self.beats.silent_for(m, beat) > limit:
                seen[m] = Liveness.DEAD
            elif late and m not in arrived:  # beats but never came (hung outside a collective): fenced out
                seen[m] = Liveness.DEAD
            elif m in arrived:
                first = self._arrival_beats.setdefault((failed.id, m), beat)
                seen[m] = Liveness.ALIVE if beat != first else Liveness.UNKNOWN
            else:
                seen[m] = Liveness.UNKNOWN
        return seen

    def silent_members(self, plan: Plan) -> list[str]:
        """``plan``'s members other than this worker whose beat has not changed for ``heartbeat_timeout`` by this
        host's clock (a recovery's group build gives up on them)."""
        others = [m for m in plan.members if m != self.wid]
        limit = self.heartbeat_timeout.total_seconds()
        return [m for m, beat in zip(others, self._beats(others)) if self.beats.silent_for(m, beat) > limit]

    def _beats(self, wids: Sequence[str]) -> list[Optional[bytes]]:
        """The beat values of ``wids`` now (None for one that never beat): one round trip when all have one."""
        at = [keys.beat(m) for m in wids]
        if at and self._k.store.check(at):
            return list(self._k.store.multi_get(at))
        return [self._k.store.get(x) if self._k.has(x) else None for x in at]

    def recovery_begun(self, plan: Plan) -> bool:
        """True once a recovery of ``plan`` began or ended (a survivor gave up on it)."""
        return _recovering(self._k.record.get()[0], plan.id, plan.prev)


def _recovering(rec: Optional[MembershipRecord], epoch: int, prev: int = 0) -> bool:
    """True when the record shows a recovery of ``epoch`` under way or decided; or, ``epoch`` being no longer in
    the record, one of ``prev``, the epoch it followed (a survivor of ``prev`` that missed the switch to ``epoch``
    began it: the same recovery, ``rendezvous_state.resolve_failed``)."""
    if rec is None:
        return False
    if rec.recovery is not None and rec.recovery.failed == epoch:
        return True
    if rec.epoch is not None and rec.epoch.kind == "recovery" and rec.epoch.prev == epoch:
        return True
    return bool(prev) and rec.plan(epoch) is None and _recovering(rec, prev)
