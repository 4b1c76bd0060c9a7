"""POST /v1/predict (throughput of candidate layouts) and POST /v1/plan (the hook's and launcher's question).

Both answer from one model pinned for the request and name it (`model_version` `g<N>`, `model_generation` N).
Read-your-writes: `min_model_version=N` (a query parameter on both; a body field too on /v1/predict) answers
only from a model fitted on generation N or later, waiting for it up to `wait_ms` (default 10,000, at most
predictor.service.MAX_VERSION_WAIT, 20,000); otherwise 503 with Retry-After naming both versions.
"""
from __future__ import annotations

import dataclasses
import math
import re
from datetime import timedelta
from typing import Any

from flask import Blueprint, Response, request

from predictor import planner
from predictor.api import HOOK_HEADER, authenticator, decision_owner, identified, json_body, metrics, services
from predictor.api.profiles import own_name, readable_by
from predictor.errors import NotFoundError, TooLarge, ValidationError
from predictor.profiles import Profile
from predictor.restart_price import HISTORY_ROWS
from slurm_plugin.contracts.records import LINK_RE, NAME_RE, validate_layout
from predictor.service import DEFAULT_VERSION_WAIT, MAX_VERSION_WAIT, ModelView
from predictor.store import encode

bp = Blueprint("predict", __name__, url_prefix="/v1")
MAX_REQUEST_LAYOUT_NODES = 65536   # sum of len(layout) over one request's candidates: the work one request may ask
PREDICT_FIELDS = ("profile", "gpu", "per_gpu_batch", "candidates", "partition", "max_gpus", "min_model_version",
                  "wait_ms")
_VERSION_RE = re.compile(r"^g?([0-9]{1,18})$")
_MAX_WAIT_MS = round(MAX_VERSION_WAIT.total_seconds() * 1000)


def _name(body: dict, key: str, pattern) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not pattern.match(value):
        raise ValidationError(key, f"expected a name matching {pattern.pattern}, got {value!r}")
    return value


def _candidates(value: Any, cap: int) -> list[dict]:
    if not isinstance(value, list) or not value or len(value) > cap:
        raise ValidationError("candidates", f"expected a list of 1..{cap} candidates")
    nodes = 0
    for cand in value:            # the work bound first, before validating what would be refused anyway
        layout = cand.get("layout") if isinstance(cand, dict) else None
        nodes += len(layout) if isinstance(layout, list) else 0
    if nodes > MAX_REQUEST_LAYOUT_NODES:
        raise TooLarge("candidates", f"{nodes} nodes in the candidates' layouts together; at most "
                                     f"{MAX_REQUEST_LAYOUT_NODES} per request: send fewer or smaller candidates")
    out = []
    for index, cand in enumerate(value):
        where = f"candidates[{index}]"
        if not isinstance(cand, dict):
            raise ValidationError(where, "expected an object {layout, intra_link, inter_link}")
        for key in cand:
            if key not in ("layout", "intra_link", "inter_link"):
                raise ValidationError(f"{where}.{key}", "unknown field (known: layout, intra_link, inter_link)")
        item = {"layout": validate_layout(cand.get("layout"), f"{where}.layout")}
        for key in ("intra_link", "inter_link"):
            if key in cand:
                if not isinstance(cand[key], str) or not LINK_RE.match(cand[key]):
                    raise ValidationError(f"{where}.{key}", f"expected a link name matching {LINK_RE.pattern}")
                item[key] = cand[key]
        if "intra_link" not in item:
            raise ValidationError(f"{where}.intra_link", "required field is missing")
        if len(item["layout"]) > 1 and "inter_link" not in item:
            raise ValidationError(f"{where}.inter_link", "required when the layout spans several nodes")
        out.append(item)
    return out


def _min_model_version(raw: Any) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 10**18:
        return raw
    match = _VERSION_RE.match(raw) if isinstance(raw, str) else None
    if match is None:
        raise ValidationError("min_model_version", "expected a model version: an integer >= 0 (as "
                                                   "`model_version_pending` says) or 'g<integer>' (as `model_version` "
                                                   f"says), got {raw!r}")
    return int(match.group(1))


def _wait_ms(raw: Any, in_query: bool) -> timedelta:
    if in_query and isinstance(raw, str) and re.fullmatch(r"[0-9]+", raw):
        raw = int(raw) if len(raw) <= 9 else _MAX_WAIT_MS
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise ValidationError("wait_ms", f"expected an integer number of milliseconds >= 0 (at most {_MAX_WAIT_MS} "
                                         f"are waited), got {raw!r}")
    return timedelta(milliseconds=min(raw, _MAX_WAIT_MS))


