"""The /v1/plan policy on the default testbed cluster (4 nodes x 4 GPUs, leaves node[1-2], node[3-4])."""
from __future__ import annotations

import pytest

from elastic_launcher.autoscale import PLANNER, advice_from_plan
from predictor import planner
from predictor.cluster import Cluster
from predictor.errors import ValidationError
from predictor.profiles import Profile
from predictor.service import ModelUnavailable
from tests.unit._service_fakes import PROFILE, FakePredictor

CLUSTER = Cluster.default()


class Models:
    """ModelCache stand-in: a fitted FakePredictor with one known (profile, GPU) pair."""

    version = "g7"

    def __init__(self, ready: bool = True, known: bool = True, **fake):
        self.ready = ready
        self.fake = FakePredictor(**fake).fit({}, [{"kind": "step", "profile": "resnet50", "gpu": "H200"}] if known else [])
        self.profiles = {"resnet50": Profile.from_dict(PROFILE)}

    def predictor(self):
        if not self.ready:
            raise ModelUnavailable("first fit still running")
        return self.fake

    def profile(self, name):
        return self.profiles.get(name)

    def known(self, name, gpu):
        return self.fake.known(name, gpu)

    def predict(self, profile, gpu, batch, candidates, job_id=None, uid=None):
        return self.fake.predict(profile, gpu, batch, candidates)


def decide(*lines, job=None, current=None, source="job_submit", models=None):
    body = {"source": source, "directives": list(lines), "job": job or {}}
    if current is not None:
        body["current"] = current
    return planner.plan(planner.parse_request(body), CLUSTER, models or Models(), default_min_efficiency=0.5)


def test_efficiency_formula_of_or_et_al():
    assert planner._efficiency(100.0, 180.0, 1, 2) == pytest.approx(0.8)
    assert planner._efficiency(400.0, 400.0, 4, 8) == 0.0
    assert planner._efficiency(400.0, 300.0, 4, 8) < 0


def test_layouts_follow_the_node_shapes():
    part = CLUSTER.partition("debug")
    assert part.layouts(8) == [(4, 4), (2, 2, 2, 2)]
    assert part.layouts(4) == [(4,), (2, 2), (1, 1, 1, 1)]
    assert part.layouts(5) == [] and part.layouts(17) == []


def test_cluster_from_what_slurm_reports():
    from slurm_plugin.client import Node, Partition as SlurmPartition

    nodes = [Node(f"node{i}", "idle", 4, 0, "leaf1" if i <= 2 else "leaf2", ("debug",)) for i in range(1, 5)]
    nodes.append(Node("login", "idle", 0, 0, None, ("cpu",)))
    parts = [SlurmPartition("cpu", ("login",), False, "UP"), SlurmPartition("debug", tuple(f"node{i}" for i in range(1, 5)), True, "UP")]
    cluster = Cluster.from_slurm(nodes, parts, gpu="H200", intra_link="nvlink", inter_link="ib")
    assert [p.name for p in cluster.partitions] == ["debug"] and cluster.default_partition == "debug"
    assert cluster.partition().to_dict() == CLUSTER.partition().to_dict()
    with pytest.raises(ValidationError):
        Cluster.from_slurm(nodes[-1:], parts[:1], gpu="H200", intra_link="nvlink", inter_link="ib")


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["partitions"][0].update(gpus_per_node=0), "partitions[0].gpus_per_node"),
    (lambda d: d["partitions"][0].update(switches={"leaf9": "node[7-8]"}), "partitions[0].switches.leaf9"),
    (lambda d: d["partitions"][0].update(nodes="node[1-2],node1"), "partitions[0].nodes"),
    (lambda d: d.update(default_partition="gpu"), "default_partition"),
])
def test_cluster_file_errors_name_the_field(mutate, field):
    data = CLUSTER.to_dict()
    mutate(data)
    with pytest.raises(ValidationError) as info:
        Cluster.from_dict(data)
    assert info.value.field == field


def test_grows_while_efficiency_holds_and_uses_one_leaf():
    out = decide("#ELASTIC model=resnet50 gpus=1-16 per_gpu_batch=64 min_efficiency=0.3",
                 job={"min_nodes": 1, "tres_per_node": "gres:gpu:4"})
    assert out["action"] == "rewrite"
    assert out["layout"] == [4, 4, 4, 4] and out["nodes"] == 4 and out["gpus_per_node"] == 4
    assert out["switches"] is None, "4 nodes do not fit one leaf of 2"
    assert all(p["global_batch"] == 64 * p["gpus"] for p in out["curve"])
    assert {tuple(p["layout"]) for p in out["curve"] if p["gpus"] == 8} == {(4, 4), (2, 2, 2, 2)}


