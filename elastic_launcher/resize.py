"""Resize mechanics: helper jobs, shrink and grow (:class:`Resizer`, which executes the controller's decisions).

The launcher channel's keys (status, operator requests, helper stop) are laid out in `store_keys.py`.

Shrink order (Slurm SIGKILLs tasks on released nodes): the leaving ranks leave at a commit point first
(runtime resize plan without them), their srun steps end, and only then are the nodes released: helper
nodes by ending the helper job (stop key + scancel), main-job nodes with `client.shrink`, whose refreshed
Slurm environment replaces the one the controller launches with. Grow: a helper job is submitted; once
it runs, its agent starts workers that join the rendezvous, and the controller posts the plan with them.
Both are :class:`~elastic_launcher.resize_ops.ResizeOp`\\ s that :meth:`Resizer.tick` moves one state per
controller tick (#27.2): nothing here waits for a helper to start, workers to join or an epoch to switch.

Slurm faults: every Slurm change here (shrink, scancel) goes through
`slurm_plugin.client.retry_transient`, so a slurmctld that restarts (each command then fails after its own
timeout) is retried with backoff for up to `SLURM_RETRY`; a submit that fails fails that grow; a grow's helper
state is asked once a tick and is UNKNOWN (not "ended") while slurmctld does not answer. A release
that still fails after that is logged (`slurm_shrink_failed`): the workers are gone already, the node
stays allocated, idle, until the job ends. "Unreachable" is never read as "job gone".
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Sequence

from elastic_launcher import store_keys as keys
from elastic_launcher.errors import ElasticError, RendezvousTimeout, ResizeConflict
from elastic_launcher.helper_agent import read_key
from elastic_launcher.launch_config import Allocation, LaunchConfig, helper_comment, helper_name
from elastic_launcher.membership import Coordinator, Plan
from elastic_launcher.reporting import RecordLog
from elastic_launcher.resize_ops import (Action, ActionKind, Observation, ResizeKind, ResizeLimits, ResizeOp,
                                         ResizeState, advance, fail)
from elastic_launcher.stragglers import StragglerDetector
from elastic_launcher.workers import WorkerPool, transition_idle_s
from slurm_plugin.client import LIVE_STATES, retry_transient
from slurm_plugin.errors import JobNotFoundError, ResizeError, SlurmError

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
    """Poll `predicate` until it is true or `timeout` passes; return its last value."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# Time a worker gets to exit after it left the group (or failed) before its step is signalled.
EXIT_GRACE = timedelta(seconds=5)
# How long a Slurm change (shrink, helper lookup, scancel) is retried through transient failures such as a
# slurmctld restart; each attempt has the client's own per-command timeout (LaunchConfig.slurm_timeout).
SLURM_RETRY = timedelta(seconds=120)


