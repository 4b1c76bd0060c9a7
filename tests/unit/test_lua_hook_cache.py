"""The job_submit hook's decision cache, in lua5.1 with the stub `slurm` table of test_lua_hook.py.

The fake service picks its reply by job name, which is not part of the cache key (the plan does not read
it): a second submission named `mode-500` that is served from the cache proves that no request was sent.
"""
from __future__ import annotations

import json
import pathlib

import pytest

from predictor import planner
from tests.unit.test_lua_hook import (BANDS, BANDS_JOB, BANDS_LINES, MAX_GPUS_PER_NODE, TABLE, Predictor, install, job,
                                     kinds, run_hook)

CACHED = Predictor.REPLIES["cached"]


@pytest.fixture
def predictor():
    server = Predictor()
    yield server
    server.close()


def names(predictor):
    return [r["body"]["job"]["name"] for r in predictor.requests]


def test_identical_request_reuses_the_decision_without_a_call(tmp_path, predictor):
    results = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="cached")},
                                                          {"job_desc": job(mode="500")}])
    assert names(predictor) == ["mode-cached"]
    first, second = (r["job_desc"] for r in results)
    # applied fully: the same rewrite, environment and decision id in the comment
    assert {k: v for k, v in second.items() if k != "name"} == {k: v for k, v in first.items() if k != "name"}
    assert second["comment"] == "my run elastic:decision=d-44" and second["min_nodes"] == 2
    assert second["environment"]["SLURM_GPUS_PER_NODE"] == "2"
    assert kinds(results[1], "user_msg") == [CACHED["reason"] + " (cached)"]
    assert any("rewrite, cached" in line for line in kinds(results[1], "log_info"))


@pytest.mark.parametrize("field, value", [
    ("directives", ("#ELASTIC model=resnet50 gpus=2-16",)), ("user_name", "bob"), ("partition", "gpu"),
    ("min_nodes", 2), ("max_nodes", 2), ("ntasks_per_node", 4), ("tres_per_job", "gres:gpu:8"),
    ("tres_per_node", "gres:gpu:2"), ("time_limit", 61), ("req_switch", 1), ("account", "proj"), ("qos", "high")])
def test_any_decision_relevant_field_misses(tmp_path, predictor, field, value):
    second = job(mode="cached")
    if field == "directives":
        second = job(mode="cached", directives=value)
    else:
        second[field] = value
    run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="cached")}, {"job_desc": second}])
    assert names(predictor) == ["mode-cached", "mode-cached"]


def test_the_key_is_built_once_a_submission(tmp_path, predictor):
    """#26: the key was built for the lookup and again to keep the reply (twice more with bands)."""
    cases = [{"job_desc": job(mode="cached")}, {"job_desc": job(mode="cached")},              # kept, then hit
             {"job_desc": bands_job("bands")}, {"job_desc": bands_job("500", "0.3")}]       # bands kept, then used
    results = run_hook(install(tmp_path, predictor.url), cases)
    assert names(predictor) == ["mode-cached", "mode-bands"]
    assert [r["key_builds"] for r in results] == [1, 1, 1, 1]


def test_the_submitting_uid_is_in_the_key(tmp_path, predictor):
    """A user's own profile plans only that user's jobs (#24.6), so a decision kept for one uid never answers
    another's identical request (the service then gives such decisions the normal cache_ttl_s)."""
    cases = [{"job_desc": job(mode="cached"), "uid": 1001}, {"job_desc": job(mode="cached"), "uid": 1002},
             {"job_desc": job(mode="500"), "uid": 1001},                                  # 1001's again: kept
             {"job_desc": bands_job("bands"), "uid": 1001}, {"job_desc": bands_job("bands", "0.3"), "uid": 1002}]
    results = run_hook(install(tmp_path, predictor.url), cases)
    assert names(predictor) == ["mode-cached", "mode-cached", "mode-bands", "mode-bands"]
    assert results[2]["job_desc"]["comment"] == "my run elastic:decision=d-44"
    assert [r["body"]["job"]["uid"] for r in predictor.requests] == [1001, 1002, 1001, 1002]


def test_ttl_expires_and_zero_or_absent_ttl_disables(tmp_path, predictor):
    conf = install(tmp_path, predictor.url)
    cases = [{"job_desc": job(mode="cached-short")}, {"job_desc": job(mode="cached-short")},           # hit
             {"job_desc": job(mode="cached-short"), "advance": 0.4},                                    # expired
             {"job_desc": job(mode="cached-zero", time_limit=5)}, {"job_desc": job(mode="cached-zero", time_limit=5)},
             {"job_desc": job(mode="rewrite", time_limit=6)}, {"job_desc": job(mode="rewrite", time_limit=6)}]
    results = run_hook(conf, cases)
    assert names(predictor) == ["mode-cached-short", "mode-cached-short", "mode-cached-zero", "mode-cached-zero",
                                "mode-rewrite", "mode-rewrite"]
    assert all(r["job_desc"]["min_nodes"] == 2 for r in results)


