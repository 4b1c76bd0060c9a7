"""POST /v1/observations: collective and step records, validated whole, stored all-or-nothing.

A job that signs with munge may only post records of its own job: a record's `job_id`, when given,
must be the signed job's (403 `job_id_mismatch`), and records without one get it filled in. Each record must
also fit what Slurm says about that job (predictor.jobcheck: GPU type, layout within its allocation, time within
its run window; 403 `record_mismatch` naming the field), or nothing of the request is stored.
The answer's `model_version_pending` is the store generation the write produced: the first model version that
includes the records (a client passes it as `min_model_version` to /v1/predict or /v1/plan). A POST with an
`Idempotency-Key` header that its caller used before, with the same body, stores nothing and answers as the first
did (`replayed`); with another body it is refused (409, field `Idempotency-Key`).
This blueprint also installs the app-wide auth hooks (read check, AuthError answers).
"""
from __future__ import annotations

import hashlib
import re

from flask import Blueprint, request

from predictor.api import AuthError, authenticator, caller, install_auth_hooks, json_body, services, write_access
from predictor.api.profiles import own_name
from predictor.jobcheck import RecordMismatch, check_records, run_seconds
from predictor.errors import Conflict, ValidationError
from slurm_plugin.contracts.records import validate_batch
from predictor.store import ClaimExceeded, KeyReused, QuotaExceeded

IDEMPOTENCY_HEADER = "Idempotency-Key"
KEY_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}\Z")

bp = Blueprint("observations", __name__, url_prefix="/v1/observations")
install_auth_hooks(bp)


@bp.post("")
@write_access
def create():
    svc = services()
    records = validate_batch(json_body())
    who = caller()
    if who.kind == "job":
        for i, record in enumerate(records):
            if record.get("job_id") not in (None, who.job_id, str(who.job_id)):
                raise AuthError(403, f"observations[{i}].job_id: job_id mismatch: the record says "
                                     f"{record['job_id']!r}, the credential signs job {who.job_id}",
                                "observations[{}].job_id".format(i), "job_id_mismatch")
        check_records(records, who.job, svc.cluster, now=authenticator().clock())
        # the signer's uid goes with every row: the fit bounds one user's influence over all their jobs (#24.1)
        records = [dict(r, job_id=r.get("job_id", who.job_id), uid=who.uid) for r in records]
        # a step row of a name this user has its own profile of (another user holds the name) is that profile's
        names = {r["profile"] for r in records if r.get("profile")}
        own = {name: own_name(svc.store, name, who.uid) for name in names}
        records = [dict(r, profile=own[r["profile"]]) if r.get("profile") in own and own[r["profile"]] != r["profile"]
                   else r for r in records]
    claim = (who.job_id, run_seconds(who.job, authenticator().clock())) if who.kind == "job" else None
    try:
        written = svc.store.write_observations(records, _write_key(who), claim, _quota(who, svc.config))
    except QuotaExceeded as exc:
        raise AuthError(403, f"observations: {exc}", "observations", "storage_quota") from None
    except ClaimExceeded as exc:
        raise RecordMismatch("observations", str(exc)) from None
    except KeyReused as exc:
        raise Conflict(IDEMPOTENCY_HEADER, str(exc)) from None
    if not written.replayed:
        svc.models.notify()
    ids = written.ids
    # A model of this version or newer includes these records: ask /v1/predict or /v1/plan for it with
    # `min_model_version` to read your own writes.
    return {"stored": len(ids), "first_id": ids[0], "last_id": ids[-1],
            "model_version_pending": written.generation, "replayed": written.replayed}, 201


def _quota(who, config) -> tuple[str, int, int] | None:
    """``(owner, period, bytes)`` a write is held to (#41.3): a job credential's rows of every kind in all, the
    tool token's per UTC day; the admin token (and open writes, development) are not held."""
    if who.kind == "job":
        return f"job:{who.job_id}", 0, config.job_write_quota_bytes
    if who.kind == "tool":
        return "tool", 1 + int(authenticator().clock() // 86400), config.token_write_quota_bytes
    return None


def _write_key(who) -> tuple[str, str, str] | None:
    """``(caller, Idempotency-Key, sha256 of the body)``: a retried POST with the same key and body stores nothing
    again (#24.13); the same key with another body is refused, 409 (#41.8: it answered "replayed" and dropped the
    rows). Keys are per caller (a job's, a token's, or anonymous), so one caller's keys never answer another's."""
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not KEY_RE.match(key):
        raise ValidationError(IDEMPOTENCY_HEADER, "expected 1-128 characters of A-Z a-z 0-9 _ . : -")
    digest = hashlib.sha256(request.get_data(cache=True)).hexdigest()
    return f"{who.kind}:{who.job_id if who.job_id is not None else ''}", key, digest


@bp.get("")
def counts():
    return {"counts": services().store.observation_counts(), "generation": services().store.generation()}
