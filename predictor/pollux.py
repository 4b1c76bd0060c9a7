"""Pollux step-time model (Qiao et al., OSDI '21; AdaptDL goodput.py), the reference for the accuracy benchmark.

Per job (profile, GPU type), with per-GPU batch b, G replicas on n nodes:

    T_compute = alpha_c + beta_c * b
    T_network = alpha_n + beta_n * max(G - 2, 0)    if n > 1   (bottleneck: inter-node)
              = alpha_r + beta_r * max(G - 2, 0)    if n == 1 and G > 1   (intra-node)
              = 1e-8                                if G == 1
    T_step    = (T_compute^gamma + T_network^gamma)^(1/gamma),  gamma in [1, 10]

It sees only (n, G), never the layout's shape, so it cannot tell `44` from `2222`. Fitted per job the way
AdaptDL's simulator fits it (Job.update_params -> goodput.fit_perf_params):
- the profile is keyed by (n, G, b): rows sharing a key are averaged (the simulator keeps one value per key);
- objective = RMSE(log T_compute vs log(step - sync)) + RMSE(log T_step vs log step)
              + 1e-3 (gamma - 1)^2 + 1e-2 ((beta_n / alpha_n)^2 + (beta_r / alpha_r)^2);
  the compute term only where rows report `sync_s` (Morphling A800 does not: step term alone);
- L-BFGS-B from (0.1, 0.01) x 3 and gamma 1.001, bounds [1e-8, inf) and gamma [1, 10];
- pinned at their lower bound: alpha_c := mean compute / 2 with a single batch size, (alpha_n, beta_n) without
  multi-node keys, (alpha_r, beta_r) without single-node multi-GPU keys, beta_n and beta_r without G > 2;
- after the fit, without multi-node keys: alpha_n >= 1.1 alpha_r, beta_n >= 1.1 beta_r.
Used only by bench/accuracy.py.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.optimize import minimize

REG_GAMMA, REG_RETRO = 1e-3, 1e-2


class PolluxParams(NamedTuple):
    alpha_c: float  # seconds per step independent of batch
    beta_c: float  # seconds per sample
    alpha_n: float  # inter-node network seconds at 2 replicas
    beta_n: float  # extra inter-node seconds per replica beyond 2
    alpha_r: float  # intra-node network seconds at 2 replicas
    beta_r: float  # extra intra-node seconds per replica beyond 2
    gamma: float  # overlap exponent


def _predict(p, b, n, G):
    """(T_step, T_compute) for arrays b, n, G; p a PolluxParams or a 7-vector."""
    p = PolluxParams(*p)
    tc = p.alpha_c + p.beta_c * b
    extra = np.maximum(G - 2, 1e-8)
    tn = np.select([n > 1, G > 1], [p.alpha_n + p.beta_n * extra, p.alpha_r + p.beta_r * extra], 1e-8)
    return (tc**p.gamma + tn**p.gamma) ** (1.0 / p.gamma), tc


def _profile(rows):
    """AdaptDL's job profile: one (step, compute) per (n, G, b) key, the mean of the rows sharing it."""
    acc: dict[tuple, list] = {}
    for r in rows:
        key = (len(r["layout"]), sum(r["layout"]), float(r["per_gpu_batch"]))
        sync = r.get("sync_s")
        acc.setdefault(key, []).append((float(r["iter_s"]), np.nan if sync is None else float(sync)))
    keys = np.array(list(acc), dtype=float)
    vals = np.array([np.mean(v, axis=0) for v in acc.values()])
    return keys[:, 0], keys[:, 1], keys[:, 2], vals[:, 0], vals[:, 0] - vals[:, 1]


