"""PlotRenderer: the admin plots, drawn off the request path by one background thread per worker (issue #14.4).

A plot request never draws; it answers from this worker's cache of PNG bytes (`PlotRenderer.answer`):

- 200 with the newest drawing of that plot; `X-Plot-State: stale` while a drawing for a newer model version is
  on its way (the old one is served meanwhile), `fresh` otherwise;
- 202 with a small "being drawn" placeholder PNG and `Retry-After` while the first drawing is not ready;
- 404 when a `?profile=&gpu=` filter names no step history (checked against the pairs the thread read last);
- 429 with `Retry-After` when MAX_PENDING plots already wait to be drawn (a client asks too much of the
  renderer; the service itself is fine).

The thread draws the queued plots one at a time, within a drawing-time budget (`DrawBudget`: DUTY of the
wall time, after a burst of BURST), so in a stream of drawings it holds at most about half of the worker's
interpreter time; requests in the other threads keep being served. For every new model version it draws again the plots asked for within
KEEP_WANTED (and, with `prerender`, the admin page's two plots for every model version from the start, so the
first page load finds them drawn). What a figure draws is bounded in predictor.plots; what is cached is bounded
by entries and bytes.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import struct
import threading
import time
import zlib
from datetime import timedelta
from typing import NamedTuple

from predictor import plots
from predictor.errors import NotFoundError

log = logging.getLogger("predictor.plotcache")

MAX_PENDING = 8                             # plots waiting to be drawn; more asks get 429
MAX_ENTRIES = 32                            # drawings cached per worker
MAX_BYTES = 16 * 1024 * 1024                # ... and their PNG bytes at most
KEEP_WANTED = timedelta(minutes=10)         # a plot asked for within this is drawn again for each new model
NO_MODEL_REFRESH = timedelta(seconds=30)    # without a model, a drawing this old is drawn again when asked
CHECK = timedelta(milliseconds=250)         # how often the thread looks for a new model version
DUTY = 0.5                                  # share of time the thread may spend drawing, in the long run
BURST = timedelta(seconds=2)                # drawing time allowed back to back (the admin page's two plots)
RETRY_AFTER_S = 1                           # what 202 and 429 answers tell the client
_MISSING_BYTES = 1024                       # what a cached "nothing matches" counts against MAX_BYTES


class PlotKey(NamedTuple):
    """One plot: `scaling` (optionally narrowed to a profile and/or GPU type) or `links`."""

    kind: str
    profile: str | None = None
    gpu: str | None = None

    @property
    def filtered(self) -> bool:
        return self.profile is not None or self.gpu is not None


DEFAULT_PLOTS = (PlotKey("scaling"), PlotKey("links"))   # the two the /admin page shows


@dataclasses.dataclass
class Rendering:
    """One drawing: the PNG (or, for a filter that matched nothing, the NotFoundError) and what it was drawn from."""

    version: tuple | None          # the model's key (generation, fitted_at) it was drawn with; None: no model
    label: str                     # that model's `g<N>`, or "none"
    png: bytes | None
    missing: NotFoundError | None
    drawn_at: float

    @property
    def nbytes(self) -> int:
        return len(self.png) if self.png is not None else _MISSING_BYTES


class PlotAnswer(NamedTuple):
    """What a plot request gets: an HTTP status, the PNG for 200/202, the model label, the 404's error."""

    status: int
    png: bytes | None = None
    model_version: str | None = None
    state: str | None = None           # 200: fresh | stale
    error: NotFoundError | None = None


