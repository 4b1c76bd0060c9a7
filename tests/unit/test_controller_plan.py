"""Controller._ask_plan / _measure_and_decide with a fake predictor: what /v1/plan is asked, and which policy
decides (planner, heuristic while the service is unreachable, none without directives). No Slurm, no workers:
the measurement, the layout and the resize calls are stubbed on the instance."""
import json

import pytest
import torch.distributed

from elastic_launcher import controller as controller_module
from elastic_launcher.autoscale import Measurement
from elastic_launcher.controller import Controller
from elastic_launcher.launch_config import Allocation, Directives, LaunchConfig
from elastic_launcher.reporting import RecordLog
from elastic_launcher.steering import JobPhase
from slurm_plugin.client import Job

SCRIPT = ("#!/bin/bash\n#ELASTIC model=resnet50 gpus=1-8 per_gpu_batch=16 max_global_batch=64 min_efficiency=0.7\n"
          "python train.py\n")


class FakePredictor:
    """Stands in for reporting.PredictorClient: answers /v1/plan from a list, records every body."""

    def __init__(self, replies, url="http://predictor:8080", last_error=None, outcome="unreachable"):
        self.url, self.last_error = url, last_error
        self.replies = list(replies)
        self.bodies: list[dict] = []
        self.writes_refused = None
        self.outcome, self.last_outcome = outcome, "not asked"

    def plan(self, body):
        self.bodies.append(json.loads(json.dumps(body)))
        reply = self.replies.pop(0)
        self.last_outcome = "answered" if reply is not None else self.outcome
        return reply

    def observe(self, records):
        return True


def make_controller(tmp_path, predictor, script=SCRIPT, nodes=2, free=("node3", "node4")):
    alloc = Allocation(job_id="42", nodes=tuple(f"node{i + 1}" for i in range(nodes)), batch_host="node1",
                       gpus_per_node=1, partition="debug")
    config = LaunchConfig(command=("python", "train.py"), allocation=alloc,
                          directives=Directives.from_script(script), run_dir=tmp_path, grow_step_nodes=2)
    c = Controller(config, registry=tmp_path / "registry", slurm=None, start_step=None)
    c.predictor = predictor
    c.records = RecordLog(tmp_path / "records.jsonl")
    c.resizes: list = []
    c._measure = lambda: (Measurement(nodes=nodes, workers=nodes, samples_per_s=100.0 * nodes, step_s=0.1), {})
    c._current_layout = lambda: [1] * nodes
    c._post_observations = lambda own: None
    c._free_nodes = lambda: list(free)
    c._pending_jobs = lambda: []
    c.resizer = FakeResizer(c.resizes, nodes)
    c.phase = JobPhase.RUNNING  # decisions are taken in RUNNING only
    return c


class FakeResizer:
    """Stands in for resize.Resizer: records the transitions the controller asks for (no op in flight)."""

    busy, settled = False, True

    def __init__(self, resizes: list, nodes: int):
        self.resizes, self.nodes = resizes, nodes

    def request_grow(self, target, action, reason, **kw):
        self.resizes.append(("grow", target))

    def request_shrink(self, target, action, reason, **kw):
        self.resizes.append((action, target))


def decisions(c):
    return [r for r in c.records.items if r["kind"] == "decision"]


def test_plan_is_asked_with_the_directive_node_range_and_the_measured_current(tmp_path):
    keep = {"action": "keep", "nodes": 2, "gpus_per_node": 1, "layout": [1, 1], "decision_id": "d-1",
            "reason": "request already matches the plan; elastic: 2 nodes x 1 GPUs (2x1); 3x1 efficiency 0.4 < 0.7"}
    c = make_controller(tmp_path, FakePredictor([keep]))
    c._measure_and_decide()
    (body,) = c.predictor.bodies
    assert body["source"] == "launcher" and body["directives"] == list(c.config.directives.raw_lines)
    # gpus=1-8 at 1 slot per node, max_global_batch 64 / per_gpu_batch 16: 1..4 nodes (not just the current 2)
    assert (body["job"]["min_nodes"], body["job"]["max_nodes"]) == (1, 4)
    assert body["current"] == {"layout": [1, 1], "samples_per_s": 200.0, "per_gpu_batch": 16}


