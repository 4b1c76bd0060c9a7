"""The prediction engine the service uses: fit on history (profiles + observations), predict candidate layouts.

`Predictor.fit` fits the per-link collective model (linkmodel.LinkModel) on `kind="collective"` records and the
throughput model (throughput.py) on `kind="step"` records; `predict` answers one (profile, GPU, batch) for a list
of candidate layouts. Records have the shapes of docs/design.md; step records may carry `sync_s` (seconds of
the step blocked in gradient sync), which sharpens the compute/sync split. Callers may assume: predictions come
back in candidate order, and a profile or link never observed still gets an answer, marked by `basis` and a
larger `uncertainty`.
"""
from __future__ import annotations

import math

import numpy as np

from predictor.crosstype import CrossTypeModel, features
from predictor.errors import ValidationError
from predictor.linkmodel import LinkModel, empty_link_model
from predictor.lru import ByteBudgetLRU
from predictor.profiles import Profile
from predictor.roofline import RooflinePrior, profile_shape
from predictor.throughput import (HOST_PER_TENSOR_PRIOR_US, NetParams, PerfParams, N_PHI, fit_bounded, predict_rows,
                                  row_owner, profile_compute_params, sync_bases, sync_link_key)

PROFILE_LOG_STD = 0.5  # relative spread of a compute estimate taken from a profile
PRIOR_LOG_STD = 1.0  # ... from a parameter-count guess
MIN_LOG_STD = 0.03
BASES_CACHE_BYTES = 32 * 1024 * 1024  # budget of the per-fit sync-time cache (`Predictor._bases`), per process
MIN_CROSS_MODELS = 2  # models measured on both types before a cross-type answer is given
CROSS_BATCHES = 8  # batch sizes per model a cross-type fit takes (spread over those it was measured at)
BASES_ENTRY_BYTES = 512  # one entry: a key of fixed size (no layout in it) and a pair of floats, dict slot included


def capped_collectives(rows: list[dict], cap: int) -> list[dict]:
    """The collective rows the link fit uses: of one owner's (`throughput.row_owner`: its user, else its job) rows
    of one point (link, op, world, size within a factor of 2), the newest `cap` (rows in stored order); rows of no
    owner all count. 20,480 rows from one job halved a link's fitted bandwidth (#24.11); a job's repeated
    timings of one point say no more than a few of them."""
    seen: dict = {}
    keep = [False] * len(rows)
    for i in range(len(rows) - 1, -1, -1):
        r = rows[i]
        owner = row_owner(r)
        if owner is None:
            keep[i] = True
            continue
        point = (owner, r["link"], r.get("op", "allreduce"), r["world"], int(r["bytes"]).bit_length())
        seen[point] = seen.get(point, 0) + 1
        keep[i] = seen[point] <= cap
    return [r for r, k in zip(rows, keep) if k]