def test_a_nan_ttl_is_not_kept_and_a_huge_one_at_most_an_hour(tmp_path, predictor):
    """#41.7: `cache_ttl_s: NaN` compared false with every bound and pinned a decision past MAX_TTL_S (31 days
    seen); now a TTL that is not a positive number keeps nothing, and any TTL is held to an hour."""
    conf = install(tmp_path, predictor.url)
    cases = [{"job_desc": job(mode="cached-nan")}, {"job_desc": job(mode="cached-nan"), "advance": 1},
             {"job_desc": job(mode="cached-huge", time_limit=7)},
             {"job_desc": job(mode="cached-huge", time_limit=7), "advance": 3599},     # an hour on: still kept
             {"job_desc": job(mode="cached-huge", time_limit=7), "advance": 2}]        # past it: asked again
    run_hook(conf, cases)
    assert names(predictor) == ["mode-cached-nan", "mode-cached-nan", "mode-cached-huge", "mode-cached-huge"]


def test_keep_decisions_are_reused_too(tmp_path, predictor):
    results = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="cached-keep")},
                                                          {"job_desc": job(mode="500")}])
    assert names(predictor) == ["mode-cached-keep"]
    assert results[1]["job_desc"]["comment"] == "my run elastic:decision=d-47"
    assert results[1]["job_desc"]["min_nodes"] == 1


def test_failures_are_never_cached_and_a_hit_survives_an_open_breaker(tmp_path, predictor):
    conf = install(tmp_path, predictor.url, failures=1, open_s=30)
    cases = [{"job_desc": job(mode="cached")},                       # cached d-44
             {"job_desc": job(mode="500", time_limit=7)},            # failure: breaker opens
             {"job_desc": job(mode="cached", time_limit=7)},         # same request: not cached, breaker open
             {"job_desc": job(mode="500")}]                          # the cached request: still rewritten
    results = run_hook(conf, cases)
    assert names(predictor) == ["mode-cached", "mode-500"]
    assert "predictor unavailable" in kinds(results[2], "user_msg")[0]
    assert results[2]["job_desc"]["min_nodes"] == 1
    assert results[3]["job_desc"]["comment"] == "my run elastic:decision=d-44"


def test_reuse_counts_ride_on_the_next_real_request_and_survive_a_failure(tmp_path, predictor):
    conf = install(tmp_path, predictor.url)
    cases = [{"job_desc": job(mode="cached")}, {"job_desc": job(mode="x")}, {"job_desc": job(mode="x")},
             {"job_desc": job(mode="500", time_limit=8)},            # carries the counts, fails: kept
             {"job_desc": job(mode="cached", time_limit=9)},         # carries them again, delivered
             {"job_desc": job(mode="cached", time_limit=10)}]        # nothing left to report
    run_hook(conf, cases)
    bodies = [r["body"] for r in predictor.requests]
    assert [b.get("reused") for b in bodies] == [None, {"d-44": 2}, {"d-44": 2}, None]
    for body in bodies:
        planner.parse_request(body)    # the service accepts the field


@pytest.mark.parametrize("entries, asked", [(2, [1, 2, 3, 1]), (0, [1, 2, 1, 3, 1])], ids=["full-emptied", "off"])
def test_cache_size_from_the_installer(tmp_path, predictor, entries, asked):
    from datetime import timedelta

    from slurm_plugin.installer import PluginConfig
    from slurm_plugin.installer import install as install_plugin

    install_plugin(PluginConfig(tmp_path, predictor.url, timedelta(milliseconds=100), cache_entries=entries,
                                max_gpus_per_node=MAX_GPUS_PER_NODE), sleep=lambda _s: None)   # no slurmctld to wait for
    cases = [{"job_desc": job(mode="cached", time_limit=t)} for t in (1, 2, 1, 3, 1)]   # 2 entries: 3rd empties it
    run_hook(tmp_path, cases)
    assert [r["body"]["job"]["time_limit_min"] for r in predictor.requests] == asked


