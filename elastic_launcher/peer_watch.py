"""The peer watch of a worker's heartbeat thread (see ``membership.Membership``, ``on_peer_failure``).

It reads the epoch's keys through the membership's key helper (``has``, ``store``): ``hb/<wid>`` (beats) and
``left/<wid>`` (left at a commit point); whether a recovery of the epoch has begun comes from the membership
record the heartbeat thread read in the same beat.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

from elastic_launcher import store_keys as keys


class BeatClock:
    """How long each worker's beat has not changed, by this process's monotonic clock (#27: never by comparing
    timestamps other hosts wrote, so a peer whose wall clock is off is neither dead nor alive by that). A worker
    first seen now counts as having just beaten. Safe to share between threads.

    Args:
        clock: this process's monotonic clock (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[str, tuple[bytes, float]] = {}  # worker -> (last beat value, when it changed here)
        self._lock = threading.Lock()

    def silent_for(self, wid: str, beat: Optional[bytes]) -> float:
        """Seconds since ``wid``'s beat value last changed (``beat``: its value now; None: it has none, then since
        it was first asked about)."""
        now = self.clock()
        with self._lock:
            last = self._seen.get(wid)
            if last is None or last[0] != beat:
                self._seen[wid] = (beat, now)
                return 0.0
            return now - last[1]


class PeerWatch:
    """The heartbeat thread's view of its peers' beats: who has not beaten for ``timeout`` seconds.

    Staleness is judged by this host's monotonic clock from when a peer's beat value last changed, never by
    comparing timestamps written on other hosts. Reports once per epoch.
    """

    def __init__(self, wid: str, timeout: float, beats: Optional[BeatClock] = None) -> None:
        self.wid, self.timeout = wid, timeout
        self.epoch: Optional[int] = None
        self.beats = beats or BeatClock()  # shared with the membership's recovery (Membership.beats)
        self.reported = False

    def check(self, k, epoch: int, members: Sequence[str], recovering: bool = False) -> Optional[str]:
        """A reason to declare the epoch broken, once; else None (``recovering``: the record shows a recovery of
        ``epoch`` begun by another rank)."""
        if epoch != self.epoch:
            self.epoch, self.reported = epoch, False
        if self.reported:
            return None
        reason = None
        if recovering:
            reason = f"a recovery of epoch {epoch} has begun"
        else:
            peers = [m for m in members if m != self.wid]
            beats_at = [keys.beat(m) for m in peers]
            if peers and k.store.check(beats_at):
                beats = k.store.multi_get(beats_at) if hasattr(k.store, "multi_get") else [k.store.get(x) for x in beats_at]
                for m, beat in zip(peers, beats):
                    silent = self.beats.silent_for(m, beat)
                    if silent > self.timeout and not k.has(keys.left(m)):
                        reason = f"worker {m} has not beaten for {silent:.1f} s"
                        break
        self.reported = reason is not None
        return reason
