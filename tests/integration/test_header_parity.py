"""#42: the hook reads `#ELASTIC` lines exactly where the real sbatch reads `#SBATCH` (marker slurm).

The cases are the header vectors of tests/vectors/directives.json that carry `sbatch_reads` (what the real sbatch
reads there; the Python and Lua readers run the same file). Each gets `#SBATCH --comment=sbatch-read` just before its
first `#ELASTIC` line: whether sbatch read its header that far shows in the job's Comment, whether the hook did in
the fake predictor's requests. They must agree, with each other and with the vector. Before #42 the hook stopped at an indented comment (sbatch reads on) and read lines split at a lone
`\\r` (sbatch reads none: the whole script is its `#!` line).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.integration.test_hook import bed, hook, predictor, sbatch, show_job  # noqa: F401 - fixtures

# The header vectors of tests/vectors/directives.json that say what the real sbatch reads there (`sbatch_reads`,
# Slurm 22.05 on the lab): the Python and Lua readers run the same vectors (test_directives, test_lua_directives)
HEADER_CASES = [v for v in json.loads((Path(__file__).parents[1] / "vectors" / "directives.json").read_text())
                if "sbatch_reads" in v]


def _marked(script: str) -> str:
    """``script`` with `#SBATCH --comment=sbatch-read` just before its first `#ELASTIC` line (the same line ends)."""
    end = "\n" if "\n" in script else "\r"
    return script.replace("#ELASTIC", "#SBATCH --comment=sbatch-read" + end + "#ELASTIC", 1)


@pytest.mark.parametrize("vector", HEADER_CASES, ids=[v["name"] for v in HEADER_CASES])
def test_the_hook_reads_the_header_where_sbatch_does(hook, predictor, sbatch, bed, vector):
    hook(predictor.url)
    result = sbatch(_marked(vector["script"]), "-H", "-J", "mode-keep")
    assert result.rc == 0, result.stderr
    sbatch_read = "sbatch-read" in show_job(bed, result.job_id).get("Comment", "")
    hook_read = any(r["path"].endswith("/v1/plan") for r in predictor.requests)
    assert hook_read == sbatch_read == (vector["result"] is not None), (sbatch_read, hook_read, predictor.requests)
    assert sbatch_read is vector["sbatch_reads"], "sbatch's reading changed: the vector's sbatch_reads is out of date"


def test_a_request_of_several_gpu_types_is_kept_by_type_with_a_message(hook, predictor, sbatch, bed):
    # #42: `--gres=gpu:h100:2,gpu:a100:1` was rewritten to one untyped count per node (both types lost); a plan
    # to rewrite it is now not applied, and the job keeps both types as written
    hook(predictor.url)
    result = sbatch("#!/bin/bash\n#ELASTIC model=resnet50 gpus=2-8\nsrun true\n", "-H", "-J", "mode-rewrite",
                    "--gres=gpu:h100:2,gpu:a100:1")
    assert result.rc == 0, result.stderr
    job = show_job(bed, result.job_id)
    assert "several GPU types (a100, h100)" in result.stderr, result.stderr
    assert "h100:2" in job["TresPerNode"] and "a100:1" in job["TresPerNode"], job["TresPerNode"]


SCRIPT = "#!/bin/bash\n#SBATCH -N1 --gpus=4\n#ELASTIC model=resnet50 gpus=2-8\nsrun true\n"


def _plans(predictor) -> list[dict]:
    return [r["body"] for r in predictor.requests if r["path"].endswith("/v1/plan")]


TEST_ONLY = [c for c in json.loads((Path(__file__).parents[1] / "vectors" / "test_only.json").read_text())["cases"]
             if "mode" in c]


@pytest.mark.parametrize("case", TEST_ONLY, ids=[c["name"] for c in TEST_ONLY])
def test_test_only_vectors_what_both_hooks_send(hook, predictor, sbatch, bed, case):
    # tests/vectors/test_only.json, on the real sbatch: job_submit cannot tell `sbatch --test-only` (22.05: its
    # job_desc is a real one's), cli_filter can: it asks with test_only, and marks the job so that job_submit plans no
    # more (cli_filter planned it) or asks with test_only too (cli_filter's ask failed). Before #42.6 both asked as for
    # a job, and the service recorded a decision (what the service keeps of each: test_plan_cache_ttl.py)
    hook(predictor.url, job_submit=True, cli_filter=True)
    result = sbatch(SCRIPT, *(["--test-only"] if case["test_only"] else ["-H"]), "-J", f"mode-{case['mode']}")
    assert result.rc == 0 and ("to start at" in result.stderr) is case["test_only"], result.stderr
    assert [(b["source"], bool(b.get("test_only"))) for b in _plans(predictor)] == \
        [(s["source"], s["test_only"]) for s in case["sends"]]


def test_job_submit_keeps_no_test_only_answer_for_the_next_real_job(hook, predictor, sbatch, bed):
    # the mark cli_filter sets (given by hand here, job_submit alone): the test's answer is not kept, so the next
    # identical real job is planned by the service (a decision of its own), not "(cached)" from the test
    hook(predictor.url, job_submit=True, cli_filter=False)
    tried = sbatch(SCRIPT, "--test-only", "--comment=elastic:test-only", "-J", "mode-cached")
    assert tried.rc == 0 and "to start at" in tried.stderr, tried.stderr
    real = sbatch(SCRIPT, "-H", "-J", "mode-cached")
    assert real.rc == 0 and "(cached)" not in real.stderr, real.stderr
    assert [b.get("test_only") for b in _plans(predictor)] == [True, None]


def test_with_job_submit_alone_a_test_only_answer_is_never_the_next_real_jobs(hook, predictor, sbatch, bed):
    # #42.6, no cli_filter: job_submit cannot tell `--test-only` (Slurm 22.05: the same job_desc), so it asks as for
    # a job; but no job follows, and slurmctld's jobs (slurm.jobs) show that no job holds the test's decision: the
    # next identical real job asks again (not "(cached)"), the one after it is served from the cache (a job holds
    # that decision now), and the hook names the held decision to the service at its next ask (X-Elastic-Claimed)
    hook(predictor.url, job_submit=True, cli_filter=False)
    tried = sbatch(SCRIPT, "--test-only", "-J", "mode-fresh")
    assert tried.rc == 0 and "to start at" in tried.stderr, tried.stderr
    real = sbatch(SCRIPT, "-H", "-J", "mode-fresh")
    assert real.rc == 0 and "(cached)" not in real.stderr, real.stderr
    # job_submit/lua re-reads slurm.jobs when a job changed in a later second than its last read (22.05's
    # last_job_update has whole seconds): a job submitted a second later makes the real one visible to the hook
    time.sleep(1.1)
    assert sbatch("#!/bin/bash\nsrun true\n", "-H").rc == 0
    again = sbatch(SCRIPT, "-H", "-J", "mode-fresh")
    assert again.rc == 0 and "(cached)" in again.stderr, again.stderr
    other = sbatch(SCRIPT.replace("gpus=2-8", "gpus=2-16"), "-H", "-J", "mode-rewrite")
    assert other.rc == 0, other.stderr
    held = show_job(bed, real.job_id)["Comment"].split("elastic:decision=")[1]
    asks = [(r["body"]["job"].get("name"), r.get("claimed")) for r in predictor.requests if r["path"].endswith("/v1/plan")]
    assert asks == [("mode-fresh", None), ("mode-fresh", None), ("mode-rewrite", held)], asks
    assert show_job(bed, again.job_id)["Comment"] == f"elastic:decision={held}"