def test_plan_keep_stays_at_the_current_size(tmp_path):
    keep = {"action": "keep", "nodes": 2, "gpus_per_node": 1, "layout": [1, 1], "reason": "already matches"}
    c = make_controller(tmp_path, FakePredictor([keep]))
    c._measure_and_decide()
    assert c.resizes == []
    (d,) = decisions(c)
    assert (d["action"], d["policy"], d["plan_nodes"]) == ("keep", "planner", 2) and "plan says 2" in d["reason"]


@pytest.mark.parametrize("plan_nodes, resize", [(3, ("grow", 3)), (1, ("shrink", 1))])
def test_plan_rewrite_sets_the_target(tmp_path, plan_nodes, resize):
    rewrite = {"action": "rewrite", "nodes": plan_nodes, "gpus_per_node": 1, "layout": [1] * plan_nodes,
               "reason": f"elastic: {plan_nodes}x1"}
    c = make_controller(tmp_path, FakePredictor([rewrite]))
    if plan_nodes == 1:    # a job waits (one the job cannot free nodes enough for): no grow, and the shrink goes
        c._pending_jobs = lambda: [controller_module.PendingJob(7, 4, "Resources")]
    c._measure_and_decide()
    assert c.resizes == [resize]
    (d,) = decisions(c)
    assert (d["policy"], d["plan_nodes"], d["target_nodes"]) == ("planner", plan_nodes, plan_nodes)
    assert f"plan says {plan_nodes} node{'' if plan_nodes == 1 else 's'}" in d["reason"]
    (plan,) = [r for r in c.records.items if r["kind"] == "plan"]
    assert plan["target_nodes"] == plan_nodes


def _one_hour_left(c) -> list:
    """The workers said --steps 36,000 and committed none: an hour left at the fake's 0.1 s a step. Returns the
    list of the progress reads a decision makes (the store's: one a decision, #46)."""
    reads = []
    c.server, c._total_steps = object(), 36_000
    c._progress = lambda wids: reads.append(wids) or {}
    return reads


def test_the_plans_shrink_waits_for_a_job_that_needs_the_nodes(tmp_path):
    # replay of Pollux 1-8 (bench/results/replay/README.md): a shrink while nobody waited freed nodes that idled
    rewrite = {"action": "rewrite", "nodes": 1, "gpus_per_node": 1, "layout": [1], "reason": "elastic: 1x1"}
    c = make_controller(tmp_path, FakePredictor([rewrite]))
    c._measure_and_decide()
    assert c.resizes == []
    (d,) = decisions(c)
    assert d["action"] == "keep" and "plan says 1 node" in d["reason"] and "no job waits" in d["reason"]


def test_nodes_handed_back_are_grown_back_once_nobody_waits(tmp_path):
    keep = {"action": "keep", "nodes": 2, "gpus_per_node": 1, "layout": [1, 1], "reason": "already matches"}
    c = make_controller(tmp_path, FakePredictor([keep, keep, keep]), nodes=3, free=())
    _one_hour_left(c)
    c._pending_jobs = lambda: [controller_module.PendingJob(7, 1, "Resources", time_limit_s=600)]
    c._measure_and_decide()
    assert c.resizes == [("shrink", 2)] and c.policy.lent_nodes_ == 3
    c._measure = lambda: (Measurement(nodes=2, workers=2, samples_per_s=200.0, step_s=0.1), {})  # shrunk
    c._current_layout = lambda: [1, 1]
    c._pending_jobs, c._free_nodes = (lambda: []), (lambda: ["node9"])
    c._measure_and_decide()
    assert c.resizes[-1] == ("grow", 3)
    assert "growing back toward the 3 nodes" in decisions(c)[-1]["reason"]


def test_a_pending_job_longer_than_half_the_time_left_is_not_handed_nodes(tmp_path):
    keep = {"action": "keep", "nodes": 3, "gpus_per_node": 1, "layout": [1, 1, 1], "reason": "already matches"}
    c = make_controller(tmp_path, FakePredictor([keep]), nodes=3, free=())
    _one_hour_left(c)
    c._pending_jobs = lambda: [controller_module.PendingJob(7, 1, "Resources", time_limit_s=1801)]
    c._measure_and_decide()
    assert c.resizes == [] and c.policy.lent_nodes_ == 0