def test_efficiency_threshold_stops_growth_and_says_why():
    out = decide("#ELASTIC model=resnet50 gpus=1-16 per_gpu_batch=64 min_efficiency=0.75")
    assert out["layout"] == [4] and out["switches"] is None
    assert "< 0.75" in out["reason"] and "efficiency" in out["reason"]
    chosen = [p for p in out["curve"] if p["layout"] == [4]][0]
    assert chosen["efficiency"] >= 0.75


def test_max_global_batch_caps_the_gpu_count():
    out = decide("#ELASTIC model=resnet50 gpus=1-16 per_gpu_batch=64 max_global_batch=512 min_efficiency=0")
    assert sum(out["layout"]) == 8 and out["global_batch"] <= 512
    assert "max_global_batch 512" in out["reason"]
    assert max(p["gpus"] for p in out["curve"]) == 8
    assert out["switches"] == 1 and out["layout"] == [4, 4]


def test_two_nodes_ask_for_one_switch():
    out = decide("#ELASTIC model=resnet50 gpus=8 per_gpu_batch=64")
    assert out["layout"] == [4, 4] and out["switches"] == 1 and "one leaf switch" in out["reason"]


def test_efficiency_objective_prefers_fewer_gpus():
    throughput = decide("#ELASTIC model=resnet50 gpus=4-16 per_gpu_batch=64 min_efficiency=0.2")
    efficiency = decide("#ELASTIC model=resnet50 gpus=4-16 per_gpu_batch=64 min_efficiency=0.2 objective=efficiency")
    assert sum(efficiency["layout"]) < sum(throughput["layout"])
    assert efficiency["layout"] == [4] and "objective efficiency" in efficiency["reason"]


def test_keep_global_splits_a_fixed_global_batch():
    out = decide("#ELASTIC model=resnet50 gpus=2-8 per_gpu_batch=64 batch_policy=keep_global min_efficiency=0",
                 job={"min_nodes": 1, "tres_per_node": "gres:gpu:2"})
    assert {p["global_batch"] for p in out["curve"]} == {128}
    assert {p["gpus"] for p in out["curve"]} == {2, 4, 8}


def test_request_that_already_matches_is_kept():
    out = decide("#ELASTIC model=resnet50 gpus=4 per_gpu_batch=64", job={"min_nodes": 1, "tres_per_node": "gres:gpu:4"})
    assert out["action"] == "keep" and out["layout"] == [4] and "already matches" in out["reason"]


@pytest.mark.parametrize("lines,job,models,source,reason", [
    ((), {}, None, "job_submit", "not an elastic job"),
    (("#ELASTIC gpus=2-4",), {}, None, "job_submit", "no model= directive"),
    (("#ELASTIC model=vgg99 per_gpu_batch=8",), {}, None, "job_submit", "unknown model 'vgg99'"),
    (("#ELASTIC model=resnet50 per_gpu_batch=8 gpu_type=T4",), {}, None, "job_submit", "unknown GPU type 'T4'"),
    (("#ELASTIC model=resnet50 per_gpu_batch=8",), {"partition": "gpu"}, None, "job_submit", "partition 'gpu'"),
    (("#ELASTIC model=resnet50 per_gpu_batch=8",), {}, Models(known=False), "job_submit", "no step history"),
    (("#ELASTIC model=resnet50 per_gpu_batch=8",), {}, Models(ready=False), "job_submit", "not ready"),
    (("#ELASTIC model=resnet50",), {}, None, "job_submit", "no per_gpu_batch"),
    (("#ELASTIC model=resnet50 per_gpu_batch=8 gpus=32-64",), {}, None, "launcher", "exceeds partition"),
    # the directives alone cannot say it (no gpus=): the request's 2 x 4 GPUs do
    (("#ELASTIC model=resnet50 per_gpu_batch=64 max_global_batch=100",),
     {"min_nodes": 2, "max_nodes": 2, "tres_per_node": "gres:gpu:4"}, None, "job_submit", "max_global_batch 100"),
    (("#ELASTIC model=resnet50 per_gpu_batch=8 elastic=off",), {}, None, "launcher", "elastic=off"),
])
def test_keep_with_a_reason(lines, job, models, source, reason):
    out = decide(*lines, job=job, models=models, source=source)
    assert out["action"] == "keep" and reason in out["reason"]
    assert out["nodes"] is None and out["curve"] == []


