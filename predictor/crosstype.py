"""Cross-type prediction: a model's step time on GPU type T from its step time on another type S, learnt from the
models measured on both.

How much faster T is than S depends on the model, its batch and its GPU count (Gavel measured 26 job types on
K80/P100/V100: P100 over K80 ranges 1.6x to 8.4x), so one ratio per pair of types is not enough. For one
direction (S -> T), the log ratio y = log(step_T / step_S) is a Gaussian process over the features `FEATURES`:

    x = (log parameter count, log training FLOPs per sample, log per-GPU batch, log GPUs, log step seconds on S)

with the additive kernel

    k(x, x') = s_c + s_m k_m + s_mb k_m k_b + s_mg k_m k_g + s_g k_g + s_gs k_g k_s

where k_m is a squared-exponential kernel over the model features (parameter count, and FLOPs per sample where
every row has them), k_b over the batch, k_g over the GPU count, k_s over the source step time. So a model's ratio
follows its own rows at a nearby batch and GPU count, and what a GPU count or a step length does to the ratio on
every model. The prior mean is the pooled centre: the mean of the per-model median log ratios (each model one vote,
however many batches and GPU counts it was measured at).

A model outside the history (no training row within `same_model_tol` of its model features) is answered with the
pooled centre, and its spread is the RMS error that centre makes on the training rows when each model is left
out of it in turn. Neither the GP over model size nor its GPU-count terms transfer to a new model on Gavel's data
(bench/crosstype.py, leave-one-model-out: borrowing the ratios of the models of nearest size scored 77% MAPE, the
GPU-count terms alone 41-46%, a shrinkage weight chosen by leave-one-model-out inside the training rows 42-44%,
against 39.5% for the median ratio and 38.9% for the pooled centre), so only the centre and an honest spread
carry over.

The hyperparameters (length scales, amplitudes, noise) are fitted per direction by maximising the log marginal
likelihood (ML-II, exact gradient) under a log-normal prior around the declared starting values
(`prior_log_std`), so with few rows they stay near those values.

Callers may assume: `predict` returns the prior mean and spread where `fit` saw no rows; a training row is answered
within its noise; a model outside the history gets the pooled centre and a spread at least the leave-one-model-out
RMS; everything is vectorised over rows.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.linalg import cho_factor, cho_solve
from scipy.optimize import minimize

FEATURES = ("log_params", "log_flops_per_sample", "log_batch", "log_gpus", "log_src_step_s")
_MODEL = (0, 1)  # columns of the model-identity kernel
_B, _G, _S = 2, 3, 4
# kernel terms: the feature groups each multiplies (an empty group is the constant term)
TERMS = ((), ("m",), ("m", "b"), ("m", "g"), ("g",), ("g", "s"))
PRIOR_NEW_MODEL_STD = 0.5  # log-ratio spread of a new model where the history has fewer than 3 models


def features(n_params, flops_per_sample, batch, gpus, src_step_s) -> np.ndarray:
    """The (n, 5) feature matrix of `FEATURES` from per-row values (FLOPs may be None/NaN: not known)."""
    cols = [np.asarray(v, dtype=float).reshape(-1) for v in
            (n_params, [np.nan if f is None else f for f in np.atleast_1d(flops_per_sample)], batch, gpus, src_step_s)]
    n = max(len(c) for c in cols)
    cols = [np.broadcast_to(c, (n,)) if len(c) == 1 else c for c in cols]
    if any(len(c) != n for c in cols):
        raise ValueError(f"features: columns of unequal length {[len(c) for c in cols]}")
    with np.errstate(divide="ignore", invalid="ignore"):
        X = np.log(np.stack(cols, axis=1))
    if not np.isfinite(np.delete(X, 1, axis=1)).all():
        raise ValueError("features: parameter count, batch, GPUs and source step time must be positive numbers")
    return X


class CrossTypeModel:
    """GP regression of log(step on T / step on S) for one direction S -> T (module docstring).

    Args:
        length_scales: starting length scales of (model features, batch, GPUs, source step), in standard
            deviations of each feature over the training rows.
        amplitudes: starting variances of the kernel terms `TERMS` (constant, model, model x batch, model x GPUs,
            GPUs, GPUs x source step), in log-ratio units squared.
        noise: starting noise variance (log-ratio units squared): run-to-run spread of one measurement.
        prior_log_std: spread of the log-normal prior of each hyperparameter around its starting value.
        optimize: fit the hyperparameters (ML-II); False keeps the starting values.
        max_iter: L-BFGS-B iterations of that fit.
        same_model_tol: distance (log units) of model features under which a row counts as a model of the
            history; the GP's answer fades into the pooled centre over this scale.
    """

    def __init__(self, *, length_scales=(0.5, 1.0, 0.7, 1.0), amplitudes=(0.1, 0.3, 0.3, 0.3, 0.1, 0.1),
                 noise=0.02, prior_log_std=1.0, optimize=True, max_iter=60, same_model_tol=0.01):
        self.length_scales = tuple(length_scales)
        self.amplitudes = tuple(amplitudes)
        self.noise = noise
        self.prior_log_std = prior_log_std
        self.optimize = optimize
        self.max_iter = max_iter
        self.same_model_tol = same_model_tol

    # ------------------------------------------------------------------ fit
    def fit(self, X, y) -> "CrossTypeModel":
        """Fit on rows of models measured on both types: X (n, 5) `features`, y (n,) log(step_T / step_S).

        Raises:
            ValueError: shapes disagree or y is not finite.
        """
        X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float).reshape(-1)
        if X.ndim != 2 or X.shape[1] != len(FEATURES) or len(X) != len(y):
            raise ValueError(f"fit: X must be (n, {len(FEATURES)}) and y (n,), got {X.shape} and {y.shape}")
        if not np.isfinite(y).all():
            raise ValueError("fit: y (log ratios) must be finite")
        self.n_rows_ = len(y)
        self.use_flops_ = bool(len(y)) and bool(np.isfinite(X[:, 1]).all())
        self.model_keys_ = self._model_keys(X)
        group = np.unique(self.model_keys_.round(9), axis=0, return_inverse=True)[1].reshape(-1) \
            if len(y) else np.zeros(0, dtype=int)
        self.mean_, self.new_model_std_ = _pooled_centre(y, group)
        Xs = X.copy()
        if not self.use_flops_:
            Xs[:, 1] = 0.0
        self.centre_ = Xs.mean(axis=0) if len(y) else np.zeros(len(FEATURES))
        scale = Xs.std(axis=0) if len(y) > 1 else np.ones(len(FEATURES))
        self.scale_ = np.where(scale > 1e-9, scale, 1.0)
        self.X_ = self._standard(Xs)
        self.theta0_ = np.log(np.r_[self.length_scales, self.amplitudes, self.noise])
        theta = self.theta0_
        if self.optimize and len(y) >= 3:
            res = minimize(self._nll, theta, args=(self.X_, y - self.mean_), jac=True, method="L-BFGS-B",
                           bounds=[(t - 4 * self.prior_log_std, t + 4 * self.prior_log_std) for t in theta],
                           options={"maxiter": self.max_iter})
            if np.all(np.isfinite(res.x)):
                theta = res.x
        self.theta_ = theta
        if len(y):
            K = self._kernel(self.X_, self.X_, theta)[0] + self._noise_var(theta) * np.eye(len(y))
            self._chol = cho_factor(K, lower=True)
            self.alpha_ = cho_solve(self._chol, y - self.mean_)
        return self

    def _model_keys(self, X: np.ndarray) -> np.ndarray:
        """The raw model features of each row (FLOPs 0 where not used): equal rows are one model."""
        M = np.nan_to_num(X[:, list(_MODEL)].copy())
        if not self.use_flops_:
            M[:, 1] = 0.0
        return M

    def _standard(self, X: np.ndarray) -> np.ndarray:
        Z = (X - self.centre_) / self.scale_
        if not self.use_flops_:
            Z[:, 1] = 0.0
        return Z

    def _noise_var(self, theta) -> float:
        return float(np.exp(theta[-1])) + 1e-8

    @staticmethod
    def _kernel(A: np.ndarray, B: np.ndarray, theta: np.ndarray, grad: bool = False):
        """K(A, B) and, with grad, dK/dtheta (one matrix per hyperparameter but the noise)."""
        ls = np.exp(theta[:4])
        amp = np.exp(theta[4:4 + len(TERMS)])
        d2 = {}
        dm = sum((np.nan_to_num(A[:, None, c] - B[None, :, c])) ** 2 for c in _MODEL)
        d2["m"], d2["b"] = dm, (A[:, None, _B] - B[None, :, _B]) ** 2
        d2["g"], d2["s"] = (A[:, None, _G] - B[None, :, _G]) ** 2, (A[:, None, _S] - B[None, :, _S]) ** 2
        names = ("m", "b", "g", "s")
        k = {n: np.exp(-0.5 * d2[n] / ls[i] ** 2) for i, n in enumerate(names)}
        parts = []
        for t in TERMS:
            p = np.ones_like(dm)
            for n in t:
                p = p * k[n]
            parts.append(p)
        K = sum(a * p for a, p in zip(amp, parts))
        if not grad:
            return K, None
        dK = []
        for i, n in enumerate(names):  # d/dlog l of exp(-d2 / 2 l^2) = k d2 / l^2
            dK.append(sum(a * p for a, p, t in zip(amp, parts, TERMS) if n in t) * d2[n] / ls[i] ** 2)
        dK.extend(a * p for a, p in zip(amp, parts))
        return K, dK

    def _nll(self, theta, X, y):
        """Negative log marginal likelihood plus the log-normal prior, and its gradient."""
        K, dK = self._kernel(X, X, theta, grad=True)
        nv = self._noise_var(theta)
        K = K + nv * np.eye(len(y))
        dK.append(nv * np.eye(len(y)))
        try:
            c = cho_factor(K, lower=True)
        except np.linalg.LinAlgError:
            return 1e10, np.zeros_like(theta)
        alpha = cho_solve(c, y)
        Kinv = cho_solve(c, np.eye(len(y)))
        W = Kinv - np.outer(alpha, alpha)
        prior = (theta - self.theta0_) / self.prior_log_std**2
        nll = 0.5 * y @ alpha + np.sum(np.log(np.diag(c[0]))) + 0.5 * np.sum((theta - self.theta0_) ** 2) \
            / self.prior_log_std**2
        g = np.array([0.5 * np.sum(W * d) for d in dK]) + prior
        return float(nll), g

    # ------------------------------------------------------------------ predict
    def predict(self, X, return_std: bool = False, prior=None):
        """log(step_T / step_S) per row of X (n, 5); with return_std also its standard deviation (noise
        included: the spread of a new measurement). `prior` (n,), optional: a centre per row for a model outside
        the history (predictor/roofline.py's shape-based ratio, fitted on the training rows only); NaN or None
        where a row has none, which then gets the pooled centre. A model of the history is answered by the GP as
        without it."""
        self._check_fitted()
        X = np.asarray(X, dtype=float)
        if X.ndim != 2 or X.shape[1] != len(FEATURES):
            raise ValueError(f"predict: X must be (n, {len(FEATURES)}), got {X.shape}")
        Xs = X.copy()
        if not self.use_flops_:
            Xs[:, 1] = 0.0
        Z = self._standard(Xs)
        prior_var = float(np.sum(np.exp(self.theta_[4:4 + len(TERMS)]))) + self._noise_var(self.theta_)
        if not self.n_rows_:
            mean, var = np.full(len(X), self.mean_), np.full(len(X), prior_var)
        else:
            Ks = self._kernel(Z, self.X_, self.theta_)[0]
            mean = self.mean_ + Ks @ self.alpha_
            var = prior_var - np.sum(Ks * cho_solve(self._chol, Ks.T).T, axis=1)
        # a model of the history answers from the GP; one unlike every training model (no row within
        # same_model_tol of its model features) from the pooled centre, with the spread the training models' own
        # leave-one-model-out measured, blended by the distance to the nearest model
        seen = np.exp(-0.5 * (self._nearest_model(X) / self.same_model_tol) ** 2)
        centre = np.full(len(X), self.mean_)
        if prior is not None:
            prior = np.broadcast_to(np.asarray(prior, dtype=float).reshape(-1), (len(X),))
            centre = np.where(np.isfinite(prior), prior, centre)
        mean = centre + seen * (mean - centre)
        sd = np.sqrt(np.maximum(var, self._noise_var(self.theta_)))
        sd = np.sqrt(seen * sd**2 + (1 - seen) * np.maximum(sd, self.new_model_std_) ** 2)
        if return_std:
            return mean, sd
        return mean

    def _nearest_model(self, X: np.ndarray) -> np.ndarray:
        """Per row of X: the distance (log units) of its model features to the nearest training model's."""
        if not self.n_rows_:
            return np.full(len(X), np.inf)
        M = self._model_keys(X)
        return np.sqrt(((M[:, None, :] - self.model_keys_[None, :, :]) ** 2).sum(axis=2)).min(axis=1)

    def _check_fitted(self):
        if not hasattr(self, "theta_"):
            raise RuntimeError("CrossTypeModel is not fitted: call fit(X, y) first")


def _pooled_centre(y: np.ndarray, group: np.ndarray) -> tuple[float, float]:
    """The log ratio a model outside the history is given, and its spread: the mean of the per-model median
    log ratios (each model one vote, however many rows it has: a pooled prior, not the rows' median), and the RMS
    error of that centre over the training rows when each model's centre leaves the model out (with fewer than
    3 models, the rows' RMS about the centre, at least PRIOR_NEW_MODEL_STD)."""
    if not len(y):
        return 0.0, PRIOR_NEW_MODEL_STD
    models = np.unique(group)
    medians = np.array([np.median(y[group == g]) for g in models])
    centre = float(np.mean(medians))
    if len(models) < 3:
        return centre, max(PRIOR_NEW_MODEL_STD, float(np.sqrt(np.mean((y - centre) ** 2))))
    err = np.concatenate([y[group == g] - np.mean(np.delete(medians, i)) for i, g in enumerate(models)])
    return centre, float(np.sqrt(np.mean(err**2)))


def median_ratio(y) -> float:
    """The baseline: the median log ratio over the models measured on both types."""
    y = np.asarray(y, dtype=float)
    return float(np.median(y)) if len(y) else 0.0


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, dtype=float), np.asarray(meas, dtype=float)
    return float(np.mean(np.abs(pred - meas) / meas) * 100) if len(meas) else math.nan
