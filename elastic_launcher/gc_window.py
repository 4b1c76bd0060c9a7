"""Keeps Python's cyclic garbage collector out of a switch's pause, and counts the time it takes.

A full collection in a worker that imported torch (and torchvision or transformers) walks a few hundred
thousand objects: tens of milliseconds, the size of a whole shrink pause. A switch allocates many objects (the
new DDP reducer and its buckets), so an automatic full collection often falls right inside it. :class:`GcWindow`
turns automatic collection off from the decision to the first completed step at the new size, then back on (the
deferred collection then runs during normal training, where it costs one slower step, not a pause).

It also counts the seconds spent in collections (``gc.callbacks``) so switch records can say how much of a pause
was the collector's: ``seconds`` is a running total; take differences.
"""
from __future__ import annotations

import gc
import time
from typing import Optional

__all__ = ["GcWindow"]


class GcWindow:
    """``hold()`` / ``release()`` around a pause; ``seconds`` is the time spent collecting since ``start()``.

    Args:
        enabled: hold the collector during pauses (False: only count, e.g. to measure what holding saves).

    ``hold`` is idempotent and remembers whether automatic collection was on: ``release`` turns it back on
    only then, so a program that runs with ``gc.disable()`` keeps it off. ``close`` releases and stops counting.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.seconds = 0.0
        self.collections = 0
        self._t0: Optional[float] = None
        self._held = False
        self._restore = False
        self._counting = False

    def start(self) -> "GcWindow":
        if not self._counting:
            gc.callbacks.append(self._on_gc)
            self._counting = True
        return self

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1
            self._t0 = None

    @property
    def held(self) -> bool:
        return self._held

    def hold(self) -> None:
        """Automatic collection off until :meth:`release` (no-op when not ``enabled`` or already held)."""
        if not self.enabled or self._held:
            return
        self._restore = gc.isenabled()
        gc.disable()
        self._held = True

    def release(self) -> None:
        """Automatic collection back on if :meth:`hold` turned it off (no-op otherwise)."""
        if not self._held:
            return
        self._held = False
        if self._restore:
            gc.enable()

    def close(self) -> None:
        self.release()
        if self._counting:
            try:
                gc.callbacks.remove(self._on_gc)
            except ValueError:
                pass
            self._counting = False
