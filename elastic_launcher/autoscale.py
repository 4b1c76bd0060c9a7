"""Autoscaling decisions from measured throughput: pure, no I/O (unit-tested in tests/unit/test_autoscale.py).

Throughput scaling efficiency (Or et al.), going from k to k+d workers with throughputs T_k, T_{k+d}:
    s = (T_{k+d} - T_k) / (d * T_k / k)          1 = perfect, 0 = no gain, < 0 = slower.
A grow is kept when s >= min_efficiency; otherwise it is reverted and no size at or above the one that
did not pay is tried again (the ceiling).

One policy: the predictor's /v1/plan (the planner the job_submit hook used at submit time) decides the
target size, passed in as a `PlanAdvice`. With a plan the policy never grows past the plan's node count,
stays when the plan says the current size (a `keep`), and shrinks toward it when it says fewer nodes. The
launcher's own heuristic grow (`grow_step_nodes` while nodes are free) runs only while the service is
unreachable or not configured, and its reasons say so. A job without `#ELASTIC` lines is not autoscaled
(the planner would answer `keep`: not an elastic job). The revert test and the directives' limits apply
on top of either.

The shrinks decided here (the plan's, a revert, above the directives' limits or the ceiling, a hand-back to a
pending job) are the job's choice: none pushes it past its Slurm time limit (issue #40). `TimeBudget` carries the
time to the job's end and the steps left, and `AutoscalePolicy.within_limit` moves such a shrink to the smallest
size from its target up to the current one that still finishes, or refuses it. Shrinks the job does not choose
(failed, taken, hung or straggling nodes: decide_failures, the straggler detector) are not checked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from slurm_plugin.contracts.records import counted


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Throughput measured at one size.

    Attributes:
        nodes: nodes in the membership when measured.
        workers: workers (GPU slots) in the membership.
        samples_per_s: committed samples per second over the window.
        step_s: mean wall time per committed step over the window.
    """

    nodes: int
    workers: int
    samples_per_s: float
    step_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the policy wants next.

    Attributes:
        action: "keep" | "grow" | "revert" | "shrink".
        target_nodes: node count to move to (the current one for keep).
        reason: one line for the records and the operator.
        efficiency: the scaling efficiency that led to it, when one was computed.
    """

    action: str
    target_nodes: int
    reason: str
    efficiency: Optional[float] = None


PLANNER = "planner"               # /v1/plan answered: its node count is the target
UNREACHABLE = "unreachable"       # the service is unreachable, refused the request or answered garbage: heuristic
NOT_CONFIGURED = "not-configured"  # no predictor URL at all: the same heuristic, and the records say why (#45.4)
NO_DIRECTIVES = "no-directives"   # the job has no #ELASTIC lines: nothing to plan, no autoscaling grow
ADVICE_SOURCES = (PLANNER, UNREACHABLE, NOT_CONFIGURED, NO_DIRECTIVES)


@dataclasses.dataclass(frozen=True)
class PlanAdvice:
    """What /v1/plan says about the job's size now, and where that came from.

    Attributes:
        nodes: node count the plan wants (the current one for a `keep`); None unless source is PLANNER.
        source: PLANNER | UNREACHABLE | NOT_CONFIGURED | NO_DIRECTIVES.
        note: one line: the planner's reason, or why there is no plan.
    """

    nodes: Optional[int]
    source: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.source not in ADVICE_SOURCES:
            raise ValueError(f"PlanAdvice.source: expected one of {'|'.join(ADVICE_SOURCES)}, got {self.source!r}")
        if (self.source == PLANNER) != (self.nodes is not None):
            raise ValueError(f"PlanAdvice.nodes: a {self.source} advice has nodes={self.nodes!r}")
        if self.nodes is not None and self.nodes < 1:
            raise ValueError(f"PlanAdvice.nodes: must be >= 1, got {self.nodes}")

    @property
    def policy(self) -> str:
        """Who decides the size: what the `decision` record's `policy` field says."""
        return {PLANNER: "planner", UNREACHABLE: "heuristic (service unreachable)",
                NOT_CONFIGURED: "heuristic (no predictor configured)",
                NO_DIRECTIVES: "none (no #ELASTIC directives)"}[self.source]


NO_SERVICE = PlanAdvice(None, NOT_CONFIGURED, "no predictor service")

