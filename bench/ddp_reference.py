"""The no-fit reference of issue 38: a DDP step from the buckets and the link's sweep, with no fitted parameter.

It is the yardstick every release is scored against (bench/loco.py), so it is kept apart from the product's model
(predictor/stepmodel.py) and never tuned: DDP's buckets in gradient-ready order (the profile's `buckets_bytes`:
first 1 MiB, then 25 MiB), each bucket's all-reduce read off the link's collective sweep at the world size
(log-log interpolation between the swept sizes, linear beyond the largest), started when its share of the
backward (by bytes; the backward is the last 2/3 of the 1-GPU step) is done and the previous one has ended; the
step is max(1-GPU step, end of the last all-reduce). The 1-GPU step at a batch is read off the model's 1-GPU
ladder (log-log interpolation, linear beyond its ends).
"""
from __future__ import annotations

import numpy as np


def sweep_curves(collectives: list[dict]) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """(link, world) -> (bytes, median seconds) of the all-reduce rows."""
    pts: dict = {}
    for r in collectives:
        if r.get("op", "allreduce") == "allreduce":
            pts.setdefault((r["link"], int(r["world"])), {}).setdefault(float(r["bytes"]), []).append(r["seconds"])
    return {k: (np.array(sorted(v)), np.array([np.median(v[b]) for b in sorted(v)])) for k, v in pts.items()}


def read_log_log(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y at x: log-log interpolation inside the points, linear (the end segment's slope in y per x) beyond."""
    x = np.atleast_1d(np.asarray(x, dtype=float))
    y = np.exp(np.interp(np.log(x), np.log(xs), np.log(ys)))
    if len(xs) >= 2:
        hi = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        lo = (ys[1] - ys[0]) / (xs[1] - xs[0])
        y = np.where(x > xs[-1], ys[-1] + hi * (x - xs[-1]), y)
        y = np.where(x < xs[0], np.maximum(ys[0] + lo * (x - xs[0]), 1e-9), y)
    return y


def step(one_gpu_s: float, buckets_bytes, curve: tuple[np.ndarray, np.ndarray]) -> float:
    """The reference's multi-GPU step: the 1-GPU step and the bucket timeline on one link's sweep."""
    buckets = np.asarray(buckets_bytes, dtype=float)
    ready = one_gpu_s / 3.0 + 2.0 * one_gpu_s / 3.0 * np.cumsum(buckets) / buckets.sum()
    end = 0.0
    for r, d in zip(ready, read_log_log(*curve, buckets)):
        end = max(end, r) + d
    return max(one_gpu_s, end)


class Reference:
    """`fit(profiles, observations)` then `predict_step(profile, gpu, batch, layout, link)`, no parameter fitted:
    what it reads is the sweep and the 1-GPU ladder of the collection it is given."""

    def fit(self, profiles, observations) -> "Reference":
        self.profiles = profiles
        self.curves = sweep_curves([o for o in observations if o.get("kind") == "collective"])
        ladders: dict = {}
        for o in observations:
            if o.get("kind") == "step" and sum(o["layout"]) == 1:
                ladders.setdefault((o["profile"], o["gpu"]), {}).setdefault(float(o["per_gpu_batch"]), []).append(
                    o["iter_s"])
        self.ladders = {k: (np.array(sorted(v)), np.array([np.median(v[b]) for b in sorted(v)]))
                        for k, v in ladders.items()}
        return self

    def predict_step(self, profile: str, gpu: str, batch: float, layout: list[int], link: str) -> float:
        one = float(read_log_log(*self.ladders[(profile, gpu)], [batch])[0])
        world = sum(layout)
        return one if world == 1 else step(one, self.profiles[profile].buckets_bytes, self.curves[(link, world)])
