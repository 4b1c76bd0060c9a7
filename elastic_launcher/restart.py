"""Restart mode (#43): the unchanged script under torchrun's elastic agent, resized by restarting it.

`RestartLauncher` runs in the batch step of the main job, as `controller.Controller` does for in-process jobs, and
shares its parts: the store (torchrun's c10d rendezvous lives in it, under `torch.rendezvous.<run id>`), the worker
steps (`workers.WorkerPool`: one srun step per node, here one torchrun agent each), the helper jobs that grow a job
(`resize.helper_script`, `helper_agent`), their one way to end (`release.Releaser.end_helper`), the operator channel
(`elastic-launch ctl JOBID --nodes N`), the records log and /v1/plan. Its decisions are restart_ops.py's.

What resizes a restart job: an operator (`ctl --nodes N`), a job of the partition pending for nodes it holds beyond
its minimum (given back, as in-process jobs do), and /v1/plan, asked with the measured throughput, the measured
restart cost and the time left (the planner grows it only when the restart pays back: predictor/restart_price.py).
Each restart's measured cost also goes to the service as a `restart` record, what it prices other jobs' restarts with.
Shrinks release helper jobs (the nodes grows added), never the main job's own nodes.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.autoscale import yield_to_pending
from elastic_launcher.control import ControlInbox, beat, serve_store
from elastic_launcher.helper_agent import read_key
from elastic_launcher.launch_config import LaunchConfig
from elastic_launcher.observations import postable
from elastic_launcher.release import Releaser
from elastic_launcher.reporting import PredictorClient, RecordLog
from elastic_launcher.resize import Fleet, NodeSlot, helper_script
from elastic_launcher.resize_ops import ResizeLimits
from elastic_launcher.restart_ops import (RestartAction, RestartLimits, RestartObservation, RestartOp, RestartState,
                                          advance, node_range, step_lines, torchrun_argv)
from elastic_launcher.workers import WorkerPool, step_prefix
from slurm_plugin.errors import SlurmError

log = logging.getLogger("elastic_launcher.restart")
PLAN_INTERVAL_S = 15.0   # /v1/plan is asked at most this often
HELPER_CHECK_S = 2.0     # a growing job asks Slurm whether its helper still lives at most this often
RATE_WINDOW = 8          # step lines at one world size a throughput reading spans (at least)


class StepWatch:
    """Follows the script's step lines in the workers' logs (`worker-*.log` in the run directory, main and helper
    nodes alike): the last `(step, world)` seen, when it was seen (the injected clock), and the throughput in steps/s
    over the lines seen at the current world size."""

    def __init__(self, run_dir: Path, clock: Callable[[], float]):
        self.run_dir, self.clock = run_dir, clock
        self._offsets: dict[Path, int] = {}
        self.last: Optional[tuple[int, int]] = None
        self.before: Optional[tuple[int, int]] = None   # the last (step, world) at the size before the current one
        self.seen: list[tuple[float, int, int]] = []   # (when, step, world) at the current world size

    def poll(self) -> Optional[tuple[int, int]]:
        for path in sorted(self.run_dir.glob("worker-*.log")):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            cut = data.rfind(b"\n") + 1   # whole lines only
            self._offsets[path] = self._offsets.get(path, 0) + cut
            for found in step_lines(data[:cut]):
                self._saw(found)
        return self.last

    def _saw(self, found: tuple[int, int]) -> None:
        if self.last is None or found[1] != self.last[1]:
            self.seen, self.before = [], self.last
        self.last = found
        self.seen = (self.seen + [(self.clock(), *found)])[-RATE_WINDOW * 4:]

    def steps_per_s(self) -> Optional[float]:
        if len(self.seen) < 2 or self.seen[-1][1] - self.seen[0][1] < RATE_WINDOW:
            return None
        (t0, s0, _), (t1, s1, _) = self.seen[0], self.seen[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def newest_mtime(directory: Optional[Path]) -> Optional[float]:
    """The newest modification time (Unix seconds) of `directory`'s entries, None when none."""
    if directory is None or not directory.is_dir():
        return None
    times = [p.stat().st_mtime for p in directory.iterdir()]
    return max(times) if times else None