@pytest.mark.parametrize("source", ["job_submit", "cli_filter", "cli"])
@pytest.mark.parametrize("models", [None, Models(ready=False)], ids=["ready", "not-ready"])
def test_gpus_minimum_above_the_partition_is_rejected_at_submit_naming_the_line(source, models):
    """Issue 15.8: `gpus=32-64` on the 16-GPU partition was kept, and the job ran below the user's minimum."""
    with pytest.raises(planner.DirectiveProblem) as info:
        decide("#ELASTIC model=resnet50 per_gpu_batch=8", "#ELASTIC gpus=32-64  # at least 32", source=source,
               models=models)
    assert info.value.field == "directives[1]" and info.value.line == "#ELASTIC gpus=32-64  # at least 32"
    assert str(info.value) == ("line 2: gpus: minimum 32 exceeds the 16 GPUs of partition debug: "
                               "'#ELASTIC gpus=32-64  # at least 32'")


def test_launcher_is_compared_with_its_current_layout():
    grow = decide("#ELASTIC model=resnet50 gpus=4-8 per_gpu_batch=64 min_efficiency=0.3", source="launcher",
                  current={"layout": [4], "samples_per_s": 6000.0})
    assert grow["action"] == "rewrite" and grow["layout"] == [4, 4] and "of 1x4" in grow["reason"]
    stay = decide("#ELASTIC model=resnet50 gpus=4-8 per_gpu_batch=64 min_efficiency=0.3", source="launcher",
                  current={"layout": [4, 4]})
    assert stay["action"] == "keep" and stay["layout"] == [4, 4] and "already matches" in stay["reason"]


def test_launcher_uses_the_current_batch():
    out = decide("#ELASTIC model=resnet50 gpus=4-8", source="launcher",
                 current={"layout": [4], "samples_per_s": 7000.0, "per_gpu_batch": 32})
    assert out["per_gpu_batch"] == 32


def test_malformed_directive_names_item_and_line():
    with pytest.raises(planner.DirectiveProblem) as info:
        planner.parse_request({"directives": ["#ELASTIC model=resnet50", "#ELASTIC gpus=8-2"]})
    assert info.value.field == "directives[1]" and info.value.line == "#ELASTIC gpus=8-2"
    assert "line 2" in info.value.message and "above maximum" in info.value.message
    with pytest.raises(planner.DirectiveProblem) as info:
        planner.parse_request({"directives": ["#SBATCH -N2"]})
    assert info.value.field == "directives[0]"
    with pytest.raises(planner.DirectiveProblem) as info:   # no size fits: refused at parse, on its line
        planner.parse_request({"directives": ["#ELASTIC model=resnet50 per_gpu_batch=64 gpus=8-16",
                                              "#ELASTIC max_global_batch=100"]})
    assert info.value.field == "directives[1]" and "no allowed size fits" in info.value.message


@pytest.mark.parametrize("body,field", [
    ({"directives": "#ELASTIC model=x"}, "directives"),
    ({"directives": [], "job": {"min_nodes": -1}}, "job.min_nodes"),
    ({"directives": [], "job": {"min_nodes": 4, "max_nodes": 2}}, "job.max_nodes"),
    ({"directives": [], "job": {"colour": "blue"}}, "job.colour"),
    ({"directives": [], "source": "sbatch"}, "source"),
    ({"directives": [], "current": {"layout": [0]}}, "current.layout[0]"),
    ({"directives": [], "current": {"layout": [4], "samples_per_s": float("nan")}}, "current.samples_per_s"),
    ({"directives": [], "extra": 1}, "extra"),
])
def test_bad_request_fields(body, field):
    with pytest.raises(ValidationError) as info:
        planner.parse_request(body)
    assert info.value.field == field


def test_slurm_unset_sentinels_read_as_unset():
    request = planner.parse_request({"directives": [], "job": {"min_nodes": 4294967294, "ntasks_per_node": 65534}})
    assert request.job == {"min_nodes": None, "ntasks_per_node": None}


def _interval_table(low_at_8: float) -> dict:
    """A 4-node x 4-GPU partition's table where 8 GPUs predict 1.9x of 4 (efficiency 0.9), its interval's lower
    end at `low_at_8` samples/s."""
    entries = [{"layout": [4], "samples_per_s": 1000.0, "samples_low": 900.0},
               {"layout": [4, 4], "samples_per_s": 1900.0, "samples_low": low_at_8}]
    return {"partition": "p", "total_gpus": 8, "nodes": 2, "gpus_per_node": 4, "one_leaf_nodes": 0,
            "gpu_hour_cost": 0.0, "node_hour_cost": 0.0, "min_efficiency": 0.7, "per_gpu_batch": 16,
            "entries": entries, "model": "m", "gpu": "g"}


