"""bench/coldstart.py: the committed GPU data loads, and the protocol never trains on what it predicts."""
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import coldstart  # noqa: E402


@pytest.fixture(scope="module")
def data():
    return coldstart.load(coldstart.DATA)


def test_committed_data_has_every_transport_and_size(data):
    profiles, coll, steps = data
    assert len(profiles) >= 4
    assert {(c["link"], c["world"]) for c in coll} == {(l, w) for l in ("nvlink", "shm", "tcp") for w in (2, 4)}
    for m in profiles:
        sizes = {(sum(r["layout"]), r["intra_link"]) for r in steps if r["profile"] == m}
        assert {(1, coldstart.ONE_GPU_LINK)} | {(w, l) for w in (2, 4) for l in ("nvlink", "shm", "tcp")} <= sizes


def _spy_fits(monkeypatch) -> list:
    """The observations of every Predictor.fit the bench makes, in order (on this thread: a service's refit thread
    that an earlier test in this process left running fits too, and is not the bench)."""
    seen = []
    real_fit = coldstart.Predictor.fit
    caller = threading.current_thread()

    def spy(self, profs, obs):
        if threading.current_thread() is caller:
            seen.append(obs)
        return real_fit(self, profs, obs)
    monkeypatch.setattr(coldstart.Predictor, "fit", spy)
    return seen


def test_a_model_is_predicted_without_its_multi_gpu_rows(data, monkeypatch):
    profiles, coll, steps = data
    seen = _spy_fits(monkeypatch)
    out = coldstart.cold_start(profiles, coll, steps, {})
    assert len(out) == sum(1 for r in steps if sum(r["layout"]) > 1)
    for obs in seen:
        train_multi = {o["profile"] for o in obs if o.get("kind") == "step" and sum(o["layout"]) > 1}
        assert len(train_multi) == len(profiles) - 1  # every model's multi-GPU rows but the held-out one's
        held = (set(profiles) - train_multi).pop()
        assert any(o.get("profile") == held and sum(o["layout"]) == 1 for o in obs)  # its 1-GPU rows stay
    assert all(t > 0 for _, t in out)


@pytest.mark.slow  # the bench's protocol B: 30 predictor fits, 1.7-2.3 s
def test_same_launch_protocol_sees_only_the_launchs_compute_of_the_held_out_model(data, monkeypatch):
    profiles, coll, steps = data
    seen = _spy_fits(monkeypatch)
    out = coldstart.cold_start(profiles, coll, steps, {}, same_launch=True)
    assert len(out) == sum(1 for r in steps if sum(r["layout"]) > 1)
    launches = {(r["profile"], r["launch"]) for r in steps if sum(r["layout"]) > 1}
    assert len(seen) == len(launches)  # one fit per (held-out model, launch)
    for obs in seen:
        train_multi = {o["profile"] for o in obs if o.get("kind") == "step" and sum(o["layout"]) > 1}
        held = (set(profiles) - train_multi).pop()
        own = [o for o in obs if o.get("kind") == "step" and o["profile"] == held]
        assert own and all(sum(o["layout"]) == 1 for o in own)
        assert len({o["launch"] for o in own}) == 1 and not own[0]["launch"].startswith("w1_")  # that launch's
        source = {(r["launch"], r["per_gpu_batch"]): r for r in steps if r["profile"] == held}
        for o in own:  # its 1-GPU step in that launch (else its compute there), never the launch's step time
            src = source[(o["launch"], o["per_gpu_batch"])]
            assert o["iter_s"] == (src["solo_s"] or src["local_s"]) and o["iter_s"] != src["iter_s"]
