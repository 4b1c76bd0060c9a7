"""Step time of data-parallel training, simulated from how DDP runs a step (in the manner of AdaptDL goodput.py:
the whole model in this file, vectorised over candidate layouts).

A candidate is (profile P, GPU type g, per-GPU batch b, layout k_1..k_n GPUs on n nodes, intra link I, inter
link E). With K = max_i k_i GPUs on the fullest node and G = sum_i k_i:

    one GPU       T1(b)   the (P, g) compute ladder: the measured 1-GPU steps, interpolated log-log in b
                          (`Ladder`); below its smallest batch its first slope (0..1), above its largest linear
                          (the GPU is saturated). Nothing measured: FLOPs / (datasheet peak x efficiency).
    phases        forward F = T1 / 3, backward B = 2 T1 / 3 (BACKWARD_SHARE: a backward is twice a forward's FLOPs)
    buckets       DDP's buckets in gradient-ready order (reverse registration; the first 1 MiB, then
                  bucket_cap_mb, one dtype a bucket: predictor/profiles.py), bytes s_1..s_m
    ready         r_j = F + B * (i_j + 1) / n_tensors             bucket j's gradients are all computed: i_j its
                  last tensor's place in gradient-ready order (the backward takes about as long a layer, not
                  a byte: `shares`)
    all-reduce    d_j = C_I(K, s_j) + C_E(n, K^nu_E s_j)          read off the link's own collective sweep
                  (`Collectives`: measured points interpolated log-log; another world size moved along the
                  ring's alpha-beta terms; across nodes the cheaper of ring and tree); hierarchical: inside the
                  node over K, then across the n nodes' NICs, which carry K^nu_E times a bucket (the K GPUs of
                  a node share its NIC: nu = 0 one copy, a hierarchical all-reduce; nu = 1 K streams of their
                  own). A link with no sweep: the ring (across nodes the cheaper of ring and tree) at the
                  latency alpha_L and bandwidth bw_L the steps over it show, and across nodes a share tree_L of
                  its all-reduces run as the tree (2 bytes over bw, where the ring moves 2(n-1)/n: NCCL's tuner
                  picks by its own cost model, which the steps show: on Pollux's T4 sockets a 2-node all-reduce
                  costs 1.3-2.3x a 3-node one, where the ring alone makes it 0.75x) (`link_seconds`)
    timeline      a_j = max(r_j, e_{j-1}); an all-reduce that overlaps the backward runs (1 + kappa_L) times
                  slower (NCCL's kernels and proxy threads contend with the compute); e_j its end
    device        T_dev = max(T1, e_m) + o_L                     o_L: the sync link's per-step cost
    host          T_host = H + c_step + c_bucket * m + c_tensor * n_tensors      (G > 1 only)
                  H = the ladder's floor (its smallest step: the host's Python and kernel launches, which
                  no batch makes shorter); c_*: DDP's host work per step, per bucket, per gradient tensor
    step          T = (T_dev^k + T_host^k)^(1/k), k = HOST_K: the slower of the two, smoothed (where both are
                  near, each one's jitter makes the other wait: at equal times the step is 2^(1/k) = 7% above
                  both);  throughput X = G * b / T
    mixed types   every rank's T1 at its own batch; the slowest rank gates (predictor/mixed.py balances batches)

Parameters are physical and few, each with the evidence it rests on (`basis`):
- per (P, g): the ladder (measured 1-GPU steps, one vote per user at each batch: the median of their medians);
- per link: the collective sweep (the cluster's own `collective` rows), kappa_L and o_L; where no sweep exists
  (public datasets, a site before its calibration job), alpha_L and bw_L as steps see them and, for a link
  across nodes, nu_L and tree_L;
- per host class (GPU type: the nodes of a partition share a host): c_step, c_bucket, c_tensor.
Defaults are the no-fit reference's: kappa = o = c = 0 (perfect overlap, no DDP host cost). A host's constants
are *fitted* from the multi-GPU steps that ran on that type where there are enough of them, else *calibrated* where
the calibration job (`elastic-predictor calibrate`: probe models with many small and few large tensors, with and
without DDP) posted `ddp_overhead` rows for its GPU type, else *default*. History first: on a fresh H200 host the
job's world-1 probes read DDP's cost a gradient tensor at 29 us, where every committed H200 collection's 2- and
4-GPU steps fit 77-89 us (the host work of a step with peers is not all there at world 1), and held out on each
collection the calibrated constants scored 6.4-15.6% against 4.7-14.1% fitted on the other collections
(bench/results/calibration_h200.md). kappa_L and o_L are *fitted* from the steps that synchronised
over link L (bounded, pulled to 0), else *default*; alpha_L and bw_L of a link with no sweep are fitted in log
ratio to the link class's prior (alpha 0.1-100x, bw 1/30-10x; pulled to the prior by a ridge worth
LINK_RIDGE_ROWS rows) from the steps that ran over it,
nu_L (0..1, pulled to 0) from its steps across nodes with K > 1, tree_L (0..1, pulled to 0: the ring) from its
steps across nodes; a link with a sweep keeps its sweep. `fit_params` is the only fit: bounded soft-L1 least squares of
log step time, each user's rows weighing one vote in all, that vote scaled by the owner's agreement with the others:
after a first fit, an owner whose rows sit a median |log residual| m from it weighs 1 / (1 + (m / OWNER_TAU)^2)
(OWN_PROFILE_TAU on the profiles no other owner measured)
(`owner_trust`: a Cauchy weight by owner, refitted until no owner's weight moves by TRUST_TOL, at most TRUST_ROUNDS
times: a first fit that one attacker's rows pulled halfway takes three), so one user's made-up rows cannot outvote
an honest history of one or two users (the ridges hold the first fit near the mechanism's defaults, which honest
steps are near and 5x slower rows are not: tests/unit/test_poisoning.py); the down-weighted owners are kept in the
document (`Params.trust`) and /admin's outlier report weighs by them.

Intervals: the 10th and 90th percentiles of log residuals by basis (`interval`). For multi-GPU answers, the
multi-GPU rows' residuals held out by owner: the owners (users, else jobs) split in OWNER_FOLDS folds, each fold's
rows predicted by the constants fitted without them (one owner: in-sample), so that what differs from one host,
day or user to the next (the host's drift between the 1-GPU launch and the multi-GPU one, the link's day) is in
the spread; pooled apart by what the prediction says gates the step (HOST_GATED: floor + DDP's host work is the
longer path; else the larger part of the device's: LINK_GATED the all-reduce exposed after the compute,
COMPUTE_GATED the compute), since a host-gated step carries the host's drift (the multi-GPU launches of
bench/data/coldstart and its session7 measured their own 1-GPU step at 0.61-1.56x the 1-GPU launch's where the
step is the host's, 1.00-1.05x where it is the GPU's); bench/loco.py measures the coverage on collections held
out. For 1-GPU answers, leave-one-batch-out on the ladders. A pool with too few residuals takes its basis's, then
the prior spread.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
from scipy.optimize import least_squares, nnls

from predictor.linkmodel import link_prior
from predictor.roofline import load_peaks

# The model's release: its equations and every constant here. Bump it with any change that can move a prediction;
# bench/loco.py prints it beside every figure.
MODEL_VERSION = "sm-2026.12.04-3"

BACKWARD_SHARE = 2.0 / 3.0     # of the 1-GPU step: backward FLOPs are twice the forward's
FLOPS_EFFICIENCY = 0.35        # of the datasheet's dense peak, for a profile never measured on a GPU type
DEFAULT_FLOPS = 20e12
GPU_FLOPS = {gpu.lower(): p.train_flops for gpu, p in load_peaks().items()}
HOST_K = 10.0                  # sharpness of the device/host max
LAUNCH_FLOOR_S = 5e-3          # the step of a profile never measured, below which no batch goes (host launches)

# Bounds of the fitted constants (SI units); each is pulled to its default (0) by a ridge worth RIDGE_ROWS rows.
BOUNDS = {"kappa": (0.0, 4.0), "o": (0.0, 0.02), "c_step": (0.0, 0.02), "c_bucket": (0.0, 2e-3),
          "c_tensor": (0.0, 5e-4),
          # a link with no sweep: log of its alpha and bw over the class prior's (bw up to 10x: a node may have
          # several NICs, a DGX A100 eight), the NIC's sharing exponent and the share of tree all-reduces
          "alpha": (math.log(0.1), math.log(100.0)), "bw": (math.log(1 / 30), math.log(10.0)), "nu": (0.0, 1.0),
          "tree": (0.0, 1.0)}
SCALE = {"kappa": 1.0, "o": 1e-3, "c_step": 1e-3, "c_bucket": 1e-4, "c_tensor": 1e-5, "alpha": 1.0, "bw": 1.0,
         "nu": 1.0, "tree": 1.0}  # the optimiser's units
RIDGE_ROWS = 2.0
# alpha, bw and nu of a link with no sweep are pulled to the class prior by a ridge worth LINK_RIDGE_ROWS rows: a step
# whose all-reduce hides under its backward says little about the link, and one owner's made-up rows across nodes
# must not take the link's bandwidth to its bound (tests/unit/test_poisoning.py: 31% moved at 2 rows, 4.5% at 50)
LINK_RIDGE_ROWS = 50.0
STRONG_RIDGE = ("alpha", "bw", "nu")
F_SCALE = 0.05                 # soft-L1 scale of log residuals
OWNER_TAU = 0.15               # log residual at which an owner's vote weighs half, on shared profiles (`owner_trust`)
OWN_PROFILE_TAU = 0.5          # the same on profiles no other owner measured (a workload the mechanism fits worse)
TRUST_ROUNDS = 5               # refits with the owners' trust, at most: until no owner's moves by TRUST_TOL
TRUST_TOL = 0.02
TRUST_KEPT = 0.9               # owners trusted less than this are named in the document (`Params.trust`)
MIN_ROWS_PER_PARAM = 2         # multi-GPU rows a fitted constant needs behind it (the ridge holds the rest)

# Interval spreads (log space) where a basis has fewer than MIN_RESIDUALS held-out residuals.
PRIOR_SPREAD = {"measured": 0.05, "calibrated": 0.10, "observed": 0.15, "inferred": 0.20, "cross-type": 0.30,
                "profile": 0.50, "prior": 1.00}
MIN_RESIDUALS = 8
INTERVAL = (0.10, 0.90)        # an 80% interval
OWNER_FOLDS = 5                # the intervals' residuals: owners held out in this many folds (a refit each)
FOLD_TOL = 1e-3                # relative tolerance of a fold's refit (the full fit: least_squares' default 1e-8)
# what gates a multi-GPU step's prediction: the host's path, else the larger part of the device's (compute or the
# all-reduce exposed after it)
HOST_GATED, LINK_GATED, COMPUTE_GATED = "host-gated", "link-gated", "compute-gated"


# --------------------------------------------------------------------------------------------------- one GPU
@dataclass(frozen=True)
class Ladder:
    """The 1-GPU step of one (profile, GPU type) at each per-GPU batch (sorted, one value a batch): `measured` on
    one GPU, or `inferred` from the pair's multi-GPU steps where it never ran on one (`infer_ladders`); `users`:
    the owners whose votes it holds (/admin shows them)."""

    batches: tuple[float, ...]
    seconds: tuple[float, ...]
    basis: str = "measured"
    users: int = 0

    @classmethod
    def from_points(cls, points: dict[float, float], users: int = 0) -> "Ladder":
        bs = sorted(points)
        return cls(tuple(float(b) for b in bs), tuple(float(points[b]) for b in bs), users=users)

    @property
    def floor(self) -> float:
        """H: the smallest 1-GPU step: the host's work a step, which no batch makes shorter."""
        return min(self.seconds)

    def at(self, b) -> np.ndarray:
        """T1 at batch(es) b: log-log interpolation; below the smallest batch its first slope (clipped to
        0..1: a smaller batch is never slower, nor cheaper than linear); above the largest linear in b."""
        x = np.log(np.atleast_1d(np.asarray(b, dtype=float)))
        lb, lt = np.log(self.batches), np.log(self.seconds)
        y = np.interp(x, lb, lt)
        if len(lb) >= 2:
            s0 = float(np.clip((lt[1] - lt[0]) / (lb[1] - lb[0]), 0.0, 1.0))
        else:
            s0 = 0.0
        y = np.where(x < lb[0], lt[0] + s0 * (x - lb[0]), y)
        y = np.where(x > lb[-1], lt[-1] + (x - lb[-1]), y)
        return np.exp(y)

    def scaled(self, ratio: float) -> "Ladder":
        return Ladder(self.batches, tuple(t * ratio for t in self.seconds), self.basis, self.users)

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "seconds": list(self.seconds), "basis": self.basis,
                "users": self.users}

    @classmethod
    def from_dict(cls, d: dict) -> "Ladder":
        return cls(tuple(map(float, d["batches"])), tuple(map(float, d["seconds"])), d.get("basis", "measured"),
                   int(d.get("users", 0)))


