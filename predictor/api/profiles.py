"""POST/GET /v1/profiles and GET /v1/profiles/<name>: model tensor profiles."""
from __future__ import annotations

import json

from flask import Blueprint

from predictor.api import AuthError, authenticator, caller, json_body, services, write_access
from predictor.errors import ValidationError
from predictor.profiles import Profile
from predictor.records import NAME_RE
from predictor.store import QuotaExceeded

bp = Blueprint("profiles", __name__, url_prefix="/v1/profiles")
MAX_EXTRA_FIELD_BYTES = 16 * 1024  # a field beyond the profile's own (#14.7: a 3.9 MB junk field was stored)
# what one user's jobs may register in all (#24.6: 100 profiles of 3.85 MB from one job took the database to
# 385 MB and every profile listing to 760 ms); tokens are not bound
JOB_PROFILE_QUOTA = (32, 16 * 1024 * 1024)


def summary(profile: Profile) -> dict:
    return {"name": profile.name, "tensors": len(profile.tensors), "params": profile.n_params,
            "grad_bytes": profile.grad_bytes, "buckets": len(profile.buckets_bytes), "source": profile.source}


def register(store, body, may_replace: bool = True, owner: int | None = None) -> tuple[Profile, bool]:
    """Validate and store a profile body; returns (profile, created).

    Args:
        may_replace: False (a job credential, or the tool token while an admin token is configured): an existing
            profile may only be re-posted unchanged.
        owner: the uid of the job registering it (None: a token): a new profile counts against that user's
            `JOB_PROFILE_QUOTA`.

    Raises:
        ValidationError: naming the bad field (`name`, `tensors[3].numel`).
        AuthError: 403 `admin_required` when replacing is not allowed and the body differs; 403
            `profile_quota` when a new profile would take its owner past the quota.
    """
    if isinstance(body, dict) and isinstance(body.get("name"), str) and not NAME_RE.match(body["name"]):
        raise ValidationError("name", f"must match {NAME_RE.pattern} (the `model=` directive grammar)")
    if isinstance(body, dict) and "source" in body and not isinstance(body["source"], str):
        raise ValidationError("source", "expected a string (where the profile came from)")
    profile = Profile.from_dict(body)
    stored = dict(profile.to_dict())
    if isinstance(body, dict):
        extra = {k: v for k, v in body.items() if k not in stored}   # keep extra fields (layer kinds...)
        for key, value in extra.items():
            try:
                size = len(json.dumps(value, allow_nan=False))
            except ValueError:
                raise ValidationError(key, "NaN and Infinity are not JSON values") from None
            if size > MAX_EXTRA_FIELD_BYTES:
                raise ValidationError(key, f"an extra profile field is kept as given, up to {MAX_EXTRA_FIELD_BYTES} "
                                           "bytes of JSON")
        stored.update(extra)
    if not may_replace and store.has_profile(profile.name) and store.get_profile(profile.name) != json.loads(json.dumps(stored)):
        raise AuthError(403, f"profile {profile.name!r} exists with a different body; replacing it needs the "
                             "admin token (ELASTIC_PREDICTOR_ADMIN_TOKEN; the tool token while none is set)", "name",
                        "admin_required")
    if owner is None:  # a token (or the importer's parse): not bound to a user
        return profile, store.put_profile(profile.name, stored)
    _check_well_known(store, profile)
    try:
        created = store.put_profile(profile.name, stored, owner, JOB_PROFILE_QUOTA)
    except QuotaExceeded as exc:
        raise AuthError(403, f"name: {exc}; ask an admin to register it", "name", "profile_quota") from None
    return profile, created


def _check_well_known(store, profile: Profile) -> None:
    """A job may register a well-known model's name (the built-in architectures of predictor.profiles, e.g.
    `resnet50`, `gpt2`) only with that model's shape: the same tensor count and parameters as the built-in one
    (#24.6: a job registered `llama-70b` with 2 tensors, and everyone's jobs of that name were planned from it).

    Raises:
        AuthError: 403 `reserved_name`.
    """
    from predictor.profiles import BUILTIN, _canonical, profile_from_spec  # noqa: PLC0415 - only for jobs

    if _canonical(profile.name) not in BUILTIN or store.has_profile(profile.name):
        return                  # a name of its own, or one already registered (re-posting it is checked above)
    known = profile_from_spec(profile.name)
    if (len(profile.tensors), profile.n_params) != (len(known.tensors), known.n_params):
        raise AuthError(403, f"name: {profile.name!r} is a well-known model ({len(known.tensors)} tensors, "
                             f"{known.n_params} parameters); this profile has {len(profile.tensors)} tensors and "
                             f"{profile.n_params}: name it after your own model, or ask an admin to register it",
                        "name", "reserved_name")


@bp.post("")
@write_access
def create():
    svc = services()
    who = caller()
    profile, created = register(svc.store, json_body(), may_replace=authenticator().administers(who),
                                owner=who.uid if who.kind == "job" else None)
    svc.models.notify()
    return summary(profile), 201 if created else 200


@bp.get("")
def index():
    rows = services().store.list_profiles()
    items = []
    for row in rows:
        item = summary(Profile.from_dict(row["body"]))
        item.update(created_at_s=row["created_at_s"], updated_at_s=row["updated_at_s"])
        items.append(item)
    return {"profiles": items}


@bp.get("/<path:name>")
def show(name: str):
    return services().store.get_profile(name)
