"""The Flask application factory (also the WSGI entry point: `predictor.app:create_app()`).

`create_app(config=None)` builds the Store (migrating it; decisions pruned to the configured retention), the
ModelCache (loading the newest stored model, then starting its refit thread; only the worker holding the fit
lock fits: predictor.service), the PlotRenderer (the admin plots' drawing thread: predictor.plotcache; started
with the refit thread when `plot_prerender`, else by the first plot request) and registers
one blueprint per resource plus one JSON error handler (a model version not reached: 503 naming both
versions). With `config=None` it reads the environment once through `Config.from_env` (the WSGI-factory entry
point).
"""
from __future__ import annotations

import io
import logging
import os
import re
import sqlite3
from typing import Callable

from flask import Flask, current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from predictor.api import AuthError, Services
from predictor.api import decisions, health, links, metrics, observations, predict, profiles, web
from predictor.config import Config
from predictor.errors import Conflict, NotFoundError, TooLarge, ValidationError
from predictor.planner import DirectiveProblem
from predictor.plotcache import PlotRenderer
from predictor.service import ModelCache, ModelUnavailable, ModelVersionUnavailable, default_predictor_factory
from predictor.store import DecisionRetention, Store

log = logging.getLogger("predictor.app")
_STORE_FULL_OR_READONLY = re.compile(r"readonly|read-only|disk is full|disk I/O error", re.IGNORECASE)


def handle_error(exc: Exception):
    """The one error handler: every error leaves as JSON `{"error": ..., "field": ...}`."""
    if isinstance(exc, TooLarge):
        return jsonify(error=str(exc), field=exc.field), 413
    if isinstance(exc, ValidationError):
        return jsonify(error=str(exc), field=exc.field), 400
    if isinstance(exc, Conflict):
        return jsonify(error=str(exc), field=exc.field), 409
    if isinstance(exc, DirectiveProblem):
        return jsonify(error=exc.message, field=exc.field, line=exc.line), 422
    if isinstance(exc, NotFoundError):
        return jsonify(error=str(exc), field=None, what=exc.what, name=exc.name, hint=exc.hint), 404
    if isinstance(exc, AuthError):
        response = jsonify(error=str(exc), field="Authorization")
        if exc.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="elastic-predictor"'
        return response, exc.status
    if isinstance(exc, ModelVersionUnavailable):
        response = jsonify(error=exc.reason, field="min_model_version", min_model_version=exc.wanted,
                           model_version=None if exc.available is None else f"g{exc.available}",
                           model_generation=exc.available, store_generation=exc.store_generation,
                           waited_ms=round(exc.waited.total_seconds() * 1000))
        response.headers["Retry-After"] = "2"
        return response, 503
    if isinstance(exc, ModelUnavailable):
        response = jsonify(error=f"no fitted model: {exc}", field=None)
        response.headers["Retry-After"] = "2"
        return response, 503
    if isinstance(exc, sqlite3.OperationalError) and _STORE_FULL_OR_READONLY.search(str(exc)):
        response = jsonify(error=f"the history database cannot be written ({exc}); nothing was stored. "
                                 "An admin must free disk space or make the database writable (GET /healthz)",
                           field=None)
        response.headers["Retry-After"] = "30"
        return response, 503
    if isinstance(exc, HTTPException):
        field = "body" if exc.code == 413 else None
        return jsonify(error=f"{exc.name}: {exc.description}", field=field), exc.code
    log.exception("unhandled error")
    return jsonify(error=f"internal error: {type(exc).__name__}", field=None), 500


_TOO_LARGE = "elastic_predictor.body_too_large"


class WholeUnsizedBody:
    """WSGI middleware: a body sent without Content-Length (chunked; the server sets `wsgi.input_terminated`) is
    read here, up to `limit` bytes, and handed on with its length; a longer one is flagged, and the app answers
    413 naming `body` (`refuse_unsized_overflow`). Without it werkzeug cut such a body at MAX_CONTENT_LENGTH
    without a word, and the truncated JSON became a 400 (#14.7). nginx, `serve`'s front end, refuses it itself;
    this covers the app under any other WSGI server."""

    def __init__(self, wsgi_app: Callable, limit: int):
        self.wsgi_app = wsgi_app
        self.limit = limit

    def __call__(self, environ: dict, start_response: Callable):
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        if environ.get("CONTENT_LENGTH") in (None, "") and (chunked or environ.get("wsgi.input_terminated")):
            data, stream = bytearray(), environ["wsgi.input"]
            while len(data) <= self.limit:
                block = stream.read(min(65536, self.limit + 1 - len(data)))
                if not block:
                    break
                data += block
            environ = {k: v for k, v in environ.items() if k not in ("wsgi.input_terminated",
                                                                      "HTTP_TRANSFER_ENCODING")}
            if len(data) > self.limit:
                environ[_TOO_LARGE] = True
                data = bytearray()
            environ.update({"wsgi.input": io.BytesIO(bytes(data)), "CONTENT_LENGTH": str(len(data))})
        return self.wsgi_app(environ, start_response)


def refuse_unsized_overflow() -> None:
    """before_request: 413 for a body `WholeUnsizedBody` found over the limit."""
    if request.environ.get(_TOO_LARGE):
        raise TooLarge("body", f"request body larger than {current_app.config['MAX_CONTENT_LENGTH']} bytes")


def create_app(config: Config | None = None, *, predictor_factory: Callable | None = None,
               start_refit: bool = True) -> Flask:
    """Build the service.

    Args:
        config: the frozen config; None reads the environment (WSGI factory use).
        predictor_factory: builds an unfitted Predictor (tests pass a fake); default predictor.engine.
        start_refit: load the newest stored model and start the background refit thread (the CLI's one-shot
            commands pass False: the app then loads a stored model on first use and never fits on its own).
    """
    if config is None:
        config = Config.from_env(os.environ)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.wsgi_app = WholeUnsizedBody(app.wsgi_app, config.max_body_bytes)
    app.before_request(refuse_unsized_overflow)
    app.json.sort_keys = False
    store = Store(config.db_path, decision_retention=DecisionRetention(
        max_rows=config.decisions_keep, max_age=config.decisions_max_age, max_bytes=config.decisions_max_bytes,
        unclaimed_max_age=config.decisions_unclaimed_max_age))
    store.migrate()
    models = ModelCache(store, predictor_factory or default_predictor_factory, debounce=config.refit_debounce,
                        poll=config.refit_poll, cache_size=config.prediction_cache_size,
                        cache_bytes=config.prediction_cache_bytes, min_interval=config.refit_min_interval,
                        fitter=config.fits, max_share=config.refit_max_share)
    plots = PlotRenderer(store, models, prerender=config.plot_prerender)
    app.extensions["elastic_predictor"] = Services(config=config, store=store, models=models, plots=plots)
    for module in (health, profiles, observations, predict, decisions, links, metrics, web):
        app.register_blueprint(module.bp)
    app.register_error_handler(Exception, handle_error)
    if start_refit:
        models.start()
        if config.plot_prerender:
            plots.start()
    return app
