"""The elastic controller: runs in the batch step of the main job and decides the job's size.

`Controller` is the loop. It owns the rendezvous store, starts workers (workers.py), measures the throughput
at each size, posts observations (the workers' relabelled records and its own step records, observations.py)
and asks /v1/plan (reporting.PredictorClient), applies the pure policy (autoscale.AutoscalePolicy: Or et al.'s
scaling-efficiency test, the predictor's plan, the directives' limits), operator requests and failure
handling, and logs every decision and measurement as a record (reporting.RecordLog). Its decisions are pure
functions (steering.py: decide_request, settle_decision; autoscale.AutoscalePolicy.decide); resize.Resizer
executes them. Every attribute is declared in `__init__`; what `run()` opens (the store and its clients, the
resizer) is None until then.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.autoscale import (NO_DIRECTIVES, NOT_CONFIGURED, UNREACHABLE, AutoscalePolicy, Decision, Measurement,
                                        PendingJob, PlanAdvice, TimeBudget, advice_from_plan, scaling_efficiency,
                                        yield_to_pending)
from elastic_launcher.control import ControlInbox, beat as heartbeat, serve_store
from elastic_launcher.errors import RendezvousTimeout
from elastic_launcher.launch_config import LaunchConfig
from elastic_launcher.membership import Coordinator
from elastic_launcher.links import HostFacts, Links, links_for
from elastic_launcher.gpu_speeds import JobTypes, decide_speeds, node_gres_types
from elastic_launcher.observations import ObservationInbox, layout_of, postable, relabel, step_record
from elastic_launcher.reporting import PredictorClient, RecordLog, progress_line, scaling_plot
from elastic_launcher.membership import Plan
from elastic_launcher.resize import Fleet, MeasureWindow, NodeSlot, Resizer, wait_until
from elastic_launcher.resize_ops import ResizeKind
from elastic_launcher.steering import (JobPhase, MeasuredThroughput, RequestKind, ThroughputModel, decide_failures,
                                       decide_request, settle_decision)
from elastic_launcher.stragglers import StragglerDetector
from elastic_launcher.workers import WorkerPool, step_prefix

# AutoscalePolicy & co. are re-exported: they lived here before autoscale.py.
__all__ = ["Controller", "AutoscalePolicy", "Decision", "Measurement", "scaling_efficiency", "PredictorClient",
           "RecordLog"]

PLAN_INTERVAL_S = 15.0  # at one size, /v1/plan is asked at most this often (seconds)
HELPER_EXIT_S = 3.0  # at the controller's exit, a helper gets this long to end after its stop key, then scancel
OBSERVATIONS_PER_POST = 1000  # records in one POST /v1/observations (the service takes up to 4096)
log = logging.getLogger("elastic_launcher.controller")


def time_left_s(facts: dict) -> float:
    """The job's training time left at its current speed, from `Controller._steps_and_eta`'s facts (inf while its
    workers have not said their --steps)."""
    return math.inf if facts["eta_s"] is None else float(facts["eta_s"])


def _rounded(value):
    """Seconds in the end summary: milliseconds, not float noise (#45.6)."""
    return round(value, 3) if isinstance(value, float) else value


OPERATOR_RULE = "none: the autoscaler decides (`ctl --nodes N` sets a size that holds until `ctl --auto`)"
PROGRESS_INTERVAL_S = 30.0  # one human progress line in the job's output at most this often (a measurement each)


class Controller:
    """Runs one elastic job from the batch step (see the module docstring).

    Args:
        config: the frozen launch configuration.
        registry: directory where `<job>.json` with the store address is published for `ctl`.
        slurm: the Slurm client (slurm_plugin.client.CommandBackend or a fake with the same methods).
        start_step: starts an srun step (slurm_plugin.client.start_step or a fake).
        throughput: what a measurement window's samples/s is taken to be (steering.ThroughputModel); the
            default is the measurement. Tests and CPU testbeds inject ``testing.LinearThroughput``.
        clock / sleep: the monotonic clock the resize deadlines are read on, and the wait between ticks (tests
            inject fakes).
        wall: the Unix clock the job's Slurm end time is compared with (tests inject a fake).

    The loop is one :meth:`_tick` per `poll_interval`, from the start on: the initial rendezvous, a resize
    (`resize_ops.ResizeOp`) and a failed node's recovery (`resize_ops.RecoveryOp`) each move one state a tick, so
    failures, operator requests and measurements are handled while any of them is in flight; `phase`
    (steering.JobPhase) says what the loop may start.
    """

    def __init__(self, config: LaunchConfig, registry: Path, slurm, start_step,
                 throughput: ThroughputModel = MeasuredThroughput(), clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, wall: Callable[[], float] = time.time):
        self.config = config
        self.registry = Path(registry)
        self.slurm = slurm
        self.start_step = start_step
        self.throughput = throughput
        self.clock = clock
        self.sleep = sleep
        self.wall = wall
        self.job_id = str(config.allocation.job_id)
        self.slots = config.slots_per_node
        self.fleet = Fleet(self.job_id, config.allocation, self.slots)
        self.phase = JobPhase.STARTING
        self.window = MeasureWindow()
        d = config.directives
        self.policy = AutoscalePolicy(d.min_efficiency, d.max_global_batch, d.per_gpu_batch, self.slots,
                                      d.gpus_min, d.gpus_max, config.grow_step_nodes)
        self.stragglers = StragglerDetector(config.straggler_ratio, config.straggler_windows,
                                            protected=frozenset({self.fleet.alloc.batch_host}))
        self.predictor = PredictorClient(config.predictor_url, config.predictor_token,
                                         config.http_timeout.total_seconds(), job_id=int(self.job_id),
                                         munge_socket=config.munge_socket)
        self.operator_cap: Optional[int] = None
        self._last_keep: Optional[str] = None
        self._plan_cache: tuple[Optional[int], float, Optional[PlanAdvice]] = (None, 0.0, None)  # (nodes asked
        # at, when, the advice then): at one size /v1/plan is asked at most every PLAN_INTERVAL_S
        # opened by run()
        self.records: Optional[RecordLog] = None
        self.server: Optional[dist.TCPStore] = None
        self.store_addr: Optional[str] = None
        self.kv: Optional[dist.Store] = None  # the launcher channel (store_keys.LAUNCHER)
        self.coord: Optional[Coordinator] = None
        self.inbox: Optional[ControlInbox] = None
        self.observations: Optional[ObservationInbox] = None
        self.pool: Optional[WorkerPool] = None
        self.resizer: Optional[Resizer] = None
        self._stop_beat = threading.Event()
        self._start_plan: Optional[Plan] = None  # STARTING: the first plan once every node's workers joined
        self._start_deadline = 0.0  # STARTING: when the current start stage (join, first step) fails
        self._start_t0 = 0.0  # STARTING: when the first plan was posted
        self._layouts: dict[int, list[int]] = {}  # world size -> layout of the epochs seen (observations)
        self._links: dict[int, Links] = {}  # world size -> links of that layout (observations.relabel)
        self._total_steps: Optional[int] = None  # the script's --steps, once a worker published it
        self._progress_logged = float("-inf")  # when the last human progress line was logged (self.clock)
        self._plan_asked = "not asked"  # what the last /v1/plan request met (PredictorClient.last_outcome)
        self._profile_outcome: Optional[str] = None  # _register_profile: known / registered / refused / ...
        self._device_gpu: dict[str, str] = {}  # node -> the type its workers' own devices reported (HostFacts.gpu)
        self._epoch: Optional[tuple[int, list[str]]] = None  # the current epoch's id and nodes in layout order
        self.types = JobTypes({}, "not read yet")  # each node's GPU type and speed, read at start (gpu_speeds.py)

    # -- lifecycle -----------------------------------------------------------------------------------
    def run(self) -> dict:
        """Start the workers, steer the job until they finish, clean up; return a summary.

        Raises:
            ElasticError: the initial rendezvous failed, or `max_failures` failures in a row.
        """
        cfg = self.config
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.records = RecordLog(cfg.run_dir / "records.jsonl")
        self.server, self.store_addr, self.kv = serve_store(cfg.store_host, cfg.store_port, cfg.store_timeout)
        self.coord = Coordinator(self.server, timeout=cfg.rendezvous_timeout)
        self.inbox = ControlInbox(self.kv)
        self.observations = ObservationInbox(self.server)
        self.pool = WorkerPool(cfg.command, self.store_addr, self.job_id, self.start_step, cfg.run_dir,
                               stop_timeout=cfg.leave_timeout)
        self.resizer = Resizer(cfg, self.fleet, coord=self.coord, pool=self.pool, slurm=self.slurm, kv=self.kv,
                               records=self.records, stragglers=self.stragglers, window=self.window,
                               store_addr=self.store_addr, progress=self._progress, free_nodes=self._free_nodes,
                               clock=self.clock)
        self._publish()
        beat = threading.Thread(target=heartbeat, args=(self.store_addr, cfg.store_timeout, self._stop_beat),
                                name="elastic-heartbeat", daemon=True)
        beat.start()
        self.records.write("start", job=self.job_id, nodes=list(self.fleet.alloc.nodes), slots=self.slots,
                           store=self.store_addr, config=json.loads(cfg.to_json()),
                           throughput=type(self.throughput).__name__)
        outcome = "failed"
        try:
            self._start_initial()
            outcome = self._loop()
            return self._summary(outcome)
        finally:
            self.phase = JobPhase.ENDED
            self._cleanup(outcome)
            self._stop_beat.set()
            beat.join(timeout=5)

    def _publish(self) -> None:
        self.registry.mkdir(parents=True, exist_ok=True)
        host, port = self.store_addr.rsplit(":", 1)
        (self.registry / f"{self.job_id}.json").write_text(json.dumps(
            {"job": self.job_id, "host": host, "port": int(port), "run_dir": str(self.config.run_dir)}))

    def _gpu_types(self) -> JobTypes:
        """Each allocated node's GPU type (Slurm's GRES type) and speed (gpu_speeds.py); Slurm unreachable:
        no labels, equal speeds."""
        names = list(self.fleet.alloc.nodes)
        try:
            gres = node_gres_types(self.slurm.nodes(), names)
        except Exception as exc:  # noqa: BLE001 - labels are a refinement: the job runs with equal batches
            log.warning("cannot read the nodes' GPU types from Slurm: %s", exc)
            gres = {n: None for n in names}
        d, c = self.config.directives, self.config
        model = d.model or "unknown"
        return decide_speeds(gres, lambda gpu: self.predictor.compute_s(model, gpu, d.per_gpu_batch,
                                                                        c.intra_link or "nvlink"), d.gpu_type)

    def _start_initial(self) -> None:
        self.types = self._gpu_types()
        self.pool.node_env = {node: self.types.env(node) for node in self.types.nodes}
        self.pool.job_env = self.config.directives.worker_env()
        self.records.write("gpu_types", **self.types.to_record())
        for node in self.fleet.alloc.nodes:
            step = self.pool.start(node, self.slots, self.fleet.alloc.env, owner_job=self.job_id)
            self.fleet.nodes[node] = NodeSlot(node, self.job_id, step_prefix(step.group))
        self.phase = JobPhase.STARTING
        self._start_deadline = self.clock() + self.config.rendezvous_timeout.total_seconds()

    def _tick_start(self) -> None:
        """STARTING, one stage a tick: every node's workers joined -> the first plan posted -> its first step ->
        RUNNING. Raises RendezvousTimeout when a stage passes `rendezvous_timeout` or a worker step fails first."""
        now, limit = self.clock(), self.config.rendezvous_timeout.total_seconds()
        failed = [f"{s.node} (exit {s.returncode()})" for s in self._main_steps() if not s.alive()]
        if failed:
            raise RendezvousTimeout(f"job {self.job_id}: workers ended before the job started: {', '.join(failed)}")
        if self._start_plan is None:
            nodes = list(self.fleet.alloc.nodes)
            missing = self.resizer.missing(nodes, self.fleet.nodes)
            if not missing:
                self._start_plan = self.coord.start([w for n in nodes for w in self.fleet.nodes[n].wids])
                self._start_t0, self._start_deadline = now, now + limit
            elif now >= self._start_deadline:
                raise RendezvousTimeout(f"job {self.job_id}: workers did not join within {limit:g} s on "
                                        f"{', '.join(missing)}")
            return
        plan = self._start_plan
        stats = self.resizer.switch_stats(plan)
        if stats is None:
            if now >= self._start_deadline:
                raise RendezvousTimeout(f"job {self.job_id}: epoch {plan.id} ({plan.world_size} workers) reported "
                                        f"no first step within {limit:g} s")
            return
        self.records.write("transition", action="start", epoch=plan.id, from_nodes=0,
                           to_nodes=len(self.fleet.nodes), world=plan.world_size,
                           first_step_s=round(now - self._start_t0, 3), stats=stats)
        self.window.reset()
        self.phase = JobPhase.RUNNING

    # -- the loop ------------------------------------------------------------------------------------
    def _loop(self) -> str:
        while True:
            finished = self._tick()
            if finished:
                return finished
            self.sleep(self.config.poll_interval.total_seconds())

    def _tick(self) -> Optional[str]:
        """One round: status, failures, operator requests, the recoveries and the resize in flight (one state
        each), the measurement; in STARTING: requests and the start's stage. Returns the outcome once every
        main-job worker ended. Waits for nothing a start, a recovery or a resize waits for."""
        self._write_status()
        finished = self._finished()
        if finished:
            return finished
        if self.phase is JobPhase.STARTING:  # no epoch yet: requests are queued, nothing else to steer
            self._handle_requests()
            self._tick_start()
            return None
        self._handle_failures()
        self._handle_requests()
        self.resizer.tick()
        self.phase = JobPhase.RECOVERING if self.resizer.recovering else \
            JobPhase.RESIZING if self.resizer.busy else JobPhase.RUNNING
        self._measure_and_decide()
        return None

    def _handle_requests(self) -> None:
        for seq, request in self.inbox.poll():
            self._handle_request(seq, request)

    def _main_steps(self):
        return [s for s in self.pool.steps.values() if s.owner_job == self.job_id]

    def _finished(self) -> Optional[str]:
        """'completed' when every worker step of the main job ended with status 0, 'failed' when all ended."""
        steps = self._main_steps()
        if not steps or any(s.alive() for s in steps):
            return None
        codes = [s.returncode() for s in steps]
        return "completed" if all(c == 0 for c in codes) else "failed"

    def _handle_failures(self) -> None:
        """A node failed when its step ended non-zero while it is a member, or when a recovery epoch left
        all its workers out although their step still runs (hung workers the survivors declared dead)."""
        ended = [s.node for s in self._main_steps() if not s.alive() and s.returncode() != 0 and not s.leaving]
        helper_failed = []
        for helper, nodes in list(self.fleet.helpers.items()):
            steps = self.resizer.helper_status(helper).get("steps", {})
            helper_failed += [n for n in nodes if steps.get(n) not in (None, 0)]
        members = set(self.coord.current().members)
        evicted = [n for n, slot in self.fleet.nodes.items() if slot.wids and not set(slot.wids) & members]
        ours = set(self.fleet.nodes) - self.resizer.handled_nodes()  # an op or a recovery handles its own nodes
        failed = decide_failures(ended, helper_failed, evicted, ours)
        for node, was_evicted in failed:  # each returns at once: the resizer follows its recovery tick by tick
            self.resizer.node_failed(node, evicted=was_evicted, keep=was_evicted and self._wants_node(len(failed)))
        if failed:
            self.phase = JobPhase.RECOVERING

    def _wants_node(self, failing: int) -> bool:
        """Whether a fenced-out node (its workers hung past the arrival deadline, alive) is kept for fresh workers
        to rejoin as newcomers rather than given back: the planner's last advice wants at least as many nodes as
        the job has, the failing ones included (no advice: given back, as before #42), within the operator's
        cap."""
        advice = self._plan_cache[2]
        if advice is None or advice.nodes is None:
            return False
        have = len(self.fleet.nodes) - failing
        target = advice.nodes if self.operator_cap is None else min(advice.nodes, self.operator_cap)
        return target > have

    def _handle_request(self, seq: int, request: dict) -> None:
        """Answer an operator's request in this tick. While a resize is in flight (RESIZING), one that posted no
        plan yet is cancelled when it goes the other way or to the size asked (its helper released), and the
        request's resize is queued behind what remains."""
        have = len(set(self.fleet.nodes) - {r.node for r in self.resizer.recoveries})  # failed ones are going
        action = decide_request(request.get("nodes"), have, self.policy.min_nodes())
        if action.kind is RequestKind.REJECT:
            self.inbox.reply(seq, False, action.message)
            return
        if action.kind is RequestKind.LIFT:
            lifted, self.operator_cap = self.operator_cap, None
            self.inbox.reply(seq, True, action.message if lifted is not None else "no operator's size was set")
            self.records.write("decision", source="operator", action="auto", from_nodes=have, target_nodes=have,
                               reason=f"elastic-launch ctl {self.job_id} --auto")
            return
        target = action.target
        self.operator_cap = target
        op = self.resizer.active
        message = action.message
        if op is not None:
            grows = op.kind is ResizeKind.GROW
            if op.cancellable and (target <= have if grows else target >= have):
                self.resizer.cancel_pending(f"operator asked for {target} nodes")
                message += f"; the {op.action} in flight ({op.state.value}) is cancelled"
            else:
                self.resizer.cancel_pending(f"operator asked for {target} nodes", keep_active=True)  # the queued
                message += f"; after the {op.action} in flight ({op.state.value})"
        self.inbox.reply(seq, True, message, target_nodes=target)
        if action.kind is RequestKind.ALREADY:
            return
        self.records.write("decision", source="operator", action="grow" if target > have else "shrink",
                           from_nodes=have, target_nodes=target, reason=f"elastic-launch ctl {self.job_id} "
                           f"--nodes {target}")
        if target < have:
            self.resizer.request_shrink(target, action="shrink", reason="operator request")
        else:
            self.resizer.request_grow(target, action="grow", reason="operator request")

    # -- measurement and autoscaling --------------------------------------------------------------------
    def _progress(self, wids) -> dict[str, dict]:
        out = {}
        for wid in wids:
            key = keys.progress(wid)
            if self.server.check([key]):
                out[wid] = json.loads(self.server.get(key))
        return out

    def _measure(self) -> Optional[tuple[Measurement, dict[str, float]]]:
        """The throughput and per-node compute time over the current window, once it is complete."""
        plan = self.coord.current()
        progress = self._progress(plan.members)
        head = progress.get(plan.members[0])
        win = self.window
        if head is None or head["epoch"] != plan.id:
            return None
        if win.epoch != plan.id:
            win.epoch, win.first, win.start = plan.id, head["step"], None
        if win.start is None:
            if head["step"] >= win.first + self.config.warmup_steps and len(progress) == len(plan.members):
                win.start = progress
            return None
        start = win.start
        steps = head["step"] - start[plan.members[0]]["step"]
        if steps < self.config.measure_steps:
            return None
        first = start[plan.members[0]]
        elapsed = head["t"] - first["t"]
        sps = (head["samples"] - first["samples"]) / elapsed if elapsed > 0 else 0.0
        per_node: dict[str, list[float]] = {}
        for wid, now in progress.items():
            then = start.get(wid)
            if then and now["steps"] > then["steps"]:
                mean = (now["compute_total_s"] - then["compute_total_s"]) / (now["steps"] - then["steps"])
                per_node.setdefault(now["node"], []).append(mean)
        workers = plan.world_size
        sps = self.throughput.samples_per_s(sps, workers, self.policy.history_)
        win.start = progress
        m = Measurement(nodes=len(self.fleet.nodes), workers=workers, samples_per_s=sps, step_s=elapsed / steps)
        return m, {node: sum(v) / len(v) for node, v in per_node.items()}

    def _measure_and_decide(self) -> None:
        """Record a complete measurement window and post the observations; in RUNNING only, decide on it
        (stragglers, the policy) and queue the resize. While a resize has posted a plan that has not ended, the
        fleet is not the epoch's: nothing is measured (the window restarts after it)."""
        if not self.resizer.settled:
            return
        result = self._measure()
        if result is None:
            return
        m, compute_by_node = result
        self.fleet.failures_in_a_row = 0
        self.policy.record(m)
        self.records.write("measurement", nodes=m.nodes, workers=m.workers, samples_per_s=round(m.samples_per_s, 3),
                           step_s=round(m.step_s, 4), compute_s_by_node={k: round(v, 4) for k, v in
                                                                         compute_by_node.items()},
                           gpu_type_by_node={k: self._node_label(k) for k in compute_by_node})
        layout = self._current_layout() or [self.slots] * m.nodes
        d = self.config.directives
        links = self._links.get(m.workers, Links(source="default: the epoch's layout is unknown"))
        gpu_by_node, rank_batches = self._ran_as(layout)
        own = step_record(d.model or "unknown", self._gpu_label(), layout, links, d.per_gpu_batch, m.step_s,
                          gpu_by_node, rank_batches)
        self._register_profile()
        # a mixed job's row names each node's type (the service keeps it and fits no type on it); without them
        # its step time would read as one type's: not posted
        self._post_observations([] if self.types.mixed and gpu_by_node is None else [own])
        # the workers' progress, read from the store once a decision whatever uses it (#46: read twice while a job waited)
        job_facts = functools.cache(lambda: self._steps_and_eta(
            self._progress(self._known_wids()) if self.server is not None else {}, m))
        now = self.clock()
        if now - self._progress_logged >= PROGRESS_INTERVAL_S:
            self._progress_logged = now
            facts = job_facts()
            log.info("%s", progress_line(facts["step"], facts["total_steps"], m.samples_per_s, m.nodes,
                                         facts["eta_s"], facts["last_resize"], time.time()))
        if not self.config.directives.elastic or self.phase is not JobPhase.RUNNING:
            return
        slow = self.stragglers.observe(compute_by_node)
        if slow:  # stragglers are handled like failures, also with --no-autoscale
            self._replace_stragglers(slow, compute_by_node)
            return
        if not self.config.autoscale:
            return
        advice = self._ask_plan(m, layout)
        free = self._free_nodes()
        pending = self._pending_jobs()   # the plan's shrink waits for one; --no-yield: they get nothing of ours
        budget = self._time_budget(job_facts())
        decision = self.policy.decide(len(free), advice, waiting=bool(pending), budget=budget)
        yielding = pending if self.config.yield_to_pending else []
        handback = None if not yielding else \
            yield_to_pending(m.nodes, self.policy.min_nodes(), len(free), yielding, time_left_s(job_facts()))
        if handback is not None:   # the whole hand-back or none: fewer nodes would not start the pending job
            handback = self.policy.within_limit(handback, m.nodes, budget, whole=True)
            handback = None if handback.action == "keep" else handback
        decision = settle_decision(decision, m.nodes, handback, yielding, self.operator_cap, advice)
        if handback is not None and decision is handback:   # the nodes are lent: grown back once nobody waits
            self.policy.lent_nodes_ = max(self.policy.lent_nodes_, m.nodes)
        keep_key = f"{advice.policy}: {decision.reason}"
        if decision.action == "keep" and keep_key == self._last_keep:
            return  # an unchanged "keep" (same policy, same reason) is not logged again (the measurement is)
        self._last_keep = keep_key if decision.action == "keep" else None
        self.records.write("decision", source="autoscale", action=decision.action, from_nodes=m.nodes,
                           target_nodes=decision.target_nodes, reason=decision.reason,
                           efficiency=decision.efficiency, policy=advice.policy, plan_nodes=advice.nodes,
                           plan_note=advice.note, free_nodes=len(free), predictor=self._plan_outcome(advice),
                           writes="refused" if self.predictor.writes_refused else self._writes_outcome())
        if decision.action == "grow":
            self.resizer.request_grow(decision.target_nodes, action="grow", reason=decision.reason)
        elif decision.action in ("revert", "shrink") and decision.target_nodes < m.nodes:
            self.resizer.request_shrink(decision.target_nodes, action=decision.action, reason=decision.reason)

    def _plan_outcome(self, advice) -> str:
        """The decision record's `predictor` flag: what the plan request met (#45.4: a bare false said neither
        why nor which): `answered`, `not configured`, `unreachable` or `refused` (the service said no)."""
        if advice.source == NO_DIRECTIVES:
            return "not asked"
        return "not configured" if advice.source == NOT_CONFIGURED else self._plan_asked

    def _writes_outcome(self) -> str:
        """The decision record's `writes` flag: `refused` (the service will not take this job's rows), `not
        configured`, or `posted` (the rows go to the service; each post's own failures are logged)."""
        return "not configured" if self.predictor.url is None else "posted"

    def _ran_as(self, layout: list[int]) -> tuple[Optional[list[str]], Optional[list[int]]]:
        """What the current epoch ran (#42.7), for its step row: each node's GPU type in the layout's order (None
        unless every node's is known and they agree with the row's label or differ: a mixed job), and each rank's
        local batch as the epoch's rank 0 wrote it (``store_keys.batches``; None if not there)."""
        if self._epoch is None or len(self._epoch[1]) != len(layout):
            return None, None
        pid, nodes = self._epoch
        types = [self._node_label(n) for n in nodes]
        if "unknown" in types or (len(set(types)) == 1 and types[0] != self._gpu_label()):
            types = None
        batches = None
        try:
            key = f"{keys.state_channel('')}/{keys.batches(pid)}"
            if self.server.check([key]):
                batches = json.loads(self.server.get(key))
        except Exception as exc:  # noqa: BLE001 - a store hiccup: the row goes without them
            log.debug("no batches of epoch %d: %s", pid, exc)
        if not isinstance(batches, list) or len(batches) != sum(layout):
            batches = None
        return types, batches

    def _current_layout(self) -> Optional[list[int]]:
        """GPUs per node of the current epoch, remembered by world size with its links for the workers' records."""
        plan = self.coord.current()
        node_of = {w: n for n, slot in self.fleet.nodes.items() for w in slot.wids}
        layout = layout_of(plan.members, node_of)
        if layout is not None:
            self._epoch = (plan.id, list(dict.fromkeys(node_of[w] for w in plan.members)))
            self._layouts[plan.world_size] = layout
            self._links[plan.world_size] = self._links_of(layout, plan.members, node_of)
        return layout

    def _gpu_label(self) -> str:
        """The GPU type the job's rows carry, labelled at the source (#26.2): the type its workers' own devices
        reported when they agree, else the one GRES type Slurm gives its nodes, else `#ELASTIC gpu_type` (default
        `unknown`, which the service resolves for a signed job from Slurm)."""
        device = {self._device_gpu[n] for n in self.fleet.nodes if n in self._device_gpu}
        if len(device) == 1:
            return next(iter(device))
        typed = {t.gpu for t in self.types.nodes.values() if t.gpu}
        if len(typed) == 1 and not self.types.mixed:
            return next(iter(typed))
        return self.config.directives.gpu_type

    def _node_label(self, node: str) -> str:
        """One node's GPU type as its workers' devices reported it (``cpu`` on the CPU), else its Slurm GRES type,
        else ``unknown``: every node of the epoch, helpers' nodes of a grow too (#45.4)."""
        typed = self.types.nodes.get(node)
        return self._device_gpu.get(node) or (typed.gpu if typed is not None and typed.gpu else "unknown")

    def _links_of(self, layout: list[int], members, node_of) -> Links:
        """The links of the current epoch: the flags when given, else from one worker's host facts per node."""
        c = self.config
        if c.intra_link and c.inter_link:
            return Links(c.intra_link, c.inter_link, "flag")
        first: dict[str, str] = {}  # node -> its first member, in the layout's node order
        for w in members:
            first.setdefault(node_of[w], w)
        facts = []
        for node, wid in first.items():
            try:
                key = keys.hosts(wid)
                if self.server.check([key]):
                    facts.append(HostFacts.from_json(self.server.get(key)))
                    if facts[-1].gpu:
                        self._device_gpu[node] = facts[-1].gpu
            except Exception as exc:  # noqa: BLE001 - a store hiccup or an old worker: fewer facts
                log.debug("no host facts of %s: %s", wid, exc)
        found = links_for(layout, facts)
        if c.intra_link or c.inter_link:  # one flag: it wins for its side
            return Links(c.intra_link or found.intra, c.inter_link or found.inter, f"flag and {found.source}")
        return found

    def _register_profile(self) -> None:
        """Once a job: the model its workers built (their `ProgressReporter.publish_profile`), registered under the
        job's own credential when the predictor has no profile of the job's `#ELASTIC model=` yet, so a new model
        is plannable from its next submission without an admin (#45.2). Tried again at the next measurement
        while the service is unreachable; recorded once as `model_profile` with what happened."""
        model = self.config.directives.model
        if self._profile_outcome is not None or not model:
            return
        try:
            if not self.server.check([keys.MODEL_PROFILE]):
                return
            body = json.loads(self.server.get(keys.MODEL_PROFILE))
        except Exception as exc:  # noqa: BLE001 - a store hiccup or a garbled key: no registration, no harm
            log.debug("no model profile from the workers: %s", exc)
            return
        outcome, detail = self.predictor.ensure_profile(dict(body, name=model))   # the name the rows carry
        if outcome == "unreachable":
            return
        self._profile_outcome = outcome
        self.records.write("model_profile", model=model, outcome=outcome, detail=detail,
                           tensors=len(body.get("tensors") or []))

    def _post_observations(self, own: list[dict]) -> None:
        """POST `own` records and the workers' new ones (relabelled) to /v1/observations; fails soft."""
        d = self.config.directives
        # every worker that ever joined, not only the fleet's: a leaver's or a fenced-out worker's last hand-off
        # comes after its node left the fleet (#42); the inbox reads each worker's channel from where it stopped
        wids = {w for slot in self.fleet.nodes.values() for w in slot.wids} | set(self.coord.joined())
        records = own + relabel(self.observations.collect(sorted(wids)), self._layouts, self._links,
                                d.model or "unknown", self._gpu_label(), steps=False)
        records, refused = postable([dict(r, job_id=int(self.job_id)) for r in records])  # its rows answer its plans
        if refused:
            log.warning("dropped %d observation record(s) the service would refuse, e.g. %s", len(refused), refused[0])
            self.records.write("observations_dropped", count=len(refused), first=refused[0])
        for start in range(0, len(records), OBSERVATIONS_PER_POST):
            if not self.predictor.observe(records[start:start + OBSERVATIONS_PER_POST]):
                break

    def _ask_plan(self, m: Measurement, layout: list[int]) -> PlanAdvice:
        """What /v1/plan says about this job's size now (autoscale.PlanAdvice): the planner chooses within the
        node range the directives allow, from where the job runs (`current`). Asked at most every
        PLAN_INTERVAL_S at one size (a plan is stored server-side per call), again after every transition;
        an unreachable service is remembered for as long (the client's circuit breaker skips it anyway)."""
        d = self.config.directives
        if not d.raw_lines:
            return PlanAdvice(None, NO_DIRECTIVES, "no #ELASTIC lines: nothing for /v1/plan to size")
        now = self.clock()
        asked_at, when, cached = self._plan_cache
        if cached is not None and asked_at == m.nodes and now - when < PLAN_INTERVAL_S:
            return cached
        low, high = self.policy.node_range()
        reply = self.predictor.plan({
            "source": "launcher", "directives": list(d.raw_lines),
            "job": {"job_id": int(self.job_id), "min_nodes": low, "max_nodes": high,
                    "tres_per_node": f"gres:gpu:{self.fleet.alloc.gpus_per_node}",
                    "partition": self.fleet.alloc.partition},
            "current": {"layout": layout, "samples_per_s": m.samples_per_s, "per_gpu_batch": d.per_gpu_batch}})
        self._plan_asked = "answered" if reply is not None else self.predictor.last_outcome
        if reply is None:
            why = "no predictor URL configured" if self.predictor.url is None else \
                (self.predictor.last_error or "service unreachable")
            advice = PlanAdvice(None, NOT_CONFIGURED if self.predictor.url is None else UNREACHABLE,
                                " ".join(why.split()))
        else:
            advice = advice_from_plan(reply, m.nodes, self.policy.slots_per_node)
            self.records.write("plan", decision_id=reply.get("decision_id"), action=reply.get("action"),
                               nodes=reply.get("nodes"), reason=reply.get("reason"), target_nodes=advice.nodes)
        self._plan_cache = (m.nodes, now, advice)
        return advice

    def _pending_jobs(self) -> list[PendingJob]:
        return self.fleet.pending(self.slurm)   # Fleet.pending; a seam the tests replace

    def _time_budget(self, facts: dict) -> TimeBudget:
        """The time to the job's end and its steps left (from `facts`, `_steps_and_eta`'s), for the time-limit check
        of voluntary shrinks (#40). The end: SLURM_JOB_END_TIME where Slurm exports it (LaunchConfig.end_time), else
        squeue's EndTime (Slurm 22.05 exports none to the batch step), read at each decision (an operator may extend
        the limit); None where unknown."""
        steps_left = None if facts["total_steps"] is None else max(0, facts["total_steps"] - facts["step"])
        end = self.config.end_time
        if not end:
            try:
                end = float(self.slurm.job(int(self.job_id)).end_time)
            except Exception as exc:  # noqa: BLE001 - Slurm slow or down: the limit is not checked this time
                log.warning("cannot read job %s's end time: %s", self.job_id, exc)
        return TimeBudget(max(0.0, end - self.wall()) if end else None, steps_left)

    def _free_nodes(self) -> list[str]:
        try:
            return [n.name for n in self.slurm.nodes() if n.state == "idle" and n.name not in self.fleet.nodes]
        except Exception as exc:  # Slurm slow or down: no grow this round
            log.warning("cannot list nodes: %s", exc)
            return []

    def _replace_stragglers(self, slow: list[str], compute_by_node: dict[str, float]) -> None:
        self.records.write("decision", source="stragglers", action="shrink", nodes=slow,
                           from_nodes=len(self.fleet.nodes), target_nodes=len(self.fleet.nodes) - len(slow),
                           reason=f"persistently slower: {({n: round(compute_by_node[n], 4) for n in slow})}")
        left = len(self.fleet.nodes) - len(slow)
        self.resizer.request_shrink(left, action="straggler", reason="straggler", prefer=slow)
        for node in slow:
            self.stragglers.forget(node)
        free = [n for n in self._free_nodes() if n not in slow]
        if free:  # queued behind the shrink: the replacement starts once the stragglers are released
            self.resizer.request_grow(left + min(len(slow), len(free)), action="replace",
                                      reason=f"replace {','.join(slow)}", exclude=slow)

    # -- reporting and cleanup --------------------------------------------------------------------------
    def _write_status(self) -> None:
        plan = None if self.phase is JobPhase.STARTING else self.coord.current()  # no epoch before the first plan
        if plan is not None:
            self._current_layout()
        last = self.policy.history_[-1] if self.policy.history_ else None
        progress = self._progress(self._known_wids())
        self.kv.set(keys.STATUS, json.dumps({
            "job": self.job_id, "epoch": plan and plan.id, "world": plan.world_size if plan else 0,
            "nodes": sorted(self.fleet.nodes), "recovering": [r.node for r in self.resizer.recoveries],
            "helpers": self.fleet.helpers, "operator_cap": self.operator_cap, "phase": self.phase.value,
            "resize": self._resize_status(),
            "samples_per_s": None if last is None else round(last.samples_per_s, 3),
            **self._steps_and_eta(progress, last),
            "operator": OPERATOR_RULE if self.operator_cap is None else
            f"holds {self.operator_cap} node(s) until `elastic-launch ctl {self.job_id} --auto`",
            "progress": {w: [p["epoch"], p["step"]] for w, p in progress.items()}}))

    def _steps_and_eta(self, progress: dict, last: Optional[Measurement]) -> dict:
        """``step`` (the furthest worker's committed step), ``total_steps`` (the script's --steps, when its workers
        said), ``eta_s`` (from the last measurement's step time) and ``last_resize`` (the last transition)."""
        step = max((int(p["step"]) for p in progress.values()), default=0)
        total = self._total_steps
        try:
            if total is None and self.server is not None and self.server.check([keys.TOTAL_STEPS]):
                total = self._total_steps = int(self.server.get(keys.TOTAL_STEPS))
        except Exception as exc:  # noqa: BLE001 - a store hiccup: no total this time
            log.debug("no total steps: %s", exc)
        eta = None if total is None or last is None else round(max(0, total - step) * last.step_s, 1)
        moves = [r for r in self.records.items if r["kind"] == "transition" and r.get("action") != "start"]
        resize = None if not moves else {k: moves[-1].get(k) for k in ("action", "from_nodes", "to_nodes", "t")}
        return {"step": step, "total_steps": total, "eta_s": eta, "last_resize": resize}

    def _resize_status(self) -> Optional[dict]:
        op = self.resizer.active if self.resizer is not None else None
        if op is None:
            return None
        return {"action": op.action, "kind": op.kind.value, "state": op.state.value, "target_nodes": op.target,
                "helper": op.helper, "nodes": list(op.nodes), "queued": len(self.resizer.ops) - 1}

    def _known_wids(self) -> list[str]:
        return [w for slot in self.fleet.nodes.values() for w in slot.wids]

    def _summary(self, outcome: str) -> dict:
        items = self.records.items
        return {"job": self.job_id, "outcome": outcome, "final_nodes": len(self.fleet.nodes),
                "transitions": [{k: _rounded(r.get(k)) for k in ("action", "from_nodes", "to_nodes", "idle_s", "pause_s",
                                                                 "wall_s")}
                                for r in items if r["kind"] == "transition"],
                "measurements": sum(r["kind"] == "measurement" for r in items)}

    def _cleanup(self, outcome: str) -> None:
        """Stop our steps, end every helper, unpublish; runs however `run` ends."""
        try:
            self.pool.stop_all()
        except Exception as exc:
            log.warning("stopping workers: %s", exc)
        try:
            self._post_observations([])  # what the workers handed over at their close
        except Exception as exc:
            log.warning("last observations not posted: %s", exc)
        releaser = self.resizer.releaser  # every helper ends the one way: stop key, 3 s, then scancel
        for helper in [*self.fleet.helpers, *releaser.ending]:  # those in a release's grace too: it outlasts us
            releaser.end_helper(helper, f"main job {outcome}", grace_s=HELPER_EXIT_S)
        if not wait_until(lambda: releaser.reap(self.clock()) == 0, timedelta(seconds=HELPER_EXIT_S + 2),
                          interval=0.2):
            releaser.reap(math.inf)  # whatever still runs is scancelled now
        releaser.drain(self.clock, self.sleep)  # Slurm changes still retried through an outage end here
        (self.registry / f"{self.job_id}.json").unlink(missing_ok=True)
        if self.records is not None:
            self.records.write("end", outcome=outcome, nodes=len(self.fleet.nodes))
            try:
                plot = scaling_plot(self.records.items, self.config.run_dir / "scaling.png")
                if plot is not None:
                    log.info("scaling plot: %s", plot)
            except Exception as exc:  # noqa: BLE001 - a plot never fails the job
                log.warning("no scaling plot: %s: %s", type(exc).__name__, exc)
