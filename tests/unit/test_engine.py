"""Predictor interface: order, keys, basis, uncertainty, fallbacks, validation errors naming fields."""
import dataclasses
import json

import numpy as np
import pytest

from predictor import stepmodel
from predictor.engine import Predictor
from predictor.errors import ValidationError
from predictor.profiles import profile_from_spec

CANDS = [{"layout": [4], "intra_link": "pcie"},
         {"layout": [2, 2], "intra_link": "pcie", "inter_link": "ethernet"},
         {"layout": [1, 1, 1, 1], "intra_link": "pcie", "inter_link": "ethernet"}]


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(0)
    profiles = {"resnet50": profile_from_spec("resnet50"), "bert": profile_from_spec("bert")}
    obs = []
    for name, c1 in (("resnet50", 4e-3), ("bert", 5e-2)):
        for lay in ([1], [2], [4], [1, 1], [2, 2], [1, 1, 1, 1], [4, 4]):
            for b in (8, 16, 32):
                t = 0.02 + c1 * b + (0.01 * max(lay) if sum(lay) > 1 else 0) + 0.08 * (len(lay) > 1)
                obs.append({"kind": "step", "profile": name, "gpu": "T4", "layout": lay, "intra_link": "pcie",
                            "inter_link": "ethernet", "per_gpu_batch": b,
                            "iter_s": t * float(np.exp(0.02 * rng.standard_normal()))})
    for p in (2, 4, 8):
        for nb in (1e5, 1e7, 1e9):
            obs.append({"kind": "collective", "op": "allreduce", "link": "nvlink", "world": p, "bytes": nb,
                        "seconds": 1e-5 * 2 * (p - 1) + 2 * (p - 1) / p * nb / 1e11})
    return Predictor().fit(profiles, obs), profiles, obs


def test_predict_shape_order_and_observed_basis(fitted):
    pred, profiles, obs = fitted
    out = pred.predict(profiles["resnet50"], "T4", 16, CANDS)
    assert [o["layout"] for o in out] == [c["layout"] for c in CANDS]
    for o in out:
        assert set(o) == {"layout", "samples_per_s", "iter_s", "compute_s", "comm_s", "uncertainty", "interval",
                          "basis", "constants"}
        assert o["interval"][0] < o["samples_per_s"] < o["interval"][1]
        assert o["basis"] in ("observed", "measured (1 rows)") and 0 < o["uncertainty"] < 0.5
        assert o["samples_per_s"] == pytest.approx(sum(o["layout"]) * 16 / o["iter_s"])


def test_predicting_a_one_gpu_row_recovers_it_and_multi_gpu_rows_stay_near(fitted):
    pred, profiles, obs = fitted
    steps = [o for o in obs if o["kind"] == "step"]
    rel = {True: [], False: []}
    for o in steps:
        c = {"layout": o["layout"], "intra_link": "pcie", "inter_link": "ethernet"}
        t = pred.predict(profiles[o["profile"]], "T4", o["per_gpu_batch"], [c])[0]["iter_s"]
        rel[sum(o["layout"]) == 1].append(t / o["iter_s"] - 1)
    assert np.max(np.abs(rel[True])) < 1e-9       # the ladder is the measured 1-GPU step, one vote a batch
    assert np.median(np.abs(rel[False])) < 0.25   # 80 ms a multi-node step is past o's bound (20 ms): no more


def test_unseen_profile_and_gpu_fall_back_with_larger_uncertainty(fitted):
    pred, profiles, _ = fitted
    seen = pred.predict(profiles["resnet50"], "T4", 16, CANDS)
    vgg = profile_from_spec("vgg16")
    new = pred.predict(vgg, "T4", 16, CANDS)
    assert all(o["basis"] == "profile" and o["uncertainty"] > s["uncertainty"] for o, s in zip(new, seen))
    assert not pred.known("vgg16", "T4") and pred.known("resnet50", "T4")
    other_gpu = pred.predict(profiles["resnet50"], "H200", 16, CANDS)
    assert other_gpu[0]["basis"] == "profile" and other_gpu[0]["iter_s"] < seen[0]["iter_s"]


