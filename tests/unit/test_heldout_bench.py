"""bench/heldout.py: the strict protocols never fit on what they predict, and a collection's standing follows the
model version it was collected under (freeze-then-score). The step model's gate is bench/loco.py's (test_loco_bench):
the frozen releases' files (heldout_frozen_tm-*.json) are the fitted model's history, kept as written."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import heldout  # noqa: E402
from predictor import stepmodel  # noqa: E402
from tests.unit.test_coldstart_bench import _spy_fits  # noqa: E402  (bench/coldstart.py's Predictor: the same class)

@pytest.fixture(scope="module")
def fresh():
    return heldout.load(heldout.HELDOUT / "session12")


def _cut(data, models=2):
    """Two models of the collection (the protocols' loops, at a tenth of the time)."""
    profiles, coll, steps = data
    keep = sorted(profiles)[:models]
    return {m: profiles[m] for m in keep}, coll, [r for r in steps if r["profile"] in keep]


def test_strict_fits_neither_the_model_nor_the_launch_it_predicts(fresh, monkeypatch):
    profiles, coll, steps = _cut(fresh)
    seen = _spy_fits(monkeypatch)
    out = heldout.strict(profiles, coll, steps)
    assert len(out) == sum(1 for r in steps if sum(r["layout"]) > 1)
    assert len(seen) == len({(r["profile"], r["launch"]) for r in steps if sum(r["layout"]) > 1})
    for obs in seen:
        step_rows = [o for o in obs if o.get("kind") == "step"]
        multi_models = {o["profile"] for o in step_rows if sum(o["layout"]) > 1}
        held = (set(profiles) - multi_models).pop()  # the one model with no multi-GPU row in this fit
        own = [o for o in step_rows if o["profile"] == held]
        assert own and all(sum(o["layout"]) == 1 for o in own)  # its 1-GPU steps only
        launches = {o["launch"] for o in step_rows if sum(o["layout"]) > 1}
        # one multi-GPU launch of the collection is absent from the fit: the one predicted
        all_multi = {r["launch"] for r in steps if sum(r["layout"]) > 1}
        assert len(all_multi - launches) == 1


def test_cold_cluster_fits_no_multi_gpu_step(fresh, monkeypatch):
    profiles, coll, steps = _cut(fresh)
    seen = _spy_fits(monkeypatch)
    out = heldout.cold_cluster(profiles, coll, steps)
    assert len(seen) == 1 and not [o for o in seen[0] if o.get("kind") == "step" and sum(o["layout"]) > 1]
    assert any(o.get("kind") == "collective" for o in seen[0])
    assert len(out) == sum(1 for r in steps if sum(r["layout"]) > 1) and all(t > 0 for _, t in out)


def _collection(tmp_path, version):
    d = tmp_path / (version or "none")
    d.mkdir()
    env = {"kind": "env"} if version is None else {"kind": "env", "model_version_at_collection": version}
    (d / "w1_none.jsonl").write_text(json.dumps(env) + "\n")
    return d


def test_a_collection_is_held_out_only_for_the_version_it_was_collected_under(tmp_path, monkeypatch):
    now = stepmodel.MODEL_VERSION
    assert heldout.standing(_collection(tmp_path, now)) == "held out"
    assert heldout.standing(_collection(tmp_path, "tm-older")) == "seen"
    assert heldout.standing(_collection(tmp_path, None)) == "dev"
    monkeypatch.setattr(heldout, "MODEL_VERSION", "tm-newer")  # a change after the collection: seen
    assert heldout.standing(tmp_path / now) == "seen"


def test_launches_collected_under_two_versions_are_refused(tmp_path):
    d = _collection(tmp_path, "tm-a")
    (d / "w2_nvlink.jsonl").write_text(json.dumps({"kind": "env", "model_version_at_collection": "tm-b"}) + "\n")
    with pytest.raises(ValueError, match="tm-a"):
        heldout.collected_under(d)


def test_regimes_follow_the_one_gpu_ladder():
    rows = [{"profile": "m", "layout": [1], "per_gpu_batch": b, "iter_s": t}
            for b, t in ((16, 0.030), (32, 0.031), (64, 0.050), (128, 0.100))]
    reg = heldout.regimes(rows)
    assert reg[("m", 16)] == "host-bound"  # 1.03x to the next batch
    assert reg[("m", 32)] == reg[("m", 64)] == reg[("m", 128)] == "GPU-bound"  # 1.6x, 2x, and 2x to reach it
