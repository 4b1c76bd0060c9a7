"""The service's frozen configuration, built once by an entry point (CLI or WSGI factory).

Nothing else in the package reads the environment: `Config.from_env` is the one place that turns
`ELASTIC_PREDICTOR_*` variables and the cluster file into values, and everything downstream receives
the frozen object.

Environment (read only by `Config.from_env`):
    ELASTIC_PREDICTOR_TOKEN       bearer token required for writes (with no admin token and munge off, unset or
                                  empty closes writes; `serve --allow-dev open-writes` opens them, #41.9)
    ELASTIC_PREDICTOR_DB          SQLite path (default `predictor.db`)
    ELASTIC_PREDICTOR_CLUSTER     JSON cluster model file (default: the built-in local testbed)
    ELASTIC_PREDICTOR_MAX_BODY    request body cap in bytes (default 4 MiB)
    ELASTIC_PREDICTOR_REFIT_DEBOUNCE_S   seconds to coalesce new observations before a refit (default 1)
    ELASTIC_PREDICTOR_CACHE_SIZE  prediction cache entries per worker (default 4096; 0 disables it)
    ELASTIC_PREDICTOR_ADMIN_TOKEN bearer token for admin operations (unset: the tool token does them)
    ELASTIC_PREDICTOR_MUNGE       1: accept munge-signed writes from jobs (`X-Elastic-Munge`, predictor.auth)
    ELASTIC_PREDICTOR_MUNGE_SOCKET  munged socket for decoding credentials (default: munge's own)
    ELASTIC_PREDICTOR_MUNGE_IN_PROCESS  0: decode with an `unmunge` run a credential instead of libmunge in the
                                  worker (default 1 where libmunge loads)
    ELASTIC_PREDICTOR_SLURM_CONF  slurm.conf for the job-owner check (default: Slurm's own)
    ELASTIC_PREDICTOR_JOB_RECENT_S  seconds after a job ended that its credential is still accepted (600)
    ELASTIC_PREDICTOR_READ_AUTH   1: reads (GET) need a credential too (/healthz stays open)
    ELASTIC_PREDICTOR_PLAN_CACHE_TTL_S  seconds the job_submit hook may reuse a /v1/plan decision for an
                                  identical request (`cache_ttl_s`; default 30, 0 disables)
    ELASTIC_PREDICTOR_CACHE_BYTES prediction cache budget per worker, in estimated bytes (default 64 MiB)
    ELASTIC_PREDICTOR_DECISIONS_KEEP      decisions kept at most (default 100000; the oldest are pruned)
    ELASTIC_PREDICTOR_DECISIONS_MAX_AGE_DAYS  decisions older than this are pruned (default 90)
    ELASTIC_PREDICTOR_DECISIONS_MAX_BYTES request and response text the decisions may hold (default 512 MiB)
    ELASTIC_PREDICTOR_DECISIONS_UNCLAIMED_MAX_AGE_S  seconds an unclaimed decision (job_submit's, no job seen holding
                                  it: maybe `sbatch --test-only`'s) is kept (default 86400)
    ELASTIC_PREDICTOR_JOB_WRITE_QUOTA_BYTES  observation bytes one job credential may store (default 64 MiB)
    ELASTIC_PREDICTOR_TOKEN_WRITE_QUOTA_BYTES  observation bytes the tool token may store a day (UTC; default 1 GiB)
    ELASTIC_PREDICTOR_PLOT_PRERENDER  1 (the default here, not in `Config()`): each worker draws the admin
                                  page's plots for every new model version before anyone asks
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Mapping

from predictor.cluster import Cluster
from predictor.errors import ValidationError

MAX_CANDIDATES = 512   # layouts one /v1/plan or /v1/predict evaluates (`Config.max_plan_candidates`'s default)

ENV_TOKEN = "ELASTIC_PREDICTOR_TOKEN"
ENV_DB = "ELASTIC_PREDICTOR_DB"
ENV_CLUSTER = "ELASTIC_PREDICTOR_CLUSTER"
ENV_MAX_BODY = "ELASTIC_PREDICTOR_MAX_BODY"
ENV_DEBOUNCE = "ELASTIC_PREDICTOR_REFIT_DEBOUNCE_S"
ENV_CACHE = "ELASTIC_PREDICTOR_CACHE_SIZE"
ENV_ADMIN_TOKEN = "ELASTIC_PREDICTOR_ADMIN_TOKEN"
ENV_MUNGE = "ELASTIC_PREDICTOR_MUNGE"
ENV_MUNGE_SOCKET = "ELASTIC_PREDICTOR_MUNGE_SOCKET"
ENV_MUNGE_IN_PROCESS = "ELASTIC_PREDICTOR_MUNGE_IN_PROCESS"
ENV_SLURM_CONF = "ELASTIC_PREDICTOR_SLURM_CONF"
ENV_JOB_RECENT = "ELASTIC_PREDICTOR_JOB_RECENT_S"
ENV_READ_AUTH = "ELASTIC_PREDICTOR_READ_AUTH"
ENV_PLAN_CACHE_TTL = "ELASTIC_PREDICTOR_PLAN_CACHE_TTL_S"
ENV_CACHE_BYTES = "ELASTIC_PREDICTOR_CACHE_BYTES"
ENV_DECISIONS_KEEP = "ELASTIC_PREDICTOR_DECISIONS_KEEP"
ENV_DECISIONS_MAX_AGE = "ELASTIC_PREDICTOR_DECISIONS_MAX_AGE_DAYS"
ENV_DECISIONS_MAX_BYTES = "ELASTIC_PREDICTOR_DECISIONS_MAX_BYTES"
ENV_DECISIONS_UNCLAIMED_MAX_AGE = "ELASTIC_PREDICTOR_DECISIONS_UNCLAIMED_MAX_AGE_S"
ENV_PLOT_PRERENDER = "ELASTIC_PREDICTOR_PLOT_PRERENDER"
ENV_JOB_WRITE_QUOTA = "ELASTIC_PREDICTOR_JOB_WRITE_QUOTA_BYTES"
ENV_TOKEN_WRITE_QUOTA = "ELASTIC_PREDICTOR_TOKEN_WRITE_QUOTA_BYTES"
ENV_REPLAY_DIR = "ELASTIC_PREDICTOR_REPLAY_DIR"
# The variable behind each range-checked field, so an out-of-range value is reported by the name the admin set.
_FIELD_ENV = {"max_body_bytes": ENV_MAX_BODY, "prediction_cache_size": ENV_CACHE, "refit_debounce": ENV_DEBOUNCE,
              "job_recent": ENV_JOB_RECENT, "plan_cache_ttl": ENV_PLAN_CACHE_TTL,
              "prediction_cache_bytes": ENV_CACHE_BYTES, "decisions_keep": ENV_DECISIONS_KEEP,
              "decisions_max_age": ENV_DECISIONS_MAX_AGE, "decisions_max_bytes": ENV_DECISIONS_MAX_BYTES,
              "decisions_unclaimed_max_age": ENV_DECISIONS_UNCLAIMED_MAX_AGE,
              "job_write_quota_bytes": ENV_JOB_WRITE_QUOTA, "token_write_quota_bytes": ENV_TOKEN_WRITE_QUOTA}


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the service needs, fixed at start-up.

    Attributes:
        db_path: SQLite database file.
        token: bearer token for writes; None with no admin token and munge off: writes are `open_writes`.
        job_write_quota_bytes: observation bytes (the stored rows' JSON, every kind: steps and collectives) one
            job credential may store in all (#41.3: collective rows were outside any claim, 7.4 GB an hour from one job).
        token_write_quota_bytes: the same for the tool token, per UTC day (#41.3: it had no quota; the admin token
            has none).
        open_writes: with no credential configured, anyone may write (True in `Config()`, for tests and embedding
            code; False from `from_env`, so `serve` and the WSGI factory close them unless `serve --allow-dev
            open-writes`, #41.9). Ignored once a credential is configured.
        cluster: the cluster model used to enumerate candidate layouts.
        max_body_bytes: requests with a larger body get 413.
        refit_debounce: how long new observations are coalesced before the background refit.
        refit_poll: how often each worker checks the store for data written by other workers.
        refit_min_interval: least time between the end of one fit and the start of the next.
        refit_max_share: at most this share of the fitter's time goes to fits: after a fit of f seconds the next
            starts at least f * (1 - share) / share later, so a steady stream of observations cannot keep a
            worker fitting all the time, while a write right after a fit waits about one fit, not a fixed pause
            (#24.16: a write is reflected within max(debounce, the fit in progress + its pause) + its own fit;
            predictor.service.ModelCache.next_fit_at).
        prediction_cache_size: entries in the per-model-version prediction cache.
        prediction_cache_bytes: budget of that cache in estimated bytes (candidates x layout length), per worker.
        default_min_efficiency: scaling-efficiency threshold when the directives give none.
        max_plan_candidates: cap on the layouts one /v1/plan or /v1/predict evaluates (a longer
            `candidates` list is refused, a plan with more layouts answers keep).
        admin_token: bearer token for admin operations; None: the tool token does them.
        munge_auth: accept munge-signed job writes (`X-Elastic-Munge`).
        munge_socket: munged socket for decoding credentials; None: munge's default.
        munge_in_process: decode credentials with libmunge in the worker (where it loads), not an `unmunge` run.
        slurm_conf: slurm.conf for checking a signing job's owner; None: Slurm's default.
        job_recent: how long after a job ended its signed writes are still accepted.
        read_auth: reads need a credential too.
        auth_timeout: limit for one `unmunge` or Slurm lookup.
        plan_cache_ttl: how long the job_submit hook may reuse a /v1/plan decision for an identical
            request (sent as `cache_ttl_s`); zero disables the hook's cache.
        decisions_keep: decisions kept at most (the newest; predictor.store.DecisionRetention).
        decisions_max_age: decisions older than this are pruned.
        decisions_max_bytes: bytes of request and response text the decisions may hold.
        decisions_unclaimed_max_age: an unclaimed decision (asked by job_submit, no job seen holding it yet: it may
            have been `sbatch --test-only`'s, #42.6) older than this is deleted.
        plot_prerender: draw the admin page's default plots in the background for every new model version
            before anyone asks (on for `serve` through `from_env`; off in `Config()`, so embedding code and
            tests start no drawing they did not ask for).
        fits: this process may fit the model (take the fit lock); False: it only loads the models others fit
            (the plan pool behind nginx, predictor.front_nginx: fits run in the side pool).
        replay_dir: the folder `elastic-predictor replay --out` wrote its report to; /admin shows it (None: the
            page says how to make one).
    """

    db_path: str = "predictor.db"
    token: str | None = None
    cluster: Cluster = dataclasses.field(default_factory=Cluster.default)
    max_body_bytes: int = 4 * 1024 * 1024
    refit_debounce: timedelta = timedelta(seconds=1)
    refit_poll: timedelta = timedelta(seconds=2)
    refit_min_interval: timedelta = timedelta(seconds=1)
    refit_max_share: float = 0.5
    prediction_cache_size: int = 4096
    default_min_efficiency: float = 0.5
    max_plan_candidates: int = MAX_CANDIDATES
    admin_token: str | None = None
    munge_auth: bool = False
    munge_socket: str | None = None
    munge_in_process: bool = True
    slurm_conf: str | None = None
    job_recent: timedelta = timedelta(minutes=10)
    read_auth: bool = False
    auth_timeout: timedelta = timedelta(seconds=5)
    plan_cache_ttl: timedelta = timedelta(seconds=30)
    prediction_cache_bytes: int = 64 * 1024 * 1024
    decisions_keep: int = 100_000
    decisions_max_age: timedelta = timedelta(days=90)
    decisions_max_bytes: int = 512 * 1024 * 1024
    decisions_unclaimed_max_age: timedelta = timedelta(days=1)
    plot_prerender: bool = False
    fits: bool = True
    open_writes: bool = True
    job_write_quota_bytes: int = 64 * 1024 * 1024
    token_write_quota_bytes: int = 1024 * 1024 * 1024
    replay_dir: str | None = None

    def __post_init__(self):
        if self.max_body_bytes < 1024:
            raise ValidationError("max_body_bytes", f"must be at least 1024, got {self.max_body_bytes}")
        if not 0.0 <= self.default_min_efficiency <= 1.0:
            raise ValidationError("default_min_efficiency", "must lie in [0, 1]")
        if self.prediction_cache_size < 0:
            raise ValidationError("prediction_cache_size", "must be >= 0")
        if self.refit_debounce < timedelta(0) or self.refit_min_interval < timedelta(0) or self.refit_poll <= timedelta(0):
            raise ValidationError("refit_debounce", "debounce and min interval must be >= 0, poll > 0")
        if not 0.0 < self.refit_max_share <= 1.0:
            raise ValidationError("refit_max_share", "must lie in (0, 1]")
        if self.job_recent < timedelta(0) or self.auth_timeout <= timedelta(0):
            raise ValidationError("job_recent", "job_recent must be >= 0 and auth_timeout > 0")
        if not timedelta(0) <= self.plan_cache_ttl <= timedelta(hours=1):
            raise ValidationError("plan_cache_ttl", "must lie in 0..3600 s")
        if self.prediction_cache_bytes < 0:
            raise ValidationError("prediction_cache_bytes", "must be >= 0")
        if self.job_write_quota_bytes < 1 or self.token_write_quota_bytes < 1:
            raise ValidationError("job_write_quota_bytes" if self.job_write_quota_bytes < 1
                                  else "token_write_quota_bytes", "must be >= 1")
        if self.decisions_keep < 1:
            raise ValidationError("decisions_keep", "must be >= 1")
        if self.decisions_max_age <= timedelta(0):
            raise ValidationError("decisions_max_age", "must be > 0 days")
        if self.decisions_max_bytes < 64 * 1024:
            raise ValidationError("decisions_max_bytes", "must be at least 65536")
        if self.decisions_unclaimed_max_age <= timedelta(0):
            raise ValidationError("decisions_unclaimed_max_age",
                                  f"must be > 0 s, got {self.decisions_unclaimed_max_age.total_seconds():g}")

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed (the object itself stays frozen)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides) -> "Config":
        """Build the config from an environment mapping (the caller passes `os.environ`).

        Explicit `overrides` (e.g. `db_path` from `--db`) win over the environment.

        Raises:
            ValidationError: a variable or the cluster file is malformed (field names the variable).
        """
        values: dict = {}
        if env.get(ENV_TOKEN):
            values["token"] = env[ENV_TOKEN]
        if env.get(ENV_DB):
            values["db_path"] = env[ENV_DB]
        if env.get(ENV_CLUSTER):
            values["cluster"] = Cluster.from_file(env[ENV_CLUSTER])
        for name, field, parse in _ENV_FIELDS:
            if env.get(name):
                values[field] = parse(env, name)
        values["plot_prerender"] = _bool_var(env, ENV_PLOT_PRERENDER) if env.get(ENV_PLOT_PRERENDER) else True
        values["open_writes"] = False
        from_env = set(values)
        values.update({k: v for k, v in overrides.items() if v is not None})
        from_env -= {k for k, v in overrides.items() if v is not None}
        try:
            return cls(**values)
        except ValidationError as exc:
            if exc.field in from_env and exc.field in _FIELD_ENV:
                raise ValidationError(_FIELD_ENV[exc.field], exc.message) from None
            raise


