"""GET /metrics: Prometheus text exposition format 0.0.4, written by hand (no client library needed).

Series (all prefixed `elastic_predictor_`):
    http_requests_total{method, endpoint, code}          counter; endpoint is the URL rule ("unmatched"), method
                                                         one of METHODS or "other": every label from a known set
                                                         (`/v1/decisions/<decision_id>`), `unmatched` for unknown
                                                         paths (bounded cardinality)
    http_request_duration_seconds{endpoint}              histogram (buckets below), time inside Flask
    decisions_total{source, action}                      counter of /v1/plan outcomes: keep, rewrite, reject (422),
                                                         error (400 / 5xx)
    model_fits_total, model_fit_failing, model_fit_seconds, model_generation, store_generation
    fit_log_rmse{profile, gpu}                           fit error of the step model on its history
    link_fit_log_rmse{link}                              fit error of the collective model per link
    observations{kind}                                   records in the store

Counters are the whole service's: each gunicorn worker writes its counts to `<db>.metrics/` beside the
database (at most every 0.5 s, see `Registry`), and whichever worker answers a scrape sums them. The model
gauges (fits, fit errors) are those of the answering worker; all workers fit the same history. The hooks are
registered here with `before_app_request` / `after_app_request`, so every blueprint's requests are counted;
the /v1/plan view passes its parsed body and action through `note_plan`, so counting decodes nothing again.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

from flask import Blueprint, Response, current_app, g, request

from predictor.api import services

bp = Blueprint("metrics", __name__)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_EXT = "elastic_predictor_metrics"


class Registry:
    """The process's counters and histograms; thread-safe (gthread workers).

    With a `spool` directory, every process of the service writes its counts there (a daemon thread, every
    `flush_every` while there is something new, and at each scrape) and a scrape sums all files: whichever gunicorn worker answers,
    the totals are the service's. Files of processes that ended stay and are summed, so counters never
    go backwards; delete the directory while the service is stopped to start from zero.

    Args:
        buckets: upper bounds of the latency histogram, seconds.
        spool: shared directory of the per-process files; None counts this process only.
        flush_every: how long a process's new counts may stay unwritten.
    """

    def __init__(self, buckets: tuple[float, ...] = BUCKETS, spool: Path | None = None,
                 flush_every: timedelta = timedelta(seconds=0.5)):
        self.buckets = buckets
        self.spool = spool
        self.flush_every = flush_every
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._flush_lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._file = None if spool is None else spool / f"{os.getpid()}-{id(self):x}.json"
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self.latency: dict[str, list] = {}     # endpoint -> [bucket counts..., sum, count]
        self.decisions: dict[tuple[str, str], int] = defaultdict(int)

    def observe(self, method: str, endpoint: str, code: int, seconds: float) -> None:
        with self._lock:
            self.requests[(method, endpoint, str(code))] += 1
            row = self.latency.setdefault(endpoint, [0] * len(self.buckets) + [0.0, 0])
            for i, bound in enumerate(self.buckets):
                if seconds <= bound:
                    row[i] += 1
            row[-2] += seconds
            row[-1] += 1
        self._changed()     # after the count: a flush that clears the flag has read it, or will run again

    def decision(self, source: str, action: str) -> None:
        with self._lock:
            self.decisions[(source, action)] += 1
        self._changed()

    def snapshot(self) -> tuple[dict, dict, dict]:
        """This process's counts: (requests, latency rows, decisions)."""
        with self._lock:
            return dict(self.requests), {k: list(v) for k, v in self.latency.items()}, dict(self.decisions)

    def _changed(self) -> None:
        if self._file is None:
            return
        self._dirty.set()
        if self._writer is None:
            with self._lock:
                if self._writer is None:   # started on first use: in the worker, after gunicorn's fork
                    self._writer = threading.Thread(target=self._write_loop, name="metrics-spool", daemon=True)
                    self._writer.start()

    def _write_loop(self) -> None:
        while True:
            self._dirty.wait()
            time.sleep(self.flush_every.total_seconds())
            try:
                self.flush()
            except OSError:   # a full or read-only disk must not kill the thread; the next change retries
                self._dirty.set()

    def flush(self) -> None:
        """Write this process's counts to the spool atomically (`<pid>-<id>.json`)."""
        if self._file is None:
            return
        with self._flush_lock:   # the writer thread and a scrape share the temporary file
            self._dirty.clear()
            body = self._body(self.snapshot())
            self.spool.mkdir(parents=True, exist_ok=True)
            tmp = self._file.with_suffix(".tmp")
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self._file)

    @staticmethod
    def _body(snapshot: tuple[dict, dict, dict]) -> dict:
        """A spool file's content: ``snapshot()`` as JSON-ready lists."""
        requests_, latency, decisions = snapshot
        return {"requests": [[*k, n] for k, n in requests_.items()], "latency": latency,
                "decisions": [[*k, n] for k, n in decisions.items()]}

    def totals(self) -> tuple[dict, dict, dict]:
        """The counts of every process in the spool (this one's as of now)."""
        own = self.snapshot()
        if self._file is None:
            return own
        try:
            self.flush()
            stale = None
        except OSError:  # a full or read-only disk (#24.10): this process's file is stale, its memory is not
            stale = self._file
        requests_, latency, decisions = defaultdict(int), {}, defaultdict(int)
        bodies = []
        if stale is not None:
            bodies.append(self._body(own))
        for path in self.spool.glob("*.json") if self.spool.is_dir() else ():
            if path == stale:
                continue
            try:
                bodies.append(json.loads(path.read_text()))
            except (OSError, ValueError):   # a file being replaced right now: its next version counts
                continue
        for body in bodies:
            for *key, n in body["requests"]:
                requests_[tuple(key)] += n
            for *key, n in body["decisions"]:
                decisions[tuple(key)] += n
            for endpoint, row in body["latency"].items():
                if len(row) == len(self.buckets) + 2:
                    total = latency.setdefault(endpoint, [0] * len(row))
                    latency[endpoint] = [a + b for a, b in zip(total, row)]
        return dict(requests_), latency, dict(decisions)


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""


