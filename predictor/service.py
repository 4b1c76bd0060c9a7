"""ModelCache: the fitted model a service process answers from; one process of the service fits it.

One ModelCache is built by `create_app` for each gunicorn worker. Requests never fit. The service's worker
processes share one model per data version:

- **One fitter.** The worker that holds the fit lock (predictor.fitlock: a non-blocking `flock` on
  `<db>.fitlock`) is the only one that fits. Its refit thread fits when the store's `generation` counter has
  moved past the model's (a write by this process: `notify()`, then a debounce so a burst of POSTs costs one
  fit; a write by another worker: seen within `min(poll, check)`), paced so fits take at most `max_share` of
  its time (`next_fit_at`), and stores the fitted model in the store's
  `models` table (a JSON document, version = the generation fitted on, newest few kept). A failed fit keeps the
  previous model, is recorded in `fit_failures` and reported by every worker's `status()`. When the fitter
  dies the kernel drops its lock and another worker's thread takes it on its next try.
- **Every worker answers from the newest stored model.** Each refit thread looks at the newest stored
  model's version every `check` (an index lookup) and loads it (reads its JSON) when it changed. `start()` loads it
  before the first request, so a worker never answers 503 while a fitted model exists.
- **Versions you can name.** A model's version is the generation it was fitted on (`model_generation`;
  `model_version` is `g<generation>`). `POST /v1/observations` answers the generation its write produced;
  `view(min_generation, wait)` waits, at most `MAX_VERSION_WAIT`, for a model at least that new and pins it
  for the request, or raises `ModelVersionUnavailable` (503).

Stored models are JSON documents (`FittedModel.blob`: the predictor's `to_params()`, the step model's parameters
with their basis, and the profiles it was fitted with, without tensor names), never pickles: reading one runs no
code, and `elastic-predictor model show` prints it. A model stored as a pickle by an older release is deleted by
the store's migration `0013_models_json` and fitted again. Each carries the fingerprint of the code that fitted it
(`code_fingerprint()`: the predictor
package's sources, Python's and the numeric libraries' versions). A worker answers from the newest stored
model whatever its code (better than a 503), and the fitter fits the data again when the model in use was
fitted by other code (after an upgrade, or a worker respawned on changed files), so the new code's model
replaces it under the same version.

Predictions are cached per (model, profile, gpu, per_gpu_batch, candidates): the cache is dropped whenever a
new model is swapped in, so a cached answer never outlives its model. It is bounded by entries and by the bytes
its entries are estimated to hold (`prediction_entry_bytes`, ELASTIC_PREDICTOR_CACHE_BYTES), since a key holds
its candidates' layouts: an entry bound alone let distinct large requests grow a worker without bound.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import importlib.metadata
import itertools
import logging
import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from predictor.fitlock import FitLock, fit_lock_path
from predictor.lru import ByteBudgetLRU
from predictor.profiles import Profile, TensorSpec
from predictor.store import ModelHead, StoredModel, Store

log = logging.getLogger("predictor.service")

MAX_VERSION_WAIT = timedelta(seconds=20)      # a request waits at most this long for a model version; below
                                              # gunicorn's default 30 s worker timeout, which a sync worker
                                              # blocked longer than that would hit
DEFAULT_VERSION_WAIT = timedelta(seconds=10)  # when `min_model_version` comes without `wait_ms`
MODEL_FORMAT = "elastic-predictor/model-1"    # a stored model's JSON document (`FittedModel.blob`)
WAIT_STEP = timedelta(milliseconds=50)        # how often a waiting request looks at the store
LOAD_WAIT = timedelta(seconds=5)              # a request waits this long at most for another thread's load
_PROBLEMS = ("fit", "load", "read", "refresh")  # what ModelCache.last_error reports first


def default_predictor_factory():
    """The production model (predictor.engine.Predictor), imported lazily."""
    from predictor.engine import Predictor  # noqa: PLC0415 - sklearn: at the first fit, not at every import

    return Predictor()


def candidates_key(candidates: list[dict]) -> tuple:
    """A hashable key equal for equal candidate lists (lists become tuples; key order as given, as the
    producers build them: a different order only costs a cache miss)."""
    return tuple(tuple((k, tuple(v) if type(v) is list else v) for k, v in cand.items()) for cand in candidates)


_heap_frozen = False


def freeze_heap_once() -> None:
    """Once per process, after its first model: move the long-lived heap (imports, app, first model) out of
    the garbage collector's full passes (`gc.freeze`). In a service process a full pass over those ~145,000
    objects took ~70 ms, paid inside whichever request triggered it (about one /v1/plan in 6,000: the hook's
    tail); afterwards a pass scans only what is new. Only once, so what stays uncollectable is bounded by
    the first model's reference cycles once a newer model replaces it."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.freeze()


