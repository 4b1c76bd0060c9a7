"""GET /healthz: liveness plus the model and store state, and GET /v1/openapi.json."""
from __future__ import annotations

import json
import pathlib

from flask import Blueprint, Response

from predictor.api import services

bp = Blueprint("health", __name__)
_OPENAPI = pathlib.Path(__file__).resolve().parents[1] / "openapi.json"


@bp.get("/healthz")
def healthz():
    svc = services()
    return {"status": "ok", "schema": svc.store.migrations(), "generation": svc.store.generation(),
            "observations": svc.store.observation_counts(), **svc.models.status()}


@bp.get("/v1/openapi.json")
def openapi():
    return Response(_OPENAPI.read_text(encoding="utf-8"), mimetype="application/json")


def openapi_document() -> dict:
    return json.loads(_OPENAPI.read_text(encoding="utf-8"))
