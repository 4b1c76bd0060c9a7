"""How an :class:`~elastic_launcher.trainer.ElasticTrainer` moves between membership epochs.

The :class:`EpochTransitions` mixin holds the epoch changes the commit vote decides on: joining the first
epoch (state from the plan's first survivor), preparing the next epoch's group in the background, switching
to it (or leaving) at a commit point, rolling back a failed step, and recovering from a failed collective
(agree on survivors, rebuild, roll back, resync). ``trainer.py`` holds the API, the loader and the vote.

Expects on ``self`` (set by ``ElasticTrainer.__init__``): ``config``, ``device``, ``module``, ``optimizer``,
``scheduler``, ``policy``, ``telemetry``, ``fault``, ``wid``, ``addr``, ``state``, ``membership``, ``sampler``,
``plan``, ``group``, ``ddp``, ``_hook``, ``_store``, ``_next``, ``_next_thread``, ``_pending_switch``,
``switches``, ``failures``, ``left``, ``_local_error``, ``_nonfinite``, ``schedule``, ``committed_step``,
``_joined``, and the properties
``rank``, ``world_size``, ``step``.
"""
from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_launcher.errors import LeftGroup, ProcessGroupError, TooManyFailures
from elastic_launcher.membership import Plan
from elastic_launcher.process_group import ProcessGroupWrapper
from elastic_launcher.telemetry import HookState, elastic_allreduce_hook

logger = logging.getLogger("elastic_launcher.trainer")
events = logging.getLogger("elastic_launcher.events")  # resize / recovery records

_DDP_PARAMS = inspect.signature(DDP.__init__).parameters


