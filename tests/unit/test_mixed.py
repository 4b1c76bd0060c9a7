"""Mixed GPU types inside one job (issue #16): the balanced prediction and the planner's mixed candidates."""
from __future__ import annotations

import pytest

from slurm_plugin.contracts.batch import split_batch
from predictor import planner
from predictor.cluster import Cluster
from predictor.mixed import balanced, constraint
from slurm_plugin.contracts.batch import type_speeds
from tests.unit._service_fakes import ModelsOverFake

STEP = {"H100": 0.030, "A100": 0.054}   # compute seconds at per-GPU batch 64 (A100 1.8x slower)


def test_balanced_batches_follow_speed_with_the_runtimes_rule():
    m = balanced((2, 2), ("H100", "A100"), STEP, 64, sync_s=0.004)
    assert m.speeds == pytest.approx((1.0, 1.0, 1 / 1.8, 1 / 1.8))
    assert list(m.batches) == split_batch(256, list(m.speeds)) and sum(m.batches) == 256
    assert m.batches[0] > 64 > m.batches[-1]
    # the slowest rank at its batch plus the sync; equal batches wait for the A100 at 64
    assert m.compute_s == pytest.approx(max(b * STEP[t] / 64 for b, t in zip(m.batches, ["H100"] * 2 + ["A100"] * 2)))
    assert m.samples_per_s == pytest.approx(256 / (m.compute_s + 0.004))
    assert m.equal_samples_per_s == pytest.approx(256 / (STEP["A100"] + 0.004))
    assert m.samples_per_s > m.equal_samples_per_s


def test_one_type_balances_to_equal_batches():
    m = balanced((4,), ("H100",), STEP, 64, sync_s=0.002)
    assert m.batches == (64,) * 4 and m.samples_per_s == pytest.approx(m.equal_samples_per_s)


@pytest.mark.parametrize("args, message", [
    (((1, 1), ("H100",), STEP, 64, 0.0), "one GPU type per node"),
    (((1, 1), ("H100", "V100"), STEP, 64, 0.0), "no compute time for GPU type"),
    (((1,), ("H100",), STEP, 64, -1.0), "sync_s"),
])
def test_bad_input_names_what_is_wrong(args, message):
    with pytest.raises(ValueError, match=message):
        balanced(*args)


def test_type_speeds_name_the_bad_type():
    assert type_speeds(STEP) == pytest.approx({"H100": 1.0, "A100": 1 / 1.8})
    with pytest.raises(ValueError, match="'A100'"):
        type_speeds({"H100": 0.03, "A100": 0.0})


def test_constraint_asks_for_counts_of_each_feature():
    assert constraint([("h100", 2), ("a100", 1)]) == "[h100*2&a100*1]"


# ---------------------------------------------------------------- the planner
class TypeModels(ModelsOverFake):
    """resnet50 on H100 and A100: compute 64 samples in STEP[gpu] seconds (linear in batch), sync `sync_s`
    on more than one GPU."""

    def __init__(self, sync_s: float = 0.002):
        super().__init__()
        self.sync_s = sync_s

    def known(self, name, gpu):
        return name == "resnet50" and gpu in STEP

    def predict(self, profile, gpu, batch, candidates, job_id=None, uid=None):
        out = []
        for c in candidates:
            compute = STEP.get(gpu, 1.0) * batch / 64
            sync = self.sync_s if sum(c["layout"]) > 1 else 0.0
            out.append({"layout": c["layout"], "compute_s": compute, "comm_s": sync, "iter_s": compute + sync,
                        "samples_per_s": sum(c["layout"]) * batch / (compute + sync), "uncertainty": 0.1,
                        "basis": "observed"})
        return out


def _cluster(features: bool = True) -> Cluster:
    part = {"gpus_per_node": 4, "intra_link": "nvlink", "inter_link": "ib", "node_hour_cost": 0.0}
    feat = (lambda f: {"feature": f}) if features else (lambda f: {})
    return Cluster.from_dict({"default_partition": "all", "partitions": [
        {**part, "name": "h100", "nodes": "node[1-2]", "gpu": "H100", "gpu_hour_cost": 2.0, **feat("h100")},
        {**part, "name": "a100", "nodes": "node[3-4]", "gpu": "A100", "gpu_hour_cost": 1.0, **feat("a100")},
        {**part, "name": "all", "nodes": "node[1-4]", "gpu": "mixed"}]})


def decide(line, job=None, cluster=None):
    body = {"source": "job_submit", "directives": [line], "job": job or {}}
    return planner.plan(planner.parse_request(body), cluster or _cluster(), TypeModels(), default_min_efficiency=0.5)


def test_more_gpus_than_one_type_has_get_a_mixed_layout_placed_by_constraint():
    out = decide("#ELASTIC model=resnet50 gpus=8-16 per_gpu_batch=64", job={"partition": "h100,a100,all"})
    assert out["action"] == "rewrite" and out["partition"] == "all" and out["constraint"] == "[h100*2&a100*2]"
    assert (out["nodes"], out["gpus_per_node"], out["layout"]) == (4, 4, [4, 4, 4, 4])
    mixed = out["mixed"]
    assert mixed["types"] == ["H100", "H100", "A100", "A100"] and sum(mixed["batches"]) == 16 * 64
    assert mixed["batches"] == split_batch(16 * 64, mixed["speeds"])
    assert mixed["speeds_by_type"] == pytest.approx({"H100": 1.0, "A100": 1 / 1.8}, abs=1e-4)
    h100 = next(a for a in out["alternatives"] if a["partition"] == "h100")
    assert out["predicted"]["samples_per_s"] > h100["samples_per_s"]
    assert out["reason"].startswith("elastic: mixed 2x4 H100 + 2x4 A100 on partition all predicted")
    assert any(a.get("mixed") and a["reason"].endswith("chosen") for a in out["alternatives"])


def test_mixing_that_does_not_pay_is_listed_but_not_chosen():
    out = decide("#ELASTIC model=resnet50 gpus=4-8 per_gpu_batch=64", job={"partition": "h100,a100,all"})
    assert out["partition"] == "h100" and out.get("constraint") is None
    mixed = [a for a in out["alternatives"] if a.get("mixed")]
    assert len(mixed) == 1 and "not chosen" in mixed[0]["reason"]


def test_efficiency_objective_never_mixes_in_a_slower_type():
    out = decide("#ELASTIC model=resnet50 gpus=8-16 per_gpu_batch=64 objective=efficiency gpu_type=any")
    assert out.get("constraint") is None and out["gpu"] == "H100"


@pytest.mark.parametrize("job, cluster", [
    ({"partition": "h100,a100"}, None),           # no named partition holds both types
    ({"partition": "h100,a100,all"}, "plain"),    # the partitions have no node feature to ask Slurm by
])
def test_no_mixing_where_slurm_cannot_be_asked_for_it(job, cluster):
    out = decide("#ELASTIC model=resnet50 gpus=8-16 per_gpu_batch=64", job=job,
                 cluster=_cluster(features=False) if cluster else None)
    assert out.get("constraint") is None and not any(a.get("mixed") for a in out["alternatives"])