def _number(value) -> str:
    if value is None:
        return "NaN"
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


class Exposition:
    """Builds the text: HELP and TYPE once per family, then its samples."""

    def __init__(self):
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples) -> None:
        full = f"elastic_predictor_{name}"
        self.lines.append(f"# HELP {full} {help_text}")
        self.lines.append(f"# TYPE {full} {kind}")
        for suffix, labels, value in samples:
            self.lines.append(f"{full}{suffix}{_labels(**labels)} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def spool_dir(db_path: str) -> Path:
    """Where the processes of the service on `db_path` keep their counts: `<db>.metrics/` beside it."""
    return Path(db_path).with_name(Path(db_path).name + ".metrics")


@bp.record_once
def _install(state) -> None:
    config = state.app.extensions["elastic_predictor"].config
    state.app.extensions[_EXT] = Registry(spool=spool_dir(config.db_path))


def registry() -> Registry:
    return current_app.extensions[_EXT]


METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})  # the method label's values


@bp.before_app_request
def _start_timer() -> None:
    g.elastic_metrics_t0 = time.perf_counter()


@bp.after_app_request
def _count(response):
    t0 = g.pop("elastic_metrics_t0", None)
    endpoint = request.url_rule.rule if request.url_rule is not None else "unmatched"
    reg = registry()
    method = request.method if request.method in METHODS else "other"  # a label never takes a client's words
    reg.observe(method, endpoint, response.status_code, time.perf_counter() - t0 if t0 else 0.0)
    if endpoint == "/v1/plan" and request.method == "POST":
        source = g.pop("elastic_plan_source", None) or _source_of_raw_body()
        if response.status_code == 200:
            action = g.pop("elastic_plan_action", "unknown")
        else:
            action = "reject" if response.status_code == 422 else "error"
        reg.decision(source, action)
    return response


