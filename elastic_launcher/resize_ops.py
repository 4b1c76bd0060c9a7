"""A resize as a sequence of explicit states, advanced one controller tick at a time (#27.2; no I/O, no waits).

:func:`advance` takes a :class:`ResizeOp`, what the controller observed this tick (:class:`Observation`: the
helper job's Slurm state, whether the newcomers joined, whether the new epoch switched, failures, a cancel) and
the time of an injected monotonic clock; it moves the op at most one state and returns the :class:`Action`\\ s to
execute (``resize.Resizer.tick`` executes them). Deadlines are absolute times of that clock, set on entering a
waiting state from :class:`ResizeLimits`.

Grow (a helper job brings nodes)::

    REQUESTED --submit the helper--> SUBMITTED --helper RUNNING, its nodes known--> ALLOCATED
    ALLOCATED --every newcomer node's workers joined; post the plan with them--> JOINED
    JOINED --the plan's first step (switch record)--> SWITCHED (done)

Shrink (leavers chosen before the op starts)::

    REQUESTED --post the plan without the leavers--> JOINED --first step--> SWITCHED
    SWITCHED --the leavers left (or leave_s passed); start releasing their nodes--> RELEASING
    RELEASING --their steps ended and the nodes went back to Slurm (a ReleaseOp)--> RELEASED (done)

Any waiting state --its deadline passed, the helper ended, a node of the op failed, the plan was superseded by a
recovery epoch--> FAILED, with the helper cancelled (grow) and the failure recorded. A cancel (operator request,
the main job ending) fails an op that has not posted its plan yet (REQUESTED, SUBMITTED, ALLOCATED) in the same
tick; once the plan is posted (JOINED and later) the op runs to its end and the caller queues what comes next.
While a failed node is recovered (``Observation.hold``) an op posts nothing and submits nothing: the epoch it
would build on is about to change; its deadlines and a cancel still apply.

Releasing nodes (:class:`ReleaseOp`, :func:`advance_release`; a shrink's leavers, a failed node)::

    EXITING --the nodes' worker steps ended--> GIVING_BACK (GIVE_BACK: Slurm shrink / helper ended)
    EXITING --exit_s passed: SIGTERM--> TERMINATING --leave_s passed: SIGKILL--> KILLING --ended or leave_s--> GIVING_BACK
    GIVING_BACK --no Slurm change of the release in flight (done, refused, or retried out)--> RELEASED
    (the batch host, which Slurm cannot drop, goes to RELEASED once its step ended: nothing to give back)

Recovering a failed node (:class:`RecoveryOp`, :func:`advance_recovery`; the survivors recover by themselves, the
controller follows them)::

    DETECTED --a recovery epoch without the node's workers is current--> EVICTED
    DETECTED --join_s passed (no recovery epoch)--> RELEASING (recovered: False)
    EVICTED --that epoch's first step, or switch_s passed--> RELEASING (RELEASE_NODES for the node)
    RELEASING --the node's step ended, the node given back (or, the batch host, restarted)--> DONE (FINISH)
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Optional

from slurm_plugin.client import LIVE_STATES

__all__ = ["ResizeState", "ResizeKind", "ResizeLimits", "ResizeOp", "Observation", "ActionKind", "Action",
           "advance", "fail", "POST_ATTEMPTS", "HELPER_ALIVE", "ReleaseState", "ReleaseOp", "advance_release",
           "RecoveryState", "RecoveryOp", "RecoveryObservation", "advance_recovery", "EXIT_GRACE_S"]

POST_ATTEMPTS = 3  # posting a plan that loses the race to a recovery is retried this often, one try a tick
HELPER_ALIVE = tuple(st for st in LIVE_STATES if st != "COMPLETING")  # in another state it ended or is ending
UNKNOWN = "UNKNOWN"  # Slurm could not be asked: never read as "ended"
EXIT_GRACE_S = 5.0  # a released node's workers get this long to exit by themselves before their step is signalled


class ResizeState(enum.Enum):
    REQUESTED = "requested"  # decided, nothing done yet
    SUBMITTED = "submitted"  # grow: the helper job is queued in Slurm
    ALLOCATED = "allocated"  # grow: the helper runs, its nodes are known; its workers are joining
    JOINED = "joined"        # the new membership is posted (grow: after the newcomers joined)
    SWITCHED = "switched"    # the new epoch completed its first step (a grow is done)
    RELEASING = "releasing"  # shrink: the leavers' steps are ending; then their nodes go back to Slurm
    RELEASED = "released"    # shrink: the leavers' nodes went back to Slurm (done)
    FAILED = "failed"        # ended without the new size (helper cancelled, failure recorded)


class ResizeKind(enum.Enum):
    GROW = "grow"
    SHRINK = "shrink"


@dataclass(frozen=True)
class ResizeLimits:
    """How long each waiting state may last (seconds): `helper_start_s` SUBMITTED, `join_s` ALLOCATED (and a
    recovery's DETECTED), `switch_s` JOINED (and a recovery's EVICTED), `leave_s` a shrink's SWITCHED (then the
    leavers' nodes are released anyway) and each signal stage of a release, `exit_s` a release's EXITING.

    Raises:
        ValueError: a limit that is not a finite number > 0, naming it.
    """

    helper_start_s: float = 60.0
    join_s: float = 120.0
    switch_s: float = 120.0
    leave_s: float = 20.0
    exit_s: float = EXIT_GRACE_S

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"ResizeLimits.{field.name} must be a finite number of seconds > 0, got {value!r}")

    @classmethod
    def from_config(cls, config) -> "ResizeLimits":
        return cls(config.helper_start_timeout.total_seconds(), config.rendezvous_timeout.total_seconds(),
                   config.rendezvous_timeout.total_seconds(), config.leave_timeout.total_seconds())


@dataclass(frozen=True)
class ResizeOp:
    """One grow or shrink in flight.

    Attributes:
        kind: grow or shrink.
        target: the node count asked for (a grow adds up to `target - nodes now`, as free nodes allow).
        action / reason: what the records call it (grow, shrink, revert, straggler, replace) and why.
        state: where it is; `deadline`: when the current state fails (None: not a waiting state).
        exclude: nodes a grow's helper must not get; prefer: nodes a shrink removes first.
        nodes: a grow's helper nodes once ALLOCATED; a shrink's leavers (chosen before it starts).
        helper: a grow's helper job id once submitted.
        plan_id: the posted plan (None until posted, or after a post lost a race); post_attempts: posts tried.
        started / allocated: clock times (the records' wall_s, allocate_s); from_nodes: the size it started at.
        error: why it FAILED; cancelled: failed by a cancel; counts: a failure that counts toward max_failures;
        skipped: nothing to do (no free nodes, already at the target); left: a shrink's leavers left cleanly.
        failed_in: the state a FAILED op was in when it failed.
    """

    kind: ResizeKind
    target: int
    action: str
    reason: str
    state: ResizeState = ResizeState.REQUESTED
    deadline: Optional[float] = None
    exclude: tuple[str, ...] = ()
    prefer: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    helper: Optional[str] = None
    plan_id: Optional[int] = None
    post_attempts: int = 0
    started: Optional[float] = None
    allocated: Optional[float] = None
    from_nodes: int = 0
    error: Optional[str] = None
    cancelled: bool = False
    counts: bool = False
    skipped: bool = False
    left: bool = False
    failed_in: Optional[ResizeState] = None

    @property
    def done(self) -> bool:
        return self.state is ResizeState.FAILED or self.state is (
            ResizeState.SWITCHED if self.kind is ResizeKind.GROW else ResizeState.RELEASED)

    @property
    def cancellable(self) -> bool:
        """Nothing posted yet: a cancel ends it in the tick it comes."""
        return self.state in (ResizeState.REQUESTED, ResizeState.SUBMITTED, ResizeState.ALLOCATED)

    def __post_init__(self) -> None:
        if isinstance(self.target, bool) or not isinstance(self.target, int) or self.target < 1:
            raise ValueError(f"a {self.kind.value} to {self.target!r} nodes: the target must be an integer >= 1 "
                             f"(a job keeps at least its batch host)")


@dataclass(frozen=True)
class Observation:
    """What the controller saw this tick, for the op in flight.

    Attributes:
        helper_state: the helper job's Slurm state ("UNKNOWN": Slurm could not be asked; "GONE": not listed).
        helper_nodes: its nodes once it runs.
        joined: every newcomer node has its workers announced in the rendezvous.
        switched: the op's plan reported its first step.
        superseded: a later epoch (a failure recovery) replaced the op's plan before it switched.
        carried: (a superseded grow) every newcomer's workers are members of the epoch that replaced the plan: the
            recovery took the newcomers with it, so the grow holds.
        left: a shrink's leavers all left at the commit point.
        failed_nodes: nodes of the op whose workers failed (the helper agent's status).
        cancel: why the op is to stop now (an operator request, the main job ending), if it is.
        hold: a failed node is being recovered: post and submit nothing this tick.
        released: a shrink's release (its ReleaseOp) ended.
    """

    helper_state: Optional[str] = None
    helper_nodes: tuple[str, ...] = ()
    joined: bool = False
    switched: bool = False
    superseded: bool = False
    carried: bool = False
    left: bool = False
    failed_nodes: tuple[str, ...] = ()
    cancel: Optional[str] = None
    hold: bool = False
    released: bool = False


class ActionKind(enum.Enum):
    SUBMIT_HELPER = "submit_helper"  # submit a helper job for the op's grow (the executor sets op.helper)
    ADOPT_NODES = "adopt_nodes"      # the helper's nodes become joining nodes (their workers' id prefixes)
    POST_PLAN = "post_plan"          # post the plan with the newcomers / without the leavers (sets op.plan_id)
    CANCEL_HELPER = "cancel_helper"  # end the op's helper job now (stop key and scancel, no wait)
    RELEASE_NODES = "release_nodes"  # start releasing nodes (a ReleaseOp: their steps end, then back to Slurm)
    FINISH = "finish"                # the new size holds: nodes become members, transition recorded, window reset
    ABORT = "abort"                  # the op failed: its nodes are forgotten, the failure recorded
    TERMINATE = "terminate"          # release: SIGTERM to the nodes' steps still running (no wait)
    KILL = "kill"                    # release: SIGKILL to them (no wait)
    GIVE_BACK = "give_back"          # release: the steps ended; Slurm shrink (main job) / end or shrink the helper


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    nodes: tuple[str, ...] = ()


def _to(op: ResizeOp, state: ResizeState, now: float, wait_s: Optional[float] = None, **changes) -> ResizeOp:
    return dataclasses.replace(op, state=state, deadline=None if wait_s is None else now + wait_s, **changes)


def fail(op: ResizeOp, now: float, error: str, *, cancelled: bool = False, counts: bool = False,
         skipped: bool = False) -> tuple[ResizeOp, list[Action]]:
    """`op` FAILED with `error`: its helper (if any) is cancelled, the failure recorded."""
    failed = _to(op, ResizeState.FAILED, now, error=error, cancelled=cancelled, counts=counts, skipped=skipped,
                 failed_in=op.state)
    actions = [Action(ActionKind.CANCEL_HELPER)] if op.helper is not None else []
    return failed, actions + [Action(ActionKind.ABORT, op.nodes)]


def _expired(op: ResizeOp, now: float) -> bool:
    return op.deadline is not None and now >= op.deadline


def _helper_ended(state: Optional[str]) -> bool:
    return state is not None and state != UNKNOWN and state not in HELPER_ALIVE


def advance(op: ResizeOp, obs: Observation, now: float, limits: ResizeLimits) -> tuple[ResizeOp, list[Action]]:
    """Move `op` at most one state on what was observed at `now`; return it and the actions to execute."""
    if op.done:
        return op, []
    if obs.cancel is not None and op.cancellable:
        return fail(op, now, f"cancelled: {obs.cancel}", cancelled=True)
    if op.started is None:
        op = dataclasses.replace(op, started=now)
    if obs.hold and (op.state is ResizeState.REQUESTED or op.state is ResizeState.ALLOCATED and obs.joined
                     or op.state is ResizeState.JOINED and op.plan_id is None):
        return (fail(op, now, _deadline_error(op, limits), counts=op.state is not ResizeState.REQUESTED)
                if _expired(op, now) else (op, []))
    if op.state is ResizeState.JOINED:
        return _joined(op, obs, now, limits)
    if op.kind is ResizeKind.SHRINK:
        return _shrink(op, obs, now, limits)
    return _grow(op, obs, now, limits)


def _grow(op: ResizeOp, obs: Observation, now: float, limits: ResizeLimits) -> tuple[ResizeOp, list[Action]]:
    s = op.state
    if s is ResizeState.REQUESTED:
        return _to(op, ResizeState.SUBMITTED, now, limits.helper_start_s), [Action(ActionKind.SUBMIT_HELPER)]
    if s is ResizeState.SUBMITTED:
        if obs.helper_state == "RUNNING" and obs.helper_nodes:
            nodes = tuple(obs.helper_nodes)
            return (_to(op, ResizeState.ALLOCATED, now, limits.join_s, nodes=nodes, allocated=now),
                    [Action(ActionKind.ADOPT_NODES, nodes)])
        if _helper_ended(obs.helper_state):
            return fail(op, now, f"helper {op.helper} ended ({obs.helper_state}) before it ran")
        if _expired(op, now):
            return fail(op, now, f"helper {op.helper} did not start within {limits.helper_start_s:g} s")
        return op, []
    # ALLOCATED
    if obs.failed_nodes:
        return fail(op, now, f"workers failed on {','.join(obs.failed_nodes)} before joining", counts=True)
    if _helper_ended(obs.helper_state):
        return fail(op, now, f"helper {op.helper} ended ({obs.helper_state}) while its workers joined", counts=True)
    if obs.joined:
        return _to(op, ResizeState.JOINED, now, limits.switch_s), [Action(ActionKind.POST_PLAN, op.nodes)]
    if _expired(op, now):
        return fail(op, now, f"workers did not join within {limits.join_s:g} s on {','.join(op.nodes)}",
                    counts=True)
    return op, []


def _shrink(op: ResizeOp, obs: Observation, now: float, limits: ResizeLimits) -> tuple[ResizeOp, list[Action]]:
    if op.state is ResizeState.REQUESTED:
        if not op.nodes:
            return fail(op, now, "no node to remove", skipped=True)
        return _to(op, ResizeState.JOINED, now, limits.switch_s), [Action(ActionKind.POST_PLAN, op.nodes)]
    if op.state is ResizeState.RELEASING:  # their steps end (ReleaseOp, no deadline here: it has its own)
        if obs.released:
            return _to(op, ResizeState.RELEASED, now), [Action(ActionKind.FINISH, op.nodes)]
        return op, []
    # SWITCHED: the leavers leave at the commit point, then their nodes are released
    if obs.left or _expired(op, now):
        return _to(op, ResizeState.RELEASING, now, left=obs.left), [Action(ActionKind.RELEASE_NODES, op.nodes)]
    return op, []


def _deadline_error(op: ResizeOp, limits: ResizeLimits) -> str:
    """Why a held op failed at its deadline (a recovery kept it from moving on)."""
    waited = {ResizeState.ALLOCATED: limits.join_s, ResizeState.JOINED: limits.switch_s}.get(op.state)
    return f"held in {op.state.value} by a node's recovery" + (f" past its {waited:g} s" if waited else "")


def _joined(op: ResizeOp, obs: Observation, now: float, limits: ResizeLimits) -> tuple[ResizeOp, list[Action]]:
    """The plan is posted (or its post lost a race and is retried): wait for its first step."""
    if op.plan_id is None:
        if op.post_attempts >= POST_ATTEMPTS:
            return fail(op, now, f"posting the plan lost {op.post_attempts} races to recoveries", counts=True)
        return op, [Action(ActionKind.POST_PLAN, op.nodes)]
    if obs.switched:
        if op.kind is ResizeKind.GROW:
            return _to(op, ResizeState.SWITCHED, now), [Action(ActionKind.FINISH, op.nodes)]
        return _to(op, ResizeState.SWITCHED, now, limits.leave_s), []
    if obs.superseded and obs.carried and op.kind is ResizeKind.GROW:
        # the plan switched (or split) and a recovery replaced it before its first step was reported, keeping the
        # newcomers: they train in the recovery's epoch, so cancelling the helper would kill live members
        return _to(op, ResizeState.SWITCHED, now), [Action(ActionKind.FINISH, op.nodes)]
    if obs.superseded:
        return fail(op, now, f"epoch {op.plan_id} was superseded by a recovery before its first step", counts=True)
    if op.kind is ResizeKind.GROW and obs.failed_nodes:
        return fail(op, now, f"workers failed on {','.join(obs.failed_nodes)} before the switch", counts=True)
    if _expired(op, now):
        return fail(op, now, f"epoch {op.plan_id} reported no first step within {limits.switch_s:g} s",
                    counts=True)
    return op, []


# -- releasing nodes ----------------------------------------------------------------------------------------
class ReleaseState(enum.Enum):
    EXITING = "exiting"          # the nodes' workers left or failed: their steps end by themselves (exit_s)
    TERMINATING = "terminating"  # SIGTERM sent to the steps still running (leave_s)
    KILLING = "killing"          # SIGKILL sent (leave_s)
    GIVING_BACK = "giving_back"  # the steps ended (or were given up on): Slurm is asked to take the nodes back,
                                 # each change retried on later ticks through a slurmctld outage (release.py)
    RELEASED = "released"        # the nodes are back with Slurm (or Slurm refused and they stay, unused)


@dataclass(frozen=True)
class ReleaseOp:
    """Nodes on their way back to Slurm: their worker steps end first (Slurm SIGKILLs the tasks of a released
    node), then GIVE_BACK. `give_back` False: the batch host, which Slurm cannot drop (its step is ended so that
    fresh workers can start there). `deadline`: when the current state escalates."""

    nodes: tuple[str, ...]
    reason: str
    state: ReleaseState = ReleaseState.EXITING
    deadline: Optional[float] = None
    give_back: bool = True
    started: Optional[float] = None

    @property
    def done(self) -> bool:
        return self.state is ReleaseState.RELEASED


def advance_release(op: ReleaseOp, running: tuple[str, ...], now: float, limits: ResizeLimits,
                    given_back: bool = False) -> tuple[ReleaseOp, list[Action]]:
    """Move a release on: `running` are its nodes whose step still runs; `given_back`, in GIVING_BACK, that no
    Slurm change of the release is still in flight (each ends by itself: done, refused, or out of retries)."""
    if op.done:
        return op, []
    if op.state is ReleaseState.GIVING_BACK:
        return (dataclasses.replace(op, state=ReleaseState.RELEASED), []) if given_back else (op, [])
    if op.started is None:
        op = dataclasses.replace(op, started=now, deadline=now + limits.exit_s)
    if not running or op.state is ReleaseState.KILLING and _expired(op, now):
        if not op.give_back:
            return dataclasses.replace(op, state=ReleaseState.RELEASED, deadline=None), []
        return (dataclasses.replace(op, state=ReleaseState.GIVING_BACK, deadline=None),
                [Action(ActionKind.GIVE_BACK, op.nodes)])
    if not _expired(op, now):
        return op, []
    if op.state is ReleaseState.EXITING:
        return (dataclasses.replace(op, state=ReleaseState.TERMINATING, deadline=now + limits.leave_s),
                [Action(ActionKind.TERMINATE, running)])
    return (dataclasses.replace(op, state=ReleaseState.KILLING, deadline=now + limits.leave_s),
            [Action(ActionKind.KILL, running)])


# -- recovering a failed node ---------------------------------------------------------------------------------
class RecoveryState(enum.Enum):
    DETECTED = "detected"    # failure recorded; the survivors' recovery epoch without the node's workers awaited
    EVICTED = "evicted"      # that epoch is current; its first step awaited
    RELEASING = "releasing"  # the node's step ending (ReleaseOp); then given back, or restarted (batch host)
    DONE = "done"            # transition recorded


@dataclass(frozen=True)
class RecoveryOp:
    """One failed node's handling (the survivors recover by themselves; the controller follows and releases).

    Attributes:
        node: the failed node; workers: its workers' ids; evicted: its workers still ran but a recovery epoch
            left them out (fenced out: hung, or past the arrival deadline; else their step ended non-zero).
        keep: the node stays the job's once its step ended (the batch host, or a fenced-out node the planner
            wants): fresh workers start there and join as newcomers (a grow without a helper).
        state / deadline: where it is and when the current state gives up waiting.
        plan_id: the recovery epoch once the node's workers are out of the membership.
        recovered: the survivors' recovery epoch came (False: the deadline passed first).
        started: clock time of the failure's detection (the record's wall_s).
    """

    node: str
    workers: tuple[str, ...]
    evicted: bool = False
    keep: bool = False
    state: RecoveryState = RecoveryState.DETECTED
    deadline: Optional[float] = None
    plan_id: Optional[int] = None
    recovered: bool = False
    started: Optional[float] = None

    @property
    def done(self) -> bool:
        return self.state is RecoveryState.DONE

    @property
    def settled(self) -> bool:
        """The membership no longer waits on this failure (the recovery epoch switched, or was given up on)."""
        return self.state in (RecoveryState.RELEASING, RecoveryState.DONE)


@dataclass(frozen=True)
class RecoveryObservation:
    """What a recovery needs to know this tick.

    Attributes:
        in_membership: some of the node's workers are in the current epoch.
        epoch: the current epoch's id.
        switched: the current epoch reported its first step.
        released: the node's ReleaseOp ended.
    """

    in_membership: bool = True
    epoch: int = 0
    switched: bool = False
    released: bool = False


def advance_recovery(op: RecoveryOp, obs: RecoveryObservation, now: float,
                     limits: ResizeLimits) -> tuple[RecoveryOp, list[Action]]:
    """Move a failed node's recovery at most one state on what was observed at `now`."""
    if op.started is None:
        op = dataclasses.replace(op, started=now, deadline=now + limits.join_s)
    release = [Action(ActionKind.RELEASE_NODES, (op.node,))]
    if op.state is RecoveryState.DETECTED:
        if not obs.in_membership:
            return dataclasses.replace(op, state=RecoveryState.EVICTED, plan_id=obs.epoch, recovered=True,
                                       deadline=now + limits.switch_s), []
        if _expired(op, now):  # no recovery epoch came: release the node anyway (the job may be ending)
            return dataclasses.replace(op, state=RecoveryState.RELEASING, deadline=None), release
        return op, []
    if op.state is RecoveryState.EVICTED:
        if obs.switched or _expired(op, now):
            return dataclasses.replace(op, state=RecoveryState.RELEASING, plan_id=obs.epoch, deadline=None), release
        return op, []
    if op.state is RecoveryState.RELEASING and obs.released:
        return dataclasses.replace(op, state=RecoveryState.DONE), [Action(ActionKind.FINISH, (op.node,))]
    return op, []
