"""The elastic controller: runs in the batch step of the main job and decides the job's size.

Two parts:
- `AutoscalePolicy`: pure decisions from measured throughput (Or et al.'s scaling-efficiency test,
  the predictor's plan when there is one, and the limits from the directives). No I/O; unit-tested.
- `Controller`: the loop. It owns the rendezvous store, starts workers (workers.py), measures the
  throughput at each size, posts observations and asks /v1/plan (predictor_client), applies the
  policy, operator requests and failure handling through resize.py, and logs every decision and
  measurement as a record (logger `elastic_launcher.records` and `run_dir/records.jsonl`).

Throughput scaling efficiency (Or et al.), going from k to k+d workers with throughputs T_k, T_{k+d}:
    s = (T_{k+d} - T_k) / (d * T_k / k)          1 = perfect, 0 = no gain, < 0 = slower.
A grow is kept when s >= min_efficiency; otherwise it is reverted and no size at or above the one that
did not pay is tried again (the ceiling).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import requests
import torch.distributed as dist

from elastic_launcher.helper_agent import HEARTBEAT_KEY, helper_key, read_key
from elastic_launcher.launch_config import LaunchConfig
from elastic_launcher.membership import Coordinator
from elastic_launcher.resize import LAUNCHER_PREFIX, ControlInbox, NodeSlot, Transitions, wait_until
from elastic_launcher.stragglers import StragglerDetector
from elastic_launcher.workers import WorkerPool


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Throughput measured at one size.

    Attributes:
        nodes: nodes in the membership when measured.
        workers: workers (GPU slots) in the membership.
        samples_per_s: committed samples per second over the window.
        step_s: mean wall time per committed step over the window.
    """

    nodes: int
    workers: int
    samples_per_s: float
    step_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the policy wants next.

    Attributes:
        action: "keep" | "grow" | "revert" | "shrink".
        target_nodes: node count to move to (the current one for keep).
        reason: one line for the records and the operator.
        efficiency: the scaling efficiency that led to it, when one was computed.
    """

    action: str
    target_nodes: int
    reason: str
    efficiency: Optional[float] = None


def scaling_efficiency(before: Measurement, after: Measurement) -> float:
    """Or et al.'s throughput scaling efficiency from `before` (k workers) to `after` (k+d workers).

    Raises:
        ValueError: when the worker counts are equal or the `before` throughput is not positive.
    """
    k, d = before.workers, after.workers - before.workers
    if d == 0:
        raise ValueError(f"scaling_efficiency: both measurements have {k} workers")
    if before.samples_per_s <= 0:
        raise ValueError(f"scaling_efficiency: throughput at {k} workers is {before.samples_per_s}")
    return (after.samples_per_s - before.samples_per_s) / (d * before.samples_per_s / k)


class AutoscalePolicy:
    """Grow while it pays; revert a grow that did not.

    Args:
        min_efficiency: a grow is kept when its scaling efficiency is at least this.
        max_global_batch: workers * per_gpu_batch must stay at or below this when growing.
        per_gpu_batch: samples per worker per step.
        slots_per_node: workers per node.
        min_workers / max_workers: bounds on workers from `#ELASTIC gpus=MIN-MAX`.
        grow_step_nodes: nodes added by one grow.

    State (set by `record`): `history_` (measurements in the order taken), `ceiling_nodes_` (smallest node
    count that was tried and did not pay; None before any revert).
    """

    def __init__(self, min_efficiency: float = 0.7, max_global_batch: int = 1 << 24, per_gpu_batch: int = 32,
                 slots_per_node: int = 1, min_workers: int = 1, max_workers: int = 4096, grow_step_nodes: int = 1):
        self.min_efficiency = min_efficiency
        self.max_global_batch = max_global_batch
        self.per_gpu_batch = per_gpu_batch
        self.slots_per_node = slots_per_node
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.grow_step_nodes = grow_step_nodes
        self.history_: list[Measurement] = []
        self.ceiling_nodes_: Optional[int] = None

    def record(self, measurement: Measurement) -> None:
        """Add the measurement at the current size (call once per measurement window)."""
        self.history_.append(measurement)

    def max_nodes(self) -> int:
        """Largest node count allowed by the directives, the global batch cap and the ceiling."""
        by_batch = self.max_global_batch // (self.per_gpu_batch * self.slots_per_node)
        by_gpus = self.max_workers // self.slots_per_node
        limit = min(by_batch, by_gpus)
        if self.ceiling_nodes_ is not None:
            limit = min(limit, self.ceiling_nodes_ - 1)
        return max(limit, 0)

    def min_nodes(self) -> int:
        return max(1, -(-self.min_workers // self.slots_per_node))

    def _last_step(self) -> tuple[Optional[Measurement], Optional[Measurement]]:
        """The latest measurement and the one before it at a different size (None when absent)."""
        if not self.history_:
            return None, None
        current = self.history_[-1]
        for earlier in reversed(self.history_[:-1]):
            if earlier.nodes != current.nodes:
                return current, earlier
        return current, None

    def decide(self, free_nodes: int, plan_nodes: Optional[int] = None) -> Decision:
        """Decide from the latest measurement.

        Args:
            free_nodes: idle nodes a grow could get now.
            plan_nodes: node count /v1/plan suggests (None: service unreachable or `keep`); the policy
                grows toward it but never past its own limits, and falls back to its heuristic without it.

        Preconditions: `record` was called at the current size.
        """
        current, before = self._last_step()
        if current is None:
            return Decision("keep", 0, "no measurement yet")
        efficiency = None
        if before is not None and current.nodes > before.nodes:
            efficiency = scaling_efficiency(before, current)
            if efficiency < self.min_efficiency:
                self.ceiling_nodes_ = current.nodes if self.ceiling_nodes_ is None else min(self.ceiling_nodes_,
                                                                                             current.nodes)
                target = max(before.nodes, self.min_nodes())
                return Decision("revert", target, f"grow {before.nodes}->{current.nodes} nodes did not pay: "
                                f"efficiency {efficiency:.2f} < {self.min_efficiency:.2f}", efficiency)
        if current.nodes > self.max_nodes() and current.nodes > self.min_nodes():
            target = max(self.max_nodes(), self.min_nodes())
            return Decision("shrink", target, f"{current.nodes} nodes is above the limit {self.max_nodes()}",
                            efficiency)
        limit = min(self.max_nodes(), current.nodes + free_nodes)
        want = current.nodes + self.grow_step_nodes if plan_nodes is None else plan_nodes
        target = min(want, limit, current.nodes + self.grow_step_nodes)
        if target <= current.nodes:
            why = self._why_not(current, free_nodes, plan_nodes, efficiency)
            return Decision("keep", current.nodes, why, efficiency)
        source = "heuristic" if plan_nodes is None else f"plan says {plan_nodes} nodes"
        paid = "" if efficiency is None else f", last grow efficiency {efficiency:.2f}"
        return Decision("grow", target, f"{source}; global batch {target * self.slots_per_node * self.per_gpu_batch}"
                        f" <= {self.max_global_batch}{paid}", efficiency)

    def _why_not(self, current: Measurement, free_nodes: int, plan_nodes: Optional[int],
                 efficiency: Optional[float]) -> str:
        if plan_nodes is not None and plan_nodes <= current.nodes:
            return f"plan says {plan_nodes} nodes"
        if self.ceiling_nodes_ is not None and current.nodes + 1 >= self.ceiling_nodes_:
            return f"{self.ceiling_nodes_} nodes did not pay before"
        if current.nodes >= self.max_nodes():
            return f"at the limit of {self.max_nodes()} nodes (max_global_batch / gpus)"
        if free_nodes <= 0:
            return "no free nodes"
        return "grow step does not fit"


log = logging.getLogger("elastic_launcher.controller")
# At one size, /v1/plan is asked at most this often (seconds).
PLAN_INTERVAL_S = 15.0
records_log = logging.getLogger("elastic_launcher.records")


class RecordLog:
    """Decisions, measurements and transitions: one JSON line each in `records.jsonl` and a log record."""

    def __init__(self, path: Path):
        self.path = path
        self.items: list[dict] = []

    def write(self, kind: str, **fields) -> dict:
        record = {"kind": kind, "t": round(time.time(), 3), **fields}
        self.items.append(record)
        with open(self.path, "a") as out:
            out.write(json.dumps(record, sort_keys=True) + "\n")
        records_log.info("%s", json.dumps(record, sort_keys=True), extra={"record": record})
        return record


class PredictorClient:
    """POST /v1/observations and /v1/plan with a per-request timeout and a circuit breaker.

    Never raises: when the service is unset, unreachable or answers garbage, `plan` returns None and the
    controller falls back to its own measured-efficiency heuristic; the breaker then skips the service for
    `cooldown_s`.
    """

    def __init__(self, url: Optional[str], token: Optional[str], timeout_s: float, cooldown_s: float = 30.0):
        self.url = url.rstrip("/") if url else None
        self.token = token
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self._open_until = 0.0
        self.last_error: Optional[str] = None

    def _post(self, path: str, body) -> Optional[dict]:
        if self.url is None or time.monotonic() < self._open_until:
            return None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            reply = requests.post(self.url + path, json=body, headers=headers, timeout=self.timeout_s)
            if reply.status_code >= 400:
                raise ValueError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            return reply.json()
        except (requests.RequestException, ValueError) as exc:
            self.last_error = f"{path}: {exc}"
            self._open_until = time.monotonic() + self.cooldown_s
            log.warning("predictor %s unavailable (%s); using the launcher heuristic", self.url, exc)
            return None

    def observe(self, records: list[dict]) -> bool:
        return bool(records) and self._post("/v1/observations", records) is not None

    def plan(self, body: dict) -> Optional[dict]:
        reply = self._post("/v1/plan", body)
        return reply if isinstance(reply, dict) and reply.get("action") in ("keep", "rewrite") else None


class Controller(Transitions):
    """Runs one elastic job from the batch step (see the module docstring).

    Args:
        config: the frozen launch configuration.
        registry: directory where `<job>.json` with the store address is published for `ctl`.
        slurm: the Slurm client (slurm_plugin.client.CommandBackend or a fake with the same methods).
        start_step: starts an srun step (slurm_plugin.client.start_step or a fake).
    """

    def __init__(self, config: LaunchConfig, registry: Path, slurm, start_step):
        self.config = config
        self.registry = Path(registry)
        self.slurm = slurm
        self.start_step = start_step
        self.job_id = str(config.allocation.job_id)
        self.alloc = config.allocation
        self.slots = config.slots_per_node
        d = config.directives
        self.policy = AutoscalePolicy(d.min_efficiency, d.max_global_batch, d.per_gpu_batch, self.slots,
                                      d.gpus_min, d.gpus_max, config.grow_step_nodes)
        self.stragglers = StragglerDetector(config.straggler_ratio, config.straggler_windows,
                                            protected=frozenset({self.alloc.batch_host}))
        self.predictor = PredictorClient(config.predictor_url, config.predictor_token,
                                         config.http_timeout.total_seconds())
        self.nodes: dict[str, NodeSlot] = {}
        self.helpers: dict[str, list[str]] = {}  # helper job id -> its nodes
        self.failures_in_a_row = 0
        self.operator_cap: Optional[int] = None
        self._last_keep: Optional[str] = None
        self._plan_cache: tuple = (None, 0.0, None)  # (nodes asked at, when, plan's node count)
        self.records: Optional[RecordLog] = None
        self._stop_beat = threading.Event()

    # -- lifecycle -----------------------------------------------------------------------------------
    def run(self) -> dict:
        """Start the workers, steer the job until they finish, clean up; return a summary.

        Raises:
            ElasticError: the initial rendezvous failed, or `max_failures` failures in a row.
        """
        cfg = self.config
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.records = RecordLog(cfg.run_dir / "records.jsonl")
        self.server = dist.TCPStore(cfg.store_host, cfg.store_port, is_master=True, wait_for_workers=False,
                                    timeout=cfg.store_timeout)
        self.store_addr = f"{cfg.store_host}:{self.server.port}"
        self.kv = dist.PrefixStore(LAUNCHER_PREFIX, self.server)
        self.coord = Coordinator(self.server, timeout=cfg.rendezvous_timeout)
        self.inbox = ControlInbox(self.kv)
        self.pool = WorkerPool(cfg.command, self.store_addr, self.job_id, self.start_step, cfg.run_dir,
                               stop_timeout=cfg.leave_timeout)
        self._publish()
        beat = threading.Thread(target=self._beat, name="elastic-heartbeat", daemon=True)
        beat.start()
        self.records.write("start", job=self.job_id, nodes=list(self.alloc.nodes), slots=self.slots,
                           store=self.store_addr, config=json.loads(cfg.to_json()))
        outcome = "failed"
        try:
            self._start_initial()
            outcome = self._loop()
            return self._summary(outcome)
        finally:
            self._cleanup(outcome)
            self._stop_beat.set()
            beat.join(timeout=5)

    def _publish(self) -> None:
        self.registry.mkdir(parents=True, exist_ok=True)
        host, port = self.store_addr.rsplit(":", 1)
        (self.registry / f"{self.job_id}.json").write_text(json.dumps(
            {"job": self.job_id, "host": host, "port": int(port), "run_dir": str(self.config.run_dir)}))

    def _beat(self) -> None:
        """Bump the heartbeat the helper agents watch (own store client: the loop may block)."""
        host, port = self.store_addr.rsplit(":", 1)
        kv = dist.PrefixStore(LAUNCHER_PREFIX, dist.TCPStore(host, int(port), is_master=False,
                                                             timeout=self.config.store_timeout))
        while not self._stop_beat.wait(0.5):
            try:
                kv.add(HEARTBEAT_KEY, 1)
            except Exception as exc:  # the store closes at exit
                log.debug("heartbeat stops: %s", exc)
                return

    def _start_initial(self) -> None:
        for node in self.alloc.nodes:
            step = self.pool.start(node, self.slots, self.alloc.env, owner_job=self.job_id)
            self.nodes[node] = NodeSlot(node, self.job_id, step.group + "-")
        wids = self._wait_joined(list(self.alloc.nodes))
        plan = self.coord.start(wids)
        t0 = time.monotonic()
        stats = self._wait_switched(plan)
        self.records.write("transition", action="start", epoch=plan.id, from_nodes=0,
                           to_nodes=len(self.nodes), world=plan.world_size, first_step_s=round(time.monotonic() - t0, 3),
                           stats=stats)
        self._measure_reset()

    # -- the loop ------------------------------------------------------------------------------------
    def _loop(self) -> str:
        while True:
            self._write_status()
            finished = self._finished()
            if finished:
                return finished
            self._handle_failures()
            for seq, request in self.inbox.poll():
                self._handle_request(seq, request)
            self._measure_and_decide()
            time.sleep(self.config.poll_interval.total_seconds())

    def _main_steps(self):
        return [s for s in self.pool.steps.values() if s.owner_job == self.job_id]

    def _finished(self) -> Optional[str]:
        """'completed' when every worker step of the main job ended with status 0, 'failed' when all ended."""
        steps = self._main_steps()
        if not steps or any(s.alive() for s in steps):
            return None
        codes = [s.returncode() for s in steps]
        return "completed" if all(c == 0 for c in codes) else "failed"

    def _helper_status(self, helper: str) -> dict:
        text = read_key(self.kv, helper_key(helper, "status"))
        return json.loads(text) if text else {}

    def _handle_failures(self) -> None:
        """A node failed when its step ended non-zero while it is a member, or when a recovery epoch left
        all its workers out although their step still runs (hung workers the survivors declared dead)."""
        failed = [s.node for s in self._main_steps()
                  if not s.alive() and s.returncode() != 0 and not s.leaving and s.node in self.nodes]
        for helper, nodes in list(self.helpers.items()):
            steps = self._helper_status(helper).get("steps", {})
            failed += [n for n in nodes if steps.get(n) not in (None, 0) and n in self.nodes]
        members = set(self.coord.current().members)
        evicted = [n for n, slot in self.nodes.items() if slot.wids and not set(slot.wids) & members]
        for node in dict.fromkeys(failed + evicted):
            if node in self.nodes:
                self._node_failed(node, evicted=node not in failed)

    def _handle_request(self, seq: int, request: dict) -> None:
        target = request.get("nodes")
        have = len(self.nodes)
        if not isinstance(target, int) or target < 1:
            self.inbox.reply(seq, False, f"'nodes' must be a positive integer, got {target!r}")
            return
        if target == have:
            self.operator_cap = target
            self.inbox.reply(seq, True, f"already on {have} nodes", target_nodes=target)
            return
        if target < self.policy.min_nodes():
            self.inbox.reply(seq, False, f"{target} nodes is below the job's minimum of {self.policy.min_nodes()}")
            return
        self.operator_cap = target
        self.inbox.reply(seq, True, f"resizing from {have} to {target} nodes", target_nodes=target)
        self.records.write("decision", source="operator", action="grow" if target > have else "shrink",
                           from_nodes=have, target_nodes=target, reason=f"elastic-launch ctl {self.job_id} "
                           f"--nodes {target}")
        if target < have:
            self._shrink_to(target, action="shrink", reason="operator request")
        else:
            self._grow(target - have, action="grow", reason="operator request")

    # -- measurement and autoscaling --------------------------------------------------------------------
    def _progress(self, wids) -> dict[str, dict]:
        out = {}
        for wid in wids:
            key = f"{LAUNCHER_PREFIX}/progress/{wid}"
            if self.server.check([key]):
                out[wid] = json.loads(self.server.get(key))
        return out

    def _measure_reset(self) -> None:
        self._window: dict = {"epoch": None, "first": None, "start": None}

    def _measure(self) -> Optional[tuple[Measurement, dict[str, float]]]:
        """The throughput and per-node compute time over the current window, once it is complete."""
        plan = self.coord.current()
        progress = self._progress(plan.members)
        head = progress.get(plan.members[0])
        win = self._window
        if head is None or head["epoch"] != plan.id:
            return None
        if win["epoch"] != plan.id:
            win.update(epoch=plan.id, first=head["step"], start=None)
        if win["start"] is None:
            if head["step"] >= win["first"] + self.config.warmup_steps and len(progress) == len(plan.members):
                win["start"] = progress
            return None
        start = win["start"]
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
        if self.config.test_throughput == "linear":  # TEST POLICY KNOB (see LaunchConfig.test_throughput)
            base = self.policy.history_[0] if self.policy.history_ else None
            sps = sps if base is None else base.samples_per_s / base.workers * workers
        win.update(start=progress)
        m = Measurement(nodes=len(self.nodes), workers=workers, samples_per_s=sps, step_s=elapsed / steps)
        return m, {node: sum(v) / len(v) for node, v in per_node.items()}

    def _measure_and_decide(self) -> None:
        result = self._measure()
        if result is None:
            return
        m, compute_by_node = result
        self.failures_in_a_row = 0
        self.policy.record(m)
        self.records.write("measurement", nodes=m.nodes, workers=m.workers, samples_per_s=round(m.samples_per_s, 3),
                           step_s=round(m.step_s, 4), compute_s_by_node={k: round(v, 4) for k, v in
                                                                         compute_by_node.items()})
        layout = [self.slots] * m.nodes
        self.predictor.observe([{"kind": "step", "profile": self.config.directives.model or "unknown",
                                 "gpu": self.config.directives.gpu_type, "layout": layout, "intra_link": "shm",
                                 "inter_link": "socket", "per_gpu_batch": self.config.directives.per_gpu_batch,
                                 "iter_s": m.step_s}])
        if not self.config.directives.elastic:
            return
        slow = self.stragglers.observe(compute_by_node)
        if slow:  # stragglers are handled like failures, also with --no-autoscale
            self._replace_stragglers(slow, compute_by_node)
            return
        if not self.config.autoscale:
            return
        plan_nodes = self._ask_plan(m, layout)
        free = self._free_nodes()
        decision = self.policy.decide(len(free), plan_nodes)
        cap = self.operator_cap
        if decision.action == "grow" and cap is not None and decision.target_nodes > cap:
            decision = Decision("grow", cap, f"{decision.reason}; capped at the operator's {cap} nodes",
                                decision.efficiency) if cap > m.nodes else \
                Decision("keep", m.nodes, f"operator asked for {cap} nodes", decision.efficiency)
        if decision.action == "keep" and decision.reason == self._last_keep:
            return  # an unchanged "keep" is not logged again (the measurement is)
        self._last_keep = decision.reason if decision.action == "keep" else None
        self.records.write("decision", source="autoscale", action=decision.action, from_nodes=m.nodes,
                           target_nodes=decision.target_nodes, reason=decision.reason,
                           efficiency=decision.efficiency, plan_nodes=plan_nodes, free_nodes=len(free),
                           predictor=self.predictor.url is not None and self.predictor.last_error is None)
        if decision.action == "grow":
            self._grow(decision.target_nodes - m.nodes, action="grow", reason=decision.reason)
        elif decision.action in ("revert", "shrink") and decision.target_nodes < m.nodes:
            self._shrink_to(decision.target_nodes, action=decision.action, reason=decision.reason)

    def _ask_plan(self, m: Measurement, layout: list[int]) -> Optional[int]:
        """The predictor's node count for this job now (None: no plan); asked at most every PLAN_INTERVAL
        at one size, again after every transition (a plan is stored server-side per call)."""
        d = self.config.directives
        now = time.monotonic()
        if not d.raw_lines or (self._plan_cache[0] == m.nodes and now - self._plan_cache[1] < PLAN_INTERVAL_S):
            return self._plan_cache[2] if self._plan_cache[0] == m.nodes else None
        self._plan_cache = (m.nodes, now, None)
        reply = self.predictor.plan({
            "source": "launcher", "directives": list(d.raw_lines),
            "job": {"job_id": int(self.job_id), "min_nodes": m.nodes, "max_nodes": m.nodes,
                    "tres_per_node": f"gres:gpu:{self.alloc.gpus_per_node}", "partition": self.alloc.partition},
            "current": {"layout": layout, "samples_per_s": m.samples_per_s, "per_gpu_batch": d.per_gpu_batch}})
        if reply is None:
            return None
        self.records.write("plan", decision_id=reply.get("decision_id"), action=reply.get("action"),
                           nodes=reply.get("nodes"), reason=reply.get("reason"))
        nodes = int(reply["nodes"]) if reply.get("action") == "rewrite" and reply.get("nodes") else None
        self._plan_cache = (m.nodes, now, nodes)
        return nodes

    def _free_nodes(self) -> list[str]:
        try:
            return [n.name for n in self.slurm.nodes() if n.state == "idle" and n.name not in self.nodes]
        except Exception as exc:  # Slurm slow or down: no grow this round
            log.warning("cannot list nodes: %s", exc)
            return []

    def _replace_stragglers(self, slow: list[str], compute_by_node: dict[str, float]) -> None:
        self.records.write("decision", source="stragglers", action="shrink", nodes=slow,
                           from_nodes=len(self.nodes), target_nodes=len(self.nodes) - len(slow),
                           reason=f"persistently slower: {({n: round(compute_by_node[n], 4) for n in slow})}")
        self._shrink_to(len(self.nodes) - len(slow), action="straggler", reason="straggler", prefer=slow)
        for node in slow:
            self.stragglers.forget(node)
        free = [n for n in self._free_nodes() if n not in slow]
        if free:
            self._grow(min(len(slow), len(free)), action="replace", reason=f"replace {','.join(slow)}",
                       exclude=slow)

    # -- reporting and cleanup --------------------------------------------------------------------------
    def _write_status(self) -> None:
        plan = self.coord.current()
        last = self.policy.history_[-1] if self.policy.history_ else None
        self.kv.set("status", json.dumps({
            "job": self.job_id, "epoch": plan.id, "world": plan.world_size, "nodes": sorted(self.nodes),
            "helpers": self.helpers, "operator_cap": self.operator_cap,
            "samples_per_s": None if last is None else round(last.samples_per_s, 3),
            "progress": {w: [p["epoch"], p["step"]] for w, p in self._progress(self._known_wids()).items()}}))

    def _known_wids(self) -> list[str]:
        return [w for slot in self.nodes.values() for w in slot.wids]

    def _summary(self, outcome: str) -> dict:
        items = self.records.items
        return {"job": self.job_id, "outcome": outcome, "final_nodes": len(self.nodes),
                "transitions": [{k: r.get(k) for k in ("action", "from_nodes", "to_nodes", "idle_s", "pause_s", "wall_s")}
                                for r in items if r["kind"] == "transition"],
                "measurements": sum(r["kind"] == "measurement" for r in items)}

    def _cleanup(self, outcome: str) -> None:
        """Stop our steps, end every helper, unpublish; runs however `run` ends."""
        try:
            self.pool.stop_all()
        except Exception as exc:
            log.warning("stopping workers: %s", exc)
        helpers = list(self.helpers)
        for helper in helpers:  # ask first (their workers are gone), then make sure: Slurm's KillWait is short
            try:
                self.kv.set(helper_key(helper, "stop"), f"main job {outcome}")
            except Exception as exc:
                log.warning("cannot signal helper %s: %s", helper, exc)
        wait_until(lambda: all(self._helper_gone(h) for h in helpers), timedelta(seconds=3), interval=0.2)
        for helper in helpers:
            cancelled = not self._helper_gone(helper)
            if cancelled:
                self._cancel(helper)
            self.helpers.pop(helper, None)
            self.records.write("helper_ended", helper=helper, reason=f"main job {outcome}", cancelled=cancelled)
        (self.registry / f"{self.job_id}.json").unlink(missing_ok=True)
        if self.records is not None:
            self.records.write("end", outcome=outcome, nodes=len(self.nodes))
