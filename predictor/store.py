"""The history store: the only module that touches SQLite (sqlite-utils; the bare connection for decisions).

Tables (explicit schema, created by named migrations recorded in `migrations`):
    profiles      name -> JSON body of a tensor profile
    observations  collective, step, ddp_overhead and restart records (JSON body plus indexed kind/profile/gpu/link)
    decisions     the /v1/plan answers with their validated requests (id `d-<n>`), pruned on write to the
                  newest rows, age and bytes a `DecisionRetention` allows (meta `decision_bytes` counts them)
    link_fits     per-link statistics of the last fitted communication model
    meta          `generation`: bumped by every write that changes what the models are fitted on
    models        the fitted models (`version` = the generation fitted on, a JSON document), newest few only;
                  written by the one process that holds the fit lock, read by every worker (predictor.service)
    fit_failures  the fits that failed (`version`, error text), newest few only, so every worker can say why

Durability: WAL journal with `synchronous=NORMAL`. In WAL mode NORMAL never corrupts the database and
survives an application crash: a COMMIT has written the transaction's frames to the WAL file (the OS
page cache) before the HTTP answer leaves, so a SIGKILLed worker or master loses no acknowledged write;
tests/unit/test_store_durability.py kills `elastic-predictor serve` during a burst of writes and checks
exactly that (tests/unit/test_plan_path.py does the same for /v1/plan decisions). Only a power loss or OS crash can roll back the last few committed transactions. Observations are re-sent telemetry and decisions are an audit trail, so losing the final
milliseconds on power loss is acceptable, while FULL would add an fsync to every POST and /v1/plan on
the request path. Each thread gets its own connection (gunicorn workers are processes; the refit
thread reads beside the request thread), and a busy timeout lets several workers write in turn.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, NamedTuple

import sqlite_utils

from predictor import lockholder
from predictor.errors import NotFoundError
from slurm_plugin.contracts.records import FITTED


def _m0001_initial(db: sqlite_utils.Database) -> None:
    db.table("profiles").create({"name": str, "body": str, "created_at_s": float, "updated_at_s": float},
                                pk="name", not_null={"body", "created_at_s", "updated_at_s"})
    db.table("observations").create(
        {"id": int, "kind": str, "profile": str, "gpu": str, "link": str, "body": str, "created_at_s": float},
        pk="id", not_null={"kind", "body", "created_at_s"})
    db.table("observations").create_index(["kind"], index_name="observations_kind")
    db.table("observations").create_index(["profile", "gpu"], index_name="observations_profile_gpu")
    db.table("decisions").create(
        {"id": int, "created_at_s": float, "source": str, "action": str, "model": str, "reason": str,
         "model_version": str, "request": str, "response": str},
        pk="id", not_null={"created_at_s", "action", "reason", "request", "response"})


def _m0002_link_fits_and_generation(db: sqlite_utils.Database) -> None:
    db.table("link_fits").create({"id": int, "model_version": str, "link": str, "stats": str, "fitted_at_s": float},
                                 pk="id", not_null={"model_version", "stats", "fitted_at_s"})
    db.table("meta").create({"key": str, "value": int}, pk="key", not_null={"value"})
    db.table("meta").insert({"key": "generation", "value": 0})


def _m0003_models(db: sqlite_utils.Database) -> None:
    # the blob last: a check reads version, code and fitted_at_s without walking the blob's overflow pages
    db.table("models").create({"version": int, "code": str, "fitted_at_s": float, "fit_s": float, "blob": bytes},
                              pk="version", not_null={"code", "fitted_at_s", "fit_s", "blob"})
    db.table("fit_failures").create({"version": int, "error": str, "failed_at_s": float},
                                    pk="version", not_null={"error", "failed_at_s"})


def _m0004_decision_bytes(db: sqlite_utils.Database) -> None:
    # the bytes of request and response text the decisions hold, kept up to date by every insert and prune
    db.execute("INSERT INTO meta (key, value) SELECT 'decision_bytes', COALESCE(SUM("
               "length(CAST(request AS BLOB)) + length(CAST(response AS BLOB))), 0) FROM decisions")


def _m0005_write_keys(db: sqlite_utils.Database) -> None:
    # idempotency keys of observation writes (#24.13): a retried POST with the same key stores nothing again
    db.table("write_keys").create({"caller": str, "key": str, "first_id": int, "last_id": int, "generation": int,
                                   "created_at_s": float}, pk=("caller", "key"),
                                  not_null={"first_id", "last_id", "generation", "created_at_s"})
    db.table("write_keys").create_index(["created_at_s"])


def _m0010_write_key_digests(db: sqlite_utils.Database) -> None:
    # the body each idempotency key was first used with (#41.8): a reused key with another body is refused
    db.execute("ALTER TABLE write_keys ADD COLUMN digest TEXT NOT NULL DEFAULT ''")


def _m0011_write_quotas(db: sqlite_utils.Database) -> None:
    # the observation bytes each credential stored (#41.3): a job's in all (period 0), the tool token's per UTC day
    db.execute("CREATE TABLE write_quotas (owner TEXT NOT NULL, period INTEGER NOT NULL, bytes INTEGER NOT NULL, "
               "updated_at_s REAL NOT NULL, PRIMARY KEY (owner, period))")


def _m0012_observation_summary(db: sqlite_utils.Database) -> None:
    # the rows stored per (kind, profile, GPU, link, layout), kept by every observation write (#41.3: /admin, /healthz
    # and /metrics counted and parsed every row: 59 ms -> 1.9 s after one job's 102,400 rows); '' for none
    db.execute("CREATE TABLE observation_summary (kind TEXT NOT NULL, profile TEXT NOT NULL, gpu TEXT NOT NULL, "
               "link TEXT NOT NULL, layout TEXT NOT NULL, rows INTEGER NOT NULL, "
               "PRIMARY KEY (kind, profile, gpu, link, layout))")
    db.execute("INSERT INTO observation_summary SELECT kind, COALESCE(profile, ''), COALESCE(gpu, ''), "
               "COALESCE(link, ''), CASE kind WHEN 'step' THEN COALESCE(json_extract(body, '$.layout'), '') "
               "ELSE '' END, COUNT(*) FROM observations GROUP BY 1, 2, 3, 4, 5")


def _m0006_decision_clients(db: sqlite_utils.Database) -> None:
    # who asked for each decision (#24.9): one client's decisions are pruned within its share of the budget
    db.execute("ALTER TABLE decisions ADD COLUMN client TEXT NOT NULL DEFAULT ''")
    db.execute("CREATE INDEX decisions_by_client ON decisions (client, id)")
    db.execute("CREATE TABLE decision_clients (client TEXT PRIMARY KEY, rows INTEGER NOT NULL, bytes INTEGER NOT NULL)")
    db.execute("INSERT INTO decision_clients SELECT client, COUNT(*), COALESCE(SUM(length(CAST(request AS BLOB)) + "
               "length(CAST(response AS BLOB))), 0) FROM decisions GROUP BY client")
    # the rows the decisions hold, kept up to date like decision_bytes (a prune reads it in O(1))
    db.execute("INSERT INTO meta (key, value) SELECT 'decision_rows', COUNT(*) FROM decisions")


def _m0007_profile_owners(db: sqlite_utils.Database) -> None:
    # who made each profile (a job's uid; NULL for the tool and admin tokens) and its size: per-user quotas (#24.6)
    db.execute("ALTER TABLE profiles ADD COLUMN owner INTEGER")
    db.execute("ALTER TABLE profiles ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")
    db.execute("UPDATE profiles SET bytes = length(CAST(body AS BLOB))")
    db.execute("CREATE INDEX profiles_by_owner ON profiles (owner)")


def _m0008_job_claims(db: sqlite_utils.Database) -> None:
    # the step seconds each signed job's rows claim (#24.1): a job's rows together cannot claim more steps than
    # it ran for
    db.execute("CREATE TABLE job_claims (job_id INTEGER PRIMARY KEY, step_s REAL NOT NULL)")


def _m0009_profile_summaries(db: sqlite_utils.Database) -> None:
    # what a listing shows of each profile, apart from its body (#24.6: listing 4 profiles of 3.9 MB parsed all their
    # tensor lists, 743 ms a request): a row of its own, so a listing never reads a body's overflow pages
    db.execute("CREATE TABLE profile_summaries (name TEXT PRIMARY KEY, owner INTEGER, bytes INTEGER NOT NULL, "
               "created_at_s REAL NOT NULL, updated_at_s REAL NOT NULL, summary TEXT NOT NULL)")
    db.execute("CREATE INDEX profile_summaries_by_owner ON profile_summaries (owner)")
    for name, body, created, updated, owner, size in db.execute(
            "SELECT name, body, created_at_s, updated_at_s, owner, bytes FROM profiles").fetchall():
        db.execute("INSERT INTO profile_summaries (name, owner, bytes, created_at_s, updated_at_s, summary) "
                   "VALUES (?, ?, ?, ?, ?, ?)", [name, owner, size, created, updated,
                                                 json.dumps(profile_summary(json.loads(body)))])


def profile_summary(body: dict) -> dict:
    """What a listing shows of a stored profile body: tensor and bucket counts, parameters, gradient bytes, source
    (bodies are validated before they are stored; one that is not parses to zeros)."""
    tensors = body.get("tensors") if isinstance(body, dict) else None
    buckets = body.get("buckets_bytes") if isinstance(body, dict) else None
    tensors = tensors if isinstance(tensors, list) else []
    buckets = buckets if isinstance(buckets, list) else []
    number = (int, float)
    return {"tensors": len(tensors),
            "params": int(sum(t.get("numel", 0) for t in tensors if isinstance(t, dict)
                              and isinstance(t.get("numel"), number))),
            "grad_bytes": int(sum(b for b in buckets if isinstance(b, number))), "buckets": len(buckets),
            "source": str(body.get("source", "api")) if isinstance(body, dict) else "api"}


def _m0013_models_json(db: sqlite_utils.Database) -> None:
    """Stored models are JSON documents now (predictor.service.FittedModel.blob): an older release's pickles are
    deleted, never unpickled; the fitter fits the stored history again."""
    db.execute("DELETE FROM models WHERE substr(blob, 1, 1) != X'7B'")   # not '{'


WRITE_KEY_TTL_S = 24 * 3600.0  # a retry comes within seconds; a day bounds the table
QUOTA_KEEP_S = 2 * 24 * 3600.0  # a credential's quota row not written for this long is forgotten (a job's ends)


def encode(document: Any) -> str:
    """Compact JSON text, byte for byte what Flask's `jsonify` sends; NaN and Infinity raise ValueError."""
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def _m0014_unclaimed_decisions(db: sqlite_utils.Database) -> None:
    # #42.6: a decision job_submit asked for is unclaimed until a job is seen holding it (job_submit cannot tell
    # `sbatch --test-only`: no job follows); unclaimed ones expire (DecisionRetention.unclaimed_max_age)
    db.execute("ALTER TABLE decisions ADD COLUMN unclaimed INTEGER NOT NULL DEFAULT 0")
    db.execute("CREATE INDEX decisions_unclaimed ON decisions (unclaimed, id)")


