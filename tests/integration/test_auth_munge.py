"""Munge-signed writes against the real testbed: the lab's munged signs, real Slurm jobs are checked.

A job of root and a job of an unprivileged user (1 node, 4 GPUs of partition debug: H200 in the default
cluster model) are kept running; credentials come from the lab's own
munged (`munge --socket`), decoded by the service with `unmunge --socket`, and the owner check goes
through `slurm_plugin.client` on the lab's slurm.conf, and so does the check of each record against the
job's allocation and run window (predictor.jobcheck). The launcher's own client
(`elastic_launcher.reporting.PredictorClient`) posts over real HTTP, signed with the lab's munged.
"""
from __future__ import annotations

import json
import pwd
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import requests
from werkzeug.serving import make_server

from elastic_launcher import reporting
from predictor.app import create_app
from slurm_plugin.contracts.signing import MUNGE_HEADER, munge_payload, munge_sign
from predictor.config import Config
from tests.unit._service_fakes import COLLECTIVE, PROFILE, STEP, FakePredictor

USER = "cloudsdk" if any(p.pw_name == "cloudsdk" for p in pwd.getpwall()) else "nobody"
RECORD = dict(COLLECTIVE, source="test_auth_munge")


@pytest.fixture
def client(testbed, tmp_path):
    config = Config(db_path=str(tmp_path / "p.db"), token="tool", admin_token="admin", munge_auth=True,
                    munge_socket=str(testbed.config.munge_socket), slurm_conf=str(testbed.config.slurm_conf),
                    refit_debounce=timedelta(0), refit_min_interval=timedelta(0))
    app = create_app(config, predictor_factory=FakePredictor, start_refit=False)
    yield app.test_client()
    app.extensions["elastic_predictor"].store.close()


def _running_job(testbed, slurm, wait_until, user: str | None) -> int:
    argv = ["sbatch", "--parsable", "-N1", "--gres=gpu:4", "-t", "5", "--chdir=/tmp", "-o", "/dev/null", "--wrap", "sleep 120"]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    env = testbed.env(path="/usr/sbin:/usr/bin:/sbin:/bin")
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30, check=True).stdout
    job_id = int(out.strip().split(";")[0])
    wait_until(lambda: slurm.job(job_id).state == "RUNNING", 30, f"job {job_id} running")
    return job_id


def _sign_as(user: str, body: bytes, job_id: int, socket) -> dict:
    cred = subprocess.run(["runuser", "-u", user, "--", "munge", "-s", munge_payload(body, job_id),
                           f"--socket={socket}"], capture_output=True, text=True, timeout=10, check=True).stdout
    return {MUNGE_HEADER: cred.strip()}


@pytest.fixture
def jobs(testbed, slurm, wait_until):
    ids = {}
    try:
        ids["root"] = _running_job(testbed, slurm, wait_until, None)
        ids["user"] = _running_job(testbed, slurm, wait_until, USER)
        yield ids
    finally:
        for job_id in ids.values():
            subprocess.run(["scancel", str(job_id)], env=testbed.env(path="/usr/bin:/bin"), check=False)


