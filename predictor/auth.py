"""Who may write (and, with `read_auth`, read): bearer tokens and munge-signed job writes.

Three kinds of caller:
    admin     `Authorization: Bearer <admin_token>` (ELASTIC_PREDICTOR_ADMIN_TOKEN): everything, including
              admin-only operations (replacing a profile that already exists with a different body).
    tool      `Authorization: Bearer <token>` (ELASTIC_PREDICTOR_TOKEN): writes; admin operations only while no
              admin token is configured.
    job       `X-Elastic-Munge: <credential>` (ELASTIC_PREDICTOR_MUNGE=1): a running (or recently ended)
              job signs its own observations and new profiles with the site's munge; no new secret.

A job's credential is `munge -s "elastic-predictor/1 job=<id> sha256=<hex digest of the body>"`
(`slurm_plugin.contracts.signing.munge_sign` builds it). The service decodes it with `unmunge` (which also refuses a replayed or
expired credential), checks that the digest matches the body it received, then asks Slurm
(`slurm_plugin.client.CommandBackend.job_owner`) that the job exists, is running or ended less than
`job_recent` ago, and runs as the uid munge vouches for.

Every refusal is an `AuthError` with a status (401: no usable credential; 403: a credential that was
understood and refused), the header it concerns and a short `reason` code:
    missing_credential, bad_token, munge_disabled, bad_credential, digest_mismatch, bad_payload,
    job_not_found, job_not_active, uid_mismatch, job_id_mismatch, admin_required, slurm_unavailable,
    record_mismatch (a signed record that does not fit its job's Slurm facts: predictor.jobcheck),
    lookup_rate (429: the signer's uid asked about more unknown jobs than `LookupBudget` allows),
    credential_busy (429: the signer's uid already has `CREDENTIAL_WRITES` writes in progress in this process,
    `CredentialSlots`; the caller retries),
    slurm_busy (503: this process's Slurm lookups are all taken; the caller retries).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import hashlib
import hmac
import os
import re
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Protocol

from slurm_plugin.contracts.signing import DEFAULT_TIMEOUT, MUNGE_HEADER, PAYLOAD_PREFIX
from slurm_plugin.errors import JobNotFoundError, SlurmError

_PAYLOAD_RE = re.compile(rf"^{re.escape(PAYLOAD_PREFIX)} job=([0-9]{{1,12}}) sha256=([0-9a-f]{{64}})\Z")
# what munge's encoder writes: "MUNGE:" + base64 + ":" (a header of any other shape never costs an unmunge run)
_CREDENTIAL_RE = re.compile(r"^MUNGE:[A-Za-z0-9+/]{16,16384}={0,2}:\Z")
OWNER_TTL = timedelta(seconds=1)        # a job's owner and state, as Slurm said them, reused this long
MISSING_TTL = timedelta(seconds=10)     # ... and that Slurm does not know a job id
OWNER_ENTRIES = 4096
LOOKUP_RATE = 2.0                       # Slurm lookups (jobs not in the cache) per signer uid and second ...
LOOKUP_BURST = 10                       # ... after a burst of this many
LOOKUP_CONCURRENT = 2                   # Slurm lookups running at once in one service process
LOOKUP_WAIT = timedelta(milliseconds=500)  # how long a lookup waits for one of those before 503 slurm_busy
CREDENTIAL_WRITES = 2                   # writes one job signer uid (all its jobs) has in progress in one service
                                        # process; more: 429 credential_busy (#24.3)


class AuthError(Exception):
    """A refused request: `status` 401 or 403, `field` the header concerned, `reason` a short code."""

    def __init__(self, status: int, message: str, field: str = "Authorization", reason: str = "bad_token"):
        self.status = status
        self.field = field
        self.reason = reason
        super().__init__(message)


# --- service side -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MungeIdentity:
    uid: int
    gid: int
    payload: str


def _bad_credential(err: int, why: str) -> AuthError:
    """401 for a credential munge refused, ``err`` its munge error number (unmunge's exit status is the same)."""
    if err == LibMunge.E_REPLAYED:
        why = "credential replayed (each credential is accepted once)"
    elif err == LibMunge.E_EXPIRED:
        why = "credential expired"
    return AuthError(401, f"{MUNGE_HEADER}: bad credential: {why}", MUNGE_HEADER, "bad_credential")


class LibMunge:
    """libmunge's ``munge_decode`` in this process (ctypes): about 0.1 ms a credential against ~1.4 ms for an
    `unmunge` run from a small process and more from a large worker, whose fork is the cost (#24.4: a flood of
    valid credentials for made-up job ids held the plan workers' CPU). One decode context per thread (a context
    must not be shared between threads). None from :meth:`load` where the library is missing.

    A hung munged holds the calling thread until libmunge gives up (its own socket timeouts and retries: 10 s
    measured with munged SIGSTOPped, then 503 ``munge_unavailable``), longer than the `unmunge` run's ``timeout``;
    a side-pool thread, never one that answers the hook's plan."""

    SOCKET_OPT = 8  # MUNGE_OPT_SOCKET (munge.h)
    E_SOCKET, E_EXPIRED, E_REPLAYED = 6, 15, 17  # EMUNGE_SOCKET, EMUNGE_CRED_EXPIRED, EMUNGE_CRED_REPLAYED

    def __init__(self, lib, socket: str | None) -> None:
        self._ctypes = ctypes
        self._lib = lib
        self._libc = ctypes.CDLL(None)
        self._socket = socket
        self._local = threading.local()

    @classmethod
    def load(cls, socket: str | None = None) -> "LibMunge | None":
        name = ctypes.util.find_library("munge") or "libmunge.so.2"
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            return None
        c = ctypes
        lib.munge_ctx_create.restype = c.c_void_p
        lib.munge_ctx_set.argtypes = [c.c_void_p, c.c_int, c.c_char_p]
        lib.munge_ctx_strerror.argtypes = [c.c_void_p]
        lib.munge_ctx_strerror.restype = c.c_char_p
        lib.munge_strerror.restype = c.c_char_p
        lib.munge_decode.argtypes = [c.c_char_p, c.c_void_p, c.POINTER(c.c_void_p), c.POINTER(c.c_int),
                                     c.POINTER(c.c_uint32), c.POINTER(c.c_uint32)]
        return cls(lib, socket)

    def _ctx(self):
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._lib.munge_ctx_create()
            if not ctx:
                raise AuthError(503, "cannot verify the munge credential: munge_ctx_create failed", MUNGE_HEADER,
                                "munge_unavailable")
            if self._socket:
                self._lib.munge_ctx_set(ctx, self.SOCKET_OPT, self._socket.encode())
            self._local.ctx = ctx  # one a thread, for the worker's life
        return ctx

    def decode(self, credential: str) -> MungeIdentity:
        c = self._ctypes
        ctx = self._ctx()
        buf, n, uid, gid = c.c_void_p(), c.c_int(), c.c_uint32(), c.c_uint32()
        err = self._lib.munge_decode(credential.encode(), ctx, c.byref(buf), c.byref(n), c.byref(uid), c.byref(gid))
        payload = c.string_at(buf, n.value).decode("utf-8", "replace") if buf.value else ""
        if buf.value:
            self._libc.free(buf)
        if err == 0:
            return MungeIdentity(int(uid.value), int(gid.value), payload)
        why = (self._lib.munge_ctx_strerror(ctx) or self._lib.munge_strerror(err) or b"").decode("utf-8", "replace")
        if err == self.E_SOCKET:
            raise AuthError(503, f"cannot verify the munge credential: {why}", MUNGE_HEADER, "munge_unavailable")
        raise _bad_credential(err, why or f"status {err}")


class Unmunger:
    """Decodes credentials (munged refuses replays and expired credentials itself): with libmunge in this process
    where it is installed (:class:`LibMunge`), else with an `unmunge` run.

    Args:
        socket: munged's socket; None uses munge's default.
        timeout: limit for one `unmunge` run.
        in_process: use libmunge when it loads (False: always run `unmunge`).
    """

    def __init__(self, socket: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT, in_process: bool = True):
        self.socket = socket
        self.timeout = timeout
        self.lib = LibMunge.load(socket) if in_process else None

    def decode(self, credential: str) -> MungeIdentity:
        """:raises AuthError: 401 `bad_credential` naming what munge said, or the header's shape; 503
        `munge_unavailable` when munged cannot be asked."""
        if not _CREDENTIAL_RE.match(credential.strip()):
            raise AuthError(401, f"{MUNGE_HEADER}: bad credential: not a munge credential (MUNGE:<base64>:, at "
                                 "most 16 KiB)", MUNGE_HEADER, "bad_credential")
        if self.lib is not None:
            return self.lib.decode(credential.strip())
        argv = ["unmunge", "--numeric"]
        if self.socket:
            argv.append(f"--socket={self.socket}")
        try:
            proc = subprocess.run(argv, input=credential.strip() + "\n", capture_output=True, text=True,
                                  timeout=self.timeout.total_seconds(), check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AuthError(503, f"cannot verify the munge credential: {exc}", MUNGE_HEADER,
                            "munge_unavailable") from exc
        head, _, payload = proc.stdout.partition("\n\n")
        meta = dict(line.split(":", 1) for line in head.splitlines() if ":" in line)
        meta = {k.strip(): v.strip() for k, v in meta.items()}
        if proc.returncode != 0 or meta.get("STATUS") != "0":
            why = proc.stderr.strip().removeprefix("unmunge: Error: ") or f"status {meta.get('STATUS', '?')}"
            status = meta.get("STATUS", "")
            raise _bad_credential(proc.returncode or (int(status) if status.isdigit() else 0), why)
        try:
            return MungeIdentity(int(meta["UID"]), int(meta["GID"]), payload)
        except (KeyError, ValueError):
            raise AuthError(401, f"{MUNGE_HEADER}: bad credential: no uid in unmunge's answer", MUNGE_HEADER,
                            "bad_credential") from None


class JobOwners(Protocol):
    """What the check needs from Slurm (slurm_plugin.client.CommandBackend provides it)."""

    def job_owner(self, job_id: int): ...


class CredentialSlots:
    """Writes in progress in this process per job signer (#24.3): a munge credential's uid, however many jobs,
    addresses and credentials it uses. nginx caps requests per bearer token over all addresses, but it cannot read
    a munge credential (each is signed afresh; its uid is known only once decoded): this is that cap, kept per
    side worker, so one user's jobs work on at most `per_credential` of its threads (4) at once and the others stay
    free for everyone else. Bearer tokens are trusted callers capped by nginx only (an import may write from
    several threads); anonymous writes (writes open) are not capped."""

    def __init__(self, per_credential: int = CREDENTIAL_WRITES):
        if per_credential < 1:
            raise ValueError(f"per_credential must be >= 1, got {per_credential}")
        self.per_credential = per_credential
        self._held: dict[tuple, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(caller: "Caller") -> tuple | None:
        """Whose slot `caller` takes: ("uid", uid) for a job; None (not capped here) for a token or anonymous."""
        return ("uid", caller.uid) if caller.kind == "job" else None

    @contextlib.contextmanager
    def hold(self, caller: "Caller"):
        """One of `caller`'s slots for the block; raises AuthError 429 `credential_busy` when all are taken."""
        key = self.key(caller)
        if key is None:
            yield
            return
        with self._lock:
            if self._held.get(key, 0) >= self.per_credential:
                raise AuthError(429, f"uid {caller.uid}'s jobs already have {self.per_credential} writes in progress "
                                     "in this service process; retry", MUNGE_HEADER, "credential_busy")
            self._held[key] = self._held.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._held[key] - 1
                if left:
                    self._held[key] = left
                else:
                    del self._held[key]

    def held(self) -> dict[tuple, int]:
        with self._lock:
            return dict(self._held)


class LookupBudget:
    """What one user's credentials may cost in Slurm lookups (#24.4: valid credentials for made-up job ids, minted
    at ~220/s, each cost a squeue and a sacct run of ~0.3 s and held a request thread, so the hook's `/v1/plan`
    waited behind them): a token bucket per uid (`rate` a second after `burst`), and at most `concurrent` lookups
    at once in this process, waited for at most `wait`. Only lookups of jobs not in `OwnerCache` count.

    Raises (from :meth:`slot`): AuthError 429 ``lookup_rate`` (this uid's bucket is empty; others are not
    affected), AuthError 503 ``slurm_busy`` (every slot is taken).
    """

    def __init__(self, rate: float = LOOKUP_RATE, burst: int = LOOKUP_BURST, concurrent: int = LOOKUP_CONCURRENT,
                 wait: timedelta = LOOKUP_WAIT, entries: int = OWNER_ENTRIES,
                 clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.wait, self.entries, self.clock = rate, burst, wait, entries, clock
        self._slots = threading.BoundedSemaphore(concurrent)
        self._lock = threading.Lock()
        self._buckets: dict[int, tuple[float, float]] = {}  # uid -> (tokens, when)

    def _take(self, uid: int) -> float:
        """Takes a token of ``uid``'s bucket; returns 0, or the seconds until one is there (nothing taken)."""
        now = self.clock()
        with self._lock:
            tokens, when = self._buckets.get(uid, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - when) * self.rate)
            if tokens < 1.0:
                self._buckets[uid] = (tokens, now)
                return (1.0 - tokens) / self.rate
            if uid not in self._buckets and len(self._buckets) >= self.entries:
                for old in sorted(self._buckets, key=lambda u: self._buckets[u][1])[: self.entries // 4]:
                    del self._buckets[old]   # the longest idle buckets are full again by now
            self._buckets[uid] = (tokens - 1.0, now)
            return 0.0

    @contextlib.contextmanager
    def slot(self, uid: int | None, job_id: int):
        wait = self._take(uid) if uid is not None else 0.0
        if wait:
            raise AuthError(429, f"{MUNGE_HEADER}: uid {uid} asked about more jobs Slurm had to be asked for than "
                                 f"{self.rate:g}/s (after {self.burst}); retry in {wait:.1f} s", MUNGE_HEADER,
                            "lookup_rate")
        if not self._slots.acquire(timeout=self.wait.total_seconds()):
            raise AuthError(503, f"cannot check job {job_id} now: Slurm lookups busy", MUNGE_HEADER, "slurm_busy")
        try:
            yield
        finally:
            self._slots.release()


class OwnerCache:
    """Slurm's answer about a job's owner, kept per job id (`ttl` when found, `missing_ttl` when Slurm does not
    know it), at most `entries`.

    A credential for an unknown job costs a squeue and a sacct run; without this, one client could make the
    service run them for every request. A found job's state (running, ended) is at most `ttl` old, so the
    `job_recent` window still closes on time.
    """

    def __init__(self, jobs: Callable[[], JobOwners], ttl: timedelta = OWNER_TTL,
                 missing_ttl: timedelta = MISSING_TTL, entries: int = OWNER_ENTRIES,
                 clock: Callable[[], float] = time.monotonic, budget: LookupBudget | None = None):
        self._jobs = jobs
        self.budget = budget or LookupBudget(clock=clock)
        self.ttl = ttl
        self.missing_ttl = missing_ttl
        self.entries = entries
        self.clock = clock
        self._seen: dict[int, tuple[float, object, Exception | None]] = {}  # job -> (when, owner, not found)

    def job_owner(self, job_id: int, uid: int | None = None):
        """Raises what the lookup raised (JobNotFoundError is remembered too; SlurmError is not), and the
        `LookupBudget`'s AuthError when ``uid`` (the credential's) may not make Slurm look the job up now."""
        now = self.clock()
        hit = self._seen.get(job_id)
        if hit is not None and now - hit[0] < (self.ttl if hit[2] is None else self.missing_ttl).total_seconds():
            if hit[2] is not None:
                raise hit[2]
            return hit[1]
        with self.budget.slot(uid, job_id):
            try:
                owner, missing = self._jobs().job_owner(job_id), None
            except JobNotFoundError as exc:
                owner, missing = None, exc
        if len(self._seen) >= self.entries:
            for old in sorted(self._seen, key=lambda j: self._seen[j][0])[: self.entries // 4]:
                del self._seen[old]
        self._seen[job_id] = (now, owner, missing)
        if missing is not None:
            raise missing
        return owner


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who a request was accepted from: `kind` admin, tool, job or anonymous (auth off); a job's caller carries
    what Slurm said about the job (`slurm_plugin.client.JobOwner`: allocation, run window) in `job`."""

    kind: str
    uid: int | None = None
    job_id: int | None = None
    job: object | None = dataclasses.field(default=None, compare=False)


class Authenticator:
    """Applies the policy above to one request's headers and body.

    Args:
        token: tool bearer token (None: none configured).
        admin_token: admin bearer token (None: admin operations take the tool token).
        munge: accept `X-Elastic-Munge` job credentials.
        unmunger: decodes credentials.
        jobs: Slurm lookup (`job_owner`); built lazily by `jobs_factory` on first use.
        job_recent: how long after a job ended its credential is still accepted.
        read_auth: reads need a credential too.
        open_writes: with no credential configured, anyone writes (else nobody does: `serve`'s default, #41.9).
        clock: seconds since the epoch (tests pass a fixed one).
    """

    def __init__(self, token: str | None = None, admin_token: str | None = None, munge: bool = False,
                 unmunger: Unmunger | None = None, jobs: JobOwners | None = None,
                 jobs_factory: Callable[[], JobOwners] | None = None,
                 job_recent: timedelta = timedelta(minutes=10), read_auth: bool = False,
                 open_writes: bool = True, clock: Callable[[], float] = time.time):
        self.token = token or None
        self.admin_token = admin_token or None
        self.munge = munge
        self.unmunger = unmunger or Unmunger()
        self._jobs = jobs
        self._jobs_factory = jobs_factory
        self.owners = OwnerCache(lambda: self.jobs)
        self.job_recent = job_recent
        self.read_auth = read_auth
        self.open_writes = open_writes
        self.clock = clock
        self.slots = CredentialSlots()

    @classmethod
    def from_config(cls, config) -> "Authenticator":
        """From the frozen `predictor.config.Config` (its auth fields)."""
        def backend():
            from slurm_plugin.client import CommandBackend   # noqa: PLC0415 - only munge mode needs Slurm
            conf = Path(config.slurm_conf) if config.slurm_conf else None

            # the service's PATH: a site's Slurm may live elsewhere (a 24.11 testbed's wrappers stand first)
            env = {"PATH": os.environ.get("PATH") or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
            return CommandBackend(slurm_conf=conf, env=env, timeout=config.auth_timeout)

        return cls(token=config.token, admin_token=config.admin_token, munge=config.munge_auth,
                   unmunger=Unmunger(config.munge_socket, config.auth_timeout, config.munge_in_process),
                   jobs_factory=backend,
                   job_recent=config.job_recent, read_auth=config.read_auth, open_writes=config.open_writes)

    @property
    def writes_open(self) -> bool:
        return self.open_writes and not (self.token or self.admin_token or self.munge)

    @property
    def jobs(self) -> JobOwners:
        if self._jobs is None:
            self._jobs = self._jobs_factory()
        return self._jobs

    # -- policy -------------------------------------------------------------------------------------
    def check_write(self, headers: Mapping[str, str], body: bytes) -> Caller:
        """Accept a write from an admin, a tool or a signed job; open when no auth is configured.

        Raises:
            AuthError: 401/403 naming what failed.
        """
        if headers.get(MUNGE_HEADER):
            return self._job(headers[MUNGE_HEADER], body)
        if headers.get("Authorization"):
            return self._bearer(headers["Authorization"], admin_only=False)
        if self.writes_open:
            return Caller("anonymous")
        raise AuthError(401, "writes need a credential: " + self._accepted(), "Authorization", "missing_credential")

    def check_read(self, headers: Mapping[str, str], body: bytes = b"") -> Caller:
        """With `read_auth` off, everyone; on, the same credentials as writes (a job signs the body it sends: the
        empty body of a GET, the request of a `POST /v1/predict`)."""
        if not self.read_auth:
            return Caller("anonymous")
        if headers.get(MUNGE_HEADER):
            return self._job(headers[MUNGE_HEADER], body)
        if headers.get("Authorization"):
            return self._bearer(headers["Authorization"], admin_only=False)
        raise AuthError(401, "reads need a credential (ELASTIC_PREDICTOR_READ_AUTH is on): " + self._accepted(),
                        "Authorization", "missing_credential")

    def check_admin(self, headers: Mapping[str, str]) -> Caller:
        """Admin operations: the admin token (or, when none is configured, the tool token)."""
        if not headers.get("Authorization"):
            if self.writes_open:
                return Caller("anonymous")
            raise AuthError(401, "admin operations need `Authorization: Bearer <admin token>` "
                                 "(ELASTIC_PREDICTOR_ADMIN_TOKEN)", "Authorization", "admin_required")
        return self._bearer(headers["Authorization"], admin_only=True)

    def administers(self, caller: Caller) -> bool:
        """Whether an accepted caller may do admin operations: the admin token; the tool token only when no admin
        token is configured; anyone while writes are open. Never a job credential."""
        if caller.kind == "admin":
            return True
        if caller.kind == "tool":
            return self.admin_token is None
        return caller.kind == "anonymous" and self.writes_open

    def _accepted(self) -> str:
        ways = []
        if self.token or self.admin_token:
            ways.append("`Authorization: Bearer <token>`")
        if self.munge:
            ways.append(f"`{MUNGE_HEADER}: <munge credential>` (slurm_plugin.contracts.signing.munge_sign)")
        return " or ".join(ways) or ("none is configured, so writes are closed (set ELASTIC_PREDICTOR_TOKEN, "
                                     "ELASTIC_PREDICTOR_ADMIN_TOKEN or ELASTIC_PREDICTOR_MUNGE=1)")

    def _bearer(self, header: str, admin_only: bool) -> Caller:
        scheme, _, given = header.partition(" ")
        given = given.strip(" \t")   # HTTP's optional whitespace only: nginx's per-token cap keys on the same text
        if scheme.lower() != "bearer" or not given:
            raise AuthError(401, "expected `Authorization: Bearer <token>`", "Authorization", "missing_credential")
        if self.admin_token and hmac.compare_digest(given.encode(), self.admin_token.encode()):
            return Caller("admin")
        if self.token and hmac.compare_digest(given.encode(), self.token.encode()):
            if admin_only and self.admin_token:
                raise AuthError(403, "this operation needs the admin token (ELASTIC_PREDICTOR_ADMIN_TOKEN), "
                                     "not the tool token", "Authorization", "admin_required")
            return Caller("admin" if admin_only else "tool")
        if self.writes_open:
            raise AuthError(403, "bearer token rejected: the service has no token configured", "Authorization",
                            "bad_token")
        raise AuthError(403, "bearer token rejected", "Authorization", "bad_token")

    def _job(self, credential: str, body: bytes) -> Caller:
        if not self.munge:
            raise AuthError(401, f"{MUNGE_HEADER} given but munge credentials are not accepted here "
                                 "(ELASTIC_PREDICTOR_MUNGE is off)", MUNGE_HEADER, "munge_disabled")
        ident = self.unmunger.decode(credential)
        match = _PAYLOAD_RE.match(ident.payload.strip())
        if not match:
            raise AuthError(401, f"{MUNGE_HEADER}: payload is not `{PAYLOAD_PREFIX} job=<id> sha256=<hex>`",
                            MUNGE_HEADER, "bad_payload")
        job_id, digest = int(match.group(1)), match.group(2)
        actual = hashlib.sha256(body).hexdigest()
        if not hmac.compare_digest(digest, actual):
            raise AuthError(403, f"{MUNGE_HEADER}: digest mismatch: the credential signs body sha256 "
                                 f"{digest[:12]}..., the request body has {actual[:12]}...", MUNGE_HEADER,
                            "digest_mismatch")
        owner = self._check_job(job_id, ident.uid)
        return Caller("job", uid=ident.uid, job_id=job_id, job=owner)

    def _check_job(self, job_id: int, uid: int):
        """Slurm's facts about `job_id` (`JobOwner`) once it is `uid`'s and active; fails closed (503) when Slurm
        cannot be asked."""
        try:
            owner = self.owners.job_owner(job_id, uid)
        except JobNotFoundError:
            raise AuthError(403, f"{MUNGE_HEADER}: job not found: Slurm does not know job {job_id}",
                            MUNGE_HEADER, "job_not_found") from None
        except SlurmError as exc:
            raise AuthError(503, f"cannot check job {job_id} with Slurm: {exc}", MUNGE_HEADER,
                            "slurm_unavailable") from exc
        if owner.user_id != uid:
            raise AuthError(403, f"{MUNGE_HEADER}: uid mismatch: job {job_id} belongs to uid {owner.user_id}, "
                                 f"the credential is uid {uid}", MUNGE_HEADER, "uid_mismatch")
        if owner.state == "PENDING":
            raise AuthError(403, f"{MUNGE_HEADER}: job {job_id} has not started", MUNGE_HEADER, "job_not_active")
        if owner.ended_at_s is not None and self.clock() - owner.ended_at_s > self.job_recent.total_seconds():
            raise AuthError(403, f"{MUNGE_HEADER}: job {job_id} ended {self.clock() - owner.ended_at_s:.0f} s ago "
                                 f"(accepted up to {self.job_recent.total_seconds():.0f} s)", MUNGE_HEADER,
                            "job_not_active")
        return owner