def _str_var(env: Mapping[str, str], name: str) -> str:
    return env[name]


def _seconds_var(env: Mapping[str, str], name: str) -> timedelta:
    return _duration_var(env, name, "seconds")


def _days_var(env: Mapping[str, str], name: str) -> timedelta:
    return _duration_var(env, name, "days")


def _duration_var(env: Mapping[str, str], name: str, unit: str) -> timedelta:
    """A duration in `unit` (seconds, days) from a variable; names the variable when it is not one."""
    try:
        return timedelta(**{unit: float(env[name])})
    except (ValueError, OverflowError):
        raise ValidationError(name, f"expected {unit}, got {env[name]!r}") from None


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValidationError(name, f"expected an integer, got {env[name]!r}") from None


def _bool_var(env: Mapping[str, str], name: str) -> bool:
    value = env[name].strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValidationError(name, f"expected 1/0 (true/false), got {env[name]!r}")


# variable -> Config field, and how its text is read (Config.from_env; each names the variable when it is wrong)
_ENV_FIELDS = (
    (ENV_MAX_BODY, "max_body_bytes", _int_var),
    (ENV_CACHE, "prediction_cache_size", _int_var),
    (ENV_DEBOUNCE, "refit_debounce", _seconds_var),
    (ENV_ADMIN_TOKEN, "admin_token", _str_var),
    (ENV_MUNGE, "munge_auth", _bool_var),
    (ENV_MUNGE_SOCKET, "munge_socket", _str_var),
    (ENV_MUNGE_IN_PROCESS, "munge_in_process", _bool_var),
    (ENV_SLURM_CONF, "slurm_conf", _str_var),
    (ENV_JOB_RECENT, "job_recent", _seconds_var),
    (ENV_READ_AUTH, "read_auth", _bool_var),
    (ENV_PLAN_CACHE_TTL, "plan_cache_ttl", _seconds_var),
    (ENV_CACHE_BYTES, "prediction_cache_bytes", _int_var),
    (ENV_DECISIONS_KEEP, "decisions_keep", _int_var),
    (ENV_DECISIONS_MAX_AGE, "decisions_max_age", _days_var),
    (ENV_DECISIONS_MAX_BYTES, "decisions_max_bytes", _int_var),
    (ENV_DECISIONS_UNCLAIMED_MAX_AGE, "decisions_unclaimed_max_age", _seconds_var),
    (ENV_JOB_WRITE_QUOTA, "job_write_quota_bytes", _int_var),
    (ENV_TOKEN_WRITE_QUOTA, "token_write_quota_bytes", _int_var),
    (ENV_REPLAY_DIR, "replay_dir", _str_var),
)
