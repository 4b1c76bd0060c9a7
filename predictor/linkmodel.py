"""Per-link collective time: a scikit-learn estimator, (link, op, participants, bytes) -> seconds.

Model, per link class L (a free string such as "nvlink", "ib") and collective op:

    t = (alpha_L * steps_op(p) + vol_op(p) * bytes / bw_L) * p ** gamma_L

    ring allreduce:        steps = 2 (p - 1),  vol = 2 (p - 1) / p
    allgather/reducescatter: steps = p - 1,    vol = (p - 1) / p
    broadcast/reduce:      steps = p - 1,      vol = 1
    alltoall:              steps = p - 1,      vol = (p - 1) / p
    sendrecv:              steps = 1,          vol = 1             (one exchange with a peer)

`gamma_L` is the learned correction for how the link degrades with participants (contention, protocol
changes); it is pulled towards 0. Fitting is MAP in log space with a robust (soft L1) loss: the prior of the
link class (`LINK_PRIORS`, by substring, else `DEFAULT_PRIOR`) enters as pseudo-observations, so a few points
move the fit a little and many points dominate. Extrapolation is that of the alpha-beta form: more bytes is
never faster, and for gamma >= 0 more participants never faster. Uncertainty (relative std of the
prediction) is the log-residual spread inflated by the parameter count over the number of observations; for a
link never observed it is the prior's spread (1.0, i.e. a factor of e).

Input `X`: a 2-D array-like of rows (link, op, participants, bytes), or a list of dicts with those keys.
`participants` >= 1 (1 costs nothing), `bytes` >= 0.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import least_squares
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from predictor.errors import ValidationError

# link class substring -> (alpha seconds, bandwidth bytes/s), bus bandwidth of a ring all-reduce.
LINK_PRIORS = {
    "nvlink": (1.5e-5, 150e9), "nvswitch": (1.5e-5, 200e9), "xgmi": (2e-5, 80e9), "pcie": (2e-5, 10e9),
    "shm": (2e-5, 20e9), "ib": (2e-5, 20e9), "infiniband": (2e-5, 20e9), "roce": (3e-5, 10e9),
    "efa": (5e-5, 10e9), "ethernet": (5e-5, 3e9), "eth": (5e-5, 3e9), "tcp": (8e-5, 2e9),
    "socket": (8e-5, 2e9), "loopback": (5e-5, 3e9),
}
DEFAULT_PRIOR = (5e-5, 5e9)
PRIOR_LOG_STD = 1.0  # relative spread of a prior-only prediction (log space)
UNKNOWN_LOG_STD = 1.5  # link name matching no known class
OPS = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce", "alltoall", "sendrecv")  # records.OPS


def _op_factors(op: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(latency steps, bandwidth volume factor) of each op on p participants (ring algorithms)."""
    steps = np.where(op == "allreduce", 2.0 * (p - 1), np.where(op == "sendrecv", 1.0, p - 1.0))
    vol = np.where(op == "allreduce", 2.0 * (p - 1) / p,
                   np.where(np.isin(op, ("broadcast", "reduce", "sendrecv")), (p > 1).astype(float), (p - 1) / p))
    return steps, vol


