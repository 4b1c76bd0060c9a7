"""HTTP API v1 blueprints (one module per resource) and the helpers they share.

Shared helpers: `services()` (the objects `create_app` built), `json_body()` (parses the request body or
raises a 400 naming `body`), `int_arg()` (an integer query parameter in bounds, else a 400 naming it), `write_access` / `admin_access` (the checks of predictor.auth on a view),
`caller()` (who the current request was accepted from) and `install_auth_hooks(bp)`, which a blueprint
calls to register, app-wide, the read check (ELASTIC_PREDICTOR_READ_AUTH) and the JSON answer for an
`AuthError` (`{"error", "field", "reason"}`, plus `WWW-Authenticate` on 401).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from flask import Blueprint, current_app, g, jsonify, request

from predictor.auth import MUNGE_HEADER, AuthError, Authenticator, Caller

from predictor.cluster import Cluster
from predictor.config import Config
from predictor.errors import ValidationError
from predictor.plotcache import PlotRenderer
from predictor.service import ModelCache
from predictor.store import Store


def int_arg(name: str, default: int | None, low: int, high: int) -> int | None:
    """The query parameter `name` as an integer in low..high (`default` when absent).

    Raises:
        ValidationError: anything else, named (non-ASCII digits such as '\u00b2' and overlong digit strings too,
            which `int()` refuses).
    """
    raw = request.args.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19) or not low <= int(raw) <= high:
        raise ValidationError(name, f"expected an integer in {low}..{high}, got {raw[:40]!r}")
    return int(raw)


@dataclasses.dataclass(frozen=True)
class Services:
    """What the blueprints use, built once per app by `create_app`."""

    config: Config
    store: Store
    models: ModelCache
    plots: PlotRenderer

    @property
    def cluster(self) -> Cluster:
        return self.config.cluster


__all__ = ["AuthError", "Services", "admin_access", "authenticator", "caller", "install_auth_hooks", "json_body", "services",
           "write_access"]
_AUTH_KEY = "elastic_predictor_auth"
OPEN_READS = ("/healthz", "/v1/openapi.json")   # GETs that stay open under ELASTIC_PREDICTOR_READ_AUTH
READ_POSTS = ("/v1/predict",)                   # POSTs that only read: under READ_AUTH they need a read credential


def services() -> Services:
    return current_app.extensions["elastic_predictor"]


def client_address() -> str:
    """Where the request came from: the address nginx (`serve`'s front end, predictor/deploy/nginx.conf.in)
    put in X-Forwarded-For (it replaces any the client sent), else the socket's peer."""
    return (request.headers.get("X-Forwarded-For") or request.remote_addr or "")[:64]


HOOK_HEADER = "X-Elastic-Hook"   # nginx sets it, replacing the client's: "1" from a `serve --hook-from` host


def decision_owner(job_uid: object) -> str:
    """Whose budget share a /v1/plan decision counts in (#41.2; predictor.store.DecisionRetention): a job
    credential's user (`uid:<uid>`), a token (`token:tool`, `token:admin`), the job_submit hook from a `--hook-from`
    host (`hook:uid:<the job's uid>`: slurmctld vouches for it), else the anonymous address (`addr:<address>`)."""
    who = identified()
    if who.kind == "job":
        return f"uid:{who.uid}"
    if who.kind in ("tool", "admin"):
        return f"token:{who.kind}"
    if request.headers.get(HOOK_HEADER) == "1":
        return f"hook:uid:{job_uid if isinstance(job_uid, int) and not isinstance(job_uid, bool) else '-'}"
    return f"addr:{client_address()}"


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


def authenticator() -> Authenticator:
    """The app's `Authenticator`, built once from its config (tests may put their own in app.extensions)."""
    auth = current_app.extensions.get(_AUTH_KEY)
    if auth is None:
        auth = current_app.extensions.setdefault(_AUTH_KEY, Authenticator.from_config(services().config))
    return auth


def caller() -> Caller:
    """Who the current request was accepted from (set by `write_access` / `admin_access`)."""
    return g.get("elastic_caller") or Caller("anonymous")


def identified() -> Caller:
    """Who the current request proves to be, where the route does not require it: the caller the read check
    accepted, else the credential the request carries if it holds (a munge credential signing this body, a bearer
    token), else anonymous. A credential that does not hold makes the request anonymous, never refused."""
    who = g.get("elastic_caller")
    if who is not None:
        return who
    if request.headers.get(MUNGE_HEADER) or request.headers.get("Authorization"):
        try:
            who = authenticator().check_write(request.headers, request.get_data(cache=True))
        except AuthError:
            who = None
    g.elastic_caller = who or Caller("anonymous")
    return g.elastic_caller


def write_access(view):
    """Decorator: a tool/admin bearer token or a munge-signed job credential (predictor.auth); the view runs in
    one of its signer uid's slots of this process when a job signed it (`CredentialSlots`: else 429
    `credential_busy`)."""

    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        auth = authenticator()
        g.elastic_caller = auth.check_write(request.headers, request.get_data(cache=True))
        with auth.slots.hold(g.elastic_caller):
            return view(*args, **kwargs)

    return wrapper


def admin_access(view):
    """Decorator: the admin token (or the tool token when no admin token is configured)."""

    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        g.elastic_caller = authenticator().check_admin(request.headers)
        return view(*args, **kwargs)

    return wrapper


def _auth_error(exc: AuthError):
    response = jsonify(error=str(exc), field=exc.field, reason=exc.reason)
    if exc.status == 401:
        response.headers["WWW-Authenticate"] = ('Bearer realm="elastic-predictor"' if exc.field == "Authorization"
                                                else f'Munge header="{MUNGE_HEADER}"')
    if exc.status in (429, 503):
        response.headers["Retry-After"] = "2" if exc.status == 503 else "1"
    return response, exc.status


def _read_check():
    if not authenticator().read_auth:
        return
    if request.method in ("GET", "HEAD") and request.path not in OPEN_READS:
        g.elastic_caller = authenticator().check_read(request.headers)
    elif request.method == "POST" and request.path in READ_POSTS:   # a job signs the body it sends
        g.elastic_caller = authenticator().check_read(request.headers, request.get_data(cache=True))


def install_auth_hooks(bp: Blueprint) -> None:
    """Register, for the whole app, the read check and the JSON answer of `AuthError`."""
    bp.before_app_request(_read_check)
    bp.app_errorhandler(AuthError)(_auth_error)
