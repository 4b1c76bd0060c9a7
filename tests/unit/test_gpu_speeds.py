"""Each node's GPU type (Slurm's GRES type) and speed for a mixed-type job (elastic_launcher/gpu_speeds.py)."""
from __future__ import annotations

import pytest

from elastic_launcher.gpu_speeds import GPU_TYPE_ENV, SPEED_ENV, decide_speeds, node_gres_types, worker_speed
from slurm_plugin.client import Node
from slurm_plugin.contracts.tres import gres_gpu_type

STEP = {"H100": 0.030, "A100": 0.054}


def asked(log):
    def compute_s(gpu):
        log.append(gpu)
        return STEP.get(gpu), "predicted" if gpu in STEP else f"no step history on {gpu}"
    return compute_s


def test_two_types_get_the_predictors_relative_speeds_and_their_labels():
    log = []
    types = decide_speeds({"node1": "h100", "node3": "a100"}, asked(log))
    assert sorted(log) == ["A100", "H100"] and types.mixed
    assert types.nodes["node1"].speed == 1.0 and types.nodes["node3"].speed == pytest.approx(1 / 1.8)
    assert types.env("node3") == {SPEED_ENV: repr(types.nodes["node3"].speed), GPU_TYPE_ENV: "A100"}
    assert types.to_record()["nodes"]["node3"] == {"gres_type": "a100", "gpu": "A100", "speed": pytest.approx(1 / 1.8)}
    assert types.source.startswith("predictor: A100 54.0 ms/step")


@pytest.mark.parametrize("gres, why", [
    ({"node1": "h100", "node2": "h100"}, "one GPU type"),
    ({"node1": None, "node2": None}, "no GPU type from Slurm"),
    ({"node1": "h100", "node2": None}, "untyped"),
    ({"node1": "h100", "node2": "v100"}, "V100: no step history on V100"),
])
def test_equal_speeds_with_the_reason_otherwise(gres, why):
    log = []
    types = decide_speeds(gres, asked(log))
    assert {t.speed for t in types.nodes.values()} == {1.0} and why in types.source
    assert bool(log) == ("v100" in gres.values())   # the predictor is asked only for a job of several types


def test_labels_come_from_slurms_gres():
    assert [gres_gpu_type(g) for g in ("gpu:h100:4(S:0)", "gpu:4", "", "gpu:a100:2,gpu:h100:2")] == ["h100", None,
                                                                                                  None, None]
    nodes = [Node("node1", "idle", 4, 0, "leaf1", ("debug",), "h100")]
    assert node_gres_types(nodes, ["node1", "node9"]) == {"node1": "h100", "node9": None}


def test_worker_speed_reads_what_the_launcher_passed():
    assert worker_speed({}) == 1.0 and worker_speed({SPEED_ENV: "0.5556"}) == 0.5556
    for bad in ("fast", "0", "-1", "inf"):
        with pytest.raises(ValueError, match=SPEED_ENV):
            worker_speed({SPEED_ENV: bad})


@pytest.mark.parametrize("declared", ["cpu", "H100"])
def test_a_job_that_names_its_type_is_one_type_whatever_the_gres_says(declared):
    log = []
    types = decide_speeds({"node1": "h100", "node3": "a100"}, asked(log), declared)
    assert not log and not types.mixed   # not asked: one type, equal batches
    assert {t.gpu for t in types.nodes.values()} == {declared} and {t.speed for t in types.nodes.values()} == {1.0}
    assert f"gpu_type={declared}" in types.source and "A100, H100" in types.source
    assert types.nodes["node3"].gres_type == "a100"   # Slurm's label kept beside


@pytest.mark.parametrize("declared", ["any", "unknown", None])
def test_a_job_that_names_no_type_reads_the_nodes_types(declared):
    log = []
    assert decide_speeds({"node1": "h100", "node3": "a100"}, asked(log), declared).mixed
    assert sorted(log) == ["A100", "H100"]