# A voluntary shrink to S is kept when steps_left x step_s(S) x LIMIT_PAD + LIMIT_SLACK_S <= the time left to the
# job's end. 5%: step-time noise between windows and the error of an unmeasured size's estimate (taken linear,
# AutoscalePolicy.step_s_at); 60 s: the resize's own pause (1.1 s measured) and the script's last save before
# Slurm's SIGTERM-to-SIGKILL wait (KillWait, 30 s by default). The launcher does not know the script's checkpoint
# interval (an elastic job keeps its state across resizes), so none is added.
LIMIT_PAD = 1.05
LIMIT_SLACK_S = 60.0


@dataclasses.dataclass(frozen=True)
class TimeBudget:
    """What a voluntary shrink is checked against (issue #40).

    Attributes:
        time_left_s: seconds from now to the job's end (Slurm's EndTime: start plus its time limit); None: unknown.
        steps_left: training steps left (the script's --steps less the furthest committed step); None: unknown.
    """

    time_left_s: Optional[float]
    steps_left: Optional[float]

    def __post_init__(self) -> None:
        for name in ("time_left_s", "steps_left"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"TimeBudget.{name}: expected None or a number >= 0, got {value!r}")

    @property
    def unknown(self) -> str:
        """Why the limit cannot be checked ("" when it can)."""
        missing = [what for what, v in (("the job's end time", self.time_left_s), ("the steps left", self.steps_left))
                   if v is None]
        return f"{' and '.join(missing)} unknown" if missing else ""

    def needs_s(self, step_s: float) -> float:
        """Time the steps left need at `step_s` a step, with the margin (LIMIT_PAD, LIMIT_SLACK_S)."""
        return self.steps_left * step_s * LIMIT_PAD + LIMIT_SLACK_S

# A job hands nodes to the head pending job only when that job's time limit is at most this share of its own time
# left. Replay of Pollux 1-8 (bench/results/replay/README.md, session 21, seed 0), with the grow back: 0.5 against no
# such rule, elastic mean -25.8% against -22.8% average JCT, jobs >10% later 17.6% against 23.8%.
YIELD_RATIO = 0.5