def flops_ladder(profile, gpu: str, calibration: float | None = None) -> Ladder:
    """The ladder of a profile never measured on `gpu`: its FLOPs (or measured seconds) per sample over the
    datasheet peak at FLOPS_EFFICIENCY, times `calibration` (the measured over this estimate, geometric mean over
    the profiles measured on that GPU), above a launch floor: flat below the batch that reaches it, linear above."""
    rate = GPU_FLOPS.get(gpu.lower(), DEFAULT_FLOPS) * FLOPS_EFFICIENCY
    if profile.compute_s_per_sample is not None:
        per = profile.compute_s_per_sample * (GPU_FLOPS.get((profile.reference_gpu or gpu).lower(), DEFAULT_FLOPS)
                                              / GPU_FLOPS.get(gpu.lower(), DEFAULT_FLOPS))
    elif profile.flops_per_sample is not None:
        per = profile.flops_per_sample / rate
    else:
        per = 6.0 * profile.n_params * 128 / rate   # transformer-style guess: 6 FLOPs a parameter a token, 128 tokens
    if calibration is not None and profile.compute_s_per_sample is None:
        per *= calibration
    b1 = max(1.0, LAUNCH_FLOOR_S / per)          # where the compute reaches the launch floor: flat below it
    return Ladder((b1 / 2.0, b1, 2.0 * b1), (LAUNCH_FLOOR_S, LAUNCH_FLOOR_S, 2.0 * LAUNCH_FLOOR_S))


