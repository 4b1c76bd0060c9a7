"""The job's membership record: one versioned document, changed only by compare-and-set (#27.1).

Everything that says who trains in which epoch lives in one JSON document at ``elastic/state``
(:data:`store_keys.STATE`), shaped like torchelastic's ``_RendezvousState``:

============ ================ =================================================================================
field        type             meaning
============ ================ =================================================================================
``version``  int              bumped by every change; the compare-and-set token is the whole document
``seq``      int              the last plan id handed out (plan ids never repeat)
``epoch``    Plan or None     the plan being trained (None before the controller's first plan)
``prev``     Plan or None     the plan ``epoch`` followed (its first survivor is the state source of newcomers)
``pending``  Plan or None     a resize posted on ``epoch``, not switched to yet (at most one)
``recovery`` Recovery or None a recovery of ``epoch`` under way: the failed plan's id and who arrived
============ ================ =================================================================================

Transitions (each a pure method returning the next record; :class:`RecordStore` writes it by compare-and-set):

- ``started(members)``: the first plan (controller).
- ``resized(members, base)``: ``pending`` = the successor of ``epoch`` (controller; refused while one is pending
  or a recovery is under way).
- ``switched(plan_id)``: ``epoch`` = ``pending`` (rank 0 of the new plan, from its heartbeat thread, after the
  vote that switched; a survivor recovering from that plan does it too, so a dead rank 0 cannot leave the record
  behind).
- ``arrived(failed, wid, members)``: a survivor of ``failed`` says it is alive; the first arrival opens ``recovery``
  and drops a ``pending`` resize of ``failed`` (superseded); ``members`` (a survivor proving a split switch, see
  :func:`resolve_failed`) restricts the members judged to those of both plans.
- ``recovered(failed, survivors)``: ``epoch`` = the survivors' plan, ``recovery`` closed.

A switch voted in the old epoch may reach some ranks only; the survivors then recover from the old epoch and from
the new plan, and both are one recovery of whichever the record holds (:func:`resolve_failed`).

Which transition a survivor makes is decided by :func:`decide_recovery_step` on the latest record, never on a
remembered one: a survivor that dies after any step leaves a record that every other survivor can carry on from,
so there is no leader to replace. Liveness is each observer's own monotonic clock since a peer's beat last changed
(:class:`~elastic_launcher.peer_watch.BeatClock`), never a comparison with timestamps other hosts wrote.
"""
from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Mapping, Optional, Sequence

import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.errors import InvalidPlan, RendezvousTimeout, ResizeConflict

__all__ = ["Plan", "Recovery", "MembershipRecord", "RecordStore", "Liveness", "RecoveryStepKind", "RecoveryStep",
           "decide_recovery_step", "resolve_failed", "recovery_members", "validate_members"]


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

    def to_dict(self) -> dict:
        return {"id": self.id, "members": list(self.members), "prev": self.prev, "kind": self.kind}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> Optional["Plan"]:
        return None if d is None else cls(int(d["id"]), tuple(d["members"]), int(d["prev"]), d["kind"])

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: "str | bytes") -> "Plan":
        return cls.from_dict(json.loads(text))


def validate_members(members: Sequence[str]) -> tuple[str, ...]:
    """``members`` as a tuple.

    Raises:
        InvalidPlan: empty, duplicate ids, or an id that is empty or holds '/'.
    """
    members = tuple(members)
    if not members:
        raise InvalidPlan("a plan needs at least one member")
    if len(set(members)) != len(members):
        raise InvalidPlan(f"duplicate worker ids in plan {list(members)}")
    for m in members:
        if not m or "/" in m:
            raise InvalidPlan(f"worker id {m!r} is empty or contains '/'")
    return members