_fingerprint: str | None = None


def code_fingerprint() -> str:
    """What a stored model depends on: the predictor package's sources, Python's and the numeric
    libraries' versions (computed once per process)."""
    global _fingerprint
    if _fingerprint is None:
        digest = hashlib.sha256(sys.version.encode())
        for dist in ("numpy", "scipy", "scikit-learn"):
            try:
                digest.update(f"{dist}={importlib.metadata.version(dist)};".encode())
            except importlib.metadata.PackageNotFoundError:
                digest.update(f"{dist}=none;".encode())
        for source in sorted(Path(__file__).resolve().parent.glob("*.py")):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
        _fingerprint = digest.hexdigest()[:16]
    return _fingerprint


class ModelUnavailable(RuntimeError):
    """No fitted model yet (first fit still running or every fit so far failed)."""


class ModelVersionUnavailable(Exception):
    """A request asked for a model at least as new as `wanted` and none came within its wait (503).

    Attributes:
        wanted: the generation asked for (`min_model_version`).
        available: the generation of the model this worker answers from now, None without one.
        store_generation: the store's generation now.
        waited: how long the request waited.
        reason: why, in words.
    """

    def __init__(self, wanted: int, available: int | None, store_generation: int, waited: timedelta, reason: str):
        super().__init__(reason)
        self.wanted = wanted
        self.available = available
        self.store_generation = store_generation
        self.waited = waited
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class FittedModel:
    """A fitted predictor with the profiles it was fitted with: what the fitter stores and every worker uses.

    Attributes:
        predictor: the fitted object (`predict`, `known`, `link_stats`).
        profiles: name -> predictor.profiles.Profile, as fitted.
        generation: the store generation of the data it was fitted on (its version).
        fitted_at_s: when the fit ended (wall clock); tells two fits of one generation apart.
        fit_s: how long the fit took.
        code: `code_fingerprint()` of the process that fitted it.
    """

    predictor: Any
    profiles: dict
    generation: int
    fitted_at_s: float
    fit_s: float
    code: str

    @property
    def version(self) -> str:
        return f"g{self.generation}"

    @property
    def key(self) -> tuple[int, float]:
        """Orders models: a newer generation, or a later fit of the same one, is newer."""
        return self.generation, self.fitted_at_s

    def blob(self) -> bytes:
        """The model as stored: a JSON document (`MODEL_FORMAT`) of the predictor's parameters and the profiles."""
        return json.dumps({"format": MODEL_FORMAT, "predictor": self.predictor.to_params(),
                           "profiles": {n: profile_doc(p) for n, p in sorted(self.profiles.items())}},
                          separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_stored(cls, stored: StoredModel, factory: Callable[[], Any],
                    known: "KnownProfiles | None" = None) -> "FittedModel":
        """The stored model, its predictor built by `factory` and loaded from the document; its profiles through
        `known` (those of the last model loaded are not built again).

        Raises:
            ValueError: the blob is not a document of `MODEL_FORMAT` (a pickle of an older release, say).
        """
        try:
            doc = json.loads(stored.blob)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"stored model g{stored.head.version} is not a {MODEL_FORMAT} JSON document "
                             f"(an older release's pickle?): {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != MODEL_FORMAT:
            raise ValueError(f"stored model g{stored.head.version} is not a {MODEL_FORMAT} document")
        profiles = (known or KnownProfiles()).build(doc["profiles"])
        head = stored.head
        return cls(factory().load_params(doc["predictor"], profiles), profiles, head.version, head.fitted_at_s,
                   stored.fit_s, head.code)


def fitted_profile(profile):
    """The profile as a fitted model keeps it: its tensors without their names (the fit and the predictions read
    their count, sizes and dtypes only). Every stored model keeps its profiles: with names, one user's 16 MiB of
    profiles with 200-character tensor names added 15 MB to each of the models kept (#24.6: 48 MB of database for
    16 MB of profiles)."""
    if all(t.name == "" for t in profile.tensors):
        return profile
    return dataclasses.replace(profile, tensors=tuple(TensorSpec("", t.numel, t.dtype) for t in profile.tensors))


def profile_doc(profile) -> dict:
    """A fitted profile as the stored model's JSON keeps it: element counts and runs of dtypes, no names."""
    doc = {k: v for k, v in profile.to_dict().items() if k != "tensors"}
    doc["numels"] = [t.numel for t in profile.tensors]
    doc["dtypes"] = [[dtype, len(list(group))] for dtype, group in itertools.groupby(t.dtype for t in profile.tensors)]
    return doc


def profile_from_doc(doc: dict):
    """The fitted profile `profile_doc` wrote (its buckets as stored, never recomputed). Its fields other than the
    tensors are validated as a profile's; the tensors, written by the fitter from validated profiles, are not checked
    one by one again: every worker loads every model, and checking 68,000 tensors (four 3.9 MB profiles, #24.11)
    took 190 ms, which a plan request arriving meanwhile waited for."""
    dtypes = itertools.chain.from_iterable(itertools.repeat(d, n) for d, n in doc["dtypes"])
    tensors = tuple(TensorSpec("", int(n), d) for n, d in zip(doc["numels"], dtypes))
    if len(tensors) != len(doc["numels"]) or not tensors:
        raise ValueError(f"profile {doc.get('name')!r}: {len(doc['numels'])} numels but dtypes for {len(tensors)}")
    rest = {k: v for k, v in doc.items() if k not in ("numels", "dtypes")}
    first = tensors[0]
    return dataclasses.replace(Profile.from_dict({**rest, "tensors": [{"numel": first.numel, "dtype": first.dtype}]}),
                               tensors=tensors, buckets_bytes=tuple(doc["buckets_bytes"]))


class KnownProfiles:
    """The profiles of the last stored model loaded, with their documents: a profile whose stored document is unchanged
    is taken as it is, not built again. Most refits bring new rows, not new profiles, and every worker loads every
    model; a plan request arriving meanwhile waits for the load (#24.16), and building four profiles of 68,000 tensors
    took 190 ms of it (#24.11: the victim's p99 140-168 ms). Not thread-safe: one loader at a time (ModelCache's
    load lock)."""

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[dict, Any]] = {}

    def build(self, docs: dict[str, dict]) -> dict:
        """name -> Profile for the stored documents `docs`; then remembers them."""
        out = {}
        for name, doc in docs.items():
            seen = self._by_name.get(name)
            out[name] = seen[1] if seen is not None and seen[0] == doc else profile_from_doc(doc)
        self._by_name = {name: (doc, out[name]) for name, doc in docs.items()}
        return out