def version_wait(body: dict | None) -> tuple[int | None, timedelta]:
    """The request's `min_model_version` and `wait_ms`: query parameters, or fields of `body` when given.

    Raises:
        ValidationError: a malformed value, one given twice, or `wait_ms` without `min_model_version`.
    """
    raw = {}
    for key in ("min_model_version", "wait_ms"):
        in_body = body is not None and key in body
        if key in request.args:
            if in_body:
                raise ValidationError(key, "given both as a query parameter and in the body; give it once")
            raw[key] = request.args[key]
        elif in_body:
            raw[key] = body[key]
    if "min_model_version" not in raw:
        if "wait_ms" in raw:
            raise ValidationError("wait_ms", "only means something with min_model_version")
        return None, DEFAULT_VERSION_WAIT
    wait = _wait_ms(raw["wait_ms"], "wait_ms" in request.args) if "wait_ms" in raw else DEFAULT_VERSION_WAIT
    return _min_model_version(raw["min_model_version"]), wait


def lookup_profile(svc, name: str, models: ModelView | None = None, reader: tuple[int | None, bool] | None = None
                   ) -> Profile:
    """The profile the model was fitted with, else the stored one (registered since the last fit).

    Args:
        reader: ``(uid, trusted)`` of who asks (`_reader`): a profile a user's job registered is found only for
            that user (predictor.api.profiles.readable_by); None: anyone's.

    Raises:
        NotFoundError: unknown profile, or another user's (404 with a hint).
    """
    if reader is not None:
        own = own_name(svc.store, name, reader[0])
        if own == name:
            _check_readable(svc, name, reader)
        name = own
    profile = (models or svc.models).profile(name)
    return profile if profile is not None else Profile.from_dict(svc.store.get_profile(name))


def _check_readable(svc, name: str, reader: tuple[int | None, bool]) -> bool:
    """Whether ``name`` is a user's profile that ``reader`` may use (True), the site's or unknown (False).

    Raises:
        NotFoundError: another user's profile (#24.6: it never decides this reader's plans or predictions).
    """
    exists, owner = svc.store.profile_owner(name)
    if not exists or owner is None:
        return False
    if not readable_by(owner, *reader):
        raise NotFoundError("profile", name, f"profile {name!r} was registered by a job of uid {owner}: only that "
                                             "user's jobs (and the tool and admin tokens) use it; register your own "
                                             "under another name, or ask an admin to register it for the site")
    return True


def _reader(uid: int | None = None) -> tuple[int | None, bool]:
    """``(uid, trusted)`` of the current request: a job credential's uid, else ``uid`` (what a plan request names);
    trusted when it holds a token or the service takes no credentials."""
    who = identified()
    if who.kind == "job":
        uid = who.uid
    return uid, who.kind in ("tool", "admin") or authenticator().writes_open


class _OwnedProfiles:
    """A `ModelView` for one plan whose `profile(name)` gives a user's profile only to that user (the planner's
    unknown-model answer for anyone else); `user_owned` tells whether the plan came from a user's profile (a
    decision for that uid only: the hook keeps one under a cache key holding the uid it sent)."""

    def __init__(self, svc, models: ModelView, uid: int | None):
        self._svc, self._models, self._uid = svc, models, uid
        self.user_owned = False

    def __getattr__(self, name):
        return getattr(self._models, name)

    def profile(self, name: str):
        reader = _reader(self._uid)
        own = own_name(self._svc.store, name, reader[0])
        try:
            if own != name or _check_readable(self._svc, name, reader):
                self.user_owned = True
        except NotFoundError:
            return None
        return self._models.profile(own)


def enumerate_candidates(cluster, gpu: str, partition: str | None, max_gpus: int | None) -> list[dict]:
    """Every uniform layout of the partition (1 GPU up to all of them, or `max_gpus`).

    Raises:
        NotFoundError: the partition is unknown or no partition has that GPU type.
        TooLarge: the layouts hold more than MAX_REQUEST_LAYOUT_NODES nodes together (field `max_gpus`).
    """
    if partition is not None:
        part = cluster.partition(partition)
    else:
        parts = cluster.partitions_with_gpu(gpu)
        if not parts:
            raise NotFoundError("GPU type", gpu, "the cluster model has "
                                + ", ".join(sorted({p.gpu for p in cluster.partitions})) + "; or pass candidates")
        part = parts[0]
    top = min(part.total_gpus, max_gpus or part.total_gpus)
    out, nodes = [], 0
    for gpus in range(1, top + 1):
        for layout in part.layouts(gpus):
            nodes += len(layout)
            if nodes > MAX_REQUEST_LAYOUT_NODES:
                raise TooLarge("max_gpus", f"the layouts of 1..{top} GPUs on partition {part.name} hold more than "
                                           f"{MAX_REQUEST_LAYOUT_NODES} nodes together; pass a smaller max_gpus")
            out.append(part.candidate(layout))
    return out


def _clean(prediction: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in prediction.items()}