@dataclass(frozen=True)
class Recovery:
    """A recovery of the record's epoch under way.

    Attributes:
        failed: the id of the failed plan (the record's ``epoch``).
        arrived: the survivors that said they are alive, in arrival order.
        members: the members judged, when a switch between ``failed`` and its resize split the survivors (some
            switched, some recovered from the old plan): the members of both plans, in the resize's order. Empty:
            the failed plan's members (:func:`recovery_members`).
    """

    failed: int
    arrived: tuple[str, ...] = ()
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class MembershipRecord:
    """The membership document (fields: the module docstring's table). Immutable: transitions return a new one
    with ``version`` + 1."""

    version: int = 0
    seq: int = 0
    epoch: Optional[Plan] = None
    prev: Optional[Plan] = None
    pending: Optional[Plan] = None
    recovery: Optional[Recovery] = None

    # ---- serialisation ------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        rec = None if self.recovery is None else {"failed": self.recovery.failed,
                                                   "arrived": list(self.recovery.arrived),
                                                   "members": list(self.recovery.members)}
        return json.dumps({"version": self.version, "seq": self.seq,
                           **{k: None if p is None else p.to_dict()
                              for k, p in (("epoch", self.epoch), ("prev", self.prev), ("pending", self.pending))},
                           "recovery": rec}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: "str | bytes") -> "MembershipRecord":
        d = json.loads(text)
        r = d.get("recovery")
        return cls(int(d["version"]), int(d["seq"]), Plan.from_dict(d["epoch"]), Plan.from_dict(d["prev"]),
                   Plan.from_dict(d["pending"]),
                   None if r is None else Recovery(int(r["failed"]), tuple(r["arrived"]), tuple(r.get("members", ()))))

    # ---- reading ------------------------------------------------------------------------------------------------
    def plan(self, pid: int) -> Optional[Plan]:
        """The plan ``pid`` if the record still holds it (epoch, prev or pending), else None."""
        for p in (self.epoch, self.prev, self.pending):
            if p is not None and p.id == pid:
                return p
        return None

    def successor_of(self, pid: int) -> Optional[int]:
        """The id of what follows epoch ``pid``: its pending resize, its recovery's plan, or a later epoch."""
        if self.epoch is None or pid > self.epoch.id:
            return None
        if pid < self.epoch.id:
            return self.epoch.id
        return self.pending.id if self.pending is not None else None

    def plan_for(self, wid: str) -> Optional[Plan]:
        """The newest plan that includes ``wid`` (pending first, then epoch), else None."""
        for p in (self.pending, self.epoch):
            if p is not None and wid in p.members:
                return p
        return None

    # ---- transitions (pure) ---------------------------------------------------------------------------------
    def _next(self, **changes) -> "MembershipRecord":
        return replace(self, version=self.version + 1, **changes)

    def started(self, members: Sequence[str]) -> "MembershipRecord":
        """The first plan.

        Raises:
            InvalidPlan: bad members, or the record has a plan already.
        """
        if self.epoch is not None:
            raise InvalidPlan(f"the job has a plan already (epoch {self.epoch.id})")
        plan = Plan(self.seq + 1, validate_members(members), 0, "initial")
        return self._next(seq=plan.id, epoch=plan)

    def resized(self, members: Sequence[str], base: int) -> "MembershipRecord":
        """``pending`` = the successor of epoch ``base`` with ``members`` in rank order.

        Raises:
            InvalidPlan: bad members, or none of ``base``'s members kept (the state would be lost).
            ResizeConflict: ``base`` is not the epoch any more, or it has a successor or a recovery already.
        """
        members = validate_members(members)
        if self.epoch is not None and self.epoch.id == base and not any(m in self.epoch.members for m in members):
            raise InvalidPlan(f"plan {list(members)} keeps no member of epoch {base}; state would be lost")
        if self.epoch is None or self.epoch.id != base or self.pending is not None or self.recovery is not None:
            taken = self.successor_of(base) or (self.seq if self.recovery is not None else base)
            raise ResizeConflict(base, taken)
        plan = Plan(self.seq + 1, members, base, "resize")
        return self._next(seq=plan.id, pending=plan)

    def switched(self, pid: int) -> "MembershipRecord":
        """``epoch`` = the pending plan ``pid`` (its members switched to it at a commit point). The same record when
        the switch is noted already."""
        if self.pending is None or self.pending.id != pid:
            return self
        return self._next(epoch=self.pending, prev=self.epoch, pending=None)

    def arrived(self, failed: int, wid: str, members: Sequence[str] = ()) -> "MembershipRecord":
        """``wid`` survived epoch ``failed`` (a recovery opens on the first arrival; a switch to ``failed`` that the
        record has not noted is noted first: a member of it is recovering from it). ``members``: this survivor
        proves a split switch (:func:`resolve_failed`): only these are judged from now on.

        Raises:
            InvalidPlan: ``failed`` is neither the epoch nor its pending plan.
        """
        rec = self.switched(failed)
        if rec.epoch is None or rec.epoch.id != failed:
            raise InvalidPlan(f"epoch {failed} is not the record's epoch ({None if rec.epoch is None else rec.epoch.id})")
        r = rec.recovery or Recovery(failed)
        members = tuple(members) or r.members
        if wid in r.arrived and members == r.members:
            return rec
        arrived = r.arrived if wid in r.arrived else r.arrived + (wid,)
        return rec._next(pending=None, recovery=Recovery(failed, arrived, members))

    def recovered(self, failed: int, survivors: Sequence[str]) -> "MembershipRecord":
        """``epoch`` = the plan of ``survivors`` (in the failed plan's order), recovery closed."""
        plan = Plan(self.seq + 1, validate_members(survivors), failed, "recovery")
        return self._next(seq=plan.id, epoch=plan, prev=self.epoch, pending=None, recovery=None)