# --------------------------------------------------------------------------------------------------- links
def ring(alpha, bw, world, nbytes) -> np.ndarray:
    """Ring all-reduce seconds of `nbytes` over `world` ranks on a link of per-step latency `alpha` and bandwidth
    `bw` (arrays broadcast): 2(p-1) alpha + 2(p-1)/p bytes / bw; 0 for one rank."""
    w = np.maximum(np.asarray(world, dtype=float), 1.0)
    return 2 * (w - 1) * alpha + 2 * (w - 1) / w * np.asarray(nbytes, dtype=float) / bw


def tree(alpha, bw, world, nbytes) -> np.ndarray:
    """Tree all-reduce seconds (reduce up, broadcast down, pipelined): 2 ceil(log2 p) alpha + 2 bytes / bw."""
    w = np.maximum(np.asarray(world, dtype=float), 1.0)
    return 2 * np.ceil(np.log2(w)) * alpha + 2 * np.asarray(nbytes, dtype=float) / bw


class Collectives:
    """All-reduce seconds per link, world size and bytes, read off the cluster's own sweeps.

    `curves[(link, world)]` holds the measured points (bytes, median seconds). A size between two points is
    interpolated log-log; below the smallest, the smallest's time (latency-bound); above the largest, the last
    segment's seconds per byte. A world size not measured on a link moves the nearest measured world's curve by
    the ring's terms (latency 2(p-1) alpha, volume 2(p-1)/p bytes / bandwidth) with that link's alpha and
    bandwidth (fitted on its points, else the link class's prior); a link never measured is its prior. `users`:
    per link, the owners whose votes its curves hold (/admin shows them)."""

    def __init__(self, curves: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] | None = None,
                 users: dict[str, int] | None = None):
        self.curves = {k: (np.asarray(b, float), np.asarray(t, float)) for k, (b, t) in (curves or {}).items()}
        self.users = dict(users or {})
        self._ab = {}
        for link in {k[0] for k in self.curves}:
            self._ab[link] = self._alpha_beta(link)

    @classmethod
    def from_rows(cls, rows: Iterable[dict]) -> "Collectives":
        """From `collective` all-reduce rows; one vote per owner (user, else job) at each point: the median of
        each owner's median, so that no one user's rows move a link's curve."""
        votes: dict[tuple, dict] = {}
        for r in rows:
            if r.get("op", "allreduce") != "allreduce" or int(r["world"]) < 2:
                continue
            key = (str(r["link"]), int(r["world"]), float(r["bytes"]))
            votes.setdefault(key, {}).setdefault(owner_of(r), []).append(float(r["seconds"]))
        pts: dict[tuple, dict] = {}
        users: dict[str, set] = {}
        for (link, world, nbytes), by in votes.items():
            pts.setdefault((link, world), {})[nbytes] = float(np.median([np.median(v) for v in by.values()]))
            users.setdefault(link, set()).update(by)
        return cls({k: (np.array(sorted(v)), np.array([v[b] for b in sorted(v)])) for k, v in pts.items()},
                   {link: len(who) for link, who in users.items()})

    def _alpha_beta(self, link: str) -> tuple[float, float]:
        """(alpha seconds a ring step, bandwidth bytes/s) of `link`: least squares over its measured points of
        t = 2(p-1) alpha + 2(p-1)/p bytes / bw, in relative terms; the link class's prior if that fails."""
        a0, bw0, _ = link_prior(link)
        rows = [(w, b, t) for (l, w), (bs, ts) in self.curves.items() if l == link for b, t in zip(bs, ts)]
        if len(rows) < 2:
            return a0, bw0
        w, b, t = (np.array(v, float) for v in zip(*rows))
        A = np.stack([2 * (w - 1), 2 * (w - 1) / w * b], axis=1) / t[:, None]
        coef, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
        if not (coef[0] > 0 and coef[1] > 0):
            return a0, bw0
        return float(coef[0]), float(1.0 / coef[1])

    def links(self) -> list[str]:
        return sorted({k[0] for k in self.curves})

    def measured(self, link: str) -> bool:
        return any(k[0] == link for k in self.curves)

    def time(self, link: str, world: int, nbytes) -> np.ndarray:
        """Ring all-reduce seconds of each size in `nbytes` over `world` ranks on `link` (0 for one rank)."""
        nb = np.atleast_1d(np.asarray(nbytes, dtype=float))
        if world <= 1:
            return np.zeros_like(nb)
        worlds = [w for (l, w) in self.curves if l == link]
        a, bw = self._ab.get(link) or link_prior(link)[:2]
        if not worlds:
            return ring(a, bw, world, nb)
        near = min(worlds, key=lambda w: (abs(math.log(w / world)), w))
        bs, ts = self.curves[(link, near)]
        t = np.exp(np.interp(np.log(np.maximum(nb, 1.0)), np.log(bs), np.log(ts)))
        if len(bs) >= 2:
            per_byte = max((ts[-1] - ts[-2]) / (bs[-1] - bs[-2]), 0.0)
            t = np.where(nb > bs[-1], ts[-1] + per_byte * (nb - bs[-1]), t)
        if near != world:
            t = np.maximum(t + 2 * (world - near) * a + (2 * (world - 1) / world - 2 * (near - 1) / near) * nb / bw,
                           1e-6)
        return t

    def across(self, link: str, nodes: int, nbytes) -> np.ndarray:
        """All-reduce across `nodes` NICs: the cheaper of the ring (the link's curve) and a tree (2 log2 n
        latencies, twice the bytes over the bandwidth): NCCL's tuner picks the faster of the two."""
        on_ring = self.time(link, nodes, nbytes)
        if nodes <= 2:
            return on_ring
        a, bw = self._ab.get(link) or link_prior(link)[:2]
        return np.minimum(on_ring, tree(a, bw, nodes, np.atleast_1d(np.asarray(nbytes, dtype=float))))

    def to_dict(self) -> dict:
        return {f"{l}@{w}": [[float(b), float(t)] for b, t in zip(bs, ts)] for (l, w), (bs, ts) in
                sorted(self.curves.items())}

    @classmethod
    def from_dict(cls, d: dict, users: dict | None = None) -> "Collectives":
        out = {}
        for key, pts in d.items():
            link, world = key.rsplit("@", 1)
            out[(link, int(world))] = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
        return cls(out, {str(k): int(v) for k, v in (users or {}).items()})


