"""A roofline prior of the cross-type step-time ratio, from a model's shape and each GPU type's published peaks.

Vendored figures (predictor/data/roofline/, SOURCE.md names the datasheet or the counting behind each):
`gpu_peaks.csv` (FP32 and tensor-core TFLOP/s, memory bandwidth per GPU type) and `gavel_model_shapes.csv`
(training FLOPs per sample, bytes written per sample and per step, ATen ops per step of Gavel's seven models,
counted by bench/gavel_shapes.py from torch.nn definitions written there).

One training step of a model on GPU type X at per-GPU batch b on g GPUs is taken as

    t_X = h * ops + max(kc_X * F b / P_X, km_X * (A b + M0) / W_X) + 2 (g - 1) / g * Gb / L_X

F FLOPs and A bytes per sample, M0 bytes per step, ops kernel launches per step, Gb gradient bytes, P_X peak
FLOP/s, W_X memory bandwidth and L_X interconnect bandwidth of X: the device part is the roofline (compute- or
memory-bound, whichever is longer), each side scaled by how far from its peak X runs (kc_X for FLOP/s, km_X for
bandwidth: a type may reach a larger share of its peak FLOP/s than of its bandwidth, or the reverse), then the ring
all-reduce of the gradients at the datasheet interconnect figure (not scaled: the link is not the device); the
host part launches at h seconds each, the same on every type. The prior of y = log(t_T / t_S) is
log t_T - log t_S. A ratio is blind to a common scale, so kc_S = km_S = 1 and three constants remain per
direction S -> T: log h (seconds per op, relative to the source's device time), log kc_T and log km_T.
`RooflinePrior.fit` fits them on the training rows only (least squares on y, each model one vote however many
rows it has, a weak pull to h = 10 us and kc_T = km_T = 1 so a fold of few models stays near the pure roofline); a
model never seen on T is then answered by `predict` from its shape alone. With no shape (None) a row has no
prior (NaN) and the caller keeps its own answer.
Until tm-2026.11.28-2 one kappa_T scaled the whole device part, all-reduce included (bench/crosstype.py,
leave-one-model-out on Gavel, seen: 35.9%; this form 34.2%: most of it from leaving the link unscaled).
"""
from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

DATA = Path(__file__).resolve().parent / "data" / "roofline"
H_PRIOR_S = 10e-6  # host seconds per launched op the fit is pulled to (a CUDA launch plus framework dispatch)
PULL = 0.3  # weight of that pull (log units) against the per-model residuals
# kernels a parameter tensor costs one step where the profile counts no ops (a service profile has its tensors, not
# its kernels): the forward op, the two of its backward (input and weight gradients) and the optimizer update.
# A priori; on Gavel's models, with their counted ops replaced by this count and no activation bytes,
# leave-one-model-out scored 35.2 / 35.3 / 35.8% at 3 / 5 / 10 per tensor (seen), against 34.2% with the counts.
OPS_PER_TENSOR = 4


@dataclass(frozen=True)
class GPUPeaks:
    gpu: str
    fp32_flops: float  # FLOP/s
    tf32_flops: float | None
    fp16_tensor_flops: float | None
    mem_bw: float  # bytes/s
    link_bw: float  # bytes/s between GPUs of one server (NVLink or PCIe, datasheet figure)
    source: str

    @property
    def train_flops(self) -> float:
        """The dense peak an FP32 training step runs at by default: TF32 tensor cores where the type has them
        (cuDNN runs FP32 convolutions in TF32 by default from Ampere on), else the FP32 figure. The one figure
        predictor/stepmodel.py's GPU_FLOPS takes per type."""
        return self.tf32_flops or self.fp32_flops


@dataclass(frozen=True)
class Shape:
    """What the roofline needs of a model (per training step on one GPU)."""

    flops_per_sample: float  # training (forward + backward) FLOPs
    bytes_per_sample: float  # bytes the step writes per sample (activations, their gradients)
    bytes_per_step: float = 0.0  # bytes independent of the batch (parameters, gradients, update)
    ops_per_step: float = 0.0  # kernels launched per step (host-bound share)
    grad_bytes: float = 0.0  # bytes all-reduced per step on more than one GPU


def _f(v):
    return float(v) if v not in ("", None) else None


@functools.lru_cache(maxsize=4)
def _read_peaks(path: Path) -> tuple:
    with open(path, encoding="utf-8", newline="") as f:
        return tuple(csv.DictReader(f))


def load_peaks(path: Path = DATA / "gpu_peaks.csv") -> dict[str, GPUPeaks]:
    """GPU type (upper case, as `variant` rows name it: V100, V100-PCIE, ...) -> its peaks. The one owner of the
    GPU figures (predictor/data/roofline/SOURCE.md names the datasheet of each); read once per path."""
    return {r["gpu"].upper(): GPUPeaks(r["gpu"].upper(), float(r["fp32_tflops"]) * 1e12,
                                       _f(r["tf32_tensor_tflops"]) and _f(r["tf32_tensor_tflops"]) * 1e12,
                                       _f(r["fp16_tensor_tflops"]) and _f(r["fp16_tensor_tflops"]) * 1e12,
                                       float(r["mem_bw_gbps"]) * 1e9, float(r["interconnect_gbps"]) * 1e9,
                                       r["source"]) for r in _read_peaks(Path(path))}


