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
from tests.unit._service_fakes import COLLECTIVE, PROFILE, STEP

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
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert f"{path}:2: line: not valid JSON" in result.stderr and f"{path}:3: record.seconds" in result.stderr
    assert f"{path}:1:" not in result.stderr and f"{path}:5:" not in result.stderr
    assert not os.path.exists(db), "a rejected import must not even create the database"
    kept = runner.invoke(main, ["import", "--db", db, "--skip-bad", str(path)])
    assert kept.exit_code == 0 and "imported 2 observation(s)" in kept.output
    assert Store(db).observation_counts() == {"collective": 1, "step": 1, "ddp_overhead": 0}


def _counts(db: str) -> tuple:
    store = Store(db)
    try:
        return store.observation_counts(), [p["name"] for p in store.list_profiles()]
    finally:
        store.close()


@pytest.mark.parametrize("bad_line,where", [
    (b"\xff\xfe not text\n", "line: not UTF-8 text"),
    (b"[" * 5000 + b"]" * 5000 + b"\n", "line: not valid JSON"),
    (b"[1, 2]\n", "record: expected an object, got list"),
    (json.dumps(dict(PROFILE, kind="profile", name="bad name!")).encode() + b"\n", "name: must match"),
    (json.dumps(dict(PROFILE, name="x", source=5)).encode() + b"\n", "source: expected a string"),
    (json.dumps(dict(PROFILE, name="x", tensors=[{"name": "w", "numel": -1, "dtype": "float32"}])).encode() + b"\n",
     "tensors[0].numel"),
])
def test_a_bad_line_names_file_line_and_field_and_the_import_is_all_or_nothing(runner, history, tmp_path,
                                                                               bad_line, where):
    before = _counts(history)
    path = tmp_path / "mixed.jsonl"
    good_profile = json.dumps(dict(PROFILE, name="newnet", kind="profile")).encode() + b"\n"
    path.write_bytes(good_profile + json.dumps(COLLECTIVE).encode() + b"\n\n" + bad_line + json.dumps(STEP).encode())
    result = runner.invoke(main, ["import", "--db", history, str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{path}:4: {where}" in result.stderr and "Traceback" not in result.output
    assert f"Error: {path}: 1 bad line(s); nothing imported" in result.stderr
    assert _counts(history) == before, "a rejected import must leave the database as it was"
    kept = runner.invoke(main, ["import", "--db", history, "--skip-bad", str(path)])
    assert kept.exit_code == 0 and "imported 2 observation(s) and 1 profile(s); 1 bad line(s)" in kept.output
    counts, names = _counts(history)
    assert counts["collective"] == before[0]["collective"] + 1 and counts["step"] == before[0]["step"] + 1
    assert names == sorted(before[1] + ["newnet"])


def test_a_database_failure_during_import_says_what_was_written(runner, tmp_path, monkeypatch):
    import sqlite3

    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(dict(PROFILE, kind="profile")) + "\n" + json.dumps(COLLECTIVE) + "\n")
    db = str(tmp_path / "f.db")

    def disk_full(self, records):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Store, "add_observations", disk_full)
    result = runner.invoke(main, ["import", "--db", db, str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert f"cannot write to {db}: database or disk is full; 1 of 1 profile(s) and no observation written" \
        in result.stderr
    monkeypatch.undo()
    again = runner.invoke(main, ["import", "--db", db, str(path)])
    assert again.exit_code == 0 and _counts(db) == ({"collective": 1, "step": 0, "ddp_overhead": 0}, ["resnet50"])


def test_plan_and_cluster_file_errors_name_the_file_and_line(runner, history, tmp_path, monkeypatch):
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -N1\n#ELASTIC model=resnet50\n#ELASTIC gpus=8-2\nsrun true\n")
    result = runner.invoke(main, ["plan", str(script), "--db", history])
    assert result.exit_code == 1 and f"{script}:4: gpus: minimum 8 is above maximum 2" in result.stderr
    script.write_bytes(b"#!/bin/bash\n#ELASTIC model=resnet50\n#ELASTIC gpus=\xff\n")
    result = runner.invoke(main, ["plan", str(script), "--db", history])
    assert result.exit_code == 1 and f"{script}:3: not UTF-8 text" in result.stderr
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"partitions": [{"name": "gpu"}]}))
    result = runner.invoke(main, ["decisions", "--db", history], env={"ELASTIC_PREDICTOR_CLUSTER": str(cluster)})
    assert result.exit_code == 1 and f"{cluster} ($ELASTIC_PREDICTOR_CLUSTER): partitions[0]." in result.stderr
    result = runner.invoke(main, ["plan", str(script), "--db", history, "--cluster", str(cluster)])
    assert result.exit_code == 1 and f"{cluster}: partitions[0]." in result.stderr


@pytest.mark.parametrize("settings", [{}, {"token": "t"}, {"admin_token": "a"}, {"munge_auth": True},
                                      {"token": "t", "admin_token": "a", "munge_auth": True, "read_auth": True},
                                      {"read_auth": True}, {"munge_auth": True, "read_auth": True},
                                      {"open_writes": False}, {"open_writes": False, "read_auth": True},
                                      {"open_writes": False, "token": "t"}])