PREDICTION_ENTRY_BYTES = 1024        # a cached answer's fixed cost: its key tuple and result list
PREDICTION_CANDIDATE_BYTES = 768     # one candidate: its key tuples and its prediction dict (measured, tracemalloc)
PREDICTION_NODE_BYTES = 16           # one layout element: in the key's tuple and in the prediction's copy
DEFAULT_PREDICTION_CACHE_BYTES = 64 * 1024 * 1024


def prediction_entry_bytes(candidates: list[dict]) -> int:
    """A cheap estimate of what one cached prediction list holds in memory (key and value), from the
    candidate count and the layout lengths; within ~10% of tracemalloc's figure for 1..4096-node layouts."""
    nodes = sum(len(cand.get("layout") or ()) for cand in candidates)
    return PREDICTION_ENTRY_BYTES + PREDICTION_CANDIDATE_BYTES * len(candidates) + PREDICTION_NODE_BYTES * nodes


class PredictionCache:
    """LRU of predictions, keyed by the model that made them (so a key never outlives its model), bounded by
    entries and by the estimated bytes they hold (`prediction_entry_bytes`).

    Args:
        size: entries kept; 0 disables the cache.
        max_bytes: budget of the entries' estimated sizes; an answer larger than it is not cached.
    """

    def __init__(self, size: int, max_bytes: int = DEFAULT_PREDICTION_CACHE_BYTES):
        self.size = size
        self._lru = ByteBudgetLRU(max_bytes, max_entries=size)

    def get(self, key: tuple):
        return self._lru.get(key)

    def put(self, key: tuple, value, candidates: list[dict]) -> None:
        """Cache `value`, the predictions of `candidates` (whose size the estimate is taken from)."""
        if self.size:
            self._lru.put(key, value, prediction_entry_bytes(candidates))

    def clear(self) -> None:
        self._lru.clear()

    @property
    def bytes(self) -> int:
        """Estimated bytes held now; never above `max_bytes`."""
        return self._lru.bytes

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    def __len__(self) -> int:
        return len(self._lru)


