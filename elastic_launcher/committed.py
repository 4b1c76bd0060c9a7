"""Per-step records of a training loop, released once a commit point covers their step.

Between two commit points a step is tentative: a failed vote or a recovery rolls the trainer back to the last
commit point and those batches are trained again. A loop that logs what each step saw (sample accounting, metrics
that must not count a batch twice) keeps its records here::

    steps = CommittedSteps()
    for batch in et.loader(ds):
        started = et.step
        ...
        alive = et.commit()
        steps.add(started, {"idx": idx})
        for rec in steps.ready(et.step, et.committed_step):
            log(rec)
    for rec in steps.rest():   # a clean end: the steps after the last commit point stand
        log(rec)
"""
from __future__ import annotations

from typing import Any

__all__ = ["CommittedSteps"]


class CommittedSteps:
    """Records keyed by the step count their batch started from (``et.step`` before the batch)."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, Any]] = []

    def add(self, started_at: int, record: Any) -> None:
        """Keeps ``record`` of the batch that started at step count ``started_at``."""
        self._pending.append((started_at, record))

    def ready(self, step: int, committed_step: int) -> list:
        """Drops the records of batches a rollback took back (started at or after ``step``) and returns, in order,
        those a commit point now covers (started before ``committed_step``)."""
        kept = [(s, r) for s, r in self._pending if s < step]
        self._pending = [(s, r) for s, r in kept if s >= committed_step]
        return [r for s, r in kept if s < committed_step]

    def rest(self) -> list:
        """The records still tentative (for a clean end of training); forgets them."""
        out, self._pending = [r for _, r in self._pending], []
        return out
