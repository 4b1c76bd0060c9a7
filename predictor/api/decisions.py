"""GET /v1/decisions (newest first, paged by `before`) and GET /v1/decisions/<id>."""
from __future__ import annotations

from flask import Blueprint, request

from predictor.api import services
from predictor.errors import ValidationError

bp = Blueprint("decisions", __name__, url_prefix="/v1/decisions")


def _int_arg(name: str, default: int | None, low: int, high: int) -> int | None:
    raw = request.args.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ValidationError(name, f"expected an integer in {low}..{high}, got {raw!r}")
    return int(raw)


@bp.get("")
def index():
    limit = _int_arg("limit", 50, 1, 1000)
    before = _int_arg("before", None, 1, 2**62)
    return {"decisions": services().store.list_decisions(limit=limit, before=before)}


@bp.get("/<decision_id>")
def show(decision_id: str):
    return services().store.get_decision(decision_id)