def link_prior(link: str) -> tuple[float, float, float]:
    """(alpha_s, bandwidth_Bps, log std) of a link class never observed, matched by substring."""
    name = str(link).lower()
    for key, (a, bw) in sorted(LINK_PRIORS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return a, bw, PRIOR_LOG_STD
    return DEFAULT_PRIOR[0], DEFAULT_PRIOR[1], UNKNOWN_LOG_STD


def _normalise_op(op: str) -> str:
    o = str(op).lower().replace("_", "").replace("-", "").replace("all_reduce", "allreduce")
    return {"reducescatterv": "reducescatter", "allgatherv": "allgather", "bcast": "broadcast"}.get(o, o)


def _as_columns(X) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate X into (link, op, participants, bytes) arrays.

    Raises:
        ValueError: bad shape; ValidationError (a ValueError) naming the bad row and column.
    """
    if isinstance(X, list) and X and isinstance(X[0], dict):
        rows = [(r.get("link"), r.get("op", "allreduce"), r.get("world", r.get("participants")), r.get("bytes"))
                for r in X]
    else:
        arr = np.asarray(X, dtype=object)
        if arr.ndim != 2 or arr.shape[1] != 4:
            raise ValueError(f"X must have 4 columns (link, op, participants, bytes), got shape {arr.shape}")
        rows = [tuple(r) for r in arr]
    if not rows:
        raise ValueError("X is empty: need at least one observation")
    link = np.array([str(r[0]) for r in rows], dtype=object)
    op = np.array([_normalise_op(r[1]) for r in rows], dtype=object)
    try:
        p = np.array([float(r[2]) for r in rows])
        b = np.array([float(r[3]) for r in rows])
    except (TypeError, ValueError) as e:
        raise ValidationError("participants/bytes", f"must be numbers: {e}") from None
    for name, v, lo in (("participants", p, 1), ("bytes", b, 0)):
        bad = ~np.isfinite(v) | (v < lo) | (v > 1e15)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValidationError(f"X[{i}].{name}", f"must be finite and >= {lo}, got {v[i]!r}")
    bad_op = ~np.isin(op, OPS)
    if bad_op.any():
        i = int(np.argmax(bad_op))
        raise ValidationError(f"X[{i}].op", f"unknown collective {op[i]!r}; known: {OPS}")
    return link, op, p, b


class LinkModel(RegressorMixin, BaseEstimator):
    """Alpha-beta collective time per link class, fitted robustly in log space with priors.

    Args:
        prior_weight: pseudo-observations the prior of a link is worth (per parameter).
        gamma_l2: ridge weight pulling the participants correction `gamma` to 0.
        f_scale: soft-L1 scale of log residuals (0.1 = 10 %); larger residuals count linearly.
        min_time_s: floor added to every prediction (launch overhead).
    """

    def __init__(self, prior_weight: float = 2.0, gamma_l2: float = 4.0, f_scale: float = 0.1,
                 min_time_s: float = 1e-6):
        self.prior_weight = prior_weight
        self.gamma_l2 = gamma_l2
        self.f_scale = f_scale
        self.min_time_s = min_time_s

    def fit(self, X, y) -> "LinkModel":
        """Fit each link class seen in X. A second fit replaces the first. Returns self."""
        link, op, p, b = _as_columns(X)
        y = np.asarray(y, dtype=float).ravel()
        if y.shape[0] != link.shape[0]:
            raise ValueError(f"X has {link.shape[0]} rows but y has {y.shape[0]}")
        if not np.all(np.isfinite(y)) or np.any(y <= 0):
            raise ValidationError("y", "seconds must be finite and positive")
        self.links_ = {}
        for name in sorted(set(link)):
            m = link == name
            self.links_[name] = self._fit_link(name, op[m], p[m], b[m], y[m])
        self.n_features_in_ = 4
        return self

    def _fit_link(self, name, op, p, b, y) -> dict:
        a0, bw0, s0 = link_prior(name)
        steps, vol = _op_factors(op, p)
        ly = np.log(y)
        w = math.sqrt(self.prior_weight) / s0

        def resid(theta):
            la, lbw, g = theta
            t = (np.exp(la) * steps + vol * b / np.exp(lbw)) * p**g + self.min_time_s
            return np.concatenate([np.log(t) - ly,
                                   [w * (la - math.log(a0)), w * (lbw - math.log(bw0)), self.gamma_l2 * g]])

        x0 = np.array([math.log(a0), math.log(bw0), 0.0])
        res = least_squares(resid, x0, loss="soft_l1", f_scale=self.f_scale,
                            bounds=([math.log(1e-8), math.log(1e6), 0.0], [math.log(1.0), math.log(1e13), 1.0]))
        theta = res.x if res.success else x0
        r = resid(theta)[: len(y)]
        n = len(y)
        spread = float(np.sqrt(np.sum(r**2) / max(n - 1, 1))) if n > 1 else s0
        # MAP spread: shrink from the prior's spread towards the residual spread as data accumulate.
        sigma = math.sqrt((spread**2 * n + s0**2 * 3 * self.prior_weight / max(n, 1)) / (n + 1))
        return {"alpha_s": float(math.exp(theta[0])), "bandwidth_Bps": float(math.exp(theta[1])),
                "gamma": float(theta[2]), "n": n, "log_rmse": float(np.sqrt(np.mean(r**2))),
                "log_std": sigma, "converged": bool(res.success)}

    def _params(self, name: str) -> tuple[float, float, float, float, bool]:
        d = self.links_.get(name)
        if d is None:
            a, bw, s = link_prior(name)
            return a, bw, 0.0, s, False
        return d["alpha_s"], d["bandwidth_Bps"], d["gamma"], d["log_std"], True

    def predict_with_std(self, X) -> tuple[np.ndarray, np.ndarray]:
        """Seconds and relative std (log space) of each row; unseen links use their class prior."""
        check_is_fitted(self, "links_")
        link, op, p, b = _as_columns(X)
        out, std = np.empty(len(link)), np.empty(len(link))
        steps, vol = _op_factors(op, p)
        for name in set(link):
            m = link == name
            a, bw, g, s, _ = self._params(name)
            out[m] = (a * steps[m] + vol[m] * b[m] / bw) * p[m] ** g + self.min_time_s
            std[m] = s
        out[p <= 1] = 0.0
        return out, std

    def predict(self, X) -> np.ndarray:
        """Seconds of each collective in X (0 for a single participant)."""
        return self.predict_with_std(X)[0]

    def time(self, link: str, op: str, participants: float, nbytes) -> np.ndarray:
        """Vectorised convenience: seconds of `op` over `participants` for each size in `nbytes`."""
        check_is_fitted(self, "links_")
        nb = np.atleast_1d(np.asarray(nbytes, dtype=float))
        if participants <= 1:
            return np.zeros_like(nb)
        a, bw, g, _, _ = self._params(str(link))
        steps, vol = _op_factors(np.array([_normalise_op(op)], dtype=object), np.array([float(participants)]))
        return (a * steps[0] + vol[0] * nb / bw) * participants**g + self.min_time_s

    def link_log_std(self, link: str) -> float:
        check_is_fitted(self, "links_")
        return self._params(str(link))[3]

    def link_stats(self) -> list[dict]:
        """One record per fitted link: alpha_s, bandwidth_Bps, gamma, n observations, fit error (log RMSE)."""
        check_is_fitted(self, "links_")
        return [{"link": k, **v} for k, v in sorted(self.links_.items())]

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.string = True
        tags.input_tags.categorical = True
        return tags


def empty_link_model(**kwargs) -> LinkModel:
    """A LinkModel that has seen nothing: every link answers from its prior."""
    m = LinkModel(**kwargs)
    m.links_ = {}
    m.n_features_in_ = 4
    return m