# --------------------------------------------------------------------------------------------------- constants
@dataclass(frozen=True)
class HostCost:
    """DDP's host seconds a synchronised step: per step, per bucket, per gradient tensor; with their basis."""

    c_step: float = 0.0
    c_bucket: float = 0.0
    c_tensor: float = 0.0
    basis: str = "default"

    def seconds(self, buckets: int, tensors: int) -> float:
        return self.c_step + self.c_bucket * buckets + self.c_tensor * tensors


@dataclass(frozen=True)
class LinkCost:
    """How a link's all-reduce overlaps a backward (kappa: 1 + kappa times slower while it does) and what a step
    synchronised over it costs beyond (o seconds); for a link with no sweep, its ring latency alpha and bandwidth
    bw as the steps see them (None: the link class's prior), how the K GPUs of a node share its NIC across
    nodes (nu: the NIC carries K^nu times a bucket's bytes; 0 a hierarchical all-reduce, one copy, 1 K streams
    of their own) and the share of its all-reduces across nodes that run as a tree (tree: 0 the ring or the
    cheaper of the two, 1 the tree); with their basis."""

    kappa: float = 0.0
    o: float = 0.0
    basis: str = "default"
    alpha: float | None = None
    bw: float | None = None
    nu: float = 0.0
    tree: float = 0.0


@dataclass
class Params:
    """Everything a prediction reads, as a versioned JSON document (`to_dict` / `from_dict`)."""

    ladders: dict[tuple[str, str], Ladder] = field(default_factory=dict)
    collectives: Collectives = field(default_factory=Collectives)
    hosts: dict[str, HostCost] = field(default_factory=dict)
    links: dict[str, LinkCost] = field(default_factory=dict)
    residuals: dict[str, list[float]] = field(default_factory=dict)   # basis -> held-out log residuals
    converged: bool = True          # False: the constants' fit failed numerically and the defaults stand
    pair_rmse: dict[tuple[str, str], float] = field(default_factory=dict)   # (P, g) -> RMS log error, multi-GPU rows
    trust: dict[str, float] = field(default_factory=dict)   # owner ("uid:N", "job:N") -> its vote's weight, < TRUST_KEPT
    version: str = MODEL_VERSION
    _quantiles: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # interval: residuals fixed

    def host(self, gpu: str) -> HostCost:
        return self.hosts.get(gpu, HostCost())

    def link(self, name: str | None) -> LinkCost:
        return self.links.get(name or "", LinkCost())

    def interval(self, basis: str, gate: str | None = None) -> tuple[float, float]:
        """(low, high) factors of an 80% interval around a prediction of this basis, for a multi-GPU step by what
        gates its prediction (`gate`: HOST_GATED, LINK_GATED, COMPUTE_GATED) where that pool has MIN_RESIDUALS
        residuals, else the basis's pool; `PRIOR_SPREAD` where fewer back it."""
        key = (basis, gate)
        if key not in self._quantiles:
            self._quantiles[key] = self._interval(basis, gate)
        return self._quantiles[key]

    def _interval(self, basis: str, gate: str | None) -> tuple[float, float]:
        res = self.residuals.get(f"{basis} {gate}", []) if gate else []
        if len(res) < MIN_RESIDUALS:
            res = self.residuals.get(basis, [])
        if len(res) >= MIN_RESIDUALS:
            lo, hi = np.quantile(np.asarray(res), INTERVAL)
            return float(math.exp(min(lo, 0.0))), float(math.exp(max(hi, 0.0)))
        s = PRIOR_SPREAD.get(basis, PRIOR_SPREAD["prior"]) * 1.2816  # the normal's 10th/90th percentile
        return math.exp(-s), math.exp(s)

    def summary(self) -> dict:
        """What /admin shows of the document (`to_dict` less the ladders and curves: their counts instead)."""
        return {"version": self.version, "converged": self.converged, "n_ladders": len(self.ladders),
                "n_curves": len(self.collectives.curves), "hosts": {g: vars(h) for g, h in sorted(self.hosts.items())},
                "links": {k: vars(v) for k, v in sorted(self.links.items())}, "residuals": self.residuals,
                "trust": self.trust}

    def to_dict(self) -> dict:
        return {"version": self.version,
                "ladders": {f"{p}|{g}": l.to_dict() for (p, g), l in sorted(self.ladders.items())},
                "collectives": self.collectives.to_dict(),
                "collective_users": dict(sorted(self.collectives.users.items())),
                "hosts": {g: vars(h) for g, h in sorted(self.hosts.items())},
                "links": {k: vars(v) for k, v in sorted(self.links.items())},
                "residuals": {k: [float(x) for x in v] for k, v in sorted(self.residuals.items())},
                "converged": self.converged,
                "pair_rmse": [[p, g, v] for (p, g), v in sorted(self.pair_rmse.items())],
                "trust": dict(sorted(self.trust.items()))}

    @classmethod
    def from_dict(cls, d: dict) -> "Params":
        return cls(ladders={tuple(k.split("|", 1)): Ladder.from_dict(v) for k, v in d.get("ladders", {}).items()},
                   collectives=Collectives.from_dict(d.get("collectives", {}), d.get("collective_users", {})),
                   hosts={g: HostCost(**h) for g, h in d.get("hosts", {}).items()},
                   links={k: LinkCost(**v) for k, v in d.get("links", {}).items()},
                   residuals={k: list(v) for k, v in d.get("residuals", {}).items()},
                   converged=bool(d.get("converged", True)),
                   pair_rmse={(p, g): float(v) for p, g, v in d.get("pair_rmse", [])},
                   trust={str(k): float(v) for k, v in d.get("trust", {}).items()},
                   version=d.get("version", MODEL_VERSION))