def test_with_no_answer_to_confirm_the_jobs_are_read_for_claims_at_most_every_10_s(tmp_path, predictor):
    # #42.6: claims cost a read of slurmctld's jobs (every job id); with no kept answer to confirm (the cache off
    # here) it is done at most every 10 s: the 3rd ask, 11 s after the 1st, names d-44, which the jobs hold
    from datetime import timedelta

    from slurm_plugin.installer import PluginConfig
    from slurm_plugin.installer import install as install_plugin

    install_plugin(PluginConfig(tmp_path, predictor.url, timedelta(milliseconds=100), cache_entries=0,
                                max_gpus_per_node=MAX_GPUS_PER_NODE), sleep=lambda _s: None)
    run_hook(tmp_path, [{"job_desc": job(mode="cached")}, {"job_desc": job(mode="cached"), "advance": 5},
                        {"job_desc": job(mode="cached"), "advance": 6}])
    assert [r["claimed"] for r in predictor.requests] == [None, None, "d-44"]


def test_reuse_counts_survive_a_422(tmp_path, predictor):
    cases = [{"job_desc": job(mode="cached")}, {"job_desc": job(mode="x")},
             {"job_desc": job(mode="422", time_limit=8)},            # rejected: the service stored nothing
             {"job_desc": job(mode="cached", time_limit=9)}]
    results = run_hook(install(tmp_path, predictor.url), cases)
    assert results[2]["rc"] != 0
    assert [r["body"].get("reused") for r in predictor.requests] == [None, {"d-44": 1}, {"d-44": 1}]


def bands_job(mode, efficiency="0.5", bounds="gpus=2-8", **fields):
    return job(mode=mode, directives=(BANDS_LINES[0], f"#ELASTIC {bounds} min_efficiency={efficiency}"), **fields)


@pytest.mark.parametrize("efficiency", ["0.2", "0.71", "0.5000017", "0.95", "0", "1"])
def test_bands_decide_other_min_efficiency_without_a_call(tmp_path, predictor, efficiency):
    """Issue 14.10 / 26.3: requests that differ only in min_efficiency (the decision cache cannot answer) are
    answered from the decisions the service precomputed for every min_efficiency (`bands`): the hook looks one
    up, validates and applies it; the decision and reason are what the service gives for that request."""
    results = run_hook(install(tmp_path, predictor.url), [{"job_desc": bands_job("bands")},
                                                          {"job_desc": bands_job("500", efficiency)}])
    assert names(predictor) == ["mode-bands"]
    d = planner.parse_request({"directives": [BANDS_LINES[0], f"#ELASTIC gpus=2-8 min_efficiency={efficiency}"]})
    expect = planner.last_step(TABLE, d.directives, planner.requested(BANDS_JOB))
    got = results[1]["job_desc"]
    assert got["min_nodes"] == got["max_nodes"] == expect["nodes"]
    assert got["tres_per_node"] == f"gres:gpu:{expect['gpus_per_node']}" and got.get("req_switch") == expect["switches"]
    assert got["comment"] == "my run elastic:decision=d-48"
    assert kinds(results[1], "user_msg") == [expect["reason"] + " (cached predictions)"]


@pytest.mark.parametrize("second", [
    {"bounds": "gpus=2-16"}, {"bounds": "gpus=2-8 objective=cost"}, {"bounds": "gpus=2-8 batch_policy=keep_global"},
    {"time_limit": 7}, {"partition": "gpu"}, {"user_name": "bob"}, {"efficiency": None}])
def test_bands_answer_only_their_own_request(tmp_path, predictor, second):
    fields = dict(second)
    if fields.get("efficiency", "") is None:      # no min_efficiency line at all: its own request
        other = job(mode="bands", directives=(BANDS_LINES[0], "#ELASTIC gpus=2-8"))
    else:
        other = bands_job("bands", fields.pop("efficiency", "0.3"), fields.pop("bounds", "gpus=2-8"), **fields)
    run_hook(install(tmp_path, predictor.url), [{"job_desc": bands_job("bands")}, {"job_desc": other}])
    assert names(predictor) == ["mode-bands", "mode-bands"]


def test_bands_expire_with_their_ttl_and_their_uses_are_reported(tmp_path, predictor):
    cases = [{"job_desc": bands_job("bands-short")},
             {"job_desc": bands_job("500", "0.3")},                          # from the bands
             {"job_desc": bands_job("bands", "0.4"), "advance": 0.4}]       # expired
    run_hook(install(tmp_path, predictor.url), cases)
    assert names(predictor) == ["mode-bands-short", "mode-bands"]
    assert predictor.requests[1]["body"]["reused"] == {"d-49": 1}


