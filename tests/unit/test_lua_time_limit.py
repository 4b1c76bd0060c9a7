"""Issue #40 in job_submit.lua (lua5.1, the driver and fake service of test_lua_hook.py): a rewrite's
`time_limit_min` (the planner computes it) becomes the job's time limit, capped at the lowest MaxTime of the
partitions it may run in (part_list's max_time), never below the job's own; a cap is said in the reason line."""
from __future__ import annotations

import pytest

from tests.unit.test_lua_hook import INFINITE, NO_VAL, PARTS, SLOWER, Predictor, install, job, kinds, run_hook


@pytest.fixture
def predictor():
    server = Predictor()
    yield server
    server.close()


def parts(**max_time):
    return {name: {**p, **({"max_time": max_time[name]} if name in max_time else {})} for name, p in PARTS.items()}


def test_the_replys_limit_is_applied_with_the_rewrite(tmp_path, predictor):
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="slower"), "part_list": parts()}])
    got = result["job_desc"]
    assert got["time_limit"] == 84 and got["tres_per_node"] == "gres:gpu:1"
    assert kinds(result, "user_msg") == [SLOWER["reason"]]
    assert predictor.requests[0]["body"]["job"]["time_limit_min"] == 60


@pytest.mark.parametrize("max_time, partition, limit, note", [
    ({"debug": 70}, "debug", 70, "; time limit capped at partition debug's MaxTime, 70 min"),
    ({"debug": 70}, None, 70, "; time limit capped at partition debug's MaxTime, 70 min"),   # the default one
    ({"debug": 90, "h100": 75}, "debug,h100", 75, "; time limit capped at partition h100's MaxTime, 75 min"),
    ({"debug": 60}, "debug", 60, "; time limit kept at 60 min: partition debug's MaxTime is 60 min"),
    ({"debug": 84}, "debug", 84, ""),
    ({"debug": INFINITE}, "debug", 84, ""),
    ({"h100": 70}, "debug", 84, ""),                                                    # another partition's
])
def test_the_limit_is_capped_at_the_partitions_max_time(tmp_path, predictor, max_time, partition, limit, note):
    case = {"job_desc": job(mode="slower", partition=partition), "part_list": parts(**max_time)}
    [result] = run_hook(install(tmp_path, predictor.url), [case])
    assert result["job_desc"]["time_limit"] == limit
    assert kinds(result, "user_msg") == [SLOWER["reason"] + note]
    assert any(line.endswith(SLOWER["reason"] + note) for line in kinds(result, "log_info"))


def test_a_limit_is_never_shortened_and_a_bad_one_is_not_applied(tmp_path, predictor):
    cases = [{"job_desc": job(mode="slower", time_limit=90)},        # the job's own is longer: kept
             {"job_desc": job(mode="slower", time_limit=NO_VAL)},    # none asked (Slurm's default applies): none set
             {"job_desc": job(mode="badlimit")}]
    longer, unset, bad = run_hook(install(tmp_path, predictor.url), cases)
    assert longer["job_desc"]["time_limit"] == 90 and longer["job_desc"]["tres_per_node"] == "gres:gpu:1"
    assert unset["job_desc"]["time_limit"] == NO_VAL and unset["job_desc"]["tres_per_node"] == "gres:gpu:1"
    assert bad["job_desc"]["time_limit"] == 60 and bad["job_desc"]["tres_per_job"] == "gres:gpu:4"
    assert kinds(bad, "user_msg") == ["elastic: prediction skipped (bad time_limit_min 84.5); job submitted as written"]