def grey_png(width: int = 480, height: int = 48) -> bytes:
    """A plain light-grey PNG built without matplotlib: the placeholder until the thread has drawn its own."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + b"\xee" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


class DrawBudget:
    """Drawing time the renderer may spend: earned at `duty` seconds per second of wall time, up to `burst`.

    A drawing spends what it took; while the budget is negative the next one waits (`wait_s`).
    """

    def __init__(self, duty: float, burst: timedelta, clock=time.monotonic):
        if not 0 < duty <= 1:
            raise ValueError("duty must lie in (0, 1]")
        self.duty = duty
        self.burst = burst.total_seconds()
        self.clock = clock
        self._credit = self.burst
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self._credit = min(self.burst, self._credit + (now - self._at) * self.duty)
        self._at = now

    def wait_s(self) -> float:
        """Seconds until the next drawing may start (0 when it may start now)."""
        if self.duty >= 1:
            return 0.0
        self._refill()
        return 0.0 if self._credit > 0 else -self._credit / self.duty

    def spend(self, seconds: float) -> None:
        self._refill()
        self._credit -= seconds


class PlotRenderer:
    """This worker's admin plots: a cache of drawings answered from, and the one thread that draws them.

    Args:
        store: the history store the plots read.
        models: the ModelCache whose current model the plots show (`current`).
        prerender: from the start, want the admin page's two plots: drawn for each model version (none while
            no model is fitted, unless asked for) without waiting for a request.
        max_pending, max_entries, max_bytes, keep_wanted, no_model_refresh, check, duty, burst: see the
            module's constants of the same names.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, store, models, *, prerender: bool = False, max_pending: int = MAX_PENDING,
                 max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, keep_wanted: timedelta = KEEP_WANTED,
                 no_model_refresh: timedelta = NO_MODEL_REFRESH, check: timedelta = CHECK, duty: float = DUTY,
                 burst: timedelta = BURST, clock=time.monotonic):
        self.store = store
        self.models = models
        self.prerender = prerender
        self.max_pending = max_pending
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.keep_wanted = keep_wanted.total_seconds()
        self.no_model_refresh = no_model_refresh.total_seconds()
        self.check = check.total_seconds()
        self.budget = DrawBudget(duty, burst, clock)
        self.clock = clock
        self._entries: collections.OrderedDict[PlotKey, Rendering] = collections.OrderedDict()
        self._bytes = 0
        self._pending: collections.OrderedDict[PlotKey, None] = collections.OrderedDict()
        self._wanted: collections.OrderedDict[PlotKey, float] = collections.OrderedDict()   # key -> last asked
        self._pairs: tuple[tuple | None, float, set] | None = None   # (version, read at, step pairs)
        self._unasked: set[PlotKey] = set()       # wanted by `prerender` only: not drawn before a model exists
        self._placeholder = grey_png()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.drawings = 0                  # plots drawn by the thread (`status()`)

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "PlotRenderer":
        """Start the drawing thread (once; later calls return at once)."""
        with self._cond:
            if self._thread is not None:
                return self
            if self.prerender:
                now = self.clock()
                for key in DEFAULT_PLOTS:
                    self._wanted[key] = now
                    self._unasked.add(key)
            self._thread = threading.Thread(target=self._run, name="predictor-plots", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout.total_seconds())

    # --- the request path: never draws -----------------------------------------------------------
    def answer(self, key: PlotKey) -> PlotAnswer:
        """What a request for `key` gets now (see the module docstring); never draws, never reads the store."""
        self.start()
        now = self.clock()
        version, label = self._version()
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                stale = self._stale(entry.version, entry.drawn_at, version, now)
                if entry.png is not None or stale:
                    self._want(key, now)
                if stale:
                    self._enqueue(key)             # full: the stale drawing is still served
                if entry.png is not None:
                    return PlotAnswer(200, entry.png, entry.label, "stale" if stale else "fresh")
                if not stale:
                    return PlotAnswer(404, error=entry.missing)
            elif key.filtered and self._known_missing(key, version, now):
                return PlotAnswer(404, error=_not_found(key))
            else:
                self._want(key, now)
            if not self._enqueue(key):
                return PlotAnswer(429)
            return PlotAnswer(202, self._placeholder, label)

    def _want(self, key: PlotKey, now: float) -> None:
        self._unasked.discard(key)
        self._wanted[key] = now
        self._wanted.move_to_end(key)
        while len(self._wanted) > self.max_entries:
            self._wanted.popitem(last=False)

    def _enqueue(self, key: PlotKey) -> bool:
        if key in self._pending:
            return True
        if len(self._pending) >= self.max_pending:
            return False
        self._pending[key] = None
        self._cond.notify_all()
        return True

    # --- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._placeholder = plots.rendering_png()
        except Exception:  # noqa: BLE001 - the grey placeholder stays
            log.exception("drawing the placeholder failed")
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # noqa: BLE001 - the thread must survive a broken store or plot
                log.exception("plot renderer step failed")
                self._stop.wait(self.check)

    def _step(self) -> None:
        with self._cond:
            if not self._pending:
                self._cond.wait(self.check)
            key = next(iter(self._pending)) if self._pending else None   # stays queued until drawn: no twin
        if self._stop.is_set():
            return
        if key is None:
            self._want_again()
            return
        delay = self.budget.wait_s()
        if delay > 0 and self._stop.wait(delay):
            return
        started = self.clock()
        try:
            rendering = self._draw(key)
        finally:
            with self._cond:
                self._pending.pop(key, None)
        self.budget.spend(self.clock() - started)
        with self._cond:
            self._keep(key, rendering)
            self.drawings += 1

    def _want_again(self) -> None:
        """Queue the plots asked for within `keep_wanted` whose drawing is older than the model in use."""
        now = self.clock()
        version, _ = self._version()
        with self._cond:
            for key, asked in list(self._wanted.items()):
                if now - asked > self.keep_wanted or (version is None and key in self._unasked):
                    continue
                entry = self._entries.get(key)
                if entry is None or self._stale(entry.version, entry.drawn_at, version, now):
                    self._enqueue(key)

    def _draw(self, key: PlotKey) -> Rendering:
        model = self.models.current
        version, label = (model.key, model.version) if model is not None else (None, "none")
        predictor = model.predictor if model is not None else None
        now = self.clock()
        if key.filtered:
            self._read_pairs(version, now)
        try:
            if key.kind == "scaling":
                png = plots.scaling_png(self.store, predictor, profile=key.profile, gpu=key.gpu)
            else:
                png = plots.links_png(self.store, predictor)
            return Rendering(version, label, png, None, now)
        except NotFoundError as exc:
            return Rendering(version, label, None, exc, now)
        except Exception as exc:  # noqa: BLE001 - shown on the image; drawn again for the next model
            log.exception("drawing plot %s failed", key)
            return Rendering(version, label, plots.failed_png(f"{type(exc).__name__}: {exc}"), None, now)

    def _read_pairs(self, version: tuple | None, now: float) -> None:
        pairs = self._pairs
        if pairs is None or self._stale(pairs[0], pairs[1], version, now):
            found = self.store.step_pairs()
            with self._cond:
                self._pairs = (version, now, found)

    def _keep(self, key: PlotKey, rendering: Rendering) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._entries[key] = rendering
        self._bytes += rendering.nbytes
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.nbytes

    # --- helpers --------------------------------------------------------------------------------
    def _version(self) -> tuple[tuple | None, str]:
        model = self.models.current
        return (model.key, model.version) if model is not None else (None, "none")

    def _stale(self, drawn_version: tuple | None, drawn_at: float, version: tuple | None, now: float) -> bool:
        if drawn_version != version:
            return True
        return version is None and now - drawn_at > self.no_model_refresh

    def _known_missing(self, key: PlotKey, version: tuple | None, now: float) -> bool:
        """The step pairs read for the model in use name nothing the filter matches (unknown: False)."""
        pairs = self._pairs
        if pairs is None or self._stale(pairs[0], pairs[1], version, now):
            return False
        return not any((key.profile is None or key.profile == p) and (key.gpu is None or key.gpu == g)
                       for p, g in pairs[2])

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def status(self) -> dict:
        with self._cond:
            return {"cached": len(self._entries), "cached_bytes": self._bytes, "pending": len(self._pending),
                    "drawings": self.drawings}


def _not_found(key: PlotKey) -> NotFoundError:
    return NotFoundError("step history", f"{key.profile or '*'} on {key.gpu or '*'}",
                         "list what exists with `elastic-predictor models`")
