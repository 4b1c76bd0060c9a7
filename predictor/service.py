"""ModelCache: the fitted Predictor a service process answers from, refitted in the background.

One ModelCache is built by `create_app` for each process. Requests never fit: they read the current
`(predictor, version)` snapshot, and a daemon thread refits when the store's `generation` counter
moves, either because this process stored observations (`notify()`, then a debounce so a burst of
POSTs costs one fit) or because another gunicorn worker did (seen by polling every `poll`). A failed
fit keeps the previous model and is reported by `status()`.

Predictions are cached per (model version, profile, gpu, per_gpu_batch, candidates): the cache is
dropped whenever a new model is swapped in, so a cached answer never outlives its model.
"""
from __future__ import annotations

import collections
import gc
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from predictor.store import Store

log = logging.getLogger("predictor.service")


def default_predictor_factory():
    """The production model (predictor.engine.Predictor), imported lazily."""
    from predictor.engine import Predictor  # noqa: PLC0415

    return Predictor()


def candidates_key(candidates: list[dict]) -> tuple:
    """A hashable key equal for equal candidate lists (lists become tuples; key order as given, as the
    producers build them: a different order only costs a cache miss)."""
    return tuple(tuple((k, tuple(v) if type(v) is list else v) for k, v in cand.items()) for cand in candidates)


_heap_frozen = False


def freeze_heap_once() -> None:
    """Once per process, after its first fit: move the long-lived heap (imports, app, first model) out of
    the garbage collector's full passes (`gc.freeze`). In a service process a full pass over those ~145,000
    objects took ~70 ms, paid inside whichever request triggered it (about one /v1/plan in 6,000: the hook's
    tail); afterwards a pass scans only what is new. Only once, so what stays uncollectable is bounded by
    the first model's reference cycles once a refit replaces it."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.freeze()


class ModelUnavailable(RuntimeError):
    """No fitted model yet (first fit still running or every fit so far failed)."""


class ModelCache:
    """Holds the fitted Predictor and refits it off the request path.

    Args:
        store: the history store the model is fitted on.
        predictor_factory: builds an unfitted Predictor (`fit`, `predict`, `known`, `link_stats`).
        debounce: wait after a notification so bursts of observations coalesce into one fit.
        poll: how often to look for writes by other processes.
        cache_size: prediction cache entries (LRU).
        min_interval: least time between two fits of the background thread.
    """

    def __init__(self, store: Store, predictor_factory: Callable[[], Any] = default_predictor_factory,
                 debounce: timedelta = timedelta(seconds=1), poll: timedelta = timedelta(seconds=2),
                 cache_size: int = 4096, min_interval: timedelta = timedelta(0)):
        self.store = store
        self.predictor_factory = predictor_factory
        self.debounce = debounce
        self.poll = poll
        self.cache_size = cache_size
        self.min_interval = min_interval
        self._snapshot: tuple[Any, int | None] = (None, None)   # (predictor, generation fitted on)
        self._profiles: dict = {}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._fit_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._fitted = threading.Condition()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.fitted_at_s: float | None = None
        self.fit_seconds: float | None = None
        self.fits = 0
        self._failed_generation: int | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "ModelCache":
        """Start the refit thread (it fits at once, then on notifications and polls)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="predictor-refit", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout.total_seconds())
            self._thread = None

    def notify(self) -> None:
        """New data was stored by this process: refit after the debounce."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                generation = self.store.generation()
                if generation not in (self._snapshot[1], self._failed_generation):
                    self.refit()
                    self._stop.wait(self.min_interval.total_seconds())
            except Exception as exc:  # noqa: BLE001 - the thread must survive a broken fit or store
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("refit failed")
                self._stop.wait(self.poll.total_seconds())
            woken = self._wake.wait(self.poll.total_seconds())
            if woken:
                self._wake.clear()
                self._stop.wait(self.debounce.total_seconds())   # coalesce a burst of POSTs

    # --- fitting --------------------------------------------------------------------------------
    def refit(self) -> int:
        """Fit a new Predictor on everything stored now and swap it in; returns the generation used.

        Raises:
            Exception: whatever loading or fitting raised; the previous model stays in place.
        """
        from predictor.profiles import Profile  # noqa: PLC0415

        with self._fit_lock:
            started = time.monotonic()
            generation = self.store.generation()
            profiles = {}
            for row in self.store.list_profiles():
                profiles[row["name"]] = Profile.from_dict(row["body"])
            observations = self.store.observations()
            try:
                predictor = self.predictor_factory().fit(profiles, observations)
            except Exception as exc:
                self._failed_generation = generation
                self.last_error = f"fit failed on generation {generation}: {type(exc).__name__}: {exc}"
                with self._fitted:
                    self._fitted.notify_all()
                raise
            with self._cache_lock:
                self._snapshot = (predictor, generation)
                self._profiles = profiles
                self._cache.clear()
            self.last_error = None
            freeze_heap_once()
            self.fitted_at_s = time.time()
            self.fit_seconds = time.monotonic() - started
            self.fits += 1
            try:
                self.store.replace_link_fits(self.version, list(predictor.link_stats()))
            except Exception:  # noqa: BLE001 - stats are informational
                log.exception("storing link stats failed")
            with self._fitted:
                self._fitted.notify_all()
            return generation

    def wait_fresh(self, timeout: timedelta = timedelta(seconds=30)) -> bool:
        """Block until the model is fitted on the store's current data (or a fit failed); True if fresh."""
        deadline = time.monotonic() + timeout.total_seconds()
        target = self.store.generation()
        self.notify()
        with self._fitted:
            while self._snapshot[1] is None or self._snapshot[1] < target:
                remaining = deadline - time.monotonic()
                failed = self._failed_generation is not None and self._failed_generation >= target
                if remaining <= 0 or failed:
                    return False
                self._fitted.wait(min(remaining, 0.5))
        return True

    # --- reading --------------------------------------------------------------------------------
    @property
    def version(self) -> str | None:
        """`g<generation>` of the model in use, None before the first fit."""
        generation = self._snapshot[1]
        return None if generation is None else f"g{generation}"

    def predictor(self):
        """The fitted Predictor.

        Raises:
            ModelUnavailable: nothing fitted yet.
        """
        predictor = self._snapshot[0]
        if predictor is None:
            raise ModelUnavailable(self.last_error or "the model is still being fitted; retry in a few seconds")
        return predictor

    def profile(self, name: str):
        """The Profile object the current model was fitted with, or None."""
        return self._profiles.get(name)

    def known(self, profile: str, gpu: str) -> bool:
        return bool(self.predictor().known(profile, gpu))

    def predict(self, profile, gpu: str, per_gpu_batch: int, candidates: list[dict]) -> list[dict]:
        """Predictions for candidates, served from the cache when this model answered the same question.

        Raises:
            ModelUnavailable: nothing fitted yet.
        """
        predictor, generation = self._snapshot
        if predictor is None:
            raise ModelUnavailable(self.last_error or "the model is still being fitted; retry in a few seconds")
        key = (generation, profile.name, gpu, per_gpu_batch, candidates_key(candidates))
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        result = predictor.predict(profile, gpu, per_gpu_batch, candidates)
        with self._cache_lock:
            if self.cache_size and self._snapshot[1] == generation:
                self._cache[key] = result
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return result

    def status(self) -> dict:
        return {"model_version": self.version, "fitted_at_s": self.fitted_at_s, "fit_s": self.fit_seconds,
                "fits": self.fits, "last_error": self.last_error, "cached_predictions": len(self._cache)}
