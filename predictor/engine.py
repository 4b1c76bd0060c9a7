"""The prediction engine the service uses: fit on history (profiles + observations), predict candidate layouts.

`Predictor.fit` reads the cluster's collective sweeps (`kind="collective"`), the 1-GPU ladders and the
multi-GPU steps (`kind="step"`) and the calibration job's probes (`kind="ddp_overhead"`) into the parameters of
the DDP step model (predictor/stepmodel.py, which holds every equation); `predict` answers one (profile, GPU,
batch) for a list of candidate layouts. Records have the shapes of docs/design.md. Callers may assume:
predictions come back in candidate order; a profile or link never observed still gets an answer, marked by
`basis` and a wider `interval`; a fitted Predictor is a JSON document (`to_params` / `load_params`), never a
pickle.
"""
from __future__ import annotations

import math

import numpy as np

from predictor import stepmodel
from predictor.crosstype import CrossTypeModel, features
from predictor.errors import ValidationError
from predictor.profiles import Profile
from predictor.roofline import RooflinePrior, profile_shape
from predictor.stepmodel import Ladder, Params
from slurm_plugin.contracts.records import is_mixed

MIN_CROSS_MODELS = 2  # models measured on both types before a cross-type answer is given
CROSS_BATCHES = 8  # batch sizes per model a cross-type fit takes (spread over those it was measured at)
Z80 = 1.2816  # the normal's 90th percentile: an 80% interval is +-Z80 standard deviations
FORMAT = "elastic-predictor/params-1"  # the JSON document's format (`to_params`)