def test_a_decision_while_a_job_waits_reads_the_workers_progress_once(tmp_path):
    # #46: the time-limit check and the hand-back each read every worker's progress from the store
    keep = {"action": "keep", "nodes": 3, "gpus_per_node": 1, "layout": [1, 1, 1], "reason": "already matches"}
    c = make_controller(tmp_path, FakePredictor([keep, keep]), nodes=3, free=())
    reads = _one_hour_left(c)
    c._pending_jobs = lambda: [controller_module.PendingJob(7, 1, "Resources", time_limit_s=600)]
    c._progress_logged = c.clock()      # no progress line due: the decision alone reads
    c._measure_and_decide()
    assert len(reads) == 1 and c.resizes == [("shrink", 2)]


def test_unreachable_service_runs_the_heuristic_and_the_record_says_so(tmp_path):
    c = make_controller(tmp_path, FakePredictor([None], last_error="/v1/plan: connection refused"))
    c._measure_and_decide()
    assert c.resizes == [("grow", 4)]
    (d,) = decisions(c)
    assert d["policy"] == "heuristic (service unreachable)" and d["plan_nodes"] is None
    assert d["reason"].startswith("heuristic (service unreachable);") and "connection refused" in d["plan_note"]
    assert (d["predictor"], d["writes"]) == ("unreachable", "posted")


def test_the_decision_record_says_not_configured_refused_or_answered(tmp_path):
    # #45.4: a lab without a service recorded "heuristic (service unreachable)"; a refused write, "predictor": false
    for sub in "abc":
        (tmp_path / sub).mkdir()
    c = make_controller(tmp_path / "a", FakePredictor([None], url=None, outcome="not configured"))
    c._measure_and_decide()
    (d,) = decisions(c)
    assert (d["policy"], d["predictor"], d["writes"]) == ("heuristic (no predictor configured)", "not configured",
                                                         "not configured")
    c = make_controller(tmp_path / "b", FakePredictor([None], outcome="refused", last_error="/v1/plan: HTTP 400"))
    c._measure_and_decide()
    assert decisions(c)[0]["predictor"] == "refused"
    keep = {"action": "keep", "reason": "fine", "nodes": 2}
    c = make_controller(tmp_path / "c", FakePredictor([keep]))
    c.predictor.writes_refused = "HTTP 401: missing_credential"
    c._measure_and_decide()
    assert (decisions(c)[0]["predictor"], decisions(c)[0]["writes"]) == ("answered", "refused")


def test_no_directives_asks_nothing_and_does_not_grow(tmp_path):
    c = make_controller(tmp_path, FakePredictor([]), script="#!/bin/bash\npython train.py\n")
    c._measure_and_decide()
    assert c.predictor.bodies == [] and c.resizes == []
    (d,) = decisions(c)
    assert d["action"] == "keep" and d["policy"] == "none (no #ELASTIC directives)"


def test_the_advice_is_cached_per_size_for_plan_interval(tmp_path):
    keep = {"action": "keep", "nodes": 2, "gpus_per_node": 1, "layout": [1, 1], "reason": "already matches"}
    c = make_controller(tmp_path, FakePredictor([keep, keep]))
    c._measure_and_decide()
    c._measure_and_decide()                     # within PLAN_INTERVAL_S at 2 nodes: the cached keep, no call
    assert len(c.predictor.bodies) == 1 and c.resizes == []
    asked_at, when, advice = c._plan_cache
    assert (asked_at, advice.nodes, advice.source) == (2, 2, "planner")
    c._plan_cache = (asked_at, when - controller_module.PLAN_INTERVAL_S - 1, advice)
    c._measure_and_decide()
    assert len(c.predictor.bodies) == 2 and c.resizes == []


def test_an_unreachable_service_is_cached_too_and_asked_again_after_the_interval(tmp_path):
    rewrite = {"action": "rewrite", "nodes": 3, "gpus_per_node": 1, "layout": [1, 1, 1], "reason": "elastic: 3x1"}
    c = make_controller(tmp_path, FakePredictor([None, rewrite]), free=())
    c._measure_and_decide()
    c._measure_and_decide()
    assert len(c.predictor.bodies) == 1 and c._plan_cache[2].source == "unreachable"
    asked_at, when, advice = c._plan_cache
    c._plan_cache = (asked_at, when - controller_module.PLAN_INTERVAL_S - 1, advice)
    c._measure_and_decide()
    assert len(c.predictor.bodies) == 2 and c._plan_cache[2].source == "planner"
    assert [d["policy"] for d in decisions(c)] == ["heuristic (service unreachable)", "planner"]


