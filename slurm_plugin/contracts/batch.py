"""The per-rank batch of a job whose ranks run at different speeds: one rule, rounding included, for the runtime
(elastic_launcher.batch_policy trains with it) and the service (predictor.mixed predicts with it)."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

__all__ = ["split_batch", "type_speeds"]


def split_batch(global_batch: int, speeds: Sequence[float]) -> list[int]:
    """Splits ``global_batch`` over ranks proportionally to ``speeds`` (samples/s), each rank >= 1.

    Raises:
        ValueError: no ranks, a non-positive speed, or fewer samples than ranks.
    """
    n = len(speeds)
    if n == 0:
        raise ValueError("split_batch needs at least one rank")
    if any(not s > 0 for s in speeds):
        raise ValueError(f"speeds must be positive, got {list(speeds)}")
    if global_batch < n:
        raise ValueError(f"global batch {global_batch} is smaller than the {n} ranks")
    total = float(sum(speeds))
    spare = global_batch - n  # one sample each first, the rest proportionally
    exact = [spare * s / total for s in speeds]
    out = [1 + int(math.floor(e)) for e in exact]
    left = global_batch - sum(out)
    # equal remainders (speeds a rounding error apart give the same quotient): the faster rank first
    order = sorted(range(n), key=lambda i: (-(exact[i] - math.floor(exact[i])), -speeds[i], i))
    for i in order[:left]:
        out[i] += 1
    return out


def type_speeds(compute_s: Mapping[str, float]) -> dict[str, float]:
    """Relative speed of each GPU type from its compute seconds at one per-GPU batch (the fastest type 1.0).

    Raises:
        ValueError: no types, or a compute time that is not a positive finite number (naming the type).
    """
    if not compute_s:
        raise ValueError("type_speeds needs the compute time of at least one GPU type")
    for gpu, seconds in compute_s.items():
        if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and math.isfinite(seconds)
                                             and seconds > 0):
            raise ValueError(f"compute time of GPU type {gpu!r} must be a positive number of seconds, got {seconds!r}")
    fastest = min(compute_s.values())
    return {gpu: fastest / seconds for gpu, seconds in compute_s.items()}
