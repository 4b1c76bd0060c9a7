"""The service's frozen configuration, built once by an entry point (CLI or WSGI factory).

Nothing else in the package reads the environment: `Config.from_env` is the one place that turns
`ELASTIC_PREDICTOR_*` variables and the cluster file into values, and everything downstream receives
the frozen object.

Environment (read only by `Config.from_env`):
    ELASTIC_PREDICTOR_TOKEN       bearer token required for writes (unset or empty: writes are open)
    ELASTIC_PREDICTOR_DB          SQLite path (default `predictor.db`)
    ELASTIC_PREDICTOR_CLUSTER     JSON cluster model file (default: the built-in local testbed)
    ELASTIC_PREDICTOR_MAX_BODY    request body cap in bytes (default 4 MiB)
    ELASTIC_PREDICTOR_REFIT_DEBOUNCE_S   seconds to coalesce new observations before a refit (default 1)
    ELASTIC_PREDICTOR_CACHE_SIZE  prediction cache entries per worker (default 4096; 0 disables it)
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Mapping

from predictor.cluster import Cluster
from predictor.errors import ValidationError

ENV_TOKEN = "ELASTIC_PREDICTOR_TOKEN"
ENV_DB = "ELASTIC_PREDICTOR_DB"
ENV_CLUSTER = "ELASTIC_PREDICTOR_CLUSTER"
ENV_MAX_BODY = "ELASTIC_PREDICTOR_MAX_BODY"
ENV_DEBOUNCE = "ELASTIC_PREDICTOR_REFIT_DEBOUNCE_S"
ENV_CACHE = "ELASTIC_PREDICTOR_CACHE_SIZE"


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the service needs, fixed at start-up.

    Attributes:
        db_path: SQLite database file.
        token: bearer token for writes; None leaves writes open (a warning case, for tests and labs).
        cluster: the cluster model used to enumerate candidate layouts.
        max_body_bytes: requests with a larger body get 413.
        refit_debounce: how long new observations are coalesced before the background refit.
        refit_poll: how often each worker checks the store for data written by other workers.
        refit_min_interval: least time between the end of one fit and the start of the next, so a steady
            stream of observations cannot keep a worker fitting all the time.
        prediction_cache_size: entries in the per-model-version prediction cache.
        default_min_efficiency: scaling-efficiency threshold when the directives give none.
        max_plan_candidates: cap on the layouts one /v1/plan or /v1/predict evaluates.
    """

    db_path: str = "predictor.db"
    token: str | None = None
    cluster: Cluster = dataclasses.field(default_factory=Cluster.default)
    max_body_bytes: int = 4 * 1024 * 1024
    refit_debounce: timedelta = timedelta(seconds=1)
    refit_poll: timedelta = timedelta(seconds=2)
    refit_min_interval: timedelta = timedelta(seconds=5)
    prediction_cache_size: int = 4096
    default_min_efficiency: float = 0.5
    max_plan_candidates: int = 512

    def __post_init__(self):
        if self.max_body_bytes < 1024:
            raise ValidationError("max_body_bytes", f"must be at least 1024, got {self.max_body_bytes}")
        if not 0.0 <= self.default_min_efficiency <= 1.0:
            raise ValidationError("default_min_efficiency", "must lie in [0, 1]")
        if self.prediction_cache_size < 0:
            raise ValidationError("prediction_cache_size", "must be >= 0")
        if self.refit_debounce < timedelta(0) or self.refit_min_interval < timedelta(0) or self.refit_poll <= timedelta(0):
            raise ValidationError("refit_debounce", "debounce and min interval must be >= 0, poll > 0")

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
        if env.get(ENV_MAX_BODY):
            values["max_body_bytes"] = _int_var(env, ENV_MAX_BODY)
        if env.get(ENV_CACHE):
            values["prediction_cache_size"] = _int_var(env, ENV_CACHE)
        if env.get(ENV_DEBOUNCE):
            try:
                values["refit_debounce"] = timedelta(seconds=float(env[ENV_DEBOUNCE]))
            except ValueError:
                raise ValidationError(ENV_DEBOUNCE, f"expected seconds, got {env[ENV_DEBOUNCE]!r}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValidationError(name, f"expected an integer, got {env[name]!r}") from None
