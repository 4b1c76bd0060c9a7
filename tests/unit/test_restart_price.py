"""Pricing a restart resize (#43): predictor/restart_price.py and the planner's use of it."""
from __future__ import annotations

import pytest

from predictor import planner
from predictor.errors import ValidationError
from predictor.restart_price import DEFAULT_RESTART_COST_S, measured_cost, price_restart
from slurm_plugin.contracts.records import validate_record
from tests.unit.test_api import AUTH, app, client, seeded  # noqa: F401 (fixtures)
from tests.unit.test_planner import CLUSTER, Models, decide

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


# -- the cluster's measured restart costs (`restart` records) price a job that measured none -----------------------
def _restart(job_id, cost_s, from_nodes=1, to_nodes=2, profile="resnet50"):
    return {"kind": "restart", "from_nodes": from_nodes, "to_nodes": to_nodes, "cost_s": cost_s,
            "checkpointed": True, "job_id": job_id, **({"profile": profile} if profile else {})}


def test_the_measured_cost_is_the_median_of_each_jobs_median_of_the_same_way():
    rows = [_restart(1, 20.0), _restart(1, 22.0), _restart(2, 30.0), _restart(3, 99.0, 2, 1),   # 3: a shrink
            *[_restart(4, 500.0)] * 9]   # one job posting many rows counts once
    cost, note = measured_cost(rows, "resnet50", grow=True)
    assert cost == pytest.approx(30.0) and note == "this cluster's median of 3 job(s)' measured grows of resnet50"
    assert measured_cost(rows, "resnet50", grow=False)[0] == pytest.approx(99.0)
    assert measured_cost([_restart(1, 40.0, profile=None)], "resnet50", grow=True) == \
        (40.0, "this cluster's median of 1 job(s)' measured grows")   # no row of the model: every model's
    assert measured_cost(rows[3:4], "resnet50", grow=True) is None


def test_the_planner_prices_a_restart_with_the_clusters_measured_cost_until_the_job_measured_its_own():
    current = {"layout": [4], "samples_per_s": 6000.0, "remaining_s": 200.0}
    default = decide(GROW, source="launcher", current=current)
    assert default["action"] == "rewrite" and "(the default: none measured yet)" in default["reason"]
    slow = [_restart(1, 120.0), _restart(2, 110.0), _restart(3, 130.0)]
    measured = planner.plan(planner.parse_request({"source": "launcher", "directives": [GROW], "current": current}),
                            CLUSTER, Models(), 0.5, restart_history=lambda: slow)
    assert measured["action"] == "keep" and "120.0 s restart (this cluster's median of 3 job(s)' measured grows " \
        "of resnet50)" in measured["reason"]
    own = planner.plan(planner.parse_request({"source": "launcher", "directives": [GROW],
                                              "current": {**current, "restart_cost_s": 15.0}}),
                       CLUSTER, Models(), 0.5, restart_history=lambda: slow)
    assert own["action"] == "rewrite" and "15.0 s restart (this job's last restart)" in own["reason"]


@pytest.mark.parametrize("field, value, message", [
    ("cost_s", 0, "must be positive"), ("to_nodes", 1, "changes the node count"),
    ("checkpointed", "yes", "true or false"), ("checkpoint_s", 60.0, "[0, cost_s=20]"), ("colour", 1, "unknown")])
def test_a_bad_restart_record_is_refused_naming_the_field(field, value, message):
    with pytest.raises(ValidationError) as err:
        validate_record({**_restart(1, 20.0), field: value}, "observations[0]")
    assert err.value.field == f"observations[0].{field}" and message in str(err.value)


def test_a_posted_restart_cost_changes_the_services_pricing_and_refits_nothing(app, seeded):
    job = {"partition": "debug", "tres_per_node": "gres:gpu:4", "min_nodes": 1, "max_nodes": 2}
    body = {"source": "launcher", "directives": [GROW], "job": job,
            "current": {"layout": [4], "samples_per_s": 6000.0, "remaining_s": 200.0}}
    before = seeded.post("/v1/plan", json=body).get_json()
    assert before["action"] == "rewrite" and "15.0 s restart (the default" in before["reason"]
    generation = seeded.get("/v1/observations").get_json()["generation"]
    posted = seeded.post("/v1/observations", json=[_restart(7, 120.0), _restart(8, 125.0)], headers=AUTH)
    assert posted.status_code == 201 and posted.get_json()["model_version_pending"] == generation
    after = seeded.post("/v1/plan", json=body).get_json()
    assert after["action"] == "keep" and after["layout"] is None
    assert "122.5 s restart (this cluster's median of 2 job(s)' measured grows of resnet50)" in after["reason"]
    assert seeded.get("/v1/observations").get_json()["counts"]["restart"] == 2
