"""Batch-size and learning-rate policy across resizes.

Two modes (``mode``):
    ``keep_per_gpu``: every rank keeps ``per_gpu_batch``; the global batch is ``world * per_gpu_batch`` capped at
        ``max_global_batch`` (Or et al., "Resource elasticity in distributed deep learning": growing the global
        batch with the GPU count, up to a limit where statistical efficiency drops).
    ``keep_global``: the global batch stays ``global_batch``; per-rank batches shrink or grow.

Learning rate (``lr_scaling``), relative to the reference global batch ``ref_global`` (the batch the base LR was
tuned for): ``linear`` lr * G / G_ref, ``sqrt`` lr * sqrt(G / G_ref), ``none``.

Heterogeneous ranks (Hwang et al., "Elastic resource sharing for distributed deep learning"): per-rank batches
are proportional to each rank's measured samples/s, so that all backward passes (and hence the allreduce)
finish together. Integer rounding uses largest remainders; every rank gets at least one sample.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

# One split rule for the runtime and the planner's balanced prediction of mixed GPU types (predictor/mixed.py): the
# contracts layer below both owns it (docs/design.md "Import order").
from slurm_plugin.contracts.batch import split_batch

__all__ = ["BatchPolicy", "split_batch"]


@dataclass(frozen=True)
class BatchPolicy:
    """Decides the global batch, the per-rank split and the LR factor for a world.

    Attributes:
        per_gpu_batch: per-rank batch in ``keep_per_gpu`` mode (and the default reference).
        mode: ``keep_per_gpu`` or ``keep_global``.
        max_global_batch: cap in ``keep_per_gpu`` mode (None: no cap).
        global_batch: the fixed global batch in ``keep_global`` mode.
        lr_scaling: ``linear``, ``sqrt`` or ``none``.
        ref_global: global batch the base LR was tuned for (default: the first world's global batch).
    """

    per_gpu_batch: int = 32
    mode: str = "keep_per_gpu"
    max_global_batch: Optional[int] = None
    global_batch: Optional[int] = None
    lr_scaling: str = "linear"
    ref_global: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mode not in ("keep_per_gpu", "keep_global"):
            raise ValueError(f"mode {self.mode!r} is not keep_per_gpu or keep_global")
        if self.lr_scaling not in ("linear", "sqrt", "none"):
            raise ValueError(f"lr_scaling {self.lr_scaling!r} is not linear, sqrt or none")
        if self.mode == "keep_global" and not self.global_batch:
            raise ValueError("mode keep_global needs global_batch")
        if self.per_gpu_batch < 1:
            raise ValueError(f"per_gpu_batch {self.per_gpu_batch} < 1")

    def global_for(self, world: int) -> int:
        """Global batch for ``world`` ranks."""
        if self.mode == "keep_global":
            return max(int(self.global_batch), world)  # type: ignore[arg-type]
        g = world * self.per_gpu_batch
        if self.max_global_batch:
            g = max(min(g, self.max_global_batch), world)
        return g

    def split(self, world: int, speeds: Optional[Sequence[float]] = None) -> list[int]:
        """Per-rank batch sizes (sum = ``global_for(world)``); equal unless ``speeds`` differ."""
        return split_batch(self.global_for(world), list(speeds) if speeds else [1.0] * world)

    def lr_factor(self, global_batch: int, ref_global: int) -> float:
        """LR multiplier for ``global_batch`` relative to ``ref_global``."""
        r = global_batch / ref_global
        return {"linear": r, "sqrt": math.sqrt(r), "none": 1.0}[self.lr_scaling]
