"""The launcher channel of a job's TCPStore: operator control (`elastic-launch ctl`) and the controller's
status, heartbeat and helper keys.

Keys of the launcher channel (prefix `launcher/` of the job's TCPStore): see elastic_launcher.store_keys.
"""
from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta

import torch.distributed as dist

from elastic_launcher import store_keys as keys


def beat(store_addr: str, timeout: timedelta, stop: threading.Event, interval_s: float = 0.5) -> None:
    """Bump the heartbeat the helper agents watch until `stop` is set, on an own store client (the controller's
    loop may block); run it in a thread. Ends quietly when the store closes."""
    host, port = store_addr.rsplit(":", 1)
    kv = launcher_store(host, int(port), timeout)
    while not stop.wait(interval_s):
        try:
            kv.add(keys.CONTROLLER_BEAT, 1)
        except Exception as exc:  # the store closes at exit
            logging.getLogger("elastic_launcher.control").debug("heartbeat stops: %s", exc)
            return


def serve_store(host: str, port: int, timeout: timedelta) -> tuple[dist.TCPStore, str, dist.Store]:
    """The job's TCPStore, served by the launcher (port 0: any free one): (server, "host:port", its launcher
    channel)."""
    server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    return server, f"{host}:{server.port}", dist.PrefixStore(keys.LAUNCHER, server)


def launcher_store(host: str, port: int, timeout: timedelta) -> dist.Store:
    """A client of the job's TCPStore, restricted to the launcher channel.

    Raises:
        RuntimeError (from torch): the store cannot be reached within `timeout`.
    """
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(keys.LAUNCHER, store)


class ControlClient:
    """What `elastic-launch ctl` uses to talk to a running controller.

    Args:
        host / port: the job's store (from the registry file the controller writes).
        timeout: bounds the connection and the wait for the controller's reply.
    """

    def __init__(self, host: str, port: int, timeout: timedelta = timedelta(seconds=30)):
        self.host, self.port, self.timeout = host, port, timeout

    def request_nodes(self, nodes) -> dict:
        """Ask for a resize to `nodes` (or "auto": lift the operator's size); return the controller's reply (it
        answers before resizing).

        Raises:
            TimeoutError: no reply within the timeout (the controller is busy in a transition or gone).
        """
        store = launcher_store(self.host, self.port, self.timeout)
        seq = store.add(keys.CTL_SEQ, 1)
        store.set(keys.ctl_request(seq), json.dumps({"nodes": nodes}))
        try:
            store.wait([keys.ctl_reply(seq)], self.timeout)
        except Exception as exc:
            raise TimeoutError(f"no reply to request {seq} within {self.timeout.total_seconds():g} s") from exc
        return json.loads(store.get(keys.ctl_reply(seq)))

    def status(self) -> dict:
        store = launcher_store(self.host, self.port, self.timeout)
        store.wait([keys.STATUS], self.timeout)
        return json.loads(store.get(keys.STATUS))


class ControlInbox:
    """Controller side of the operator channel: new requests since the last poll, and replies."""

    def __init__(self, store: dist.Store):
        self.store = store
        self.seen = 0

    def poll(self) -> list[tuple[int, dict]]:
        last = self.store.add(keys.CTL_SEQ, 0)
        out = []
        while self.seen < last:
            self.seen += 1
            key = keys.ctl_request(self.seen)
            if self.store.check([key]):
                try:
                    out.append((self.seen, json.loads(self.store.get(key))))
                except ValueError:
                    self.reply(self.seen, False, "request is not JSON")
        return out

    def reply(self, seq: int, ok: bool, message: str, **extra) -> None:
        self.store.set(keys.ctl_reply(seq), json.dumps({"ok": ok, "message": message, **extra}))
