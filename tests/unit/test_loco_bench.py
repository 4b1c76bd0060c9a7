"""bench/loco.py, issue 38's headline: each collection held out in turn is predicted from a store without its
multi-GPU rows, and the step model is never worse than the no-fit reference on any collection or transport."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import ladder_repeat  # noqa: E402
import loco  # noqa: E402

# Where the step model (sm-2026.12.02-5, as -3 before it) loses to the reference: the earliest collection, host-bound
# nearly throughout, collected by an earlier collector (its SOURCE.md; commit 8693b77, before 55e8401 pinned each rank
# to its share of the CPUs), whose socket rows ran faster than its own sweep says (at 4 GPUs a comm-bound step took
# 0.83-1.01x, median 0.94, the forward plus the sweep's all-reduce times; medians 1.03-1.17x on the other
# collections). bench/results/loco_consistency.md: its host is unlike the others' (1-GPU window jitter 0.066 against
# 0.002-0.022; fitted on its own rows, DDP's host work 29 us a gradient tensor and no socket contention, kappa 0,
# against 49-87 us and 0.09-0.73), and with those constants the held-out model beats the reference on every transport
# and on decisions (tests/unit/test_loco_consistency.py): the loss is constants that no other collection carries and
# that only a calibration of that host would give. Strict: the day this holds, the test says so and the entry goes.
LOSES = {("coldstart/session7", "transport tcp"), ("coldstart/session7", "same choice @0.7")}

# The step model's figures (bench/results/loco.md, sm-2026.12.02-5): MAPE all (%) at most, the same GPU count as
# measured @0.7 at least, the 80% interval's coverage at least (and at most 95%: an interval that covers every row
# says little). Tighter than -3 where -5 improved (coldstart 4.9 -> 4.7% and 55 -> 57, session13 9.5 -> 9.1%,
# session14 9.8 -> 9.5% and 66 -> 67, session16 6.2 -> 5.6% and 67 -> 68; coverage of session7 38 -> 43%); -3 had
# no such gate. session12's 8.73% is -3's 8.71% within 0.02. sm-2026.12.04-3 (each owner's vote weighed by its
# agreement with the fit, #41.1) traded on purpose: session12 8.7 -> 8.3%, session13 9.1 -> 8.9%; one borderline
# group each at session13 (61 -> 60) and session16 (68 -> 67), session13's coverage 0.78 -> 0.74 (inside 70-90%)
# and session12's 0.82 -> 0.819, against a history of one honest user that one attacker no longer outvotes.
FIGURES = {"coldstart": (4.7, 57, 0.92), "coldstart/session7": (14.1, 28, 0.43), "heldout/session12": (8.4, 61, 0.81),
           "heldout/session13": (8.9, 60, 0.74), "heldout/session14": (9.6, 67, 0.76),
           "heldout/session16": (5.6, 67, 0.86)}


@pytest.fixture(scope="module")
def data():
    return {loco.name_of(p): loco.load(p) for p in loco.collections()}


def test_a_held_out_collection_keeps_only_its_sweeps_ladders_and_profiles(data):
    held = "heldout/session16"
    profiles, obs, rows = loco.held_out_store(data, held)
    mine = {r["profile"] for r in data[held][2]}
    steps = [o for o in obs if o.get("kind") == "step" and o["profile"] in mine]
    assert steps and all(sum(o["layout"]) == 1 for o in steps)          # its 1-GPU ladders, nothing more
    assert rows and all(sum(r["layout"]) > 1 for r in rows) and {r["profile"] for r in rows} == mine
    assert any(o.get("kind") == "step" and sum(o["layout"]) > 1 for o in obs)   # the other collections' history
    assert len({o["uid"] for o in obs}) == len(data)                     # one signer per collection


def test_decisions_compare_the_choices_of_the_plan_policy():
    # a curve that scales at 0.95 to 2 GPUs and 0.5 beyond, measured; predicted as scaling well throughout
    meas = {1: 100.0, 2: 195.0, 4: 290.0}
    assert loco.choice(meas, 0.7) == 2 and loco.choice(meas, 0.4) == 4
    rows = [{"profile": "m", "per_gpu_batch": 10, "intra_link": "l", "layout": [g], "iter_s": g * 10 / x,
             "pred_s": g * 10 / (100.0 * g), "one_pred_s": 0.1} for g, x in meas.items() if g > 1]
    out = loco.decisions(rows, {("m", 10): 0.1})["0.7"]
    assert out["same"] == 0 and out["over"] == 1 and out["over_gpus_pct"] == pytest.approx(100.0)


def test_remeasured_takes_the_one_gpu_step_of_the_groups_smallest_launch():
    # two groups scaling at 0.95 to 2 GPUs: one whose 1-GPU step timed again reads the same, one whose re-timed
    # 1-GPU step is 30% longer (2 GPUs then look superlinear; the measured curve still picks 2: same choice), and a
    # group at 0.8 to 2 GPUs (measured: stay at 1) whose 2-GPU launch timed the 1-GPU step 20% longer (2 GPUs look
    # at 0.96: the choice flips)
    def group(model, eff, solo):
        return [{"profile": model, "per_gpu_batch": 10, "intra_link": "l", "layout": [1], "iter_s": 0.1,
                 "solo_s": None},
                {"profile": model, "per_gpu_batch": 10, "intra_link": "l", "layout": [2], "iter_s": 0.1 / eff,
                 "solo_s": solo},
                {"profile": model, "per_gpu_batch": 10, "intra_link": "l", "layout": [4], "iter_s": 1.0,
                 "solo_s": 10.0}]    # the 4-GPU launch's solo step is not the one read
    steps = group("a", 0.95, 0.1) + group("b", 0.95, 0.13) + group("c", 0.8, 0.12)
    out = loco.remeasured(steps)
    assert out["groups"] == 3 and out["same"]["0.7"] == 2
    assert out["one_gpu_moved_pct"][0] == pytest.approx(20.0)
    assert out["from"] == "solo_s"
    assert loco.remeasured([r | {"solo_s": None} for r in steps]) is None
    # a collection with no solo step at all (session 7): the smallest launch's no_sync() step stands in, labelled
    proxy = loco.remeasured([r | {"solo_s": None, "local_s": r["solo_s"]} for r in steps])
    assert proxy["from"] == "local_s" and proxy["same"] == out["same"] and proxy["groups"] == 3


def test_held_scores_only_the_named_collections_with_the_others_in_the_store(data, capsys):
    out = loco.score("reference", data, ["heldout/session16"])
    assert list(out) == ["heldout/session16"] and out["heldout/session16"]["rows"] == 72
    with pytest.raises(SystemExit):
        loco.main(["--held", "heldout/session99", "--no-write"])
    assert "heldout/session99" in capsys.readouterr().err


@pytest.fixture(scope="module")
def scores(data):
    return loco.score("new", data), loco.score("reference", data)


@pytest.mark.slow
def test_the_step_model_is_never_worse_than_the_no_fit_reference(scores):
    new, ref = scores
    worse = set()
    for held in new:
        for link, value in new[held]["transport"].items():
            if value > ref[held]["transport"][link]:
                worse.add((held, f"transport {link}"))
        if new[held]["all"] > ref[held]["all"]:
            worse.add((held, "all"))
        if new[held]["decisions"]["0.7"]["same"] < ref[held]["decisions"]["0.7"]["same"]:
            worse.add((held, "same choice @0.7"))
    assert worse == LOSES, sorted(worse ^ LOSES)


@pytest.mark.slow
def test_the_step_models_figures_hold_on_every_held_out_collection(scores):
    new, _ = scores
    assert set(new) == set(FIGURES)
    got = {h: (round(s["all"], 2), s["decisions"]["0.7"]["same"], round(s["coverage"], 3)) for h, s in new.items()}
    bad = {h: got[h] for h, (mape, same, cover) in FIGURES.items()
           if got[h][0] > mape or got[h][1] < same or got[h][2] < cover or got[h][2] > 0.95}
    assert not bad, (bad, FIGURES)


CALIBRATION = ROOT / "bench" / "results" / "gpu_runs" / "2026-12-03_session22" / "c1" / "calibrate.jsonl"


def test_a_calibration_covers_a_cold_start_and_the_sites_own_multi_gpu_steps_win_over_it(data):
    # the calibration job's world-1 probes of a fresh H200 host (29 us a gradient tensor) set DDP's host cost while no
    # multi-GPU step ran on H200; once enough did, their fit replaces it (held out on every collection, the history
    # fitted on the others scores 4.7-14.1%, the calibration alone 6.4-15.6%: bench/results/calibration_h200.md)
    import json

    from predictor.engine import Predictor
    from predictor.stepmodel import host_cost_from_probes
    calibration = [json.loads(line) for line in CALIBRATION.read_text().splitlines()]
    probes = host_cost_from_probes(calibration)["H200"]
    profiles, obs, _ = loco.held_out_store(data, "heldout/session16", calibration)
    cold = Predictor().fit(profiles, [r for r in obs if r.get("kind") != "step" or sum(r["layout"]) == 1])
    assert cold.params_.hosts["H200"] == probes
    warm = Predictor().fit(profiles, obs)
    host = warm.params_.hosts["H200"]
    assert host.basis == "fitted" and host.c_tensor > 2 * probes.c_tensor


def test_ladder_repeat_tells_host_bound_rows_from_gpu_bound_ones():
    # batch 8 and 16 flat (the host's), 64 four times batch 16's (the GPU's); launch 2's host runs 20% slower
    one = {("m", 8): 0.010, ("m", 16): 0.011, ("m", 64): 0.044}
    two = {k: v * (1.2 if k[1] < 64 else 1.001) for k, v in one.items()}
    rows = {r["batch"]: r for r in ladder_repeat.spreads([one, two, {**one, ("x", 1): 1.0}])}
    assert set(rows) == {8, 16, 64}                          # only what every launch measured
    assert rows[8]["kind"] == rows[16]["kind"] == "host" and rows[64]["kind"] == "GPU"
    assert rows[16]["spread"] == pytest.approx(0.2) and rows[64]["spread"] == pytest.approx(0.001)