# --------------------------------------------------------------------------------------------------- the step
def sync_link(layout, intra: str, inter: str | None) -> str:
    """The link a step synchronises over last: the inter-node link across nodes, else the intra-node link."""
    return (inter or intra) if len(layout) > 1 else intra


def link_seconds(coll: Collectives, lc: LinkCost, link: str, world, nbytes, across: bool = False) -> np.ndarray:
    """All-reduce seconds of `nbytes` over `world` ranks (arrays broadcast) on `link`: a link with a sweep reads
    it (`Collectives`); one without, the ring (across nodes the cheaper of ring and tree, a share `lc.tree` the
    tree) at the alpha and bw the steps showed (`LinkCost`, fitted), else at its class's prior."""
    if coll.measured(link):
        return coll.across(link, int(world), nbytes) if across else coll.time(link, int(world), nbytes)
    a0, bw0 = link_prior(link)[:2]
    a, bw = lc.alpha or a0, lc.bw or bw0
    w = np.asarray(world, dtype=float)
    t = ring(a, bw, w, nbytes)
    if across:
        on_tree = tree(a, bw, w, nbytes)
        t = (1.0 - lc.tree) * np.where(w > 2, np.minimum(t, on_tree), t) + lc.tree * on_tree
    return np.where(w > 1, t, 0.0)


def bucket_comm(params: "Params", buckets: np.ndarray, layouts, intra: str, inter: str | None) -> np.ndarray:
    """d[c, j]: all-reduce seconds of bucket j on candidate layout c, hierarchical: inside the fullest node over
    its K GPUs, then across the n nodes, whose NICs carry K^nu times the bucket (nu: the inter link's)."""
    out = np.zeros((len(layouts), len(buckets)))
    for c, lay in enumerate(layouts):
        k, n = max(lay), len(lay)
        if k > 1:
            out[c] += link_seconds(params.collectives, params.link(intra), intra, k, buckets)
        if n > 1:
            lc = params.link(inter or intra)
            out[c] += link_seconds(params.collectives, lc, inter or intra, n, buckets * k ** lc.nu, across=True)
    return out


def simulate(t1: np.ndarray, floor: np.ndarray, share: np.ndarray, comm: np.ndarray, kappa: np.ndarray,
             o: np.ndarray, host_s: np.ndarray, multi: np.ndarray) -> dict:
    """The step of each candidate c: the device's timeline and the host's path, smoothly maxed (module docstring).
    Arrays over c, and share[c, j] (the gradient bytes ready once bucket j is: cumulative, 1 at the last bucket)
    and comm[c, j] (bucket j's all-reduce seconds) over buckets in ready order; a padded bucket (NaN share) is
    skipped. Pure and vectorised."""
    fwd = t1 * (1.0 - BACKWARD_SHARE)
    end = np.zeros_like(t1)
    slow = 1.0 + kappa
    for j in range(share.shape[1]):
        valid = np.isfinite(share[:, j])
        ready = fwd + (t1 - fwd) * np.nan_to_num(share[:, j])
        start = np.maximum(ready, end)
        d = comm[:, j]
        # inside the backward the all-reduce runs `slow` times slower; the rest of it after t1 at full speed
        inside = np.clip((t1 - start) / slow, 0.0, d)
        done = np.where(start < t1, start + inside * slow + (d - inside), start + d)
        end = np.where(valid, done, end)
    device = np.where(multi, np.maximum(t1, end) + o, t1)
    host = np.where(multi, floor + host_s, 0.0)
    iter_s = np.where(multi, (device ** HOST_K + host ** HOST_K) ** (1.0 / HOST_K), device)
    return {"iter_s": iter_s, "compute_s": t1, "comm_s": np.where(multi, np.maximum(end - fwd, 0.0), 0.0),
            "exposed_s": iter_s - t1,
            "gate": np.where(~multi, "", np.where(host >= device, HOST_GATED,
                                                  np.where(device - t1 > t1, LINK_GATED, COMPUTE_GATED)))}


def shares(profile) -> np.ndarray:
    """The share of the backward done when each bucket (in ready order) is ready: its last gradient tensor's
    place among the profile's tensors (in gradient-ready order), (index + 1) / n. The backward spends about as
    long on each layer, not on each byte: a transformer's embedding holds a fifth (BERT) to two thirds (XLM-R) of
    its bytes and is ready last, a CNN's last stage most of its bytes and is ready first. A tensor's bucket: the
    running sum of the tensors' bytes against the buckets' (DDP's order; exact for one dtype). No tensors: the byte
    shares."""
    buckets = np.asarray(profile.buckets_bytes, dtype=float)
    sizes = np.array([t.nbytes for t in profile.tensors], dtype=float)
    if not len(sizes):
        return np.cumsum(buckets) / max(float(np.sum(buckets)), 1.0)
    last = np.searchsorted(np.cumsum(sizes), np.cumsum(buckets) * (np.sum(sizes) / np.sum(buckets)) - 0.5)
    out = (np.minimum(last, len(sizes) - 1) + 1) / len(sizes)
    out[-1] = 1.0
    return out


def predict_layouts(params: Params, ladder: Ladder, profile, gpu: str, b: float, layouts, intra: str,
                    inter: str | None) -> dict:
    """compute_s, comm_s, iter_s and samples_per_s of one (profile, GPU, batch) on each layout (pure)."""
    buckets, tensors = np.asarray(profile.buckets_bytes, dtype=float), len(profile.tensors)
    n = len(layouts)
    G = np.array([sum(l) for l in layouts], dtype=float)
    multi = G > 1
    t1 = np.full(n, float(ladder.at(b)[0]))
    floor = np.full(n, min(ladder.floor, float(t1[0])))
    comm = bucket_comm(params, buckets, layouts, intra, inter)
    lc = [params.link(sync_link(l, intra, inter)) for l in layouts]
    host = params.host(gpu).seconds(len(buckets), tensors)
    r = simulate(t1, floor, np.tile(shares(profile), (n, 1)), comm, np.array([c.kappa for c in lc]),
                 np.array([c.o for c in lc]), np.full(n, host), multi)
    r["samples_per_s"] = G * b / r["iter_s"]
    return r