def test_a_plan_to_shrink_does_not_undo_an_operators_size(tmp_path):
    rewrite = {"action": "rewrite", "nodes": 1, "gpus_per_node": 1, "layout": [1], "reason": "elastic: 1x1"}
    c = make_controller(tmp_path, FakePredictor([rewrite]))
    c.operator_cap = 2  # `elastic-launch ctl 42 --nodes 2` earlier
    c._pending_jobs = lambda: [controller_module.PendingJob(7, 4, "Resources")]  # waits; more than the job can give
    c._measure_and_decide()
    assert c.resizes == []
    (d,) = decisions(c)
    assert d["action"] == "keep" and "operator's 2 nodes" in d["reason"]


def _pending_squeue(tmp_path, jobs):
    """A Controller whose Slurm client answers squeue with `jobs` (slurm_plugin.client.Job)."""
    keep = {"action": "keep", "nodes": 3, "gpus_per_node": 1, "layout": [1, 1, 1], "reason": "already matches"}
    c = make_controller(tmp_path, FakePredictor([keep]), nodes=3, free=())
    del c._pending_jobs  # the real one, over a fake client
    c.slurm = type("Slurm", (), {"jobs": lambda self: jobs})()
    return c


def _job(job_id, state, nodes, reason, partition="debug"):
    from slurm_plugin.client import Job
    return Job(job_id=job_id, name="other", state=state, nodes=(), nodelist="", cpus_per_node=(), gpus_per_node=(),
               tres_per_node="", comment="", batch_host="", reason=reason, partition=partition, node_count=nodes)


def test_a_job_pending_for_nodes_gets_them_from_the_surplus(tmp_path):
    c = _pending_squeue(tmp_path, [_job(7, "PENDING", 2, "Resources"), _job(8, "RUNNING", 1, "None"),
                                   _job(9, "PENDING", 1, "Resources", partition="other")])
    c._measure_and_decide()
    assert c.resizes == [("shrink", 1)]
    (d,) = decisions(c)
    assert d["action"] == "shrink" and "pending job 7" in d["reason"]


def test_own_helpers_and_unsatisfiable_pending_jobs_are_not_yielded_to(tmp_path):
    c = _pending_squeue(tmp_path, [_job(42, "PENDING", 1, "Resources"), _job(7, "PENDING", 9, "Resources")])
    c.fleet.helpers = {"43": []}
    c.slurm = type("Slurm", (), {"jobs": lambda self: [_job(43, "PENDING", 1, "Resources"),
                                                       _job(7, "PENDING", 9, "Resources")]})()
    c._measure_and_decide()
    assert c.resizes == []   # 43 is its own helper; 7 needs more than the whole surplus of 2 nodes


def test_no_grow_while_another_job_waits_for_nodes(tmp_path):
    rewrite = {"action": "rewrite", "nodes": 4, "gpus_per_node": 1, "layout": [1] * 4, "reason": "elastic: 4x1"}
    c = make_controller(tmp_path, FakePredictor([rewrite]), nodes=2, free=("node3",))
    c._pending_jobs = lambda: [controller_module.PendingJob(7, 4, "Resources")]
    c._measure_and_decide()
    assert c.resizes == []
    (d,) = decisions(c)
    assert d["action"] == "keep" and "job 7 waits" in d["reason"]


def test_operator_requests_are_decided_from_plain_values():
    from elastic_launcher.steering import RequestKind, decide_request
    assert decide_request("2", 2, 1).kind is RequestKind.REJECT
    assert "positive integer" in decide_request(0, 2, 1).message
    assert decide_request(2, 2, 1).kind is RequestKind.ALREADY
    below = decide_request(1, 3, 2)
    assert below.kind is RequestKind.REJECT and below.message == "1 nodes is below the job's minimum of 2"
    assert (decide_request(4, 2, 1).kind, decide_request(4, 2, 1).target) == (RequestKind.RESIZE, 4)


