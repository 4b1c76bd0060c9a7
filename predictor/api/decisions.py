"""GET /v1/decisions (newest first, paged by `before`) and GET /v1/decisions/<id>."""
from __future__ import annotations

from flask import Blueprint, request

from predictor.api import int_arg, services
from predictor.errors import ValidationError

bp = Blueprint("decisions", __name__, url_prefix="/v1/decisions")


@bp.get("")
def index():
    limit = int_arg("limit", 50, 1, 1000)
    before = int_arg("before", None, 1, 2**62)
    return {"decisions": services().store.list_decisions(limit=limit, before=before)}


@bp.get("/<decision_id>")
def show(decision_id: str):
    return services().store.get_decision(decision_id)
