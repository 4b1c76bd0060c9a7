"""How an :class:`~elastic_launcher.trainer.ElasticTrainer` moves between membership epochs: the executor of the
decisions in :mod:`elastic_launcher.epoch_decisions` (whose docstring draws the transitions), and the small
stateful helpers around it.

Decisions and their execution are apart (as torchelastic's rendezvous and agent do): a pure ``decide_*`` function
looks at what a commit point, a posted plan or a recovery says and returns an action; :class:`EpochExecutor`
applies it (groups, DDP wraps, state broadcasts, store keys) and returns what the trainer adopts. No class here
reads an attribute another class sets.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_launcher import store_keys as keys
from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.epoch_decisions import PrepareKind, RecoveryKind, decide_prepare, decide_recovery, source_rank
from elastic_launcher.errors import LeftGroup, PeerFailure, ProcessGroupError, RendezvousTimeout
from elastic_launcher.membership import Membership, Plan
from elastic_launcher.process_group import ProcessGroupWrapper, StoreAddr, give_up_build
from elastic_launcher.state import TrainingState
from elastic_launcher.telemetry import HookState, Telemetry, elastic_allreduce_hook

logger = logging.getLogger("elastic_launcher.trainer")
events = logging.getLogger("elastic_launcher.events")  # resize / recovery records

__all__ = ["Epoch", "PeerFailureRelay", "NextEpoch", "SwitchLog", "ExecutorSettings", "EpochExecutor"]

_DDP_PARAMS = inspect.signature(DDP.__init__).parameters


# ---- state the executor hands back --------------------------------------------------------------------------
@dataclass
class Epoch:
    """The epoch a worker trains in, as the executor built it.

    Attributes:
        plan: the membership epoch.
        group: its process group.
        ddp: the DDP wrapper on ``group``.
        hook: the wrapper's communication hook state.
        batches: every rank's local batch size (``BatchPolicy.split``).
    """

    plan: Plan
    group: ProcessGroupWrapper
    ddp: DDP
    hook: HookState
    batches: list[int]


class PeerFailureRelay:
    """Called from the heartbeat thread when a peer of an epoch stopped beating, or its recovery began: fails
    that epoch's group (an NCCL communicator is aborted), so a training thread waiting on the dead peer wakes
    up with an error and its commit vote turns into a recovery. Reports of an epoch already left are dropped."""

    def __init__(self) -> None:
        self._current: Optional[tuple[int, ProcessGroupWrapper]] = None

    def watch(self, epoch: int, group: ProcessGroupWrapper) -> None:
        """From now on, failures reported for ``epoch`` fail ``group``."""
        self._current = (epoch, group)

    def __call__(self, epoch: int, reason: str) -> None:
        current = self._current
        if current is not None and current[0] == epoch:
            current[1].fail(PeerFailure(f"epoch {epoch}: {reason}"))


class NextEpoch:
    """The next epoch's group, built in the background while training goes on.

    Args:
        membership: where posted plans appear (``next_plan()`` reads no store).
        wid: this worker.
        build: ``build(plan) -> group`` configures the plan's group (blocking; runs on a thread).
    """

    def __init__(self, membership: Membership, wid: str, build: Callable[[Plan], ProcessGroupWrapper]) -> None:
        self._membership = membership
        self._wid = wid
        self._build = build
        self._decided: Optional[int] = None  # the plan id last acted on
        self._ready: Optional[tuple[int, Optional[ProcessGroupWrapper]]] = None  # (plan id, group or None=leave)
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> None:
        """Every step: acts on a newly posted plan (no store access, no allocation otherwise)."""
        nxt = self._membership.next_plan()
        if nxt is None or nxt.id == self._decided or self._thread is not None:
            return
        self._decided = nxt.id
        action = decide_prepare(nxt, self._wid)
        if action.kind is PrepareKind.LEAVE:
            self._ready = (nxt.id, None)
            return
        self._thread = threading.Thread(target=self._run_build, args=(nxt,), name=f"elastic-build-{nxt.id}",
                                        daemon=True)
        self._thread.start()

    def _run_build(self, plan: Plan) -> None:
        try:
            g = self._build(plan)
        except Exception as e:  # noqa: BLE001 - a superseded or failed plan: stay in the current epoch
            logger.warning("building group for epoch %d failed: %s", plan.id, e)
            return
        self._ready = (plan.id, g)

    def ready_id(self) -> int:
        """The plan id this worker is ready to switch to (its vote), 0 when none."""
        ready = self._ready
        return ready[0] if ready is not None else 0

    def prepared(self) -> Optional[tuple[int, ProcessGroupWrapper]]:
        """(plan id, group) of the next epoch this worker is ready to switch to and stays in; None otherwise."""
        ready = self._ready
        return ready if ready is not None and ready[1] is not None else None

    def leaving(self) -> bool:
        """The prepared next plan leaves this worker out."""
        ready = self._ready
        return ready is not None and ready[1] is None

    def take(self) -> tuple[int, Optional[ProcessGroupWrapper]]:
        """Hands the prepared (plan id, group or None to leave) over; nothing is prepared afterwards.

        Raises:
            ProcessGroupError: nothing was prepared (the vote said ready: a bug).
        """
        ready = self._ready
        if ready is None:
            raise ProcessGroupError("switch voted without a prepared next epoch")
        self._ready, self._thread, self._decided = None, None, None
        return ready

    def drop(self) -> None:
        """Forgets the prepared epoch, aborting its group."""
        if self._ready is not None and self._ready[1] is not None:
            self._ready[1].abort()
        self._ready, self._thread, self._decided = None, None, None


class SwitchLog:
    """The records of epoch changes: one is pending from the change until the first commit point after it.

    Args:
        wid: this worker, for the event log.
        device: a CUDA device is synchronised before a pause ends (its queued first step is part of it).
    """

    def __init__(self, wid: str, device: torch.device) -> None:
        self._wid = wid
        self._device = device
        self.pending: Optional[dict] = None
        self.done: list[dict] = []

    def begin(self, rec: dict) -> None:
        """A change happened; ``rec`` holds ``t_decide`` (and ``t_entered`` once the new epoch was entered)."""
        self.pending = rec

    def finish(self, t: float, step: int) -> Optional[dict]:
        """The first commit point after the change, at ``t``: completes and returns the record (None if none)."""
        rec = self.pending
        if rec is None:
            return None
        self.pending = None
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            t = time.perf_counter()
        rec["pause_s"] = t - rec.pop("t_decide")
        if "t_entered" in rec:
            rec["first_step_s"] = t - rec.pop("t_entered")
        self.done.append(rec)
        events.info("switch %s", json.dumps(rec), extra={"wid": self._wid, "step": step})
        return rec


# ---- execution ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExecutorSettings:
    """What the executor needs of ``TrainerConfig``.

    Attributes:
        backend, timeout, connect_timeout: of every group built.
        rendezvous_timeout: waiting for a state skeleton.
        bucket_cap_mb: DDP bucket size.
    """

    backend: str
    timeout: timedelta
    connect_timeout: timedelta
    rendezvous_timeout: timedelta
    bucket_cap_mb: float


class EpochExecutor:
    """Applies the decisions: builds groups, wraps DDP, moves state. Holds only what it is given here.

    Args:
        settings: timeouts and sizes.
        wid: this worker.
        addr: the job store's address (group prefixes go under it).
        store: the trainer's store client (speeds, state skeletons).
        membership: this worker's membership client.
        state: the registered training state.
        module: the bare model.
        optimizer: its optimizer (learning rates follow the global batch).
        scheduler: its LR scheduler or None.
        policy: the batch/LR policy.
        device: the model's device.
        telemetry: the hook's timing collector or None.
        fault: the ``fail_at`` test seam or None.
        relay: the peer watchdog's relay (pointed at each entered epoch's group).
    """

    def __init__(self, settings: ExecutorSettings, *, wid: str, addr: StoreAddr, store, membership: Membership,
                 state: TrainingState, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 policy: BatchPolicy, device: torch.device, telemetry: Optional[Telemetry], fault,
                 relay: PeerFailureRelay) -> None:
        self.settings = settings
        self.wid = wid
        self.addr = addr
        self.store = store
        self.membership = membership
        self.state = state
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.policy = policy
        self.device = device
        self.telemetry = telemetry
        self.fault = fault
        self.relay = relay

    # ---- groups ---------------------------------------------------------------------------------------------
    def new_group(self, plan: Plan) -> ProcessGroupWrapper:
        """A configured group for ``plan`` (blocking; aborted again when configuring fails).

        Raises:
            ProcessGroupError, RendezvousTimeout: the group could not be built.
        """
        s = self.settings
        g = ProcessGroupWrapper(s.backend, self.device, s.timeout, s.connect_timeout)
        try:
            g.configure(self.addr.with_prefix(keys.group_channel(self.addr.prefix, plan.id)), plan.rank_of(self.wid),
                        plan.world_size)
        except BaseException:
            g.abort()
            raise
        return g

    def _source(self, plan: Plan) -> int:
        prev = self.membership.plan(plan.prev) if plan.kind != "initial" and plan.prev != 0 else None
        return source_rank(plan, prev)

    def _broadcast_state(self, group: ProcessGroupWrapper, src: int, plan: Plan, watch: Callable[[], str]) -> int:
        """Moves rank ``src``'s state to every rank of ``group``: a receiver waits for the state skeleton while
        ``watch()`` (:meth:`_round_watch`) says nothing."""
        return self.state.broadcast(group, src, self.store, keys.state(plan.id), self.settings.rendezvous_timeout,
                                    give_up=watch, poll=self.membership.heartbeat_interval.total_seconds() / 2)

    # ---- entering an epoch ----------------------------------------------------------------------------------
    def enter(self, plan: Plan, group: ProcessGroupWrapper, step_fn: Callable[[], int]) -> Epoch:
        """Wraps DDP on ``group`` (no init sync), splits the batch, scales learning rates, watches ``plan``.
        The caller drops the old wrapper first (its reducer holds autograd hooks)."""
        kw = dict(process_group=group.pg, init_sync=False, bucket_cap_mb=self.settings.bucket_cap_mb)
        kw["forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMS else "broadcast_buffers"] = False
        if self.device.type == "cuda":
            kw["device_ids"] = [self.device.index]
        ddp = DDP(self.module, **kw)
        hook = HookState(group, self.telemetry, fault=self.fault, step_fn=step_fn)
        ddp.register_comm_hook(hook, _hook_with_fault)
        batches = self._repartition(plan, group.size())
        self.relay.watch(plan.id, group)
        self.membership.watch(plan)
        if group.rank() == 0:
            self.membership.note_switched(plan)  # the record notes it from the heartbeat thread
            self.store.set(keys.batches(plan.id), json.dumps(batches))  # what ran, for the launcher's step rows
        return Epoch(plan, group, ddp, hook, batches)

    def batches_for(self, plan: Plan, world: int) -> list[int]:
        """Every rank's local batch in ``plan`` (reads the members' speeds; changes nothing)."""
        speeds = [float(self.store.get(keys.speed(m))) for m in plan.members]
        return self.policy.split(world, speeds if len(set(speeds)) > 1 else None)

    def _repartition(self, plan: Plan, world: int) -> list[int]:
        batches = self.batches_for(plan, world)
        g = sum(batches)
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
        return batches

    # ---- transitions ----------------------------------------------------------------------------------------
    def join(self, plan: Plan, group: ProcessGroupWrapper, step_fn: Callable[[], int]) -> tuple[Epoch, dict]:
        """First entry into ``plan``: receive the state from its first survivor (rank 0 initially). Returns the
        epoch and its pending switch record (completed at the first commit point).

        A newcomer's wait for the state skeleton is watched by :meth:`entry_watch`.

        Raises:
            RendezvousTimeout: the state did not come (a newcomer never trained: it ends, and the survivors'
                recovery of ``plan`` goes on without it).
        """
        t0 = time.perf_counter()
        on_switch = getattr(self.fault, "on_switch", None)
        if on_switch is not None and plan.kind != "initial":
            on_switch("join")  # test seam: a newcomer dies during the switch's state broadcast
        self._broadcast_state(group, self._source(plan), plan, self.entry_watch(plan))
        t1 = time.perf_counter()
        if self.state.sampler is not None:
            self.state.sampler.prefetch()
        epoch = self.enter(plan, group, step_fn)
        # The first epoch's rank 0 reports it switched (the controller waits for that); a newcomer of a later
        # epoch only records its own join (that epoch's rank 0 is a survivor and reports it).
        rec = {"epoch": plan.id, "prev": plan.prev, "kind": "initial" if plan.kind == "initial" else "join",
               "world": plan.world_size, "step": step_fn(), "t_decide": t1, "state_wait_and_sync_s": t1 - t0,
               "enter_s": time.perf_counter() - t1}
        return epoch, rec

    def leave(self, old: Plan, old_group: ProcessGroupWrapper, pid: int, step: int) -> None:
        """Leaves at a commit point: this worker is not in plan ``pid``."""
        old_group.abort()
        self.membership.mark_left()
        events.info("left at epoch %d -> %d", old.id, pid, extra={"wid": self.wid, "step": step})

    def entry_watch(self, plan: Plan) -> Callable[[], str]:
        """The watch of a member's waits on its first entry into ``plan`` (:meth:`_round_watch`, up to
        ``rendezvous_timeout`` from now): a newcomer's wait for where the epoch starts and for its state. It has no
        arrival deadline of its own: the wait began before the survivors reached the switch (they train on until
        the commit point that finds everyone ready), so it ends when a member of ``plan`` is silent or a recovery of
        ``plan`` begins (the survivors gave the switch's round up at their arrival deadline, or a survivor's vote
        failed and the recovery of the old epoch dropped the grow)."""
        return self._round_watch(plan, time.monotonic() + self.settings.rendezvous_timeout.total_seconds(),
                                 arrival=False)

    def switch(self, old: Plan, old_group: ProcessGroupWrapper, new_group: ProcessGroupWrapper,
               t_decide: float, step_fn: Callable[[], int]) -> tuple[Epoch, dict]:
        """Moves to the posted next plan on its prepared group: newcomers receive the state. The state's move is a
        round with the arrival deadline (:meth:`_round_watch`, from the vote on): a state source that hangs before
        it posts the skeleton, beating on, is given up at it, and the survivors recover from the new plan (which
        fences it at that recovery's own arrival deadline).

        Raises:
            RendezvousTimeout, ProcessGroupError: the state did not move (the caller recovers from the new plan).
        """
        nxt = self.membership.next_plan()
        if nxt is None:
            raise ProcessGroupError(f"switch from epoch {old.id} voted but no next plan is posted")
        watch = self._round_watch(nxt, time.monotonic() + self.settings.rendezvous_timeout.total_seconds())
        t0 = time.perf_counter()
        old_group.abort()
        t1 = time.perf_counter()
        nbytes = 0
        if any(m not in old.members for m in nxt.members):
            nbytes = self._broadcast_state(new_group, self._source(nxt), nxt, watch)
        t2 = time.perf_counter()
        epoch = self.enter(nxt, new_group, step_fn)
        t3 = time.perf_counter()
        rec = {"epoch": nxt.id, "prev": old.id, "kind": nxt.kind, "old_world": old.world_size,
               "world": nxt.world_size, "step": step_fn(), "t_decide": t_decide, "abort_s": t1 - t0,
               "state_sync_s": t2 - t1, "state_bytes": nbytes, "rewrap_s": t3 - t2, "t_entered": t3}
        return epoch, rec

    def recover(self, failed: Plan, old_group: ProcessGroupWrapper, err: Optional[BaseException],
                try_shrink: bool, lost: int, interval: int, step_fn: Callable[[], int]) -> tuple[Epoch, dict]:
        """Agrees on the survivors of ``failed``, rebuilds (``decide_recovery``), rolls back to the last commit
        point and resyncs from the survivor with the newest one. Building the survivors' group and taking the state
        is one round with the arrival deadline (:meth:`_round_watch`): a survivor that dies in it, or hangs beating
        on (before its build, or as the state source before it posts the skeleton), makes the survivors' plan the
        failed one: the survivors recover from it in turn (the recovery fences the hung one at its own arrival
        deadline), within ``rendezvous_timeout`` in all.

        Raises:
            LeftGroup: this worker was declared dead.
            RendezvousTimeout: no group of survivors within ``rendezvous_timeout``.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.settings.rendezvous_timeout.total_seconds()
        first, tried = failed, []
        while True:
            try:
                plan = self.membership.recover(failed, self._left(deadline, failed))
            except LeftGroup:
                if old_group is not None:
                    old_group.abort()
                raise
            watch = self._round_watch(plan, deadline)  # from here on: the round's arrival deadline
            action = decide_recovery(failed, plan, self.wid, try_shrink and old_group is not None)
            if action.kind is RecoveryKind.LEAVE:
                if old_group is not None:
                    old_group.abort()
                raise LeftGroup(f"worker {self.wid} was declared dead in recovery of epoch {failed.id}")
            new = None
            if action.kind is RecoveryKind.SHRINK:
                try:
                    new = old_group.shrink(list(action.dead_ranks), abort=True)
                except ProcessGroupError as e:
                    logger.info("shrink unavailable, rebuilding: %s", e)
            if old_group is not None:
                old_group.abort()
                old_group = None
            why = ""
            if new is None:
                new, why = self._build_watched(plan, watch)
            if new is not None:
                why = self._resync(new, plan, watch)
            if not why:
                break
            tried.append({"epoch": plan.id, "why": why})
            failed = plan  # a survivor died or hung before the recovered epoch trained: recover from that epoch
        epoch = self.enter(plan, new, step_fn)
        t1 = time.perf_counter()
        rec = {"epoch": plan.id, "prev": first.id, "kind": "recovery", "old_world": first.world_size,
               "world": plan.world_size, "step": step_fn(), "lost_steps": lost, "commit_interval": interval,
               "recover_s": t1 - t0, "error": str(err)[:200], "abandoned": tried}
        events.warning("recovery %s", json.dumps(rec), extra={"wid": self.wid, "step": step_fn()})
        # completed (pause_s, switches, elastic/switched/<id> from rank 0) at the first commit of the new epoch
        return epoch, {**rec, "t_decide": t0, "t_entered": t1}

    def _left(self, deadline: float, failed: Plan) -> timedelta:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeout(f"worker {self.wid}: no group of survivors within "
                                    f"{self.settings.rendezvous_timeout.total_seconds():g} s (at epoch {failed.id})")
        return timedelta(seconds=left)

    def _round_watch(self, plan: Plan, deadline: float, arrival: bool = True) -> Callable[[], str]:
        """Why to give up a round that moves to ``plan`` (a recovery's build and state, a switch's state, a
        newcomer's state), asked while it waits ("": go on): a member's beat stopped for ``heartbeat_timeout`` (it
        died after the decision), another survivor gave up on the plan (a recovery of it began), ``deadline``
        passed, or, with ``arrival``, the round's arrival deadline did (``Membership.arrival_timeout`` from now on
        the membership's clock: a member that hung, beating on, before it built its group or, as the state source,
        before it posted the skeleton; the recovery from this plan fences it at that recovery's own arrival
        deadline)."""
        m = self.membership
        arrival_s = m.arrival_timeout.total_seconds()
        arrival_at = m.clock() + arrival_s if arrival else math.inf

        def why() -> str:
            silent = m.silent_members(plan)
            if silent:
                return f"silent: {', '.join(silent)}"
            if m.recovery_begun(plan):
                return "given up by another survivor"
            if time.monotonic() > deadline:
                return "deadline"
            if m.clock() > arrival_at:
                return f"arrival deadline: the round of epoch {plan.id} not complete after {arrival_s:g} s"
            return ""
        return why

    def _resync(self, group: ProcessGroupWrapper, plan: Plan, watch: Callable[[], str]) -> str:
        """Rolls back to the last commit point and takes the state of the survivor with the newest one on ``group``
        (:meth:`_newest_commit`); a receiver waits for its skeleton while ``watch()`` says nothing. Returns "" or
        why it failed (a peer failed, or the round was given up on; the group is aborted)."""
        self.state.restore()
        try:
            self._broadcast_state(group, self._newest_commit(group), plan, watch)
        except Exception as e:  # noqa: BLE001 - a survivor died or hung since the decision: recover from this plan
            logger.warning("recovery epoch %d: state broadcast failed: %s", plan.id, e)
            group.abort()
            return f"state broadcast failed: {str(e)[:100]}"
        return ""

    def _newest_commit(self, group: ProcessGroupWrapper) -> int:
        """The lowest rank of ``group`` whose last commit point is the newest (one allreduce; call after restore).

        Survivors can hold different commit points: a vote that some ranks read and others did not (its allreduce,
        or the buffer broadcast after it, failed on some) committed on the ones that read it. It was agreed (every
        rank voted in it), so it is the state: the sampler position of the last agreed commit, and steps the
        others had not committed yet count once, not twice.
        """
        steps = torch.zeros(group.size(), dtype=torch.int64, device=self.device)
        steps[group.rank()] = int(self.state.counters.get("step", 0))
        group.allreduce([steps]).wait()
        steps = steps.cpu()
        return int((steps == steps.max()).nonzero()[0])

    def _build_watched(self, plan: Plan, watch: Callable[[], str]) -> tuple[Optional[ProcessGroupWrapper], str]:
        """Builds ``plan``'s group on a thread while ``watch()`` says nothing (:meth:`_round_watch`). Returns
        (group, "") or (None, why): ``watch``'s reason, or the build failed.
        A build given up on ends on its own thread, and a group it completes after that is aborted."""
        box: dict = {}
        lock = threading.Lock()  # the build's check-and-store against the give-up: no group left un-aborted

        def run() -> None:
            try:
                g = self.new_group(plan)
            except BaseException as e:  # noqa: BLE001 - reported below
                box["error"] = e
                return
            with lock:
                if box.get("abandoned"):
                    g.abort()
                else:
                    box["group"] = g

        t = threading.Thread(target=run, name=f"elastic-recover-{plan.id}", daemon=True)
        t.start()
        poll = self.membership.heartbeat_interval.total_seconds() / 2
        while True:
            t.join(poll)
            if not t.is_alive():
                break
            why = watch()
            if why:
                with lock:
                    box["abandoned"] = True
                    late = box.pop("group", None)  # finished between the join and here
                if late is not None:
                    late.abort()
                give_up_build(t)  # the worker's close() waits for it (bounded) before the process exits
                logger.warning("recovery epoch %d: group build given up (%s)", plan.id, why)
                return None, why
        if "error" in box:
            logger.warning("recovery epoch %d: group build failed: %s", plan.id, box["error"])
            return None, f"build failed: {str(box['error'])[:100]}"
        return box["group"], ""


def _hook_with_fault(state: HookState, bucket):  # no return annotation (see elastic_allreduce_hook)
    """The elastic hook, plus the ``fail_at`` seam: dies mid-backward when the fault plan says so."""
    fault = state.fault
    if fault is not None and bucket.index() == 0:
        fault.maybe_fail(state.group.rank(), state.step_fn())
    return elastic_allreduce_hook(state, bucket)
