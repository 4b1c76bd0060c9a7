"""The pure decisions of an :class:`~elastic_launcher.trainer.ElasticTrainer`'s epoch changes (no I/O): what a
commit point's vote, a recovery and a newly posted plan lead to. :class:`~elastic_launcher.epochs.EpochExecutor`
applies them.

Transitions of one worker (:class:`Phase`)::

    CREATED --ElasticTrainer.join() (connect, warm up, announce, wait for a plan, build its group)--> JOINING
    CREATED --join() raised (nothing left running: no heartbeat, no group)--> FAILED
    JOINING --the loader's first batch (state from the plan's first survivor)--> TRAINING
    TRAINING, at a commit point: decide_commit(vote) ->
        COMMIT    the step becomes the rollback point                           -> TRAINING
        ARM       every rank is ready, but a rank's loader needs time to read the next epoch's batches: commit,
                  and switch at the next commit point (the interval to it is at least that loader's depth)
        SWITCH    commit, then move to the next epoch's prepared group           -> TRAINING (next epoch)
        LEAVE     commit, then leave (this worker is not in the next plan)       -> LEFT
        ROLLBACK  a rank saw a local error: restore the last commit point        -> TRAINING
        RECOVER   a collective failed: decide_recovery(survivors) ->
                      SHRINK / REBUILD a group of the survivors, roll back, resync -> TRAINING (recovery epoch)
                      LEAVE (declared dead)                                        -> LEFT, raises LeftGroup
        GIVE_UP   ``max_retries`` failed commits in a row                         -> raises TooManyFailures
    TRAINING, every step: a newly posted plan -> decide_prepare ->
        BUILD (the next group, in the background) or LEAVE (ready at once: nothing to build)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from elastic_launcher.membership import Plan

__all__ = ["Phase", "VoteTally", "CommitOutcome", "CommitAction", "decide_commit", "RecoveryKind", "RecoveryAction",
           "decide_recovery", "PrepareKind", "PrepareAction", "decide_prepare", "source_rank"]


class Phase(enum.Enum):
    """Where a worker is: CREATED (configured, ``join()`` not called yet), JOINING (``join()`` under way, or done
    and the state not received yet), TRAINING, LEFT (for good), FAILED (``join()`` raised; build a new trainer)."""

    CREATED = "created"
    JOINING = "joining"
    TRAINING = "training"
    LEFT = "left"
    FAILED = "failed"


@dataclass(frozen=True)
class VoteTally:
    """What a commit vote says: the SUM over the ranks of [ready, collectives ok, local step ok, 1, proposal,
    lead, leading, stop]: ``lead`` is the steps a rank's loader needs to read the next epoch's batches before a switch
    (its depth), ``leading`` 1 where that is not yet armed for this commit point, ``stop`` 1 where the rank was
    asked to stop (SIGTERM: ``ElasticTrainer.request_stop``).

    Attributes:
        counted: every rank took part (the last entry is the group size; a vote that an aborted NCCL
            communicator handed back untouched says 1, half reduced less than the size).
        collectives_ok: counted, and no rank saw a collective fail.
        local_ok: no rank reported a local error (non-finite loss, ...): else everyone rolls back.
        ready: every rank is ready to switch to the same next epoch (``ready`` > 0).
        proposals: the sum of the ranks' proposed commit intervals (``CommitSchedule.committed`` reads it).
        lead: steps the switch must be announced ahead (the mean over the ranks that need it), 0 when every rank
            is armed for this commit point or needs none.
        stop: some rank was asked to stop: every rank stops at this commit point (the same step everywhere: a rank
            that stopped on its own would leave its peers in the next step's collectives).
    """

    counted: bool
    collectives_ok: bool
    local_ok: bool
    ready: bool
    proposals: int = 0
    lead: int = 0
    stop: bool = False

    @classmethod
    def read(cls, v, n: int, ready: int) -> "VoteTally":
        total, coll, local, count, proposals, lead, leading, stop = [int(x) for x in v] + [0] * (8 - len(v))
        counted = count == n
        return cls(counted, counted and coll == n, local == n, ready > 0 and total == n * ready, proposals,
                   -(-lead // leading) if leading else 0, stop > 0)


class CommitOutcome(enum.Enum):
    """What a commit point does (see the module docstring's diagram)."""

    COMMIT = "commit"
    ARM = "arm"
    SWITCH = "switch"
    LEAVE = "leave"
    ROLLBACK = "rollback"
    RECOVER = "recover"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class CommitAction:
    """The decision of one commit point.

    Attributes:
        outcome: what to do.
        failures: failed commits in a row once this one is applied (0 after a success).
        error: what failed (ROLLBACK, RECOVER, GIVE_UP), for the logs and the exception.
    """

    outcome: CommitOutcome
    failures: int
    error: Optional[BaseException] = None


def decide_commit(tally: Optional[VoteTally], collective_error: Optional[BaseException],
                  local_error: Optional[BaseException], leaving: bool, failures: int, max_retries: int) -> CommitAction:
    """The commit point's decision from the vote.

    Args:
        tally: the vote's :class:`VoteTally`, or None when the vote itself failed.
        collective_error: the group's recorded error (``errored()``), read after the vote.
        local_error: this rank's error since the last commit point (``report_error``), if any.
        leaving: the prepared next epoch leaves this worker out (only read when the tally says ready).
        failures: failed commits in a row before this one.
        max_retries: failed commits in a row tolerated; one more gives up.
    """
    if tally is None or collective_error is not None or not tally.collectives_ok:
        outcome, error = CommitOutcome.RECOVER, collective_error
    elif not tally.local_ok:
        outcome = CommitOutcome.ROLLBACK
        error = local_error or FloatingPointError("a rank saw a non-finite loss (watch_loss)")
    elif tally.ready and tally.lead:
        return CommitAction(CommitOutcome.ARM, 0)
    elif tally.ready:
        return CommitAction(CommitOutcome.LEAVE if leaving else CommitOutcome.SWITCH, 0)
    else:
        return CommitAction(CommitOutcome.COMMIT, 0)
    if failures + 1 > max_retries:
        return CommitAction(CommitOutcome.GIVE_UP, failures + 1, error)
    return CommitAction(outcome, failures + 1, error)


class RecoveryKind(enum.Enum):
    LEAVE = "leave"      # this worker was declared dead: it leaves and raises LeftGroup
    SHRINK = "shrink"    # try the backend's communicator shrink without the dead ranks, else REBUILD
    REBUILD = "rebuild"  # a fresh group of the survivors


@dataclass(frozen=True)
class RecoveryAction:
    """How a recovery rebuilds. ``dead_ranks``: ranks of the failed epoch left out (SHRINK)."""

    kind: RecoveryKind
    dead_ranks: tuple[int, ...] = ()


def decide_recovery(failed: Plan, survivors: Plan, wid: str, try_shrink: bool) -> RecoveryAction:
    """How this worker goes from the failed epoch to the survivors' epoch the group agreed on."""
    if wid not in survivors.members:
        return RecoveryAction(RecoveryKind.LEAVE)
    dead = tuple(failed.rank_of(m) for m in failed.members if m not in survivors.members)
    if try_shrink and dead:
        return RecoveryAction(RecoveryKind.SHRINK, dead)
    return RecoveryAction(RecoveryKind.REBUILD)


class PrepareKind(enum.Enum):
    LEAVE = "leave"  # not a member of the next plan: ready to leave at once
    BUILD = "build"  # build the next plan's group in the background


@dataclass(frozen=True)
class PrepareAction:
    kind: PrepareKind
    plan: Plan


def decide_prepare(nxt: Plan, wid: str) -> PrepareAction:
    """What this worker prepares for a newly posted next plan."""
    return PrepareAction(PrepareKind.BUILD if wid in nxt.members else PrepareKind.LEAVE, nxt)


def source_rank(plan: Plan, prev: Optional[Plan]) -> int:
    """The rank of ``plan`` whose state the others receive: its first survivor of ``prev`` (0 without one)."""
    if plan.kind == "initial" or plan.prev == 0 or prev is None:
        return 0
    return min(plan.rank_of(m) for m in plan.members if m in prev.members)