# --------------------------------------------------------------------------------------------------- fitting
def owner_of(row: dict):
    """Whose vote a row is: the user who signed it (`uid`), else its job, else nobody in particular."""
    if row.get("uid") is not None:
        return ("uid", row["uid"])
    return ("job", row["job_id"]) if row.get("job_id") is not None else None


def ladders_from(rows: Iterable[dict]) -> dict[tuple[str, str], Ladder]:
    """Per (profile, GPU): the 1-GPU steps, one vote per owner at each batch (median of the owners' medians)."""
    votes: dict[tuple, dict] = {}
    for r in rows:
        if sum(r["layout"]) != 1:
            continue
        key = (r["profile"], r["gpu"], float(r["per_gpu_batch"]))
        votes.setdefault(key, {}).setdefault(owner_of(r), []).append(float(r["iter_s"]))
    pts: dict[tuple, dict] = {}
    users: dict[tuple, set] = {}
    for (p, g, b), by in votes.items():
        pts.setdefault((p, g), {})[b] = float(np.median([np.median(v) for v in by.values()]))
        users.setdefault((p, g), set()).update(by)
    return {k: Ladder.from_points(v, len(users[k])) for k, v in pts.items()}


def owner_name(owner) -> str:
    """An owner as the document names it: "uid:1000", "job:42"."""
    return f"{owner[0]}:{owner[1]}"


def owner_trust(rows: list[dict], log_residuals: np.ndarray) -> dict:
    """Per owner of `rows`: 1 / (1 + (m / tau)^2), m the median |log residual| of its rows against the fit; on the
    (profile, GPU) pairs other owners measured too, tau = OWNER_TAU: there the fit is several users' consensus; on
    pairs only it measured, tau = OWN_PROFILE_TAU: there a far row may as well be the mechanism's misfit of an
    unusual workload (on ElasticFlow's A100 traces, one owner a model, OWNER_TAU everywhere took leave-one-model-out
    from 21.7% to 27.6%), and 5x made-up rows still weigh a tenth. An owner with both: the smaller weight."""
    owners_of: dict = {}
    for r in rows:
        owners_of.setdefault((r["profile"], r["gpu"]), set()).add(owner_of(r))
    by: dict = {}
    for r, e in zip(rows, log_residuals):
        if owner_of(r) is not None:
            shared = len(owners_of[(r["profile"], r["gpu"])]) > 1
            by.setdefault(owner_of(r), {}).setdefault(shared, []).append(abs(float(e)))
    return {o: min(1.0 / (1.0 + (float(np.median(v)) / (OWNER_TAU if shared else OWN_PROFILE_TAU)) ** 2)
                   for shared, v in parts.items()) for o, parts in by.items()}


def _weights(rows: list[dict]) -> np.ndarray:
    """One vote per owner: each owner's rows share weight 1 (rows of no owner weigh 1 each)."""
    owners = [owner_of(r) for r in rows]
    count: dict = {}
    for o in owners:
        count[o] = count.get(o, 0) + 1
    return np.array([1.0 if o is None else 1.0 / count[o] for o in owners])


