"""The controller's pure decisions (no I/O): what an operator request, a measurement window and a failure
survey lead to. :class:`~elastic_launcher.controller.Controller` gathers the facts, calls these and has the
:class:`~elastic_launcher.resize.Resizer` execute the result.

Transitions of a job (:class:`JobPhase`; the loop reads it to know what it may start)::

    STARTING --initial plan's first step (one start stage a tick)--> RUNNING
    any --every main-job worker ended--> ENDED (completed | failed)
    each tick (never waiting for a start, a recovery or a resize: controller.Controller._tick):
        failures       -> decide_failures, then Resizer.node_failed each (a resize_ops.RecoveryOp followed tick by
                          tick: release or restart the node): RECOVERING until every recovery and rejoin ended,
                          ops post and submit nothing meanwhile; a node an op or a recovery handles is theirs
        operator asks  -> decide_request: REJECT | ALREADY | RESIZE, answered in this tick; while RESIZING, an op
                          that posted nothing yet is cancelled (its helper released) and the request queued
        the resize     -> Resizer.tick: the op in flight moves one state (resize_ops.advance): RESIZING until
                          it is SWITCHED, RELEASED or FAILED, then RUNNING
        a measurement  -> recorded and posted in RUNNING and RESIZING (while the fleet is the epoch's); only in
                          RUNNING: AutoscalePolicy.decide, then settle_decision (pending jobs, the operator's
                          cap): keep | grow | shrink | revert -> a queued op (RESIZING)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Collection, Optional, Protocol, Sequence

from elastic_launcher.autoscale import Decision, Measurement, PendingJob, PlanAdvice
from slurm_plugin.contracts.records import counted

__all__ = ["JobPhase", "decide_failures", "RequestKind", "RequestAction", "decide_request", "settle_decision",
           "ThroughputModel", "MeasuredThroughput"]


class JobPhase(enum.Enum):
    """Where the controller is (see the module docstring): the loop decides from it what else it may start."""

    STARTING = "starting"      # initial workers joining; the first plan not switched yet (ticked)
    RUNNING = "running"        # steady: measurements may lead to a resize
    RESIZING = "resizing"      # a resize op in flight: failures, requests and measurements still handled
    RECOVERING = "recovering"  # a failed node's recovery or a batch host's rejoin in flight: ops hold, no measuring
    ENDED = "ended"


def decide_failures(ended: Sequence[str], helper_failed: Sequence[str], evicted: Sequence[str],
                    nodes: Collection[str]) -> list[tuple[str, bool]]:
    """The job's nodes to handle as failed, in order, each with ``evicted``: True when its workers still run but
    a recovery epoch left them all out (hung workers the survivors declared dead).

    Args:
        ended: nodes whose main-job step ended non-zero while they were members (not leaving).
        helper_failed: helper nodes whose step ended non-zero (the helper agent's status).
        evicted: nodes none of whose workers is in the current membership.
        nodes: the nodes the job trains on (others are no longer its concern).
    """
    failed = [n for n in (*ended, *helper_failed) if n in nodes]
    return [(n, n not in failed) for n in dict.fromkeys([*failed, *evicted]) if n in nodes]


class RequestKind(enum.Enum):
    REJECT = "reject"    # answered False with the reason
    ALREADY = "already"  # the job has that size: the operator's cap is set, nothing moves
    RESIZE = "resize"    # the cap is set and the job grows or shrinks to it
    LIFT = "lift"        # `ctl --auto`: the operator's size is lifted, the autoscaler decides again


@dataclass(frozen=True)
class RequestAction:
    """The answer to an operator's `elastic-launch ctl JOB --nodes N`.

    Attributes:
        kind: what happens.
        message: the reply the operator reads.
        target: the node count asked for (None when rejected for its form).
    """

    kind: RequestKind
    message: str
    target: Optional[int] = None


def decide_request(target, have: int, min_nodes: int) -> RequestAction:
    """An operator's request for ``target`` nodes while the job has ``have`` (``min_nodes``: the job's minimum);
    ``target`` "auto" lifts the operator's size (the autoscaler decides again)."""
    if target == "auto":
        return RequestAction(RequestKind.LIFT, "the operator's size is lifted: the autoscaler decides again", None)
    if not isinstance(target, int) or target < 1:
        return RequestAction(RequestKind.REJECT, f"'nodes' must be a positive integer, got {target!r}")
    if target == have:
        return RequestAction(RequestKind.ALREADY, f"already on {counted(have, 'node')}", target)
    if target < min_nodes:
        return RequestAction(RequestKind.REJECT, f"{target} nodes is below the job's minimum of {min_nodes}",
                             target)
    return RequestAction(RequestKind.RESIZE, f"resizing from {have} to {counted(target, 'node')}", target)


def settle_decision(decision: Decision, nodes: int, handback: Optional[Decision], pending: Sequence[PendingJob],
                    operator_cap: Optional[int], advice: PlanAdvice) -> Decision:
    """The policy's ``decision`` at ``nodes`` nodes, after what the partition and the operator say.

    Args:
        decision: ``AutoscalePolicy.decide``'s answer.
        nodes: the job's nodes now.
        handback: ``yield_to_pending``'s shrink for a job that waits for this one's nodes, if any (wins over the
            policy and over the operator's size).
        pending: jobs of the partition pending for nodes (no grow while one waits).
        operator_cap: the size the operator set (``elastic-launch ctl JOB --nodes N``), if any: it holds until the
            operator lifts it (``ctl JOB --auto``). The autoscaler (planner, heuristic, revert) only moves the job
            toward it, never away (#45.5: it held against plans in one job and was reverted in another).
        advice: what /v1/plan said.
    """
    if handback is not None:  # another job waits for nodes this one holds above its minimum: it wins, also over
        return handback       # the operator's size (which holds against the autoscaler, not against other users)
    if decision.action == "grow" and pending:  # the free nodes are what a pending job waits to add up
        decision = Decision("keep", nodes, f"no grow while job {pending[0].job_id} waits for nodes "
                            f"({decision.reason})", decision.efficiency)
    cap = operator_cap
    if cap is None or decision.action not in ("grow", "shrink", "revert"):
        return decision
    grow = decision.action == "grow"
    if (grow and nodes < cap) or (not grow and nodes > cap):   # toward the operator's size: at most to it
        target = min(decision.target_nodes, cap) if grow else max(decision.target_nodes, cap)
        return Decision(decision.action, target, f"{decision.reason}; toward the operator's {counted(cap, 'node')}",
                        decision.efficiency)
    return Decision("keep", nodes, f"held at the operator's {counted(cap, 'node')} until `ctl --auto` "
                    f"({decision.reason})", decision.efficiency)


class ThroughputModel(Protocol):
    """What the controller takes as a window's samples/s. Production uses the measurement
    (:class:`MeasuredThroughput`); a test or a CPU testbed, where nothing really scales, injects another through
    ``Controller(throughput=...)`` (``elastic-launch --test-throughput linear`` gives
    ``elastic_launcher.testing.LinearThroughput``)."""

    def samples_per_s(self, measured: float, workers: int, history: Sequence[Measurement]) -> float:
        """``measured`` samples/s of a window at ``workers`` workers; ``history``: the earlier measurements."""


class MeasuredThroughput:
    """The throughput is what was measured (the production model)."""

    def samples_per_s(self, measured: float, workers: int, history: Sequence[Measurement]) -> float:
        return measured