def test_the_operators_cap_bounds_a_grow_and_a_pending_job_wins():
    from elastic_launcher.autoscale import PlanAdvice
    from elastic_launcher.steering import settle_decision
    grow = controller_module.Decision("grow", 4, "efficiency 0.9")
    heuristic = PlanAdvice(None, "unreachable", "down")
    capped = settle_decision(grow, 2, None, [], 3, heuristic)
    assert (capped.action, capped.target_nodes) == ("grow", 3) and "operator's 3 nodes" in capped.reason
    assert settle_decision(grow, 3, None, [], 3, heuristic).action == "keep"
    pending = [controller_module.PendingJob(7, 1, "Resources")]
    assert settle_decision(grow, 2, None, pending, None, heuristic).action == "keep"
    handback = controller_module.Decision("shrink", 1, "pending job 7")
    assert settle_decision(grow, 2, handback, pending, None, heuristic) is handback


def test_a_pending_jobs_handback_is_not_held_at_the_operators_size():
    """The operator asked for 3 nodes and the planner says 1: the planner's shrink is refused, but a pending job
    that waits for a node this job holds gets it (the demo's grow, then another user's job)."""
    from elastic_launcher.autoscale import PlanAdvice
    from elastic_launcher.steering import settle_decision
    planner = PlanAdvice(1, "planner", "plan says 1")
    plan_shrink = controller_module.Decision("shrink", 1, "plan says 1 nodes, fewer than 3")
    held = settle_decision(plan_shrink, 3, None, [], 3, planner)
    assert (held.action, held.target_nodes) == ("keep", 3) and "operator's 3 nodes" in held.reason
    pending = [controller_module.PendingJob(5, 2, "Resources")]
    handback = controller_module.Decision("shrink", 2, "handing 1 node back for pending job 5")
    out = settle_decision(plan_shrink, 3, handback, pending, 3, planner)
    assert (out.action, out.target_nodes, out.reason) == ("shrink", 2, handback.reason)


def test_the_linear_throughput_seam_scales_the_first_measurement():
    from elastic_launcher.steering import MeasuredThroughput
    from elastic_launcher.testing import LinearThroughput
    first = Measurement(nodes=1, workers=2, samples_per_s=50.0, step_s=0.1)
    assert MeasuredThroughput().samples_per_s(60.0, 4, [first]) == 60.0
    assert LinearThroughput().samples_per_s(60.0, 4, []) == 60.0
    assert LinearThroughput().samples_per_s(60.0, 4, [first]) == 100.0


def test_failed_nodes_are_the_ended_then_the_evicted_each_once():
    from elastic_launcher.steering import decide_failures
    nodes = {"node1", "node2", "node3", "node4"}
    assert decide_failures(["node2", "gone"], ["node4"], ["node3", "node2"], nodes) == \
        [("node2", False), ("node4", False), ("node3", True)]
    assert decide_failures([], [], [], nodes) == []


def test_the_predictor_token_is_never_written_to_the_records_or_the_log(tmp_path, caplog):
    # #24.15: the launch config went into records.jsonl and the job's .out file (both world-readable) whole
    alloc = Allocation(job_id="42", nodes=("node1",), batch_host="node1", gpus_per_node=1, partition="debug")
    config = LaunchConfig(command=("python", "train.py"), allocation=alloc, directives=Directives.from_script(SCRIPT),
                          run_dir=tmp_path, predictor_token="s3cret-token")
    summary = json.loads(config.to_json())
    assert summary["predictor_token"] == "(set)" and "s3cret-token" not in config.to_json()
    # #45.6: the directives' set of given keys is a JSON list, not a Python repr inside a string
    assert summary["directives"]["given"] == sorted(Directives.from_script(SCRIPT).given)
    assert "frozenset" not in config.to_json()
    with caplog.at_level("DEBUG"):
        Controller(config, registry=tmp_path / "registry", slurm=None, start_step=None)
    written = "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    assert "s3cret-token" not in written + caplog.text


def test_a_job_signs_with_the_munge_socket_its_environment_names(tmp_path):
    # #26.4: the test lab's munged is not at munge's default socket; a template job there could not sign, got 401
    from slurm_plugin.lab.testbed import Testbed
    from slurm_plugin.lab.testbed_conf import TestbedConfig
    bed = Testbed(TestbedConfig(lab=tmp_path / "lab", port_base=17000))
    socket = bed.env()["ELASTIC_MUNGE_SOCKET"]      # what `eval "$(elastic-slurm testbed env)"` exports
    assert socket == str(bed.config.munge_socket)
    alloc = Allocation(job_id="42", nodes=("node1",), batch_host="node1", gpus_per_node=1, partition="debug")
    config = LaunchConfig(command=("python", "train.py"), allocation=alloc, directives=Directives.from_script(SCRIPT),
                          run_dir=tmp_path, munge_socket=socket)
    ctl = Controller(config, registry=tmp_path / "registry", slurm=None, start_step=None)
    assert ctl.predictor.munge_socket == socket and ctl.predictor.job_id == 42


