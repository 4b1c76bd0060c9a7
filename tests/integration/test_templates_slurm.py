"""The sbatch templates on the Slurm testbed: each one is a valid batch script as written and as rendered,
and the small CPU variant of each runs to completion under elastic-launch (real sbatch, srun steps, gloo).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_plugin import templates

NAMES = sorted(templates.templates())
# The jobs get Slurm's minimal PATH: name this interpreter and its elastic-launch explicitly.
LAUNCHER = Path(sys.executable).parent / "elastic-launch"
LAUNCH = [str(LAUNCHER)] if LAUNCHER.exists() else [sys.executable, "-m", "elastic_launcher.cli"]


def _test_only(testbed, script: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_CONF": str(testbed.config.slurm_conf)}
    return subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, env=env,
                          timeout=60, cwd=script.parent)


def test_there_are_at_least_four_templates():
    assert {"resnet50", "transformer-finetune", "gpt-lm", "wrap-train-py"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_template_as_written_passes_sbatch_test_only(testbed, name, tmp_path):
    script = tmp_path / f"{name}.sbatch"
    script.write_text(templates.get(name).text)
    proc = _test_only(testbed, script)
    assert proc.returncode == 0, proc.stderr
    assert "to start at" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("gpus, expect_nodes", [("2-16", "node1"), ("6-12", "node[1-2]")])
def test_rendered_template_passes_sbatch_test_only(testbed, name, gpus, expect_nodes, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(templates.render(templates.get(name), templates.Params(gpus=gpus, gpus_per_node=4)))
    proc = _test_only(testbed, script)
    assert proc.returncode == 0, proc.stderr
    if "elastic:" not in proc.stderr:   # no job_submit hook installed on this lab: the request as written
        assert f"on nodes {expect_nodes} " in proc.stderr, proc.stderr


def test_a_bad_request_is_refused_by_test_only(testbed, tmp_path):
    """The check is real: 5 GPUs on one node of the 4-GPU testbed cannot run."""
    script = tmp_path / "job.sbatch"
    script.write_text(templates.render(templates.get("resnet50"), templates.Params(sbatch={"gpus-per-node": "5"})))
    proc = _test_only(testbed, script)
    assert proc.returncode != 0


@pytest.mark.parametrize("name, done", [
    ("resnet50", "done: 20 steps"),
    ("gpt-lm", "done: 20 steps"),
    ("transformer-finetune", "done: 20 steps"),
    ("wrap-train-py", "done: 20 steps on 2 ranks"),
])
def test_cpu_variant_runs_to_completion_under_elastic_launch(slurm, submit, idle_nodes, wait_until, tmp_path,
                                                             name, done):
    work = Path(tmp_path)
    script = work / "job.sbatch"
    params = templates.Params(cpu_test=True, python=sys.executable, launcher=LAUNCH,
                              launcher_options={"--run-dir": str(work / "run")})
    script.write_text(templates.render(templates.get(name), params))
    job_id = submit(script, ["--chdir", str(work)])

    wait_until(lambda: slurm.job(job_id).state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"), 240,
               f"the {name} CPU job to finish")
    out = (work / f"{name}-cpu-test-{job_id}.out").read_text()
    assert slurm.job(job_id).state == "COMPLETED", out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["outcome"] == "completed" and summary["final_nodes"] in (1, 2), summary   # 1: straggler cut
    logs = "\n".join(p.read_text() for p in (work / "run").glob("worker-*.log"))
    assert done in logs, logs[-3000:]
    records = [json.loads(line) for line in (work / "run" / "records.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "transition" and r["action"] == "start")
    assert start["world"] == 2 and start["to_nodes"] == 2