class Predictor:
    """Throughput of data-parallel training per candidate layout, from link and step history.

    Args:
        bucket_cap_mb: DDP bucket cap used for profiles that do not list their buckets.
        link_prior_weight: pseudo-observations a link class prior is worth in the collective model.
        sync_weight: weight of reported sync times against step times in the step fit.
        w_l2: ridge weight of a link's topology corrections.
        dw_l2: ridge weight of a job's own refinement of them.
        shape_l2: ridge weight of a link's per-shape corrections (learnt from shapes >= 2 jobs ran).
        gamma_prior: compute/sync overlap exponent used where it cannot be fitted.
        f_scale: soft-L1 scale of log residuals in the step fit.
        recent_rows: for a job asking about itself (`predict(job_id=)`), a candidate that job measured (same
            profile, GPU, per-GPU batch, layout shape and links) is predicted at the median of its newest
            this-many step rows (`basis: measured`): the model generalises to what was not run, the job's own
            measurement wins where there is one, and newer evidence over older (rows in stored order).
        link_rows_cap: one owner's collective rows of one point (link, op, world, size within a factor of 2)
            count at most this many times in the link fit, the newest (`capped_collectives`).
        job_rows_cap: one user's step rows (all their jobs'; an unsigned job's alone) weigh at most this many rows
            in the fit (throughput.job_weights).
    """

    def __init__(self, *, bucket_cap_mb: float = 25.0, link_prior_weight: float = 2.0, sync_weight: float = 0.5,
                 w_l2: float = 1.0, dw_l2: float = 0.3, shape_l2: float = 1.0, gamma_prior: float = 1.5,
                 f_scale: float = 0.05, recent_rows: int = 5, job_rows_cap: int = 20, link_rows_cap: int = 4):
        self.bucket_cap_mb = bucket_cap_mb
        self.link_prior_weight = link_prior_weight
        self.sync_weight = sync_weight
        self.w_l2 = w_l2
        self.dw_l2 = dw_l2
        self.shape_l2 = shape_l2
        self.gamma_prior = gamma_prior
        self.f_scale = f_scale
        self.recent_rows = recent_rows
        self.job_rows_cap = job_rows_cap
        self.link_rows_cap = link_rows_cap

    # ------------------------------------------------------------------ fit
    def fit(self, profiles: dict[str, Profile], observations: list[dict]) -> "Predictor":
        """Fit on validated observation dicts. Step rows of profiles not in `profiles` are skipped (`skipped_`).

        Raises:
            ValidationError: a record lacks a field the fit needs (named as `observations[i].field`).
        """
        coll = [o for o in observations if o.get("kind") == "collective"]
        steps, self.skipped_ = [], 0
        for i, o in enumerate(observations):
            if o.get("kind") != "step":
                continue
            for f in ("profile", "gpu", "layout", "intra_link", "per_gpu_batch", "iter_s"):
                if o.get(f) in (None, "", []):
                    raise ValidationError(f"observations[{i}].{f}", "required for a step record")
            if o["profile"] not in profiles:
                self.skipped_ += 1
                continue
            steps.append(o)
        coll = capped_collectives(coll, self.link_rows_cap)
        if coll:
            X = [(o["link"], o.get("op", "allreduce"), o["world"], o["bytes"]) for o in coll]
            self.links_ = LinkModel(prior_weight=self.link_prior_weight).fit(X, [o["seconds"] for o in coll])
        else:
            self.links_ = empty_link_model(prior_weight=self.link_prior_weight)
        self.profiles_ = dict(profiles)
        self._base_cache = ByteBudgetLRU(BASES_CACHE_BYTES)
        self.step_links_ = {}
        for o in steps:
            for key in (o["intra_link"], o.get("inter_link")):
                if key:
                    self.step_links_[key] = self.step_links_.get(key, 0) + 1
        if steps:
            bases = np.array([self._bases(profiles[o["profile"]], o["layout"], o["intra_link"], o.get("inter_link"))
                              for o in steps])
            tensors = np.array([len(profiles[o["profile"]].tensors) for o in steps], dtype=float)
            fit = fit_bounded(steps, bases, tensors, sync_weight=self.sync_weight, w_l2=self.w_l2,
                              dw_l2=self.dw_l2, shape_l2=self.shape_l2, job_rows_cap=self.job_rows_cap,
                              gamma_prior=self.gamma_prior, f_scale=self.f_scale)
        else:
            fit = {"perf": {}, "net": {}, "log_rmse": {}, "converged": True, "cost": 0.0, "unfitted": []}
        self.unfitted_ = fit["unfitted"]   # pairs the fit's time budget left for the next fit (fit_bounded)
        self.perf_, self.net_, self.log_rmse_ = fit["perf"], fit["net"], fit["log_rmse"]
        self.n_rows_, self.batches_ = {}, {}
        for o in steps:
            key = (o["profile"], o["gpu"])
            if key not in self.perf_:
                continue
            self.n_rows_[key] = self.n_rows_.get(key, 0) + 1
            self.batches_.setdefault(key, set()).add(float(o["per_gpu_batch"]))
        self._cross_cache = {}
        self.converged_ = fit["converged"]
        self.calibration_ = self._calibrate()
        self.n_steps_ = len(steps)
        self.measured_ = measured_steps(steps, self.recent_rows)
        return self

    def __getstate__(self) -> dict:
        """What pickling keeps (the service stores fitted predictors): all but the `_bases` cache, which is
        rebuilt on use."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_base_cache", "_cross_cache")}

    def _bases(self, profile: Profile, layout, intra, inter):
        """(T_I, T_E) of the profile's buckets on a layout; cached per fit, bounded by BASES_CACHE_BYTES.

        `sync_bases` depends on the layout only through its largest node and its node count, so those are the
        key: an entry's size does not grow with the layout, and layouts of one shape share an entry.
        """
        key = (profile.name, profile.buckets_bytes, max(layout), len(layout), intra, inter)
        cache = self.__dict__.get("_base_cache")
        if cache is None:       # unpickled: the cache is not stored with the model
            cache = self.__dict__.setdefault("_base_cache", ByteBudgetLRU(BASES_CACHE_BYTES))
        hit = cache.get(key)
        if hit is None:
            hit = sync_bases(self.links_, np.asarray(profile.buckets_bytes, dtype=float), list(layout), intra, inter)
            cache.put(key, hit, BASES_ENTRY_BYTES)
        return hit

    def _calibrate(self) -> dict[str, float]:
        """Per GPU: geometric mean of fitted c1 over the profile estimate, for never-observed profiles."""
        ratios: dict[str, list[float]] = {}
        for (name, gpu), p in self.perf_.items():
            est = profile_compute_params(self.profiles_[name], gpu, None).c1
            ratios.setdefault(gpu, []).append(math.log(p.c1 / est))
        return {g: math.exp(float(np.mean(v))) for g, v in ratios.items()}

    # ------------------------------------------------------------------ predict
    def known(self, profile_name: str, gpu: str) -> bool:
        """Whether step history exists for this (profile, GPU type) pair."""
        self._check_fitted()
        return (profile_name, gpu) in self.perf_

    def predict(self, profile: Profile, gpu: str, per_gpu_batch: int, candidates: list[dict],
                job_id: int | None = None) -> list[dict]:
        """Predicted step time and throughput of each candidate layout, in order.

        For `job_id` (a running job asking about itself), a layout that job measured is answered with its own
        measurement (`recent_rows`); for anyone else every layout is the model's, fitted on all jobs, so one
        job's rows never stand in for everybody's answer.

        Raises:
            ValidationError: bad batch or candidate (named as `candidates[i].layout`, ...).
        """
        self._check_fitted()
        if isinstance(per_gpu_batch, bool) or not isinstance(per_gpu_batch, (int, float)) \
                or not math.isfinite(per_gpu_batch) or not 0 < per_gpu_batch <= 1e7:
            raise ValidationError("per_gpu_batch", f"must be a positive number, got {per_gpu_batch!r}")
        cands = [_check_candidate(c, i) for i, c in enumerate(candidates)]
        if not cands:
            return []
        perf, basis, log_std = self._cross_type(profile, gpu, float(per_gpu_batch)) or self._perf(profile, gpu)
        measured = self.__dict__.get("measured_", {})
        out = []
        for c in cands:
            net, link_std = self._net(c["layout"], c["intra_link"], c["inter_link"])
            bases = np.array([self._bases(profile, c["layout"], c["intra_link"], c["inter_link"])])
            r = predict_rows(perf, net, float(per_gpu_batch), [c["layout"]], bases, len(profile.tensors))
            share = float(r["comm_s"][0] / max(r["iter_s"][0], 1e-12)) if sum(c["layout"]) > 1 else 0.0
            std = math.sqrt(log_std**2 + (share * link_std) ** 2)
            pred = {"layout": list(c["layout"]), "samples_per_s": float(r["samples_per_s"][0]),
                    "iter_s": float(r["iter_s"][0]), "compute_s": float(r["compute_s"][0]),
                    "comm_s": float(r["comm_s"][0]), "uncertainty": std, "basis": basis}
            seen = None if job_id is None else measured.get(
                (int(job_id), *step_key(profile.name, gpu, per_gpu_batch, c["layout"], c["intra_link"],
                                        c["inter_link"])))
            if seen is not None:  # measured: its newest rows' median, the model's split of it scaled alike
                iter_s, spread, n = seen
                scale = iter_s / pred["iter_s"]
                pred.update(iter_s=iter_s, samples_per_s=sum(c["layout"]) * per_gpu_batch / iter_s,
                            compute_s=pred["compute_s"] * scale, comm_s=pred["comm_s"] * scale,
                            uncertainty=max(spread, std / math.sqrt(n), MIN_LOG_STD), basis=f"measured ({n} rows)")
            out.append(pred)
        return out

    def _perf(self, profile: Profile, gpu: str) -> tuple[PerfParams, str, float]:
        key = (profile.name, gpu)
        if key in self.perf_:
            # residual spread, inflated while a pair has few rows (its parameters are then poorly pinned down)
            n = self.n_rows_.get(key, 1)
            std = math.sqrt(self.log_rmse_.get(key, 0.1) ** 2 + PROFILE_LOG_STD**2 * min(1.0, 2.0 / n))
            return self.perf_[key], "observed", max(std, MIN_LOG_STD)
        gammas = [p.gamma for p in self.perf_.values()]
        gamma = float(np.median(gammas)) if gammas else self.gamma_prior
        perf = profile_compute_params(profile, gpu, self.calibration_.get(gpu), gamma)
        has_estimate = profile.compute_s_per_sample is not None or profile.flops_per_sample is not None
        return perf, ("profile" if has_estimate else "prior"), (PROFILE_LOG_STD if has_estimate else PRIOR_LOG_STD)

    # ------------------------------------------------------------------ cross-type (predictor/crosstype.py)
    def _cross_type(self, profile: Profile, gpu: str, b: float) -> tuple[PerfParams, str, float] | None:
        """For a profile never measured on `gpu` but measured on other types: its fitted parameters on the source
        type whose cross-type answer is surest, compute scaled by the predicted ratio at this batch; None where
        the pair was measured, the profile never was, or no source type shares MIN_CROSS_MODELS models with
        `gpu`. The profile is a model outside the cross-type history of (source, gpu) (it was never measured on
        `gpu`), so its ratio is centred on the roofline prior from its shape (predictor/roofline.py, fitted on the
        history's profiles that have FLOPs, both types in the vendored peak table) where there is one, else on the
        pooled centre. Uncertainty: the cross-type model's spread and the source pair's own, together."""
        if (profile.name, gpu) in self.perf_:
            return None
        best = None
        for (name, src), ps in self.perf_.items():
            if name != profile.name:
                continue
            fitted = self._cross_model(src, gpu)
            if fitted is None:
                continue
            model, n_models, roof = fitted
            t_src = _compute_s(ps, b)
            shape = profile_shape(profile)
            prior = roof.predict([shape], [b]) if roof is not None and shape is not None else None
            m, sd = model.predict(features(profile.n_params, profile.flops_per_sample, b, 1, t_src), return_std=True,
                                  prior=prior)
            std = math.sqrt(float(sd[0]) ** 2 + self._perf(profile, src)[2] ** 2)
            if best is None or std < best[2]:
                ratio = math.exp(float(m[0]))
                how = "; roofline" if prior is not None and np.isfinite(prior).all() else ""
                best = (ps._replace(c0=ps.c0 * ratio, c1=ps.c1 * ratio),
                        f"cross-type from {src} ({n_models} models on both{how})", std)
        return best

    def _cross_model(self, src: str, dst: str) -> tuple[CrossTypeModel, int, RooflinePrior | None] | None:
        """The cross-type model src -> dst, how many profiles it learnt from and the roofline prior fitted on
        them (None where fewer than MIN_CROSS_MODELS of them have FLOPs or a type is not in the peak table):
        fitted on the single-GPU compute time of every profile fitted on both types, at the batches it was
        measured at (cached per fit)."""
        cache = self.__dict__.setdefault("_cross_cache", {})
        key = (src, dst)
        if key not in cache:
            names = sorted({n for n, g in self.perf_ if g == src and (n, dst) in self.perf_})
            seen = self.__dict__.get("batches_", {})  # a model stored by older code has none: no cross-type answer
            names = [n for n in names if seen.get((n, src)) or seen.get((n, dst))]
            rows = []
            for n in names:
                batches = sorted(seen.get((n, src), set()) | seen.get((n, dst), set()))
                pick = np.unique(np.linspace(0, len(batches) - 1, min(CROSS_BATCHES, len(batches))).round())
                for b in (batches[int(i)] for i in pick):
                    t_s, t_d = _compute_s(self.perf_[(n, src)], b), _compute_s(self.perf_[(n, dst)], b)
                    p = self.profiles_[n]
                    rows.append((p.n_params, p.flops_per_sample, b, t_s, math.log(t_d / t_s), n))
            if len(names) < MIN_CROSS_MODELS:
                cache[key] = None
            else:
                n_params, flops, bs, t_src, y, who = zip(*rows)
                X = features(n_params, list(flops), bs, [1] * len(rows), t_src)
                cache[key] = (CrossTypeModel().fit(X, np.array(y)), len(names),
                              self._roofline(src, dst, bs, np.array(y), who))
        return cache[key]

    def _roofline(self, src: str, dst: str, batch, y: np.ndarray, who) -> RooflinePrior | None:
        """The roofline prior src -> dst fitted on the cross-type rows (each profile one vote); None where fewer
        than MIN_CROSS_MODELS of their profiles have a shape or a type has no vendored peaks."""
        shapes = [profile_shape(self.profiles_[n]) for n in who]
        if len({n for n, s in zip(who, shapes) if s is not None}) < MIN_CROSS_MODELS:
            return None
        try:
            return RooflinePrior(src, dst).fit(shapes, batch, y, list(who))
        except KeyError:  # a GPU type the peak table does not name
            return None

    def _net(self, layout, intra: str, inter: str | None) -> tuple[NetParams, float]:
        """Link scales, topology corrections, overlap offset and overhead of the candidate's links (0 = the link
        model as is)."""
        link_std = 0.0
        for link in (intra, inter):
            if link and link not in self.step_links_ and link not in self.links_.links_:
                link_std = max(link_std, self.links_.link_log_std(link))
        s_i = self.net_.get("intra", {}).get(intra, 0.0)
        s_e, w = self.net_.get("inter", {}).get(inter or "", (0.0, (0.0,) * N_PHI))
        key = sync_link_key(layout, intra, inter)  # a link no row ran on: DDP's per-tensor host work regardless
        dgamma, overhead, per_tensor = self.net_.get("sync", {}).get(
            key, (0.0, 0.0, HOST_PER_TENSOR_PRIOR_US * 1e-6 if key.startswith("intra:") else 0.0))
        return NetParams(s_i, s_e, w, self.net_.get("shape", {}).get(inter or ""), dgamma, overhead,
                         per_tensor), link_std

    def link_stats(self) -> list[dict]:
        """Per link: alpha_s, bandwidth_Bps (as steps see it), n collectives, n_steps, log_rmse (collective fit
        error; absent for a link seen only in steps)."""
        self._check_fitted()
        stats = {s["link"]: dict(s) for s in self.links_.link_stats()}
        for link, n_steps in self.step_links_.items():
            s = stats.setdefault(link, {"link": link, "n": 0})  # no collectives: no collective fit error
            a, bw, *_ = self.links_._params(link)
            scales = [v for k, v in self.net_.get("intra", {}).items() if k == link] + \
                     [v[0] for k, v in self.net_.get("inter", {}).items() if k == link]
            scale = math.exp(float(np.mean(scales))) if scales else 1.0
            s.update({"alpha_s": a * scale, "bandwidth_Bps": bw / scale, "n_steps": n_steps})
        return [stats[k] for k in sorted(stats)]

    def _check_fitted(self):
        if not hasattr(self, "perf_"):
            raise RuntimeError("Predictor is not fitted: call fit(profiles, observations) first")


def _compute_s(perf: PerfParams, b: float) -> float:
    """One GPU's compute seconds per step at per-GPU batch b."""
    return float(perf.c0 + perf.c1 * b**perf.e)