def test_rows_are_labelled_with_the_devices_type_then_slurms_then_the_directive(tmp_path):
    # #26.2: the worker knows its device, the controller reads the GRES type from Slurm, yet rows carried the
    # directive's value (default `unknown`)
    from elastic_launcher.gpu_speeds import JobTypes, NodeType
    alloc = Allocation(job_id="42", nodes=("node1", "node2"), batch_host="node1", gpus_per_node=1, partition="debug")
    config = LaunchConfig(command=("python", "train.py"), allocation=alloc, directives=Directives.from_script(SCRIPT),
                          run_dir=tmp_path)
    ctl = Controller(config, registry=tmp_path / "registry", slurm=None, start_step=None)
    assert ctl._gpu_label() == config.directives.gpu_type                       # nothing known: the directive
    ctl.types = JobTypes({"node1": NodeType("h200", "H200"), "node2": NodeType("h200", "H200")}, "test")
    assert ctl._gpu_label() == "H200"                                           # Slurm's one GRES type
    from elastic_launcher.resize import NodeSlot
    ctl.fleet.nodes = {n: NodeSlot(n, "42", f"j42-{n}") for n in ("node1", "node2")}   # the epoch's nodes
    ctl._device_gpu["node1"] = "cpu"
    assert ctl._gpu_label() == "cpu"                                            # what the devices say (#45.4)
    ctl._device_gpu["node2"] = "A100"
    assert ctl._gpu_label() == "H200"                                           # devices disagree: Slurm's
    ctl._device_gpu["node3"] = "A100"                                            # a helper's node, grown onto
    ctl.types = JobTypes({"node1": NodeType("h200", "H200")}, "test")
    assert [ctl._node_label(n) for n in ("node1", "node2", "node3", "node4")] == ["cpu", "A100", "A100", "unknown"]


def test_the_operators_size_holds_against_every_autoscale_move_until_lifted():
    # #45.5: one job held the operator's size against 20 plans, another reverted it 3 s after the first measurement
    from elastic_launcher.autoscale import PlanAdvice
    from elastic_launcher.steering import settle_decision
    Decision = controller_module.Decision
    heuristic, planner = PlanAdvice(None, "unreachable", "down"), PlanAdvice(2, "planner", "plan says 2")
    revert = Decision("revert", 2, "grow 2->4 nodes did not pay: efficiency 0.41 < 0.70", 0.41)
    for decision, advice in ((revert, heuristic), (Decision("shrink", 2, "plan says 2 nodes"), planner),
                             (Decision("grow", 6, "efficiency 0.9"), heuristic)):
        held = settle_decision(decision, 4, None, [], 4, advice)
        assert (held.action, held.target_nodes) == ("keep", 4), decision
        assert held.reason.startswith("held at the operator's 4 nodes until `ctl --auto`")
        assert settle_decision(decision, 4, None, [], None, advice) is decision          # lifted: the autoscaler's
    toward = settle_decision(Decision("shrink", 1, "plan says 1 node"), 4, None, [], 3, planner)
    assert (toward.action, toward.target_nodes) == ("shrink", 3)                         # toward it, not past it


def test_ctl_auto_lifts_the_operators_size_and_status_says_which_rule_holds(tmp_path):
    from elastic_launcher.reporting import status_table
    from tests.unit.test_resize_tick import Clock
    from tests.unit.test_resize_tick import make_controller as ticking_controller
    c = ticking_controller(tmp_path, Clock())
    c.operator_cap = 2
    c.inbox.requests = [(1, {"nodes": "auto"})]
    c._handle_requests()
    assert c.inbox.replies[1]["ok"] and c.operator_cap is None
    assert "autoscaler decides again" in c.inbox.replies[1]["message"]
    (d,) = [r for r in c.records.items if r["kind"] == "decision"]
    assert (d["source"], d["action"]) == ("operator", "auto")
    status = {"job": "42", "phase": "running", "epoch": 3, "world": 2, "nodes": ["node1", "node2"], "step": 600,
              "total_steps": 3000, "samples_per_s": 321.14, "eta_s": 130.0, "resize": None, "recovering": [],
              "last_resize": {"action": "grow", "from_nodes": 1, "to_nodes": 2, "t": 100.0},
              "operator": "holds 2 node(s) until `elastic-launch ctl 42 --auto`"}
    table = status_table(status, now=135.0)
    assert "progress    step 600/3000 (20%)  2 nodes  321 samples/s  ETA 2 min  last resize: grow 1->2, 35 s ago" \
        in table
    assert "operator    holds 2 node(s) until `elastic-launch ctl 42 --auto`" in table