def test_serve_states_the_write_policy_the_service_applies(settings):
    from predictor.auth import AuthError, Authenticator
    from predictor.cli import auth_policy
    from predictor.config import Config

    config = Config(**settings)
    text = "\n".join(auth_policy(config))
    auth = Authenticator.from_config(config)
    try:
        auth.check_write({}, b"[]")
        open_writes = True
    except AuthError:
        open_writes = False
    assert ("writes are open to anyone" in text) == open_writes
    for value, name in [(config.token, "ELASTIC_PREDICTOR_TOKEN"), (config.admin_token, "ELASTIC_PREDICTOR_ADMIN_TOKEN"),
                        (config.munge_auth, "ELASTIC_PREDICTOR_MUNGE")]:
        assert (f"({name}" in text) == bool(value) or open_writes
    admin_ok = any(_admin_accepted(auth, token) for token in ("t", "a"))
    assert ("admin operations (replacing a profile) need a token: none is set" in text) == \
           (not admin_ok and not open_writes)
    reads_closed = settings.get("read_auth", False)
    assert ("reads need" in text or "every read except /healthz is refused" in text) == reads_closed


def test_a_bare_serve_closes_writes_and_names_what_opens_them(runner, tmp_path):
    """#41.9: `serve` with no token and munge off opened writes to anyone (one warning line). Its configuration
    (Config.from_env) now closes them; `--allow-dev open-writes` opens them."""
    from predictor.app import create_app
    from predictor.config import Config

    config = Config.from_env({}, db_path=str(tmp_path / "h.db"))
    assert config.open_writes is False
    refused = create_app(config).test_client().post("/v1/observations", json=[STEP])
    assert refused.status_code == 401 and "writes are closed" in refused.get_json()["error"]
    opened = create_app(config.replace(open_writes=True)).test_client().post("/v1/observations", json=[STEP])
    assert opened.status_code == 201


@pytest.mark.parametrize("nginx_v, why", [
    (None, "nginx is not installed"),
    ("nginx version: nginx/1.22.1\nconfigure arguments: --with-http_ssl_module", "nginx has no stream module"),
])
def test_serve_without_nginx_or_its_stream_module_names_the_packages(runner, tmp_path, monkeypatch, nginx_v, why):
    """#46: nginx is serve's one front end (the buffered fallback, which one client address could take from
    everyone, is gone): where nginx or its stream module is missing, `serve` stops at once with one line naming
    the packages, and nothing is created."""
    from predictor import front_nginx

    fake = tmp_path / "nginx"
    fake.write_text(f"#!/bin/sh\nprintf '{nginx_v}\\n' >&2\n")
    fake.chmod(0o755)
    monkeypatch.setattr(front_nginx.shutil, "which", lambda *_a, **_k: None if nginx_v is None else str(fake))
    db = tmp_path / "h.db"
    result = runner.invoke(main, ["serve", "--db", str(db), "--port", "1"])
    assert result.exit_code == 1 and why in result.output, result.output
    assert "apt-get install -y nginx-light libnginx-mod-stream" in result.output and not db.exists()


def test_the_database_is_created_owner_only(tmp_path):
    """#41.9: the file holds the pickled models every worker loads; it was created 0644."""
    import stat

    store = Store(str(tmp_path / "new.db"))
    store.migrate()
    store.add_decision({"directives": []}, {"action": "keep", "reason": "x"}, "cli", None)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes["new.db"] == 0o600 and all(m == 0o600 for m in modes.values()), modes


def _admin_accepted(auth, token: str) -> bool:
    from predictor.auth import AuthError

    try:
        return auth.check_admin({"Authorization": f"Bearer {token}"}).kind == "admin"
    except AuthError:
        return False


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
    assert broken.exit_code == 1 and f"{bad}:1: gpus: " in broken.output and "above maximum" in broken.output


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


@pytest.mark.slow  # a real gunicorn process
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
    assert "writes need the tool token (ELASTIC_PREDICTOR_TOKEN)" in output and "open to anyone" not in output


def test_elastic_launch_script_and_registry_errors_name_the_file(runner, tmp_path):
    from elastic_launcher.cli import ctl, launch

    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(tmp_path)}
    script = tmp_path / "job.sbatch"
    cases = [(b"#!/bin/bash\n#SBATCH -N1\n#ELASTIC gpus=8-2\nsrun true\n", f"{script}:3: gpus: "),
             (b"#!/bin/bash\n#ELASTIC model=\xff\n", f"{script}:2: not UTF-8 text"),
             (b"#!/bin/bash\n#ELASTIC model=resnet50 colour=blue\n", f"{script}:2: ")]
    for content, expected in cases:
        script.write_bytes(content)
        result = runner.invoke(launch, ["--script", str(script), "--", "true"], env=env)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert expected in result.output, result.output
    script.write_text("#!/bin/bash\n#ELASTIC model=resnet50\n")
    result = runner.invoke(launch, ["--script", str(script), "--directive", "gpus=4-1", "--", "true"], env=env)
    assert result.exit_code == 1 and "Error: --directive: gpus: " in result.output
    registry = tmp_path / "registry"
    registry.mkdir()
    for content, expected in [("{not json", "not valid JSON"), ('{"host": "h"}', "port: expected a port number"),
                              ('{"host": 5, "port": 80}', "host: expected a host name"), ("[]", "expected an object")]:
        (registry / "42.json").write_text(content)
        result = runner.invoke(ctl, ["42", "--status", "--registry", str(registry)])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert f"{registry / '42.json'}: {expected}" in result.output, result.output