def fit_pollux(rows: list[dict]) -> PolluxParams:
    """Perf params of one job from its step rows (see the module docstring)."""
    n, G, b, step, compute = _profile(rows)
    has_c = np.isfinite(compute) & (compute > 0)
    x0 = np.array([1e-1, 1e-2] * 3 + [1.0 + 1e-3])
    lo = np.array([1e-8] * 6 + [1.0])
    hi = np.array([np.inf] * 6 + [10.0])
    pinned = np.zeros(7, bool)
    if len(np.unique(b)) == 1:
        x0[0] = lo[0] = hi[0] = np.mean(compute[has_c] if has_c.any() else step) / 2
        pinned[0] = True
    if not (n > 1).any():
        pinned[[2, 3]] = True
    if not ((n == 1) & (G > 1)).any():
        pinned[[4, 5]] = True
    if not (G > 2).any():
        pinned[[3, 5]] = True
    x0[pinned & (np.arange(7) != 0)] = lo[pinned & (np.arange(7) != 0)]
    free = ~pinned
    ls, lc = np.log(step), np.log(np.where(has_c, compute, 1.0))

    def full(z):
        x = x0.copy()
        x[free] = z
        return x

    sel_n, sel_r = n > 1, (n == 1) & (G > 1)
    extra = np.maximum(G - 2, 1e-8)

    def objective(z):
        """Value and exact gradient (AdaptDL differentiates it with autograd)."""
        x = full(z)
        ac, bc, an, bn, ar, br, g = x
        ts, tc = _predict(x, b, n, G)
        tn = np.select([sel_n, sel_r], [an + bn * extra, ar + br * extra], 1e-8)
        s = tc**g + tn**g
        grad = np.zeros(7)
        r2 = np.log(ts) - ls
        e2 = np.sqrt(np.mean(r2**2))
        w2 = r2 / (len(r2) * max(e2, 1e-12))  # d e2 / d r2
        d_tc, d_tn = w2 * tc ** (g - 1) / s, w2 * tn ** (g - 1) / s
        grad[6] = np.sum(w2 * (-np.log(s) / g**2 + (tc**g * np.log(tc) + tn**g * np.log(tn)) / (g * s)))
        val = e2
        if has_c.any():
            r1 = np.log(tc[has_c]) - lc[has_c]
            e1 = np.sqrt(np.mean(r1**2))
            val += e1
            d_tc[has_c] += r1 / (len(r1) * max(e1, 1e-12)) / tc[has_c]
        grad[0], grad[1] = np.sum(d_tc), np.sum(d_tc * b)
        grad[2], grad[3] = np.sum(d_tn[sel_n]), np.sum(d_tn[sel_n] * extra[sel_n])
        grad[4], grad[5] = np.sum(d_tn[sel_r]), np.sum(d_tn[sel_r] * extra[sel_r])
        val += REG_GAMMA * (g - 1) ** 2 + REG_RETRO * ((bn / an) ** 2 + (br / ar) ** 2)
        grad[6] += 2 * REG_GAMMA * (g - 1)
        grad[2] -= 2 * REG_RETRO * bn**2 / an**3
        grad[3] += 2 * REG_RETRO * bn / an**2
        grad[4] -= 2 * REG_RETRO * br**2 / ar**3
        grad[5] += 2 * REG_RETRO * br / ar**2
        return val, grad[free]

    with np.errstate(all="ignore"):
        res = minimize(objective, x0[free], method="L-BFGS-B", jac=True,
                       bounds=list(zip(lo[free], hi[free])))
    x = full(res.x if np.all(np.isfinite(res.x)) else x0[free])
    if not (n > 1).any():  # AdaptDL's prior: inter-node is no faster than intra-node
        x[2], x[3] = max(x[2], 1.1 * x[4]), max(x[3], 1.1 * x[5])
    return PolluxParams(*map(float, x))


class PolluxModel:
    """Reference model: fit(rows) per (profile, gpu); predict(rows) -> step seconds."""

    def fit(self, rows: list[dict]) -> "PolluxModel":
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            groups.setdefault((r["profile"], r["gpu"]), []).append(r)
        self.params_ = {key: fit_pollux(rs) for key, rs in groups.items()}
        return self

    def predict(self, rows: list[dict]) -> np.ndarray:
        """Step seconds of each row; rows of an unfitted (profile, gpu) give NaN."""
        out = np.full(len(rows), np.nan)
        for i, r in enumerate(rows):
            p = self.params_.get((r["profile"], r["gpu"]))
            if p is not None:
                out[i] = _predict(p, float(r["per_gpu_batch"]), len(r["layout"]), sum(r["layout"]))[0]
        return out
