"""POST/GET /v1/profiles and GET /v1/profiles/<name>: model tensor profiles."""
from __future__ import annotations

import json

from flask import Blueprint, request

from predictor.api import AuthError, authenticator, caller, int_arg, json_body, services, write_access
from predictor.errors import ValidationError
from predictor.profiles import BUILTIN, Profile, _canonical, profile_from_spec
from slurm_plugin.contracts.records import NAME_RE
from predictor.store import QuotaExceeded

bp = Blueprint("profiles", __name__, url_prefix="/v1/profiles")
MAX_EXTRA_FIELD_BYTES = 16 * 1024  # a field beyond the profile's own (#14.7: a 3.9 MB junk field was stored)
# what one user's jobs may register in all (#24.6: 100 profiles of 3.85 MB from one job took the database to
# 385 MB and every profile listing to 760 ms); tokens are not bound
JOB_PROFILE_QUOTA = (32, 16 * 1024 * 1024)


LIST_LIMIT = 100          # profiles a listing returns by default (?limit=, at most LIST_MAX)
LIST_MAX = 1000


def summary(profile: Profile) -> dict:
    return {"name": profile.name, "tensors": len(profile.tensors), "params": profile.n_params,
            "grad_bytes": profile.grad_bytes, "buckets": len(profile.buckets_bytes), "source": profile.source}


def scoped_name(name: str, uid: int) -> str:
    """Where a user's own profile of `name` is stored when another user holds the name (#24: a squat must not
    block it): `<name>@u<uid>`. '@' is outside the `model=` grammar (NAME_RE), so no request can name it, nor
    register or post rows under it; the service maps `name` to it for that user's jobs only."""
    return f"{name}@u{int(uid)}"


def own_name(store, name: str, uid: int | None) -> str:
    """The stored name `name` means for a job of `uid`: its own scoped profile when it has one, else `name`."""
    if uid is None:
        return name
    scoped = scoped_name(name, uid)
    return scoped if store.profile_owner(scoped)[0] else name


def _owner_text(owner: int | None) -> str:
    return "the site's (registered with a token)" if owner is None else f"uid {owner}'s"


def register(store, body, may_replace: bool = True, owner: int | None = None) -> tuple[Profile, bool]:
    """Validate and store a profile body; returns (profile, created).

    A name is owned by who registered it (#24.6): a job's user (its uid), or the site (a token, the importer).
    Anyone may re-post a profile unchanged (nothing is written); only an admin (`may_replace`) replaces one, and
    an admin's (or a token's) write makes the profile the site's. A user's profile serves only that user's plans
    and predictions (`readable_by`). A name another user holds does not block a job: its user gets a profile of
    that name of its own, stored as `scoped_name(name, uid)`, which that user's plans, predictions and step rows
    use (`own_name`).

    Args:
        may_replace: True for an admin (the admin token; the tool token while none is set): replaces anyone's.
        owner: the uid of the job registering it (None: a token): a new or replaced profile counts against that
            user's `JOB_PROFILE_QUOTA`.

    Raises:
        ValidationError: naming the bad field (`name`, `tensors[3].numel`).
        AuthError: 403 `name_owned` when a job's body differs from the site's profile of that name,
            `admin_required` when it differs from its own user's or a token that does not
            administer would replace one; 403 `profile_quota` when a new profile would take its owner past the
            quota; 403 `reserved_name` (`_check_well_known`).
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
    # an admin replaces anyone's (and the importer's parse, a stand-in store, has no owners)
    exists, current_owner = (False, None) if may_replace else store.profile_owner(profile.name)
    if exists and not may_replace and owner is not None and current_owner not in (None, owner):
        # another user holds the name: this user's own profile of that name, beside it (#24: no squat blocks it)
        stored["name"] = scoped_name(profile.name, owner)
        profile = Profile.from_dict(stored)
        exists, current_owner = store.profile_owner(profile.name)
    if exists and not may_replace and store.get_profile(profile.name) != json.loads(json.dumps(stored)):
        if owner is not None and current_owner != owner:
            raise AuthError(403, f"name: profile {profile.name!r} is {_owner_text(current_owner)}: only an admin may "
                                 f"replace it; name your profile after your own model (e.g. with your user "
                                 "name), or ask an admin to register it for the site", "name", "name_owned")
        raise AuthError(403, f"profile {profile.name!r} exists with a different body; replacing it needs the "
                             "admin token (ELASTIC_PREDICTOR_ADMIN_TOKEN; the tool token while none is set)", "name",
                        "admin_required")
    if exists and not may_replace:
        return profile, False                     # re-posted unchanged: nothing is written, the owner stays
    if owner is None:  # a token (or the importer's parse): the site's, not bound to a user
        return profile, store.put_profile(profile.name, stored)
    _check_well_known(store, profile)
    try:
        created = store.put_profile(profile.name, stored, owner, JOB_PROFILE_QUOTA)
    except QuotaExceeded as exc:
        raise AuthError(403, f"name: {exc}; ask an admin to register it", "name", "profile_quota") from None
    return profile, created


def readable_by(owner: int | None, reader: int | None, trusted: bool) -> bool:
    """Whether a profile of ``owner`` (None: the site's) is used for a plan or prediction asked for ``reader``
    (a job's uid, or the uid a plan request names), #24.6: a user's profile serves that user's jobs only, so a name
    one user registered first never decides another user's plans. ``trusted``: the caller holds a token or the
    service takes no credentials (it sees every profile when it names no uid)."""
    if owner is None:
        return True
    if reader is not None:
        return reader == owner
    return trusted


def _check_well_known(store, profile: Profile) -> None:
    """A job may register a well-known model's name (the built-in architectures of predictor.profiles, e.g.
    `resnet50`, `gpt2`) only with that model's shape: the same tensor count and parameters as the built-in one
    (#24.6: a job registered `llama-70b` with 2 tensors, and everyone's jobs of that name were planned from it).

    Raises:
        AuthError: 403 `reserved_name`.
    """
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
    """Summaries, by name, a page at a time (#24.6: no body is read): `?limit=` (default `LIST_LIMIT`, at most
    `LIST_MAX`) and `?after=<name>` (the `next` of the previous page; null on the last)."""
    limit = int_arg("limit", LIST_LIMIT, 1, LIST_MAX)
    after = request.args.get("after")
    if after is not None and (len(after) > 200 or not after):
        raise ValidationError("after", "expected the `next` name of the previous page")
    rows = services().store.profile_summaries(limit + 1, after)
    items = [{k: row[k] for k in ("name", "tensors", "params", "grad_bytes", "buckets", "source", "owner", "bytes",
                                  "created_at_s", "updated_at_s")} for row in rows[:limit]]
    return {"profiles": items, "next": items[-1]["name"] if len(rows) > limit else None}


@bp.get("/<path:name>")
def show(name: str):
    return services().store.get_profile(name)
