"""Resize mechanics: helper jobs, shrink and grow (:class:`Resizer`, which executes the controller's decisions).

The launcher channel's keys (status, operator requests, helper stop) are laid out in `store_keys.py`.

Shrink order (Slurm SIGKILLs tasks on released nodes): the leaving ranks leave at a commit point first
(runtime resize plan without them), their srun steps end, and only then are the nodes released: helper
nodes by ending the helper job (stop key + scancel), main-job nodes with `client.shrink`, whose refreshed
Slurm environment replaces the one the controller launches with. Grow: a helper job is submitted; once
it runs, its agent starts workers that join the rendezvous, and the controller posts the plan with them.

Slurm faults: every Slurm change here (shrink, helper lookup, scancel) goes through
`slurm_plugin.client.retry_transient`, so a slurmctld that restarts (each command then fails after its own
timeout) is retried with backoff for up to `SLURM_RETRY`; a submit that fails skips that grow. A release
that still fails after that is logged (`slurm_shrink_failed`): the workers are gone already, the node
stays allocated, idle, until the job ends. "Unreachable" is never read as "job gone".
"""
from __future__ import annotations

import dataclasses
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
from elastic_launcher.launch_config import Allocation, LaunchConfig, helper_comment, helper_name
from elastic_launcher.membership import Coordinator, Plan
from elastic_launcher.reporting import RecordLog
from elastic_launcher.stragglers import StragglerDetector
from elastic_launcher.workers import WorkerPool, transition_idle_s
from slurm_plugin.client import retry_transient
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
        failures_in_a_row: failed resizes and worker losses since the last good measurement.
    """

    job_id: str
    alloc: Allocation
    slots: int
    nodes: dict[str, NodeSlot] = dataclasses.field(default_factory=dict)
    helpers: dict[str, list[str]] = dataclasses.field(default_factory=dict)
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
    """

    def __init__(self, config: LaunchConfig, fleet: Fleet, *, coord: Coordinator, pool: WorkerPool, slurm,
                 kv, records: RecordLog, stragglers: StragglerDetector, window: MeasureWindow, store_addr: str,
                 progress: Callable[[Sequence[str]], dict], finished: Callable[[], Optional[str]],
                 free_nodes: Callable[[], list[str]]) -> None:
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

    @property
    def job_id(self) -> str:
        return self.fleet.job_id

    def wait_switched(self, plan: Plan) -> dict:
        """Wait for `plan`'s first committed step; return the runtime's switch record (`elastic/switched/<id>`,
        written by the epoch's rank 0 for every kind of epoch) plus `idle_s`: the extra time the survivors'
        step took across the transition (from rank 0's progress reports).

        Raises:
            RendezvousTimeout: not within `rendezvous_timeout`, or the workers all ended meanwhile.
        """
        head: dict = {}
        stats: dict = {}

        def first_step() -> bool:
            head.update(self._progress(plan.members[:1]).get(plan.members[0]) or {})
            if not stats:
                stats.update(self.coord.switched(plan) or {})
            return bool(stats) and head.get("epoch") == plan.id

        def superseded() -> bool:
            return self.coord.current().id > plan.id

        if not wait_until(lambda: first_step() or superseded() or self._finished() is not None,
                          self.config.rendezvous_timeout, interval=0.05) or not first_step():
            raise RendezvousTimeout(f"job {self.job_id}: epoch {plan.id} ({plan.world_size} workers) reported no "
                                    f"first step within {self.config.rendezvous_timeout.total_seconds():g} s "
                                    f"or the workers ended")
        idle, step = transition_idle_s(head.get("recent", []), plan.id)
        stats["idle_s"] = None if idle is None else round(idle, 3)
        stats["step_s"] = None if step is None else round(step, 3)
        return stats

    def wait_joined(self, nodes: Sequence[str]) -> list[str]:
        """Wait until every node has `slots` joined workers; set their wids; return them in node order.

        Raises:
            RendezvousTimeout: after `rendezvous_timeout`, naming the nodes short of workers.
        """
        missing: list[str] = []

        def ready() -> bool:
            joined = self.coord.joined()
            missing.clear()
            for node in nodes:
                slot = self.fleet.nodes[node]
                mine = sorted((w for w in joined if w.startswith(slot.prefix)), key=lambda w: int(w.rsplit("-", 1)[1]))
                if len(mine) >= self.fleet.slots:
                    slot.wids = tuple(mine[: self.fleet.slots])
                else:
                    missing.append(f"{node} ({len(mine)}/{self.fleet.slots})")
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

    def shrink_to(self, target: int, action: str, reason: str, prefer: Sequence[str] = ()) -> None:
        owners = {n: s.owner for n, s in self.fleet.nodes.items()}
        leavers = choose_leavers(list(self.fleet.nodes), owners, self.job_id, self.fleet.alloc.batch_host,
                                 len(self.fleet.nodes) - target, prefer)
        before = len(self.fleet.nodes)
        for node in leavers:
            if node in self.pool.steps:
                self.pool.steps[node].leaving = True
        try:
            plan, stats, wall = self._resize_members(remove=leavers)
        except (RendezvousTimeout, ResizeConflict) as exc:
            self.records.write("transition_failed", action=action, from_nodes=before, target_nodes=target,
                               error=str(exc))
            self.fleet.failures_in_a_row += 1
            return
        left = wait_until(lambda: all(self.coord.has_left(w) for n in leavers for w in self.fleet.nodes[n].wids),
                          self.config.leave_timeout)
        if not left:
            stuck = [w for n in leavers for w in self.fleet.nodes[n].wids if not self.coord.has_left(w)]
            log.warning("workers %s did not leave within %g s; their steps are stopped", stuck,
                        self.config.leave_timeout.total_seconds())
        released = self._release(leavers, reason=reason)
        self.records.write("transition", action=action, epoch=plan.id, from_nodes=before,
                           to_nodes=len(self.fleet.nodes),
                           world=plan.world_size, nodes_out=leavers, reason=reason, wall_s=round(wall, 3),
                           pause_s=stats.get("pause_s"), idle_s=stats.get("idle_s"), left_cleanly=left,
                           release_s=released, stats=stats)
        self.window.reset()

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
            return self.slurm.job(int(helper)).state not in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING")
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

    def grow(self, add: int, action: str, reason: str, exclude: Sequence[str] = ()) -> bool:
        """Grow by up to `add` nodes with one helper job; False when nothing was added."""
        cfg = self.config
        free = [n for n in self._free_nodes() if n not in exclude]
        count = min(add, len(free))
        before = len(self.fleet.nodes)
        if count < 1:
            self.records.write("transition_skipped", action=action, reason="no free nodes")
            return False
        script = helper_script(self.job_id, count, self.fleet.alloc.gpus_per_node, self.fleet.alloc.partition,
                               [*self.fleet.nodes, *exclude], self.store_addr, self.fleet.slots,
                               cfg.helper_orphan_timeout, cfg.run_dir, cfg.command, Path(os.getcwd()))
        t0 = time.monotonic()
        try:
            helper = str(self.slurm.submit(script))
        except SlurmError as exc:  # not retried: the decision is re-taken at the next measurement
            log.warning("job %s: helper submission failed: %s", self.job_id, exc)
            self.records.write("transition_failed", action=action, error=f"helper submission failed: {exc}")
            return False
        self.fleet.helpers[helper] = []
        self.records.write("helper_submitted", helper=helper, nodes=count, reason=reason)
        running = wait_until(lambda: self._job_state(helper) == "RUNNING", cfg.helper_start_timeout, interval=0.2)
        if not running:
            self.cancel(helper)
            self.fleet.helpers.pop(helper, None)
            self.records.write("transition_failed", action=action, error=f"helper {helper} did not start "
                               f"within {cfg.helper_start_timeout.total_seconds():g} s")
            return False
        try:
            nodes = list(retry_transient(lambda: self.slurm.job(int(helper)).nodes,
                                         f"job {self.job_id}: nodes of helper {helper}", SLURM_RETRY))
        except (SlurmError, JobNotFoundError) as exc:
            self._end_helper(helper, f"its nodes are unknown: {exc}")
            self.records.write("transition_failed", action=action, error=f"helper {helper}: {exc}")
            return False
        self.fleet.helpers[helper] = nodes
        for node in nodes:
            self.fleet.nodes[node] = NodeSlot(node, helper, f"j{helper}-{node}-")
        allocated_s = time.monotonic() - t0
        try:
            self.wait_joined(nodes)
            plan, stats, wall = self._resize_members(add=nodes)
        except (RendezvousTimeout, ResizeConflict) as exc:
            for node in nodes:
                self.fleet.nodes.pop(node, None)
            self._end_helper(helper, f"grow failed: {exc}")
            self.records.write("transition_failed", action=action, error=str(exc))
            self.fleet.failures_in_a_row += 1
            return False
        self.records.write("transition", action=action, epoch=plan.id, from_nodes=before,
                           to_nodes=len(self.fleet.nodes),
                           world=plan.world_size, nodes_in=nodes, helper=helper, reason=reason,
                           allocate_s=round(allocated_s, 3), wall_s=round(wall, 3), pause_s=stats.get("pause_s"),
                           idle_s=stats.get("idle_s"), stats=stats)
        self.window.reset()
        return True

    def _job_state(self, job: str) -> str:
        try:
            return self.slurm.job(int(job)).state
        except Exception:
            return "UNKNOWN"