class RestartLauncher:
    """Runs one restart-mode job (see the module docstring).

    Args:
        config: the frozen launch configuration (`restart=True`).
        registry: where `<job>.json` with the store address is published for `ctl`.
        slurm: the Slurm client; start_step: starts an srun step (slurm_plugin.client's).
        clock / sleep: the monotonic clock the waits are read on and the wait between ticks.
    """

    def __init__(self, config: LaunchConfig, registry: Path, slurm, start_step,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.config, self.registry, self.slurm, self.start_step = config, Path(registry), slurm, start_step
        self.clock, self.sleep = clock, sleep
        self.job_id = str(config.allocation.job_id)
        self.fleet = Fleet(self.job_id, config.allocation, config.slots_per_node)
        d = config.directives
        self.nodes_range = node_range(d.gpus_min, d.gpus_max, self.fleet.slots)
        self.limits = RestartLimits(config.checkpoint_timeout, config.helper_start_timeout + config.rendezvous_timeout)
        self.predictor = PredictorClient(config.predictor_url, config.predictor_token,
                                         config.http_timeout.total_seconds(), job_id=int(self.job_id),
                                         munge_socket=config.munge_socket)
        self.op: Optional[RestartOp] = None
        self.cost_s: Optional[float] = None   # the last restart's measured cost
        self.end_time = config.end_time   # when the job's time limit ends it (Unix s); from Slurm when None
        self.operator_cap: Optional[int] = None
        self._plan_asked = float("-inf")
        self._helper_asked = float("-inf")   # when Slurm was last asked whether the grow's helper still lives
        self._stop_beat = threading.Event()
        # opened by run()
        self.records: Optional[RecordLog] = None
        self.server: Optional[dist.TCPStore] = None
        self.store_addr = ""
        self.kv = self.inbox = self.pool = self.releaser = self.steps = None

    def run(self) -> dict:
        """Start torchrun on every node, resize on request, end with the script; return a summary."""
        cfg = self.config
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.records = RecordLog(cfg.run_dir / "records.jsonl")
        self.server, self.store_addr, self.kv = serve_store(cfg.store_host, cfg.store_port, cfg.store_timeout)
        self.inbox = ControlInbox(self.kv)
        command = torchrun_argv(sys.executable, cfg.command, self.store_addr, f"elastic-{self.job_id}",
                                self.nodes_range, self.fleet.slots, cfg.rendezvous_last_call, cfg.max_restarts)
        self.pool = WorkerPool(command, self.store_addr, self.job_id, self.start_step, cfg.run_dir,
                               stop_timeout=cfg.leave_timeout)
        self.pool.job_env = cfg.directives.worker_env()
        self.releaser = Releaser(self.fleet, self.pool, self.slurm, self.kv, self.records, forget=lambda n: None,
                                 limits=ResizeLimits.from_config(cfg), clock=self.clock)
        self.steps = StepWatch(cfg.run_dir, self.clock)
        self.registry.mkdir(parents=True, exist_ok=True)
        (self.registry / f"{self.job_id}.json").write_text(json.dumps(
            {"job": self.job_id, "host": cfg.store_host, "port": self.server.port, "run_dir": str(cfg.run_dir)}))
        beater = threading.Thread(target=beat, args=(self.store_addr, cfg.store_timeout, self._stop_beat),
                                  name="elastic-heartbeat", daemon=True)
        beater.start()
        self.records.write("start", job=self.job_id, mode="restart", nodes=list(self.fleet.alloc.nodes),
                           nnodes=list(self.nodes_range), store=self.store_addr, command=command)
        for node in self.fleet.alloc.nodes:
            step = self.pool.start(node, 1, self.fleet.alloc.env, owner_job=self.job_id)
            self.fleet.nodes[node] = NodeSlot(node, self.job_id, step_prefix(step.group))
        outcome = "failed"
        try:
            while (ended := self._tick()) is None:
                self.sleep(cfg.poll_interval.total_seconds())
            outcome = ended
            return {"job": self.job_id, "mode": "restart", "outcome": outcome, "final_nodes": len(self.fleet.nodes),
                    "transitions": [{k: r.get(k) for k in ("action", "from_nodes", "to_nodes", "cost_s",
                                                           "checkpointed")}
                                    for r in self.records.items if r["kind"] == "transition"]}
        finally:
            self._cleanup(outcome)
            self._stop_beat.set()
            beater.join(timeout=5)

    # -- one tick ---------------------------------------------------------------------------------------
    def _tick(self) -> Optional[str]:
        main = [s for s in self.pool.steps.values() if s.owner_job == self.job_id]
        if main and not any(s.alive() for s in main):   # the agents end with the script (or give up)
            return "completed" if all(s.returncode() == 0 for s in main) else "failed"
        self.releaser.tick()
        self.steps.poll()
        for seq, request in self.inbox.poll():
            self._operator(seq, request)
        if self.op is not None:
            self._advance()
        elif self.config.autoscale:
            self._autoscale()
        self._write_status()
        return None

    def _operator(self, seq: int, request: dict) -> None:
        nodes = request.get("nodes")
        if nodes == "auto":
            self.operator_cap = None
            self.inbox.reply(seq, True, "the planner decides again")
            return
        low, high = self.nodes_range
        if not isinstance(nodes, int) or not low <= nodes <= high:
            self.inbox.reply(seq, False, f"nodes must be in {low}..{high} (the job's #ELASTIC gpus bounds), "
                                         f"got {nodes!r}")
            return
        if self.op is not None:
            self.inbox.reply(seq, False, f"a {self.op.action} is in flight ({self.op.state.value}); ask again")
            return
        self.operator_cap = nodes
        ok, message = self.request(nodes, "operator", f"operator asked for {nodes} node(s)")
        self.inbox.reply(seq, ok, message)

    def request(self, nodes: int, action: str, reason: str) -> tuple[bool, str]:
        """Start a restart resize to `nodes`: SIGUSR1 to every worker now, the change once it checkpointed."""
        now_nodes = len(self.fleet.nodes)
        if nodes == now_nodes:
            return True, f"already on {nodes} node(s)"
        if nodes < now_nodes and not self.fleet.helpers:
            return False, "only nodes added by a grow can be released (the main job's stay)"
        for node in list(self.fleet.nodes):
            self.pool.signal_step(node, signal.SIGUSR1)
        self.op = RestartOp(grow=nodes > now_nodes, target=nodes, world=nodes * self.fleet.slots,
                            from_nodes=now_nodes, action=action, reason=reason, signalled=self.clock())
        self.records.write("decision", action="grow" if self.op.grow else "shrink", source=action,
                           from_nodes=now_nodes, target_nodes=nodes, reason=reason)
        return True, f"{'grow' if self.op.grow else 'shrink'} to {nodes} node(s): checkpoint signal sent"

    def _advance(self) -> None:
        op, cfg = self.op, self.config
        mtime = newest_mtime(cfg.checkpoint_dir)
        ended = False
        if op.helper is not None and self.clock() - self._helper_asked >= HELPER_CHECK_S:
            self._helper_asked = self.clock()
            ended = self.releaser.helper_gone(op.helper)
        obs = RestartObservation(checkpoint_at=None if mtime is None else self.clock() - (time.time() - mtime),
                                 world=None if self.steps.last is None else self.steps.last[1], helper_ended=ended)
        op, actions = advance(op, obs, self.clock(), self.limits)
        for action in actions:
            if action is RestartAction.CHANGE:
                op = self._change(op)
            elif action is RestartAction.RECORD:
                self.cost_s = op.cost_s
                before = self.steps.before
                cost = {"from_nodes": op.from_nodes, "to_nodes": len(self.fleet.nodes), "world": op.world,
                        "cost_s": op.cost_s, "checkpoint_s": round(op.changed - op.signalled, 3),
                        "checkpointed": op.checkpointed}
                self.records.write("transition", action=op.action, mode="restart", **cost, posted=self._post(cost),
                                   step=self.steps.seen[0][1], reason=op.reason, helper=op.helper,
                                   # steps trained at the old size after the checkpoint the restart resumed from
                                   steps_redone=None if before is None else before[0] - (self.steps.seen[0][1] - 1))
            elif action is RestartAction.FAIL:
                self.records.write("resize_failed", action=op.action, error=op.error, helper=op.helper)
                if op.grow and op.helper in self.fleet.helpers:
                    self.releaser.end_helper(op.helper, f"grow failed: {op.error}", grace_s=5.0)
        self.op = None if op.done else op

    def _post(self, cost: dict) -> bool:
        """The restart's measured cost to the service, a `restart` record (the planner prices other jobs' restarts
        with it, predictor/restart_price.py); whether it was stored."""
        model = self.config.directives.model
        kept, refused = postable([{"kind": "restart", **cost, "job_id": int(self.job_id), "timestamp_s": time.time(),
                                   **({"profile": model} if model else {})}])
        if refused:
            log.warning("job %s: restart record not posted: %s", self.job_id, refused[0])
        return bool(kept) and self.predictor.observe(kept)

    def _change(self, op: RestartOp) -> RestartOp:
        cfg = self.config
        if not op.grow:
            for helper in sorted(self.fleet.helpers, key=int, reverse=True):
                if len(self.fleet.nodes) <= op.target:
                    break
                if not self.fleet.helpers[helper]:   # its agent has not said which nodes it holds yet
                    continue
                for node in self.fleet.helpers[helper]:
                    self.fleet.nodes.pop(node, None)
                # scancel now: Slurm's SIGTERM reaches the leavers' agents and workers at once, the script saves and
                # stops with its peers (the template's SIGTERM pattern), instead of training on through a grace
                self.releaser.end_helper(helper, op.reason, grace_s=0.0)
            return dataclasses.replace(op, world=len(self.fleet.nodes) * self.fleet.slots)
        count = op.target - len(self.fleet.nodes)
        script = helper_script(self.job_id, count, self.fleet.alloc.gpus_per_node, self.fleet.alloc.partition,
                               list(self.fleet.nodes), self.store_addr, 1, cfg.helper_orphan_timeout, cfg.run_dir,
                               self.pool.command, Path(os.getcwd()))
        try:
            helper = str(self.slurm.submit(script))
        except SlurmError as exc:
            log.warning("job %s: helper submission failed: %s", self.job_id, exc)
            return dataclasses.replace(op, state=RestartState.FAILED, error=f"helper submission failed: {exc}")
        self.fleet.helpers[helper] = []
        self.records.write("helper_submitted", helper=helper, nodes=count, reason=op.reason)
        return dataclasses.replace(op, helper=helper)

    def _autoscale(self) -> None:
        """A pending job's nodes back first; else, at most every PLAN_INTERVAL_S, what /v1/plan says."""
        nodes = len(self.fleet.nodes)
        if self.config.yield_to_pending and self.fleet.helpers:
            decision = yield_to_pending(nodes, self.nodes_range[0], len(self._idle()), self.fleet.pending(self.slurm))
            if decision is not None:
                self.request(decision.target_nodes, "yield", decision.reason)
                return
        if self.operator_cap is not None or self.clock() - self._plan_asked < PLAN_INTERVAL_S:
            return
        rate, d = self.steps.steps_per_s(), self.config.directives
        if rate is None or not d.raw_lines or self.steps.last is None:
            return
        self._plan_asked = self.clock()
        world = self.steps.last[1]
        current = {"layout": [self.fleet.slots] * nodes, "samples_per_s": rate * d.per_gpu_batch * world,
                   "per_gpu_batch": d.per_gpu_batch}
        if self.cost_s is not None:   # until measured, the planner prices a restart with its default
            current["restart_cost_s"] = self.cost_s
        if self.end_time is None:
            self.end_time = self._slurm_end_time()
        if self.end_time:
            current["remaining_s"] = max(0.0, self.end_time - time.time())
        low, high = self.nodes_range
        reply = self.predictor.plan({"source": "launcher", "directives": list(d.raw_lines), "current": current,
                                     "job": {"job_id": int(self.job_id), "min_nodes": low, "max_nodes": high,
                                             "tres_per_node": f"gres:gpu:{self.fleet.alloc.gpus_per_node}",
                                             "partition": self.fleet.alloc.partition}})
        if reply is None:
            return
        self.records.write("plan", decision_id=reply.get("decision_id"), action=reply.get("action"),
                           nodes=reply.get("nodes"), reason=reply.get("reason"), current=current)
        target = reply.get("nodes")
        if reply.get("action") == "rewrite" and isinstance(target, int) and target != nodes:
            target = min(target, nodes + len(self._idle())) if target > nodes else target
            if target != nodes:
                self.request(target, "plan", reply.get("reason") or "the planner")

    def _slurm_end_time(self) -> Optional[float]:
        """The job's end as Slurm plans it (Slurm 22.05 does not export SLURM_JOB_END_TIME); 0.0 when Slurm does not
        say, None while it cannot be asked (asked again at the next plan)."""
        try:
            return float(self.slurm.job(int(self.job_id)).end_time)
        except Exception as exc:  # noqa: BLE001 - Slurm slow or down: the plan goes without the time left
            log.warning("cannot read job %s's end time: %s", self.job_id, exc)
            return None

    def _idle(self) -> list[str]:
        try:
            return [n.name for n in self.slurm.nodes() if n.state == "idle" and n.name not in self.fleet.nodes]
        except Exception as exc:  # noqa: BLE001 - Slurm slow or down: no grow this round
            log.warning("cannot list nodes: %s", exc)
            return []

    def _write_status(self) -> None:
        for helper, nodes in self.fleet.helpers.items():   # a helper's nodes once its agent reported them
            if not nodes:
                status = read_key(self.kv, keys.helper_status(helper))
                if status is not None:
                    self.fleet.helpers[helper] = list(json.loads(status).get("nodes") or [])
                    for node in self.fleet.helpers[helper]:
                        self.fleet.nodes[node] = NodeSlot(node, helper, "")
        last = self.steps.last
        self.kv.set(keys.STATUS, json.dumps({
            "job": self.job_id, "mode": "restart", "phase": "resizing" if self.op else "running",
            "nodes": sorted(self.fleet.nodes), "helpers": self.fleet.helpers, "step": last and last[0],
            "world": last and last[1], "restart_cost_s": self.cost_s, "operator_cap": self.operator_cap,
            "resize": None if self.op is None else {"action": self.op.action, "state": self.op.state.value,
                                                    "target_nodes": self.op.target, "helper": self.op.helper}}))

    def _cleanup(self, outcome: str) -> None:
        try:
            self.pool.stop_all()
        except Exception as exc:  # noqa: BLE001 - the end goes on
            log.warning("stopping workers: %s", exc)
        for helper in [*self.fleet.helpers, *self.releaser.ending]:
            self.releaser.end_helper(helper, f"main job {outcome}", grace_s=3.0)
        deadline = self.clock() + 5.0
        while self.releaser.reap(self.clock()) and self.clock() < deadline:
            self.sleep(0.2)
        self.releaser.reap(float("inf"))
        self.releaser.drain(self.clock, self.sleep)
        (self.registry / f"{self.job_id}.json").unlink(missing_ok=True)
        self.records.write("end", outcome=outcome, nodes=len(self.fleet.nodes))
