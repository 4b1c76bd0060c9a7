"""Resize mechanics: helper jobs, shrink and grow (:class:`Resizer`, which executes the controller's decisions).

The launcher channel's keys (status, operator requests, helper stop) are laid out in `store_keys.py`.

Shrink order (Slurm SIGKILLs tasks on released nodes): the leaving ranks leave at a commit point first
(runtime resize plan without them), their srun steps end, and only then are the nodes released: helper
nodes by ending the helper job (stop key + scancel), main-job nodes with `client.shrink`, whose refreshed
Slurm environment replaces the one the controller launches with. Grow: a helper job is submitted; once
it runs, its agent starts workers that join the rendezvous, and the controller posts the plan with them.
Both are :class:`~elastic_launcher.resize_ops.ResizeOp`\\ s that :meth:`Resizer.tick` moves one state per
controller tick (#27.2); a failed node is a :class:`~elastic_launcher.resize_ops.RecoveryOp` moved the same way,
and releases are `release.Releaser`'s: nothing here waits for a helper to start, workers to join or leave, an
epoch to switch or a step to end.

Slurm faults: every Slurm change (shrink, scancel) is a `release.SlurmChange`, so a slurmctld that restarts
(each command then fails after its own timeout) is retried on later ticks with backoff for up to
`release.SLURM_RETRY`, no tick waiting between attempts; a submit that fails fails that grow; a grow's
helper state is asked once a tick and is UNKNOWN (not "ended") while slurmctld does not answer. A release
that still fails after that is logged (`slurm_shrink_failed`): the workers are gone already, the node
stays allocated, idle, until the job ends. "Unreachable" is never read as "job gone".
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Sequence

from elastic_launcher import store_keys as keys
from elastic_launcher.autoscale import PendingJob
from elastic_launcher.errors import ElasticError, ResizeConflict
from elastic_launcher.helper_agent import read_key
from elastic_launcher.launch_config import Allocation, LaunchConfig, helper_comment, helper_name
from elastic_launcher.membership import Coordinator, Plan
from elastic_launcher.release import Releaser
from elastic_launcher.reporting import RecordLog
from elastic_launcher.resize_ops import (Action, ActionKind, Observation, RecoveryObservation, RecoveryOp,
                                         RecoveryState, ResizeKind, ResizeLimits, ResizeOp, ResizeState, advance,
                                         advance_recovery, fail)
from elastic_launcher.stragglers import StragglerDetector
from elastic_launcher.workers import WorkerPool, node_prefix, step_prefix, transition_idle_s, worker_slot
from slurm_plugin.errors import JobNotFoundError, SlurmError

log = logging.getLogger("elastic_launcher.resize")


def helper_script(main_job: str, nodes: int, gpus_per_node: int, partition: Optional[str], exclude: Sequence[str],
                  store_addr: str, workers_per_node: int, orphan_timeout: timedelta, log_dir: Path,
                  command: Sequence[str], workdir: Path) -> str:
    """The batch script of a grow helper job (a normal job the job_submit hook skips by its comment)."""
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={helper_name(main_job)}",
             f"#SBATCH --comment={helper_comment(main_job)}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --output={log_dir}/helper-%j.out",
             f"#SBATCH --chdir={workdir}"]
    if gpus_per_node > 0:
        lines.append(f"#SBATCH --gres=gpu:{gpus_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if exclude:
        lines.append(f"#SBATCH --exclude={','.join(sorted(exclude))}")
    agent = [sys.executable, "-m", "elastic_launcher.cli", "agent", "--main-job", str(main_job),
             "--store", store_addr, "--workers-per-node", str(workers_per_node),
             "--orphan-timeout", f"{orphan_timeout.total_seconds():g}", "--log-dir", str(log_dir), "--", *command]
    lines.append("exec " + " ".join(shlex.quote(a) for a in agent))
    return "\n".join(lines) + "\n"


def choose_leavers(nodes_in_order: Sequence[str], owner: dict[str, str], main_job: str, batch_host: str,
                   count: int, prefer: Sequence[str] = ()) -> list[str]:
    """Which `count` nodes leave a shrink: `prefer` first (stragglers, failed), then helper nodes (newest
    first), then main-job nodes from the highest, never the batch host.

    Raises:
        ValueError: fewer removable nodes than `count`.
    """
    order = [n for n in prefer if n in nodes_in_order and n != batch_host]
    helpers = [n for n in reversed(nodes_in_order) if owner.get(n) != str(main_job)]
    mains = [n for n in reversed(nodes_in_order) if owner.get(n) == str(main_job) and n != batch_host]
    for n in helpers + mains:
        if n not in order:
            order.append(n)
    if len(order) < count:
        raise ValueError(f"cannot remove {count} nodes of {list(nodes_in_order)}: only {order} are removable")
    return order[:count]


def wait_until(predicate, timeout: timedelta, interval: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout` passes; return its last value (the controller's exit only:
    nothing in a tick waits)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


@dataclasses.dataclass
class NodeSlot:
    """A node the job trains on. `owner` is the allocation holding it (main job or a helper job);
    `prefix` is what its workers' ids start with (`workers.node_prefix` or `workers.step_prefix`), `wids` the ids
    once joined."""

    node: str
    owner: str
    prefix: str
    wids: tuple[str, ...] = ()


class MeasureWindow:
    """The throughput measurement window: the epoch it is in, the step it began at, the progress at its start.
    ``reset()`` after every transition: the next window waits for ``warmup_steps`` in the new epoch."""

    def __init__(self) -> None:
        self.epoch: Optional[int] = None
        self.first: Optional[int] = None
        self.start: Optional[dict] = None

    def reset(self) -> None:
        self.epoch = self.first = self.start = None


@dataclasses.dataclass
class Fleet:
    """The nodes the job trains on, shared by the controller (which decides) and the :class:`Resizer` (which
    changes them).

    Attributes:
        job_id: the main job.
        alloc: the main allocation as it stands (a main-job shrink refreshes its nodes and environment).
        slots: workers per node.
        nodes: node -> NodeSlot of every node the job trains on.
        helpers: helper job id -> its nodes.
        joining: node -> NodeSlot of a grow's helper nodes (or a restarted batch host) whose workers are joining
            (not members yet: they become `nodes` when the op posts its plan).
        failures_in_a_row: failed resizes and worker losses since the last good measurement.
    """

    job_id: str
    alloc: Allocation
    slots: int
    nodes: dict[str, NodeSlot] = dataclasses.field(default_factory=dict)
    helpers: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    joining: dict[str, NodeSlot] = dataclasses.field(default_factory=dict)
    failures_in_a_row: int = 0

    def pending(self, slurm) -> list[PendingJob]:
        """Other jobs of the allocation's partition pending for nodes (not the job nor its helpers), highest
        priority first (then oldest); [] when Slurm is slow or down (no hand-back this round)."""
        try:
            jobs = slurm.jobs()
        except Exception as exc:  # noqa: BLE001 - Slurm slow or down: no hand-back this round
            log.warning("cannot list jobs: %s", exc)
            return []
        return PendingJob.of(jobs, {int(self.job_id), *(int(h) for h in self.helpers)}, self.alloc.partition)


class Resizer:
    """How the job changes size: executes what `controller.Controller` decided (grow, shrink, replace) and follows
    a failed node's recovery, one tick at a time. Holds only what it is given.

    Args:
        config: the launch configuration.
        fleet: the job's nodes (changed here).
        coord: the membership coordinator on the job store.
        pool: the worker steps.
        slurm: the Slurm client.
        kv: the launcher channel (helper stop keys, helper status).
        records: the records log.
        stragglers: the straggler detector (released nodes are forgotten).
        window: the measurement window (reset after each transition).
        store_addr: the job store's address (helper jobs' agents connect to it).
        progress: `progress(wids) -> {wid: progress record}` from the store.
        free_nodes: `free_nodes() -> [node]` idle in Slurm and not the job's.
        clock: the monotonic clock the ops' deadlines are read on (tests inject a fake one).

    Three lanes, each moved by :meth:`tick` and none waiting: `recoveries` (a failed node's
    `resize_ops.RecoveryOp`, several at once), `rejoins` (a restarted batch host's workers joining, a grow without
    a helper) and `ops` (grows and shrinks, one in flight, the others queued; they post nothing while a recovery
    is unsettled: `recovering`). Releases and helper ends are the :class:`~elastic_launcher.release.Releaser`'s.
    """

    def __init__(self, config: LaunchConfig, fleet: Fleet, *, coord: Coordinator, pool: WorkerPool, slurm,
                 kv, records: RecordLog, stragglers: StragglerDetector, window: MeasureWindow, store_addr: str,
                 progress: Callable[[Sequence[str]], dict], free_nodes: Callable[[], list[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.fleet = fleet
        self.coord = coord
        self.pool = pool
        self.slurm = slurm
        self.kv = kv
        self.records = records
        self.stragglers = stragglers
        self.window = window
        self.store_addr = store_addr
        self._progress = progress
        self._free_nodes = free_nodes
        self.clock = clock
        self.limits = ResizeLimits.from_config(config)
        self.releaser = Releaser(fleet, pool, slurm, kv, records, stragglers.forget, self.limits, clock)
        self.ops: list[ResizeOp] = []  # the resize in flight first, then those queued behind it
        self.recoveries: list[RecoveryOp] = []  # failed nodes being handled
        self.rejoins: list[ResizeOp] = []  # restarted batch-host workers joining
        self.last: Optional[ResizeOp] = None  # the last op that ended (SWITCHED, RELEASED or FAILED)
        self._cancel: Optional[str] = None  # why the op in flight is to stop at the next tick
        self._plans: dict[int, Plan] = {}  # plans the ops posted, by id

    @property
    def job_id(self) -> str:
        return self.fleet.job_id

    def switch_stats(self, plan: Plan) -> Optional[dict]:
        """`plan`'s switch record (`elastic/switched/<id>`, written by the epoch's rank 0 for every kind of epoch)
        plus `idle_s` / `step_s` (the extra time the survivors' step took across the transition, from rank 0's
        progress reports) once rank 0 reported a step in it; None before (no wait)."""
        head = self._progress(plan.members[:1]).get(plan.members[0]) or {}
        stats = self.coord.switched(plan)
        if not stats or head.get("epoch") != plan.id:
            return None
        idle, step = transition_idle_s(head.get("recent", []), plan.id)
        return {**stats, "idle_s": None if idle is None else round(idle, 3),
                "step_s": None if step is None else round(step, 3)}

    def missing(self, nodes: Sequence[str], slots: dict[str, NodeSlot]) -> list[str]:
        """The nodes of `nodes` short of joined workers ("node (have/slots)"); sets the wids of the others."""
        joined = self.coord.joined()
        missing = []
        for node in nodes:
            slot = slots[node]
            mine = sorted((w for w in joined if w.startswith(slot.prefix)), key=worker_slot)
            if len(mine) >= self.fleet.slots:
                slot.wids = tuple(mine[: self.fleet.slots])
            else:
                missing.append(f"{node} ({len(mine)}/{self.fleet.slots})")
        return missing

    # -- the lanes' state ----------------------------------------------------------------------------------
    def request_grow(self, target: int, action: str, reason: str, exclude: Sequence[str] = ()) -> ResizeOp:
        """Queue a grow to `target` nodes (one helper job for up to `target - nodes` free nodes).

        Raises:
            ValueError: `target` is not an integer >= 1.
        """
        op = ResizeOp(ResizeKind.GROW, target, action, reason, exclude=tuple(exclude))
        self.ops.append(op)
        return op

    def request_shrink(self, target: int, action: str, reason: str, prefer: Sequence[str] = ()) -> ResizeOp:
        """Queue a shrink to `target` nodes (the leavers are chosen when it starts, `prefer` first).

        Raises:
            ValueError: `target` is not an integer >= 1 (the batch host always stays).
        """
        op = ResizeOp(ResizeKind.SHRINK, target, action, reason, prefer=tuple(prefer))
        self.ops.append(op)
        return op

    @property
    def active(self) -> Optional[ResizeOp]:
        """The op in flight (or the next to start), None when no resize is pending."""
        return self.ops[0] if self.ops else None

    @property
    def busy(self) -> bool:
        return bool(self.ops)

    @property
    def recovering(self) -> bool:
        """A failed node's recovery or a restarted batch host's rejoin is in progress (JobPhase.RECOVERING)."""
        return bool(self.recoveries or self.rejoins)

    @property
    def settled(self) -> bool:
        """The fleet's nodes are the current epoch's: nothing recovers or rejoins, and no op has posted a plan that
        has not ended yet."""
        op = self.active
        return not self.recovering and (op is None or op.cancellable)

    def handled_nodes(self) -> set[str]:
        """Nodes an op, a recovery or a rejoin is handling (their failures are theirs, not new ones)."""
        nodes = {r.node for r in self.recoveries} | {n for op in self.rejoins for n in op.nodes}
        op = self.active
        return nodes | (set(op.nodes) if op is not None else set())

    def cancel_pending(self, reason: str, keep_active: bool = False) -> list[ResizeOp]:
        """Drop the queued ops and, unless `keep_active`, cancel the op in flight at the next tick if it has posted
        nothing yet (`ResizeOp.cancellable`); return what was dropped or will be cancelled."""
        head, queued = (self.ops[:1], self.ops[1:])
        self.ops = head
        for op in queued:
            self.records.write("transition_skipped", action=op.action, reason=f"cancelled: {reason}")
        if head and head[0].cancellable and not keep_active:
            self._cancel = reason
            return head + queued
        return queued

    # -- one tick ------------------------------------------------------------------------------------------
    def tick(self) -> Optional[ResizeOp]:
        """Move releases and helper ends, every recovery and rejoin, and the op in flight one state each; execute
        their actions; return the op in flight (None: no op). Never waits for Slurm or the workers (a Slurm
        command has its own timeout; an unreachable slurmctld is retried only by a release or a cancel)."""
        self.releaser.tick()
        now = self.clock()
        for rec in list(self.recoveries):
            self._tick_recovery(rec, now)
        hold = any(not r.settled for r in self.recoveries)
        self.rejoins = [op for op in (self._step(op, now, None, hold) for op in self.rejoins) if not op.done]
        if not self.ops:
            return None
        cancel, self._cancel = self._cancel, None
        op = self._step(self.ops[0], now, cancel, self.recovering)
        if op.done:
            self.ops.pop(0)
            self.last = op
        else:
            self.ops[0] = op
        return op

    def _step(self, op: ResizeOp, now: float, cancel: Optional[str], hold: bool) -> ResizeOp:
        if op.state is ResizeState.REQUESTED and not hold:
            op = self._prepare(op)
        op, actions = advance(op, self.observe(op, cancel, hold), now, self.limits)
        return self._execute(op, actions, now)

    def _prepare(self, op: ResizeOp) -> ResizeOp:
        """A starting op's size to start from and, for a shrink, its leavers."""
        have = len(self.fleet.nodes)
        op = dataclasses.replace(op, from_nodes=have)
        if op.kind is ResizeKind.SHRINK and not op.nodes and op.target < have:
            owners = {n: s.owner for n, s in self.fleet.nodes.items()}
            try:
                leavers = choose_leavers(list(self.fleet.nodes), owners, self.job_id, self.fleet.alloc.batch_host,
                                         have - op.target, op.prefer)
            except ValueError as exc:
                log.warning("job %s: %s", self.job_id, exc)
                return op
            op = dataclasses.replace(op, nodes=tuple(leavers))
        return op

    def observe(self, op: ResizeOp, cancel: Optional[str] = None, hold: bool = False) -> Observation:
        """What an op needs to know this tick (one Slurm query at most, a few store reads)."""
        seen: dict = {"cancel": cancel, "hold": hold}
        if op.helper is not None and op.state in (ResizeState.SUBMITTED, ResizeState.ALLOCATED):
            seen["helper_state"], seen["helper_nodes"] = self._helper_job(op.helper)
        if op.kind is ResizeKind.GROW and op.state in (ResizeState.ALLOCATED, ResizeState.JOINED):
            steps = self.helper_status(op.helper).get("steps", {}) if op.helper is not None else \
                {n: self.pool.steps[n].returncode() for n in op.nodes if n in self.pool.steps}
            seen["failed_nodes"] = tuple(n for n in op.nodes if steps.get(n) not in (None, 0))
        if op.state is ResizeState.ALLOCATED:
            seen["joined"] = not self.missing(op.nodes, self.fleet.joining)
        if op.state is ResizeState.JOINED and op.plan_id in self._plans:
            seen["switched"] = self.switch_stats(self._plans[op.plan_id]) is not None
            current = self.coord.current()
            seen["superseded"] = not seen["switched"] and current.id > op.plan_id
            if seen["superseded"] and op.kind is ResizeKind.GROW:
                newcomers = [w for n in op.nodes for w in self._slot(n).wids]
                seen["carried"] = bool(newcomers) and set(newcomers) <= set(current.members)
        if op.kind is ResizeKind.SHRINK and op.state is ResizeState.SWITCHED:
            seen["left"] = all(self.coord.has_left(w) for n in op.nodes for w in self._slot(n).wids)
        if op.kind is ResizeKind.SHRINK and op.state is ResizeState.RELEASING:
            seen["released"] = self.releaser.done(OP_RELEASE)
        return Observation(**seen)

    def helper_status(self, helper: str) -> dict:
        """The helper agent's status record (`launcher/helper/<id>/status`: its steps' exit codes), {} if none; the
        one reader of that key."""
        text = read_key(self.kv, keys.helper_status(helper))
        return json.loads(text) if text else {}

    def _helper_job(self, helper: str) -> tuple[str, tuple[str, ...]]:
        """(Slurm state, nodes) of a helper: "GONE" when Slurm no longer lists it, "UNKNOWN" when it cannot say."""
        try:
            job = self.slurm.job(int(helper))
        except JobNotFoundError:
            return "GONE", ()
        except Exception as exc:  # noqa: BLE001 - slurmctld slow or restarting: asked again next tick
            log.warning("job %s: state of helper %s unknown: %s", self.job_id, helper, exc)
            return "UNKNOWN", ()
        return job.state, tuple(job.nodes)

    def _slot(self, node: str) -> NodeSlot:
        return self.fleet.nodes.get(node) or self.fleet.joining[node]

    def _execute(self, op: ResizeOp, actions: Sequence[Action], now: float) -> ResizeOp:
        for act in actions:
            kind = act.kind
            if kind is ActionKind.SUBMIT_HELPER:
                op = self._submit(op, now)
            elif kind is ActionKind.ADOPT_NODES:
                self.fleet.helpers[op.helper] = list(act.nodes)
                for node in act.nodes:
                    self.fleet.joining[node] = NodeSlot(node, op.helper, node_prefix(op.helper, node))
            elif kind is ActionKind.POST_PLAN:
                op = self._post(op)
            elif kind is ActionKind.CANCEL_HELPER:
                self.releaser.end_helper(op.helper, op.error or "resize failed")
            elif kind is ActionKind.RELEASE_NODES:
                self.releaser.release(OP_RELEASE, act.nodes, op.reason)
            elif kind is ActionKind.FINISH:
                self._finish(op, now)
            elif kind is ActionKind.ABORT:
                self._abort(op)
        return op

    def _submit(self, op: ResizeOp, now: float) -> ResizeOp:
        cfg = self.config
        free = [n for n in self._free_nodes() if n not in op.exclude]
        count = min(op.target - len(self.fleet.nodes), len(free))
        if count < 1:
            why = "no free nodes" if op.target > len(self.fleet.nodes) else f"already on {len(self.fleet.nodes)} nodes"
            failed, more = fail(op, now, why, skipped=True)
            return self._execute(failed, more, now)
        script = helper_script(self.job_id, count, self.fleet.alloc.gpus_per_node, self.fleet.alloc.partition,
                               [*self.fleet.nodes, *op.exclude], self.store_addr, self.fleet.slots,
                               cfg.helper_orphan_timeout, cfg.run_dir, cfg.command, Path(os.getcwd()))
        try:
            helper = str(self.slurm.submit(script))
        except SlurmError as exc:  # not retried: the decision is re-taken at the next measurement
            log.warning("job %s: helper submission failed: %s", self.job_id, exc)
            failed, more = fail(op, now, f"helper submission failed: {exc}")
            return self._execute(failed, more, now)
        self.fleet.helpers[helper] = []
        self.records.write("helper_submitted", helper=helper, nodes=count, reason=op.reason)
        return dataclasses.replace(op, helper=helper)

    def _post(self, op: ResizeOp) -> ResizeOp:
        """Post the plan with the newcomers (grow) or without the leavers (shrink) on the current epoch; a post
        that loses the race to a recovery leaves `plan_id` None (tried again next tick)."""
        base = self.coord.current()
        if op.kind is ResizeKind.GROW:
            members = list(base.members) + [w for n in op.nodes for w in self._slot(n).wids
                                            if w not in base.members]
        else:
            for node in op.nodes:
                if node in self.pool.steps:
                    self.pool.steps[node].leaving = True
            leaving = {w for n in op.nodes for w in self.fleet.nodes[n].wids}
            members = [w for w in base.members if w not in leaving]
        tries = op.post_attempts + 1
        try:
            plan = self.coord.request_resize(members, base)
        except ResizeConflict as exc:
            log.warning("resize lost a race (%s); posting again on the new epoch", exc)
            return dataclasses.replace(op, plan_id=None, post_attempts=tries)
        self._plans[plan.id] = plan
        if op.kind is ResizeKind.GROW:  # members now: the fleet's nodes are the posted epoch's
            for node in op.nodes:
                self.fleet.nodes[node] = self.fleet.joining.pop(node)
        return dataclasses.replace(op, plan_id=plan.id, post_attempts=tries)

    def _finish(self, op: ResizeOp, now: float) -> None:
        plan = self._plans.get(op.plan_id) or self.coord.current()
        stats = self.switch_stats(plan) or {}
        if op.kind is ResizeKind.GROW:
            extra = dict(nodes_in=list(op.nodes), helper=op.helper,
                         allocate_s=None if op.allocated is None else round(op.allocated - op.started, 3))
        else:
            extra = dict(nodes_out=list(op.nodes), left_cleanly=op.left,
                         release_s=self.releaser.seconds.get(OP_RELEASE))
            self.releaser.close(OP_RELEASE)
        self.records.write("transition", action=op.action, epoch=plan.id, from_nodes=op.from_nodes,
                           to_nodes=len(self.fleet.nodes), world=plan.world_size, reason=op.reason,
                           wall_s=round(now - op.started, 3), pause_s=stats.get("pause_s"),
                           idle_s=stats.get("idle_s"), stats=stats, **extra)
        self.window.reset()

    def _abort(self, op: ResizeOp) -> None:
        if op.kind is ResizeKind.GROW:
            for node in op.nodes:
                self.fleet.joining.pop(node, None)
                self.fleet.nodes.pop(node, None)
                if op.helper is None:  # a rejoin: its restarted step goes too (a later failure restarts it)
                    self.pool.signal_step(node, signal.SIGKILL)
                    self.pool.forget(node)
            if op.plan_id is not None:  # its epoch lost the newcomers: measure afresh
                self.window.reset()
        else:
            for node in op.nodes:
                if node in self.pool.steps:
                    self.pool.steps[node].leaving = False
        if op.skipped:
            self.records.write("transition_skipped", action=op.action, reason=op.error)
        else:
            self.records.write("transition_failed", action=op.action, from_nodes=op.from_nodes,
                               target_nodes=op.target, state=op.failed_in.value, cancelled=op.cancelled, error=op.error)
        if op.counts:
            self.fleet.failures_in_a_row += 1

    # -- failed nodes --------------------------------------------------------------------------------------
    def node_failed(self, node: str, evicted: bool = False, keep: bool = False) -> None:
        """Record `node`'s failure and start following its recovery (the survivors recover by themselves);
        returns at once. `keep`: the node's step is ended but the node stays the job's, and fresh workers rejoin
        there as newcomers (always for the batch host; for a fenced-out node when the planner wants it).

        Raises:
            ElasticError: more than `max_failures` failures in a row.
        """
        slot = self.fleet.nodes[node]
        keep = keep or node == self.fleet.alloc.batch_host  # Slurm cannot drop it: its workers restart
        self.records.write("failure", node=node, owner=slot.owner, workers=sorted(slot.wids),
                           cause="left out of the membership while running" if evicted else "workers ended",
                           rejoin=keep)
        self.fleet.failures_in_a_row += 1
        if self.fleet.failures_in_a_row > self.config.max_failures:
            raise ElasticError(f"job {self.job_id}: {self.fleet.failures_in_a_row} failures in a row (last: {node})")
        rec = RecoveryOp(node, tuple(slot.wids), evicted, keep)
        self.recoveries.append(rec)
        self._tick_recovery(rec, self.clock())

    def _tick_recovery(self, rec: RecoveryOp, now: float) -> None:
        plan = self.coord.current()
        key = f"{FAILED_RELEASE}{rec.node}"
        obs = RecoveryObservation(in_membership=bool(set(rec.workers) & set(plan.members)), epoch=plan.id,
                                  switched=rec.state is RecoveryState.EVICTED and self.switch_stats(plan) is not None,
                                  released=self.releaser.done(key))
        new, actions = advance_recovery(rec, obs, now, self.limits)
        self.recoveries = [new if r is rec else r for r in self.recoveries]
        for act in actions:
            if act.kind is ActionKind.RELEASE_NODES:
                self.releaser.release(key, act.nodes, f"workers on {rec.node} failed", give_back=not rec.keep)
            elif act.kind is ActionKind.FINISH:
                self.recoveries = [r for r in self.recoveries if r is not new]
                self._recovered(new, plan, now)
                self.releaser.close(key)

    def _recovered(self, rec: RecoveryOp, plan: Plan, now: float) -> None:
        stats = self.switch_stats(plan) or {}
        self.records.write("transition", action="failure", node=rec.node, epoch=plan.id,
                           from_nodes=len(self.fleet.nodes) + 1, to_nodes=len(self.fleet.nodes),
                           world=plan.world_size, recovered=rec.recovered, wall_s=round(now - rec.started, 3),
                           pause_s=stats.get("pause_s"), idle_s=stats.get("idle_s"), stats=stats)
        self.window.reset()
        if rec.keep:
            self._rejoin(rec.node, now)

    def _rejoin(self, node: str, now: float) -> None:
        """Start fresh workers on a kept node (the batch host, or a fenced-out node the planner wants); they join
        as newcomers, a grow without a helper."""
        have = len(self.fleet.nodes)
        try:
            step = self.pool.start(node, self.fleet.slots, self.fleet.alloc.env, owner_job=self.job_id)
        except (SlurmError, ValueError) as exc:
            self.records.write("transition_failed", action="rejoin", node=node, state="requested", error=str(exc))
            return
        self.fleet.joining[node] = NodeSlot(node, self.job_id, step_prefix(step.group))
        self.rejoins.append(ResizeOp(ResizeKind.GROW, have + 1, "rejoin", f"restart the workers of {node}",
                                     state=ResizeState.ALLOCATED, deadline=now + self.limits.join_s,
                                     nodes=(node,), started=now, allocated=now, from_nodes=have))


OP_RELEASE = "resize"  # the Releaser's owner key of the op in flight's release
FAILED_RELEASE = "failed:"  # ... and of a failed node's (followed by the node)
