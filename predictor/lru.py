"""ByteBudgetLRU: a thread-safe LRU bounded by the bytes of its entries, not only by their number.

Caches keyed by request content (the prediction cache, the engine's sync-time cache) grow with what clients
send: an entry-count bound lets a few large requests hold gigabytes. Each `put` comes with the caller's cheap
estimate of the entry's size (e.g. candidates x layout length); least recently used entries are evicted until
the summed estimates fit the budget, and an entry larger than the whole budget is not kept at all.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Hashable


class ByteBudgetLRU:
    """LRU mapping bounded by `max_bytes` of estimated entry sizes and, optionally, by `max_entries`.

    Args:
        max_bytes: budget of the summed entry estimates; 0 disables the cache (nothing is kept).
        max_entries: most entries kept; None: only the byte budget bounds them.
    """

    def __init__(self, max_bytes: int, max_entries: int | None = None):
        if max_bytes < 0 or (max_entries is not None and max_entries < 0):
            raise ValueError("max_bytes and max_entries must be >= 0")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        """The value stored under `key` (now the most recently used), else None."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Store `value` as `nbytes` large, evicting the least recently used entries beyond the bounds.

        Returns False (and keeps nothing) when the cache is off or the entry alone exceeds the budget.
        """
        nbytes = max(int(nbytes), 1)
        if nbytes > self.max_bytes or self.max_entries == 0:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes or (self.max_entries is not None
                                                   and len(self._entries) > self.max_entries):
                _, (_, size) = self._entries.popitem(last=False)
                self._bytes -= size
                self.evictions += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def bytes(self) -> int:
        """The summed size estimates of the entries held now (never above `max_bytes`)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