def fit_params(profiles: dict, collectives: Collectives, ladders: dict[tuple[str, str], Ladder],
               multi_rows: list[dict], calibrated: dict[str, HostCost] | None = None) -> Params:
    """Host and link constants from the multi-GPU step rows whose (profile, GPU) has a ladder: bounded soft-L1
    least squares of log step time, one vote per owner, each constant pulled to 0; a host class with a calibration
    keeps it only while its multi-GPU steps are too few to fit. The parameter count is fixed by the links and GPU
    types (never by profiles or rows), and one pass of the model over all rows is one vectorised `simulate`. A numerical failure keeps the defaults (`converged`
    False). Returns the Params with held-out residuals by basis."""
    calibrated = dict(calibrated or {})
    rows = [r for r in multi_rows if (r["profile"], r["gpu"]) in ladders and r["profile"] in profiles]
    link_of = [sync_link(r["layout"], r["intra_link"], r.get("inter_link")) for r in rows]
    link_rows = {l: link_of.count(l) for l in sorted(set(link_of))}
    host_rows = {g: sum(1 for r in rows if r["gpu"] == g) for g in sorted({r["gpu"] for r in rows})}
    names: list[tuple[str, str]] = []
    for link, n in link_rows.items():
        if n >= MIN_ROWS_PER_PARAM * 2:
            names += [("kappa", link), ("o", link)]
    for gpu, n in host_rows.items():
        if n >= MIN_ROWS_PER_PARAM * 3:   # the site's own multi-GPU steps win over a calibration (module docstring)
            names += [("c_step", gpu), ("c_bucket", gpu), ("c_tensor", gpu)]
            calibrated.pop(gpu, None)
    X = _design(rows, profiles, ladders, collectives)
    for link in sorted((set(X["intra"]) | set(X["inter"])) - {None}):   # links with no sweep: as steps see them
        used = sum(1 for a, b in zip(X["intra"], X["inter"]) if link in (a, b))
        if used >= MIN_ROWS_PER_PARAM * 3:
            names += [("alpha", link), ("bw", link)]
        shared = sum(1 for e, k in zip(X["inter"], X["K"]) if e == link and k > 1)
        if shared >= MIN_ROWS_PER_PARAM * 3:
            names += [("nu", link)]
        if sum(1 for e in X["inter"] if e == link) >= MIN_ROWS_PER_PARAM * 3:
            names += [("tree", link)]
    converged = True

    def build(x) -> tuple[dict, dict]:
        val = {n: float(v) * SCALE[n[0]] for n, v in zip(names, x)}
        hosts = {g: HostCost(val.get(("c_step", g), 0.0), val.get(("c_bucket", g), 0.0),
                             val.get(("c_tensor", g), 0.0), "fitted" if ("c_step", g) in val else "default")
                 for g in host_rows}
        hosts.update(calibrated)
        links = {}
        for l in sorted(set(link_rows) | {n[1] for n in names if n[0] in ("alpha", "bw", "nu", "tree")}):
            a0, bw0 = link_prior(l)[:2]
            links[l] = LinkCost(val.get(("kappa", l), 0.0), val.get(("o", l), 0.0),
                                "fitted" if any(n[1] == l for n in val) else "default",
                                a0 * math.exp(val[("alpha", l)]) if ("alpha", l) in val else None,
                                bw0 * math.exp(val[("bw", l)]) if ("bw", l) in val else None,
                                val.get(("nu", l), 0.0), val.get(("tree", l), 0.0))
        return hosts, links

    def predict_all(x) -> dict:
        hosts, links = build(x)
        lc = [links[l] for l in link_of]
        hc = [hosts.get(r["gpu"], HostCost()) for r in rows]
        host_s = np.array([h.seconds(nb, nt) for h, nb, nt in zip(hc, X["nb"], X["nt"])])
        return simulate(X["t1"], X["floor"], X["share"], _comm(X, links, collectives),
                        np.array([c.kappa for c in lc]), np.array([c.o for c in lc]), host_s,
                        np.ones(len(rows), dtype=bool))

    y = np.log([r["iter_s"] for r in rows]) if rows else np.zeros(0)
    w = _weights(rows)

    def solve(keep: np.ndarray, start=None, tol: float = 1e-8) -> tuple[np.ndarray, bool]:
        """The constants fitted on the rows where `keep` (the others weigh nothing), from `start` (default inside
        the bounds, near 0), to a relative tolerance `tol` of the cost and the constants: (x, converged)."""
        lo = [BOUNDS[n[0]][0] / SCALE[n[0]] for n in names]
        hi = [BOUNDS[n[0]][1] / SCALE[n[0]] for n in names]
        ridge = np.array([math.sqrt(LINK_RIDGE_ROWS if n[0] in STRONG_RIDGE else RIDGE_ROWS) * F_SCALE
                          for n in names])
        sw = np.sqrt(np.where(keep, w, 0.0))

        def resid(v):
            return np.concatenate([sw * (np.log(predict_all(v)["iter_s"]) - y), ridge * np.asarray(v) / np.asarray(hi)])
        x0 = 0.1 * np.asarray(hi) if start is None else start  # at 0 the host path is below the device's, flat
        try:
            res = least_squares(resid, x0, bounds=(lo, hi), loss="soft_l1", f_scale=F_SCALE, max_nfev=200,
                                ftol=tol, xtol=tol)
        except (np.linalg.LinAlgError, ValueError, FloatingPointError):
            return np.zeros(len(names)), False
        return res.x, bool(res.success) and bool(np.all(np.isfinite(res.x)))

    x = np.zeros(len(names))
    trust: dict = {}
    if names:
        x, converged = solve(np.ones(len(rows), dtype=bool))
        for _ in range(TRUST_ROUNDS if converged else 0):   # each owner's vote by its agreement (module docstring)
            before, trust = trust, owner_trust(rows, np.log(predict_all(x)["iter_s"]) - y)
            if before and max(abs(trust[o] - before[o]) for o in trust) < TRUST_TOL:
                break
            w = _weights(rows) * np.array([trust.get(owner_of(r), 1.0) for r in rows])
            x, converged = solve(np.ones(len(rows), dtype=bool), x)
        if not converged:       # the defaults (the no-fit reference's constants) stand, and say so
            names, x, trust, w = [], np.zeros(0), {}, _weights(rows)
    hosts, links = build(x)
    residuals: dict[str, list[float]] = {}
    by_pair: dict[tuple[str, str], list[float]] = {k: [] for k in ladders}
    if rows:
        fit = predict_all(x)
        for r, t in zip(rows, fit["iter_s"]):
            by_pair[(r["profile"], r["gpu"])].append(float(math.log(r["iter_s"] / t)))
        # the intervals' residuals: each owner's rows predicted by constants fitted without them (folds of owners)
        held, gated = fit["iter_s"].copy(), fit["gate"].copy()
        owners = sorted({repr(owner_of(r)) for r in rows if owner_of(r) is not None})
        if names and len(owners) >= 2:
            k = min(OWNER_FOLDS, len(owners))
            fold_of = {o: i % k for i, o in enumerate(owners)}
            fold = np.array([fold_of[repr(owner_of(r))] if owner_of(r) is not None else i % k
                             for i, r in enumerate(rows)])
            for f in range(k):
                # from the fit on all rows (a fold moves it little), to 0.1%: a residual needs no more
                xf, ok = solve(fold != f, x, FOLD_TOL)
                if ok:
                    out = predict_all(xf)
                    held = np.where(fold == f, out["iter_s"], held)
                    gated = np.where(fold == f, out["gate"], gated)
        for r, t, g in zip(rows, held, gated):
            basis = "calibrated" if hosts.get(r["gpu"], HostCost()).basis == "calibrated" else "observed"
            e = float(math.log(r["iter_s"] / t))
            residuals.setdefault(basis, []).append(e)
            residuals.setdefault(f"{basis} {g}", []).append(e)
    residuals["measured"] = _ladder_residuals(ladders)
    ladders = {**infer_ladders(profiles, collectives, ladders, multi_rows, hosts, links), **ladders}
    return Params(ladders=dict(ladders), collectives=collectives, hosts=hosts, links=links, residuals=residuals,
                  converged=converged,
                  pair_rmse={k: float(np.sqrt(np.mean(np.square(v)))) if v else 0.0 for k, v in by_pair.items()},
                  trust={owner_name(o): round(t, 4) for o, t in trust.items() if t < TRUST_KEPT})


def infer_ladders(profiles: dict, collectives: Collectives, ladders: dict, multi_rows: list[dict],
                  hosts: dict, links: dict) -> dict[tuple[str, str], Ladder]:
    """Ladders of the (profile, GPU) pairs that ran on several GPUs but never on one (a job submitted at 4 GPUs
    posts 4-GPU rows only): at each batch, the T1 whose simulated step is the measured one (the step grows with T1,
    so bisection finds it; T1 is its own floor, the host path then being T1 plus DDP's host work), one vote per
    owner (the median of the owners' medians). Their basis is `inferred`."""
    rows = [r for r in multi_rows if (r["profile"], r["gpu"]) not in ladders and r["profile"] in profiles]
    if not rows:
        return {}
    dummy = {(r["profile"], r["gpu"]): Ladder((1.0,), (1.0,)) for r in rows}
    X = _design(rows, profiles, dummy, collectives)
    lc = [links.get(sync_link(r["layout"], r["intra_link"], r.get("inter_link")), LinkCost()) for r in rows]
    kappa, o = np.array([c.kappa for c in lc]), np.array([c.o for c in lc])
    host_s = np.array([hosts.get(r["gpu"], HostCost()).seconds(nb, nt) for r, nb, nt in zip(rows, X["nb"], X["nt"])])
    y = np.array([float(r["iter_s"]) for r in rows])
    lo, hi = np.full(len(rows), 1e-7), y.copy()
    for _ in range(48):
        mid = np.sqrt(lo * hi)
        t = simulate(mid, mid, X["share"], X["comm"], kappa, o, host_s, np.ones(len(rows), dtype=bool))["iter_s"]
        lo, hi = np.where(t < y, mid, lo), np.where(t < y, hi, mid)
    votes: dict[tuple, dict] = {}
    for r, t1 in zip(rows, np.sqrt(lo * hi)):
        key = (r["profile"], r["gpu"], float(r["per_gpu_batch"]))
        votes.setdefault(key, {}).setdefault(owner_of(r), []).append(float(t1))
    pts: dict[tuple, dict] = {}
    for (p, g, b), by in votes.items():
        pts.setdefault((p, g), {})[b] = float(np.median([np.median(v) for v in by.values()]))
    return {k: Ladder(*dataclasses.astuple(Ladder.from_points(v))[:2], basis="inferred") for k, v in pts.items()}


