"""Restart mode's executor (#43) with fakes: what it asks /v1/plan and how it starts the resize the answer asks for."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from elastic_launcher.launch_config import Allocation, Directives, LaunchConfig
from elastic_launcher.reporting import RecordLog
from elastic_launcher.restart import StepWatch, RestartLauncher
from elastic_launcher.restart_ops import RestartOp, RestartState
from slurm_plugin.client import Node
from slurm_plugin.contracts.records import validate_record

LINES = ("#ELASTIC model=resnet50 gpus=1-4 per_gpu_batch=16 mode=restart",)


class Planner:
    def __init__(self, reply):
        self.reply, self.bodies = reply, []

    def plan(self, body):
        self.bodies.append(body)
        return self.reply


def launcher(tmp_path, reply, end_time=None):
    now = [100.0]
    cfg = LaunchConfig(command=("python", "train.py"), run_dir=tmp_path, restart=True, end_time=end_time,
                       allocation=Allocation(job_id="42", nodes=("node1",), batch_host="node1", gpus_per_node=1,
                                             partition="debug"),
                       directives=Directives.from_mapping({"gpus": {"min": 1, "max": 4}, "per_gpu_batch": 16,
                                                           "mode": "restart", "model": "resnet50"}, LINES))
    slurm = SimpleNamespace(nodes=lambda: [Node(f"node{i}", "idle", 1, 0, None, ("debug",)) for i in (2, 3, 4)],
                            jobs=lambda: [])
    run = RestartLauncher(cfg, tmp_path / "reg", slurm, start_step=None, clock=lambda: now[0])
    run.records, run.predictor = RecordLog(tmp_path / "records.jsonl"), Planner(reply)
    signalled = []
    run.pool = SimpleNamespace(signal_step=lambda node, sig: signalled.append((node, sig)))
    run.fleet.nodes["node1"] = SimpleNamespace()
    run.steps = StepWatch(tmp_path, clock=lambda: now[0])
    for step in range(1, 12):   # 10 steps in 5 s at world 1: 2 steps/s, 32 samples/s
        now[0] += 0.5
        run.steps._saw((step, 1))
    return run, signalled


def test_the_plan_request_carries_the_rate_the_restart_cost_and_the_time_left(tmp_path, monkeypatch):
    monkeypatch.setattr("elastic_launcher.restart.time.time", lambda: 1000.0)
    run, _ = launcher(tmp_path, {"action": "keep", "reason": "elastic: stays", "nodes": None}, end_time=4600.0)
    run._autoscale()
    (body,) = run.predictor.bodies
    assert body["current"] == {"layout": [1], "samples_per_s": pytest.approx(32.0), "per_gpu_batch": 16,
                               "remaining_s": 3600.0}   # no cost measured yet: the planner's default prices it
    assert body["directives"] == list(LINES) and body["job"]["max_nodes"] == 4 and run.op is None
    run.cost_s, run._plan_asked = 21.5, float("-inf")   # once measured, the job's own cost is what is priced
    run._autoscale()
    assert run.predictor.bodies[-1]["current"]["restart_cost_s"] == 21.5


def test_without_slurm_job_end_time_the_time_left_is_read_from_slurm(tmp_path, monkeypatch):
    monkeypatch.setattr("elastic_launcher.restart.time.time", lambda: 1000.0)
    run, _ = launcher(tmp_path, {"action": "keep", "reason": "elastic: stays", "nodes": None})
    run.slurm.job = lambda job_id: SimpleNamespace(end_time=2800 if job_id == 42 else 0)
    run._autoscale()
    assert run.predictor.bodies[-1]["current"]["remaining_s"] == 1800.0


def test_a_plan_to_grow_signals_every_worker_and_waits_for_the_checkpoint(tmp_path):
    run, signalled = launcher(tmp_path, {"action": "rewrite", "reason": "elastic: 2 nodes; restart pays back",
                                         "nodes": 2})
    run._autoscale()
    assert signalled == [("node1", signal.SIGUSR1)]
    assert run.op.grow and run.op.target == 2 and run.op.state is RestartState.CHECKPOINT and run.op.action == "plan"
    assert "restart pays back" in run.op.reason


def test_a_plan_that_keeps_the_size_starts_nothing(tmp_path):
    run, signalled = launcher(tmp_path, {"action": "keep", "reason": "elastic: stays on 1 node(s): restart would "
                                                                    "not pay back: ...", "nodes": None})
    run._autoscale()
    assert signalled == [] and run.op is None
    (plan,) = [r for r in run.records.items if r["kind"] == "plan"]
    assert "would not pay back" in plan["reason"]


def test_a_shrink_below_the_first_allocation_is_refused(tmp_path):
    run, signalled = launcher(tmp_path, None)
    run.fleet.nodes["node0"] = SimpleNamespace()
    ok, message = run.request(1, "operator", "test")
    assert not ok and "only nodes added by a grow" in message and signalled == [] and run.op is None


def test_a_job_waiting_for_nodes_gets_the_helper_nodes_back(tmp_path):
    run, signalled = launcher(tmp_path, None)
    run.fleet.nodes.update({"node2": SimpleNamespace(), "node3": SimpleNamespace()})
    run.fleet.helpers["43"] = ["node2", "node3"]
    run.slurm.nodes = lambda: []   # the whole partition is the job's
    run.slurm.jobs = lambda: [SimpleNamespace(job_id=50, state="PENDING", node_count=1, reason="Resources",
                                              partition="debug", priority=1, time_limit_s=600)]
    run._autoscale()
    assert not run.op.grow and run.op.target == 2 and run.op.action == "yield" and "pending job 50" in run.op.reason
    assert {node for node, _ in signalled} == {"node1", "node2", "node3"} and run.predictor.bodies == []


def test_a_finished_restart_posts_its_measured_cost_to_the_service(tmp_path):
    run, _ = launcher(tmp_path, None)
    posted = []
    run.predictor.observe = lambda records: posted.extend(records) or True
    run.fleet.nodes["node2"] = SimpleNamespace()
    run.op = RestartOp(grow=True, target=2, world=2, from_nodes=1, action="plan", reason="test", signalled=101.0,
                       state=RestartState.CHANGING, changed=103.0, checkpointed=True)
    run.steps._saw((12, 2))   # the first step at the new size, 4.5 s after the signal
    run._advance()
    (record,) = posted
    assert validate_record(record, "r") == {"kind": "restart", "from_nodes": 1, "to_nodes": 2, "world": 2,
                                            "cost_s": 4.5, "checkpoint_s": 2.0, "checkpointed": True, "job_id": 42,
                                            "timestamp_s": record["timestamp_s"], "profile": "resnet50"}
    (moved,) = [r for r in run.records.items if r["kind"] == "transition"]
    assert moved["posted"] is True and moved["cost_s"] == 4.5 and run.cost_s == 4.5 and run.op is None