@dataclasses.dataclass
class NodeSlot:
    """A node the job trains on. `owner` is the allocation holding it (main job or a helper job);
    `prefix` is the prefix of its workers' ids (`j<owner>-<node>-`), `wids` the ids once joined."""

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
        joining: node -> NodeSlot of a grow's helper nodes whose workers are joining (not members yet: they
            become `nodes` when the grow posts its plan).
        failures_in_a_row: failed resizes and worker losses since the last good measurement.
    """

    job_id: str
    alloc: Allocation
    slots: int
    nodes: dict[str, NodeSlot] = dataclasses.field(default_factory=dict)
    helpers: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    joining: dict[str, NodeSlot] = dataclasses.field(default_factory=dict)
    failures_in_a_row: int = 0


class Resizer:
    """How the job changes size: executes what `controller.Controller` decided (grow, shrink, replace, a failed
    node's release and rejoin). Holds only what it is given.

    Args:
        config: the launch configuration.
        fleet: the job's nodes (changed here).
        coord: the membership coordinator on the job store.
        pool: the worker steps.
        slurm: the Slurm client.
        kv: the launcher channel (helper stop keys).
        records: the records log.
        stragglers: the straggler detector (released nodes are forgotten).
        window: the measurement window (reset after each transition).
        store_addr: the job store's address (helper jobs' agents connect to it).
        progress: `progress(wids) -> {wid: progress record}` from the store.
        finished: `finished() -> None | outcome` once every main-job worker ended.
        free_nodes: `free_nodes() -> [node]` idle in Slurm and not the job's.
        clock: the monotonic clock the ops' deadlines are read on (tests inject a fake one).

    Grows and shrinks are :class:`~elastic_launcher.resize_ops.ResizeOp`\\ s: `request_grow` / `request_shrink`
    queue one, and every controller tick calls :meth:`tick`, which observes the op in flight, moves it one state
    (`resize_ops.advance`) and executes the actions; it never waits for Slurm or the workers.
    """

    def __init__(self, config: LaunchConfig, fleet: Fleet, *, coord: Coordinator, pool: WorkerPool, slurm,
                 kv, records: RecordLog, stragglers: StragglerDetector, window: MeasureWindow, store_addr: str,
                 progress: Callable[[Sequence[str]], dict], finished: Callable[[], Optional[str]],
                 free_nodes: Callable[[], list[str]], clock: Callable[[], float] = time.monotonic) -> None:
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
        self._finished = finished
        self._free_nodes = free_nodes
        self.clock = clock
        self.limits = ResizeLimits.from_config(config)
        self.ops: list[ResizeOp] = []  # the resize in flight first, then those queued behind it
        self.last: Optional[ResizeOp] = None  # the last op that ended (SWITCHED, RELEASED or FAILED)
        self._cancel: Optional[str] = None  # why the op in flight is to stop at the next tick
        self._plans: dict[int, Plan] = {}  # plans the ops posted, by id
        self._release_s: Optional[float] = None  # the last RELEASE_NODES' seconds, for its op's record

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

    def wait_switched(self, plan: Plan) -> dict:
        """Wait for :meth:`switch_stats` of `plan` (the job's start and a failed node's recovery or rejoin; the
        ops of :meth:`tick` poll it instead).

        Raises:
            RendezvousTimeout: not within `rendezvous_timeout`, or the workers all ended meanwhile.
        """
        stats: dict = {}

        def first_step() -> bool:
            stats.update(self.switch_stats(plan) or {})
            return bool(stats)

        def superseded() -> bool:
            return self.coord.current().id > plan.id

        if not wait_until(lambda: first_step() or superseded() or self._finished() is not None,
                          self.config.rendezvous_timeout, interval=0.05) or not first_step():
            raise RendezvousTimeout(f"job {self.job_id}: epoch {plan.id} ({plan.world_size} workers) reported no "
                                    f"first step within {self.config.rendezvous_timeout.total_seconds():g} s "
                                    f"or the workers ended")
        return stats

    def _missing(self, nodes: Sequence[str], slots: dict[str, NodeSlot]) -> list[str]:
        """The nodes of `nodes` short of joined workers ("node (have/slots)"); sets the wids of the others."""
        joined = self.coord.joined()
        missing = []
        for node in nodes:
            slot = slots[node]
            mine = sorted((w for w in joined if w.startswith(slot.prefix)), key=lambda w: int(w.rsplit("-", 1)[1]))
            if len(mine) >= self.fleet.slots:
                slot.wids = tuple(mine[: self.fleet.slots])
            else:
                missing.append(f"{node} ({len(mine)}/{self.fleet.slots})")
        return missing

    def wait_joined(self, nodes: Sequence[str]) -> list[str]:
        """Wait until every node has `slots` joined workers; set their wids; return them in node order.

        Raises:
            RendezvousTimeout: after `rendezvous_timeout`, naming the nodes short of workers.
        """
        missing: list[str] = []

        def ready() -> bool:
            missing[:] = self._missing(nodes, self.fleet.nodes)
            return not missing

        if not wait_until(ready, self.config.rendezvous_timeout, interval=0.1):
            raise RendezvousTimeout(f"job {self.job_id}: workers did not join within "
                                    f"{self.config.rendezvous_timeout.total_seconds():g} s on {', '.join(missing)}")
        return [w for node in nodes for w in self.fleet.nodes[node].wids]

    def node_failed(self, node: str, evicted: bool = False) -> None:
        slot = self.fleet.nodes[node]
        dead = set(slot.wids)
        t0 = time.monotonic()
        self.records.write("failure", node=node, owner=slot.owner, workers=sorted(dead),
                           cause="left out of the membership while running" if evicted else "workers ended")
        self.fleet.failures_in_a_row += 1
        if self.fleet.failures_in_a_row > self.config.max_failures:
            raise ElasticError(f"job {self.job_id}: {self.fleet.failures_in_a_row} failures in a row (last: {node})")
        recovered = wait_until(lambda: not dead & set(self.coord.current().members), self.config.rendezvous_timeout)
        plan = self.coord.current()
        stats = {}
        if recovered:
            try:
                stats = self.wait_switched(plan)
            except RendezvousTimeout as exc:
                log.warning("recovery epoch %d did not report a first step: %s", plan.id, exc)
        before = len(self.fleet.nodes)
        if node == self.fleet.alloc.batch_host:  # cannot be released: end its workers, start fresh ones there
            self.pool.stop(node, EXIT_GRACE)
            self.pool.forget(node)
            self.fleet.nodes.pop(node)
        else:
            self._release([node], reason=f"workers on {node} failed")
        self.records.write("transition", action="failure", epoch=plan.id, from_nodes=before,
                           to_nodes=len(self.fleet.nodes), world=plan.world_size, recovered=recovered,
                           wall_s=round(time.monotonic() - t0, 3), pause_s=stats.get("pause_s"),
                           idle_s=stats.get("idle_s"), stats=stats)
        self.window.reset()
        if node == self.fleet.alloc.batch_host:
            self._rejoin(node)

    def _rejoin(self, node: str) -> None:
        """Start new workers on a node of the main allocation and add them to the membership."""
        before = len(self.fleet.nodes)
        step = self.pool.start(node, self.fleet.slots, self.fleet.alloc.env, owner_job=self.job_id)
        self.fleet.nodes[node] = NodeSlot(node, self.job_id, step.group + "-")
        try:
            self.wait_joined([node])
            plan, stats, wall = self._resize_members(add=[node])
        except (RendezvousTimeout, ResizeConflict) as exc:
            self.records.write("transition_failed", action="rejoin", node=node, error=str(exc))
            return
        self.records.write("transition", action="rejoin", epoch=plan.id, from_nodes=before,
                           to_nodes=len(self.fleet.nodes),
                           world=plan.world_size, nodes_in=[node], wall_s=round(wall, 3),
                           pause_s=stats.get("pause_s"), idle_s=stats.get("idle_s"), stats=stats)
        self.window.reset()

    def _resize_members(self, add: Sequence[str] = (), remove: Sequence[str] = ()) -> tuple[Plan, dict, float]:
        """Post the plan without `remove`'s workers and with `add`'s, wait for its first step.

        Returns (plan, the runtime's switch stats, wall seconds from request to first step).

        Raises:
            RendezvousTimeout: the new epoch did not complete a step in time.
            ResizeConflict: a failure recovery won the race twice.
        """
        for attempt in range(3):
            base = self.coord.current()
            leaving = {w for n in remove for w in self.fleet.nodes[n].wids}
            members = [w for w in base.members if w not in leaving]
            members += [w for n in add for w in self.fleet.nodes[n].wids if w not in members]
            t0 = time.monotonic()
            try:
                plan = self.coord.request_resize(members, base)
            except ResizeConflict as exc:
                if attempt == 2:
                    raise
                log.warning("resize lost a race (%s); retrying on the new epoch", exc)
                wait_until(lambda: self.coord.current().id != base.id, self.config.rendezvous_timeout)
                continue
            stats = self.wait_switched(plan)
            return plan, stats, time.monotonic() - t0
        raise AssertionError("unreachable")

    def _release(self, nodes: Sequence[str], reason: str) -> float:
        """Give nodes whose workers are gone back to Slurm; return the seconds it took.

        Main-job nodes: their steps must end (SIGTERM after `leave_timeout`), then `client.shrink`, and the
        refreshed environment replaces the one new steps are started with. Helper nodes: the whole helper
        ends (stop key, then scancel) or, when some of its nodes stay, the helper is shrunk.
        """
        t0 = time.monotonic()
        mains = [n for n in nodes if self.fleet.nodes[n].owner == self.job_id]
        if mains:
            for node in self.pool.wait_ended(mains, EXIT_GRACE):
                log.warning("workers on %s did not exit after leaving; stopping the step", node)
                self.pool.stop(node)
            for node in mains:
                self.pool.forget(node)
            keep = [n for n, s in self.fleet.nodes.items() if s.owner == self.job_id and n not in mains]
            self._slurm_shrink(self.job_id, keep, reason, main=True)
        for helper, helper_nodes in list(self.fleet.helpers.items()):
            going = [n for n in helper_nodes if n in nodes]
            if not going:
                continue
            staying = [n for n in helper_nodes if n not in going]
            if staying:
                self._slurm_shrink(helper, staying, reason, main=False)
                self.fleet.helpers[helper] = staying
            else:
                self._end_helper(helper, reason)
        for node in nodes:
            self.fleet.nodes.pop(node, None)
            self.stragglers.forget(node)
        return round(time.monotonic() - t0, 3)

    def _slurm_shrink(self, job: str, keep: Sequence[str], reason: str, main: bool) -> bool:
        """`client.shrink(job, keep)`, retried through transient failures for `SLURM_RETRY`; for the main
        job the refreshed environment replaces the one new steps start with. False (and a
        `slurm_shrink_failed` record) when Slurm refused or stayed unreachable."""
        t0 = time.monotonic()
        try:
            result = retry_transient(lambda: self.slurm.shrink(int(job), list(keep)),
                                     f"job {self.job_id}: shrink job {job} to {','.join(keep)}", SLURM_RETRY)
        except (SlurmError, ResizeError, JobNotFoundError) as exc:
            log.error("job %s: could not give nodes back to Slurm (job %s keeps %s): %s; they stay allocated, "
                      "unused", self.job_id, job, ",".join(keep), exc)
            self.records.write("slurm_shrink_failed", job=job, keep=list(keep), reason=reason, error=str(exc),
                               wall_s=round(time.monotonic() - t0, 3))
            return False
        if main:
            self.fleet.alloc = self.fleet.alloc.with_nodes(tuple(keep), result.apply(self.fleet.alloc.env))
        self.records.write("slurm_shrink", job=job, nodelist=result.job.nodelist, nodes=len(result.job.nodes),
                           reason=reason, wall_s=round(time.monotonic() - t0, 3))
        return True

    def _end_helper(self, helper: str, reason: str) -> None:
        self.kv.set(keys.helper_stop(helper), reason)
        gone = wait_until(lambda: self.helper_gone(helper), self.config.leave_timeout, interval=0.3)
        if not gone:
            self.cancel(helper)
        self.fleet.helpers.pop(helper, None)
        self.records.write("helper_ended", helper=helper, reason=reason, cancelled=not gone)

    def helper_gone(self, helper: str) -> bool:
        """True once Slurm shows the helper ended or no longer lists it; False while it runs or while
        Slurm cannot be asked (an unreachable controller is not a finished job)."""
        try:
            return self.slurm.job(int(helper)).state not in LIVE_STATES
        except JobNotFoundError:
            return True
        except SlurmError as exc:
            log.warning("job %s: state of helper %s unknown: %s", self.job_id, helper, exc)
            return False

    def cancel(self, helper: str) -> None:
        """scancel the helper, retried through transient failures for `SLURM_RETRY`."""
        try:
            retry_transient(lambda: self.slurm.cancel(int(helper)), f"job {self.job_id}: scancel helper {helper}",
                            SLURM_RETRY)
        except JobNotFoundError as exc:  # already gone
            log.info("scancel %s: %s", helper, exc)
        except SlurmError as exc:
            log.error("job %s: could not cancel helper %s: %s (its agent ends on its own after the orphan "
                      "timeout)", self.job_id, helper, exc)

    # -- resizes as ops, one state a tick (resize_ops.py) ----------------------------------------------
    def request_grow(self, target: int, action: str, reason: str, exclude: Sequence[str] = ()) -> ResizeOp:
        """Queue a grow to `target` nodes (one helper job for up to `target - nodes` free nodes)."""
        op = ResizeOp(ResizeKind.GROW, target, action, reason, exclude=tuple(exclude))
        self.ops.append(op)
        return op

    def request_shrink(self, target: int, action: str, reason: str, prefer: Sequence[str] = ()) -> ResizeOp:
        """Queue a shrink to `target` nodes (the leavers are chosen when it starts, `prefer` first)."""
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
    def settled(self) -> bool:
        """The fleet's nodes are the current epoch's: no op has posted a plan that has not ended yet."""
        op = self.active
        return op is None or op.cancellable

    def op_nodes(self) -> set[str]:
        """Nodes the op in flight is adding or removing (their failures are the op's, not the failure handler's)."""
        op = self.active
        return set(op.nodes) if op is not None else set()

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

    def tick(self) -> Optional[ResizeOp]:
        """Observe the op in flight, move it one state, execute the actions; return it (None: no op).
        Never waits for Slurm or the workers (a Slurm command has its own timeout; an unreachable slurmctld
        is retried only by a release or a cancel)."""
        if not self.ops:
            return None
        op, now = self.ops[0], self.clock()
        if op.state is ResizeState.REQUESTED:
            op = self._prepare(op)
        cancel, self._cancel = self._cancel, None
        op, actions = advance(op, self.observe(op, cancel), now, self.limits)
        op = self._execute(op, actions, now)
        if op.done:
            self.ops.pop(0)
            self.last = op
        else:
            self.ops[0] = op
        return op

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

    def observe(self, op: ResizeOp, cancel: Optional[str] = None) -> Observation:
        """What the op in flight needs to know this tick (one Slurm query at most, a few store reads)."""
        seen: dict = {"cancel": cancel}
        if op.helper is not None and op.state in (ResizeState.SUBMITTED, ResizeState.ALLOCATED):
            seen["helper_state"], seen["helper_nodes"] = self._helper_job(op.helper)
        if op.helper is not None and op.state in (ResizeState.ALLOCATED, ResizeState.JOINED):
            steps = self.helper_status(op.helper).get("steps", {})
            seen["failed_nodes"] = tuple(n for n in op.nodes if steps.get(n) not in (None, 0))
        if op.state is ResizeState.ALLOCATED:
            seen["joined"] = not self._missing(op.nodes, self.fleet.joining)
        if op.state is ResizeState.JOINED and op.plan_id in self._plans:
            seen["switched"] = self.switch_stats(self._plans[op.plan_id]) is not None
            seen["superseded"] = not seen["switched"] and self.coord.current().id > op.plan_id
        if op.kind is ResizeKind.SHRINK and op.state is ResizeState.SWITCHED:
            seen["left"] = all(self.coord.has_left(w) for n in op.nodes for w in self._slot(n).wids)
        return Observation(**seen)

    def helper_status(self, helper: str) -> dict:
        """The helper agent's status record (`launcher/helper/<id>/status`: its steps' exit codes), {} if none."""
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
                    self.fleet.joining[node] = NodeSlot(node, op.helper, f"j{op.helper}-{node}-")
            elif kind is ActionKind.POST_PLAN:
                op = self._post(op)
            elif kind is ActionKind.CANCEL_HELPER:
                self._cancel_helper(op.helper, op.error or "resize failed")
            elif kind is ActionKind.RELEASE_NODES:
                self._release_s = self._release(list(act.nodes), reason=op.reason)
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

    def _cancel_helper(self, helper: Optional[str], reason: str) -> None:
        """End a failed grow's helper now: the stop key for its agent, and scancel without waiting (its workers
        were never members, or the recovery already left them out)."""
        if helper is None:
            return
        try:
            self.kv.set(keys.helper_stop(helper), reason)
        except Exception as exc:  # noqa: BLE001 - scancel follows anyway
            log.warning("cannot signal helper %s: %s", helper, exc)
        self.cancel(helper)
        self.fleet.helpers.pop(helper, None)
        self.records.write("helper_ended", helper=helper, reason=reason, cancelled=True)

    def _finish(self, op: ResizeOp, now: float) -> None:
        plan = self._plans.get(op.plan_id) or self.coord.current()
        stats = self.switch_stats(plan) or {}
        extra = dict(nodes_in=list(op.nodes), helper=op.helper,
                     allocate_s=None if op.allocated is None else round(op.allocated - op.started, 3)) \
            if op.kind is ResizeKind.GROW else dict(nodes_out=list(op.nodes), left_cleanly=op.left,
                                                     release_s=self._release_s)
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