def test_the_end_summary_rounds_seconds():
    from elastic_launcher.controller import _rounded
    assert _rounded(0.10734999999) == 0.107 and _rounded(3) == 3 and _rounded(None) is None


def test_ctl_on_an_ended_job_says_where_its_records_are(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from elastic_launcher.cli import ctl
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))   # no Slurm here: sacct cannot be read
    out = CliRunner().invoke(ctl, ["77", "--status", "--registry", str(tmp_path)])
    assert out.exit_code == 1 and "job 77 has no running elastic-launch (it ended, or has not started yet)" in \
        out.output and "elastic-77/records.jsonl" in out.output and "sacct -j 77 -X` (the last record" in out.output


def test_an_ended_resized_job_reads_as_its_end_state_not_resizing():
    # #45: `sacct -j N` shows a completed elastic job that shrank as RESIZING first (one record per size, each size
    # it left RESIZING); ctl says the end state and the sizes. An older job of the same id (a lab's counter) is not it
    from elastic_launcher.reporting import ended_job
    from slurm_plugin.client import AcctRecord
    old = AcctRecord(19, "other", "CANCELLED", "None assigned", 0)
    rz = [AcctRecord(19, "train", "RESIZING", "node[1-4]", 16), AcctRecord(19, "train", "RESIZING", "node[1-2]", 8)]
    done = AcctRecord(19, "train", "COMPLETED", "node1", 4)
    text = ended_job(19, [old, *rz, done])
    assert text.startswith("job 19 ended COMPLETED on 1 node(s); it ran at 4 -> 2 -> 1 nodes") and "RESIZING" in text
    assert ended_job(19, [old, done]) == "job 19 ended COMPLETED on 1 node(s)"
    assert ended_job(19, [*rz[:1], AcctRecord(19, "train", "TIMEOUT", "node[1-2]", 8)]).startswith(
        "job 19 ended TIMEOUT on 2 node(s); it ran at 4 -> 2 nodes")
    assert ended_job(19, []) == "sacct has no record of job 19"


def test_one_progress_line_per_interval_in_the_jobs_output(tmp_path, caplog):
    keep = {"action": "keep", "reason": "fine", "nodes": 2}
    c = make_controller(tmp_path, FakePredictor([keep] * 3))
    now = [1000.0]
    c.clock = lambda: now[0]
    with caplog.at_level("INFO", logger="elastic_launcher.controller"):
        for t in (1000.0, 1010.0, 1031.0):   # measurements 10 s and 21 s apart; the interval is 30 s
            now[0] = t
            c._plan_cache = (None, 0.0, None)
            c._measure_and_decide()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines == ["step 0  2 nodes  200 samples/s  ETA ?  last resize: none"] * 2


