"""Elastic data sampler: exact once-per-epoch coverage across resizes.

The sampler's state is global and tiny: ``(epoch, pos)``. Each epoch walks a seeded permutation of the dataset
indices. A step consumes the next ``G`` positions (the global batch) ``[pos, pos + G)``; rank ``r`` takes the
slice of length ``b_r`` after the slices of ranks ``0..r-1`` (``sum(b) == G``). Because the state is global,
any membership change at a step boundary just repartitions what is left: no sample is skipped or seen twice in
an epoch. The last step of an epoch takes the ``R < G`` remaining samples, split proportionally; a rank left
with none gets one *padding* sample of weight 0 (it must run forward/backward for the collective), which is
reported separately so accounting stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from elastic_launcher.batch_policy import split_batch

__all__ = ["ElasticSampler", "Slice"]


@dataclass(frozen=True)
class Slice:
    """What one rank processes in one step.

    Attributes:
        indices: dataset indices that count (may be empty on a padded rank).
        padding: indices fed only to keep the collective going (weight 0).
        step_total: samples the whole group processes this step (the gradient divisor).
    """

    indices: list[int]
    padding: list[int]
    step_total: int

    @property
    def weight(self) -> float:
        """Fraction of the step's samples this rank holds (the gradient scale for a local-mean loss)."""
        return len(self.indices) / self.step_total


class ElasticSampler:
    """Global-position sampler.

    Args:
        size: number of samples in the dataset.
        seed: base seed; epoch ``e`` uses the permutation seeded with ``seed + e``.
        shuffle: permute within each epoch.
    """

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError(f"dataset size {size} < 1")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.pos = 0
        self._perms: dict[int, torch.Tensor] = {}  # epoch -> permutation: the current one and the next

    def _order(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                perm = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                perm = torch.arange(self.size)
            for old in [e for e in self._perms if e < epoch - 1 or e > epoch + 1]:
                del self._perms[old]  # a loader looks one epoch ahead at most; a rollback one back
            self._perms[epoch] = perm
        return perm

    def prefetch(self) -> None:
        """Computes the current epoch's permutation now (off the critical path of a join)."""
        self._order(self.epoch)

    def plan_step(self, batches: Sequence[int], pos: Optional[int] = None) -> list[int]:
        """Per-rank counts of the step at ``pos`` (default: the current position) given the nominal per-rank
        ``batches`` (shrunk at epoch end)."""
        g = sum(batches)
        left = self.size - (self.pos if pos is None else pos)
        if left >= g:
            return list(batches)
        if left >= len(batches):
            return split_batch(left, [float(b) for b in batches])
        return [1] * left + [0] * (len(batches) - left)

    def slice_at(self, epoch: int, pos: int, rank: int, batches: Sequence[int]) -> Slice:
        """The slice of rank ``rank`` for the step at position ``(epoch, pos)`` (a pure function of its arguments
        and the seed: the loader computes future slices with it)."""
        counts = self.plan_step(batches, pos)
        order = self._order(epoch)
        start = pos + sum(counts[:rank])
        idx = order[start:start + counts[rank]].tolist()
        total = sum(counts)
        pad = [] if idx else [int(order[pos + total - 1])]
        return Slice(idx, pad, total)

    def after(self, epoch: int, pos: int, batches: Sequence[int]) -> tuple[int, int]:
        """The position after the step at ``(epoch, pos)`` planned with ``batches`` (wraps to the next epoch)."""
        pos += sum(self.plan_step(batches, pos))
        return (epoch + 1, 0) if pos >= self.size else (epoch, pos)

    def slice_for(self, rank: int, batches: Sequence[int]) -> Slice:
        """The slice of rank ``rank`` for the next step (does not advance)."""
        return self.slice_at(self.epoch, self.pos, rank, batches)

    def advance(self, batches: Sequence[int]) -> None:
        """Moves past the step planned with ``batches``; wraps to the next epoch at the end."""
        self.epoch, self.pos = self.after(self.epoch, self.pos, batches)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "size": self.size, "seed": self.seed}

    def load_state_dict(self, d: dict) -> None:
        if d["size"] != self.size:
            raise ValueError(f"sampler state for {d['size']} samples loaded into one of {self.size}")
        self.epoch, self.pos, self.seed = int(d["epoch"]), int(d["pos"]), int(d["seed"])
