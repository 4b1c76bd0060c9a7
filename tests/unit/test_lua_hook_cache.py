"""The job_submit hook's decision cache, in lua5.1 with the stub `slurm` table of test_lua_hook.py.

The fake service picks its reply by job name, which is not part of the cache key (the plan does not read
it): a second submission named `mode-500` that is served from the cache proves that no request was sent.
"""
from __future__ import annotations

import pytest

from predictor import planner
from tests.unit.test_lua_hook import Predictor, install, job, kinds, run_hook

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

    install_plugin(PluginConfig(tmp_path, predictor.url, timedelta(milliseconds=100), cache_entries=entries))
    cases = [{"job_desc": job(mode="cached", time_limit=t)} for t in (1, 2, 1, 3, 1)]   # 2 entries: 3rd empties it
    run_hook(tmp_path, cases)
    assert [r["body"]["job"]["time_limit_min"] for r in predictor.requests] == asked


def test_reuse_counts_survive_a_422(tmp_path, predictor):
    cases = [{"job_desc": job(mode="cached")}, {"job_desc": job(mode="x")},
             {"job_desc": job(mode="422", time_limit=8)},            # rejected: the service stored nothing
             {"job_desc": job(mode="cached", time_limit=9)}]
    results = run_hook(install(tmp_path, predictor.url), cases)
    assert results[2]["rc"] != 0
    assert [r["body"].get("reused") for r in predictor.requests] == [None, {"d-44": 1}, {"d-44": 1}]


TABLE = Predictor.REPLIES["table"]["table"]


def batch16(*extra):
    return ("#ELASTIC model=resnet50 per_gpu_batch=16",) + extra


@pytest.mark.parametrize("bounds", ["gpus=1-16 min_efficiency=0.2", "gpus=2-8 min_efficiency=0.71", "gpus=4",
                                    "gpus=1-12 objective=efficiency", "gpus=3-7 max_global_batch=80"])
def test_a_cached_prediction_table_decides_other_bounds_without_a_call(tmp_path, predictor, bounds):
    """Issue 14.10: distinct requests (the decision cache cannot answer) of the same partition, model, GPU type
    and per-GPU batch are decided in the hook from the table the service sent, by the policy's last step."""
    first = job(mode="table", directives=batch16("#ELASTIC gpus=2-8"))
    second = job(mode="500", directives=batch16(f"#ELASTIC {bounds}"), time_limit=7)
    results = run_hook(install(tmp_path, predictor.url), [{"job_desc": first}, {"job_desc": second}])
    assert names(predictor) == ["mode-table"]
    expect = planner.last_step(TABLE, planner.parse_request({"directives": list(batch16(f"#ELASTIC {bounds}"))})
                               .directives, planner.requested({"min_nodes": 1, "tres_per_job": "gres:gpu:4"}))
    got = results[1]["job_desc"]
    assert got["min_nodes"] == got["max_nodes"] == expect["nodes"]
    assert got["comment"] == "my run elastic:decision=d-48"
    shown = expect["reason"] if expect["reason"].startswith("elastic:") else "elastic: " + expect["reason"]
    assert kinds(results[1], "user_msg") == [shown + " (cached predictions)"]
    assert got.get("req_switch") == expect["switches"]


@pytest.mark.parametrize("field, value", [
    ("directives", batch16("#ELASTIC gpus=2-8 gpu_type=H100")),
    ("directives", ("#ELASTIC model=resnet50 per_gpu_batch=32 gpus=2-8",)),
    ("directives", ("#ELASTIC model=vgg16 per_gpu_batch=16 gpus=2-8",)),
    ("directives", batch16("#ELASTIC gpus=2-8 batch_policy=keep_global")),
    ("directives", batch16("#ELASTIC gpus=32-64")),          # above the partition: the service rejects it
    ("partition", "gpu")])