def test_an_older_services_prediction_table_decides_nothing(tmp_path, predictor):
    run_hook(install(tmp_path, predictor.url), [{"job_desc": bands_job("table")}, {"job_desc": bands_job("rewrite", "0.3")}])
    assert names(predictor) == ["mode-table", "mode-rewrite"]


# #24.5 / #26.3: what a hostile or broken service put in bands is validated before it is applied, like a fresh reply
HOSTILE = {"zero-nodes": {"nodes": 0}, "fraction": {"gpus_per_node": 2.5}, "action": {"action": "grow"},
           "switches": {"switches": -1}, "partition": {"partition": "a;b"}, "interval": {"above": "0"},
           "reason": {"reason": None},
           # beyond the partition (the testbed's debug: 4 nodes x 4 GPUs): Slurm would refuse the job
           "gpus-beyond-node": {"gpus_per_node": 8}, "nodes-beyond-partition": {"nodes": 8}}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_band_is_never_applied(tmp_path, predictor, case):
    hostile = [{**band, **HOSTILE[case]} for band in BANDS]
    Predictor.REPLIES[f"bands-{case}"] = {**Predictor.REPLIES["bands"], "bands": hostile}
    try:
        results = run_hook(install(tmp_path, predictor.url), [{"job_desc": bands_job(f"bands-{case}")},
                                                              {"job_desc": bands_job("rewrite", "0.3")}])
    finally:
        del Predictor.REPLIES[f"bands-{case}"]
    assert names(predictor) == [f"mode-bands-{case}", "mode-rewrite"]   # asked, not decided from the band
    assert results[1]["job_desc"]["min_nodes"] == Predictor.REPLIES["rewrite"]["nodes"]


def test_a_reply_larger_than_the_hook_reads_is_skipped(tmp_path, predictor):
    results = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="huge")}])
    msg = kinds(results[0], "user_msg")[0]
    assert msg.startswith("elastic: prediction skipped (reply of ") and "more than 524288" in msg
    assert results[0]["job_desc"]["min_nodes"] == 1  # submitted as written


def test_a_test_only_answer_is_not_reused_and_the_jobs_decisions_are_claimed(tmp_path, predictor):
    # #42.6: job_submit cannot tell `sbatch --test-only` (Slurm 22.05: the same job_desc, no job follows). Its kept
    # answer is reused only once a job holds the decision (slurm.jobs), so the next identical real job asks the
    # service (a decision of its own, not "(cached)" from the test); the decision ids jobs hold go to the service
    # as claims with the next ask (X-Elastic-Claimed), so the test's stays unclaimed and expires there.
    cases = [{"job_desc": job(mode="cached"), "test_only": True},   # d-44, no job follows
             {"job_desc": job(mode="cached")},                      # asks again: d-44 again from the fake
             {"job_desc": job(mode="500")},                         # a job holds d-44 now: reused, no request
             {"job_desc": job(mode="rewrite", directives=("#ELASTIC model=resnet50 gpus=2-16",))}]
    results = run_hook(install(tmp_path, predictor.url), cases)
    assert names(predictor) == ["mode-cached", "mode-cached", "mode-rewrite"]
    assert kinds(results[1], "user_msg") == [CACHED["reason"]]               # asked, not "(cached)"
    assert kinds(results[2], "user_msg") == [CACHED["reason"] + " (cached)"]
    assert [r["claimed"] for r in predictor.requests] == [None, None, "d-44"]


TEST_ONLY = json.loads((pathlib.Path(__file__).parents[1] / "vectors" / "test_only.json").read_text())["cases"]
JOB_SUBMIT_ALONE = [c for c in TEST_ONLY if c["hooks"] == ["job_submit"]]


@pytest.mark.parametrize("case", JOB_SUBMIT_ALONE, ids=[c["name"] for c in JOB_SUBMIT_ALONE])
def test_test_only_vectors_what_job_submit_sends_and_reuses(tmp_path, predictor, case):
    # tests/vectors/test_only.json (the service's side of the same vectors: test_plan_cache_ttl.py)
    cases = [{"job_desc": job(mode="cached", comment=case["comment"]), "test_only": case["test_only"]},
             {"job_desc": job(mode="cached")}]   # the next identical real job, no mark
    results = run_hook(install(tmp_path, predictor.url), cases)
    sent = [(r["body"]["source"], bool(r["body"].get("test_only"))) for r in predictor.requests]
    expected = [(s["source"], s["test_only"]) for s in case["sends"]]
    assert sent == expected + ([("job_submit", False)] if case["next_real_job"] == "asks" else []), sent
    cached = CACHED["reason"] + " (cached)"
    assert (kinds(results[1], "user_msg") == [cached]) is (case["next_real_job"] == "cached")
