"""What the controller writes and sends: the records log and the predictor client.

`RecordLog`: each decision, measurement and transition is one JSON line in `run_dir/records.jsonl` and a
record of the logger `elastic_launcher.records`. `PredictorClient`: `POST /v1/observations` (signed with the
site's munge for the job, else the bearer token) and `POST /v1/plan`, each with a timeout and behind one circuit
breaker; it never raises.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Optional
from urllib.parse import quote

import requests

from slurm_plugin.hostlist import expand as expand_hostlist
from slurm_plugin.contracts.signing import MUNGE_HEADER, MungeError, munge_sign

log = logging.getLogger("elastic_launcher.controller")
records_log = logging.getLogger("elastic_launcher.records")


class RecordLog:
    """Decisions, measurements and transitions: one JSON line each in `records.jsonl` and a log record."""

    def __init__(self, path: Path):
        self.path = path
        self.items: list[dict] = []

    def write(self, kind: str, **fields) -> dict:
        record = {"kind": kind, "t": round(time.time(), 3), **fields}
        self.items.append(record)
        with open(self.path, "a") as out:
            out.write(json.dumps(record, sort_keys=True) + "\n")
        records_log.info("%s", json.dumps(record, sort_keys=True), extra={"record": record})
        return record


class PredictorClient:
    """POST /v1/observations, /v1/plan and /v1/predict with a per-request timeout and a circuit breaker.

    Observations are signed for the job (`slurm_plugin.contracts.signing.munge_sign`, header `X-Elastic-Munge`) when `job_id`
    is given: the body is serialised once and exactly those bytes are signed and sent; each attempt signs
    afresh (a munge credential is accepted once and expires). Without a credential from munge (`MungeError`:
    munge missing, munged down) or when the service answers 401 `munge_disabled`, the post goes with the
    bearer token instead (without one when no token is set), and the fall-back is logged once.

    A post of observations that meets a connection error, timeout, 5xx or 429 answer (busy: the front end's cap of
    requests in progress per address or per bearer token, #24.3) is retried `retries` times after `retry_delay_s`;
    another 4xx answer is not (the same body would be refused again), nor is /v1/plan (the
    controller decides without it). Never raises: when the service is unset, unreachable or
    answers garbage, `plan` returns None and the controller falls back to its own measured-efficiency
    heuristic; the breaker then skips the service for `cooldown_s`. A refusal (4xx) is not the service being
    down and opens no breaker; a 401/403 on a signed write means this job may not write: logged once with how to
    fix it, observations are no longer posted, plans are still asked for (#26.4).

    Args:
        url: the service's base URL; None: every call returns None.
        token: bearer token (ELASTIC_PREDICTOR_TOKEN); sent with /v1/predict and with unsigned posts.
        timeout_s: limit of one HTTP request, and of one `munge` run.
        job_id: the Slurm job the observations belong to; None: no munge signing.
        munge_socket: munged's socket; None: munge's default.
    """

    def __init__(self, url: Optional[str], token: Optional[str], timeout_s: float, cooldown_s: float = 30.0,
                 job_id: Optional[int] = None, munge_socket: Optional[str] = None, retries: int = 1,
                 retry_delay_s: float = 0.5):
        self.url = url.rstrip("/") if url else None
        self.token = token
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self.job_id = job_id
        self.munge_socket = munge_socket
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self._open_until = 0.0
        self._munge_refused: Optional[str] = None   # the service said it takes no munge credentials
        self._fallback_logged = False
        self.last_error: Optional[str] = None
        self.writes_refused: Optional[str] = None   # why the service refused this job's writes (401/403), if it did
        # what the last request met: answered, not configured, unreachable (no answer, 5xx, breaker open), refused
        self.last_outcome = "not asked"

    def _bearer(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _credential(self, data: bytes) -> dict:
        """The headers that authenticate `data`: a fresh munge credential, else the bearer token."""
        if self.job_id is None or self._munge_refused:
            return self._bearer()
        try:
            return munge_sign(data, self.job_id, socket=self.munge_socket, timeout=timedelta(seconds=self.timeout_s))
        except MungeError as exc:
            self._fall_back(str(exc))
            return self._bearer()

    def _fall_back(self, why: str) -> None:
        if not self._fallback_logged:
            self._fallback_logged = True
            log.warning("cannot sign observations with munge (%s); posting them %s", why,
                        "with the bearer token" if self.token else "without a credential (no token set)")

    def _send(self, path: str, data: bytes, signed: bool, retries: int, key: Optional[str] = None):
        """One POST with retries; returns the decoded reply or raises `_Refused` with the last error. ``key``:
        the write's Idempotency-Key, the same on every attempt (a retry after a lost answer stores nothing twice)."""
        attempt = 0
        while True:
            headers = {"Content-Type": "application/json", **(self._credential(data) if signed else self._bearer())}
            if key is not None:
                headers["Idempotency-Key"] = key
            error = None
            try:
                reply = requests.post(self.url + path, data=data, headers=headers, timeout=self.timeout_s)
            except requests.RequestException as exc:
                error = str(exc)
            else:
                if reply.status_code < 400:
                    return reply.json()
                error = f"HTTP {reply.status_code}: {reply.text[:200]}"
                if MUNGE_HEADER in headers and reply.status_code == 401 and _reason(reply) == "munge_disabled":
                    self._munge_refused = error
                    self._fall_back("the service accepts no munge credentials")
                    continue                       # at once with the bearer token; not counted as a retry
                if reply.status_code < 500 and reply.status_code != 429:   # 429: busy (a front end's cap), retried
                    raise _Refused(error, reply.status_code)
            attempt += 1
            if attempt > retries:
                raise _Refused(error)
            time.sleep(self.retry_delay_s)

    def _post(self, path: str, body, signed: bool = False, retries: int = 0, key: Optional[str] = None) -> Optional[dict]:
        if self.url is None or time.monotonic() < self._open_until:
            self.last_outcome = "not configured" if self.url is None else "unreachable"
            return None
        try:
            data = json.dumps(body, allow_nan=False).encode()
            reply = self._send(path, data, signed, retries, key)
            self.last_outcome = "answered"
            return reply
        except _Refused as exc:
            error = str(exc)
            if exc.status is not None:      # the service is up and answered: refused, not unavailable
                self.last_outcome = "refused"
                self.last_error = f"{path}: {error}"
                if exc.status in (401, 403) and signed:
                    self._refuse_writes(path, error)
                else:
                    log.warning("predictor %s refused %s (%s)", self.url, path, error)
                return None
        except Exception as exc:  # noqa: BLE001 - posting never raises into the job (garbage reply, bad body...)
            error = f"{type(exc).__name__}: {exc}"
        self.last_outcome = "unreachable"
        self.last_error = f"{path}: {error}"
        self._open_until = time.monotonic() + self.cooldown_s
        log.warning("predictor %s unavailable (%s); using the launcher heuristic", self.url, error)
        return None

    def _refuse_writes(self, path: str, error: str) -> None:
        """A 401/403 on a write: this job may not write (#26.4). Logged once with how to fix it; the job stops
        posting observations but keeps asking for plans, which need no credential."""
        if self.writes_refused is None:
            log.warning("predictor %s: this job is not allowed to write %s (%s). Jobs write with their own munge "
                        "credential: the site runs the service with ELASTIC_PREDICTOR_MUNGE=1 where the jobs' "
                        "munged is reachable (docs/admin-guide.md); the tool token stays out of jobs. Plans are "
                        "still asked for and followed.", self.url, path, error)
        self.writes_refused = error

    def observe(self, records: list[dict]) -> bool:
        """POST records; False when not stored (also, without a try, once the service refused this job's writes)."""
        if not records or self.writes_refused is not None:
            return False
        return self._post("/v1/observations", records, signed=True, retries=self.retries,
                          key=uuid.uuid4().hex) is not None

    def ensure_profile(self, body: dict) -> tuple[str, str]:
        """Registers the model profile ``body`` (``POST /v1/profiles``, signed for the job like observations)
        unless the service already has a profile of that name (``GET /v1/profiles/<name>``). Returns what
        happened and a detail: ``known``, ``registered`` (the name it is stored under), ``refused`` (the
        service's answer), ``unreachable`` or ``not configured`` (no predictor URL). Never raises."""
        if self.url is None:
            return "not configured", "no predictor URL configured"
        if time.monotonic() < self._open_until:
            return "unreachable", self.last_error or "circuit open"
        name = str(body.get("name", ""))
        try:
            reply = requests.get(f"{self.url}/v1/profiles/{quote(name, safe='')}", headers=self._bearer(),
                                 timeout=self.timeout_s)
        except requests.RequestException as exc:
            return "unreachable", str(exc)
        if reply.status_code == 200:
            return "known", name
        if reply.status_code != 404:
            return "unreachable" if reply.status_code >= 500 else "refused", f"GET: HTTP {reply.status_code}"
        try:
            stored = self._send("/v1/profiles", json.dumps(body).encode(), True, self.retries, uuid.uuid4().hex)
        except _Refused as exc:
            return ("refused" if exc.status is not None else "unreachable"), str(exc)
        return "registered", str(stored.get("name", name)) if isinstance(stored, dict) else name

    def compute_s(self, profile: str, gpu: str, per_gpu_batch: int, intra_link: str) -> tuple[Optional[float], str]:
        """The predicted compute seconds per step of `profile` on one `gpu` at `per_gpu_batch` (POST /v1/predict),
        or None and why: no service, no answer, or no history of the model on that type (measured or cross-type).
        """
        # asked once, at the job's start (not on a submission's path): retried like observations, so one slow
        # answer (a service worker loading its model) neither costs the job its speeds nor opens the breaker
        reply = self._post("/v1/predict", {"profile": profile, "gpu": gpu, "per_gpu_batch": per_gpu_batch,
                                           "candidates": [{"layout": [1], "intra_link": intra_link}]},
                           retries=self.retries)
        if reply is None:
            return None, "no predictor URL configured" if self.url is None else (self.last_error or "no answer")
        try:
            pred = reply["predictions"][0]
            seconds = float(pred["compute_s"])
        except (KeyError, IndexError, TypeError, ValueError):
            return None, "a /v1/predict answer without compute_s"
        if not reply.get("known") and not str(pred.get("basis", "")).startswith("cross-type"):
            return None, f"no step history of {profile} on {gpu}"
        return (seconds, "predicted") if seconds > 0 else (None, f"compute_s {seconds!r}")

    def plan(self, body: dict) -> Optional[dict]:
        """POST /v1/plan, signed for the job like observations: only a plan request the job itself signed is
        answered from the job's own step times for the layouts it ran (#24.12)."""
        reply = self._post("/v1/plan", body, signed=True)
        return reply if isinstance(reply, dict) and reply.get("action") in ("keep", "rewrite") else None


class _Refused(Exception):
    """A post that failed after its retries (message: the last error; ``status``: the HTTP status of a 4xx
    refusal, None when the service did not answer or answered 5xx)."""

    def __init__(self, error: str, status: Optional[int] = None) -> None:
        super().__init__(error)
        self.status = status


def _reason(reply) -> Optional[str]:
    """The `reason` of a JSON error answer (predictor.auth), if any."""
    try:
        body = reply.json()
    except ValueError:
        return None
    return body.get("reason") if isinstance(body, dict) else None


def duration(seconds: Optional[float]) -> str:
    """``45 s``, ``12 min``, ``3.2 h``: a duration a person reads (None: ``?``)."""
    if seconds is None:
        return "?"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _rate(samples_per_s: Optional[float]) -> str:
    return "?" if samples_per_s is None else f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def progress_line(step: int, total: Optional[int], samples_per_s: Optional[float], nodes: int,
                  eta_s: Optional[float], last_resize: Optional[dict], now: float) -> str:
    """The launcher's line per log interval, and the head of ``ctl --status``: ``step 600/3000 (20%)  4 nodes
    321 samples/s  ETA 2 min  last resize: grow 2->4, 35 s ago``."""
    of = f"/{total} ({100 * step / total:.0f}%)" if total else ""
    resize = "none" if not last_resize else (f"{last_resize['action']} {last_resize['from_nodes']}->"
                                             f"{last_resize['to_nodes']}, {duration(now - last_resize['t'])} ago")
    return (f"step {step}{of}  {nodes} node{'' if nodes == 1 else 's'}  {_rate(samples_per_s)} samples/s  "
            f"ETA {duration(eta_s)}  last resize: {resize}")


def status_table(status: dict, now: Optional[float] = None) -> str:
    """``elastic-launch ctl JOB --status`` for a person (``--json`` prints ``status`` as it is)."""
    now = time.time() if now is None else now
    nodes = status.get("nodes") or []
    resize = status.get("resize")
    rows = [("job", f"{status.get('job')}  {status.get('phase')}  epoch {status.get('epoch')}  "
                    f"{status.get('world')} workers"),
            ("progress", progress_line(status.get("step", 0), status.get("total_steps"), status.get("samples_per_s"),
                                       len(nodes), status.get("eta_s"), status.get("last_resize"), now)),
            ("nodes", ", ".join(nodes) or "-"),
            ("operator", status.get("operator") or "-"),
            ("resizing", "-" if not resize else f"{resize['action']} to {resize['target_nodes']} node(s), "
                                                f"{resize['state']}" + (f", helper job {resize['helper']}"
                                                                        if resize.get("helper") else "")),
            ("recovering", ", ".join(status.get("recovering") or []) or "-")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def ended_job(job_id: int, records) -> str:
    """What ``ctl`` says of a job whose launcher has ended, from its sacct records (``Backend.sacct``, oldest first).

    A resized job has one record per size it ran at, and Slurm marks each size it left RESIZING, so ``sacct -j N``
    shows a completed elastic job as RESIZING first (#45): the job's end state is its last record's. Records
    before the run of RESIZING ones belong to an older job of the same id (a lab's restarted counter).
    """
    if not records:
        return f"sacct has no record of job {job_id}"
    run = [records[-1]]
    for rec in reversed(records[:-1]):
        if rec.state != "RESIZING":
            break
        run.insert(0, rec)
    end = run[-1]
    sizes = [len(expand_hostlist(r.nodelist)) if r.nodelist and r.nodelist != "None assigned" else 0 for r in run]
    text = f"job {job_id} ended {end.state} on {sizes[-1]} node(s)"
    if len(run) > 1:
        text += (f"; it ran at {' -> '.join(map(str, sizes))} nodes: `sacct -j {job_id} -X` lists one record per "
                 f"size, each size it left as RESIZING (a resize, not the job's state), the last its end state")
    return text


def scaling_plot(records: list[dict], path: Path) -> Optional[Path]:
    """The job's scaling at a glance, beside its records (``elastic-<job>/scaling.png``): measured samples/s over
    the job's time, each point at its node count's colour, and the mean samples/s per node count against
    linear scaling from the smallest size. None (and nothing written) without a measurement."""
    points = [(r["t"], r["nodes"], r["samples_per_s"]) for r in records if r.get("kind") == "measurement"]
    if not points:
        return None
    from matplotlib.figure import Figure  # noqa: PLC0415 - 0.3-0.5 s of imports, at the job's end only

    t0 = points[0][0]
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    over_time, by_size = fig.subplots(1, 2, width_ratios=(2, 1))
    sizes = sorted({n for _, n, _ in points})
    for n in sizes:
        mine = [(t - t0, sps) for t, m, sps in points if m == n]
        over_time.scatter([x for x, _ in mine], [y for _, y in mine], s=10, label=f"{n} node{'s' * (n != 1)}")
    for r in records:
        if r.get("kind") == "transition" and r.get("action") != "start":
            over_time.axvline(r["t"] - t0, color="grey", lw=0.6, ls=":")
    over_time.set(xlabel="seconds since the first measurement", ylabel="samples/s", title="measured throughput")
    over_time.legend(fontsize="small")
    mean = [sum(s for _, m, s in points if m == n) / sum(1 for _, m, _ in points if m == n) for n in sizes]
    by_size.plot(sizes, mean, "o-", label="measured (mean)")
    by_size.plot(sizes, [mean[0] * n / sizes[0] for n in sizes], "--", color="grey", label="linear")
    by_size.set(xlabel="nodes", ylabel="samples/s", title="scaling", xticks=sizes)
    by_size.legend(fontsize="small")
    fig.savefig(path, dpi=90)
    return path