def test_real_munge_credentials_against_real_jobs(client, testbed, jobs):
    sock = testbed.config.munge_socket
    body = json.dumps([RECORD]).encode()
    results = {}

    def post(name, data, headers, path="/v1/observations"):
        r = client.post(path, data=data, headers={"Content-Type": "application/json", **headers})
        results[name] = (r.status_code, (r.json or {}).get("reason"))
        return r

    # accepted: root signs for root's job; the user signs for the user's job (observations and a profile)
    assert post("root job", body, munge_sign(body, jobs["root"], socket=sock)).status_code == 201
    assert post("user job", body, _sign_as(USER, body, jobs["user"], sock)).status_code == 201
    profile = json.dumps(dict(PROFILE, name="signed-net")).encode()
    assert post("user profile", profile, _sign_as(USER, profile, jobs["user"], sock), "/v1/profiles").status_code == 201

    # refused, each naming what failed
    r = post("uid mismatch", body, munge_sign(body, jobs["user"], socket=sock))          # root signs the user's job
    assert (r.status_code, r.json["reason"]) == (403, "uid_mismatch"), r.json
    assert f"job {jobs['user']} belongs to uid {pwd.getpwnam(USER).pw_uid}" in r.json["error"]
    r = post("user for root job", body, _sign_as(USER, body, jobs["root"], sock))
    assert (r.status_code, r.json["reason"]) == (403, "uid_mismatch"), r.json
    r = post("job not found", body, munge_sign(body, 9_999_999, socket=sock))
    assert (r.status_code, r.json["reason"]) == (403, "job_not_found"), r.json
    tampered = json.dumps([dict(RECORD, seconds=123.0)]).encode()
    r = post("tampered body", tampered, munge_sign(body, jobs["root"], socket=sock))
    assert (r.status_code, r.json["reason"]) == (403, "digest_mismatch"), r.json
    headers = munge_sign(body, jobs["root"], socket=sock)
    assert post("first use", body, headers).status_code == 201
    r = post("replayed", body, headers)
    assert (r.status_code, r.json["reason"]) == (401, "bad_credential") and "replayed" in r.json["error"], r.json
    r = post("garbage", body, {MUNGE_HEADER: "MUNGE:AAAA:"})
    assert (r.status_code, r.json["reason"]) == (401, "bad_credential"), r.json
    other = json.dumps([dict(RECORD, job_id=jobs["user"])]).encode()
    r = post("record of another job", other, munge_sign(other, jobs["root"], socket=sock))
    assert (r.status_code, r.json["reason"]) == (403, "job_id_mismatch"), r.json
    # records checked against Slurm's facts about the job: 1 node x 4 GPUs, running since its start
    fits = json.dumps([RECORD, dict(STEP, layout=[4], timestamp_s=time.time())]).encode()
    assert post("fits the allocation", fits, munge_sign(fits, jobs["root"], socket=sock)).status_code == 201
    for name, record, field in [("2 nodes on a 1-node job", dict(STEP, layout=[2, 2]), "layout"),
                                ("8 ranks on 4 GPUs", dict(RECORD, world=8), "world"),
                                ("another GPU type", dict(STEP, layout=[4], gpu="A100"), "gpu"),
                                ("before the job began", dict(STEP, layout=[4], timestamp_s=time.time() - 86400),
                                 "timestamp_s")]:
        bad = json.dumps([RECORD, record]).encode()
        r = post(name, bad, munge_sign(bad, jobs["root"], socket=sock))
        assert (r.status_code, r.json["reason"], r.json["field"]) == (403, "record_mismatch",
                                                                      f"observations[1].{field}"), r.json

    counts = client.get("/v1/observations").json["counts"]
    assert counts["collective"] == 4        # root job, user job, first use, fits; nothing refused got in
    assert counts["step"] == 1

    # a job that just ended is still accepted (within job_recent), but not once the window is 0
    env = testbed.env(path="/usr/bin:/bin")
    subprocess.run(["scancel", str(jobs["root"])], env=env, check=True, timeout=30)
    slurm = client.application.extensions["elastic_predictor_auth"].jobs
    deadline = time.monotonic() + 30
    while slurm.job_owner(jobs["root"]).ended_at_s is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert post("ended job", body, munge_sign(body, jobs["root"], socket=sock)).status_code == 201
    client.application.extensions["elastic_predictor_auth"].job_recent = timedelta(0)
    time.sleep(1.1)
    r = post("ended, window 0", body, munge_sign(body, jobs["root"], socket=sock))
    assert (r.status_code, r.json["reason"]) == (403, "job_not_active"), r.json
    print("\nmunge auth results:", json.dumps(results))


@pytest.fixture
def served(testbed, tmp_path):
    """The service over real HTTP (the launcher posts with `requests`), munge on, tool token "tool"."""
    config = Config(db_path=str(tmp_path / "served.db"), token="tool", munge_auth=True,
                    munge_socket=str(testbed.config.munge_socket), slurm_conf=str(testbed.config.slurm_conf),
                    refit_debounce=timedelta(0), refit_min_interval=timedelta(0))
    app = create_app(config, predictor_factory=FakePredictor, start_refit=False)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)  # shutdown() waits a poll
    thread.start()
    yield app, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()
    app.extensions["elastic_predictor"].store.close()


def test_launcher_post_signed_with_munge_is_accepted_and_a_tampered_or_foreign_one_is_not(served, testbed, jobs,
                                                                                          monkeypatch):
    app, url = served
    sock = str(testbed.config.munge_socket)
    signed = []

    def recording_sign(body, job_id, **kwargs):
        signed.append((body, job_id))
        return munge_sign(body, job_id, **kwargs)

    monkeypatch.setattr(reporting, "munge_sign", recording_sign)
    store = app.extensions["elastic_predictor"].store
    launcher = reporting.PredictorClient(url, None, timeout_s=10, job_id=jobs["root"], munge_socket=sock)
    assert launcher.observe([RECORD]), launcher.last_error
    assert store.observations()[-1]["job_id"] == jobs["root"]
    body = signed[-1][0]

    def post(data, headers):
        reply = requests.post(f"{url}/v1/observations", data=data, timeout=10,
                              headers={"Content-Type": "application/json", **headers})
        return reply.status_code, reply.json().get("reason")

    # the launcher's exact bytes with one byte changed, under a fresh credential for the original bytes
    at = body.index(b'"seconds": ') + len(b'"seconds": ')
    tampered = body[:at] + (b"9" if body[at:at + 1] != b"9" else b"8") + body[at + 1:]
    assert len(tampered) == len(body) and tampered != body
    assert post(tampered, munge_sign(body, jobs["root"], socket=sock)) == (403, "digest_mismatch")
    # the same bytes signed by root for another user's job, and for a job Slurm does not know
    assert post(body, munge_sign(body, jobs["user"], socket=sock)) == (403, "uid_mismatch")
    assert post(body, munge_sign(body, 9_999_999, socket=sock)) == (403, "job_not_found")
    foreign = reporting.PredictorClient(url, None, timeout_s=10, job_id=jobs["user"], munge_socket=sock, retries=0)
    assert foreign.observe([RECORD]) is False and "uid_mismatch" in foreign.last_error
    # munged unreachable: the launcher falls back to the bearer token (a tool write, no job id)
    fallback = reporting.PredictorClient(url, "tool", timeout_s=10, job_id=jobs["root"],
                                         munge_socket=str(testbed.config.munge_dir / "no-such.socket"))
    assert fallback.observe([RECORD]), fallback.last_error
    assert [r.get("job_id") for r in store.observations()] == [jobs["root"], None]