def _source_of_raw_body() -> str:
    """The `source` of a /v1/plan body the view did not note (it answered before decoding it): `other` when the
    body cannot be read (over the size cap), is not JSON or is nested too deep. Never raises: an exception in an
    after-request hook turns the view's 4xx into a 500."""
    try:
        return plan_source(json.loads(request.get_data(cache=True)))
    except Exception:  # noqa: BLE001 - RequestEntityTooLarge, ValueError, RecursionError, ...
        return "other"


def plan_source(body) -> str:
    """The `source` label of a /v1/plan body (`other` when missing, unknown or the body is not JSON)."""
    source = body.get("source") if isinstance(body, dict) else None
    return source if source in ("job_submit", "cli_filter", "launcher", "cli") else "other"


def note_plan(body=None, action: str | None = None) -> None:
    """Tell the request's counter what the /v1/plan view already knows, so it decodes nothing again:
    the parsed body (only if sent as JSON, as `request.get_json` would see it) and then the 200's action."""
    if body is not None:
        g.elastic_plan_source = plan_source(body if request.is_json else None)
    if action is not None:
        g.elastic_plan_action = action


def _model_samples(svc) -> tuple[list, list]:
    """Fit errors of the current model (empty before the first fit)."""
    try:
        predictor = svc.models.predictor()
    except Exception:  # noqa: BLE001 - ModelUnavailable: nothing fitted yet
        return [], []
    errors = sorted(getattr(predictor, "log_rmse_", {}).items())
    steps = [("", {"profile": p, "gpu": gpu}, err) for (p, gpu), err in errors]
    links = [("", {"link": s["link"]}, s.get("log_rmse")) for s in predictor.link_stats() if "log_rmse" in s]
    return steps, links


@bp.get("/metrics")
def metrics():
    svc = services()
    requests_, latency, decisions = registry().totals()
    out = Exposition()
    out.family("http_requests_total", "counter", "HTTP requests served by this process.",
               [("", {"method": m, "endpoint": e, "code": c}, n) for (m, e, c), n in sorted(requests_.items())])
    hist = []
    for endpoint, row in sorted(latency.items()):
        for bound, count in zip(BUCKETS, row):
            hist.append(("_bucket", {"endpoint": endpoint, "le": _number(bound)}, count))
        hist += [("_bucket", {"endpoint": endpoint, "le": "+Inf"}, row[-1]),
                 ("_sum", {"endpoint": endpoint}, row[-2]), ("_count", {"endpoint": endpoint}, row[-1])]
    out.family("http_request_duration_seconds", "histogram", "Time to answer a request, inside the app.", hist)
    out.family("decisions_total", "counter", "Outcomes of POST /v1/plan (keep, rewrite, reject, error) by source.",
               [("", {"source": s, "action": a}, n) for (s, a), n in sorted(decisions.items())])
    status = svc.models.status()
    out.family("model_fits_total", "counter", "Model fits completed by this process.", [("", {}, status["fits"])])
    out.family("model_fit_failing", "gauge", "1 when the last fit failed (the previous model stays in use).",
               [("", {}, 1 if status["last_error"] else 0)])
    out.family("model_fit_seconds", "gauge", "Duration of the last successful fit.", [("", {}, status["fit_s"])])
    version = status["model_version"]
    out.family("model_generation", "gauge", "Store generation the current model was fitted on (-1: none yet).",
               [("", {}, int(version[1:]) if version else -1)])
    out.family("store_generation", "gauge", "Store generation now (ahead of model_generation while a refit is due).",
               [("", {}, svc.store.generation())])
    steps, links = _model_samples(svc)
    out.family("fit_log_rmse", "gauge", "Fit error (log RMSE) of the step-time model per profile and GPU type.", steps)
    out.family("link_fit_log_rmse", "gauge", "Fit error (log RMSE) of the collective model per link.", links)
    out.family("observations", "gauge", "Observation records in the store.",
               [("", {"kind": k}, n) for k, n in sorted(svc.store.observation_counts().items())])
    return Response(out.text(), content_type="text/plain; version=0.0.4; charset=utf-8")