def test_the_scaling_plot_is_drawn_from_the_measurements(tmp_path):
    from elastic_launcher.reporting import scaling_plot
    records = [{"kind": "measurement", "t": 100.0 + i, "nodes": n, "samples_per_s": 100.0 * n}
               for i, n in enumerate([2, 2, 4, 4])]
    records.insert(2, {"kind": "transition", "action": "grow", "t": 101.5})
    path = scaling_plot(records, tmp_path / "scaling.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert scaling_plot([r for r in records if r["kind"] != "measurement"], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_a_mixed_jobs_step_row_names_each_nodes_type_and_each_ranks_batch(tmp_path):
    # #42.7: a job on an H100 and an A100 node posted no step row at all, and no row held its per-rank batches
    from elastic_launcher import store_keys as keys
    from elastic_launcher.gpu_speeds import JobTypes, NodeType
    c = make_controller(tmp_path, FakePredictor([{"action": "keep", "reason": "fine", "nodes": 2}]))
    posted = []
    c._post_observations = posted.append
    c.types = JobTypes({"node1": NodeType("h100", "H100"), "node2": NodeType("a100", "A100", 0.56)}, "predictor")
    c._epoch = (7, ["node1", "node2"])  # what _current_layout remembers of the epoch
    c.server = torch.distributed.HashStore()  # the job's store (a TCPStore server in a real run)
    c.server.set(f"{keys.state_channel('')}/{keys.batches(7)}", json.dumps([82, 46]))  # what its rank 0 wrote
    c._measure_and_decide()
    [row] = posted[0]
    assert (row["gpu"], row["gpu_by_node"], row["rank_batches"], row["layout"]) == \
        ("A100+H100", ["H100", "A100"], [82, 46], [1, 1])
    from slurm_plugin.contracts.records import validate_record
    assert validate_record(row, "row") == row


def test_a_one_type_jobs_step_row_carries_its_ranks_batches(tmp_path):
    from elastic_launcher import store_keys as keys
    from elastic_launcher.gpu_speeds import JobTypes, NodeType
    c = make_controller(tmp_path, FakePredictor([{"action": "keep", "reason": "fine", "nodes": 2}]))
    posted = []
    c._post_observations = posted.append
    c.types = JobTypes({"node1": NodeType("h100", "H100"), "node2": NodeType("h100", "H100")}, "one type")
    c._epoch = (3, ["node1", "node2"])
    c.server = torch.distributed.HashStore()
    c.server.set(f"{keys.state_channel('')}/{keys.batches(3)}", json.dumps([16, 16]))
    c._measure_and_decide()
    [row] = posted[0]
    assert (row["gpu"], row["gpu_by_node"], row["rank_batches"]) == ("H100", ["H100", "H100"], [16, 16])


def test_no_yield_keeps_the_nodes_and_grows_as_planned_while_a_job_waits(tmp_path):
    import dataclasses
    rewrite = {"action": "rewrite", "nodes": 3, "gpus_per_node": 1, "layout": [1, 1, 1], "reason": "elastic: 3x1"}
    c = make_controller(tmp_path, FakePredictor([rewrite]))
    c.config = dataclasses.replace(c.config, yield_to_pending=False)   # elastic-launch --no-yield
    _one_hour_left(c)
    c._pending_jobs = lambda: [controller_module.PendingJob(7, 3, "Resources", time_limit_s=60)]
    c._measure_and_decide()
    assert c.resizes == [("grow", 3)] and c.policy.lent_nodes_ == 0


class EndOnlySlurm:
    """squeue for the job's own end time only (Slurm 22.05 exports no SLURM_JOB_END_TIME to the batch step)."""

    def __init__(self, end_time):
        self.end_time, self.asked = end_time, []

    def job(self, job_id, timeout=None):
        self.asked.append(job_id)
        return Job(job_id, "train", "RUNNING", (), "", (), (), "", "", "node1", "None", end_time=self.end_time)


@pytest.mark.parametrize("left_s, resize", [(300, [("shrink", 1)]), (200, [])])
def test_the_plans_shrink_is_refused_when_the_steps_left_would_not_end_before_the_job(tmp_path, left_s, resize):
    """Issue #40: 1,000 steps left at 0.1 s on 2 nodes; on 1 node (linear) they need 1,000 x 0.2 x 1.05 + 60 = 270 s:
    the shrink goes with 300 s to the job's end (squeue's EndTime against the wall clock), not with 200 s."""
    rewrite = {"action": "rewrite", "nodes": 1, "gpus_per_node": 1, "layout": [1], "reason": "elastic: 1x1"}
    c = make_controller(tmp_path, FakePredictor([rewrite]))
    c._pending_jobs = lambda: [controller_module.PendingJob(7, 4, "Resources")]
    c.slurm, c.wall = EndOnlySlurm(1_000_000 + left_s), lambda: 1_000_000.0
    c.server, c._total_steps = object(), 1000      # the workers said --steps 1000; none committed a step yet
    c._progress = lambda wids: {}
    c._measure_and_decide()
    assert c.resizes == resize and c.slurm.asked == [42]
    (d,) = decisions(c)
    assert ("refused: 1000 steps left need 270 s at 1 node" in d["reason"]) == (not resize)