@bp.post("/predict")
def predict():
    svc = services()
    body = json_body()
    if not isinstance(body, dict):
        raise ValidationError("body", "expected a JSON object")
    for key in body:
        if key not in PREDICT_FIELDS:
            raise ValidationError(key, f"unknown field (known: {', '.join(sorted(PREDICT_FIELDS))})")
    name = _name(body, "profile", NAME_RE)
    gpu = _name(body, "gpu", LINK_RE)
    batch = body.get("per_gpu_batch")
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 65536:
        raise ValidationError("per_gpu_batch", f"expected an integer in 1..65536, got {batch!r}")
    partition = body.get("partition")
    if partition is not None and (not isinstance(partition, str) or not LINK_RE.match(partition)):
        raise ValidationError("partition", f"expected a partition name matching {LINK_RE.pattern}")
    max_gpus = body.get("max_gpus")
    if max_gpus is not None and (isinstance(max_gpus, bool) or not isinstance(max_gpus, int)
                                 or not 1 <= max_gpus <= 65536):
        raise ValidationError("max_gpus", "expected an integer in 1..65536")
    if "candidates" in body:
        candidates = _candidates(body["candidates"], svc.config.max_plan_candidates)
    else:
        candidates = enumerate_candidates(svc.cluster, gpu, partition, max_gpus)
    min_version, wait = version_wait(body)
    models = svc.models.view(min_version, wait)
    profile = lookup_profile(svc, name, models, _reader())
    predictions = models.predict(profile, gpu, batch, candidates)
    return {"profile": name, "gpu": gpu, "per_gpu_batch": batch, "model_version": models.version,
            "model_generation": models.generation, "known": models.known(name, gpu),
            "predictions": [_clean(p) for p in predictions]}


def _is_job(who, job_id: int) -> bool:
    """Whether ``who`` may see job ``job_id``'s own step times in a plan: the job itself (its munge credential), the
    admin token, or anyone on a service that takes no credentials at all. A tool token does not: every job's
    launcher may carry it (#24.12)."""
    return (who.kind == "job" and who.job_id == job_id) or who.kind == "admin" or authenticator().writes_open


def _proven_user(job_uid) -> int | None:
    """The uid whose own step measurements may answer a plan (#41.1): a job credential's own user, the uid a
    request names with the admin token (or on a service that takes no credentials) or from the hook on a
    `--hook-from` host (slurmctld vouches for the job's uid), else None: an anonymous caller, or the tool token
    that every job's launcher may carry (as for a job's own rows, #24.12), naming a uid gets the model's answer."""
    who = identified()
    if who.kind == "job":
        return who.uid
    named = job_uid if isinstance(job_uid, int) and not isinstance(job_uid, bool) else None
    if who.kind == "admin" or authenticator().writes_open or request.headers.get(HOOK_HEADER) == "1":
        return named
    return None


CLAIMED_HEADER = "X-Elastic-Claimed"  # the hook's decision ids that jobs hold, space-separated (docs/hook.md)


@bp.post("/plan")
def plan():
    svc = services()
    body = json_body()
    metrics.note_plan(body)
    plan_request = planner.parse_request(body)
    asking = plan_request.job.get("job_id")
    if plan_request.current is not None and asking is not None and _is_job(identified(), asking):
        plan_request = dataclasses.replace(plan_request, own_job=asking)
    plan_request = dataclasses.replace(plan_request, own_user=_proven_user(plan_request.job.get("uid")))
    models = svc.models.view(*version_wait(None))
    scoped = _OwnedProfiles(svc, models, plan_request.job.get("uid"))
    response = planner.plan(plan_request, svc.cluster, scoped, svc.config.default_min_efficiency,
                            svc.config.max_plan_candidates, svc.config.db_path,
                            lambda: svc.store.observations(kind="restart", limit=HISTORY_ROWS, newest=True))
    response.setdefault("model_version", models.version)     # keeps name the model in use too
    response["model_generation"] = models.generation
    # The hook may reuse a decision made from a prediction for identical requests; a keep for lack of a
    # model, profile or history is not reused, since it changes as soon as the admin or a job supplies it.
    # One made from a user's own profile (#24.6) only for the uid it names: the hook's cache key holds that uid.
    ttl = svc.config.plan_cache_ttl.total_seconds() if response.get("predicted") is not None and (
        not scoped.user_owned or plan_request.job.get("uid") is not None) else 0
    response["cache_ttl_s"] = round(ttl, 3)
    owner = decision_owner(plan_request.job.get("uid"))
    claimed = request.headers.get(CLAIMED_HEADER, "").split()[:planner.MAX_REUSED_IDS]
    if claimed:  # the hook saw jobs holding these decisions (docs/hook.md: --test-only)
        svc.store.claim_decisions(claimed, owner)
    if plan_request.test_only:  # `sbatch --test-only` (#42.6): no job follows; no decision id, nothing kept or reused
        response.pop("bands", None)
        response.update(cache_ttl_s=0, test_only=True)
        return Response(encode(response) + "\n", mimetype="application/json")
    # job_submit cannot tell `sbatch --test-only` from a job (#42.6, Slurm 22.05: the same job_desc): its decision
    # is unclaimed until the hook sees a job holding it, and expires unclaimed (DecisionRetention.unclaimed_max_age)
    text = svc.store.add_decision_text(encode(plan_request.record()), response, plan_request.source,
                                       models.version, owner, unclaimed=plan_request.source == "job_submit")
    metrics.note_plan(action=response["action"])
    return Response(text + "\n", mimetype="application/json")    # stored and sent: the same bytes as jsonify
