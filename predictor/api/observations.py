"""POST /v1/observations: collective and step records, validated whole, stored all-or-nothing."""
from __future__ import annotations

from flask import Blueprint

from predictor.api import json_body, services, write_access
from predictor.records import validate_batch

bp = Blueprint("observations", __name__, url_prefix="/v1/observations")


@bp.post("")
@write_access
def create():
    svc = services()
    records = validate_batch(json_body())
    ids = svc.store.add_observations(records)
    svc.models.notify()
    return {"stored": len(ids), "first_id": ids[0], "last_id": ids[-1]}, 201


@bp.get("")
def counts():
    return {"counts": services().store.observation_counts(), "generation": services().store.generation()}
