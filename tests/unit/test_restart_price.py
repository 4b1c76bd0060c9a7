"""Pricing a restart resize (#43): predictor/restart_price.py and the planner's use of it."""
from __future__ import annotations

import pytest

from predictor.errors import ValidationError
from predictor.restart_price import DEFAULT_RESTART_COST_S, price_restart
from tests.unit.test_planner import decide

GROW = "#ELASTIC model=resnet50 gpus=4-8 per_gpu_batch=64 min_efficiency=0.3 mode=restart"


def test_a_resize_that_would_not_pay_back_is_refused():
    # 100 -> 150 samples/s, a 20 s restart, 30 s left: +500 gained against 2000 lost
    price = price_restart(current_rate=100.0, new_rate=150.0, cost_s=20.0, remaining_s=30.0)
    assert not price.pays and price.gained == pytest.approx(500.0) and price.lost == pytest.approx(2000.0)
    assert "would not pay back" in price.note and "20.0 s restart" in price.note


def test_the_same_resize_pays_with_enough_time_left():
    price = price_restart(current_rate=100.0, new_rate=150.0, cost_s=20.0, remaining_s=3600.0)
    assert price.pays and price.gained == pytest.approx(50.0 * 3580.0) and "pays back" in price.note


def test_the_break_even_point_is_refused():
    # gained == lost exactly: no gain, the restart is not worth its risk
    assert not price_restart(100.0, 200.0, 10.0, 20.0).pays
    assert price_restart(100.0, 200.0, 10.0, 20.001).pays


def test_bad_numbers_name_the_argument():
    with pytest.raises(ValueError, match="remaining_s"):
        price_restart(1.0, 2.0, 1.0, -1.0)


def test_the_planner_keeps_a_restart_job_when_the_grow_would_not_pay_back():
    short = decide(GROW, source="launcher", current={"layout": [4], "samples_per_s": 6000.0, "restart_cost_s": 30.0,
                                                      "remaining_s": 40.0})
    assert short["action"] == "keep" and short["nodes"] is None
    assert short["reason"].startswith("elastic: stays on 1 node(s): restart would not pay back")
    assert "30.0 s restart" in short["reason"] and "1x4" in short["reason"]
    long = decide(GROW, source="launcher", current={"layout": [4], "samples_per_s": 6000.0, "restart_cost_s": 30.0,
                                                     "remaining_s": 36000.0})
    assert long["action"] == "rewrite" and long["layout"] == [4, 4] and "restart pays back" in long["reason"]


def test_without_remaining_time_the_resize_stands_and_says_it_was_not_priced():
    out = decide(GROW, source="launcher", current={"layout": [4], "samples_per_s": 6000.0, "restart_cost_s": 30.0})
    assert out["action"] == "rewrite" and "restart not priced" in out["reason"]


def test_an_in_process_job_is_never_priced():
    out = decide(GROW.replace(" mode=restart", ""), source="launcher",
                 current={"layout": [4], "samples_per_s": 6000.0, "restart_cost_s": 30.0, "remaining_s": 40.0})
    assert out["action"] == "rewrite" and "restart" not in out["reason"]


def test_a_restart_job_that_measured_no_cost_yet_is_priced_with_the_default():
    out = decide(GROW, source="launcher", current={"layout": [4], "samples_per_s": 6000.0, "remaining_s": 40.0})
    assert out["action"] == "keep" and f"{DEFAULT_RESTART_COST_S:.1f} s restart" in out["reason"]


@pytest.mark.parametrize("field, value", [("restart_cost_s", -1), ("remaining_s", "soon"), ("restart_cost_s", True)])
def test_bad_restart_fields_are_named(field, value):
    with pytest.raises(ValidationError) as err:
        decide(GROW, source="launcher", current={"layout": [4], field: value})
    assert err.value.field == f"current.{field}"