def test_a_running_job_grows_only_where_the_interval_s_lower_end_passes_min_efficiency():
    d = {"min_efficiency": 0.7, "gpus": {"min": 4, "max": 8}}
    running = {"nodes": 1, "per_node": 4, "total": 4, "switch": "placed"}
    sure = planner.last_step(_interval_table(1800.0), d, running)             # lower end: efficiency 0.8
    assert sure["layout"] == [4, 4] and "uncertain" not in sure["reason"]
    unsure = planner.last_step(_interval_table(1500.0), d, running)           # lower end: efficiency 0.5
    assert unsure["layout"] == [4] and unsure["action"] == "keep"
    assert "grow to 2x4 uncertain: efficiency at the 80% interval's lower end 0.50 < 0.7" in unsure["reason"]
    submit = planner.last_step(_interval_table(1500.0), d, {"nodes": 1, "per_node": 4, "total": 4, "switch": None})
    assert submit["layout"] == [4, 4] and "uncertain: efficiency at the 80% interval's lower end 0.50" in submit["reason"]
    assert [e.get("samples_low") for e in submit["curve"]] == [900.0, 1500.0]


def test_a_gpu_count_without_a_node_shape_is_kept_at_that_count():
    """`--gpus=4` planned at 4 GPUs keeps the request (Slurm places them; a pinned 1x4 waits for a free node); a
    plan of another count, or a request with a node shape, is rewritten as before."""
    kept = decide("#ELASTIC model=resnet50 per_gpu_batch=64", job={"tres_per_job": "gres:gpu:4"})
    assert kept["action"] == "keep" and kept["layout"] == [4] and "placed by Slurm" in kept["reason"]
    grown = decide("#ELASTIC model=resnet50 per_gpu_batch=64 gpus=4-8 min_efficiency=0",
                   job={"tres_per_job": "gres:gpu:4"})
    assert grown["action"] == "rewrite" and sum(grown["layout"]) == 8
    shaped = decide("#ELASTIC model=resnet50 per_gpu_batch=64", job={"min_nodes": 2, "tres_per_node": "gres:gpu:2"})
    assert shaped["action"] == "rewrite" and shaped["layout"] == [4]


def _uneven_table(at_6: float, low_at_6: float) -> dict:
    """A partition of 4-GPU nodes whose table has 3 and 6 GPUs as 1x3 and 2x3 only (no 4+2: layouts are uniform)."""
    entries = [{"layout": [3], "samples_per_s": 1000.0, "samples_low": 950.0},
               {"layout": [3, 3], "samples_per_s": at_6, "samples_low": low_at_6}]
    return {"partition": "p", "total_gpus": 8, "nodes": 2, "gpus_per_node": 4, "one_leaf_nodes": 0,
            "gpu_hour_cost": 0.0, "node_hour_cost": 0.0, "min_efficiency": 0.5, "per_gpu_batch": 16,
            "entries": entries, "model": "m", "gpu": "g"}


def test_a_running_job_on_a_layout_the_table_lacks_is_judged_at_its_own_gpu_count():
    """Slurm places `--gpus=6` as 4+2, a layout no table row has. The running job was compared with the smallest
    count (1x3), its own size read as an uncertain grow from there, and it was planned down to 3 GPUs, which the
    launcher takes as 1 node of 4 (Pollux replay: 166 such runtime plans). At the count it runs it keeps."""
    d = {"min_efficiency": 0.5, "gpus": {"min": 3, "max": 6}}
    running = {"nodes": 2, "per_node": 4, "total": 6, "switch": "placed"}
    kept = planner.last_step(_uneven_table(1900.0, 1300.0), d, running)   # lower end: efficiency 0.3
    assert kept["action"] == "keep" and sum(kept["layout"]) == 6
    assert "the job's 6 GPUs are the plan's count" in kept["reason"] and "uncertain" not in kept["reason"]
    assert advice_from_plan(kept, 2, 4).nodes == 2 and advice_from_plan(kept, 2, 4).source == PLANNER
    shrunk = planner.last_step(_uneven_table(1200.0, 1150.0), d, running)   # 3 -> 6 efficiency 0.2: fewer GPUs
    assert shrunk["action"] == "rewrite" and shrunk["layout"] == [3]
