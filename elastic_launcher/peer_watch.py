"""The peer watch of a worker's heartbeat thread (see ``membership.Membership``, ``on_peer_failure``).

It reads the epoch's keys through the membership's key helper (``has``, ``store``): ``hb/<wid>`` (beats),
``left/<wid>`` (left at a commit point) and ``recover/<epoch>/leader`` (a recovery has begun).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from elastic_launcher import store_keys as keys


class PeerWatch:
    """The heartbeat thread's view of its peers' beats: who has not beaten for ``timeout`` seconds.

    Staleness is judged by this host's monotonic clock from when a peer's beat value last changed, never by
    comparing timestamps written on other hosts. Reports once per epoch.
    """

    def __init__(self, wid: str, timeout: float) -> None:
        self.wid, self.timeout = wid, timeout
        self.epoch: Optional[int] = None
        self.seen: dict[str, tuple[bytes, float]] = {}  # peer -> (last beat value, when it changed here)
        self.reported = False

    def check(self, k, epoch: int, members: Sequence[str]) -> Optional[str]:
        """A reason to declare the epoch broken, once; else None."""
        if epoch != self.epoch:
            self.epoch, self.seen, self.reported = epoch, {}, False
        if self.reported:
            return None
        reason = None
        if k.has(keys.recover_leader(epoch)):
            reason = f"a recovery of epoch {epoch} has begun"
        else:
            now = time.monotonic()
            peers = [m for m in members if m != self.wid]
            beats_at = [keys.beat(m) for m in peers]
            if peers and k.store.check(beats_at):
                beats = k.store.multi_get(beats_at) if hasattr(k.store, "multi_get") else [k.store.get(x) for x in beats_at]
                for m, beat in zip(peers, beats):
                    last = self.seen.get(m)
                    if last is None or last[0] != beat:
                        self.seen[m] = (beat, now)
                    elif now - last[1] > self.timeout and not k.has(keys.left(m)):
                        reason = f"worker {m} has not beaten for {now - last[1]:.1f} s"
                        break
        self.reported = reason is not None
        return reason