def load_gavel_shapes(path: Path = DATA / "gavel_model_shapes.csv") -> dict[str, Shape]:
    """Gavel model name -> Shape (bytes per step: the counted fixed part plus the update's 4x parameter bytes)."""
    with open(path, encoding="utf-8", newline="") as f:
        return {r["model"]: Shape(float(r["train_flops_per_sample"]), float(r["act_bytes_per_sample"]),
                                  float(r["step_bytes_fixed"]) + 4 * float(r["param_bytes"]),
                                  float(r["ops_per_step"]), float(r["param_bytes"])) for r in csv.DictReader(f)}


def profile_shape(profile) -> Shape | None:
    """What a service profile (predictor/profiles.py) knows, as a Shape: training FLOPs per sample, its parameter
    bytes (the gradient buckets; the update reads and writes about 4x them a step), its tensor count times
    OPS_PER_TENSOR launches, no activation bytes (a profile has none, so the memory side sees the batch-free bytes
    only). None without FLOPs per sample: no prior."""
    flops = getattr(profile, "flops_per_sample", None)
    if not flops or not flops > 0:
        return None
    param_bytes = float(profile.grad_bytes) or 4.0 * float(profile.n_params)
    return Shape(float(flops), 0.0, 4.0 * param_bytes, float(OPS_PER_TENSOR * len(profile.tensors)), param_bytes)


def roofline_terms(shapes, batch, peaks: GPUPeaks, gpus=1) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (seconds at peak on this type as columns (compute F b / P, memory (A b + M0) / W, ring all-reduce
    2 (g - 1) / g Gb / L over the server's interconnect), shape (n, 3); ops per step, shape (n,)); NaN where a row
    has no shape. Vectorised over rows."""
    n = len(shapes)
    b = np.broadcast_to(np.asarray(batch, dtype=float), (n,))
    g = np.broadcast_to(np.asarray(gpus, dtype=float), (n,))
    nan = math.nan
    cols = np.array([(s.flops_per_sample, s.bytes_per_sample, s.bytes_per_step, s.grad_bytes, s.ops_per_step)
                     if s is not None else (nan,) * 5 for s in shapes], dtype=float).reshape(n, 5)
    F, A, M0, Gb, ops = cols.T
    dev = np.stack([F * b / peaks.fp32_flops, (A * b + M0) / peaks.mem_bw,
                    2 * (g - 1) / g * Gb / peaks.link_bw], axis=1)
    return dev, ops


def log_ratio(theta, dev_s, dev_t, ops) -> np.ndarray:
    """log(t_T / t_S) of the step model (module docstring) at theta = (log h, log kc_T, log km_T); dev_s, dev_t the
    (n, 3) `roofline_terms` of the rows on S and T."""
    h, kc, km = math.exp(theta[0]), math.exp(theta[1]), math.exp(theta[2])
    t_s = h * ops + np.maximum(dev_s[:, 0], dev_s[:, 1]) + dev_s[:, 2]
    t_t = h * ops + np.maximum(kc * dev_t[:, 0], km * dev_t[:, 1]) + dev_t[:, 2]
    return np.log(t_t) - np.log(t_s)


class RooflinePrior:
    """The roofline prior of one direction S -> T, its two constants fitted on training rows (module docstring).

    Args:
        src, dst: GPU types (keys of `peaks`).
        peaks: GPU type -> GPUPeaks (default: the vendored table).
    """

    def __init__(self, src: str, dst: str, peaks: dict[str, GPUPeaks] | None = None):
        peaks = load_peaks() if peaks is None else peaks
        self.src, self.dst = peaks[src.upper()], peaks[dst.upper()]
        self.theta_ = np.array([math.log(H_PRIOR_S), 0.0, 0.0])
        self.models_: tuple = ()

    def terms(self, shapes, batch, gpus=1):
        dev_s, ops = roofline_terms(shapes, batch, self.src, gpus)
        dev_t, _ = roofline_terms(shapes, batch, self.dst, gpus)
        return dev_s, dev_t, ops

    def fit(self, shapes, batch, y, model, gpus=1) -> "RooflinePrior":
        """Fit (log h, log kc_T, log km_T) on training rows: `shapes` (Shape or None per row), per-GPU `batch`, y the
        measured log(step_T / step_S), `model` the row's model name (each model one vote). Rows without a shape
        are ignored; with none the constants stay at their starting values (pure roofline, h = H_PRIOR_S)."""
        dev_s, dev_t, ops = self.terms(shapes, batch, gpus)
        y, model = np.asarray(y, dtype=float), np.asarray(model, dtype=object)
        ok = np.isfinite(dev_s).all(axis=1)
        self.models_ = tuple(sorted(set(model[ok])))
        if not ok.any():
            return self
        counts = {m: int(np.sum(model[ok] == m)) for m in self.models_}
        w = np.sqrt(np.array([1.0 / counts[m] for m in model[ok]]))
        theta0 = self.theta_.copy()

        def resid(theta):
            r = w * (log_ratio(theta, dev_s[ok], dev_t[ok], ops[ok]) - y[ok])
            return np.r_[r, PULL * (theta - theta0)]

        res = least_squares(resid, theta0, bounds=(theta0 - 6, theta0 + 6))
        if np.all(np.isfinite(res.x)):
            self.theta_ = res.x
        return self

    def predict(self, shapes, batch, gpus=1) -> np.ndarray:
        """The prior log(step_T / step_S) per row; NaN where a row has no shape."""
        dev_s, dev_t, ops = self.terms(shapes, batch, gpus)
        out = np.full(len(dev_s), np.nan)
        ok = np.isfinite(dev_s).all(axis=1)
        out[ok] = log_ratio(self.theta_, dev_s[ok], dev_t[ok], ops[ok])
        return out
