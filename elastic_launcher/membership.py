"""Membership protocol: who is in which epoch, over one TCPStore hosted by the controller.

The controller (``elastic-launch``) hosts a ``TCPStore`` server that outlives every worker. Workers and the
controller exchange small keys under the ``elastic/`` prefix. An *epoch* is one membership: a :class:`Plan`
with a unique integer id and the ordered list of worker ids (the order is the rank order). Process groups of an
epoch use the store prefix ``epoch/<id>``, so every membership change gets a fresh prefix.

The keys (who writes and reads each, and its value) are the runtime channel of
:mod:`elastic_launcher.store_keys`: ``plan/<id>``, ``current``, ``next/<id>``, ``recover/<id>/...``, ``hb/<wid>``,
``joined``, ``switched/<id>``, ``left/<wid>``.

Controller side (:class:`Coordinator`): ``start(members)`` posts the first plan; ``request_resize(members)``
posts the successor of the current epoch (grow: newcomers appended after the survivors; shrink: leavers
omitted); ``wait_switched(plan)`` blocks until the new epoch has completed its first step; ``joined()`` and
``alive()`` tell which workers are ready / beating. Newcomers must be started (srun / helper job) with their
worker id before or after ``request_resize``; they prepare (imports, model build, communicator) and the
survivors switch at the first commit point at which everyone of the plan is ready. Leavers exit at that same
commit point, after which the controller may release their nodes (``left/<wid>`` is set just before exit).

Worker side (:class:`Membership`): a heartbeat/poll thread beats ``hb/<wid>`` and watches ``next/<current>`` so
that commit points read a local variable, not the store. A newcomer calls :meth:`Membership.wait_for_plan`.
After a collective failure, survivors call :meth:`Membership.recover`: the first one to arrive becomes leader,
waits until every member of the failed epoch has either announced itself alive or has a heartbeat unchanged for
``heartbeat_timeout`` (by the leader's own monotonic clock), and posts a recovery plan with the survivors in their
old order. A leader that falls silent before posting is replaced by the first survivor to see it, and the plan is
posted by compare-and-set, so any survivor finishes a recovery a dead one began. A recovery supersedes a planned
resize of the same epoch; its newcomers time out and the controller re-requests the resize.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.errors import InvalidPlan, RendezvousTimeout, ResizeConflict
from elastic_launcher.peer_watch import BeatClock, PeerWatch

logger = logging.getLogger("elastic_launcher.membership")

__all__ = ["Plan", "Coordinator", "Membership"]


@dataclass(frozen=True)
class Plan:
    """One membership epoch.

    Attributes:
        id: unique epoch id (also the process-group store prefix ``epoch/<id>``).
        members: worker ids in rank order.
        prev: id of the epoch this one follows (0 for the first).
        kind: ``initial``, ``resize`` or ``recovery``.
    """

    id: int
    members: tuple[str, ...]
    prev: int = 0
    kind: str = "initial"

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def group_prefix(self) -> str:
        return keys.epoch_group(self.id)

    def rank_of(self, wid: str) -> int:
        """Rank of ``wid`` in this plan, -1 if not a member."""
        return self.members.index(wid) if wid in self.members else -1

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "members": list(self.members), "prev": self.prev, "kind": self.kind})

    @classmethod
    def from_json(cls, text: "str | bytes") -> "Plan":
        d = json.loads(text)
        return cls(int(d["id"]), tuple(d["members"]), int(d["prev"]), d["kind"])


def _validate(members: Sequence[str]) -> tuple[str, ...]:
    members = tuple(members)
    if not members:
        raise InvalidPlan("a plan needs at least one member")
    if len(set(members)) != len(members):
        raise InvalidPlan(f"duplicate worker ids in plan {list(members)}")
    for m in members:
        if not m or "/" in m:
            raise InvalidPlan(f"worker id {m!r} is empty or contains '/'")
    return members


class _Keys:
    """Store access shared by both sides (all keys under ``elastic/``)."""

    def __init__(self, store: dist.Store, timeout: timedelta) -> None:
        self.store = dist.PrefixStore(keys.RUNTIME, store)
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

    def plan(self, pid: int) -> Plan:
        return Plan.from_json(self.get(keys.plan(pid)))

    def post(self, members: Sequence[str], prev: int, kind: str) -> Plan:
        pid = self.store.add(keys.SEQ, 1)
        plan = Plan(pid, _validate(members), prev, kind)
        self.store.set(keys.plan(pid), plan.to_json())
        return plan

    def current(self) -> Optional[Plan]:
        return self.plan(int(self.get(keys.CURRENT))) if self.has(keys.CURRENT) else None


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
        """Posts the first plan; its members then start training together."""
        plan = self._k.post(members, 0, "initial")
        self._k.store.set(keys.CURRENT, str(plan.id))
        return plan

    def current(self) -> Plan:
        """The epoch the workers train in now (updated at each switch).

        Raises:
            RendezvousTimeout: :meth:`start` was never called.
        """
        return self._k.plan(int(self._k.wait_get(keys.CURRENT, self.timeout, "first plan")))

    def request_resize(self, members: Sequence[str], base: Optional[Plan] = None) -> Plan:
        """Posts the successor of ``base`` (default: the current epoch) with ``members`` in rank order.

        Survivors should come first in their current order so that rank 0 (the state source) survives.
        Takes effect at the first commit point after every member of the new plan is ready.

        Raises:
            InvalidPlan: empty or duplicate members.
            ResizeConflict: ``base`` already has a successor (another resize, or a failure recovery).
        """
        base = base or self.current()
        if not any(m in base.members for m in members):
            raise InvalidPlan(f"plan {list(members)} keeps no member of epoch {base.id}; state would be lost")
        plan = self._k.post(members, base.id, "resize")
        won = self._k.store.compare_set(keys.next_plan(base.id), "", str(plan.id)).decode()
        if won != str(plan.id):
            raise ResizeConflict(base.id, int(won))
        if self._k.has(keys.recover_plan(base.id)):
            raise ResizeConflict(base.id, int(self._k.get(keys.recover_plan(base.id))))
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
    """Worker-side view: heartbeat, polling for the next plan, newcomer wait, failure recovery.

    Args:
        store_factory: returns a fresh client of the job's store (one per thread).
        wid: this worker's id (unique in the job, no '/').
        timeout: bound for waiting on a plan / recovery decision.
        heartbeat_interval: period of heartbeats and of polling ``next/<current>``.
        heartbeat_timeout: a peer silent for longer is considered dead during recovery (its beat unchanged for
            that long by this host's monotonic clock: `peer_watch.BeatClock`).
        wall_clock: the time a beat writes (tests give one set off by some seconds).
        on_peer_failure: if given, the heartbeat thread also watches the peers of the watched epoch and calls
            ``on_peer_failure(epoch, reason)`` once per epoch when one of them has not beaten for
            ``heartbeat_timeout`` (measured on this host's clock, from when its beat last changed, so clock
            skew between nodes does not matter) or when a recovery of that epoch has begun. It runs on the
            heartbeat thread and must not block.
    """

    def __init__(self, store_factory: Callable[[], dist.Store], wid: str,
                 timeout: timedelta = timedelta(seconds=120),
                 heartbeat_interval: timedelta = timedelta(seconds=0.2),
                 heartbeat_timeout: timedelta = timedelta(seconds=5),
                 on_peer_failure: Optional[Callable[[int, str], None]] = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        _validate([wid])
        self.wid = wid
        self.wall_clock = wall_clock  # what a beat says (for people reading the store); liveness never reads it
        self.beats = BeatClock()  # when each peer's beat last changed here: the peer watch's and recovery's
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.on_peer_failure = on_peer_failure
        self._factory = store_factory
        self._k = _Keys(store_factory(), timeout)
        self._watch_epoch: Optional[int] = None
        self._watch_members: tuple[str, ...] = ()
        self._next: Optional[Plan] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
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
        k = _Keys(self._factory(), self.timeout)
        peers = PeerWatch(self.wid, self.heartbeat_timeout.total_seconds(), self.beats)
        while not self._stop.wait(self.heartbeat_interval.total_seconds()):
            try:
                k.store.set(keys.beat(self.wid), repr(self.wall_clock()))
                ep, members = self._watch_epoch, self._watch_members
                if ep is not None and self._next is None and k.has(keys.next_plan(ep)):
                    plan = k.plan(int(k.get(keys.next_plan(ep))))
                    with self._lock:
                        if self._watch_epoch == ep:
                            self._next = plan
            except Exception as e:  # noqa: BLE001 - store gone: the controller ended; stop beating
                logger.debug("heartbeat thread stops: %s", e)
                return
            if self.on_peer_failure is not None and ep is not None and peers is not None:
                try:
                    reason = peers.check(k, ep, members)
                except Exception as e:  # noqa: BLE001 - the watch is a help; it never stops the beat
                    logger.warning("worker %s: peer watch off: %s", self.wid, e)
                    peers = None
                    continue
                if reason is not None:
                    self._report_peer_failure(ep, reason)

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

    def next_plan(self) -> Optional[Plan]:
        """The posted successor of the watched epoch, if any (no store access)."""
        return self._next

    def stop(self) -> None:
        """Stops the heartbeat thread and waits for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ---- plans ------------------------------------------------------------------------------------------------
    def wait_for_plan(self, timeout: Optional[timedelta] = None) -> Plan:
        """Blocks until a plan that includes this worker is posted (initial or as a newcomer); returns it.

        Follows ``current`` then the chain of ``next/`` keys.

        Raises:
            RendezvousTimeout: no such plan within ``timeout``.
        """
        t = timeout or self.timeout
        deadline = time.monotonic() + t.total_seconds()
        pid = int(self._k.wait_get(keys.CURRENT, t, "the first plan"))
        while True:
            plan = self._k.plan(pid)
            if self.wid in plan.members:
                return plan
            key = keys.next_plan(pid)
            if self._k.has(key):
                pid = int(self._k.get(key))
                continue
            if self._k.has(keys.recover_plan(pid)):
                pid = int(self._k.get(keys.recover_plan(pid)))
                continue
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"worker {self.wid}: no plan includes it after {t.total_seconds():.0f}s")
            time.sleep(self.heartbeat_interval.total_seconds() / 2)

    def plan(self, pid: int) -> Plan:
        """Reads plan ``pid`` from the store."""
        return self._k.plan(pid)

    def publish_current(self, plan: Plan) -> None:
        """Marks ``plan`` as the epoch being trained (called by its rank 0 at the switch)."""
        self._k.store.set(keys.CURRENT, str(plan.id))

    def report_switched(self, plan: Plan, stats: dict) -> None:
        """Writes the switch stats record the controller waits for (rank 0 of ``plan``)."""
        self._k.store.set(keys.switched(plan.id), json.dumps(stats))

    def mark_left(self) -> None:
        self._k.store.set(keys.left(self.wid), repr(time.time()))

    # ---- failure recovery -------------------------------------------------------------------------------------
    def recover(self, failed: Plan, timeout: Optional[timedelta] = None) -> Plan:
        """Agrees with the other survivors of ``failed`` on the recovery plan (survivors in old order).

        The first survivor to arrive leads: it waits until every member has either arrived or been silent for
        ``heartbeat_timeout``, and posts the plan. The others wait for it; when the leader itself falls silent for
        ``heartbeat_timeout`` before a plan is posted (it died after winning), the first of them to see it takes
        the lead over from it (compare-and-set on the leader key) and decides without it (#27). The plan is
        posted by compare-and-set too, so a leader thought dead that posts after all cannot post a second one:
        every survivor adopts the one posted first. Liveness is this host's monotonic clock since a member's
        beat last changed (`BeatClock`), never a comparison with timestamps other hosts wrote.

        Preconditions: the caller's group for ``failed`` is broken or aborted.

        Raises:
            RendezvousTimeout: the decision did not come within ``timeout``.
        """
        t = timeout or self.timeout
        deadline = time.monotonic() + t.total_seconds()
        lead_key, plan_key = keys.recover_leader(failed.id), keys.recover_plan(failed.id)
        self._k.store.set(keys.recover_alive(failed.id, self.wid), "1")
        leader = self._k.store.compare_set(lead_key, "", self.wid).decode()
        dead: set[str] = set()
        while leader != self.wid:
            if self._k.has(plan_key):
                return self._k.plan(int(self._k.get(plan_key)))
            if self._silent(leader) > self.heartbeat_timeout.total_seconds():
                logger.warning("recovery of epoch %d: leader %s fell silent; taking over", failed.id, leader)
                dead.add(leader)
                leader = self._k.store.compare_set(lead_key, leader, self.wid).decode()
                continue
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"recovery plan of epoch {failed.id}: none within {t.total_seconds():g} s "
                                        f"(leader {leader})")
            time.sleep(self.heartbeat_interval.total_seconds() / 2)
        return self._lead_recovery(failed, dead, deadline)

    def _silent(self, wid: str) -> float:
        """Seconds ``wid``'s beat has not changed, by this host's clock (no beat at all: since first asked)."""
        key = keys.beat(wid)
        return self.beats.silent_for(wid, self._k.store.get(key) if self._k.has(key) else None)

    def _lead_recovery(self, failed: Plan, dead: set[str], deadline: float) -> Plan:
        """The leader's part: who of ``failed``'s members survive (``dead``: known dead already), then the plan."""
        state = {m: False for m in dead}
        limit = self.heartbeat_timeout.total_seconds()
        while True:
            for m in failed.members:
                if m in state:
                    continue
                silent = self._silent(m) if m != self.wid else 0.0
                if silent > limit:
                    state[m] = False
                elif self._k.has(keys.recover_alive(failed.id, m)):
                    state[m] = True
            if len(state) == len(failed.members):
                break
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"recovery of epoch {failed.id}: members "
                                        f"{[m for m in failed.members if m not in state]} undecided")
            time.sleep(self.heartbeat_interval.total_seconds() / 2)
        survivors = [m for m in failed.members if state[m]]
        posted = self._k.post(survivors, failed.id, "recovery")
        pid = int(self._k.store.compare_set(keys.recover_plan(failed.id), "", str(posted.id)).decode())
        plan = posted if pid == posted.id else self._k.plan(pid)
        logger.warning("recovery of epoch %d: dead %s, new epoch %d", failed.id,
                       [m for m in failed.members if m not in plan.members], plan.id)
        return plan

    def plan_superseded(self, plan: Plan) -> bool:
        """True if ``plan`` (a resize) lost to a recovery of its base epoch."""
        return self._k.has(keys.recover_plan(plan.prev))
