"""CommitSchedule: every rank computes the same commit points from the agreed vote, whatever it measured."""
from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_launcher.commit_schedule import CommitSchedule


def _run(scheds: list[CommitSchedule], step_s: list[float], steps: int, cost_s: float = 0.0) -> list[int]:
    """Drives one schedule per rank through ``steps`` steps (rank r's steps take ``step_s[r]``, a commit point
    costs ``cost_s`` more); votes are a SUM of proposals. Returns the commit points (checked equal on all ranks)."""
    t = [0.0] * len(scheds)
    for s in scheds:
        s.enter(0, 0.0)
    points = []
    for step in range(1, steps + 1):
        due = {s.due(step) for s in scheds}
        assert len(due) == 1, f"ranks disagree whether step {step} is a commit point"
        if due.pop():
            total = sum(s.proposal() for s in scheds)
            for r, s in enumerate(scheds):
                t[r] += step_s[r] + cost_s
                s.committed(step, total, len(scheds), t[r])
            assert len({(s.next_at, s.interval) for s in scheds}) == 1
            points.append(step)
        else:
            for r, s in enumerate(scheds):
                t[r] += step_s[r]
                s.tick(t[r])
    return points


def test_fixed_interval_starts_at_the_epochs_first_step():
    assert _run([CommitSchedule(every=5) for _ in range(3)], [0.01] * 3, 21) == [1, 6, 11, 16, 21]


def test_auto_ramps_by_doubling_to_the_period():
    points = _run([CommitSchedule(period_s=0.5)], [0.05], 80)
    gaps = [b - a for a, b in zip(points, points[1:])]
    assert points[0] == 1
    assert all(b <= 2 * a for a, b in zip(gaps, gaps[1:]))  # never more than doubles
    assert gaps[-1] == 10  # 0.5 s of 50 ms steps


def test_a_costly_commit_point_spreads_the_points_out_to_the_budget():
    # 5 ms per commit point on 10 ms steps: 1% of the time between points needs >= 500 ms, i.e. 50 steps
    s = CommitSchedule(period_s=0.1, overhead_budget=0.01)
    points = _run([s], [0.01], 400, cost_s=0.005)
    assert s.cost_s == pytest.approx(0.005, rel=0.05)
    assert points[-1] - points[-2] == 50


@settings(max_examples=50, deadline=None)
@given(step_s=st.lists(st.floats(1e-4, 2.0), min_size=1, max_size=6), cost=st.floats(0, 0.5),
       max_every=st.integers(1, 64))
def test_ranks_agree_and_the_interval_is_bounded(step_s, cost, max_every):
    scheds = [CommitSchedule(period_s=0.3, max_every=max_every) for _ in step_s]
    points = _run(scheds, step_s, 150, cost_s=cost)
    gaps = [b - a for a, b in zip([0] + points, points)]
    assert all(1 <= g <= max_every for g in gaps)  # a failure loses at most max_every steps


def test_enter_makes_the_next_step_a_commit_point_again():
    s = CommitSchedule(every=8)
    s.enter(0, 0.0)
    s.committed(1, 8, 1, 0.1)
    assert s.next_at == 9 and not s.due(5)
    s.enter(5, 0.2)  # a rollback to step 5, or a new epoch there
    assert s.due(6) and s.interval == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="commit_every 0"):
        CommitSchedule(every=0)
    with pytest.raises(ValueError, match="overhead_budget"):
        CommitSchedule(overhead_budget=1.5)


def test_committed_steps_releases_covered_records_and_drops_rolled_back_ones():
    from elastic_launcher.committed import CommittedSteps
    c = CommittedSteps()
    for s in range(4):  # batches started at 0..3; commit point at 1 covers the batch started at 0
        c.add(s, f"b{s}")
        if s == 0:
            assert c.ready(1, 1) == ["b0"]
    assert c.ready(4, 1) == []  # 1..3 tentative
    assert c.ready(1, 1) == []  # rolled back to 1: b1..b3 dropped
    c.add(1, "b1'")
    assert c.ready(2, 2) == ["b1'"]
    c.add(2, "b2'")
    assert c.rest() == ["b2'"] and c.rest() == []


def test_an_armed_switch_gets_at_least_the_loaders_lead_unless_the_interval_is_fixed():
    auto = CommitSchedule(None, 0.5, 0.01, 256)
    auto.committed(10, 2 * 3, 2, 1.0, at_least=32)
    assert (auto.interval, auto.next_at) == (32, 42)
    auto.committed(42, 2 * 3, 2, 2.0, at_least=1000)
    assert auto.interval == 256  # never past max_every
    fixed = CommitSchedule(5, 0.5, 0.01, 256)
    fixed.committed(10, 2 * 5, 2, 1.0, at_least=32)
    assert fixed.interval == 5


def test_an_armed_switch_comes_after_the_lead_not_after_the_steady_interval():
    # newcomers wait for the switch with their GPUs idle: the proposals (200 steps) are for steady training
    auto = CommitSchedule(None, 0.5, 0.01, 256)
    auto.committed(10, 2 * 200, 2, 1.0, at_least=32)
    assert (auto.interval, auto.next_at) == (32, 42)
    auto.committed(42, 2 * 200, 2, 2.0)
    assert auto.interval == 200


def test_a_prepared_resize_hurries_the_commit_points_within_the_hurry_budget():
    s = CommitSchedule(None, 0.5, 0.01, 256)
    s.interval, s.cost_s = 128, 0.2  # a 0.2 s commit point: 20 s between two at a 1% budget
    s._periods.extend([0.05] * 10)
    assert s.proposal() == 256  # 20 s / 0.05 s, capped by the ramp (2 x 128)
    assert s.proposal(hurry=True) == 40  # 0.2 s / 10% = 2 s: newcomers wait at most that for the ready vote


@pytest.mark.parametrize("field, value, words", [
    ("backend", "mpi", "gloo or nccl"), ("timeout", timedelta(0), "positive timedelta"),
    ("rendezvous_timeout", 5, "positive timedelta"), ("heartbeat_timeout", timedelta(seconds=0.3), "two heartbeat"),
    ("commit_every", 0, ">= 1"), ("commit_overhead", 1.5, "fraction"), ("max_retries", -1, ">= 0"),
    ("bucket_cap_mb", 0, "positive size")])
def test_trainer_config_refuses_what_it_cannot_run_with(field, value, words):
    # #27: TrainerConfig validated none of its timeouts
    from elastic_launcher.trainer import TrainerConfig
    with pytest.raises(ValueError, match=rf"TrainerConfig\.{field}=.*{words}"):
        TrainerConfig(**{field: value})
    TrainerConfig()   # the defaults hold