_DECISION_COLUMNS = "id, created_at_s, source, action, model, reason, model_version, request, response, unclaimed"

MIGRATIONS: list[tuple[str, Callable[[sqlite_utils.Database], None]]] = [
    ("0001_initial", _m0001_initial),
    ("0002_link_fits_and_generation", _m0002_link_fits_and_generation),
    ("0003_models", _m0003_models),
    ("0004_decision_bytes", _m0004_decision_bytes),
    ("0005_write_keys", _m0005_write_keys),
    ("0006_decision_clients", _m0006_decision_clients),
    ("0007_profile_owners", _m0007_profile_owners),
    ("0008_job_claims", _m0008_job_claims),
    ("0009_profile_summaries", _m0009_profile_summaries),
    ("0010_write_key_digests", _m0010_write_key_digests),
    ("0011_write_quotas", _m0011_write_quotas),
    ("0012_observation_summary", _m0012_observation_summary),
    ("0013_models_json", _m0013_models_json),
    ("0014_unclaimed_decisions", _m0014_unclaimed_decisions),
]
WAL_SIZE_LIMIT = 4 * 1024 * 1024  # bytes the WAL file keeps after a checkpoint (#24.6: it stayed at its 18 MB peak)
WRITE_POLL_S = 0.002  # a waiting writer tries the write lock again at most this long after a release (_begin_immediate)


