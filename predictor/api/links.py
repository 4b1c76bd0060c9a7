"""GET /v1/links: per-link statistics of the fitted communication model."""
from __future__ import annotations

import math

from flask import Blueprint

from predictor.api import services

bp = Blueprint("links", __name__, url_prefix="/v1/links")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


@bp.get("")
def index():
    svc = services()
    return {"model_version": svc.models.version, "links": _clean(svc.store.link_fits())}