def step_key(profile: str, gpu: str, per_gpu_batch, layout, intra: str, inter: str | None) -> tuple:
    """What makes two step rows the same measurement: the layout as a shape (GPUs per node, sorted), and the
    inter link only where the layout spans nodes."""
    shape = tuple(sorted(int(k) for k in layout))
    return profile, gpu, float(per_gpu_batch), shape, intra, inter if len(shape) > 1 else None


def measured_steps(steps: list[dict], recent: int) -> dict[tuple, tuple[float, float, int]]:
    """Per (job_id, `step_key`) of rows that name their job: (median iter_s of the newest `recent` rows, their
    log spread, rows used)."""
    groups: dict[tuple, list[float]] = {}
    for o in steps:  # oldest first: the newest rows of a key end the list
        if o.get("job_id") is None:
            continue
        groups.setdefault((int(o["job_id"]), *step_key(o["profile"], o["gpu"], o["per_gpu_batch"], o["layout"],
                                                       o["intra_link"], o.get("inter_link"))),
                          []).append(float(o["iter_s"]))
    out = {}
    for key, xs in groups.items():
        xs = xs[-recent:]
        logs = np.log(xs)
        out[key] = (float(np.median(xs)), float(np.std(logs)) if len(xs) > 1 else 0.0, len(xs))
    return out


def _check_candidate(c, i: int) -> dict:
    if not isinstance(c, dict):
        raise ValidationError(f"candidates[{i}]", "must be an object {layout, intra_link, inter_link}")
    lay = c.get("layout")
    if not isinstance(lay, list) or not lay or len(lay) > 4096 or any(
            isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= 1024 for k in lay):
        raise ValidationError(f"candidates[{i}].layout",
                              f"must be a non-empty list of GPUs per node (1..1024), got {lay!r}")
    intra = c.get("intra_link")
    if not isinstance(intra, str) or not intra:
        raise ValidationError(f"candidates[{i}].intra_link", "must be a link name")
    inter = c.get("inter_link")
    if len(lay) > 1 and (not isinstance(inter, str) or not inter):
        raise ValidationError(f"candidates[{i}].inter_link", "required for a layout on several nodes")
    return {"layout": lay, "intra_link": intra, "inter_link": inter if len(lay) > 1 else None}