def _design(rows: list[dict], profiles: dict, ladders: dict, coll: Collectives) -> dict:
    """What `simulate` reads of each row that no constant changes: T1, the floor, the buckets' ready shares and
    bytes (padded with NaN shares and 0 bytes to the most buckets), the all-reduce seconds over links with a
    sweep, K and n, the intra (K > 1) and inter (n > 1) link where it has no sweep (else None), bucket and tensor
    counts."""
    n = len(rows)
    width = max((len(profiles[r["profile"]].buckets_bytes) for r in rows), default=1)
    share, comm, nbytes = np.full((n, width), np.nan), np.zeros((n, width)), np.zeros((n, width))
    t1, floor, nb, nt, K, N, intra, inter = np.zeros(n), np.zeros(n), [], [], np.ones(n), np.ones(n), [], []
    swept = Params(collectives=coll)
    for i, r in enumerate(rows):
        p, lad = profiles[r["profile"]], ladders[(r["profile"], r["gpu"])]
        buckets = np.asarray(p.buckets_bytes, dtype=float)
        t1[i] = float(lad.at(r["per_gpu_batch"])[0])
        floor[i] = min(lad.floor, t1[i])
        share[i, :len(buckets)] = shares(p)
        nbytes[i, :len(buckets)] = buckets
        K[i], N[i] = max(r["layout"]), len(r["layout"])
        a, e = r["intra_link"], (r.get("inter_link") or r["intra_link"])
        intra.append(a if K[i] > 1 and not coll.measured(a) else None)
        inter.append(e if N[i] > 1 and not coll.measured(e) else None)
        if intra[i] is None and K[i] > 1:     # the swept links' share, fixed: inside the node over K
            comm[i, :len(buckets)] += bucket_comm(swept, buckets, [[int(K[i])]], a, None)[0]
        if inter[i] is None and N[i] > 1:     # and across the n nodes
            comm[i, :len(buckets)] += bucket_comm(swept, buckets, [[1] * int(N[i])], a, e)[0]
        nb.append(len(buckets))
        nt.append(len(p.tensors))
    return {"t1": t1, "floor": floor, "share": share, "comm": comm, "bytes": nbytes, "K": K, "n": N,
            "intra": intra, "inter": inter, "nb": nb, "nt": nt}


def _comm(X: dict, links: dict[str, LinkCost], coll: Collectives) -> np.ndarray:
    """comm[c, j] of the design's rows at these link constants: the swept links' seconds (fixed) plus, for each
    link with no sweep, `link_seconds` at its alpha, bw and nu, vectorised over its rows."""
    comm = X["comm"].copy()
    for role, world, across in (("intra", X["K"], False), ("inter", X["n"], True)):
        names = np.array([x or "" for x in X[role]], dtype=object)
        for link in set(names) - {""}:
            m = names == link
            lc = links.get(link, LinkCost())
            nbytes = X["bytes"][m] * (X["K"][m, None] ** lc.nu if across else 1.0)
            comm[m] += link_seconds(coll, lc, link, world[m, None], nbytes, across)
    return comm


def _ladder_residuals(ladders: dict[tuple[str, str], Ladder]) -> list[float]:
    """Leave-one-batch-out log errors of the ladders' interior points: how well a batch between two measured
    ones is read."""
    out = []
    for lad in ladders.values():
        for i in range(1, len(lad.batches) - 1):
            rest = Ladder(lad.batches[:i] + lad.batches[i + 1:], lad.seconds[:i] + lad.seconds[i + 1:])
            out.append(float(math.log(lad.seconds[i] / rest.at(lad.batches[i])[0])))
    return out


def host_cost_from_probes(rows: list[dict]) -> dict[str, HostCost]:
    """Per GPU type, DDP's host cost from the calibration job's `ddp_overhead` rows: each row is one probe
    (`buckets`, `tensors`, `bytes`, `extra_s` = the DDP step minus the same model's plain step, at world size
    `world`). The world-1 rows where there are any (no all-reduce to expose: DDP's own work only), else all; one
    vote per probe shape (the median of its rows); non-negative least squares of
    extra_s = c_step + c_bucket * buckets + c_tensor * tensors + c_byte * bytes over >= 3 shapes, clipped to the
    bounds. c_byte takes the gradients' copies into the buckets, which a CPU host does itself and a GPU does on the
    device (in its timeline): it keeps them out of the per-step, per-bucket and per-tensor costs and is not kept."""
    by: dict[str, dict] = {}
    for gpu in {r["gpu"] for r in rows}:
        mine = [r for r in rows if r["gpu"] == gpu]
        alone = [r for r in mine if int(r["world"]) == 1] or mine
        for r in alone:
            by.setdefault(gpu, {}).setdefault((int(r["buckets"]), int(r["tensors"]), float(r.get("bytes") or 0.0)),
                                              []).append(float(r["extra_s"]))
    out = {}
    for gpu, probes in by.items():
        if len(probes) < 3:
            continue
        A = np.array([[1.0, nb, nt, nbytes] for nb, nt, nbytes in probes])
        scale = np.maximum(A.max(axis=0), 1e-12)
        y = np.array([np.median(v) for v in probes.values()])
        coef = nnls(A / scale, np.maximum(y, 0.0))[0] / scale
        c = [float(np.clip(v, *BOUNDS[k])) for v, k in zip(coef, ("c_step", "c_bucket", "c_tensor"))]
        out[gpu] = HostCost(*c, basis="calibrated")
    return out