class ModelView:
    """The model one request answers from, pinned: its version, profiles and predictions all come from it.

    The planner and the /v1/predict view use it like a ModelCache (`predictor()`, `profile()`, `known()`,
    `predict()`, `version`).
    """

    def __init__(self, cache: "ModelCache", model: FittedModel | None):
        self._cache = cache
        self.model = model

    @property
    def version(self) -> str | None:
        return None if self.model is None else self.model.version

    @property
    def generation(self) -> int | None:
        return None if self.model is None else self.model.generation

    def predictor(self):
        """The fitted predictor.

        Raises:
            ModelUnavailable: nothing fitted yet.
        """
        if self.model is None:
            raise ModelUnavailable(self._cache.unavailable_reason())
        return self.model.predictor

    def profile(self, name: str):
        """The Profile object the model was fitted with, or None."""
        return None if self.model is None else self.model.profiles.get(name)

    def known(self, profile: str, gpu: str) -> bool:
        return bool(self.predictor().known(profile, gpu))

    def predict(self, profile, gpu: str, per_gpu_batch: int, candidates: list[dict],
                job_id: int | None = None, uid: int | None = None) -> list[dict]:
        """Predictions for candidates, from the cache when this model answered the same question (`job_id`,
        `uid`: the asking job and user, whose own measurements answer for the layouts they ran:
        engine.Predictor.predict).

        Raises:
            ModelUnavailable: nothing fitted yet.
        """
        predictor = self.predictor()
        key = (self.model.key, profile.name, gpu, per_gpu_batch, job_id, uid, candidates_key(candidates))
        hit = self._cache.predictions.get(key)
        if hit is not None:
            return hit
        result = predictor.predict(profile, gpu, per_gpu_batch, candidates, job_id=job_id, uid=uid)
        if self._cache.current is self.model:         # a model swapped out meanwhile caches nothing
            self._cache.predictions.put(key, result, candidates)
        return result


