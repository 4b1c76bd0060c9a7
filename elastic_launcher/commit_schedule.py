"""When the next commit point is: the same step on every rank, whatever each rank measured.

A commit point costs a blocking vote (one tiny allreduce read on the host: the host waits for the device to drain,
and then the device waits for the host to queue the next step), a broadcast of the floating-point buffers and an
in-memory snapshot. Taken every step, that cost was 20-42% of a steady step on H100/H200 (bench/results/
gpu_transition.md). Taken every ``k`` steps it is ``cost / k`` per step, and a failure rolls back at most ``k``
steps.

``k`` is decided in the vote itself, so no rank ever decides alone (a rank that votes while a peer does not waits
forever in a collective that never matches): every rank adds its *proposal* to the vote, the vote is a SUM, and
every rank reads the same sum and takes ``ceil(sum / n)``. A proposal is

* ``commit_every`` when the configuration fixes it;
* otherwise the number of steps that fills ``period_s`` of training, or more if the measured cost of a commit
  point would exceed ``overhead_budget`` of that time, never more than twice the current ``k`` (a ramp: the first
  commit point after a new epoch or a rollback is the next step, which verifies the new group and ends the pause)
  and never more than ``max_every``.

So a failure loses at most ``max_every`` steps, and in auto mode about ``max(period_s, cost / overhead_budget)``
seconds of training. The cost of a commit point is measured on the host as the wall time of a commit interval
minus ``k`` times the median period of the steps inside it that held no commit point (their device work is
queued, so their periods are the device step time once the host is ahead).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional

__all__ = ["CommitSchedule"]

_MIN_STEPS_FOR_COST = 3  # a commit interval with fewer plain steps says nothing reliable about the cost


class CommitSchedule:
    """The commit points of one rank: a deterministic function of the agreed vote results.

    Args:
        every: fixed number of steps between commit points, or None to choose it from measurements.
        period_s: auto mode: training time between commit points to aim at.
        overhead_budget: auto mode: a commit point may cost at most this fraction of the time between two.
        max_every: upper bound on the steps between commit points (bounds what a failure loses).
        hurry_budget: auto mode, while a next epoch is prepared (``proposal(hurry=True)``): the overhead allowed
            then (newcomers wait for the commit point that finds everyone ready, their GPUs idle).

    Attributes:
        next_at: global step count at which the next commit point is (the commit after that step's batch).
        interval: steps between the last commit point and ``next_at``.
        cost_s: measured cost of one commit point (exponential average), None until measured.
        history: ``(step, interval, cost_s)`` of the commit points whose cost was measured (the last 64).
    """

    def __init__(self, every: Optional[int] = None, period_s: float = 0.5, overhead_budget: float = 0.01,
                 max_every: int = 256, hurry_budget: float = 0.1) -> None:
        if every is not None and every < 1:
            raise ValueError(f"commit_every {every} < 1")
        if max_every < 1 or period_s <= 0 or not 0 < overhead_budget < 1:
            raise ValueError(f"commit schedule: max_every {max_every}, period_s {period_s}, "
                             f"overhead_budget {overhead_budget} out of range")
        self.every = every
        self.period_s = period_s
        self.overhead_budget = overhead_budget
        self.hurry_budget = max(hurry_budget, overhead_budget)
        self.max_every = max(max_every, every or 1)
        self.next_at = 1
        self.interval = 1
        self.cost_s: Optional[float] = None
        self.history: deque = deque(maxlen=64)
        self._periods: deque = deque(maxlen=64)  # plain steps of this epoch (seconds)
        self._in_interval: list[float] = []      # plain steps since the last commit point
        self._last_t: Optional[float] = None     # when the last step (of any kind) ended
        self._commit_t: Optional[float] = None   # when the last commit point ended
        self._measurable = False                 # the current interval started at a steady commit point

    def enter(self, step: int, t: float) -> None:
        """A new epoch or a rollback at ``step``: the next commit point is the next step; measurements restart."""
        self.next_at = step + 1
        self.interval = 1
        self._periods.clear()
        self._in_interval = []
        self._last_t = self._commit_t = t
        self._measurable = False

    def due(self, step: int) -> bool:
        """Whether the batch that brought the count to ``step`` ends at a commit point."""
        return step >= self.next_at

    def tick(self, t: float) -> None:
        """A step without a commit point ended at ``t``."""
        if self._last_t is not None:
            p = t - self._last_t
            self._periods.append(p)
            self._in_interval.append(p)
        self._last_t = t

    def step_s(self) -> Optional[float]:
        """Median period of this epoch's plain steps, None before two were seen."""
        return statistics.median(self._periods) if len(self._periods) >= 2 else None

    def proposal(self, hurry: bool = False) -> int:
        """This rank's proposal for the interval after the commit point being voted on. ``hurry``: a next epoch is
        being prepared (a newcomer is starting, its GPUs held idle until the commit point that finds everyone
        ready): commit points may then cost up to ``hurry_budget`` of the time between two."""
        if self.every is not None:
            return self.every
        ramp = min(2 * self.interval, self.max_every)
        step = self.step_s()
        if step is None or step <= 0:
            return ramp
        target = self.period_s
        if self.cost_s is not None:
            target = max(target, self.cost_s / (self.hurry_budget if hurry else self.overhead_budget))
        return max(1, min(math.ceil(target / step - 1e-6), ramp))  # 1e-6: 0.5 / 0.05 is 10, not 11

    def committed(self, step: int, proposals_sum: int, n: int, t: float, at_least: int = 1) -> None:
        """The vote at ``step`` succeeded and ended at ``t``; ``proposals_sum`` is the agreed SUM over ``n`` ranks;
        ``at_least``: at an armed switch (ARM), the loaders' agreed lead: in auto mode the switch is exactly that
        many steps ahead (the proposals are for steady training; a newcomer waiting for the switch holds its GPUs
        idle), never more than ``max_every``; a fixed interval stays fixed."""
        if self._measurable and self._commit_t is not None and len(self._in_interval) >= _MIN_STEPS_FOR_COST:
            k = len(self._in_interval) + 1
            cost = max(0.0, (t - self._commit_t) - k * statistics.median(self._in_interval))
            self.cost_s = cost if self.cost_s is None else 0.5 * self.cost_s + 0.5 * cost
            self.history.append((step, k, cost))
        if self.every is None and at_least > 1:  # an armed switch: as soon as the loaders have their lead
            self.interval = min(self.max_every, at_least)
        else:
            self.interval = min(self.max_every, max(1, -(-int(proposals_sum) // max(n, 1))))
        self.next_at = step + self.interval
        self._in_interval = []
        self._last_t = self._commit_t = t
        self._measurable = True
