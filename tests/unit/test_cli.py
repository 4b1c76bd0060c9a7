"""`elastic-predictor` commands through click's runner, and `serve` as a real gunicorn process."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import requests
from click.testing import CliRunner

from predictor.cli import main
from predictor.store import Store
from tests.unit._service_fakes import COLLECTIVE, STEP

COMMANDS = ["serve", "import", "profile", "predict", "plan", "evaluate", "decisions"]


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def history(tmp_path, runner):
    """A database with the resnet50 profile and a few H200 steps and collectives."""
    db = str(tmp_path / "h.db")
    assert runner.invoke(main, ["profile", "resnet50", "--db", db]).exit_code == 0
    lines = []
    for layout, iter_s in [([1], 0.030), ([2], 0.031), ([4], 0.0322), ([2, 2], 0.036), ([4, 4], 0.040)]:
        step = dict(STEP, layout=layout, iter_s=iter_s)
        if len(layout) == 1:
            del step["inter_link"]
        lines.append(step)
    for link, bandwidth in [("nvlink", 3e11), ("ib", 2.5e10)]:
        for world in (2, 4, 8):
            for size in (1 << 20, 1 << 26):
                lines.append(dict(COLLECTIVE, link=link, world=world, bytes=size, seconds=2e-5 + size / bandwidth))
    path = tmp_path / "h.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = runner.invoke(main, ["import", "--db", db, str(path)])
    assert result.exit_code == 0, result.output
    return db


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(runner, command):
    result = runner.invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "Example: " in result.output
    assert f"elastic-predictor {command}" in result.output.split("Example: ")[1]


def test_profile_prints_and_registers(runner, tmp_path):
    db = str(tmp_path / "p.db")
    result = runner.invoke(main, ["profile", "resnet50", "--db", db])
    assert result.exit_code == 0 and "25,557,032" in result.output
    assert Store(db).get_profile("resnet50")["name"] == "resnet50"
    as_json = runner.invoke(main, ["profile", "resnet50", "--json"])
    assert len(json.loads(as_json.stdout)["tensors"]) == 161
    unknown = runner.invoke(main, ["profile", "nosuchnet"])
    assert unknown.exit_code == 1 and "nosuchnet" in unknown.output


def test_import_reports_bad_lines_by_number_and_stores_nothing(runner, tmp_path):
    db = str(tmp_path / "i.db")
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([json.dumps(STEP), "not json", json.dumps(dict(COLLECTIVE, seconds=-1)),
                               "", json.dumps(COLLECTIVE)]) + "\n")
    result = runner.invoke(main, ["import", "--db", db, str(path)])
    assert result.exit_code == 1
    assert "line 2:" in result.stderr and "line 3: record.seconds" in result.stderr and "line 1:" not in result.stderr
    assert not os.path.exists(db), "a rejected import must not even create the database"
    kept = runner.invoke(main, ["import", "--db", db, "--skip-bad", str(path)])
    assert kept.exit_code == 0 and "imported 2 observation(s)" in kept.output
    assert Store(db).observation_counts() == {"collective": 1, "step": 1}


def test_predict_prints_a_table_of_candidates(runner, history):
    result = runner.invoke(main, ["predict", "--db", history, "--profile", "resnet50", "--gpu", "H200",
                                  "--per-gpu-batch", "64", "--gpus", "4-8"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "(observed)" in lines[0] and "samples/s" in lines[1]
    rows = [line.split() for line in lines[3:]]
    assert {(r[0], r[1]) for r in rows} >= {("4", "1x4"), ("4", "2x2"), ("8", "2x4"), ("8", "4x2")}
    assert all(float(r[3]) > 0 for r in rows)
    bad = runner.invoke(main, ["predict", "--db", history, "--profile", "resnet50", "--gpu", "H200",
                               "--per-gpu-batch", "64", "--gpus", "x"])
    assert bad.exit_code == 2


def test_plan_a_batch_script(runner, history, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -N1\n#ELASTIC model=resnet50 gpus=1-8\n#ELASTIC per_gpu_batch=64\nsrun true\n")
    result = runner.invoke(main, ["plan", str(script), "--db", history, "--nodes", "1", "--gpus-per-node", "4"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("d-1 ") and "elastic: " in result.output and "efficiency" in result.output
    bad = tmp_path / "bad.sbatch"
    bad.write_text("#ELASTIC gpus=8-2\n")
    broken = runner.invoke(main, ["plan", str(bad), "--db", history])
    assert broken.exit_code == 1 and "line 1" in broken.output and "above maximum" in broken.output


def test_evaluate_fit_errors_and_decisions_table(runner, history):
    result = runner.invoke(main, ["evaluate", "--db", history, "--fit-errors"])
    assert result.exit_code == 0, result.output
    assert "resnet50 on H200" in result.output and "nvlink" in result.output
    Store(history).add_decision({"directives": []}, {"action": "keep", "reason": "not an elastic job"}, "cli", None)
    table = runner.invoke(main, ["decisions", "--db", history])
    assert table.exit_code == 0 and "d-1 " in table.output and "not an elastic job" in table.output


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_runs_gunicorn_with_the_token_from_the_environment(history):
    port = _free_port()
    env = dict(os.environ, ELASTIC_PREDICTOR_TOKEN="tok")
    proc = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--db", history, "--workers", "1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = requests.get(f"{base}/healthz", timeout=2).json()
                if health["model_version"]:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server did not come up"
            time.sleep(0.3)
        assert requests.post(f"{base}/v1/observations", json=[STEP], timeout=5).status_code == 401
        assert requests.post(f"{base}/v1/observations", json=[STEP], timeout=5,
                             headers={"Authorization": "Bearer tok"}).status_code == 201
        plan = requests.post(f"{base}/v1/plan", timeout=10, json={
            "source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=1-8 per_gpu_batch=64"]}).json()
        assert plan["action"] == "rewrite" and plan["decision_id"].startswith("d-")
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert "Booting worker" in output
