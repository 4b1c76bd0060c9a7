"""/v1/plan comparing partitions of different GPU types (issue #16): several named partitions or gpu_type=any."""
from __future__ import annotations

import re

import pytest

from predictor import planner
from predictor.cluster import Cluster
from tests.unit._service_fakes import ModelsOverFake


def _cluster(a100_cost: float = 2.0) -> Cluster:
    part = {"gpus_per_node": 4, "intra_link": "nvlink", "inter_link": "ib", "node_hour_cost": 0.0}
    return Cluster.from_dict({"default_partition": "v100", "partitions": [
        {**part, "name": "v100", "nodes": "node[1-2]", "gpu": "V100", "gpu_hour_cost": 1.0},
        {**part, "name": "a100", "nodes": "node[3-4]", "gpu": "A100", "gpu_hour_cost": a100_cost}]})


class TypedModels(ModelsOverFake):
    """resnet50 measured on `known` types; A100 computes `speedup` times faster; an unmeasured type is answered
    with `unmeasured_basis` (the engine's cross-type basis, or `profile` when it cannot)."""

    def __init__(self, known=("V100", "A100"), speedup: float = 2.0,
                 unmeasured_basis: str = "cross-type from V100 (3 models on both)"):
        super().__init__()
        self.known_types, self.speedup, self.unmeasured_basis = set(known), speedup, unmeasured_basis

    def known(self, name, gpu):
        return name == "resnet50" and gpu in self.known_types

    def predict(self, profile, gpu, batch, candidates, job_id=None, uid=None):
        out = self.fake.predict(profile, gpu, batch, candidates)
        for p in out:
            if gpu == "A100":
                p["iter_s"] = p["compute_s"] / self.speedup + p["comm_s"]
                p["samples_per_s"] = sum(p["layout"]) * batch / p["iter_s"]
            p["basis"] = "observed" if gpu in self.known_types else self.unmeasured_basis
        return out


def decide(*lines, job=None, models=None, cluster=None):
    body = {"source": "job_submit", "directives": list(lines), "job": job or {}}
    return planner.plan(planner.parse_request(body), cluster or _cluster(), models or TypedModels(),
                        default_min_efficiency=0.5)


LINE = "#ELASTIC model=resnet50 gpus=4-8 per_gpu_batch=64"


def test_one_partition_answers_as_before():
    one = decide(LINE, job={"partition": "v100"})
    alone = Cluster.from_dict({"default_partition": "v100", "partitions": [_cluster().partition("v100").to_dict()]})
    assert one == decide(LINE, job={}, cluster=alone)
    assert "alternatives" not in one and one["partition"] == "v100"


def test_two_partitions_pick_the_faster_type_with_the_reason():
    out = decide(LINE, job={"partition": "v100,a100"})
    assert out["partition"] == "a100" and out["gpu"] == "A100" and out["action"] == "rewrite"
    assert re.match(r"elastic: partition a100: \dx\d A100 predicted \d\.\dx of v100 \dx\d at \d\.\dx its cost "
                    r"per sample; ", out["reason"]), out["reason"]
    assert {a["partition"] for a in out["alternatives"]} == {"v100", "a100"}
    v100 = next(a for a in out["alternatives"] if a["partition"] == "v100")
    assert out["predicted"]["samples_per_s"] > v100["samples_per_s"]


def test_cost_objective_prefers_the_cheaper_sample():
    line = LINE + " objective=cost"
    dear = decide(line, job={"partition": "v100,a100"}, cluster=_cluster(a100_cost=5.0))  # 2x faster, 5x the price
    cheap = decide(line, job={"partition": "v100,a100"}, cluster=_cluster(a100_cost=1.2))
    assert dear["partition"] == "v100" and cheap["partition"] == "a100"


def test_gpu_type_any_compares_every_partition():
    out = decide(LINE + " gpu_type=any")
    assert out["partition"] == "a100" and len(out["alternatives"]) == 2


def test_a_job_already_sized_right_but_bound_for_the_default_partition_is_moved():
    first = decide(LINE + " gpu_type=any")
    sized = {"min_nodes": first["nodes"], "max_nodes": first["nodes"],
             "tres_per_node": f"gres:gpu:{first['gpus_per_node']}", "req_switch": first["switches"]}
    on_a100 = decide(LINE, job={**sized, "partition": "a100"})
    assert on_a100["action"] == "keep"               # the layout alone would be kept on a100
    out = decide(LINE + " gpu_type=any", job=sized)  # no partition named: it would run on the default, v100
    assert out["partition"] == "a100" and out["action"] == "rewrite"


def test_a_type_never_measured_counts_only_cross_type():
    cross = decide(LINE, job={"partition": "v100,a100"}, models=TypedModels(known=("V100",)))
    assert cross["partition"] == "a100" and "(cross-type from V100 (3 models on both))" in cross["reason"]
    guess = decide(LINE, job={"partition": "v100,a100"},
                   models=TypedModels(known=("V100",), unmeasured_basis="profile"))
    assert guess["partition"] == "v100"
    a100 = next(a for a in guess["alternatives"] if a["partition"] == "a100")
    assert a100["samples_per_s"] is None and "cross-type" in a100["reason"]


@pytest.mark.parametrize("job,lines,reason", [
    ({"partition": "v100,a100"}, (LINE,), "no step history for resnet50 on A100, V100"),
    ({"partition": "t4,p100"}, (LINE,), "partition 't4,p100' has no GPU nodes"),
])
def test_nothing_to_compare_keeps_with_a_reason(job, lines, reason):
    out = decide(*lines, job=job, models=TypedModels(known=()))
    assert out["action"] == "keep" and reason in out["reason"]
