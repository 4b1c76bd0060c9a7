"""Step rows far from the model, and the jobs whose rows mostly are (issue #14.2: outliers flagged on /admin).

For each step row the fitted model predicts the step time of the row's own layout, links, GPU and per-GPU batch
(as for anyone else's plan: not from that job's own measurements), and the row's log residual is
`r = log(observed iter_s / predicted iter_s)`. The residuals are centred on their median and scaled by their
MAD (1.4826 x the median absolute deviation, at least `MIN_SIGMA` so a near-perfect fit does not flag a few
percent); a row is an outlier when `|r - median| > K x sigma`. Median and MAD weigh each user's rows (each unsigned
job's) together as at most `JOB_ROWS_CAP` rows (`job_weights`), times the trust the fit gave that owner
(`stepmodel.owner_trust`, kept in the model's document), so one user who posts hundreds of made-up rows cannot move
the centre and make everyone else the outlier, nor can one such user against a history of one honest user (#41.1).

A job is listed when more than `MOSTLY` of its rows are outliers, with its median deviation and the uid that signed
its rows (a munge-signed job's; none for a token's), so several jobs of one user show as that user's. What the admin
sees: the deviation as observed / predicted - 1 (+300%: four times slower than the model says).

Bounded work: the newest `MAX_ROWS` step rows, one `predict` call per (profile, GPU, per-GPU batch) over its
distinct layouts; rows whose profile is not registered (no prediction) are left out.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np

from predictor.errors import NotFoundError, ValidationError
from predictor.profiles import Profile
from slurm_plugin.contracts.records import is_mixed, layout_name
from predictor.stepmodel import owner_name, owner_of

K = 4.0
MIN_SIGMA = 0.05
MOSTLY = 0.5
JOB_ROWS_CAP = 20
MAX_ROWS = 20000
SHOWN = 50            # outlier rows listed (largest deviations first)

OUTLIER_COLUMNS = [("id", "row", "d"), ("job_id", "job", ""), ("profile", "profile", ""), ("gpu", "gpu", ""),
                   ("layout", "layout", ""), ("observed_s", "step s", ".4f"), ("predicted_s", "predicted s", ".4f"),
                   ("deviation", "deviation", "+.0%"), ("score", "|r|/sigma", ".1f")]
JOB_COLUMNS = [("job_id", "job", ""), ("uid", "user (uid)", ""), ("rows", "rows", "d"), ("outliers", "outliers", "d"),
               ("share", "outlier share", ".0%"), ("deviation", "median deviation", "+.0%")]


@dataclasses.dataclass(frozen=True)
class Report:
    """`rows`: outlier rows, largest first (at most SHOWN); `jobs`: jobs whose rows are mostly outliers;
    `checked`: rows compared with the model; `sigma`: the robust scale used."""

    rows: list[dict]
    jobs: list[dict]
    checked: int
    sigma: float


def job_weights(rows: list[dict], cap: int) -> np.ndarray:
    """Per row: 1, or cap / n for the n rows of one owner (`stepmodel.owner_of`: its user, else its job) with
    more than `cap`, so no owner weighs more than `cap` rows (rows of no owner weigh 1)."""
    owners = [owner_of(r) for r in rows]
    counts: dict = {}
    for o in owners:
        if o is not None:
            counts[o] = counts.get(o, 0) + 1
    return np.array([1.0 if o is None else min(1.0, cap / counts[o]) for o in owners])


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, cum[-1] / 2.0)])


def _predicted(store, predictor, rows: list[dict]) -> list[tuple[dict, float]]:
    """(row, predicted iter_s) for the rows the model can predict."""
    groups: dict = defaultdict(list)
    for row in rows:
        if not is_mixed(row):  # a mixed job's step is no one type's: the fit has nothing to compare it with
            groups[(row["profile"], row["gpu"], row["per_gpu_batch"])].append(row)
    out = []
    for (name, gpu, batch), members in groups.items():
        try:
            profile = Profile.from_dict(store.get_profile(name))
        except (NotFoundError, ValidationError):
            continue
        keys = sorted({_key(r) for r in members})
        cands = [{"layout": list(lay), "intra_link": intra, **({"inter_link": inter} if inter else {})}
                 for lay, intra, inter in keys]
        try:
            preds = predictor.predict(profile, gpu, batch, cands)
        except ValidationError:
            continue
        by_key = {k: p["iter_s"] for k, p in zip(keys, preds)}
        out += [(r, by_key[_key(r)]) for r in members]
    return out


def _key(row: dict) -> tuple:
    """A row's candidate: layout, intra link, inter link ("" on one node, so keys of both kinds sort together)."""
    return tuple(row["layout"]), row["intra_link"], row.get("inter_link") or ""


def outlier_report(store, predictor) -> Report:
    """Outlier rows and mostly-outlier jobs of the step history against the fitted `predictor` (module docstring).

    Args:
        store: the history Store.
        predictor: a fitted predictor (`predict(profile, gpu, per_gpu_batch, candidates)`); None: nothing to
            compare with, an empty report.
    """
    if predictor is None:
        return Report([], [], 0, MIN_SIGMA)
    pairs = [(r, p) for r, p in _predicted(store, predictor, store.observations(kind="step")[-MAX_ROWS:])
             if p > 0 and math.isfinite(p) and 0 < r["iter_s"] / p < math.inf]  # extreme values: no log ratio
    if not pairs:
        return Report([], [], 0, MIN_SIGMA)
    rows = [r for r, _ in pairs]
    resid = np.log(np.array([r["iter_s"] / p for r, p in pairs]))
    trust = getattr(getattr(predictor, "params_", None), "trust", {}) or {}
    weights = job_weights(rows, JOB_ROWS_CAP) * np.array(
        [1.0 if owner_of(r) is None else trust.get(owner_name(owner_of(r)), 1.0) for r in rows])
    centre = _weighted_median(resid, weights)
    sigma = max(1.4826 * _weighted_median(np.abs(resid - centre), weights), MIN_SIGMA)
    score = np.abs(resid - centre) / sigma
    flagged = []
    per_job: dict = defaultdict(lambda: [0, 0, []])     # job -> [rows, outliers, residuals]
    signer: dict = {}                                    # job -> the uid that signed its rows (#24.1), if any
    for row, (_, pred), r, z in zip(rows, pairs, resid, score):
        job = per_job[row.get("job_id")]
        if row.get("uid") is not None:
            signer[row.get("job_id")] = row["uid"]
        job[0] += 1
        job[2].append(r)
        if z > K:
            job[1] += 1
            flagged.append({"id": row["id"], "job_id": row.get("job_id"), "profile": row["profile"],
                            "gpu": row["gpu"], "layout": layout_name(row["layout"]), "observed_s": row["iter_s"],
                            "predicted_s": pred, "deviation": math.expm1(r), "score": float(z)})
    flagged.sort(key=lambda f: -f["score"])
    jobs = [{"job_id": job_id, "uid": signer.get(job_id), "rows": n, "outliers": bad, "share": bad / n,
             "deviation": math.expm1(float(np.median(rs)))}
            for job_id, (n, bad, rs) in per_job.items() if job_id is not None and bad / n > MOSTLY]
    jobs.sort(key=lambda j: (-j["outliers"], str(j["job_id"])))
    return Report(flagged[:SHOWN], jobs, len(rows), sigma)