class Predictor:
    """Throughput of data-parallel training per candidate layout, from the cluster's own measurements.

    Args:
        recent_rows: for a job asking about itself (`predict(job_id=)`), a candidate that job measured (same
            profile, GPU, per-GPU batch, layout shape and links) is predicted at the median of its newest
            this-many step rows (`basis: measured`); for a user (`predict(uid=)`), one that any of the user's jobs
            measured, at the median of the user's newest rows (#41.1: a user's own signed measurements dominate
            that user's own predictions). The model generalises to what was not run, the asker's own measurement
            wins where there is one, and newer evidence over older (rows in stored order).
    """

    def __init__(self, *, recent_rows: int = 5):
        self.recent_rows = recent_rows

    # ------------------------------------------------------------------ fit
    def fit(self, profiles: dict[str, Profile], observations: list[dict]) -> "Predictor":
        """Fit on validated observation dicts. Step rows of profiles not in `profiles` are skipped (`skipped_`).

        Raises:
            ValidationError: a record lacks a field the fit needs (named as `observations[i].field`).
        """
        steps, probes, coll, self.skipped_ = [], [], [], 0
        for i, o in enumerate(observations):
            kind = o.get("kind")
            if kind == "collective":
                coll.append(o)
            elif kind == "ddp_overhead":
                probes.append(o)
            elif kind == "step":
                for f in ("profile", "gpu", "layout", "intra_link", "per_gpu_batch", "iter_s"):
                    if o.get(f) in (None, "", []):
                        raise ValidationError(f"observations[{i}].{f}", "required for a step record")
                if o["profile"] not in profiles or is_mixed(o):  # a mixed step is no one type's (kept, not fit)
                    self.skipped_ += 1
                    continue
                steps.append(o)
        collectives = stepmodel.Collectives.from_rows(coll)
        ladders = stepmodel.ladders_from(steps)
        multi = [o for o in steps if sum(o["layout"]) > 1]
        self.params_ = stepmodel.fit_params(profiles, collectives, ladders, multi,
                                            stepmodel.host_cost_from_probes(probes))
        self.step_links_ = {}
        for o in steps:
            for key in (o["intra_link"], o.get("inter_link")):
                if key and sum(o["layout"]) > 1:
                    self.step_links_[key] = self.step_links_.get(key, 0) + 1
        self.n_rows_ = {}
        for o in steps:
            key = (o["profile"], o["gpu"])
            self.n_rows_[key] = self.n_rows_.get(key, 0) + 1
        self.log_rmse_ = dict(self.params_.pair_rmse)
        self.converged_ = self.params_.converged
        self.calibration_ = _calibrate(self.params_.ladders, profiles)
        self.measured_ = measured_steps(steps, self.recent_rows)
        self.measured_users_ = measured_steps(steps, self.recent_rows, "uid")
        self.n_steps_ = len(steps)
        self._cross_cache = {}
        self.profiles_ = {k: v for k, v in profiles.items() if any(k == p for p, _ in self.params_.ladders)}
        return self

    # ------------------------------------------------------------------ the JSON document
    def to_params(self) -> dict:
        """The fitted model as a JSON-ready document: the step model's parameters (ladders, collective curves,
        host and link constants with their basis, held-out residuals) and what predictions read besides."""
        self._check_fitted()
        return {"format": FORMAT, "model": self.params_.to_dict(), "recent_rows": self.recent_rows,
                "calibration": self.calibration_,
                "n_rows": [[p, g, n] for (p, g), n in self.n_rows_.items()], "step_links": self.step_links_,
                "measured": [[list(k), list(v)] for k, v in self.measured_.items()],
                "measured_users": [[list(k), list(v)] for k, v in self.measured_users_.items()],
                "n_steps": self.n_steps_,
                "skipped": self.skipped_, "profiles": sorted(self.profiles_)}

    def load_params(self, doc: dict, profiles: dict[str, Profile]) -> "Predictor":
        """This Predictor as `to_params` wrote it, with the profiles it was fitted with (stored beside it).

        Raises:
            ValidationError: not a document of this format.
        """
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValidationError("model.format", f"expected {FORMAT!r}, got {doc.get('format') if isinstance(doc, dict) else doc!r}")
        self.params_ = Params.from_dict(doc["model"])
        self.recent_rows = int(doc.get("recent_rows", self.recent_rows))
        self.calibration_ = dict(doc.get("calibration", {}))
        self.log_rmse_ = dict(self.params_.pair_rmse)
        self.converged_ = self.params_.converged
        self.n_rows_ = {(p, g): int(n) for p, g, n in doc.get("n_rows", [])}
        self.step_links_ = dict(doc.get("step_links", {}))
        self.measured_ = {tuple(_key(k)): tuple(v) for k, v in doc.get("measured", [])}
        self.measured_users_ = {tuple(_key(k)): tuple(v) for k, v in doc.get("measured_users", [])}
        self.n_steps_ = int(doc.get("n_steps", 0))
        self.skipped_ = int(doc.get("skipped", 0))
        self.profiles_ = {n: profiles[n] for n in doc.get("profiles", []) if n in profiles}
        self._cross_cache = {}
        return self

    # ------------------------------------------------------------------ predict
    def known(self, profile_name: str, gpu: str) -> bool:
        """Whether step history exists for this (profile, GPU type) pair."""
        self._check_fitted()
        return (profile_name, gpu) in self.params_.ladders

    def _each_layout(self, ladder, profile, gpu: str, b: float, cands: list[dict]) -> list[dict]:
        """The step model's answer for each candidate, one vectorised call per (intra, inter) link pair (the model is
        vectorised over layouts: a call per candidate cost a 16-candidate /v1/plan most of its time)."""
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(cands):
            groups.setdefault((c["intra_link"], c["inter_link"]), []).append(i)
        out: list[dict] = [{} for _ in cands]
        for (intra, inter), idx in groups.items():
            r = stepmodel.predict_layouts(self.params_, ladder, profile, gpu, b, [cands[i]["layout"] for i in idx],
                                          intra, inter)
            for k, i in enumerate(idx):
                out[i] = {key: value[k] for key, value in r.items()}
        return out

    def predict(self, profile: Profile, gpu: str, per_gpu_batch: int, candidates: list[dict],
                job_id: int | None = None, uid: int | None = None) -> list[dict]:
        """Predicted step time and throughput of each candidate layout, in order, each with an 80% `interval`
        of samples/s (low, high) and the basis of the constants it used.

        For `job_id` (a running job asking about itself), a layout that job measured is answered with its own
        measurement (`recent_rows`), else for `uid` (the user asking, as the service proved it) a layout that
        user's jobs measured with the user's; for anyone else every layout is the model's, fitted on all users,
        so one user's rows never stand in for everybody's answer.

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
        b = float(per_gpu_batch)
        ladder, basis, extra_std = self._cross_type(profile, gpu, b) or self._ladder(profile, gpu)
        host = self.params_.host(gpu)
        measured = self.__dict__.get("measured_", {})
        by_users = self.__dict__.get("measured_users_", {})
        out = []
        for c, r in zip(cands, self._each_layout(ladder, profile, gpu, b, cands)):
            multi = sum(c["layout"]) > 1
            link = self.params_.link(stepmodel.sync_link(c["layout"], c["intra_link"], c["inter_link"]))
            # the interval: the basis's held-out spread, widened by what the compute estimate adds
            which = ("cross-type" if basis.startswith("cross-type") else basis) if basis != "observed" else (
                "calibrated" if multi and host.basis == "calibrated" else "observed" if multi else "measured")
            gate = str(r["gate"]) if multi else None
            lo, hi = self.params_.interval(which, gate)
            std = math.sqrt((math.log(hi / lo) / (2 * Z80)) ** 2 + extra_std ** 2)
            sps = float(r["samples_per_s"])
            pred = {"layout": list(c["layout"]), "samples_per_s": sps, "iter_s": float(r["iter_s"]),
                    "compute_s": float(r["compute_s"]), "comm_s": float(r["comm_s"]), "uncertainty": std,
                    "interval": [sps * math.exp(-Z80 * std) if extra_std else sps / hi,
                                 sps * math.exp(Z80 * std) if extra_std else sps / lo],
                    "basis": basis,
                    "constants": {"host": host.basis if multi else "none", "link": link.basis if multi else "none"}}
            key = step_key(profile.name, gpu, per_gpu_batch, c["layout"], c["intra_link"], c["inter_link"])
            seen, whose = None if job_id is None else measured.get((int(job_id), *key)), ""
            if seen is None and uid is not None:
                seen, whose = by_users.get((int(uid), *key)), " of this user"
            if seen is not None:  # measured: its newest rows' median, the model's split of it scaled alike
                iter_s, spread, n = seen
                scale = iter_s / pred["iter_s"]
                sps = sum(c["layout"]) * per_gpu_batch / iter_s
                u = max(spread, std / math.sqrt(n), stepmodel.PRIOR_SPREAD["measured"])
                pred.update(iter_s=iter_s, samples_per_s=sps, compute_s=pred["compute_s"] * scale,
                            comm_s=pred["comm_s"] * scale, uncertainty=u,
                            interval=[sps * math.exp(-Z80 * u), sps * math.exp(Z80 * u)],
                            basis=f"measured ({n} rows{whose})")
            out.append(pred)
        return out

    def _ladder(self, profile: Profile, gpu: str) -> tuple[Ladder, str, float]:
        """(ladder, basis, extra log std): the measured one, else the FLOPs estimate calibrated on this GPU."""
        lad = self.params_.ladders.get((profile.name, gpu))
        if lad is not None:    # measured on one GPU, or inferred from the pair's multi-GPU steps
            return lad, "observed" if lad.basis == "measured" else lad.basis, 0.0
        has_estimate = profile.compute_s_per_sample is not None or profile.flops_per_sample is not None
        basis = "profile" if has_estimate else "prior"
        return stepmodel.flops_ladder(profile, gpu, self.calibration_.get(gpu)), basis, 0.0

    # ------------------------------------------------------------------ cross-type (predictor/crosstype.py)
    def _cross_type(self, profile: Profile, gpu: str, b: float) -> tuple[Ladder, str, float] | None:
        """For a profile never measured on `gpu` but measured on other types: its ladder on the source type whose
        cross-type answer is surest, scaled by the predicted ratio at this batch; None where the pair was measured,
        the profile never was, or no source type shares MIN_CROSS_MODELS models with `gpu`. The ratio is centred on
        the roofline prior from the profile's shape (predictor/roofline.py) where there is one, else on the pooled
        centre. The extra log std is the cross-type model's spread."""
        if (profile.name, gpu) in self.params_.ladders:
            return None
        best = None
        for (name, src), lad in self.params_.ladders.items():
            if name != profile.name:
                continue
            fitted = self._cross_model(src, gpu)
            if fitted is None:
                continue
            model, n_models, roof = fitted
            t_src = float(lad.at(b)[0])
            shape = profile_shape(profile)
            prior = roof.predict([shape], [b]) if roof is not None and shape is not None else None
            m, sd = model.predict(features(profile.n_params, profile.flops_per_sample, b, 1, t_src), return_std=True,
                                  prior=prior)
            std = float(sd[0])
            if best is None or std < best[2]:
                how = "; roofline" if prior is not None and np.isfinite(prior).all() else ""
                best = (lad.scaled(math.exp(float(m[0]))), f"cross-type from {src} ({n_models} models on both{how})",
                        std)
        return best

    def _cross_model(self, src: str, dst: str) -> tuple[CrossTypeModel, int, RooflinePrior | None] | None:
        """The cross-type model src -> dst, how many profiles it learnt from and the roofline prior fitted on
        them (None where fewer than MIN_CROSS_MODELS of them have FLOPs or a type is not in the peak table):
        fitted on the 1-GPU steps of every profile measured on both types, at up to CROSS_BATCHES of the batches
        either was measured at (cached per fit)."""
        cache = self.__dict__.setdefault("_cross_cache", {})
        key = (src, dst)
        if key not in cache:
            lads = self.params_.ladders
            names = sorted({n for n, g in lads if g == src and (n, dst) in lads and n in self.profiles_})
            rows = []
            for n in names:
                batches = sorted(set(lads[(n, src)].batches) | set(lads[(n, dst)].batches))
                pick = np.unique(np.linspace(0, len(batches) - 1, min(CROSS_BATCHES, len(batches))).round())
                for b in (batches[int(i)] for i in pick):
                    t_s, t_d = float(lads[(n, src)].at(b)[0]), float(lads[(n, dst)].at(b)[0])
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

    def link_stats(self) -> list[dict]:
        """Per link: alpha_s and bandwidth_Bps (the ring's alpha-beta through its sweep), n (sweep points),
        log_rmse (the alpha-beta line against the sweep), n_steps, kappa and o (how its all-reduce overlaps a
        backward and what a step over it costs) with their basis, users (the owners its sweep's votes are)."""
        self._check_fitted()
        coll = self.params_.collectives
        out = {}
        for link in sorted(set(coll.links()) | set(self.step_links_) | set(self.params_.links)):
            a, bw = coll._ab.get(link) or stepmodel.link_prior(link)[:2]
            s = {"link": link, "alpha_s": a, "bandwidth_Bps": bw, "n": 0}
            pts = [(w, b, t) for (l, w), (bs, ts) in coll.curves.items() if l == link for b, t in zip(bs, ts)]
            if pts:
                w, b, t = (np.array(v, float) for v in zip(*pts))
                line = 2 * (w - 1) * a + 2 * (w - 1) / w * b / bw
                s.update(n=len(pts), log_rmse=float(np.sqrt(np.mean(np.log(t / line) ** 2))))
            lc = self.params_.link(link)
            s.update(n_steps=self.step_links_.get(link, 0), kappa=lc.kappa, o_s=lc.o, basis=lc.basis,
                     users=coll.users.get(link, 0))
            out[link] = s
        return [out[k] for k in sorted(out)]

    def _check_fitted(self):
        if not hasattr(self, "params_"):
            raise RuntimeError("Predictor is not fitted: call fit(profiles, observations) first")