def register_hint(name: str, db: str) -> str:
    """How to register an unknown profile, as the service and the CLI say it (a command that runs as shown)."""
    return (f"a job of it registers it at its first measurement (elastic-launch), or register it with POST "
            f"/v1/profiles or `elastic-predictor profile package.module:callable --name {name} --db {db}` (a "
            f"callable that builds the model)")


@dataclasses.dataclass(frozen=True)
class DecisionRetention:
    """How many /v1/plan decisions the store keeps; the oldest go first, pruned by the writes themselves.

    A decision is deleted once it is not among the newest `max_rows`, or older than `max_age`, or the
    decisions hold more than `max_bytes` of request and response text. Each decision counts for its owner
    (predictor.api.decision_owner: a signing job's user, a token, the hook from a `--hook-from` host per job user,
    else the anonymous address). When a size bound is reached, anonymous decisions go first, the largest anonymous
    client's oldest (#41.2: eight anonymous addresses, each under its share, erased every hook decision); then an
    owner holding more than `client_share` of the rows or bytes loses its own oldest, so one user's flood never
    evicts another's decisions (#24.9). Age prunes the oldest of anyone. A write that finds a bound passed
    deletes down to a slack below it (at most `batch_rows` rows, `batch_bytes` bytes or `max_age / 16` of
    age), so one write in many pays for a prune and none deletes more than a batch.

    Attributes:
        max_rows: decisions kept at most.
        max_age: decisions older than this are deleted.
        max_bytes: request and response text kept at most, in bytes.
        batch_rows: most rows one write deletes, and the row slack a prune leaves below `max_rows`.
        batch_bytes: the byte slack a prune leaves below `max_bytes`.
        client_share: the part of `max_rows` and `max_bytes` one client's decisions may hold.
        unclaimed_max_age: an unclaimed decision (asked by job_submit, no job seen holding it yet: it may have been
            `sbatch --test-only`'s, #42.6) older than this is deleted, a batch at a time.
    """

    max_rows: int = 100_000
    max_age: timedelta = timedelta(days=90)
    max_bytes: int = 512 * 1024 * 1024
    batch_rows: int = 256
    batch_bytes: int = 8 * 1024 * 1024
    client_share: float = 0.25
    unclaimed_max_age: timedelta = timedelta(days=1)

    def __post_init__(self):
        if self.max_rows < 1 or self.max_bytes < 1 or self.batch_rows < 1 or self.batch_bytes < 1:
            raise ValueError("decision retention bounds must be >= 1")
        if self.max_age <= timedelta(0) or self.unclaimed_max_age <= timedelta(0):
            raise ValueError("decision retention max_age and unclaimed_max_age must be > 0")
        if not 0 < self.client_share <= 1:
            raise ValueError("decision retention client_share must be in (0, 1]")

    @property
    def row_target(self) -> int:
        """Rows a prune leaves: a slack below `max_rows` that one batch (with the row just written) reaches."""
        return max(1, self.max_rows - min(self.batch_rows - 1, self.max_rows // 8))

    @property
    def byte_target(self) -> int:
        """Bytes a prune leaves at most (a slack below `max_bytes`)."""
        return self.max_bytes - min(self.batch_bytes, max(1, self.max_bytes // 8))

    @property
    def age_target(self) -> timedelta:
        """Age above which a prune deletes (a slack below `max_age`)."""
        return self.max_age - self.max_age / 16


class ModelHead(NamedTuple):
    """Which stored model is the newest, without its blob: what a worker compares on every check."""

    version: int          # the store generation the model was fitted on
    fitted_at_s: float    # tells a model stored again under the same version from the one already loaded
    code: str             # fingerprint of the code that fitted it (predictor.service.code_fingerprint)


class StoredModel(NamedTuple):
    head: ModelHead
    blob: bytes
    fit_s: float


class FitFailure(NamedTuple):
    version: int
    error: str
    failed_at_s: float


class QuotaExceeded(Exception):
    """A write that would take its owner past a quota (nothing was written)."""


class KeyReused(Exception):
    """An idempotency key stored with another body (``Store.write_observations``); nothing was written."""

    def __init__(self, key: str):
        super().__init__(f"key {key!r} was used with another body: a retry sends the same bytes, a new write a new key")


class ClaimExceeded(Exception):
    """A signed job's step rows would claim more seconds of steps than the job ran (``Store.write_observations``'s
    ``claim``); nothing of the write was stored."""

    def __init__(self, job_id: int, claimed_s: float, new_s: float, allowed_s: float):
        super().__init__(f"job {job_id}'s step rows would claim {claimed_s + new_s:.1f} s of steps (this post "
                         f"{new_s:.1f} s), it ran for {allowed_s:.1f} s: each row is at least one step")
        self.job_id, self.claimed_s, self.new_s, self.allowed_s = job_id, claimed_s, new_s, allowed_s


def claimed_seconds(record: dict) -> float:
    """Seconds of steps a validated record says its job ran: a step row one step of ``iter_s``, a ddp_overhead row
    one plain and one DDP step of its probe, a collective row none (a job's claim: ``write_observations``)."""
    if record["kind"] == "step":
        return float(record["iter_s"])
    if record["kind"] == "ddp_overhead":
        return float(record["plain_s"]) + float(record["ddp_s"])
    return 0.0


class WrittenObservations(NamedTuple):
    ids: list[int]
    generation: int       # the store generation right after the write: a model of this version includes it
    replayed: bool = False  # the write key was seen before: nothing was stored now, these are the first write's


class Store:
    """SQLite history behind a small API; safe to share between threads (one connection each).

    Args:
        path: database file (created if missing, mode 0600: it holds the fitted models as pickles that every worker
            loads, #41.9; SQLite gives its -wal and -shm files the same mode).
        busy_timeout: how long a write waits for another writer's lock.
        decision_retention: the bounds decision writes prune to; None keeps every decision (one-shot CLI
            commands, which must not prune by defaults the service was configured past).
    """

    def __init__(self, path: str, busy_timeout: timedelta = timedelta(seconds=10),
                 decision_retention: DecisionRetention | None = None):
        self.path = path
        self.busy_timeout = busy_timeout
        self.decision_retention = decision_retention
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._probe: tuple[float, str | None] | None = None  # (monotonic time, write_problem's answer)

    @property
    def db(self) -> sqlite_utils.Database:
        """This thread's database handle (opened on first use with WAL and synchronous=NORMAL)."""
        db = getattr(self._local, "db", None)
        if db is None:
            if self.path != ":memory:":
                with contextlib.suppress(FileExistsError):   # created here, owner-only, before SQLite opens it
                    os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout.total_seconds(), check_same_thread=False)
            db = sqlite_utils.Database(conn, execute_plugins=False)
            if db.journal_mode != "wal":
                db.enable_wal()
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            self._local.db = db
            with self._lock:
                self._all.append(conn)
        return db

    @contextlib.contextmanager
    def _write(self):
        """A write transaction taken with BEGIN IMMEDIATE.

        A deferred BEGIN that reads first and then writes cannot wait for another writer in WAL mode
        (SQLITE_BUSY at once); IMMEDIATE takes the write lock up front, so the busy timeout applies.
        Nested sqlite-utils calls inside use savepoints.
        """
        db = self.db
        self._begin_immediate(db)
        try:
            yield db
        except BaseException:
            db.rollback()
            raise
        db.conn.execute("COMMIT")

    def _transaction(self, body: Callable[[sqlite_utils.Database], Any]) -> Any:
        """``body(db)`` in one write transaction (`_write`), run in this process's lock holder thread where one
        was started (predictor.lockholder: the side pool's, so the write lock is never held at its nice 10 while
        the hook's /v1/plan waits for it), else in the calling thread. ``body`` must use the ``db`` it is given
        (the holder's own connection), and prepare what needs no lock before."""
        def transaction():
            with self._write() as db:
                return body(db)

        holder = lockholder.current()
        return transaction() if holder is None else holder.run(transaction)

    @contextlib.contextmanager
    def _read(self):
        """A read transaction: every SELECT inside sees the same committed state (a WAL snapshot)."""
        db = self.db
        db.conn.execute("BEGIN")
        try:
            yield db
        finally:
            db.conn.execute("ROLLBACK")

    def _begin_immediate(self, db: sqlite_utils.Database) -> None:
        """BEGIN IMMEDIATE, tried again every WRITE_POLL_S (at most) while another connection holds the lock.

        SQLite's own busy handler sleeps longer the longer it has waited (1, 2, 5, ... then 100 ms between
        tries), so under a stream of short writes from other processes a waiter that missed a few releases
        sleeps through many more: the hook's /v1/plan waited up to 0.3-0.5 s for its decision's INSERT while
        four token writers posted ~280 rows/s (#24.13, no worker killed). Here the connection's busy timeout is
        off while the lock is taken and this loop tries again within WRITE_POLL_S of a release; the timeout is
        back for everything inside the transaction. Nothing has been written when BEGIN fails, so retrying is
        safe; after `busy_timeout` in all the error goes up.
        """
        conn = db.conn
        deadline = time.monotonic() + self.busy_timeout.total_seconds()
        delay = WRITE_POLL_S / 8
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            while True:
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as exc:
                    message = str(exc).lower()
                    if ("locked" not in message and "busy" not in message) or time.monotonic() >= deadline:
                        raise
                time.sleep(delay)
                delay = min(delay * 2, WRITE_POLL_S)
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout.total_seconds() * 1000)}")

    def close(self) -> None:
        """Close every connection this store opened (any thread)."""
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
        self._local = threading.local()

    # --- schema ---------------------------------------------------------------------------------
    def migrate(self) -> list[str]:
        """Apply pending migrations, each in its own transaction; returns the names applied now."""
        db = self.db
        with self._write():
            db.table("migrations").create({"name": str, "applied_at_s": float}, pk="name", if_not_exists=True)
        done = self.migrations()
        applied = []
        for name, step in MIGRATIONS:
            if name in done:
                continue
            with self._write():
                if db.execute("SELECT 1 FROM migrations WHERE name = ?", [name]).fetchone():
                    continue                     # another worker applied it meanwhile
                step(db)
                db.table("migrations").insert({"name": name, "applied_at_s": time.time()})
            applied.append(name)
        return applied

    def migrations(self) -> list[str]:
        """Names of the migrations applied, in order."""
        return [row[0] for row in self.db.execute("SELECT name FROM migrations ORDER BY name").fetchall()]

    def write_problem(self, max_age: timedelta = timedelta(0)) -> str | None:
        """Why this store cannot be written, or None: a real write (one `meta` row) in its own transaction.

        A read-only file or a full disk does not stop the service from starting or reading; every write then
        failed with a 500. `serve` checks this at start, /healthz on every call.

        Args:
            max_age: answer from the last probe when it is younger than this.
        """
        now = time.monotonic()
        with self._lock:
            last = self._probe
        if last is not None and now - last[0] < max_age.total_seconds():
            return last[1]
        problem = None
        try:
            with self._write() as db:
                db.execute("INSERT INTO meta(key, value) VALUES('write_probe', ?) "
                           "ON CONFLICT(key) DO UPDATE SET value = excluded.value", [int(time.time())])
        except sqlite3.Error as exc:
            problem = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._probe = (now, problem)
        return problem

    def generation(self, db: sqlite_utils.Database | None = None) -> int:
        """A counter bumped by every write that changes the fitting data (profiles, observations)."""
        row = (self.db if db is None else db).execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
        return int(row[0]) if row else 0

    def _bump(self, db: sqlite_utils.Database | None = None) -> None:
        (self.db if db is None else db).execute("UPDATE meta SET value = value + 1 WHERE key = 'generation'")

    # --- profiles -------------------------------------------------------------------------------
    def put_profile(self, name: str, body: dict, owner: int | None = None,
                    quota: tuple[int, int] | None = None) -> bool:
        """Insert or replace a profile; True when it was new.

        Args:
            owner: who makes it: the uid of a job, None for a token (the site's). A new profile is its maker's;
                a replaced one becomes its replacer's (an admin replacing a user's profile makes it the site's).
                Who may replace whose is the API's decision (predictor.api.profiles.register).
            quota: ``(profiles, bytes)`` the owner may hold at most, checked in the same transaction.

        Raises:
            QuotaExceeded: the write would take the owner past ``quota``.
        """
        now = time.time()
        text = json.dumps(body, allow_nan=False)
        summary = json.dumps(profile_summary(body))

        def write(db: sqlite_utils.Database) -> bool:
            row = db.execute("SELECT created_at_s, owner, bytes FROM profile_summaries WHERE name = ?",
                             [name]).fetchone()
            if owner is not None and quota is not None:
                count, held = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM profile_summaries "
                                         "WHERE owner = ? AND name != ?", [owner, name]).fetchone()
                if count + 1 > quota[0] or held + len(text) > quota[1]:
                    raise QuotaExceeded(f"uid {owner} holds {count} profiles of {held} bytes; a new one of "
                                        f"{len(text)} bytes passes the quota of {quota[0]} profiles, {quota[1]} bytes")
            created = row[0] if row else now
            db.execute("INSERT INTO profiles (name, body, created_at_s, updated_at_s, owner, bytes) "
                       "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET body = excluded.body, "
                       "updated_at_s = excluded.updated_at_s, owner = excluded.owner, bytes = excluded.bytes",
                       [name, text, created, now, owner, len(text)])
            db.execute("INSERT INTO profile_summaries (name, owner, bytes, created_at_s, updated_at_s, summary) "
                       "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET owner = excluded.owner, "
                       "bytes = excluded.bytes, updated_at_s = excluded.updated_at_s, summary = excluded.summary",
                       [name, owner, len(text), created, now, summary])
            self._bump(db)
            return row is None

        return self._transaction(write)

    def profile_owner(self, name: str) -> tuple[bool, int | None]:
        """``(exists, owner)``: whether a profile of that name is stored, and its owner's uid (None: the site's,
        registered with a token or imported)."""
        row = self.db.execute("SELECT owner FROM profile_summaries WHERE name = ?", [name]).fetchone()
        return (False, None) if row is None else (True, row[0])

    def profile_summaries(self, limit: int | None = None, after: str | None = None) -> list[dict]:
        """Profiles by name without their bodies: ``{"name", "owner", "bytes", "created_at_s", "updated_at_s",
        "tensors", "params", "grad_bytes", "buckets", "source"}``; ``after`` pages on from a name."""
        sql, params = _select("SELECT name, owner, bytes, created_at_s, updated_at_s, summary FROM profile_summaries",
                              ("name > ?", after), "name", limit)
        return [{"name": n, "owner": o, "bytes": b, "created_at_s": c, "updated_at_s": u, **json.loads(summary)}
                for n, o, b, c, u, summary in self.db.execute(sql, params)]

    def get_profile(self, name: str) -> dict:
        """The stored profile body.

        Raises:
            NotFoundError: no profile of that name.
        """
        row = self.db.execute("SELECT body FROM profiles WHERE name = ?", [name]).fetchone()
        if row is None:
            raise NotFoundError("profile", name, register_hint(name, self.path))
        return json.loads(row[0])

    def has_profile(self, name: str) -> bool:
        return self.db.execute("SELECT 1 FROM profiles WHERE name = ?", [name]).fetchone() is not None

    def list_profiles(self) -> list[dict]:
        """Every profile as `{"name", "created_at_s", "updated_at_s", "body"}`, by name."""
        rows = self.db.execute("SELECT name, created_at_s, updated_at_s, body FROM profiles ORDER BY name")
        return [{"name": n, "created_at_s": c, "updated_at_s": u, "body": json.loads(b)} for n, c, u, b in rows]

    # --- observations ---------------------------------------------------------------------------
    def add_observations(self, records: Iterable[dict]) -> list[int]:
        """Store validated records in one transaction (all or nothing); returns their ids."""
        return self.write_observations(records).ids

    def write_observations(self, records: Iterable[dict], key: tuple[str, str, str] | None = None,
                           claim: tuple[int, float] | None = None,
                           quota: tuple[str, int, int] | None = None) -> WrittenObservations:
        """Store validated records in one transaction (all or nothing); returns their ids and the generation
        the write produced (read inside the same transaction, so another writer cannot move it in between).

        Args:
            key: ``(caller, idempotency key, body digest)``: a write with a key stored before (within
                ``WRITE_KEY_TTL_S``) and the same digest stores nothing and returns the first write's answer,
                ``replayed`` set.
            claim: ``(job id, seconds it ran)`` for a signed job's write: its step rows (each at least one step of
                ``iter_s``) and ddp_overhead rows (one plain and one DDP step of the probe each), with all it stored
                before, may claim at most that many seconds of steps.
            quota: ``(owner, period, bytes)``: the rows' stored JSON, with what ``owner`` stored before in ``period``,
                may take at most that many bytes (#41.3); rows of periods not written for ``QUOTA_KEEP_S`` are
                forgotten.

        Raises:
            ClaimExceeded: the claim would pass the job's run time (nothing stored).
            KeyReused: the key was stored with another body's digest (nothing stored; #41.8).
            QuotaExceeded: the rows would take ``quota``'s owner past its bytes (nothing stored).
        """
        now = time.time()
        records = list(records)
        rows = [(r["kind"], r.get("profile"), r.get("gpu"), r.get("link"), json.dumps(r, allow_nan=False), now)
                for r in records]
        new_s = sum(claimed_seconds(r) for r in records)
        fitted = any(r["kind"] in FITTED for r in records)
        new_bytes = sum(len(row[4].encode()) for row in rows)
        summary: dict[tuple, int] = {}
        for r in records:
            layout = json.dumps(r.get("layout"), separators=(",", ":")) if r["kind"] == "step" and r.get("layout") \
                is not None else ""
            k = (r["kind"], r.get("profile") or "", r.get("gpu") or "", r.get("link") or "", layout)
            summary[k] = summary.get(k, 0) + 1

        def write(db: sqlite_utils.Database) -> WrittenObservations:
            if key is not None:
                db.execute("DELETE FROM write_keys WHERE created_at_s < ?", [now - WRITE_KEY_TTL_S])
                seen = db.execute("SELECT first_id, last_id, generation, digest FROM write_keys WHERE caller = ? "
                                  "AND key = ?", list(key[:2])).fetchone()
                if seen is not None and seen[3] not in ("", key[2]):    # '': stored before digests were kept
                    raise KeyReused(key[1])
                if seen is not None:
                    return WrittenObservations(list(range(seen[0], seen[1] + 1)), seen[2], True)
            if quota is not None:
                owner, period, most = quota
                db.execute("DELETE FROM write_quotas WHERE updated_at_s < ?", [now - QUOTA_KEEP_S])
                found = db.execute("SELECT bytes FROM write_quotas WHERE owner = ? AND period = ?",
                                   [owner, period]).fetchone()
                held = found[0] if found is not None else 0
                if held + new_bytes > most:
                    raise QuotaExceeded(f"{owner} stored {held} bytes of observations"
                                        f"{' today (UTC)' if period else ''}; these {new_bytes} more would pass its "
                                        f"quota of {most}")
                db.execute("INSERT INTO write_quotas (owner, period, bytes, updated_at_s) VALUES (?, ?, ?, ?) "
                           "ON CONFLICT (owner, period) DO UPDATE SET bytes = bytes + excluded.bytes, "
                           "updated_at_s = excluded.updated_at_s", [owner, period, new_bytes, now])
            if claim is not None and new_s > 0:
                job_id, allowed_s = claim
                found = db.execute("SELECT step_s FROM job_claims WHERE job_id = ?", [job_id]).fetchone()
                claimed_s = found[0] if found is not None else 0.0
                if claimed_s + new_s > allowed_s:
                    raise ClaimExceeded(job_id, claimed_s, new_s, allowed_s)
                db.execute("INSERT INTO job_claims (job_id, step_s) VALUES (?, ?) ON CONFLICT (job_id) DO UPDATE "
                           "SET step_s = step_s + excluded.step_s", [job_id, new_s])
            # one statement for all rows (the lock is held for the inserts alone); under the write lock nobody
            # else inserts, and an INTEGER PRIMARY KEY takes MAX(id) + 1, so the ids are first .. first + n - 1
            first = db.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM observations").fetchone()[0]
            db.conn.executemany("INSERT INTO observations (kind, profile, gpu, link, body, created_at_s) "
                                "VALUES (?, ?, ?, ?, ?, ?)", rows)
            ids = list(range(first, first + len(rows)))
            db.conn.executemany("INSERT INTO observation_summary (kind, profile, gpu, link, layout, rows) VALUES "
                                "(?, ?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET rows = rows + excluded.rows",
                                [(*k, n) for k, n in summary.items()])
            if fitted:   # a write of restart costs alone changes no model: no refit for it
                self._bump(db)
            generation = self.generation(db)
            if key is not None and ids:
                db.execute("INSERT INTO write_keys (caller, key, first_id, last_id, generation, created_at_s, digest) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?)", [*key[:2], ids[0], ids[-1], generation, now, key[2]])
            return WrittenObservations(ids, generation)

        return self._transaction(write)

    def observations(self, kind: str | None = None, limit: int | None = None, newest: bool = False) -> list[dict]:
        """Stored records (oldest first), optionally of one kind, each with its `id`; `newest`: the newest `limit`
        of them (still oldest first)."""
        sql, params = _select("SELECT id, body FROM observations", ("kind = ?", kind), "id DESC" if newest else "id",
                              limit)
        rows = [dict(json.loads(body), id=oid) for oid, body in self.db.execute(sql, params)]
        return rows[::-1] if newest else rows

    def step_pairs(self) -> set[tuple[str, str]]:
        """The (profile, GPU type) pairs that have step records."""
        rows = self.db.execute("SELECT DISTINCT profile, gpu FROM observations WHERE kind = 'step'").fetchall()
        return {(profile, gpu) for profile, gpu in rows}

    def observation_counts(self) -> dict[str, int]:
        """Rows stored per kind, from the summary the writes keep (O(distinct keys), not O(rows): #41.3)."""
        rows = self.db.execute("SELECT kind, SUM(rows) FROM observation_summary GROUP BY kind").fetchall()
        return {"collective": 0, "step": 0, "ddp_overhead": 0, **{k: n for k, n in rows}}

    def observation_summary(self, kind: str) -> list[dict]:
        """Rows stored of `kind` per (profile, gpu, link, layout): each a dict with those (None for none; `layout` a
        list) and `rows`."""
        out = []
        for profile, gpu, link, layout, n in self.db.execute(
                "SELECT profile, gpu, link, layout, rows FROM observation_summary WHERE kind = ?", [kind]):
            out.append({"profile": profile or None, "gpu": gpu or None, "link": link or None,
                        "layout": json.loads(layout) if layout else None, "rows": n})
        return out

    # --- decisions ------------------------------------------------------------------------------
    def add_decision(self, request: dict, response: dict, source: str | None, model_version: str | None,
                     client: str = "", unclaimed: bool = False) -> dict:
        """Store a plan decision; returns the response with `decision_id` (`d-<n>`) filled in."""
        return json.loads(self.add_decision_text(encode(request), response, source, model_version, client,
                                                 unclaimed))

    def add_decision_text(self, request_text: str, response: dict, source: str | None,
                          model_version: str | None, client: str = "", unclaimed: bool = False) -> str:
        """Store a plan decision whose request is already JSON text; returns the stored response text.

        The hot path of /v1/plan: the response is encoded once (compact, as Flask sends JSON), the
        `decision_id` is spliced in front and the same text is both stored and sent, in one INSERT of a
        transaction that commits before this returns (durable against SIGKILL, see the module doc). The id is
        the next rowid, read under the write lock (`d-<max+1>`, what a plain INSERT would assign). `unclaimed`:
        no job is known to hold it yet (:meth:`claim_decisions`).

        Raises:
            ValueError: the response holds NaN or Infinity (nothing stored).
        """
        tail = encode(response)[1:]          # '"action":...}': the response always has action and reason

        def write(db: sqlite_utils.Database) -> str:
            conn = db.conn
            now = time.time()
            number = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM decisions").fetchone()[0]
            full = f'{{"decision_id":"d-{number}",' + tail
            conn.execute("INSERT INTO decisions (id, created_at_s, source, action, model, reason, model_version,"
                         " request, response, client, unclaimed) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (number, now, source, response["action"], response.get("model"),
                          response["reason"], model_version, request_text, full, client, int(unclaimed)))
            added = len(request_text.encode("utf-8", "surrogatepass")) + len(full.encode("utf-8", "surrogatepass"))
            conn.execute("UPDATE meta SET value = value + CASE key WHEN 'decision_bytes' THEN ? ELSE 1 END "
                         "WHERE key IN ('decision_bytes', 'decision_rows')", (added,))
            conn.execute("INSERT INTO decision_clients (client, rows, bytes) VALUES (?, 1, ?) ON CONFLICT(client) "
                         "DO UPDATE SET rows = rows + 1, bytes = bytes + excluded.bytes", (client, added))
            if self.decision_retention is not None:
                self._prune_decisions(conn, number, now, self.decision_retention)
                self._expire_unclaimed(conn, number, now, self.decision_retention)
            return full

        return self._transaction(write)

    def claim_decisions(self, ids: list[str], client: str) -> int:
        """Marks the unclaimed decisions among ``ids`` (``d-<n>``; others ignored) that ``client`` asked for as a
        job's (the hook saw a job holding each); returns how many it marked. The hook (``hook:uid:<uid>``) claims
        any hook decision: it asks for every user's jobs."""
        numbers = [int(i[2:]) for i in ids if i.startswith("d-") and i[2:].isascii() and i[2:].isdigit()
                   and len(i) <= 20]
        if not numbers:
            return 0

        def write(db: sqlite_utils.Database) -> int:
            marks = ",".join("?" * len(numbers))
            whose = "client LIKE 'hook:%'" if client.startswith("hook:") else "client = ?"
            return db.conn.execute(f"UPDATE decisions SET unclaimed = 0 WHERE unclaimed = 1 AND {whose} AND id IN "
                                   f"({marks})", ([] if client.startswith("hook:") else [client]) + numbers).rowcount

        return self._transaction(write)

    @classmethod
    def _expire_unclaimed(cls, conn: sqlite3.Connection, newest: int, now: float, keep: DecisionRetention) -> int:
        """Inside a decision's write: deletes unclaimed decisions older than ``keep.unclaimed_max_age`` (one batch
        at most, never the decision just written); returns the rows deleted."""
        cutoff = now - keep.unclaimed_max_age.total_seconds()
        oldest = conn.execute("SELECT created_at_s FROM decisions WHERE unclaimed = 1 ORDER BY id LIMIT 1").fetchone()
        if oldest is None or oldest[0] >= cutoff:  # the common case: one index probe
            return 0
        rows = []
        for row in conn.execute("SELECT id, length(CAST(request AS BLOB)) + length(CAST(response AS BLOB)), client, "
                                "created_at_s FROM decisions WHERE unclaimed = 1 AND id < ? ORDER BY id LIMIT ?",
                                (newest, keep.batch_rows)):
            if row[3] >= cutoff:
                break
            rows.append(row)
        if rows:
            conn.execute(f"DELETE FROM decisions WHERE id IN ({','.join('?' * len(rows))})", [r[0] for r in rows])
            cls._forget(conn, [(who, size) for _, size, who, _ in rows])
        return len(rows)

    @staticmethod
    def _forget(conn: sqlite3.Connection, deleted: list[tuple[str, int]]) -> None:
        """Counters after deleting decisions given as (client, bytes)."""
        by_client: dict[str, list[int]] = {}
        for who, size in deleted:
            entry = by_client.setdefault(who, [0, 0])
            entry[0] += 1
            entry[1] += size
        for who, (rows, size) in by_client.items():
            conn.execute("UPDATE decision_clients SET rows = MAX(0, rows - ?), bytes = MAX(0, bytes - ?) "
                         "WHERE client = ?", (rows, size, who))
        conn.execute("DELETE FROM decision_clients WHERE rows = 0")
        conn.execute("UPDATE meta SET value = MAX(0, value - CASE key WHEN 'decision_bytes' THEN ? ELSE ? END) "
                     "WHERE key IN ('decision_bytes', 'decision_rows')",
                     (sum(size for _, size in deleted), len(deleted)))

    @classmethod
    def _prune_decisions(cls, conn: sqlite3.Connection, newest: int, now: float, keep: DecisionRetention) -> int:
        """Inside a decision's write: when a bound of `keep` is passed, delete the oldest decisions down to its
        targets (one batch at most, never the decision just written); returns the rows deleted."""
        oldest = conn.execute("SELECT id, created_at_s FROM decisions ORDER BY id LIMIT 1").fetchone()
        counts = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('decision_bytes', 'decision_rows')"))
        held, rows = counts.get("decision_bytes", 0), counts.get("decision_rows", 0)
        too_old = oldest[1] < now - keep.max_age.total_seconds()
        if rows <= keep.max_rows and held <= keep.max_bytes and not too_old:
            return 0
        # a size bound: anonymous decisions go first (the largest anonymous client's oldest: #41.2, anonymous traffic
        # never evicts a signed or the hook's decision), then the largest owner over its share
        victim = None if too_old else cls._largest_anonymous(conn) or cls._over_share(conn, keep)
        only = " AND client = ?" if victim is not None else ""
        params = (newest, victim, keep.batch_rows) if victim is not None else (newest, keep.batch_rows)
        cutoff = now - keep.age_target.total_seconds()
        last, freed = None, 0
        deleted: list[tuple[str, int]] = []
        for oid, created, size, who in conn.execute(
                "SELECT id, created_at_s, length(CAST(request AS BLOB)) + length(CAST(response AS BLOB)), client "
                f"FROM decisions WHERE id < ?{only} ORDER BY id LIMIT ?", params):
            if rows - len(deleted) <= keep.row_target and held - freed <= keep.byte_target and created >= cutoff:
                break
            last, freed = oid, freed + size
            deleted.append((who, size))
        if last is None:
            return 0
        conn.execute(f"DELETE FROM decisions WHERE id <= ?{only}", (last, victim) if victim is not None else (last,))
        cls._forget(conn, deleted)
        return len(deleted)

    @staticmethod
    def _largest_anonymous(conn: sqlite3.Connection) -> str | None:
        """The anonymous client (`addr:...`, or a bare address stored before #41.2) holding the most bytes."""
        row = conn.execute("SELECT client FROM decision_clients WHERE client NOT LIKE 'uid:%' AND client NOT LIKE "
                           "'hook:%' AND client NOT LIKE 'token:%' ORDER BY bytes DESC LIMIT 1").fetchone()
        return row[0] if row else None

    @staticmethod
    def _over_share(conn: sqlite3.Connection, keep: DecisionRetention) -> str | None:
        """The client holding the largest part of the budget (rows or bytes), if more than its share."""
        best, part = None, keep.client_share
        for who, rows, size in conn.execute("SELECT client, rows, bytes FROM decision_clients"):
            held = max(rows / keep.max_rows, size / keep.max_bytes)
            if held > part:
                best, part = who, held
        return best

    def decision_bytes(self) -> int:
        """Bytes of request and response text the stored decisions hold (what `DecisionRetention.max_bytes`
        bounds)."""
        row = self.db.execute("SELECT value FROM meta WHERE key = 'decision_bytes'").fetchone()
        return int(row[0]) if row else 0

    def get_decision(self, decision_id: str) -> dict:
        """One decision with its request and response.

        Raises:
            NotFoundError: malformed or unknown id.
        """
        hint = "ids look like d-42; list them with GET /v1/decisions"
        number = decision_id[2:] if decision_id.startswith("d-") else ""
        if not (number.isascii() and number.isdigit()) or len(number) > 18:   # '\u00b2'.isdigit() (#41.9)
            raise NotFoundError("decision", decision_id, hint)
        row = self.db.execute(f"SELECT {_DECISION_COLUMNS} FROM decisions WHERE id = ?", [int(number)]).fetchone()
        if row is None:
            raise NotFoundError("decision", decision_id, hint)
        return self._decision(row, full=True)

    def list_decisions(self, limit: int = 50, before: int | None = None) -> list[dict]:
        """Newest first; `before` pages down by numeric id."""
        sql = f"SELECT {_DECISION_COLUMNS} FROM decisions"
        params: list[Any] = []
        if before is not None:
            sql += " WHERE id < ?"
            params.append(before)
        sql += " ORDER BY id DESC LIMIT ?"
        params.append(limit)
        return [self._decision(row, full=False) for row in self.db.execute(sql, params).fetchall()]

    @staticmethod
    def _decision(row: tuple, full: bool) -> dict:
        oid, created, source, action, model, reason, version, request, response, unclaimed = row
        out = {"decision_id": f"d-{oid}", "created_at_s": created, "source": source, "action": action,
               "model": model, "reason": reason, "model_version": version, "unclaimed": bool(unclaimed)}
        if full:
            out["request"] = json.loads(request)
            out["response"] = json.loads(response)
        return out

    def fit_inputs(self) -> tuple[int, list[dict], list[dict]]:
        """(generation, profiles as `list_profiles` gives them, observations), read in one transaction: the
        generation names exactly the data returned, so a model fitted on it may carry that number."""
        with self._read():
            return self.generation(), self.list_profiles(), self.observations()

    # --- fitted models --------------------------------------------------------------------------
    def put_model(self, version: int, blob: bytes, code: str, fitted_at_s: float, fit_s: float,
                  keep: int = 3) -> None:
        """Store a fitted model (replacing one of the same version), keep only the newest `keep`, and drop the
        failures it supersedes; one transaction."""
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO models (version, blob, code, fitted_at_s, fit_s) VALUES (?, ?, ?, ?, ?)",
                       [version, sqlite3.Binary(blob), code, fitted_at_s, fit_s])
            db.execute("DELETE FROM models WHERE version NOT IN "
                       "(SELECT version FROM models ORDER BY version DESC LIMIT ?)", [max(1, keep)])
            db.execute("DELETE FROM fit_failures WHERE version <= ?", [version])

    def newest_model_head(self) -> ModelHead | None:
        """The newest stored model's version, fit time and code fingerprint (no blob: an index lookup)."""
        row = self.db.execute("SELECT version, fitted_at_s, code FROM models ORDER BY version DESC LIMIT 1").fetchone()
        return ModelHead(*row) if row else None

    def newest_model(self) -> StoredModel | None:
        """The newest stored model with its blob."""
        row = self.db.execute("SELECT version, fitted_at_s, code, blob, fit_s FROM models "
                              "ORDER BY version DESC LIMIT 1").fetchone()
        return StoredModel(ModelHead(*row[:3]), bytes(row[3]), row[4]) if row else None

    def add_fit_failure(self, version: int, error: str, keep: int = 3) -> None:
        """Record that fitting `version` failed (replacing an earlier record of it), keeping the newest few."""
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO fit_failures (version, error, failed_at_s) VALUES (?, ?, ?)",
                       [version, error, time.time()])
            db.execute("DELETE FROM fit_failures WHERE version NOT IN "
                       "(SELECT version FROM fit_failures ORDER BY version DESC LIMIT ?)", [max(1, keep)])

    def newest_fit_failure(self) -> FitFailure | None:
        row = self.db.execute("SELECT version, error, failed_at_s FROM fit_failures "
                              "ORDER BY version DESC LIMIT 1").fetchone()
        return FitFailure(*row) if row else None

    # --- link fits ------------------------------------------------------------------------------
    def replace_link_fits(self, model_version: str, stats: list[dict]) -> None:
        """Replace the stored per-link statistics with those of a new fit."""
        db = self.db
        now = time.time()
        with self._write():
            db.execute("DELETE FROM link_fits")
            for item in stats:
                db.execute("INSERT INTO link_fits (model_version, link, stats, fitted_at_s) VALUES (?, ?, ?, ?)",
                           [model_version, str(item.get("link", "")), json.dumps(item, default=str), now])

    def link_fits(self) -> list[dict]:
        rows = self.db.execute("SELECT model_version, stats, fitted_at_s FROM link_fits ORDER BY id").fetchall()
        return [{"model_version": v, "fitted_at_s": t, **json.loads(s)} for v, s, t in rows]


def _select(sql: str, where: tuple[str, Any], order: str, limit: int | None) -> tuple[str, list[Any]]:
    """``sql`` with ``WHERE where[0]`` when its value ``where[1]`` is not None, ordered, and limited."""
    params: list[Any] = []
    if where[1] is not None:
        sql += f" WHERE {where[0]}"
        params.append(where[1])
    sql += f" ORDER BY {order}"
    if limit is not None:
        sql += " LIMIT ?"
        params.append(limit)
    return sql, params
