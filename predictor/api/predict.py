"""POST /v1/predict (throughput of candidate layouts) and POST /v1/plan (the hook's and launcher's question)."""
from __future__ import annotations

import math
from typing import Any

from flask import Blueprint, Response, request

from predictor import planner
from predictor.api import json_body, metrics, services
from predictor.errors import NotFoundError, ValidationError
from predictor.profiles import Profile
from predictor.records import LINK_RE, NAME_RE, validate_layout
from predictor.store import encode

bp = Blueprint("predict", __name__, url_prefix="/v1")
MAX_CANDIDATES = 512


def _name(body: dict, key: str, pattern) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not pattern.match(value):
        raise ValidationError(key, f"expected a name matching {pattern.pattern}, got {value!r}")
    return value


def _candidates(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value or len(value) > MAX_CANDIDATES:
        raise ValidationError("candidates", f"expected a list of 1..{MAX_CANDIDATES} candidates")
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


def lookup_profile(svc, name: str) -> Profile:
    """The profile the model was fitted with, else the stored one (registered since the last fit).

    Raises:
        NotFoundError: unknown profile (404 with a hint).
    """
    profile = svc.models.profile(name)
    return profile if profile is not None else Profile.from_dict(svc.store.get_profile(name))


def enumerate_candidates(cluster, gpu: str, partition: str | None, max_gpus: int | None) -> list[dict]:
    """Every uniform layout of the partition (1 GPU up to all of them, or `max_gpus`).

    Raises:
        NotFoundError: the partition is unknown or no partition has that GPU type.
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
    return [part.candidate(layout) for gpus in range(1, top + 1) for layout in part.layouts(gpus)]


def _clean(prediction: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in prediction.items()}


@bp.post("/predict")
def predict():
    svc = services()
    body = json_body()
    if not isinstance(body, dict):
        raise ValidationError("body", "expected a JSON object")
    for key in body:
        if key not in ("profile", "gpu", "per_gpu_batch", "candidates", "partition", "max_gpus"):
            raise ValidationError(key, "unknown field (known: candidates, gpu, max_gpus, partition, per_gpu_batch, profile)")
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
        candidates = _candidates(body["candidates"])
    else:
        candidates = enumerate_candidates(svc.cluster, gpu, partition, max_gpus)
    profile = lookup_profile(svc, name)
    predictions = svc.models.predict(profile, gpu, batch, candidates)
    return {"profile": name, "gpu": gpu, "per_gpu_batch": batch, "model_version": svc.models.version,
            "known": svc.models.known(name, gpu), "predictions": [_clean(p) for p in predictions]}


@bp.post("/plan")
def plan():
    svc = services()
    body = json_body()
    metrics.note_plan(body)
    plan_request = planner.parse_request(body)
    response = planner.plan(plan_request, svc.cluster, svc.models, svc.config.default_min_efficiency,
                            svc.config.max_plan_candidates)
    # The hook may reuse a decision made from a prediction for identical requests; a keep for lack of a
    # model, profile or history is not reused, since it changes as soon as the admin or a job supplies it.
    ttl = svc.config.plan_cache_ttl.total_seconds() if response.get("predicted") is not None else 0
    response["cache_ttl_s"] = round(ttl, 3)
    text = svc.store.add_decision_text(_request_text(plan_request.raw), response, plan_request.source,
                                       svc.models.version)
    metrics.note_plan(action=response["action"])
    return Response(text + "\n", mimetype="application/json")    # stored and sent: the same bytes as jsonify


def _request_text(raw: dict) -> str:
    """The request as stored: the body's own UTF-8 text (it parsed to `raw`), else `raw` encoded again."""
    try:
        text = request.get_data(cache=True).decode("utf-8")
    except UnicodeDecodeError:                  # UTF-16/32 or lone surrogates: json.loads took it, store canonical
        return encode(raw)
    return encode(raw) if text.startswith("\ufeff") else text