def _key(k: list) -> tuple:
    """A `measured_` (`measured_users_`) key as JSON gave it back: the layout shape a tuple again."""
    job, profile, gpu, batch, shape, intra, inter = k
    return int(job), profile, gpu, float(batch), tuple(shape), intra, inter


def _calibrate(ladders: dict, profiles: dict) -> dict[str, float]:
    """Per GPU: geometric mean over its measured profiles of the measured 1-GPU step at the ladder's largest
    batch over the FLOPs estimate there, for profiles never measured on it."""
    ratios: dict[str, list[float]] = {}
    for (name, gpu), lad in ladders.items():
        if name not in profiles:
            continue
        b = lad.batches[-1]
        est = float(stepmodel.flops_ladder(profiles[name], gpu).at(b)[0])
        ratios.setdefault(gpu, []).append(math.log(lad.seconds[-1] / est))
    return {g: math.exp(float(np.mean(v))) for g, v in ratios.items()}


def step_key(profile: str, gpu: str, per_gpu_batch, layout, intra: str, inter: str | None) -> tuple:
    """What makes two step rows the same measurement: the layout as a shape (GPUs per node, sorted), and the
    inter link only where the layout spans nodes."""
    shape = tuple(sorted(int(k) for k in layout))
    return profile, gpu, float(per_gpu_batch), shape, intra, inter if len(shape) > 1 else None


def measured_steps(steps: list[dict], recent: int, by: str = "job_id") -> dict[tuple, tuple[float, float, int]]:
    """Per (job_id, `step_key`) of rows that name their job (`by="uid"`: per (uid, ...) of rows a user signed):
    (median iter_s of the newest `recent` rows, their log spread, rows used)."""
    groups: dict[tuple, list[float]] = {}
    for o in steps:  # oldest first: the newest rows of a key end the list
        if not isinstance(o.get(by), int) or isinstance(o.get(by), bool):   # a dataset's owner names: no one asks
            continue
        groups.setdefault((int(o[by]), *step_key(o["profile"], o["gpu"], o["per_gpu_batch"], o["layout"],
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
