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


def test_goodput_against_measured_plain_with_no_pause_is_the_steady_ratio_inverted():
    # 60 steps at 1 GPU (0.1 s) then 60 at 2 (0.05 s a step), no pause; plain DDP measured at 0.08 / 0.04 s
    ours = _sched([1] * 60 + [2] * 60, 0.1)
    plain = {1: {"mean_s": 0.08, "median_s": 0.08}, 2: {"mean_s": 0.04, "median_s": 0.04}}
    res = steady_goodput.analyse(ours, plain, ours["b"], [1, 2])
    assert res["steady"][2]["ratio"] == pytest.approx(1.25)
    assert res["goodput"]["ratio"] == pytest.approx(1 / 1.25, rel=1e-3)
    assert res["goodput"]["gpu_time_ratio"] == pytest.approx(res["goodput"]["ratio"])  # no newcomer started


def test_gpu_time_goodput_charges_the_newcomers_gpus_from_their_start():
    ours = _sched([1] * 30 + [2] * 60 + [4] * 30, 0.1)
    t_grow = ours["recs"][89][1]  # the 2 -> 4 switch ends step 90
    ours["newcomers_started"] = [ours["recs"][79][1]]  # 10 steps before it, the helper's GPUs are held
    plain = {n: {"mean_s": 0.05, "median_s": 0.05} for n in (1, 2, 4)}
    res = steady_goodput.analyse(ours, plain, ours["b"], [1, 2, 4])
    g = res["goodput"]
    assert g["gpu_time_ideal"] > g["ideal"] and g["gpu_time_ratio"] < g["ratio"]
    held = steady_goodput._gpus_held(ours["recs"], ours["newcomers_started"])
    assert held[80:90] == [4] * 10 and held[79] == 2 and held[90] == 4 and t_grow > 0
    # the extra ideal is exactly those 10 periods at 4 GPUs' rate instead of 2's
    extra = sum(ours["recs"][m][1] - ours["recs"][m - 1][1] for m in range(80, 90)) * (4 - 2) * 8 / 0.05
    assert g["gpu_time_ideal"] - g["ideal"] == pytest.approx(extra)


def test_no_measured_plain_no_goodput():
    ours = _sched([1] * 60 + [2] * 60, 0.1)
    assert steady_goodput.analyse(ours, {}, ours["b"], [1, 2])["goodput"] is None


def test_the_ideal_is_the_faster_plain_run_so_a_drift_between_them_cannot_lift_goodput():
    # ours steps at exactly the speed of plain DDP's faster run; the slower run (the host drifted) must not count
    ours = _sched([1] * 60 + [2] * 60, 0.1)  # 0.1 s at 1 GPU, 0.05 s at 2
    before = {1: {"mean_s": 0.1, "median_s": 0.1, "steps": 9}, 2: {"mean_s": 0.055, "median_s": 0.055, "steps": 9}}
    after = {1: {"mean_s": 0.11, "median_s": 0.11, "steps": 9},
             2: {"mean_s": 0.05, "median_s": 0.05, "steps": 9}}
    plain = steady_goodput.bracket(before, after)
    assert plain[2]["best_s"] == pytest.approx(0.05) and plain[2]["mean_s"] == pytest.approx(0.0525)
    g = steady_goodput.analyse(ours, plain, ours["b"], [1, 2])["goodput"]
    assert g["ratio"] == pytest.approx(1.0, rel=1e-3)  # not above: the mean of the two would say 1.05
    assert g["ratio_vs_mean"] == pytest.approx(0.0525 / 0.05, rel=1e-3)


def test_a_newcomers_startup_is_split_into_phases_from_its_spawn():
    res = {"startup": {"t_proc": 10.5, "t_fn": 13.0, "t_built": 14.0, "t_join": 14.1, "t_joined": 20.1,
                       "t_first_batch": 20.2, "warm_up_s": 1.5, "loader_warm_s": 0.3},
           "switches": [{"kind": "join", "join_s": {"plan_wait_s": 3.0, "group_s": 0.9}}],
           "recs": [(2, 20.4, 1, False, 0.0, 0.0)]}
    s = steady_goodput._startup(10.0, res)
    assert s["interpreter_s"] == pytest.approx(0.5) and s["imports_s"] == pytest.approx(3.0)
    assert s["build_s"] == pytest.approx(1.0) and s["join_s"] == pytest.approx(6.0)
    assert s["plan_wait_s"] == 3.0 and s["spawn_to_first_step_end_s"] == pytest.approx(10.4)
    line = steady_goodput.startup_line("resnet50", [[s]])
    assert "spawn -> first step 10.40 s" in line and "plan wait 3.00" in line