def test_an_unswept_link_is_its_class_prior_and_says_so(fitted):
    pred, profiles, _ = fitted
    known = pred.predict(profiles["resnet50"], "T4", 16, CANDS[1:2])[0]
    new = pred.predict(profiles["resnet50"], "T4", 16, [{"layout": [2, 2], "intra_link": "pcie",
                                                          "inter_link": "omni-path-x"}])[0]
    assert known["constants"]["link"] == "fitted" and new["constants"]["link"] == "default"
    assert new["comm_s"] != known["comm_s"]


def test_more_gradient_bytes_never_faster(fitted):
    # the same buckets, each twice the bytes (float64). Not profile_from_spec(dtype="float64"): DDP's cap then cuts
    # other buckets, and a smaller last bucket (7.3 MiB against float32's 9.3) can end the step sooner
    pred, profiles, _ = fitted
    small = profile_from_spec("resnet50")
    big = dataclasses.replace(small, tensors=tuple(dataclasses.replace(x, dtype="float64") for x in small.tensors),
                              buckets_bytes=tuple(2 * b for b in small.buckets_bytes))
    for c in CANDS:
        assert pred.predict(big, "T4", 16, [c])[0]["comm_s"] >= pred.predict(small, "T4", 16, [c])[0]["comm_s"]


def test_link_stats(fitted):
    pred, _, _ = fitted
    stats = {s["link"]: s for s in pred.link_stats()}
    assert {"nvlink", "pcie", "ethernet"} <= set(stats)
    assert stats["nvlink"]["n"] == 9 and stats["nvlink"]["bandwidth_Bps"] > 0
    assert all(s["alpha_s"] > 0 and s["bandwidth_Bps"] > 0 for s in stats.values())


@pytest.mark.parametrize("cand,field", [
    ({"layout": [], "intra_link": "pcie"}, "candidates[0].layout"),
    ({"layout": [2, -1], "intra_link": "pcie", "inter_link": "ib"}, "candidates[0].layout"),
    ({"layout": [2, 2], "intra_link": "pcie"}, "candidates[0].inter_link"),
    ({"layout": [2]}, "candidates[0].intra_link"),
])
def test_bad_candidates_name_the_field(fitted, cand, field):
    pred, profiles, _ = fitted
    with pytest.raises(ValidationError) as e:
        pred.predict(profiles["resnet50"], "T4", 16, [cand])
    assert e.value.field == field


def test_bad_batch_and_unfitted():
    with pytest.raises(RuntimeError, match="not fitted"):
        Predictor().predict(profile_from_spec("resnet50"), "T4", 16, CANDS)
    pred = Predictor().fit({}, [])
    with pytest.raises(ValidationError, match="per_gpu_batch"):
        pred.predict(profile_from_spec("resnet50"), "T4", float("nan"), CANDS)
    out = pred.predict(profile_from_spec("resnet50"), "T4", 16, CANDS)
    assert all(o["basis"] == "profile" and o["iter_s"] > 0 for o in out)


def test_uncertainty_shrinks_as_step_history_grows():
    # steps a DDP step can be (the step model's own at known constants, 2% noise), each job one owner: many of them
    # back the interval with their held-out residuals, one 1-GPU row leaves it at the prior spread
    rng = np.random.default_rng(1)
    profiles = {"resnet50": profile_from_spec("resnet50"), "bert": profile_from_spec("bert")}
    truth = stepmodel.Params(ladders={(n, "T4"): stepmodel.Ladder.from_points({8: a, 16: 2 * a, 32: 4 * a})
                                      for n, a in (("resnet50", 0.04), ("bert", 0.3))},
                             hosts={"T4": stepmodel.HostCost(c_tensor=5e-5)},
                             links={"pcie": stepmodel.LinkCost(alpha=2e-5, bw=8e9, kappa=0.3)})
    obs, job = [], 0
    for name, p in profiles.items():
        for b in (8, 16, 32):
            for lay in ([1], [2], [4]):
                t = stepmodel.predict_layouts(truth, truth.ladders[(name, "T4")], p, "T4", b, [lay], "pcie", None)
                for _ in range(2):
                    job += 1
                    obs.append({"kind": "step", "profile": name, "gpu": "T4", "layout": lay, "intra_link": "pcie",
                                "per_gpu_batch": b, "job_id": job,
                                "iter_s": float(t["iter_s"][0]) * float(np.exp(0.02 * rng.standard_normal()))})
    one = [o for o in obs if o["profile"] == "resnet50"][:1]
    few = Predictor().fit(profiles, one).predict(profiles["resnet50"], "T4", 24, CANDS[:1])[0]  # batch 24: never
    many = Predictor().fit(profiles, obs).predict(profiles["resnet50"], "T4", 24, CANDS[:1])[0]  # measured, modelled
    assert few["basis"] == many["basis"] == "observed"
    assert few["uncertainty"] == pytest.approx(stepmodel.PRIOR_SPREAD["observed"])
    assert few["uncertainty"] > 2 * many["uncertainty"]