def test_a_table_answers_only_its_partition_model_gpu_and_batch(tmp_path, predictor, field, value):
    second = job(mode="table", directives=value) if field == "directives" else job(mode="table", **{field: value})
    run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="table", directives=batch16("#ELASTIC gpus=2-8"))},
                                                 {"job_desc": second}])
    assert names(predictor) == ["mode-table", "mode-table"]


def test_a_table_expires_with_its_ttl_and_its_uses_are_reported(tmp_path, predictor):
    cases = [{"job_desc": job(mode="table-short", directives=batch16("#ELASTIC gpus=2-8"))},
             {"job_desc": job(mode="500", directives=batch16("#ELASTIC gpus=1-4"))},              # from the table
             {"job_desc": job(mode="table", directives=batch16("#ELASTIC gpus=1-3")), "advance": 0.4}]  # expired
    run_hook(install(tmp_path, predictor.url), cases)
    assert names(predictor) == ["mode-table-short", "mode-table"]
    assert predictor.requests[1]["body"]["reused"] == {"d-49": 1}


# #24.5: what a hostile or impersonated service put in a table. Before, the hook applied decisions from these: [0,4]
# dropped the job's GPUs, [2.5,2.5] asked for 2.5 GPUs, [8,8] put 8 GPUs on 4-GPU nodes, [1]*8 asked for 8 nodes
# of a 4-node partition.
HOSTILE = {"zero": [0, 4], "fraction": [2.5, 2.5], "too-many-gpus": [8, 8], "too-many-nodes": [1] * 8,
           "negative": [8, -4]}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_table_that_does_not_fit_its_partition_decides_nothing(tmp_path, predictor, case):
    hostile = {**TABLE, "entries": [{"layout": HOSTILE[case], "samples_per_s": 1e9}] + TABLE["entries"]}
    Predictor.REPLIES[f"table-{case}"] = {**Predictor.REPLIES["table"], "table": hostile}
    try:
        results = run_hook(install(tmp_path, predictor.url),
                           [{"job_desc": job(mode=f"table-{case}", directives=batch16("#ELASTIC gpus=2-8"))},
                            {"job_desc": job(mode="rewrite", directives=batch16("#ELASTIC gpus=1-16"), time_limit=7)}])
    finally:
        del Predictor.REPLIES[f"table-{case}"]
    assert names(predictor) == [f"mode-table-{case}", "mode-rewrite"]  # the second was asked, not decided from it
    got = results[1]["job_desc"]
    assert got["min_nodes"] == Predictor.REPLIES["rewrite"]["nodes"]


def test_table_problems_are_named_by_the_lua_check():
    import json
    import subprocess

    from tests.unit.test_lua_hook import LUA_DIR
    tables = {"ok": TABLE, **{k: {**TABLE, "entries": [{"layout": v, "samples_per_s": 1.0}]} for k, v in HOSTILE.items()},
              "big": {**TABLE, "entries": [TABLE["entries"][0]] * 4097}, "no-shape": {**TABLE, "nodes": 0}}
    code = (f"package.path = {json.dumps(str(LUA_DIR) + '/?.lua;')} .. package.path\n"
            "local cjson = require('cjson')\nlocal M = require('elastic_common')\n"
            f"local tables = cjson.decode([==[{json.dumps(tables)}]==])\n"
            "for name, t in pairs(tables) do print(name .. '=' .. tostring(M.table_problem(t))) end\n")
    out = subprocess.run(["lua5.1", "-"], input=code, capture_output=True, text=True, timeout=60, check=True).stdout
    problems = dict(line.split("=", 1) for line in out.splitlines())
    assert problems.pop("ok") == "nil"
    assert all(p != "nil" for p in problems.values()), problems


def test_a_reply_larger_than_the_hook_reads_is_skipped(tmp_path, predictor):
    results = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="huge")}])
    msg = kinds(results[0], "user_msg")[0]
    assert msg.startswith("elastic: prediction skipped (reply of ") and "more than 524288" in msg
    assert results[0]["job_desc"]["min_nodes"] == 1  # submitted as written