class Liveness(enum.Enum):
    """How one observer sees a member of a failed plan during its recovery."""

    ALIVE = "alive"  # arrived, and its beat changed after this observer saw the arrival
    DEAD = "dead"  # its beat has not changed for heartbeat_timeout, by this observer's clock
    UNKNOWN = "unknown"  # neither yet


class RecoveryStepKind(enum.Enum):
    ARRIVE = "arrive"  # write this survivor's arrival (opens the recovery, notes a switch it proves)
    WAIT = "wait"  # some member is neither alive nor dead yet: read again after a while
    DECIDE = "decide"  # every member judged: write the survivors' plan
    ADOPT = "adopt"  # the recovery of the failed plan is decided: train in ``plan``
    OUT = "out"  # the record moved on without this worker (declared dead): leave


@dataclass(frozen=True)
class RecoveryStep:
    """What :func:`decide_recovery_step` says to do, and the record to write (ARRIVE, DECIDE)."""

    kind: RecoveryStepKind
    record: Optional[MembershipRecord] = None
    plan: Optional[Plan] = None
    waiting_for: tuple[str, ...] = field(default=())


def resolve_failed(rec: MembershipRecord, failed: Plan) -> tuple[Plan, tuple[str, ...]]:
    """The plan whose recovery a survivor of ``failed`` takes part in, as ``rec`` holds it, and the members judged
    when this survivor proves a split switch (else ``()``).

    A switch to a resize P of epoch E is voted in E's collective, and the vote's allreduce or the buffer broadcast
    after it can finish on some ranks and fail on others: some survivors train in P (and fail there: P's first
    collective needs the others), some recover from E. Both are one recovery, of whichever of E and P the record
    holds: the record switched to P (its rank 0 noted it, or a P survivor arrived first): a survivor of E recovers
    P; the record fell back to E (an E survivor arrived first and dropped the pending P): a survivor of P recovers
    E. Such a survivor proves that P never committed a step (its first collective needed it), so the recovery
    judges only the members of both plans: E's committed state is theirs; P's newcomers never trained (they leave
    and join again as newcomers); E's leavers leave as the resize said::

        failed is the record's epoch, or its pending plan ------------------------> failed
        record switched from failed to its resize P (P or a recovery of P) ------> P, split
        failed is a resize whose base E the record holds (E or a recovery of E) -> E, split
        otherwise ----------------------------------------------------------------> failed
    """
    held = {p.id: p for p in (rec.prev, rec.epoch, rec.pending) if p is not None}
    if rec.epoch is not None and failed.id in (rec.epoch.id, rec.pending.id if rec.pending else -1):
        return held[failed.id], ()
    for p in held.values():  # the record switched from failed to its resize
        if p.kind == "resize" and p.prev == failed.id and p.id != (rec.pending.id if rec.pending else -1):
            return p, tuple(m for m in p.members if m in failed.members)
    base = held.get(failed.prev) if failed.kind == "resize" else None
    if base is not None and (rec.pending is None or rec.pending.id != failed.id):  # the record fell back to base
        return base, tuple(m for m in failed.members if m in base.members)
    return failed, ()


def recovery_members(rec: MembershipRecord, failed: Plan) -> tuple[str, ...]:
    """The members of ``failed`` (as :func:`resolve_failed` gives it) that its recovery judges."""
    r = rec.recovery
    return r.members if r is not None and r.failed == failed.id and r.members else failed.members