class ModelCache:
    """Holds the model this process answers from; fits and stores it while this process holds the fit lock.

    Args:
        store: the history store the model is fitted on and stored in.
        predictor_factory: builds an unfitted predictor (`fit`, `predict`, `known`, `link_stats`, and
            `to_params` / `load_params(doc, profiles)`: the JSON document the store keeps).
        debounce: wait after a notification so bursts of observations coalesce into one fit.
        poll: how often, at least, to look for writes by other processes.
        cache_size: prediction cache entries (LRU).
        cache_bytes: prediction cache budget in estimated bytes (`prediction_entry_bytes`).
        min_interval: least time between the end of one fit of the background thread and the start of the next.
        max_share: at most this share of the time goes to the background thread's fits: after a fit of f
            seconds the next starts at least f * (1 - max_share) / max_share later (and `min_interval`), so a
            flood of writes cannot keep it fitting, while a write that comes right after a fit waits about one
            more fit, not a fixed pause (#24.2, #24.16; `pause_after`).
        check: how often, at least, to look for a newer stored model (and try for the fit lock).
        keep_models: stored models kept (the newest).
        lock: the fit lock; default `<db>.fitlock` beside the store's database.
        fitter: False: the refit thread never takes the fit lock, it only loads what other processes fit (the
            plan pool behind nginx, so no fit shares a process with the hook's /v1/plan).
    """

    def __init__(self, store: Store, predictor_factory: Callable[[], Any] = default_predictor_factory,
                 debounce: timedelta = timedelta(seconds=1), poll: timedelta = timedelta(seconds=2),
                 cache_size: int = 4096, min_interval: timedelta = timedelta(0),
                 cache_bytes: int = DEFAULT_PREDICTION_CACHE_BYTES,
                 check: timedelta = timedelta(milliseconds=100), keep_models: int = 3, lock: FitLock | None = None,
                 fitter: bool = True, max_share: float = 0.5):
        if not 0.0 < max_share <= 1.0:
            raise ValueError(f"max_share must lie in (0, 1], got {max_share}")
        self.store = store
        self.fitter = fitter
        self.predictor_factory = predictor_factory
        self.debounce = debounce
        self.poll = poll
        self.min_interval = min_interval
        self.max_share = max_share
        self._not_before = 0.0                    # time.monotonic() before which the next fit does not start
        self._pending_since: float | None = None  # when this process stored data not yet being fitted (notify)
        self.check = check
        self.keep_models = keep_models
        self.election = lock or FitLock(fit_lock_path(store.path))
        self.predictions = PredictionCache(cache_size, cache_bytes)
        self._model: FittedModel | None = None
        self._seen: ModelHead | None = None       # the newest stored model last loaded, or found unusable
        self._failed_generation: int | None = None
        self._fit_lock = threading.Lock()         # one fit at a time in this process
        self._load_lock = threading.Lock()        # one model load at a time in this process
        self._known_profiles = KnownProfiles()    # the last loaded model's profiles (under the load lock)
        self._swapped = threading.Condition()     # notified when a model is swapped in or a fit fails
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._problems: dict[str, str] = {}       # what is wrong in this process now, by source (see _PROBLEMS)
        self.fits = 0                             # fits completed by this process

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "ModelCache":
        """Load the newest stored model (so the first request has it), then start the refit thread."""
        if self._thread is None:
            self.load_newest()
            self._thread = threading.Thread(target=self._run, name="predictor-refit", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stop the refit thread and give the fit lock up (another worker takes it on its next try)."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout.total_seconds())
            if thread.is_alive():
                log.warning("the refit thread is still fitting after %s; it keeps the fit lock", timeout)
                return
        self.election.release()

    def notify(self) -> None:
        """New data was stored by this process: fit it once the debounce has gathered the burst it belongs to
        (counted from the first write not yet being fitted) and the pacing allows (`next_fit_at`)."""
        if self._pending_since is None:
            self._pending_since = time.monotonic()
        self._wake.set()

    def pause_after(self, fit_s: float) -> float:
        """Seconds from the end of a fit that took `fit_s` to the earliest start of the next one."""
        return max(self.min_interval.total_seconds(), fit_s * (1.0 - self.max_share) / self.max_share)

    def next_fit_at(self) -> float:
        """time.monotonic() at which the fitter may start its next fit: the pause after the last fit and the
        debounce of this process's first write since the last fit began, whichever ends later. A write is
        so reflected within max(debounce, the fit in progress + its pause) + its own fit + `check` (#24.16)."""
        pending = self._pending_since
        return max(self._not_before, -float("inf") if pending is None else pending + self.debounce.total_seconds())

    def _run(self) -> None:
        interval = min(self.poll, self.check).total_seconds()
        while not self._stop.is_set():
            try:
                self._tick()
                self._report("refresh", None)
            except Exception as exc:  # noqa: BLE001 - the thread must survive a broken store
                self._report("refresh", f"{type(exc).__name__}: {exc}")
                log.exception("model refresh failed")
                self._stop.wait(self.poll.total_seconds())
            if self._wake.wait(interval):    # a write by this process: look at once (the pacing still holds)
                self._wake.clear()

    def _tick(self) -> None:
        """Load a newer stored model; then, as the fitter, fit when the data moved past the model and the pacing
        allows (`next_fit_at`: the debounce, and the pause after the last fit that bounds the fits' share)."""
        self.load_newest()
        if not (self.fitter and self.election.try_acquire()) or time.monotonic() < self.next_fit_at():
            return
        if self._fit_due():
            self._pending_since = None           # what is stored from here on waits for the next fit
            started = time.monotonic()
            try:
                self._fit_and_publish()
            except Exception:  # noqa: BLE001 - reported (here and in the store) by _fit_and_publish
                log.exception("fit failed")
            ended = time.monotonic()
            self._not_before = ended + self.pause_after(ended - started)

    def _fit_due(self) -> bool:
        generation = self.store.generation()
        model = self._model
        if model is not None and model.generation >= generation and model.code == code_fingerprint():
            return False
        failure = self.store.newest_fit_failure()
        return self._failed_generation != generation and (failure is None or failure.version < generation)

    # --- fitting --------------------------------------------------------------------------------
    def refit(self, timeout: timedelta = timedelta(seconds=60)) -> int:
        """Bring this process's model up to the data stored now; returns the generation of the model in use.

        This process fits when it may (it holds the fit lock, or takes it for this fit); while another
        process holds it, it waits up to `timeout` for that fitter's model of the current data and loads it.

        Raises:
            ModelUnavailable: another process fits and no model of the current data came in time.
            Exception: whatever loading or fitting raised; the previous model stays in place.
        """
        if self.election.held:
            return self._fit_and_publish().generation
        if self.election.try_acquire():
            try:
                return self._fit_and_publish().generation
            finally:
                if self._thread is None:      # no refit thread to keep fitting: let another process fit
                    self.election.release()
        target = self.store.generation()
        model = self.wait_for(target, timeout)
        if model is None:
            raise ModelUnavailable(f"another process fits the model and none of generation {target} came within "
                                   f"{timeout.total_seconds():g} s: {self.unavailable_reason()}")
        return model.generation

    def _fit_and_publish(self) -> FittedModel:
        with self._fit_lock:
            started = time.monotonic()
            generation, profile_rows, observations = self.store.fit_inputs()
            try:
                profiles = {row["name"]: fitted_profile(Profile.from_dict(row["body"])) for row in profile_rows}
                predictor = self.predictor_factory().fit(profiles, observations)
            except Exception as exc:
                self._record_failure(generation, exc)
                raise
            model = FittedModel(predictor, profiles, generation, time.time(), time.monotonic() - started,
                                code_fingerprint())
            self.fits += 1
            try:                                  # before the model: a worker that loads it finds its stats
                self.store.replace_link_fits(model.version, list(predictor.link_stats()))
            except Exception:  # noqa: BLE001 - stats are informational
                log.exception("storing link stats failed")
            self._report("fit", self._publish(model))
            self._swap(model)
            return model

    def _publish(self, model: FittedModel) -> str | None:
        """Store the model for every worker; returns what went wrong, or None."""
        try:
            self.store.put_model(model.generation, model.blob(), model.code, model.fitted_at_s, model.fit_s,
                                 keep=self.keep_models)
        except Exception as exc:  # noqa: BLE001 - this process still answers from it; status() says why
            log.exception("storing model %s failed", model.version)
            return (f"model {model.version} could not be stored, so only the fitting process answers from it: "
                    f"{type(exc).__name__}: {exc}")
        self._seen = ModelHead(model.generation, model.fitted_at_s, model.code)
        return None

    def _record_failure(self, generation: int, exc: Exception) -> None:
        self._failed_generation = generation
        problem = f"fit failed on generation {generation}: {type(exc).__name__}: {exc}"
        self._report("fit", problem)
        try:
            self.store.add_fit_failure(generation, problem)
        except Exception:  # noqa: BLE001 - the local record still stops a retry loop
            log.exception("recording the failed fit failed")
        with self._swapped:
            self._swapped.notify_all()     # requests waiting for this generation answer now

    # --- loading --------------------------------------------------------------------------------
    def load_newest(self) -> FittedModel | None:
        """Swap in the newest stored model when it is newer than the one in use; returns the model in use.

        Cheap when nothing changed (one index lookup). Never raises: a store or unpickling error is reported
        (`last_error`) and the current model stays. While another thread of this process is loading a newer
        model, waits for it (at most `LOAD_WAIT`): an answer never comes from a model older than one already
        stored, so once any worker's answer reflects a write, no later answer goes back (#24.16).
        """
        try:
            head = self.store.newest_model_head()
            self._report("read", None)
        except Exception as exc:  # noqa: BLE001 - keep answering from what is loaded
            self._report("read", f"reading the stored model failed: {type(exc).__name__}: {exc}")
            return self._model
        if head is None or head == self._seen:
            return self._model
        if not self._load_lock.acquire(blocking=False):
            if self._load_lock.acquire(timeout=LOAD_WAIT.total_seconds()):  # the other thread's load is done
                self._load_lock.release()
            return self._model
        try:
            current = self._model
            if current is not None and current.key >= (head.version, head.fitted_at_s):
                self._seen = head
            else:
                stored = self.store.newest_model()
                if stored is not None:
                    self._swap(FittedModel.from_stored(stored, self.predictor_factory, self._known_profiles))
                    self._seen = stored.head
                    if stored.head.code != code_fingerprint():
                        log.info("answering from stored model g%d, fitted by other code, until the fitter has "
                                 "fitted it again", stored.head.version)
        except Exception as exc:  # noqa: BLE001 - an unreadable blob must not take the worker down
            self._seen = head
            self._report("load", f"loading stored model g{head.version} failed: {type(exc).__name__}: {exc}")
            log.exception("loading the stored model failed")
        finally:
            self._load_lock.release()
        return self._model

    def _swap(self, model: FittedModel) -> None:
        with self._swapped:
            current = self._model
            if current is not None and current.key >= model.key:
                return
            self._model = model
            self.predictions.clear()
            self._report("load", None)        # a stored model that could not be loaded is superseded
            self._swapped.notify_all()
        freeze_heap_once()

    # --- versions -------------------------------------------------------------------------------
    def wait_for(self, generation: int, timeout: timedelta) -> FittedModel | None:
        """The model in use once it is fitted on at least `generation`; None when `timeout` passed first or
        the fit of that data failed."""
        deadline = time.monotonic() + max(timeout.total_seconds(), 0.0)
        while True:
            model = self._model
            if model is None or model.generation < generation:
                model = self.load_newest()
            if model is not None and model.generation >= generation:
                return model
            if self._fit_failed_at(generation):
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with self._swapped:
                self._swapped.wait(min(remaining, WAIT_STEP.total_seconds()))

    def _fit_failed_at(self, generation: int) -> bool:
        if self._failed_generation is not None and self._failed_generation >= generation:
            return True
        failure = self.store.newest_fit_failure()
        return failure is not None and failure.version >= generation

    def wait_fresh(self, timeout: timedelta = timedelta(seconds=30)) -> bool:
        """Block until the model is fitted on the store's current data (or its fit failed); True if fresh."""
        target = self.store.generation()
        self.notify()
        model = self.wait_for(target, timeout)
        return model is not None and model.generation >= target

    def view(self, min_generation: int | None = None, wait: timedelta = DEFAULT_VERSION_WAIT) -> ModelView:
        """The model a request answers from, pinned for the whole request.

        Args:
            min_generation: answer only from a model fitted on at least this generation (what
                `POST /v1/observations` said as `model_version_pending`), waiting for it.
            wait: how long to wait for it; capped at MAX_VERSION_WAIT.

        Raises:
            ModelVersionUnavailable: no such model within the wait, no write has produced that generation
                yet, or its fit failed.
        """
        if min_generation is None:  # the newest stored model, whichever worker fitted it (one index lookup)
            return ModelView(self, self.load_newest())
        model = self._model
        if model is not None and model.generation >= min_generation:
            return ModelView(self, model)
        started = time.monotonic()
        store_generation = self.store.generation()
        if min_generation > store_generation:
            raise self._not_reached(min_generation, started, f"no write has produced generation {min_generation} "
                                                             f"yet (the store is at generation {store_generation})")
        wait = min(max(wait, timedelta(0)), MAX_VERSION_WAIT)
        model = self.wait_for(min_generation, wait)
        if model is None:
            failed = self._fit_failed_at(min_generation)
            why = (f"the fit of that data failed: {self.unavailable_reason()}" if failed else
                   f"it was not fitted within {round(wait.total_seconds() * 1000)} ms")
            raise self._not_reached(min_generation, started, why)
        return ModelView(self, model)

    def _not_reached(self, wanted: int, started: float, why: str) -> ModelVersionUnavailable:
        model = self._model
        have = f"this worker answers from {model.version}" if model is not None else "no model is fitted yet"
        store_generation = self.store.generation()
        return ModelVersionUnavailable(
            wanted, None if model is None else model.generation, store_generation,
            timedelta(seconds=time.monotonic() - started),
            f"model version g{wanted} is not available: {why}; {have}")

    # --- reading --------------------------------------------------------------------------------
    @property
    def current(self) -> FittedModel | None:
        """The model in use now (None before the first one)."""
        return self._model

    @property
    def version(self) -> str | None:
        """`g<generation>` of the model in use, None before the first one."""
        model = self._model
        return None if model is None else model.version

    @property
    def fitted_at_s(self) -> float | None:
        model = self._model
        return None if model is None else model.fitted_at_s

    @property
    def fit_seconds(self) -> float | None:
        model = self._model
        return None if model is None else model.fit_s

    def unavailable_reason(self) -> str:
        """Why there is no model (for the 503): the last fit error, else that the first fit is running."""
        return self.last_error or "the model is still being fitted; retry in a few seconds"

    def _report(self, source: str, problem: str | None) -> None:
        """Set (or, with None, clear) what is wrong with one source: fit, load, read, refresh."""
        if problem is None:
            self._problems.pop(source, None)
        else:
            self._problems[source] = problem

    @property
    def last_error(self) -> str | None:
        """What is wrong now: this process's failing fit, stored-model load or store read, else a failed fit
        (by any process) newer than the model in use; None when nothing is."""
        for source in _PROBLEMS:
            if source in self._problems:
                return self._problems[source]
        try:
            failure = self.store.newest_fit_failure()
        except Exception as exc:  # noqa: BLE001 - status must answer
            return f"reading fit failures failed: {type(exc).__name__}: {exc}"
        model = self._model
        if failure is not None and (model is None or failure.version > model.generation):
            return failure.error
        return None

    def predictor(self):
        """The fitted predictor in use.

        Raises:
            ModelUnavailable: nothing fitted yet.
        """
        return self.view().predictor()

    def profile(self, name: str):
        """The Profile object the current model was fitted with, or None."""
        return self.view().profile(name)

    def known(self, profile: str, gpu: str) -> bool:
        return self.view().known(profile, gpu)

    def predict(self, profile, gpu: str, per_gpu_batch: int, candidates: list[dict],
                job_id: int | None = None, uid: int | None = None) -> list[dict]:
        """Predictions of the current model (cached per model).

        Raises:
            ModelUnavailable: nothing fitted yet.
        """
        return self.view().predict(profile, gpu, per_gpu_batch, candidates, job_id=job_id, uid=uid)

    def status(self) -> dict:
        model = self._model
        return {"model_version": None if model is None else model.version,
                "model_generation": None if model is None else model.generation,
                "fitted_at_s": None if model is None else model.fitted_at_s,
                "fit_s": None if model is None else model.fit_s,
                "fits": self.fits, "fitter": self.election.held, "last_error": self.last_error,
                "cached_predictions": len(self.predictions), "cached_prediction_bytes": self.predictions.bytes}
