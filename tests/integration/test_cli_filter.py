"""cli_filter.lua on the real testbed: the same request and rewrite as job_submit.lua, from sbatch's side.

Uses the fixtures of test_hook.py (fake predictor chosen by job name, installer, sbatch runner).
"""
from __future__ import annotations

import os

import pytest

from tests.integration.test_hook import bed, hook, predictor, sbatch, script, show_job, tres  # noqa: F401
from tests.unit.test_lua_hook import REWRITE

LAYOUT_FIELDS = ("NumNodes", "TresPerNode", "Switches", "NtasksPerN:B:S:C", "Comment")


def test_cli_filter_gives_the_same_rewrite_as_job_submit(hook, predictor, sbatch, bed):
    hook(predictor.url, job_submit=True, cli_filter=False)
    by_job_submit = show_job(bed, sbatch(script(), "-H", "-J", "mode-rewrite").job_id)
    hook(predictor.url, job_submit=False, cli_filter=True)
    result = sbatch(script(), "-H", "-J", "mode-rewrite")
    assert result.rc == 0, result.stderr
    assert result.stderr.strip() == f"sbatch: lua: {REWRITE['reason']}"
    by_cli_filter = show_job(bed, result.job_id)
    assert {k: by_cli_filter[k] for k in LAYOUT_FIELDS} == {k: by_job_submit[k] for k in LAYOUT_FIELDS}
    assert by_cli_filter["TresPerNode"] == tres(bed, 2)
    # an option cannot be unset from cli_filter: --gpus is kept consistent (2 x 2) instead of cleared
    assert by_cli_filter["TresPerJob"] == tres(bed, 4)
    assert [r["body"]["source"] for r in predictor.requests] == ["job_submit", "cli_filter"]
    # the submitting uid, as job_submit sends it (#26: a user's own profile plans only that user's jobs)
    assert predictor.requests[1]["body"]["job"] == {"name": "mode-rewrite", "min_nodes": 1, "max_nodes": 1,
                                                    "tres_per_job": tres(bed, 4), "uid": os.getuid()}
    assert predictor.requests[0]["body"]["job"]["uid"] == os.getuid()


def test_job_submit_does_not_plan_again_after_cli_filter(hook, predictor, sbatch, bed):
    hook(predictor.url, job_submit=True, cli_filter=True)
    result = sbatch(script(), "-H", "-J", "mode-rewrite")
    assert result.stderr.strip() == f"sbatch: lua: {REWRITE['reason']}"
    assert [r["body"]["source"] for r in predictor.requests] == ["cli_filter"]
    assert show_job(bed, result.job_id)["Comment"] == "orig elastic:decision=d-42"


def test_cli_filter_rejects_malformed_directive(hook, predictor, sbatch):
    hook(predictor.url, job_submit=False, cli_filter=True)     # the service's 422 (the fake parses as it does)
    result = sbatch(script(directives="#ELASTIC model=resnet50 colour=blue\n"), "-H")
    assert result.rc != 0
    assert "sbatch: error: lua: elastic: line 3: unknown key 'colour'" in result.stderr
    assert "'#ELASTIC model=resnet50 colour=blue'; job rejected: Slurm's next line (\"cli_filter plugin terminated " \
        "with error\") is this rejection" in result.stderr


@pytest.mark.parametrize("mode", ["stopped", "500"])
def test_cli_filter_fails_open(hook, predictor, sbatch, bed, mode):
    hook("http://127.0.0.1:9" if mode == "stopped" else predictor.url, job_submit=False, cli_filter=True)
    result = sbatch(script(), "-H", "-J", f"mode-{mode}")
    assert result.rc == 0 and "sbatch: lua: elastic: prediction skipped (" in result.stderr
    job = show_job(bed, result.job_id)
    assert job["NumNodes"] in ("1", "1-1") and job["TresPerJob"] == tres(bed, 4) and "TresPerNode" not in job


def test_cli_filter_breaker_persists_across_sbatch_processes(hook, predictor, sbatch):
    hook(predictor.url, job_submit=False, cli_filter=True, failures=2, open_s=30)
    for _ in range(2):
        assert "HTTP 500" in sbatch(script(), "-H", "-J", "mode-500").stderr
    third = sbatch(script(), "-H", "-J", "mode-rewrite")
    assert "predictor unavailable" in third.stderr
    assert len(predictor.requests) == 2


def test_cli_filter_ignores_scripts_without_directives_and_srun(hook, predictor, sbatch, bed, tmp_path):
    import subprocess
    hook(predictor.url, job_submit=False, cli_filter=True)
    (tmp_path / "step.sh").write_text(script(body="true\n"))  # #ELASTIC lines, but srun runs it as a program
    (tmp_path / "step.sh").chmod(0o755)
    srun = subprocess.run(["srun", "-N1", "--gpus=1", str(tmp_path / "step.sh")], capture_output=True, text=True,
                          timeout=60, env=bed.env(path="/usr/bin:/bin"), cwd=tmp_path)
    assert srun.returncode == 0 and srun.stderr == ""
    plain = sbatch(script(directives=""), "-H", "-J", "mode-rewrite")
    assert plain.rc == 0 and plain.stderr == ""
    assert predictor.requests == []


def test_cli_filter_gives_elastic_jobs_no_kill(hook, predictor, sbatch):
    """--no-kill keeps an elastic job alive when a node dies (the launcher drops the node; checked by hand: a
    2-node job submitted through this setting kept node1 when node2's slurmd was SIGKILLed and went DOWN).
    job_submit/lua 22.05 cannot set it, so the cli_filter does; `sbatch -v` prints the option as sent."""
    hook("http://127.0.0.1:9", job_submit=False, cli_filter=True)
    elastic = sbatch(script(), "-H", "-v")
    assert elastic.rc == 0 and "no-kill             : set" in elastic.stderr
    assert "elastic: --no-kill set: a node failure shrinks the job instead of ending it" in elastic.stderr
    plain = sbatch(script(directives=""), "-H", "-v")
    assert plain.rc == 0 and "sbatch: defined options" in plain.stderr and "no-kill" not in plain.stderr