def advice_from_plan(reply: Optional[dict], current_nodes: int, slots_per_node: int) -> PlanAdvice:
    """Map a /v1/plan answer (planner.plan's body) to a target node count for a job at `current_nodes`.

    `keep` (the job already runs the planned layout, or the planner cannot judge it) means: stay at the
    current size. `rewrite` means: move to the plan's layout; a layout with another GPU count per node than
    the job's `slots_per_node` (which a running job cannot change) is taken as its GPU count in whole nodes
    of the job, rounded down (never more GPUs than planned), at least 1. None or an answer without a usable
    layout: UNREACHABLE (the client already turns errors and garbage into None).
    """
    if reply is None:
        return PlanAdvice(None, UNREACHABLE, "service unreachable")
    note = " ".join(str(reply.get("reason") or "").split())
    action = reply.get("action")
    if action == "keep":
        return PlanAdvice(current_nodes, PLANNER, note)
    nodes, per_node, layout = reply.get("nodes"), reply.get("gpus_per_node"), reply.get("layout")
    if action != "rewrite" or not _positive_int(nodes):
        return PlanAdvice(None, UNREACHABLE, f"unusable plan answer: action {action!r}, nodes {nodes!r}")
    if per_node is None or per_node == slots_per_node:
        return PlanAdvice(nodes, PLANNER, note)
    if isinstance(layout, list) and layout and all(_positive_int(g) for g in layout):
        gpus = sum(layout)
    elif _positive_int(per_node):
        gpus = nodes * per_node
    else:
        return PlanAdvice(None, UNREACHABLE, f"unusable plan answer: layout {layout!r}, gpus_per_node {per_node!r}")
    return PlanAdvice(max(1, gpus // slots_per_node), PLANNER, note)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class PendingJob:
    """Another job of the partition waiting for nodes (squeue: PENDING, reason Resources or Priority).

    Attributes:
        job_id: its Slurm id.
        nodes: nodes it asks for.
        reason: Slurm's pending reason.
        time_limit_s: its time limit (inf: none known; such a job is never handed nodes: yield_to_pending).
    """

    job_id: int
    nodes: int
    reason: str
    time_limit_s: float = math.inf

    @staticmethod
    def of(jobs, ours: set, partition: str | None = None) -> "list[PendingJob]":
        """The jobs (squeue's, `slurm_plugin.client.Job`) pending for nodes, highest priority first (then oldest),
        but ``ours`` (the job and its helpers), and those of another partition than ``partition`` when given.
        Reason "None": just submitted, not yet looked at by the scheduler (a job that idle nodes can take needs
        nothing from this one: yield_to_pending counts the idle nodes first)."""
        jobs = sorted(jobs, key=lambda j: (-j.priority, j.job_id))
        return [PendingJob(j.job_id, j.node_count, j.reason, j.time_limit_s or math.inf) for j in jobs
                if j.state == "PENDING" and j.job_id not in ours and j.node_count > 0
                and j.reason in ("Resources", "Priority", "None")
                and (not partition or partition in j.partition.split(","))]


def yield_to_pending(current_nodes: int, min_nodes: int, idle_nodes: int, pending: "list[PendingJob]",
                     time_left_s: float = math.inf, yield_ratio: float = YIELD_RATIO) -> Optional[Decision]:
    """A shrink that lets the partition's next pending job start, or None.

    `pending` is in Slurm's order (highest priority first); the job gives back what the first of them lacks
    beyond the idle nodes, never going below its own minimum (the `gpus` directive's lower bound). Only the first:
    nodes handed back for a later, smaller job let it jump the queue, and the large jobs at its head wait for ever
    (the replay of Pollux workload 5: average JCT +99% against as submitted when it yielded to the smallest pending
    job first, -5% when it yields to the head; bench/results/replay/README.md). A head that even the job's whole
    surplus cannot unblock is left to Slurm, and so is one whose time limit is over `yield_ratio` of this job's
    `time_left_s` (or unknown): shrinking a long job for another long one keeps both on the cluster longer. The
    nodes handed back are lent: `AutoscalePolicy.lent_nodes_` grows the job back once nobody waits.
    """
    if not pending:
        return None
    p, spare = pending[0], current_nodes - min_nodes
    if not p.time_limit_s <= yield_ratio * time_left_s:
        return None
    need = p.nodes - idle_nodes
    if 0 < need <= spare:
        return Decision("shrink", current_nodes - need,
                        f"handing {need} node{'s' if need > 1 else ''} back for pending job {p.job_id} "
                        f"({p.nodes} node{'s' if p.nodes > 1 else ''}, {p.reason})")
    return None


def scaling_efficiency(before: Measurement, after: Measurement) -> float:
    """Or et al.'s throughput scaling efficiency from `before` (k workers) to `after` (k+d workers).

    Raises:
        ValueError: when the worker counts are equal or the `before` throughput is not positive.
    """
    k, d = before.workers, after.workers - before.workers
    if d == 0:
        raise ValueError(f"scaling_efficiency: both measurements have {k} workers")
    if before.samples_per_s <= 0:
        raise ValueError(f"scaling_efficiency: throughput at {k} workers is {before.samples_per_s}")
    return (after.samples_per_s - before.samples_per_s) / (d * before.samples_per_s / k)


class AutoscalePolicy:
    """Grow while it pays; revert a grow that did not.

    Args:
        min_efficiency: a grow is kept when its scaling efficiency is at least this.
        max_global_batch: workers * per_gpu_batch must stay at or below this when growing.
        per_gpu_batch: samples per worker per step.
        slots_per_node: workers per node.
        min_workers / max_workers: bounds on workers from `#ELASTIC gpus=MIN-MAX`.
        grow_step_nodes: nodes added by one grow.

    State (set by `record`): `history_` (measurements in the order taken), `ceiling_nodes_` (smallest node
    count that was tried and did not pay; None before any revert); `lent_nodes_` (set by the caller when it hands
    nodes back to a pending job: the size the job had before; 0: none lent), which `decide` grows back to.
    """

    def __init__(self, min_efficiency: float = 0.7, max_global_batch: int = 1 << 24, per_gpu_batch: int = 32,
                 slots_per_node: int = 1, min_workers: int = 1, max_workers: int = 4096, grow_step_nodes: int = 1):
        self.min_efficiency = min_efficiency
        self.max_global_batch = max_global_batch
        self.per_gpu_batch = per_gpu_batch
        self.slots_per_node = slots_per_node
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.grow_step_nodes = grow_step_nodes
        self.history_: list[Measurement] = []
        self.ceiling_nodes_: Optional[int] = None
        self.lent_nodes_ = 0

    def record(self, measurement: Measurement) -> None:
        """Add the measurement at the current size (call once per measurement window)."""
        self.history_.append(measurement)

    def directive_max_nodes(self) -> int:
        """Largest node count the directives allow (`gpus` max and `max_global_batch`), ignoring the ceiling."""
        by_batch = self.max_global_batch // (self.per_gpu_batch * self.slots_per_node)
        by_gpus = self.max_workers // self.slots_per_node
        return max(min(by_batch, by_gpus), 0)

    def max_nodes(self) -> int:
        """Largest node count allowed by the directives, the global batch cap and the ceiling."""
        limit = self.directive_max_nodes()
        if self.ceiling_nodes_ is not None:
            limit = min(limit, self.ceiling_nodes_ - 1)
        return max(limit, 0)

    def min_nodes(self) -> int:
        return max(1, -(-self.min_workers // self.slots_per_node))

    def node_range(self) -> tuple[int, int]:
        """(min, max) nodes the job may span by its directives: what /v1/plan is asked to choose within."""
        low = self.min_nodes()
        return low, max(low, self.directive_max_nodes())

    def _last_step(self) -> tuple[Optional[Measurement], Optional[Measurement]]:
        """The latest measurement and the one before it at a different size (None when absent)."""
        if not self.history_:
            return None, None
        current = self.history_[-1]
        for earlier in reversed(self.history_[:-1]):
            if earlier.nodes != current.nodes:
                return current, earlier
        return current, None

    def step_s_at(self, nodes: int) -> float:
        """Step time expected at `nodes`: the latest measurement at that size, else the latest one scaled linearly
        (step_s x its nodes / `nodes`: the most a shrink of a fixed global batch slows the job under sublinear
        scaling; pessimistic for keep_per_gpu, whose step time barely changes: it may keep a job at a size it could
        have left, not run it into its limit). Precondition: a measurement with step_s > 0 was recorded."""
        at = [m for m in self.history_ if m.nodes == nodes and m.step_s > 0]
        if at:
            return at[-1].step_s
        current = self.history_[-1]
        return current.step_s * current.nodes / nodes

    def within_limit(self, decision: Decision, nodes: int, budget: Optional[TimeBudget],
                     whole: bool = False) -> Decision:
        """`decision` at `nodes` nodes, a voluntary shrink or revert being moved to the smallest size from its target
        up to below `nodes` whose steps left finish before the job's end (`TimeBudget.needs_s` at `step_s_at`), or
        turned into a keep when none does (issue #40). `whole`: only the target itself will do (a hand-back: fewer
        nodes do not let the pending job start). Other decisions are returned as they are; with the end time, the
        steps left or a step time unknown the shrink stands as before and its reason says the limit was not
        checked."""
        target = decision.target_nodes
        if decision.action not in ("shrink", "revert") or target >= nodes:
            return decision
        why = "no time budget given" if budget is None else budget.unknown
        if not why and not (self.history_ and self.history_[-1].step_s > 0):
            why = "no step time measured"
        if why:
            return dataclasses.replace(decision, reason=f"{decision.reason}; time limit not checked: {why}")
        fit = next((n for n in ([target] if whole else range(target, nodes))
                    if budget.needs_s(self.step_s_at(n)) <= budget.time_left_s), None)
        if fit == target:
            return decision
        short = (f"{budget.steps_left:.0f} steps left need {budget.needs_s(self.step_s_at(target)):.0f} s at "
                 f"{counted(target, 'node')}, {budget.time_left_s:.0f} s to the time limit")
        if fit is None:
            return Decision("keep", nodes, f"{decision.reason}; refused: {short}", decision.efficiency)
        return Decision(decision.action, fit, f"{decision.reason}; to {counted(fit, 'node')}, not {target}: {short}",
                        decision.efficiency)

    def decide(self, free_nodes: int, advice: PlanAdvice = NO_SERVICE, waiting: bool = True,
               budget: Optional[TimeBudget] = None) -> Decision:
        """Decide from the latest measurement.

        Args:
            free_nodes: idle nodes a grow could get now.
            advice: what /v1/plan says (`PlanAdvice`). PLANNER: grow toward its node count (never past it,
                nor past the policy's own limits), stay when it is the current size, shrink toward it when it
                is smaller. UNREACHABLE, NOT_CONFIGURED: the heuristic grow by `grow_step_nodes`. NO_DIRECTIVES: no
                grow.
            waiting: whether a job of the partition waits for nodes. The plan's shrink waits for one (the nodes
                it frees would idle: in the replay of Pollux 1-8 a 6-GPU job shrunk to 4 while nobody waited ran
                25% longer); with none, nodes lent to pending jobs (`lent_nodes_`) are grown back whatever the
                plan says of a grow (the size was the job's own), never past a size a revert found not to pay.
            budget: the time to the job's end and its steps left: every shrink and revert decided here goes only
                as far as finishes before it (`within_limit`); None or unknown parts: not checked, and the reason says so.

        Preconditions: `record` was called at the current size.
        """
        current, before = self._last_step()
        if current is None:
            return Decision("keep", 0, "no measurement yet")
        efficiency = None
        if before is not None and current.nodes > before.nodes:
            efficiency = scaling_efficiency(before, current)
            if efficiency < self.min_efficiency:
                self.ceiling_nodes_ = current.nodes if self.ceiling_nodes_ is None else min(self.ceiling_nodes_,
                                                                                             current.nodes)
                target = max(before.nodes, self.min_nodes())
                return self.within_limit(Decision(
                    "revert", target, f"grow {before.nodes}->{counted(current.nodes, 'node')} did not pay: "
                    f"efficiency {efficiency:.2f} < {self.min_efficiency:.2f}", efficiency), current.nodes, budget)
        if current.nodes > self.max_nodes() and current.nodes > self.min_nodes():
            target = max(self.max_nodes(), self.min_nodes())
            return self.within_limit(Decision("shrink", target, f"{counted(current.nodes, 'node')} is above the limit "
                                              f"{self.max_nodes()}", efficiency), current.nodes, budget)
        if advice.source == NO_DIRECTIVES:
            return Decision("keep", current.nodes, "no #ELASTIC directives: not autoscaled", efficiency)
        if advice.source == PLANNER and advice.nodes < current.nodes:
            target = max(advice.nodes, self.min_nodes())
            why = f"plan says {counted(advice.nodes, 'node')}, fewer than {current.nodes}"
            if target < current.nodes:
                if not waiting:
                    return Decision("keep", current.nodes, f"{why}; no job waits for the nodes", efficiency)
                return self.within_limit(Decision("shrink", target, why, efficiency), current.nodes, budget)
        limit = min(self.max_nodes(), current.nodes + free_nodes)
        want = advice.nodes if advice.source == PLANNER else current.nodes + self.grow_step_nodes
        target = min(want, limit, current.nodes + self.grow_step_nodes)
        if target <= current.nodes:
            back = min(self.lent_nodes_, limit)
            if back > current.nodes and not waiting:
                return Decision("grow", back, f"growing back toward the {counted(self.lent_nodes_, 'node')} it had "
                                "before handing nodes to pending jobs", efficiency)
            why = self._why_not(current, free_nodes, advice)
            return Decision("keep", current.nodes, why, efficiency)
        source = f"plan says {counted(advice.nodes, 'node')}" if advice.source == PLANNER else advice.policy
        paid = "" if efficiency is None else f", last grow efficiency {efficiency:.2f}"
        return Decision("grow", target, f"{source}; global batch {target * self.slots_per_node * self.per_gpu_batch}"
                        f" <= {self.max_global_batch}{paid}", efficiency)

    def _why_not(self, current: Measurement, free_nodes: int, advice: PlanAdvice) -> str:
        if advice.source == PLANNER and advice.nodes <= current.nodes:
            return f"plan says {counted(advice.nodes, 'node')}"
        if self.ceiling_nodes_ is not None and current.nodes + 1 >= self.ceiling_nodes_:
            return f"{counted(self.ceiling_nodes_, 'node')} did not pay before"
        if current.nodes >= self.max_nodes():
            return f"at the limit of {counted(self.max_nodes(), 'node')} (max_global_batch / gpus)"
        if free_nodes <= 0:
            return "no free nodes"
        return "grow step does not fit"
