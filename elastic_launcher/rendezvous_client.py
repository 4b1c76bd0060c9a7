"""The trainer's rendezvous client: connects to the controller's store, runs the heartbeat (:class:`Membership`),
announces the worker, waits for a plan that includes it and watches for the next one (:class:`NextEpoch`, its group
built in the background). The only part of the trainer that uses the store itself (the executor uses its connection).
"""
from __future__ import annotations

import json
import time
from typing import Callable, Optional

import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.epochs import NextEpoch, PeerFailureRelay
from elastic_launcher.errors import ProcessGroupError
from elastic_launcher.membership import Membership, Plan
from elastic_launcher.process_group import ProcessGroupWrapper, StoreAddr, connect_store
from elastic_launcher.state import wait_posted
from elastic_launcher.trainer_config import TrainerConfig

__all__ = ["RendezvousClient"]


class RendezvousClient:
    """One worker's side of the rendezvous, built with the store's address and the trainer's timeouts; connects on
    :meth:`connect`, announces on :meth:`announce`. ``current``: the epoch whose group :meth:`heartbeat_ended`
    fails; ``fault``: the trainer's test seam (its ``on_recovery`` goes to the membership)."""

    def __init__(self, addr: StoreAddr, wid: str, config: TrainerConfig, current, fault=None) -> None:
        self.addr = addr
        self.wid = wid
        self.config = config
        self.fault = fault
        self._current = current
        self.store: Optional[dist.Store] = None  # the state channel: speeds, loader starts, the executor's keys
        self.membership: Optional[Membership] = None  # the heartbeat thread, once open()
        self.relay = PeerFailureRelay()
        self.next_epoch: Optional[NextEpoch] = None  # the next plan and its group, once announce()
        self.end_reason: Optional[str] = None  # why this worker ended on its own (its heartbeat could not be written)

    def connect(self) -> dist.Store:
        """Connects to the store's state channel (within ``connect_timeout``; raises ProcessGroupError)."""
        self.store = connect_store(self.addr.with_prefix(keys.state_channel(self.addr.prefix)),
                                   self.config.connect_timeout)
        return self.store

    def open(self) -> Membership:
        """Builds the membership (its heartbeat starts in :meth:`announce`)."""
        config = self.config
        watchdog = config.peer_watchdog if config.peer_watchdog is not None else config.backend == "nccl"
        self.membership = Membership(lambda: connect_store(self.addr, config.connect_timeout), self.wid,
                                     config.rendezvous_timeout, config.heartbeat_interval, config.heartbeat_timeout,
                                     on_peer_failure=self.relay if watchdog else None,
                                     on_recovery=getattr(self.fault, "on_recovery", None),
                                     arrival_timeout=(config.arrival_timeout
                                                      or config.timeout + config.heartbeat_timeout),
                                     on_end=self.heartbeat_ended)
        return self.membership

    def announce(self, speed: float,
                 build: Callable[[Plan], ProcessGroupWrapper]) -> tuple[Plan, ProcessGroupWrapper, dict]:
        """Publishes ``speed``, announces the worker (starts the heartbeat), waits for a plan that includes it and
        builds that plan's group with ``build``. Returns the plan, its group and the times of those phases.

        Raises:
            RendezvousTimeout: no plan within ``rendezvous_timeout``.
            ProcessGroupError: the group was not built.
        """
        self.next_epoch = NextEpoch(self.membership, self.wid, build)
        self.store.set(keys.speed(self.wid), repr(speed))  # read by every member of a plan that includes it
        t_announce = time.perf_counter()
        self.membership.start()  # announced: from here on a failure must stop the heartbeat
        plan = self.membership.wait_for_plan()
        t_plan = time.perf_counter()
        group = build(plan)
        return plan, group, {"plan_wait_s": t_plan - t_announce, "group_s": time.perf_counter() - t_plan,
                             "t_joined": time.perf_counter()}

    def heartbeat_ended(self, reason: str) -> None:
        """The membership's ``on_end`` (heartbeat thread): the beat could not be written for ``heartbeat_timeout``,
        so the peers judge this worker dead. The group is failed (a collective blocked on a peer wakes up) and the
        next ``commit()`` ends this worker."""
        self.end_reason = reason
        group = self._current.group
        if group is not None:
            group.fail(ProcessGroupError(reason))

    def publish_loader_start(self, plan_id: int, step: int, epoch: int, pos: int) -> None:
        """Where epoch ``plan_id`` starts (``keys.loader_start``): newcomers' loaders read ahead from there."""
        self.store.set(keys.loader_start(plan_id), json.dumps({"step": step, "epoch": epoch, "pos": pos}))

    def loader_start(self, plan_id: int, give_up: Optional[Callable[[], str]] = None) -> dict:
        """What :meth:`publish_loader_start` wrote for ``plan_id``, waited for up to ``rendezvous_timeout`` and while
        ``give_up()`` (a newcomer's round watch, ``EpochExecutor.entry_watch``) says nothing.

        Raises:
            RendezvousTimeout: not published in time, or ``give_up`` gave a reason.
        """
        key = keys.loader_start(plan_id)
        wait_posted(self.store, key, self.config.rendezvous_timeout, give_up,
                    self.config.heartbeat_interval.total_seconds() / 2, "loader start")
        return json.loads(self.store.get(key))

    def stop(self) -> None:
        """Stops the heartbeat, if it was built (idempotent)."""
        if self.membership is not None:
            self.membership.stop()
