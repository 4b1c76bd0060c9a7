"""GET /healthz: liveness plus the model and store state, and GET /v1/openapi.json."""
from __future__ import annotations

import json
import pathlib
from datetime import timedelta

from flask import Blueprint, Response

from predictor.api import services

bp = Blueprint("health", __name__)
_OPENAPI = pathlib.Path(__file__).resolve().parents[1] / "openapi.json"


@bp.get("/healthz")
def healthz():
    """200 `ok`, or 503 `degraded` with `store_error` when the database cannot be written (read-only, disk full):
    the service still reads, but every write (observations, profiles, /v1/plan's decision) would fail."""
    svc = services()
    svc.models.load_newest()  # every worker reports the service's newest model, not only what it has loaded
    problem = svc.store.write_problem(max_age=WRITE_PROBE_MAX_AGE)
    body = {"status": "ok" if problem is None else "degraded", "writable": problem is None,
            "schema": svc.store.migrations(), "generation": svc.store.generation(),
            "observations": svc.store.observation_counts(), **svc.models.status()}
    if problem is not None:
        body["store_error"] = problem
        return body, 503
    return body


WRITE_PROBE_MAX_AGE = timedelta(seconds=5)  # /healthz writes one row at most this often per worker


@bp.get("/v1/openapi.json")
def openapi():
    return Response(_OPENAPI.read_text(encoding="utf-8"), mimetype="application/json")


def openapi_document() -> dict:
    return json.loads(_OPENAPI.read_text(encoding="utf-8"))
