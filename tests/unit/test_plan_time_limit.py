"""Issue #40: a rewrite to a layout predicted slower than the one asked carries a longer time limit
(`time_limit_min`, ceil(asked minutes x asked samples/s / chosen samples/s)), said in the reason; never a shorter one.

The tables are written by hand (predictor.planner.last_step reads nothing else), so each number is the rule's."""
from __future__ import annotations

import math

import pytest

from predictor import planner

# one node of 4 GPUs scales poorly past 2: 1 -> 2 GPUs efficiency 0.8, 2 -> 4 GPUs 0.11 (below 0.5)
SPS = {(1,): 1000.0, (2,): 1800.0, (1, 1): 1700.0, (4,): 2000.0, (2, 2): 1900.0, (1, 1, 1, 1): 1500.0}
LINES = ("#ELASTIC model=resnet50 per_gpu_batch=64", "#ELASTIC gpus=1-4 min_efficiency=0.5")


def table(sps=SPS):
    return {"gpu": "T4", "partition": "debug", "total_gpus": 16, "nodes": 4, "gpus_per_node": 4,
            "one_leaf_nodes": 2, "gpu_hour_cost": 0.0, "node_hour_cost": 0.0, "min_efficiency": 0.5,
            "per_gpu_batch": 64, "model": "resnet50",
            "entries": [{"layout": list(layout), "samples_per_s": s} for layout, s in
                        sorted(sps.items(), key=lambda kv: (sum(kv[0]), len(kv[0])))]}


def decide(job, lines=LINES, sps=SPS):
    d = planner.parse_request({"directives": list(lines)}).directives
    return planner.last_step(table(sps), d, planner.requested(job))


ASKED_1X4 = {"min_nodes": 1, "tres_per_node": "gres:gpu:4"}


@pytest.mark.parametrize("job", [ASKED_1X4, {"min_nodes": 1, "tres_per_job": "gres:gpu:4"},
                                 {"tres_per_node": "gres:gpu:4"}, {"tres_per_job": "gres:gpu:4"}])
def test_a_slower_layout_gets_the_limit_scaled_by_the_throughput_ratio(job):
    """1x4 asked (2000 samples/s), 1x2 chosen (1800): 60 min -> ceil(60 x 2000 / 1800) = 67; the same for a job
    naming 1 node and 4 GPUs, 4 GPUs per node on no node count, and 4 GPUs only (their best layout, 1x4)."""
    out = decide({**job, "time_limit_min": 60})
    assert out["action"] == "rewrite" and out["layout"] == [2]
    assert out["time_limit_min"] == 67
    assert out["reason"].endswith("; time limit 60 -> 67 min")


def test_the_ratio_is_the_asked_layouts_not_the_best_of_its_count():
    """2x2 asked (1900): ceil(100 x 1900 / 1800) = 106, not 112 from 1x4's 2000."""
    out = decide({"min_nodes": 2, "tres_per_node": "gres:gpu:2", "time_limit_min": 100})
    assert out["layout"] == [2] and out["time_limit_min"] == 106


@pytest.mark.parametrize("job, sps, limit", [
    ({"min_nodes": 1, "tres_per_node": "gres:gpu:1", "time_limit_min": 60}, SPS, None),  # 1x1 asked: 1x2 faster
    ({**ASKED_1X4, "time_limit_min": 60}, {**SPS, (2,): 2000.0}, None),                # as fast: the same limit
    ({**ASKED_1X4, "time_limit_min": 60}, {**SPS, (2,): 1999.99}, 61),                 # 60.0003 min: rounded up
])
def test_a_limit_is_never_shortened(job, sps, limit):
    out = decide(job, sps=sps)
    assert out["action"] == "rewrite" and out["layout"] == [2]
    assert out.get("time_limit_min") == limit
    assert ("time limit" in out["reason"]) == (limit is not None)


@pytest.mark.parametrize("job, sps", [
    (ASKED_1X4, SPS),                                                            # no limit asked
    ({**ASKED_1X4, "time_limit_min": 0}, SPS),                                   # Slurm's 0: none
    ({"min_nodes": 1, "tres_per_node": "gres:gpu:8", "time_limit_min": 60}, SPS),  # 1x8: no such layout
    ({**ASKED_1X4, "time_limit_min": 60}, {**SPS, (4,): 0.0}),                   # asked layout infeasible
])
def test_no_limit_without_an_asked_limit_or_a_prediction_of_the_asked_layout(job, sps):
    out = decide(job, sps=sps)
    assert out["action"] == "rewrite" and "time_limit_min" not in out and "time limit" not in out["reason"]


def test_a_kept_request_and_a_running_job_get_no_limit():
    kept = decide({"min_nodes": 1, "tres_per_node": "gres:gpu:2", "time_limit_min": 60})
    assert kept["action"] == "keep" and "time_limit_min" not in kept
    running = planner.last_step(table(), planner.parse_request({"directives": list(LINES)}).directives,
                                {"nodes": 1, "per_node": 4, "total": 4, "switch": "placed"})
    assert running["action"] == "rewrite" and "time_limit_min" not in running


def test_the_hooks_bands_carry_the_limit_of_each_decision():
    """min_efficiency 0.05 keeps 1x4 (2 -> 4 GPUs at 0.11 passes): no limit; 0.5 takes 1x2: 67 min."""
    d = planner.parse_request({"directives": list(LINES)}).directives
    bands = planner.min_efficiency_bands(table(), d, planner.requested({**ASKED_1X4, "time_limit_min": 60}))
    at = {v: next(b for b in bands if b["above"] < v <= b["upto"]) for v in (0.05, 0.5)}
    assert at[0.05]["action"] == "keep" and "time_limit_min" not in at[0.05]
    assert at[0.5]["time_limit_min"] == 67 and at[0.5]["reason"].endswith("; time limit 60 -> 67 min")


def test_the_service_plans_the_limit_from_the_jobs_time_limit_min():
    """Through parse_request and plan (tests/unit/test_planner.py's fake predictor): the request's job field."""
    from tests.unit.test_planner import decide as plan
    lines = ("#ELASTIC model=resnet50 gpus=1-16 per_gpu_batch=64 min_efficiency=0.75",)
    asked = {"min_nodes": 2, "tres_per_node": "gres:gpu:4"}
    out = plan(*lines, job={**asked, "time_limit_min": 30})
    no_limit = plan(*lines, job=asked)
    sps = {tuple(e["layout"]): e["samples_per_s"] for e in out["curve"]}
    assert out["layout"] == [4] and sps[(4, 4)] > sps[(4,)]
    assert out["time_limit_min"] == math.ceil(30 * sps[(4, 4)] / sps[(4,)]) > 30
    assert "time_limit_min" not in no_limit
