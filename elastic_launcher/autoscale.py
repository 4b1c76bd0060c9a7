"""Autoscaling decisions from measured throughput: pure, no I/O (unit-tested in tests/unit/test_autoscale.py).

Throughput scaling efficiency (Or et al.), going from k to k+d workers with throughputs T_k, T_{k+d}:
    s = (T_{k+d} - T_k) / (d * T_k / k)          1 = perfect, 0 = no gain, < 0 = slower.
A grow is kept when s >= min_efficiency; otherwise it is reverted and no size at or above the one that
did not pay is tried again (the ceiling). The predictor's plan, when there is one, sets the grow target.
"""
from __future__ import annotations

import dataclasses
from typing import Optional


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
    count that was tried and did not pay; None before any revert).
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

    def record(self, measurement: Measurement) -> None:
        """Add the measurement at the current size (call once per measurement window)."""
        self.history_.append(measurement)

    def max_nodes(self) -> int:
        """Largest node count allowed by the directives, the global batch cap and the ceiling."""
        by_batch = self.max_global_batch // (self.per_gpu_batch * self.slots_per_node)
        by_gpus = self.max_workers // self.slots_per_node
        limit = min(by_batch, by_gpus)
        if self.ceiling_nodes_ is not None:
            limit = min(limit, self.ceiling_nodes_ - 1)
        return max(limit, 0)

    def min_nodes(self) -> int:
        return max(1, -(-self.min_workers // self.slots_per_node))

    def _last_step(self) -> tuple[Optional[Measurement], Optional[Measurement]]:
        """The latest measurement and the one before it at a different size (None when absent)."""
        if not self.history_:
            return None, None
        current = self.history_[-1]
        for earlier in reversed(self.history_[:-1]):
            if earlier.nodes != current.nodes:
                return current, earlier
        return current, None

    def decide(self, free_nodes: int, plan_nodes: Optional[int] = None) -> Decision:
        """Decide from the latest measurement.

        Args:
            free_nodes: idle nodes a grow could get now.
            plan_nodes: node count /v1/plan suggests (None: service unreachable or `keep`); the policy
                grows toward it but never past its own limits, and falls back to its heuristic without it.

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
                return Decision("revert", target, f"grow {before.nodes}->{current.nodes} nodes did not pay: "
                                f"efficiency {efficiency:.2f} < {self.min_efficiency:.2f}", efficiency)
        if current.nodes > self.max_nodes() and current.nodes > self.min_nodes():
            target = max(self.max_nodes(), self.min_nodes())
            return Decision("shrink", target, f"{current.nodes} nodes is above the limit {self.max_nodes()}",
                            efficiency)
        limit = min(self.max_nodes(), current.nodes + free_nodes)
        want = current.nodes + self.grow_step_nodes if plan_nodes is None else plan_nodes
        target = min(want, limit, current.nodes + self.grow_step_nodes)
        if target <= current.nodes:
            why = self._why_not(current, free_nodes, plan_nodes, efficiency)
            return Decision("keep", current.nodes, why, efficiency)
        source = "heuristic" if plan_nodes is None else f"plan says {plan_nodes} nodes"
        paid = "" if efficiency is None else f", last grow efficiency {efficiency:.2f}"
        return Decision("grow", target, f"{source}; global batch {target * self.slots_per_node * self.per_gpu_batch}"
                        f" <= {self.max_global_batch}{paid}", efficiency)

    def _why_not(self, current: Measurement, free_nodes: int, plan_nodes: Optional[int],
                 efficiency: Optional[float]) -> str:
        if plan_nodes is not None and plan_nodes <= current.nodes:
            return f"plan says {plan_nodes} nodes"
        if self.ceiling_nodes_ is not None and current.nodes + 1 >= self.ceiling_nodes_:
            return f"{self.ceiling_nodes_} nodes did not pay before"
        if current.nodes >= self.max_nodes():
            return f"at the limit of {self.max_nodes()} nodes (max_global_batch / gpus)"
        if free_nodes <= 0:
            return "no free nodes"
        return "grow step does not fit"