def decide_recovery_step(rec: MembershipRecord, failed: Plan, wid: str,
                         seen: Mapping[str, Liveness]) -> RecoveryStep:
    r"""The next step of survivor ``wid`` recovering from ``failed``, on the latest record ``rec``.

    ``failed`` is first resolved to the plan the record recovers in its place (:func:`resolve_failed`: a switch
    that split the survivors is one recovery). ``seen`` is this observer's judgement of the members (:class:`Liveness`);
    a member absent from it is UNKNOWN. Any survivor may take any step, so the recovery finishes whoever dies on
    the way::

        record's epoch moved past failed --(its prev is failed, wid a member)--> ADOPT
                                        \-(otherwise)-----------------------> OUT
        wid not among the members judged (a split: a newcomer or a leaver) ---> OUT
        wid not arrived, or it proves a split the record does not know yet ---> ARRIVE
        every other member ALIVE (and arrived) or DEAD -----------------------> DECIDE
        otherwise ------------------------------------------------------------> WAIT
    """
    failed, split = resolve_failed(rec, failed)
    epoch = rec.epoch
    if epoch is not None and epoch.id > failed.id and (rec.pending is None or rec.pending.id != failed.id):
        if epoch.prev == failed.id and epoch.kind == "recovery" and wid in epoch.members:
            return RecoveryStep(RecoveryStepKind.ADOPT, plan=epoch)
        return RecoveryStep(RecoveryStepKind.OUT, plan=epoch)
    members = split or recovery_members(rec, failed)
    if wid not in members:
        return RecoveryStep(RecoveryStepKind.OUT, plan=failed)
    r = rec.recovery
    if r is None or r.failed != failed.id or wid not in r.arrived or (split and r.members != split):
        return RecoveryStep(RecoveryStepKind.ARRIVE, record=rec.arrived(failed.id, wid, split))
    undecided = tuple(m for m in members if m != wid and seen.get(m, Liveness.UNKNOWN) is Liveness.UNKNOWN)
    if undecided:
        return RecoveryStep(RecoveryStepKind.WAIT, waiting_for=undecided)
    survivors = [m for m in members
                 if m == wid or (m in r.arrived and seen.get(m) is Liveness.ALIVE)]
    return RecoveryStep(RecoveryStepKind.DECIDE, record=rec.recovered(failed.id, survivors))


class RecordStore:
    """The record in the job's store (``elastic/state``), read and written whole. A backend in torchelastic's
    sense: :meth:`set` writes only over the version it was given and hands back the latest record either way.

    Args:
        store: a client of the job's store (unprefixed: the record sits in the runtime channel).
        timeout: bound of :meth:`update`'s retries when other writers keep winning.
    """

    def __init__(self, store: dist.Store, timeout: timedelta = timedelta(seconds=60)) -> None:
        self.store = dist.PrefixStore(keys.RUNTIME, store)
        self.timeout = timeout
        self._exists = False  # the record is never deleted: once seen, one round trip a read

    def get(self) -> tuple[MembershipRecord, bytes]:
        """The latest record and its token (an empty record and token before the first write)."""
        if not self._exists:
            if not self.store.check([keys.STATE]):
                return MembershipRecord(), b""
            self._exists = True
        raw = self.store.get(keys.STATE)
        return MembershipRecord.from_json(raw), raw

    def set(self, record: MembershipRecord, token: bytes) -> tuple[MembershipRecord, bytes, bool]:
        """Writes ``record`` if the stored one is still ``token``. Returns (latest record, its token, written)."""
        new = record.to_json().encode()
        now = self.store.compare_set(keys.STATE, token, new)
        if now == new:
            return record, new, True
        return MembershipRecord.from_json(now), now, False

    def update(self, change) -> MembershipRecord:
        """Applies ``change(latest) -> next`` until one write wins, re-deciding on the latest record after every
        lost race; returns the record written (``change`` may raise to refuse).

        Raises:
            RendezvousTimeout: other writers kept winning for ``timeout``.
        """
        deadline = time.monotonic() + self.timeout.total_seconds()
        rec, token = self.get()
        while True:
            nxt = change(rec)
            if nxt is rec:
                return rec
            rec, token, won = self.set(nxt, token)
            if won:
                return rec
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"membership record: no write won within {self.timeout.total_seconds():g} s")