class EpochTransitions:
    """Joining, switching, leaving, rollback and recovery (mixed into ``ElasticTrainer``)."""

    # ---- joining and switching ------------------------------------------------------------------------------
    def _new_wrapper(self) -> ProcessGroupWrapper:
        c = self.config
        return ProcessGroupWrapper(c.backend, self.device, c.timeout, c.connect_timeout)

    def _join(self) -> None:
        """First entry into the group: receive the state from the plan's first survivor (rank 0 initially)."""
        src = self._source_rank(self.plan)
        t0 = time.perf_counter()
        self.state.broadcast(self.group, src, self._store, f"state/{self.plan.id}", self.config.rendezvous_timeout)
        t1 = time.perf_counter()
        self.sampler.prefetch()
        self._enter(self.plan, newcomer=True)
        self._joined = True
        # The first epoch's rank 0 reports it switched (the controller waits for that); a newcomer of a later
        # epoch only records its own join (that epoch's rank 0 is a survivor and reports it).
        self._pending_switch = {"epoch": self.plan.id, "prev": self.plan.prev,
                                "kind": "initial" if self.plan.kind == "initial" else "join",
                                "world": self.plan.world_size, "step": self.step, "t_decide": t1,
                                "state_wait_and_sync_s": t1 - t0, "enter_s": time.perf_counter() - t1}

    def _source_rank(self, plan: Plan) -> int:
        if plan.kind == "initial" or plan.prev == 0:
            return 0
        prev = self.membership.plan(plan.prev)
        return min(plan.rank_of(m) for m in plan.members if m in prev.members)

    def _enter(self, plan: Plan, newcomer: bool = False) -> None:
        """Re-wraps DDP on the current group and repartitions; the epoch is ``plan`` from here on."""
        self.plan = plan
        self.epoch_start_step = self.step  # same on every rank of the plan (survivors and newcomers)
        if self.ddp is not None:
            self.ddp = None  # drop the old reducer (and its autograd hooks) before wrapping again
        kw = dict(process_group=self.group.pg, init_sync=False, bucket_cap_mb=self.config.bucket_cap_mb)
        kw["forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMS else "broadcast_buffers"] = False
        if self.device.type == "cuda":
            kw["device_ids"] = [self.device.index]
        self.ddp = DDP(self.module, **kw)
        self._hook = HookState(self.group, self.telemetry)
        self._hook.fault = self.fault
        self._hook.step_fn = lambda: self.step
        self.ddp.register_comm_hook(self._hook, _hook_with_fault)
        self._repartition()
        self._epoch_group = (plan.id, self.group)
        self.membership.watch(plan)
        if self.rank == 0:
            self.membership.publish_current(plan)
        self._local_error = self._nonfinite = None
        self.state.snapshot()
        self.committed_step = self.step
        self.schedule.enter(self.step, time.perf_counter())  # next commit point: the first step of the epoch

    def _repartition(self) -> None:
        world = self.world_size
        speeds = [float(self._store.get(f"speed/{m}")) for m in self.plan.members]
        self.batches = self.policy.split(world, speeds if len(set(speeds)) > 1 else None)
        g = sum(self.batches)
        c = self.state.counters
        if not c.get("ref_global"):
            c["ref_global"] = self.policy.ref_global or g
        factor = self.policy.lr_factor(g, c["ref_global"])
        ratio = factor / c["lr_factor"]
        if ratio != 1.0:
            for pg in self.optimizer.param_groups:
                pg["lr"] *= ratio
            if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
                self.scheduler.base_lrs = [lr * ratio for lr in self.scheduler.base_lrs]
        c["lr_factor"] = factor

    def _maybe_prepare_next(self) -> None:
        nxt = self.membership.next_plan()
        if nxt is None or (self._next is not None and self._next[0] == nxt.id) or self._next_thread is not None:
            return
        if self.wid not in nxt.members:
            self._next = (nxt.id, None)  # leaving: ready at once
            return

        def build() -> None:
            g = self._new_wrapper()
            try:
                g.configure(self.addr.with_prefix(f"{self.addr.prefix}/{nxt.group_prefix}"),
                            nxt.rank_of(self.wid), nxt.world_size)
            except Exception as e:  # noqa: BLE001 - a superseded or failed plan: stay in the current epoch
                logger.warning("building group for epoch %d failed: %s", nxt.id, e)
                g.abort()
                return
            self._next = (nxt.id, g)

        self._next_thread = threading.Thread(target=build, name=f"elastic-build-{nxt.id}", daemon=True)
        self._next_thread.start()

    def _drop_next(self) -> None:
        if self._next is not None and self._next[1] is not None:
            self._next[1].abort()
        self._next, self._next_thread = None, None

    def _switch(self, t_decide: float) -> bool:
        """Everyone voted ready for the posted plan: leave, or move to the prepared group."""
        pid, new_group = self._next  # type: ignore[misc]
        nxt = self.membership.next_plan()
        old_plan, old_group = self.plan, self.group
        self._next, self._next_thread = None, None
        self.ddp = None  # the old reducer (freed later by the cyclic GC; the old group stays retired)
        if new_group is None:
            old_group.abort()
            self.left = True
            self.membership.mark_left()
            events.info("left at epoch %d -> %d", old_plan.id, pid, extra={"wid": self.wid, "step": self.step})
            return False
        t0 = time.perf_counter()
        self.group = new_group
        old_group.abort()
        t1 = time.perf_counter()
        newcomers = [m for m in nxt.members if m not in old_plan.members]
        nbytes = 0
        if newcomers:
            nbytes = self.state.broadcast(self.group, self._source_rank(nxt), self._store, f"state/{nxt.id}",
                                          self.config.rendezvous_timeout)
        t2 = time.perf_counter()
        self._enter(nxt)
        t3 = time.perf_counter()
        self._pending_switch = {"epoch": nxt.id, "prev": old_plan.id, "kind": nxt.kind,
                                "old_world": old_plan.world_size, "world": nxt.world_size, "step": self.step,
                                "t_decide": t_decide, "abort_s": t1 - t0, "state_sync_s": t2 - t1,
                                "state_bytes": nbytes, "rewrap_s": t3 - t2, "t_entered": t3}
        return True

    def _finish_switch(self, t: float) -> None:
        """Called at the first commit after a switch: the first step at the new size is done."""
        rec = self._pending_switch
        self._pending_switch = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            t = time.perf_counter()
        rec["pause_s"] = t - rec.pop("t_decide")
        if "t_entered" in rec:
            rec["first_step_s"] = t - rec.pop("t_entered")
        self.switches.append(rec)
        events.info("switch %s", json.dumps(rec), extra={"wid": self.wid, "step": self.step})
        if self.rank == 0 and rec["kind"] != "join":
            self.membership.report_switched(self.plan, rec)

    # ---- failure handling -----------------------------------------------------------------------------------
    def _rollback(self, err: Optional[BaseException]) -> None:
        self.failures += 1
        if self.failures > self.config.max_retries:
            raise TooManyFailures(f"{self.failures} failed commits in a row at step {self.step}; last: {err}")
        self.state.restore()
        self._local_error = self._nonfinite = None
        self.schedule.enter(self.step, time.perf_counter())
        logger.warning("rolled back to step %d after %s", self.step, err)

    def _recover(self, err: Optional[BaseException]) -> None:
        """A collective failed: agree on survivors, rebuild, roll back to the last commit, resync from rank 0."""
        t0 = time.perf_counter()
        self.failures += 1
        if self.failures > self.config.max_retries:
            raise TooManyFailures(f"{self.failures} failed commits in a row at step {self.step}; last: {err}")
        failed, old = self.plan, self.group
        self._drop_next()
        self.ddp = None
        plan = self.membership.recover(failed)
        if self.wid not in plan.members:
            old.abort()
            self.left = True
            raise LeftGroup(f"worker {self.wid} was declared dead in recovery of epoch {failed.id}")
        new = None
        dead = [failed.rank_of(m) for m in failed.members if m not in plan.members]
        if self.config.try_shrink and dead:
            try:
                new = old.shrink(dead, abort=True)
            except ProcessGroupError as e:
                logger.info("shrink unavailable, rebuilding: %s", e)
        old.abort()
        if new is None:
            new = self._new_wrapper()
            new.configure(self.addr.with_prefix(f"{self.addr.prefix}/{plan.group_prefix}"),
                          plan.rank_of(self.wid), plan.world_size)
        self.group = new
        lost, interval = self.step - self.committed_step, self.schedule.interval
        self.state.restore()
        self.state.broadcast(self.group, 0, self._store, f"state/{plan.id}", self.config.rendezvous_timeout)
        self._enter(plan)
        t1 = time.perf_counter()
        rec = {"epoch": plan.id, "prev": failed.id, "kind": "recovery", "old_world": failed.world_size,
               "world": plan.world_size, "step": self.step, "lost_steps": lost, "commit_interval": interval,
               "recover_s": t1 - t0, "error": str(err)[:200]}
        events.warning("recovery %s", json.dumps(rec), extra={"wid": self.wid, "step": self.step})
        # completed (pause_s, switches, elastic/switched/<id> from rank 0) at the first commit of the new epoch
        self._pending_switch = {**rec, "t_decide": t0, "t_entered": t1}


def _hook_with_fault(state: HookState, bucket):  # no return annotation (see elastic_allreduce_hook)
    """The elastic hook, plus the ``fail_at`` seam: dies mid-backward when the fault plan says so."""
    fault = getattr(state, "fault", None)
    if fault is not None and bucket.index() == 0:
        fault.maybe_fail(state.group.rank(), state.step_fn())
    return elastic_allreduce_hook(state, bucket)