def test_permutations_of_a_layout_are_one_prediction(fitted):
    pred, profiles, _ = fitted
    cands = [{"layout": lay, "intra_link": "pcie", "inter_link": "ethernet"} for lay in ([1, 1, 3, 3], [3, 1, 3, 1])]
    a, b = pred.predict(profiles["resnet50"], "T4", 16, cands)
    assert a["iter_s"] == b["iter_s"]


def test_a_fitted_predictor_is_a_json_document_that_predicts_the_same(fitted):
    pred, profiles, _ = fitted
    before = pred.predict(profiles["resnet50"], "T4", 16, CANDS)
    doc = json.loads(json.dumps(pred.to_params()))
    assert doc["model"]["hosts"]["T4"]["basis"] == "fitted" and doc["model"]["version"]
    loaded = Predictor().load_params(doc, profiles)
    assert loaded.predict(profiles["resnet50"], "T4", 16, CANDS) == before
    assert loaded.known("resnet50", "T4") and loaded.link_stats() == pred.link_stats()


def _measured_history(profile_name="resnet50"):
    """A resnet50-like history on T4 (the module fixture's shape) plus one job's own rows on [1, 1] / loopback."""
    rng = np.random.default_rng(3)
    obs = []
    for lay in ([1], [2], [4], [2, 2], [4, 4]):
        for b in (8, 16, 32):
            t = 0.02 + 0.002 * b + (0.01 * max(lay) if sum(lay) > 1 else 0) + 0.08 * (len(lay) > 1)
            obs.append({"kind": "step", "profile": profile_name, "gpu": "T4", "layout": lay, "intra_link": "pcie",
                        "inter_link": "ethernet", "per_gpu_batch": b,
                        "iter_s": t * float(np.exp(0.02 * rng.standard_normal()))})
    return obs


def test_a_measured_layout_is_predicted_at_its_newest_median_and_others_by_the_model():
    from predictor.profiles import Profile
    from tests.unit._service_fakes import PROFILE
    profiles = {"resnet50": Profile.from_dict(PROFILE)}
    obs = _measured_history()
    old = [0.30, 0.31, 0.29]          # an earlier run of [1, 1] on loopback at batch 8
    new = [0.50, 0.52, 0.49, 0.51]    # the job's own, newer: slower than the model or the old run would say
    for t in old + new:
        obs.append({"kind": "step", "profile": "resnet50", "gpu": "T4", "layout": [1, 1], "intra_link": "loopback",
                    "inter_link": "loopback", "per_gpu_batch": 8, "iter_s": t, "job_id": 77})
    pred = Predictor(recent_rows=4).fit(profiles, obs)
    cands = [{"layout": [1, 1], "intra_link": "loopback", "inter_link": "loopback"},
             {"layout": [1, 1, 1], "intra_link": "loopback", "inter_link": "loopback"}]
    two, three = pred.predict(profiles["resnet50"], "T4", 8, cands, job_id=77)
    assert two["iter_s"] == pytest.approx(float(np.median(new)), rel=0.05)   # within 5% of the newest median
    assert two["samples_per_s"] == pytest.approx(2 * 8 / two["iter_s"])
    assert two["basis"] == "measured (4 rows)" and three["basis"] == "observed"
    # a batch that was not measured is the model's answer; so is every layout for anyone but that job (one
    # job's rows never stand in for everybody's answer)
    (other,) = pred.predict(profiles["resnet50"], "T4", 16, cands[:1], job_id=77)
    assert other["basis"] == "observed"
    (stranger,) = pred.predict(profiles["resnet50"], "T4", 8, cands[:1], job_id=78)
    assert stranger["basis"] == "observed" and stranger["iter_s"] != two["iter_s"]


