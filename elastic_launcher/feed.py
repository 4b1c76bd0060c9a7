"""The trainer's data side: the elastic sampler, the loader on it (:class:`~elastic_launcher.loading.Pipeline`)
and what that loader loads for (a :class:`~elastic_launcher.loading.Basis`: the current epoch's, or the next one's
once its switch is armed or while joining). The commit protocol moves the sampler and tells the feed what comes next.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.epoch_decisions import Phase
from elastic_launcher.loading import Basis, Pipeline
from elastic_launcher.membership import Plan
from elastic_launcher.sampler import ElasticSampler
from elastic_launcher.state import TrainingState

logger = logging.getLogger("elastic_launcher.trainer")
__all__ = ["DataFeed"]


class DataFeed:
    """The sampler and loader of one trainer: ``seed`` is the sampler's, ``policy`` gives a prepared loader's guess
    before the plan is known, the sampler is registered in ``state``, ``current`` is the epoch trained in."""

    def __init__(self, seed: int, policy: BatchPolicy, state: TrainingState, current) -> None:
        self.seed = seed
        self.policy = policy
        self.state = state
        self._current = current
        self.sampler: Optional[ElasticSampler] = None
        self.pipeline: Optional[Pipeline] = None  # the DataLoader of the last loader() call
        self.forecast: Optional[Basis] = None  # the next epoch's (armed, or being joined) rank and batches
        self._prepared = False  # prepare() was called: the pipeline's workers start in join()
        self.batch_indices: list[int] = []  # the indices of the batch handed out last
        self.batch_t = time.perf_counter()  # when it was handed out

    def ensure_sampler(self, dataset) -> None:
        if self.sampler is None:
            self.sampler = ElasticSampler(len(dataset), seed=self.seed)
            self.sampler.prefetch()
            self.state.sampler = self.sampler

    def prepare(self, dataset, collate_fn: Optional[Callable], options: dict,
                to_device: Optional[Callable] = None) -> None:
        """``ElasticTrainer.prepare_loader``: the pipeline :meth:`start_prepared` starts in ``join()``."""
        self.ensure_sampler(dataset)
        self.pipeline_for(dataset, collate_fn, options, to_device)
        self._prepared = True

    def start_prepared(self) -> Optional[Pipeline]:
        """``join()``, before the warm-up: starts a prepared pipeline's workers (processes, pin-memory thread) on a
        guess of this worker's batches, redirected once the plan is known. Returns it, or None if none was."""
        pipe = self.pipeline if self._prepared else None
        if pipe is not None:
            self.forecast = Basis(0, tuple(self.policy.split(1)))  # a guess: redirected once the plan is known
            pipe.start(0, self.sampler.epoch, self.sampler.pos)
        return pipe

    def pipeline_for(self, dataset, collate_fn: Optional[Callable], options: dict,
                     to_device: Optional[Callable] = None) -> Pipeline:
        old, prepared, self._prepared = self.pipeline, self._prepared, False
        if old is not None and old.dataset is dataset and old.arguments[2] is to_device and \
                (old.persistent or (prepared and old.arguments == (collate_fn, options, to_device))):
            return old
        if old is not None:
            old.close()
        self.pipeline = Pipeline(dataset, self.sampler, self.load_basis, collate_fn, options, to_device,
                                 self.state.device)
        return self.pipeline

    def load_basis(self, step: int) -> Basis:
        """What the batch taken at step count ``step`` is loaded for: the next epoch's rank and batches from the
        commit point its switch was armed for (ARM) or, joining, the epoch being joined; else the current epoch's.
        ``Pipeline.get`` is always asked with this function's answer, so a reset of the loader's projection hands
        out exactly the batch asked for next."""
        nxt, cur = self.forecast, self._current
        if nxt is not None and (cur.phase is Phase.JOINING or
                                (cur.switch_at is not None and step >= cur.switch_at)):
            return nxt
        return Basis(cur.group.rank(), tuple(cur.batches))

    def next_batch(self, pipe: Pipeline, step: int) -> tuple[Any, float]:
        """The batch of step count ``step`` for this rank in the current epoch, and how long it was waited for."""
        cur = self._current
        sl = self.sampler.slice_for(cur.group.rank(), cur.batches)
        self.batch_indices = sl.indices
        if cur.hook is not None:
            cur.hook.scale = sl.weight
        t_get = time.perf_counter()
        batch = pipe.get(step, self.sampler.epoch, self.sampler.pos, self.load_basis(step))
        self.batch_t = time.perf_counter()
        if cur.hook is not None:
            cur.hook.first_sync_t = None
        return batch, self.batch_t - t_get

    def lead(self, leaving: bool) -> int:
        """Steps this worker's loader needs between the announcement of a switch and the switch: what it has in
        flight (a batch asked for now arrives after those), 0 when it loads in this process or leaves."""
        if self.pipeline is None or leaving:
            return 0
        return self.pipeline.depth

    def expect(self, basis: Basis, step: int, at: int) -> None:
        """A switch is armed for step ``at``: from there on the loader loads for ``basis``."""
        self.forecast = basis
        if self.pipeline is not None:
            self.pipeline.rewind(step, self.sampler.epoch, self.sampler.pos, at)

    def drop_forecast(self) -> None:
        """The loader loads for the current epoch again (it was entered, or the armed switch did not come)."""
        self.forecast = None

    def position_at(self, step: int, at: int) -> tuple[int, int]:
        """The sampler's (epoch, pos) at step ``at``, walked ahead from ``step`` along the loader's projection."""
        epoch, pos = self.sampler.epoch, self.sampler.pos
        if self.pipeline is not None:
            epoch, pos = self.pipeline.ahead.walk(step, epoch, pos, at)
        return epoch, pos

    def load_ahead(self, pipe: Pipeline, plan: Plan, basis: Callable[[], Basis],
                   read_start: Callable[[int], dict]) -> dict:
        """Starts the loader before the state arrives, where the epoch is expected to start: the beginning for the
        first epoch, else what the current epoch's rank 0 published (``read_start``); the first batches are then
        loaded while the survivors train on. A wrong guess costs a reload, nothing else. Returns its times."""
        t0 = time.perf_counter()
        if plan.kind == "initial":
            start = {"step": int(self.state.counters["step"]), "epoch": self.sampler.epoch, "pos": self.sampler.pos}
        else:
            try:
                start = read_start(plan.id)
            except Exception as e:  # noqa: BLE001 - the state broadcast decides; this was only a head start
                logger.info("no loader start for epoch %d: %s", plan.id, e)
                return {"start_wait_s": time.perf_counter() - t0}
        t1 = time.perf_counter()
        self.forecast = basis()
        pipe.start(start["step"], start["epoch"], start["pos"])
        return {"start_wait_s": t1 - t0, "loader_start_s": time.perf_counter() - t1}

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
