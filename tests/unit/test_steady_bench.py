"""bench/interleaved.py and bench/steady_goodput.py: the steady ratio pools the same rounds on both sides, and
goodput's ideal carries plain DDP's interleaved step to the schedule run's host."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import interleaved  # noqa: E402
import steady_goodput  # noqa: E402


def _block(ms: float) -> dict:
    return {"mean_ms": ms, "host_ms": [0.0] * len(interleaved.PHASES)}


def test_ratio_pools_only_rounds_both_sides_ran():
    blocks = [(0, 2, "trainer", _block(30.0)), (0, 2, "ddp-default", _block(20.0)),
              (1, 2, "trainer", _block(10.0)), (1, 2, "ddp-default", _block(20.0)),
              (2, 2, "trainer", _block(99.0))]  # round 2 has no plain block: left out
    r = interleaved.ratios(blocks, "trainer", "ddp-default")[2]
    assert r["ratio"] == pytest.approx(1.0) and r["rounds"] == 2
    assert sorted(r["round_ratios"]) == pytest.approx([0.5, 1.5])
    assert r["mean_s"] == pytest.approx(0.020) and r["plain_mean_s"] == pytest.approx(0.020)
    rows = interleaved.table(blocks, "ddp-default")
    assert any(row.startswith("| 2 | trainer |") and "| 1.000 |" in row for row in rows)


def _sched(world_by_step: list[int], period: float, commit_every: int = 5) -> dict:
    """A schedule run's records (world, end time, step, commit point, host s in commit, host s in the step)."""
    recs, t = [], 0.0
    for i, w in enumerate(world_by_step, start=1):
        t += period * (1.0 if w == world_by_step[0] else 0.5)
        recs.append((w, t, i, i % commit_every == 0, 1e-5, 1e-3))
    return {"recs": recs, "switches": [], "b": 8, "commit_interval": commit_every, "commit_cost_s": 0.0}


def test_goodput_against_matched_plain_is_the_steady_ratio_inverted_when_nothing_pauses():
    # 60 steps at 1 GPU (0.1 s) then 60 at 2 (0.05 s a step), no pause: ours is exactly steady throughout
    ours = _sched([1] * 60 + [2] * 60, 0.1)
    own = steady_goodput.analyse(ours, {}, ours["b"], [1, 2])
    assert own["steady"][2]["mean_s"] == pytest.approx(0.05)
    inter = {1: {"ratio": 1.25}, 2: {"ratio": 1.25}}   # ours 25% slower than plain DDP in the interleaved blocks
    plain = steady_goodput.matched_plain(own, inter)
    assert plain[2]["mean_s"] == pytest.approx(0.04)
    res = steady_goodput.analyse(ours, plain, ours["b"], [1, 2])
    assert res["steady"][2]["ratio"] == pytest.approx(1.25)
    assert res["goodput"]["ratio"] == pytest.approx(1 / 1.25, rel=1e-3)


def test_a_size_without_an_interleaved_ratio_gets_no_baseline():
    own = {"steady": {1: {"mean_s": 0.1, "median_s": 0.1}, 4: {"mean_s": 0.2, "median_s": 0.2}}}
    assert set(steady_goodput.matched_plain(own, {1: {"ratio": 1.0}})) == {1}
