"""HTTP API v1 blueprints (one module per resource) and the helpers they share.

Shared helpers: `services()` (the objects `create_app` built), `json_body()` (parses the request body or
raises a 400 naming `body`) and `write_access` (bearer-token check for writes).
"""
from __future__ import annotations

import dataclasses
import functools
import hmac
import json
from typing import Any

from flask import current_app, request

from predictor.cluster import Cluster
from predictor.config import Config
from predictor.errors import ValidationError
from predictor.service import ModelCache
from predictor.store import Store


@dataclasses.dataclass(frozen=True)
class Services:
    """What the blueprints use, built once per app by `create_app`."""

    config: Config
    store: Store
    models: ModelCache

    @property
    def cluster(self) -> Cluster:
        return self.config.cluster


class AuthError(Exception):
    """Missing (401) or wrong (403) bearer token on a write."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


def services() -> Services:
    return current_app.extensions["elastic_predictor"]


def json_body() -> Any:
    """The request's JSON document.

    Raises:
        ValidationError: the body is empty or not JSON (field `body`).
    """
    data = request.get_data(cache=True)
    if not data:
        raise ValidationError("body", "expected a JSON body")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValidationError("body", f"not valid JSON: {exc}") from None


def write_access(view):
    """Decorator: require `Authorization: Bearer <token>` when a token is configured."""

    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        token = services().config.token
        if token:
            header = request.headers.get("Authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not given:
                raise AuthError(401, "writes need `Authorization: Bearer <token>` (ELASTIC_PREDICTOR_TOKEN)")
            if not hmac.compare_digest(given.strip().encode(), token.encode()):
                raise AuthError(403, "bearer token rejected")
        return view(*args, **kwargs)

    return wrapper
