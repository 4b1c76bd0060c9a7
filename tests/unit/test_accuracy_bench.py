"""bench/accuracy.py, issue 38 item 7: public data held out by model. The held-out model's multi-GPU rows never
enter a fit, only its 1-GPU ladder does; the tables score what the fits predicted."""
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import accuracy  # noqa: E402

from predictor import stepmodel as sm  # noqa: E402
from predictor.datasets import Dataset, load_pollux  # noqa: E402
from predictor.engine import Predictor  # noqa: E402
from predictor.profiles import profile_from_spec  # noqa: E402

NAMES = ("resnet50", "vgg16", "resnet18_cifar10")
LAYOUTS = [[1], [2], [1, 1], [2, 2], [1, 3], [1, 1, 3, 3], [1, 3, 1, 3]]


def _dataset() -> Dataset:
    """Three models on 'T4' over pcie / ethernet, steps from the step model at links with no sweep."""
    profiles = {n: dataclasses.replace(profile_from_spec(n), name=n) for n in NAMES}
    ladders = {(n, "T4"): sm.Ladder.from_points({16.0: 0.04 * s, 64.0: 0.12 * s}) for n, s in zip(NAMES, (1, 3, .5))}
    truth = sm.Params(ladders=ladders, links={"ethernet": sm.LinkCost(bw=0.5e9, nu=0.4),
                                              "pcie": sm.LinkCost(bw=3e9)})
    steps = []
    for n in NAMES:
        p = profiles[n]
        for b in (64.0,):
            r = sm.predict_layouts(truth, ladders[(n, "T4")], p, "T4", b, LAYOUTS,
                                   "pcie", "ethernet")
            for lay, t in zip(LAYOUTS, r["iter_s"]):
                steps.append({"kind": "step", "profile": n, "gpu": "T4", "layout": lay, "intra_link": "pcie",
                              "per_gpu_batch": b, "iter_s": float(t), "uid": n,
                              **({"inter_link": "ethernet"} if len(lay) > 1 else {})})
    return Dataset("synthetic", "T4", profiles, steps)


def test_leave_one_model_out_never_fits_the_held_out_models_multi_gpu_rows(monkeypatch):
    ds, seen = _dataset(), []
    real_fit = Predictor.fit

    def recording_fit(self, profiles, observations):
        seen.append(list(observations))
        return real_fit(self, profiles, observations)
    monkeypatch.setattr(Predictor, "fit", recording_fit)
    res = accuracy.protocol_lomo(ds, np.random.default_rng(0))
    assert len(seen) == 2 * len(NAMES)            # per held-out model: the fitted model and the prior
    for i, obs in enumerate(seen):
        held = NAMES[i // 2]
        assert not [o for o in obs if o["profile"] == held and sum(o["layout"]) > 1], held
        assert [o for o in obs if o["profile"] == held]                 # its 1-GPU ladder is posted
        if i % 2 == 0:      # the fitted model sees every row of the other models
            assert len(obs) == sum(1 for r in ds.steps if r["profile"] != held) + sum(
                1 for r in ds.steps if r["profile"] == held and sum(r["layout"]) == 1)
        else:               # the prior sees no multi-GPU row at all
            assert all(sum(o["layout"]) == 1 for o in obs)
    multi = sum(1 for r in ds.steps if sum(r["layout"]) > 1)
    assert res["new"]["rows"] == multi and sum(e["new"]["rows"] for e in res["per_model"].values()) == multi
    # steps made by the model at links the prior does not know: learnt from the other models, the held-out ones
    # are predicted closely; the prior (3 GB/s Ethernet, one copy through the NIC) is far off
    assert res["new"]["mape_pct"] < 5.0 < 15.0 < res["prior"]["mape_pct"], (res["new"], res["prior"])
    assert res["by_nodes"]["across nodes"]["new"]["rows"] == sum(
        1 for r in ds.steps if len(r["layout"]) > 1)


def test_kendall_tau_over_shapes_pools_permutations_and_rows_ties_them():
    rows = [{"profile": "m", "per_gpu_batch": 8, "layout": lay, "iter_s": t} for lay, t in
            (([1, 3], 1.0), ([3, 1], 1.2), ([2, 2], 2.0), ([4], 0.5))]
    exact = accuracy.group_metrics(rows, [r["iter_s"] for r in rows], None)
    assert exact["kendall_tau_shapes"] == pytest.approx(1.0)
    blind = accuracy.group_metrics(rows, [1.0, 1.0, 2.0, 0.5], None)   # permutations predicted alike
    assert blind["kendall_tau_shapes"] == pytest.approx(1.0) and blind["kendall_tau"] < 1.0
    reversed_ = accuracy.group_metrics(rows, [2.0, 2.0, 1.0, 4.0], None)
    assert reversed_["kendall_tau_shapes"] == pytest.approx(-1.0)


@pytest.mark.slow
def test_pollux_t4_leave_one_model_out_gate():
    """The figures bench/results/accuracy.md reports for Pollux T4 (leave-one-model-out), as a floor: the step
    model fitted on the other models beats the class prior, within the MAPE and tau it reached. The issue's
    targets (MAPE <= 10%, tau >= 0.9) are not reached (accuracy.md says how far, and the tau a model reading the
    held-out rows at other batch sizes gets: 0.52); this gate keeps what was."""
    res = accuracy.protocol_lomo(load_pollux(), np.random.default_rng(0))
    assert res["new"]["mape_pct"] <= GATE_MAPE, res["new"]
    assert res["new"]["mape_pct"] < res["prior"]["mape_pct"]
    assert res["new"]["kendall_tau_shapes"] >= GATE_TAU, res["new"]


# bench/results/accuracy_quick.md (sm-2026.12.02-5): MAPE 11.9% (prior 93.2%; -2 and -3 13.0%), tau over shapes
# 0.284 (prior -0.006; the ceiling that reads held-out rows 0.520). The gate sits a little below what was reached.
GATE_MAPE, GATE_TAU = 13.0, 0.25
