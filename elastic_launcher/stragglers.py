"""Straggler detection: a node whose workers are persistently slower than the rest.

The controller feeds one window at a time: the mean step (compute) time of each node's workers over the
last measurement window. A node is *slow in a window* when its mean exceeds `ratio` times the median of
the other nodes' means; it is a *straggler* once it has been slow in `windows` consecutive windows.
Any window in which it is not slow resets its count, so a one-off hiccup (GC, a noisy neighbour) never
shrinks a job. Callers must assume nothing about which nodes a window contains: nodes that join start
at zero and nodes that leave are forgotten.
"""
from __future__ import annotations

import statistics
from typing import Mapping


class StragglerDetector:
    """Counts consecutive slow windows per node.

    Args:
        ratio: a node is slow when its mean step time is above `ratio` x the median of the others (> 1).
        windows: consecutive slow windows before the node is reported (>= 1).
        protected: nodes never reported (e.g. the batch host, which a shrink cannot release).
    """

    def __init__(self, ratio: float = 1.5, windows: int = 3, protected: frozenset[str] = frozenset()):
        if ratio <= 1.0:
            raise ValueError(f"StragglerDetector.ratio must be > 1, got {ratio}")
        if windows < 1:
            raise ValueError(f"StragglerDetector.windows must be >= 1, got {windows}")
        self.ratio = ratio
        self.windows = windows
        self.protected = frozenset(protected)
        self.slow_counts_: dict[str, int] = {}

    def observe(self, step_s_by_node: Mapping[str, float]) -> list[str]:
        """Record one window and return the nodes that are now stragglers (sorted, maybe empty).

        Args:
            step_s_by_node: node name -> mean step time of its workers in this window (seconds, > 0).
                Fewer than two nodes: nothing can be compared and every count is reset.
        """
        self.slow_counts_ = {node: count for node, count in self.slow_counts_.items() if node in step_s_by_node}
        if len(step_s_by_node) < 2:
            self.slow_counts_.clear()
            return []
        stragglers = []
        for node, step_s in step_s_by_node.items():
            others = [value for other, value in step_s_by_node.items() if other != node]
            slow = step_s > self.ratio * statistics.median(others)
            self.slow_counts_[node] = self.slow_counts_.get(node, 0) + 1 if slow else 0
            if self.slow_counts_[node] >= self.windows and node not in self.protected:
                stragglers.append(node)
        return sorted(stragglers)

    def forget(self, node: str) -> None:
        """Drop a node's history (after it was shrunk away or replaced)."""
        self.slow_counts_.pop(node, None)