def test_a_layout_measured_below_min_efficiency_is_not_planned_again():
    from predictor import planner
    from predictor.cluster import Cluster
    from predictor.profiles import Profile
    from tests.unit._service_fakes import PROFILE
    profiles = {"resnet50": Profile.from_dict(PROFILE)}
    cluster = Cluster.default()
    gpu, intra, inter = cluster.partition().gpu, cluster.partition().intra_link, cluster.partition().inter_link
    rows = []
    for lay, t in (([1], 0.10), ([2], 0.102), ([4], 0.105), ([2, 2], 0.11)):
        for _ in range(3):  # a history in which crossing nodes scales well
            rows.append({"kind": "step", "profile": "resnet50", "gpu": gpu, "layout": lay, "intra_link": intra,
                         "inter_link": inter, "per_gpu_batch": 64, "iter_s": t})
    for _ in range(3):  # then this job measured 2 nodes: half the throughput of one node
        rows.append({"kind": "step", "profile": "resnet50", "gpu": gpu, "layout": [4, 4], "intra_link": intra,
                     "inter_link": inter, "per_gpu_batch": 64, "iter_s": 0.42, "job_id": 5})

    from tests.unit._service_fakes import FittedModels

    def Models(rows):  # noqa: N802 - reads as the class it stands for
        return FittedModels(Predictor().fit(profiles, rows), profiles)

    body = {"source": "launcher", "directives": ["#ELASTIC model=resnet50 gpus=4-8 per_gpu_batch=64"],
            "job": {"job_id": 5}, "current": {"layout": [4], "per_gpu_batch": 64}}
    asking = dataclasses.replace(planner.parse_request(dict(body)), own_job=5)   # what the API does for the job
    before = planner.plan(asking, cluster, Models(rows[:-3]), default_min_efficiency=0.7)
    after = planner.plan(asking, cluster, Models(rows), default_min_efficiency=0.7)
    assert before["layout"] == [4, 4], before           # the history alone said: two nodes pay
    assert after["layout"] != [4, 4], after             # this job measured them: they did not
    two = next(e for e in after["curve"] if e["gpus"] == 8)
    assert two["samples_per_s"] == pytest.approx(8 * 64 / 0.42, rel=0.05) and two["efficiency"] < 0.7


def test_a_model_that_only_ran_on_several_gpus_gets_its_one_gpu_step_inferred():
    # a job submitted at 4 GPUs posts 4-GPU rows only: without a 1-GPU ladder the planner kept every such job
    profiles = {"resnet50": profile_from_spec("resnet50")}
    coll = [{"kind": "collective", "op": "allreduce", "link": "nvlink", "world": w, "bytes": b,
             "seconds": 2e-5 * 2 * (w - 1) + 2 * (w - 1) / w * b / 100e9} for w in (2, 4) for b in (1e4, 1e6, 1e8)]
    one = {"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [1], "intra_link": "none",
           "per_gpu_batch": 64, "iter_s": 0.05}
    cand = [{"layout": [1], "intra_link": "nvlink"}, {"layout": [4], "intra_link": "nvlink"}]
    truth = Predictor().fit(profiles, coll + [one]).predict(profiles["resnet50"], "H200", 64, cand)
    four = dict(one, layout=[4], intra_link="nvlink", iter_s=truth[1]["iter_s"])
    only = Predictor().fit(profiles, coll + [four])
    assert only.known("resnet50", "H200") and only.params_.ladders[("resnet50", "H200")].basis == "inferred"
    got = only.predict(profiles["resnet50"], "H200", 64, cand)
    assert [g["iter_s"] for g in got] == pytest.approx([t["iter_s"] for t in truth], rel=1e-6)
    assert got[0]["basis"] == "inferred" and got[0]["interval"][1] / got[0]["interval"][0] > \
        truth[0]["interval"][1] / truth[0]["interval"][0]
