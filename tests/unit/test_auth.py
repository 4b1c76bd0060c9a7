"""predictor.auth through the Flask app: bearer/admin tokens, munge-signed job writes, read switch.

munge and Slurm are replaced by fakes here (tests/integration/test_auth_munge.py uses the real ones):
the fake unmunger treats a credential as `FAKE:<uid>:<nonce>:<payload>`, refuses anything else and
refuses a credential it has seen (as munged does).
"""
from __future__ import annotations

import contextlib
import http.server
import json
import threading
from datetime import timedelta

import pytest

from predictor.app import create_app
from predictor.auth import AuthError, Authenticator, MungeIdentity
from slurm_plugin.contracts.signing import MUNGE_HEADER, munge_payload
from predictor.config import Config
from slurm_plugin.client import JobOwner
from slurm_plugin.errors import JobNotFoundError
from tests.unit._service_fakes import COLLECTIVE, DDP_OVERHEAD, PROFILE, STEP, FakePredictor

TOKEN, ADMIN = "tool-token", "admin-token"
NOW = 2_000_000_000.0


class FakeUnmunger:
    def __init__(self):
        self.seen: set[str] = set()

    def decode(self, credential: str) -> MungeIdentity:
        if not credential.startswith("FAKE:"):
            raise AuthError(401, f"{MUNGE_HEADER}: bad credential: Invalid credential", MUNGE_HEADER, "bad_credential")
        if credential in self.seen:
            raise AuthError(401, f"{MUNGE_HEADER}: bad credential: credential replayed", MUNGE_HEADER,
                            "bad_credential")
        self.seen.add(credential)
        _, uid, _nonce, payload = credential.split(":", 3)
        return MungeIdentity(int(uid), int(uid), payload)


def facts(job_id: int, uid: int, state: str, ended: float | None, **alloc) -> JobOwner:
    """A job as Slurm would describe it: by default 2 nodes x 4 GPUs of partition debug (H200 in the default
    cluster model), started an hour before NOW."""
    alloc = {"started_at_s": NOW - 7200, "max_nodes": 2, "max_gpus": 8, "max_cpus": 16, "gpus_per_node": 4,
             "partition": "debug", **alloc}
    if state == "PENDING":
        alloc.update(started_at_s=None, max_nodes=0)
    return JobOwner(job_id, uid, state, ended, **alloc)


class FakeJobs:
    jobs = {7: facts(7, 1000, "RUNNING", None), 8: facts(8, 1001, "RUNNING", None),
            9: facts(9, 1000, "COMPLETED", NOW - 60), 10: facts(10, 1000, "COMPLETED", NOW - 3600),
            11: facts(11, 1000, "PENDING", None)}

    def job_owner(self, job_id: int) -> JobOwner:
        if job_id not in self.jobs:
            raise JobNotFoundError(job_id, "neither squeue nor sacct lists it")
        return self.jobs[job_id]


def sign(body: bytes, job_id: int, uid: int = 1000, nonce: list = [0]) -> dict:   # noqa: B006 - a counter
    nonce[0] += 1
    return {MUNGE_HEADER: f"FAKE:{uid}:{nonce[0]}:{munge_payload(body, job_id)}", "Content-Type": "application/json"}


def make_app(tmp_path, **cfg):
    config = Config(db_path=str(tmp_path / "p.db"), refit_debounce=timedelta(0), refit_min_interval=timedelta(0),
                    refit_poll=timedelta(milliseconds=50), **cfg)
    app = create_app(config, predictor_factory=FakePredictor, start_refit=False)
    app.extensions["elastic_predictor_auth"] = Authenticator(
        token=config.token, admin_token=config.admin_token, munge=config.munge_auth, unmunger=FakeUnmunger(),
        jobs=FakeJobs(), job_recent=config.job_recent, read_auth=config.read_auth, clock=lambda: NOW)
    return app


@pytest.fixture
def app(tmp_path):
    app = make_app(tmp_path, token=TOKEN, admin_token=ADMIN, munge_auth=True)
    yield app
    app.extensions["elastic_predictor"].store.close()


@pytest.fixture
def client(app):
    return app.test_client()


def body_of(records) -> bytes:
    return json.dumps(records).encode()


def test_signed_observations_accepted_and_tagged_with_the_job(client, app):
    body = body_of([COLLECTIVE])
    r = client.post("/v1/observations", data=body, headers=sign(body, 7))
    assert r.status_code == 201, r.json
    stored = app.extensions["elastic_predictor"].store.observations()
    assert stored[-1]["job_id"] == 7


def test_recently_ended_job_accepted(client):
    body = body_of([COLLECTIVE])
    assert client.post("/v1/observations", data=body, headers=sign(body, 9)).status_code == 201


@pytest.mark.parametrize("job,uid,tamper,status,reason", [
    (7, 1001, False, 403, "uid_mismatch"),
    (8, 1000, False, 403, "uid_mismatch"),
    (99, 1000, False, 403, "job_not_found"),
    (10, 1000, False, 403, "job_not_active"),
    (11, 1000, False, 403, "job_not_active"),
    (7, 1000, True, 403, "digest_mismatch"),
])
def test_signed_write_refusals_name_what_failed(client, job, uid, tamper, status, reason):
    body = body_of([COLLECTIVE])
    headers = sign(body, job, uid)
    sent = body_of([dict(COLLECTIVE, seconds=9.0)]) if tamper else body
    r = client.post("/v1/observations", data=sent, headers=headers)
    assert r.status_code == status
    assert r.json["reason"] == reason and r.json["field"] == MUNGE_HEADER
    assert reason.replace("_", " ").split()[0] in r.json["error"]


def test_bad_and_replayed_credentials(client):
    body = body_of([COLLECTIVE])
    r = client.post("/v1/observations", data=body, headers={MUNGE_HEADER: "MUNGE:garbage"})
    assert (r.status_code, r.json["reason"]) == (401, "bad_credential")
    headers = sign(body, 7)
    assert client.post("/v1/observations", data=body, headers=headers).status_code == 201
    r = client.post("/v1/observations", data=body, headers=headers)
    assert (r.status_code, r.json["reason"]) == (401, "bad_credential") and "replayed" in r.json["error"]


def test_payload_must_bind_job_and_digest(client):
    body = body_of([COLLECTIVE])
    r = client.post("/v1/observations", data=body, headers={MUNGE_HEADER: "FAKE:1000:1:hello"})
    assert (r.status_code, r.json["reason"]) == (401, "bad_payload")


def test_record_of_another_job_refused(client):
    body = body_of([dict(COLLECTIVE, job_id=8)])
    r = client.post("/v1/observations", data=body, headers=sign(body, 7))
    assert (r.status_code, r.json["reason"]) == (403, "job_id_mismatch")
    assert r.json["field"] == "observations[0].job_id"


def test_job_may_add_but_not_replace_a_profile(client):
    body = json.dumps(dict(PROFILE, name="my-resnet")).encode()
    assert client.post("/v1/profiles", data=body, headers=sign(body, 7)).status_code == 201
    assert client.post("/v1/profiles", data=body, headers=sign(body, 7)).status_code == 200   # unchanged
    changed = json.dumps(dict(PROFILE, name="my-resnet", source="poisoned")).encode()
    r = client.post("/v1/profiles", data=changed, headers=sign(changed, 7))
    assert (r.status_code, r.json["reason"]) == (403, "admin_required")
    assert client.post("/v1/profiles", data=changed, headers={"Authorization": f"Bearer {ADMIN}",
                                                              "Content-Type": "application/json"}).status_code == 200


def test_a_job_registers_a_well_known_name_only_with_its_shape(client):
    # #24.6: a job registered `llama-70b` with 2 tensors; every job of that model was then planned from it
    from predictor.profiles import profile_from_spec
    squat = json.dumps(dict(PROFILE, name="gpt2")).encode()
    r = client.post("/v1/profiles", data=squat, headers=sign(squat, 7))
    assert (r.status_code, r.json["reason"], r.json["field"]) == (403, "reserved_name", "name"), r.json
    assert "well-known" in r.json["error"]
    true = json.dumps(profile_from_spec("gpt2").to_dict()).encode()
    assert client.post("/v1/profiles", data=true, headers=sign(true, 7)).status_code == 201
    tool = json.dumps(dict(PROFILE, name="vgg16")).encode()            # tokens are trusted (admin-guide)
    assert client.post("/v1/profiles", data=tool, headers={"Authorization": f"Bearer {TOKEN}",
                                                           "Content-Type": "application/json"}).status_code == 201


def test_one_users_jobs_register_profiles_within_a_quota(client, monkeypatch):
    # #24.6: one job registered 100 profiles of 3.85 MB (385 MB of database, listings at 760 ms)
    from predictor.api import profiles
    monkeypatch.setattr(profiles, "JOB_PROFILE_QUOTA", (2, 10 ** 6))

    def named(name):
        return json.dumps(dict(PROFILE, name=name)).encode()
    for name, job in (("m-1", 7), ("m-2", 8)):   # two jobs of uid 1000 (the fake Slurm's owner of both)
        assert client.post("/v1/profiles", data=named(name), headers=sign(named(name), 7)).status_code == 201
    r = client.post("/v1/profiles", data=named("m-3"), headers=sign(named("m-3"), 7))
    assert (r.status_code, r.json["reason"], r.json["field"]) == (403, "profile_quota", "name")
    assert "uid 1000 holds 2 profiles" in r.json["error"]
    assert client.post("/v1/profiles", data=named("m-1"), headers=sign(named("m-1"), 7)).status_code == 200
    tool = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    assert client.post("/v1/profiles", data=named("m-3"), headers=tool).status_code == 201   # tokens are not bound
    owners = dict(client.application.extensions["elastic_predictor"].store.db.execute(
        "SELECT name, owner FROM profiles").fetchall())
    assert owners["m-1"] == owners["m-2"] == 1000 and owners["m-3"] is None


def test_tool_token_may_not_replace_a_profile_while_an_admin_token_is_set(client):
    # issue #14.1: the tool token replaced a 199-tensor profile with a 1-tensor one (200) despite the admin token
    tool = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    assert client.post("/v1/profiles", data=json.dumps(PROFILE), headers=tool).status_code == 201
    assert client.post("/v1/profiles", data=json.dumps(PROFILE), headers=tool).status_code == 200  # unchanged
    one = dict(PROFILE, tensors=PROFILE["tensors"][:1])
    r = client.post("/v1/profiles", data=json.dumps(one), headers=tool)
    assert (r.status_code, r.json["reason"], r.json["field"]) == (403, "admin_required", "name")
    assert len(client.get(f"/v1/profiles/{PROFILE['name']}").json["tensors"]) == len(PROFILE["tensors"])


def test_without_an_admin_token_the_tool_token_administers(tmp_path):
    from predictor.auth import Authenticator, Caller
    assert Authenticator(token=TOKEN).administers(Caller("tool"))
    assert not Authenticator(token=TOKEN, admin_token=ADMIN).administers(Caller("tool"))
    assert not Authenticator(token=TOKEN).administers(Caller("job", uid=1, job_id=7))
    assert Authenticator().administers(Caller("anonymous"))  # writes open: nothing configured
    assert not Authenticator(munge=True).administers(Caller("anonymous"))


@pytest.mark.parametrize("headers,status,reason", [
    ({}, 401, "missing_credential"),
    ({"Authorization": "Bearer nope"}, 403, "bad_token"),
    ({"Authorization": "Basic abc"}, 401, "missing_credential"),
])
def test_bearer_refusals(client, headers, status, reason):
    r = client.post("/v1/observations", json=[COLLECTIVE], headers=headers)
    assert (r.status_code, r.json["reason"], r.json["field"]) == (status, reason, "Authorization")
    if status == 401:
        assert "WWW-Authenticate" in r.headers


def test_a_token_is_read_as_nginx_keys_its_cap_spaces_and_tabs_around_it_only():
    """#24.3: nginx caps requests in progress per bearer token, keyed on the token with the scheme in any case and
    spaces and tabs around it dropped (nginx.conf.in). The service compared the token after Python's str.strip(),
    which drops other characters too (form feed, \\x1c-\\x1f, \\x85, NBSP): `Bearer <token>\\xa0` was accepted as the
    token under another nginx key, a second cap of requests for one credential. Now only spaces and tabs go."""
    from predictor.auth import AuthError, Authenticator
    auth = Authenticator(token=TOKEN)
    for header in (f"Bearer {TOKEN}", f"bearer  {TOKEN} ", f"BEARER \t{TOKEN}\t"):
        assert auth.check_write({"Authorization": header}, b"").kind == "tool", header
    for header in (f"Bearer {TOKEN}\xa0", f"Bearer {TOKEN}\x0c", f"Bearer \x1f{TOKEN}", f"Bearer {TOKEN}\x85"):
        with pytest.raises(AuthError) as err:
            auth.check_write({"Authorization": header}, b"")
        assert (err.value.status, err.value.reason) == (403, "bad_token"), repr(header)


@pytest.mark.parametrize("token", [TOKEN, ADMIN])
def test_tool_and_admin_tokens_write(client, token):
    r = client.post("/v1/observations", json=[COLLECTIVE], headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201


def test_munge_header_refused_when_munge_is_off(tmp_path):
    app = make_app(tmp_path, token=TOKEN)
    body = body_of([COLLECTIVE])
    r = app.test_client().post("/v1/observations", data=body, headers=sign(body, 7))
    assert (r.status_code, r.json["reason"]) == (401, "munge_disabled")
    app.extensions["elastic_predictor"].store.close()


def test_reads_open_by_default_and_closed_by_the_switch(tmp_path, client):
    assert client.get("/v1/profiles").status_code == 200
    (tmp_path / "b").mkdir()
    closed_app = make_app(tmp_path / "b", token=TOKEN, admin_token=ADMIN, munge_auth=True, read_auth=True)
    closed = closed_app.test_client()
    r = closed.get("/v1/profiles")
    assert (r.status_code, r.json["reason"]) == (401, "missing_credential")
    assert closed.get("/v1/decisions").status_code == 401
    assert closed.get("/healthz").status_code == 200
    assert closed.get("/v1/profiles", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert closed.get("/v1/profiles", headers=sign(b"", 7)).status_code == 200
    assert closed.get("/v1/profiles", headers={"Authorization": "Bearer x"}).status_code == 403
    # #14.9: the API contract stays open as documented; POST /v1/predict only reads, so it is closed too
    assert closed.get("/v1/openapi.json").status_code == 200
    query = json.dumps({"profile": "x", "gpu": "H100", "per_gpu_batch": 8}).encode()
    r = closed.post("/v1/predict", data=query, headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json["reason"]) == (401, "missing_credential")
    signed = closed.post("/v1/predict", data=query, headers={**sign(query, 7), "Content-Type": "application/json"})
    assert signed.status_code != 401 and signed.status_code != 403
    closed_app.extensions["elastic_predictor"].store.close()


@pytest.mark.parametrize("name", ["resnet50\n", "resnet50\n\n"])
def test_a_name_with_a_trailing_newline_is_refused(client, name):
    # #14.9: `$` with re.match let "resnet50\n" through
    body = json.dumps(dict(PROFILE, name=name)).encode()
    r = client.post("/v1/profiles", data=body, headers={"Authorization": f"Bearer {ADMIN}",
                                                        "Content-Type": "application/json"})
    assert (r.status_code, r.json["field"]) == (400, "name")


def test_admin_check(tmp_path):
    auth = Authenticator(token=TOKEN, admin_token=ADMIN)
    assert auth.check_admin({"Authorization": f"Bearer {ADMIN}"}).kind == "admin"
    with pytest.raises(AuthError) as err:
        auth.check_admin({"Authorization": f"Bearer {TOKEN}"})
    assert err.value.reason == "admin_required"
    assert Authenticator(token=TOKEN).check_admin({"Authorization": f"Bearer {TOKEN}"}).kind == "admin"


def test_open_service_stays_open(tmp_path):
    app = make_app(tmp_path)
    assert app.test_client().post("/v1/observations", json=[COLLECTIVE]).status_code == 201
    app.extensions["elastic_predictor"].store.close()


def test_config_reads_auth_variables_once():
    cfg = Config.from_env({"ELASTIC_PREDICTOR_ADMIN_TOKEN": "a", "ELASTIC_PREDICTOR_MUNGE": "1",
                           "ELASTIC_PREDICTOR_MUNGE_SOCKET": "/run/m.sock", "ELASTIC_PREDICTOR_SLURM_CONF": "/etc/s.conf",
                           "ELASTIC_PREDICTOR_JOB_RECENT_S": "30", "ELASTIC_PREDICTOR_READ_AUTH": "true"})
    assert (cfg.admin_token, cfg.munge_auth, cfg.munge_socket, cfg.slurm_conf, cfg.read_auth) == \
           ("a", True, "/run/m.sock", "/etc/s.conf", True)
    assert cfg.job_recent == timedelta(seconds=30)
    from predictor.errors import ValidationError
    with pytest.raises(ValidationError) as err:
        Config.from_env({"ELASTIC_PREDICTOR_MUNGE": "maybe"})
    assert err.value.field == "ELASTIC_PREDICTOR_MUNGE"


def test_job_owner_lines_from_squeue_and_sacct():
    from slurm_plugin.client import parse_owner
    # captured on the testbed: squeue -O (see _OWNER_SQUEUE) and sacct -X -P (_OWNER_SACCT) of a 2-node
    # --gres=gpu:2 job shrunk to 1 node: its first size stays in sacct as RESIZING
    squeue = "1|1000|RUNNING|2026-11-27T05:15:42|2026-11-27T05:20:42|1|debug|cpu=1,node=1,billing=1,gres/gpu=2|" \
             "gres:gpu:2|\n"
    sacct = ("1|1000|RESIZING|2026-11-27T05:15:42|2026-11-27T05:16:07|2|debug|billing=2,cpu=2,gres/gpu=4,node=2\n"
             "1|1000|RUNNING|2026-11-27T05:15:42|Unknown|1|debug|billing=1,cpu=1,gres/gpu=2,node=1\n")
    job = parse_owner(squeue, sacct, 1)
    assert (job.user_id, job.state, job.ended_at_s, job.partition) == (1000, "RUNNING", None, "debug")
    assert (job.max_nodes, job.max_gpus, job.max_cpus, job.gpus_per_node, job.gpu_type) == (2, 4, 2, 2, None)
    assert job.started_at_s is not None
    # forgotten by slurmctld: sacct alone; its newest record gives the state, the end and a typed GPU
    done = parse_owner("", "17|0|RESIZING|2026-11-26T07:40:00|2026-11-26T07:41:00|4|gpu|gres/gpu=16,"
                           "gres/gpu:h100=16\n17|0|CANCELLED by 0|2026-11-26T07:40:00|2026-11-26T07:49:48|2|gpu|"
                           "gres/gpu=8,gres/gpu:h100=8\n", 17)
    assert (done.state, done.max_nodes, done.max_gpus, done.gpu_type, done.gpus_per_node) == \
        ("CANCELLED", 4, 16, "h100", None)
    assert done.ended_at_s - done.started_at_s == 588
    pending = parse_owner("5|1000|PENDING|2026-11-27T06:00:00|2026-11-27T07:00:00|2|debug||gres:gpu:4|", "", 5)
    assert (pending.state, pending.started_at_s, pending.max_nodes, pending.max_gpus) == ("PENDING", None, 0, 0)
    assert parse_owner("", "", 5) is None and parse_owner("18|0|RUNNING|||1|debug|||", "", 5) is None
    assert parse_owner("5|root|RUNNING|||1|debug|||", "", 5) is None


# --- the launcher's side: elastic_launcher.reporting.PredictorClient signs its posts ---------------------
class FakeSigner:
    """Stands in for `munge_sign` in the launcher: FAKE credentials the FakeUnmunger above decodes."""

    def __init__(self, uid: int = 1000, error: Exception | None = None):
        self.uid, self.error, self.signed = uid, error, []

    def __call__(self, body: bytes, job_id: int, socket=None, timeout=None) -> dict:
        if self.error is not None:
            raise self.error
        self.signed.append(body)
        return {MUNGE_HEADER: f"FAKE:{self.uid}:{len(self.signed)}:{munge_payload(body, job_id)}"}


@pytest.fixture
def serve_app():
    """Serve a Flask app over real HTTP (the launcher posts with `requests`); yields a function app -> URL."""
    from werkzeug.serving import make_server

    servers = []

    def start(flask_app) -> str:
        server = make_server("127.0.0.1", 0, flask_app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)  # shutdown() waits a poll
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server, thread in servers:
        server.shutdown()
        thread.join()


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers POSTs with the statuses queued in `answers` (then 201) and records what it received."""

    answers: list = []
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        Scripted.seen.append((dict(self.headers), raw))
        status, body = Scripted.answers.pop(0) if Scripted.answers else (201, b'{"stored": 1}')
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    Scripted.answers, Scripted.seen = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)  # shutdown() waits a poll
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def launcher(url, monkeypatch, signer, **kwargs):
    from elastic_launcher import reporting

    monkeypatch.setattr(reporting, "munge_sign", signer)
    return reporting.PredictorClient(url, kwargs.pop("token", TOKEN), timeout_s=5, retry_delay_s=0, **kwargs)


def test_launcher_signs_the_bytes_it_sends_and_the_service_accepts_them(app, serve_app, monkeypatch):
    signer = FakeSigner()
    client = launcher(serve_app(app), monkeypatch, signer, job_id=7)
    records = [COLLECTIVE, dict(COLLECTIVE, seconds=1 / 3, bytes=1 << 20)]   # a float with many digits
    assert client.observe(records), client.last_error
    stored = app.extensions["elastic_predictor"].store.observations()
    assert [r["job_id"] for r in stored] == [7, 7] and stored[-1]["seconds"] == 1 / 3
    assert [r["uid"] for r in stored] == [1000, 1000]  # the signer's: one user's jobs share one cap (#24.1)
    assert len(signer.signed) == 1 and json.loads(signer.signed[0]) == records


def test_launcher_signed_post_for_a_foreign_job_is_refused_and_does_not_raise(app, serve_app, monkeypatch):
    client = launcher(serve_app(app), monkeypatch, FakeSigner(uid=1000), job_id=8)   # job 8 is uid 1001's
    assert client.observe([COLLECTIVE]) is False
    assert "403" in client.last_error and "uid_mismatch" in client.last_error
    assert sum(app.extensions["elastic_predictor"].store.observation_counts().values()) == 0


def test_each_retry_is_signed_afresh_over_the_same_bytes(scripted, monkeypatch):
    Scripted.answers = [(503, b'{"reason": "slurm_unavailable"}'), (502, b"bad gateway")]
    signer = FakeSigner()
    client = launcher(scripted, monkeypatch, signer, job_id=7, retries=2)
    assert client.observe([COLLECTIVE]), client.last_error
    assert len(Scripted.seen) == 3 and len(signer.signed) == 3
    credentials = [headers[MUNGE_HEADER] for headers, _ in Scripted.seen]
    assert len(set(credentials)) == 3, "a munge credential is accepted once: every attempt needs its own"
    for (headers, raw), signed in zip(Scripted.seen, signer.signed):
        assert raw == signed and headers[MUNGE_HEADER].endswith(munge_payload(raw, 7))
        assert "Authorization" not in headers


def test_every_attempt_of_one_write_carries_one_idempotency_key(scripted, monkeypatch):
    # #24.13: a retry after a lost answer was stored twice (9 of 13,896 posts under SIGKILL)
    Scripted.answers = [(503, b'{"reason": "slurm_unavailable"}'), (502, b"bad gateway")]
    client = launcher(scripted, monkeypatch, FakeSigner(), job_id=7, retries=2)
    assert client.observe([COLLECTIVE]) and client.observe([COLLECTIVE])
    keys = [headers["Idempotency-Key"] for headers, _ in Scripted.seen]
    assert len(keys) == 4 and len(set(keys[:3])) == 1 and keys[3] != keys[0]


def test_a_write_retried_with_its_key_is_stored_once(client):
    store = client.application.extensions["elastic_predictor"].store
    auth = {"Authorization": f"Bearer {TOKEN}"}
    headers = {**auth, "Idempotency-Key": "job7-batch-1"}
    first = client.post("/v1/observations", json=[COLLECTIVE, COLLECTIVE], headers=headers)
    again = client.post("/v1/observations", json=[COLLECTIVE, COLLECTIVE], headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.get_json() == {**first.get_json(), "replayed": True} and first.get_json()["replayed"] is False
    assert store.observation_counts()["collective"] == 2
    other = client.post("/v1/observations", json=[COLLECTIVE], headers={**auth, "Idempotency-Key": "job7-batch-2"})
    assert other.get_json()["replayed"] is False and store.observation_counts()["collective"] == 3
    bad = client.post("/v1/observations", json=[COLLECTIVE], headers={**auth, "Idempotency-Key": "a b"})
    assert bad.status_code == 400 and bad.get_json()["field"] == "Idempotency-Key"


def test_a_key_reused_with_another_body_is_refused_and_stores_nothing(client):
    """#41.8: a reused Idempotency-Key with another body answered 201 "replayed" and dropped the new rows (two
    clients of the shared token collide). The key is bound to the body's SHA-256: 409, nothing stored; the same key
    and bytes still replay; another caller's same key is its own."""
    store = client.application.extensions["elastic_predictor"].store
    auth = {"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": "shared-1", "Content-Type": "application/json"}
    first = client.post("/v1/observations", data=body_of([COLLECTIVE]), headers=auth)
    other = client.post("/v1/observations", data=body_of([COLLECTIVE, COLLECTIVE]), headers=auth)
    assert (first.status_code, other.status_code) == (201, 409)
    assert other.get_json()["field"] == "Idempotency-Key" and "another body" in other.get_json()["error"]
    assert store.observation_counts()["collective"] == 1
    again = client.post("/v1/observations", data=body_of([COLLECTIVE]), headers=auth)
    assert again.status_code == 201 and again.get_json()["replayed"] is True
    body = body_of([COLLECTIVE, COLLECTIVE])
    job = client.post("/v1/observations", data=body, headers={**sign(body, 7), "Idempotency-Key": "shared-1"})
    assert job.status_code == 201 and job.get_json()["replayed"] is False
    assert store.observation_counts()["collective"] == 3


def test_a_job_credential_and_the_tool_token_have_a_storage_quota_of_every_row_kind(tmp_path):
    """#41.3: collective rows were outside a job's storage claim (one job: 2.1 MB/s, 7.4 GB an hour) and the tool
    token had no quota at all. Now a job credential stores at most `job_write_quota_bytes` of rows in all, the tool
    token `token_write_quota_bytes` a UTC day; past it 403 `storage_quota`, nothing of that request stored; other
    jobs and the admin token are not held by it."""
    row = len(json.dumps(dict(COLLECTIVE, job_id=7, uid=1000)).encode())
    app = make_app(tmp_path, token=TOKEN, admin_token=ADMIN, munge_auth=True, job_write_quota_bytes=5 * row,
                   token_write_quota_bytes=3 * row + 10)
    client, store = app.test_client(), app.extensions["elastic_predictor"].store
    statuses = []
    for _ in range(7):
        body = body_of([COLLECTIVE])
        statuses.append(client.post("/v1/observations", data=body, headers=sign(body, 7)).status_code)
    assert statuses == [201] * 5 + [403] * 2
    body = body_of([COLLECTIVE])
    refused = client.post("/v1/observations", data=body, headers=sign(body, 7))
    assert refused.json["reason"] == "storage_quota" and refused.json["field"] == "observations"
    assert store.observation_counts()["collective"] == 5
    body = body_of([COLLECTIVE])
    assert client.post("/v1/observations", data=body, headers=sign(body, 8, uid=1001)).status_code == 201
    tool = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    tool_rows = body_of([dict(COLLECTIVE, job_id=99)] * 2)
    assert [client.post("/v1/observations", data=tool_rows, headers=tool).status_code for _ in range(2)] == [201, 403]
    admin = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
    assert client.post("/v1/observations", data=body_of([COLLECTIVE] * 8), headers=admin).status_code == 201
    app.extensions["elastic_predictor"].store.close()


def test_a_payload_names_its_job_in_ascii_digits(client):
    """#41.9: '\u0661\u0662' matched \\d and int() read it as job 12."""
    from slurm_plugin.contracts.signing import PAYLOAD_PREFIX
    body = body_of([COLLECTIVE])
    payload = munge_payload(body, 12).replace("job=12", "job=\u0661\u0662")
    assert payload.startswith(PAYLOAD_PREFIX + " job=\u0661")
    r = client.post("/v1/observations", data=body, headers={MUNGE_HEADER: f"FAKE:1000:99:{payload}"})
    assert (r.status_code, r.json["reason"]) == (401, "bad_payload")


def test_a_decision_id_of_other_digits_is_not_found(client):
    r = client.get("/v1/decisions/d-\u00b2")
    assert r.status_code == 404 and r.get_json()["what"] == "decision"


def test_one_users_jobs_have_at_most_two_writes_in_progress_in_a_process_and_no_one_else_waits(client, app):
    """#24.3: nginx caps requests per bearer token but cannot read a munge credential (signed afresh each time), so
    one user's jobs, from as many addresses and credentials as they like, could hold every thread of a side worker
    with writes. Now a signer uid has at most CREDENTIAL_WRITES writes in progress in one process; beyond, 429
    credential_busy to it alone. Tokens are trusted callers, capped by nginx (an import may write from threads)."""
    import contextlib  # noqa: PLC0415

    from predictor.auth import CREDENTIAL_WRITES, Caller  # noqa: PLC0415
    auth = app.extensions["elastic_predictor_auth"]
    body = body_of([COLLECTIVE])
    tool, admin = {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": f"Bearer {ADMIN}"}
    with contextlib.ExitStack() as held:
        for _ in range(CREDENTIAL_WRITES):        # uid 1000's jobs have that many writes in progress (other threads)
            held.enter_context(auth.slots.hold(Caller("job", uid=1000, job_id=9)))
        r = client.post("/v1/observations", data=body, headers=sign(body, 7))      # another job of uid 1000
        assert (r.status_code, r.json["reason"], r.json["field"]) == (429, "credential_busy", MUNGE_HEADER)
        assert r.headers["Retry-After"] == "1" and "uid 1000" in r.json["error"]
        assert client.post("/v1/observations", data=body, headers=sign(body, 8, 1001)).status_code == 201
        assert client.post("/v1/observations", json=[COLLECTIVE], headers=tool).status_code == 201
        assert client.post("/v1/observations", json=[COLLECTIVE], headers=admin).status_code == 201
        for _ in range(CREDENTIAL_WRITES + 1):        # no slot for a token: nginx caps those
            held.enter_context(auth.slots.hold(Caller("tool")))
        assert client.post("/v1/observations", json=[COLLECTIVE], headers=tool).status_code == 201
    assert client.post("/v1/observations", data=body, headers=sign(body, 7)).status_code == 201
    bad = b'[{"kind": "nope"}]'
    assert client.post("/v1/observations", data=bad, headers=sign(bad, 7)).status_code == 400
    assert auth.slots.held() == {}                # every write let go of its slot, a refused one too


def test_credential_slots_refuse_a_cap_below_one():
    from predictor.auth import CredentialSlots  # noqa: PLC0415
    with pytest.raises(ValueError, match="per_credential must be >= 1, got 0"):
        CredentialSlots(0)


def test_a_busy_answer_is_retried_and_the_batch_stored(scripted, monkeypatch):
    # #24.3: over nginx's cap of requests in progress per bearer token (or per address) the answer is 429; the
    # launcher took it for a refusal and dropped the batch. It is busy, not refused: retried like a 5xx
    Scripted.answers = [(429, b'{"reason": "busy"}')]
    client = launcher(scripted, monkeypatch, FakeSigner(), job_id=7, retries=1)
    assert client.observe([COLLECTIVE]), client.last_error
    assert len(Scripted.seen) == 2 and client.writes_refused is None


def test_a_refusal_is_not_retried_and_stops_the_jobs_writes(scripted, monkeypatch):
    Scripted.answers = [(403, b'{"reason": "digest_mismatch"}')]
    client = launcher(scripted, monkeypatch, FakeSigner(), job_id=7, retries=3)
    assert client.observe([COLLECTIVE]) is False and "HTTP 403" in client.last_error
    assert client.observe([COLLECTIVE]) is False
    assert len(Scripted.seen) == 1


def test_a_refused_write_is_logged_once_and_plans_are_still_asked_and_followed(scripted, monkeypatch, caplog):
    # #26.4: a 401 on observations opened the breaker for every call, so the launcher grew by its own rule
    # ("heuristic (service unreachable)") against the submit-time plan
    plan = {"action": "keep", "reason": "fine", "nodes": 2}
    Scripted.answers = [(401, b'{"reason": "missing_credential"}'), (200, json.dumps(plan).encode()),
                        (400, b'{"error": "bad directive"}'), (200, json.dumps(plan).encode())]
    client = launcher(scripted, monkeypatch, FakeSigner(), job_id=7)
    with caplog.at_level("WARNING"):
        assert client.observe([COLLECTIVE]) is False and client.writes_refused
        assert client.observe([COLLECTIVE]) is False                      # not posted again
        assert client.plan({"source": "launcher", "directives": []}) == plan
        assert client.plan({"source": "launcher", "directives": []}) is None   # a refused plan: no breaker ...
        assert client.plan({"source": "launcher", "directives": []}) == plan   # ... the next one is asked
    assert len(Scripted.seen) == 4
    assert sum("not allowed to write" in r.getMessage() for r in caplog.records) == 1


def test_munge_error_falls_back_to_the_bearer_token_and_is_logged_once(scripted, monkeypatch, caplog):
    from slurm_plugin.contracts.signing import MungeError

    client = launcher(scripted, monkeypatch, FakeSigner(error=MungeError("cannot run munge: no such file")), job_id=7)
    assert client.observe([COLLECTIVE]) and client.observe([STEP])
    assert [headers.get("Authorization") for headers, _ in Scripted.seen] == [f"Bearer {TOKEN}"] * 2
    assert all(MUNGE_HEADER not in headers for headers, _ in Scripted.seen)
    warnings = [r for r in caplog.records if "munge" in r.getMessage()]
    assert len(warnings) == 1 and "no such file" in warnings[0].getMessage()
    assert "bearer token" in warnings[0].getMessage()


def test_service_without_munge_gets_the_bearer_token(tmp_path, serve_app, monkeypatch, caplog):
    no_munge = make_app(tmp_path, token=TOKEN)
    signer = FakeSigner()
    client = launcher(serve_app(no_munge), monkeypatch, signer, job_id=7)
    assert client.observe([COLLECTIVE]) and client.observe([COLLECTIVE]), client.last_error
    assert len(signer.signed) == 1, "after munge_disabled the launcher stops signing"
    assert no_munge.extensions["elastic_predictor"].store.observation_counts()["collective"] == 2
    assert len([r for r in caplog.records if "accepts no munge" in r.getMessage()]) == 1
    no_munge.extensions["elastic_predictor"].store.close()


@pytest.mark.parametrize("case", ["signer crashes", "garbage reply", "nan in body", "service down"])
def test_posting_never_raises(scripted, monkeypatch, case):
    signer = FakeSigner(error=RuntimeError("boom") if case == "signer crashes" else None)
    url = "http://127.0.0.1:9" if case == "service down" else scripted
    client = launcher(url, monkeypatch, signer, job_id=7, retries=0)
    if case == "garbage reply":
        Scripted.answers = [(200, b"<html>not json")]
    record = dict(COLLECTIVE, seconds=float("nan")) if case == "nan in body" else COLLECTIVE
    assert client.observe([record]) is False
    assert client.last_error.startswith("/v1/observations: ")
    assert client.observe([COLLECTIVE]) is False    # breaker open
    assert len(Scripted.seen) == (1 if case == "garbage reply" else 0)


def test_without_a_job_id_the_launcher_sends_the_bearer_token(scripted, monkeypatch):
    signer = FakeSigner()
    assert launcher(scripted, monkeypatch, signer).observe([COLLECTIVE])
    assert signer.signed == [] and Scripted.seen[0][0]["Authorization"] == f"Bearer {TOKEN}"


def test_plan_is_asked_once_and_signed_for_the_job(scripted, monkeypatch):
    # signed since #24.12: only the job itself is answered from its own step times
    Scripted.answers = [(503, b'{"reason": "busy"}')]
    signer = FakeSigner()
    client = launcher(scripted, monkeypatch, signer, job_id=7, retries=3)
    assert client.plan({"source": "launcher", "directives": []}) is None
    assert len(Scripted.seen) == 1 and len(signer.signed) == 1
    assert MUNGE_HEADER in Scripted.seen[0][0]


def test_a_header_that_is_no_munge_credential_never_runs_unmunge(monkeypatch):
    from predictor import auth as auth_module
    runs = []
    monkeypatch.setattr(auth_module.subprocess, "run", lambda *a, **k: runs.append(a) or None)
    for junk in ("garbage", "MUNGE:", "MUNGE:!!!!:", "MUNGE:" + "A" * 20000 + ":", "x" * 100):
        with pytest.raises(auth_module.AuthError) as err:
            auth_module.Unmunger().decode(junk)
        assert err.value.reason == "bad_credential" and "not a munge credential" in str(err.value)
    assert runs == []


def test_slurm_is_asked_about_a_job_once_per_ttl_found_or_not_found():
    from predictor.auth import OwnerCache
    from slurm_plugin.errors import JobNotFoundError
    calls = []

    class Jobs:
        def job_owner(self, job_id):
            calls.append(job_id)
            if job_id == 404:
                raise JobNotFoundError(f"job {job_id}")
            return ("owner", job_id)

    now = [0.0]
    cache = OwnerCache(lambda: Jobs(), clock=lambda: now[0])
    assert cache.job_owner(7) == cache.job_owner(7) == ("owner", 7)
    for _ in range(3):
        with pytest.raises(JobNotFoundError):
            cache.job_owner(404)
    assert calls == [7, 404]
    now[0] = cache.ttl.total_seconds() + 0.01   # a found job's state is re-read after ttl (it may have ended) ...
    cache.job_owner(7)
    with pytest.raises(JobNotFoundError):        # ... an unknown one only after missing_ttl
        cache.job_owner(404)
    assert calls == [7, 404, 7]
    now[0] = cache.missing_ttl.total_seconds() + 0.01
    with pytest.raises(JobNotFoundError):
        cache.job_owner(404)
    assert calls == [7, 404, 7, 404]


def test_one_users_credentials_for_made_up_jobs_are_limited_and_others_still_get_in(tmp_path):
    # #24.4: valid credentials for made-up job ids (~220/s) each cost a squeue + sacct of ~0.3 s; the Slurm
    # lookups one uid may cause are bounded (429 lookup_rate, Retry-After), another user's job is not affected
    from predictor.auth import LookupBudget
    lookups = []

    class CountingJobs(FakeJobs):
        def job_owner(self, job_id):
            lookups.append(job_id)
            return super().job_owner(job_id)

    app = make_app(tmp_path, token=TOKEN, admin_token=ADMIN, munge_auth=True)
    try:
        auth = app.extensions["elastic_predictor_auth"]
        auth._jobs = CountingJobs()
        auth.owners.budget = LookupBudget(rate=1.0, burst=10, clock=lambda: 0.0)  # time stands still
        client = app.test_client()
        body = body_of([COLLECTIVE])
        answers = [client.post("/v1/observations", data=body, headers=sign(body, 100_000 + i, uid=666))
                   for i in range(100)]
        codes = [r.status_code for r in answers]
        assert codes.count(403) == 10 and codes.count(429) == 90, codes    # 10 looked up (not found), 90 limited
        assert len(lookups) == 10
        limited = next(r for r in answers if r.status_code == 429)
        assert limited.json["reason"] == "lookup_rate" and limited.headers["Retry-After"] == "1"
        ok = client.post("/v1/observations", data=body, headers=sign(body, 8, uid=1001))  # another user's job
        assert ok.status_code == 201, ok.json
    finally:
        app.extensions["elastic_predictor"].store.close()


def test_slurm_lookups_at_once_are_bounded_and_the_excess_told_to_retry():
    import threading as th

    from predictor.auth import LookupBudget, OwnerCache
    release, started = th.Event(), []

    class SlowJobs:
        def job_owner(self, job_id):
            started.append(job_id)
            release.wait(10)
            return ("owner", job_id)

    cache = OwnerCache(lambda: SlowJobs(), budget=LookupBudget(concurrent=2, wait=timedelta(milliseconds=50)))
    threads = [th.Thread(target=cache.job_owner, args=(j, 1000 + j)) for j in (1, 2)]
    for t in threads:
        t.start()
    while len(started) < 2:
        th.Event().wait(0.01)
    with pytest.raises(AuthError) as err:
        cache.job_owner(3, 1003)
    assert err.value.status == 503 and err.value.reason == "slurm_busy" and started == [1, 2]
    release.set()
    for t in threads:
        t.join()
    assert cache.job_owner(3, 1003) == ("owner", 3)


def _launcher_plan(job_id: int) -> bytes:
    return json.dumps({"source": "launcher", "directives": ["#ELASTIC model=resnet50 gpus=1-8 per_gpu_batch=64"],
                       "job": {"job_id": job_id, "partition": "debug"},
                       "current": {"layout": [2, 2], "per_gpu_batch": 64}}).encode()


@contextlib.contextmanager
def _plans_asking(tmp_path, monkeypatch, who: str):
    """A seeded app with munge and both tokens, whose `ModelView.predict` records the `who` it was asked for
    (`job_id` or `uid`): yields (the app, its test client, the values seen)."""
    from predictor.service import ModelView
    from tests.unit._service_fakes import seeded_app
    app = seeded_app(tmp_path)
    app.extensions["elastic_predictor_auth"] = Authenticator(
        token=TOKEN, admin_token=ADMIN, munge=True, unmunger=FakeUnmunger(), jobs=FakeJobs(), clock=lambda: NOW)
    seen, real = [], ModelView.predict

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get(who))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelView, "predict", spy)
    try:
        yield app, app.test_client(), seen
    finally:
        app.extensions["elastic_predictor"].models.stop()
        app.extensions["elastic_predictor"].store.close()


def test_a_plan_uses_a_jobs_own_step_times_only_for_that_job(tmp_path, monkeypatch):
    # #24.12: /v1/plan answered any job's measured step times to whoever named its job id, under READ_AUTH too
    with _plans_asking(tmp_path, monkeypatch, "job_id") as (app, client, seen):
        body = _launcher_plan(7)
        headers = {"Content-Type": "application/json"}
        for given, expected in [(headers, None),                                        # anonymous
                                ({**headers, "Authorization": f"Bearer {TOKEN}"}, None),  # any job's tool token
                                (sign(body, 8, uid=1001), None),                      # another user's job
                                (sign(body, 7, uid=1000), 7),                         # the job itself
                                ({**headers, "Authorization": f"Bearer {ADMIN}"}, 7),
                                ({**headers, MUNGE_HEADER: "not a credential"}, None)]:
            seen.clear()
            reply = client.post("/v1/plan", data=body, headers=given)
            assert reply.status_code == 200, reply.get_json()
            assert seen and set(seen) == {expected}, (given, seen)
        # read_auth on: the reader's own credential, not the job id it names, decides
        app.extensions["elastic_predictor_auth"].read_auth = True
        seen.clear()
        assert client.post("/v1/plan", data=body, headers={**headers, "Authorization": f"Bearer {TOKEN}"}
                           ).status_code == 200 and set(seen) == {None}


def test_a_plan_uses_a_users_own_step_times_only_for_a_uid_it_proves(tmp_path, monkeypatch):
    # #41.1: a user's own signed measurements answer that user's plans: for the uid of the job credential, the uid
    # the admin token names, the uid the hook names from a --hook-from host (nginx's header); never for a uid an
    # anonymous caller or the tool token (every job's launcher may carry it) names
    from predictor.api import HOOK_HEADER
    with _plans_asking(tmp_path, monkeypatch, "uid") as (_, client, seen):
        body = json.dumps({"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=1-8 per_gpu_batch=64"],
                           "job": {"uid": 1000, "partition": "debug"}}).encode()
        headers = {"Content-Type": "application/json"}
        for given, expected in [(headers, None),                                          # anonymous
                                ({**headers, HOOK_HEADER: "1"}, 1000),                    # the hook's own path
                                ({**headers, "Authorization": f"Bearer {TOKEN}"}, None),  # any job's tool token
                                ({**headers, "Authorization": f"Bearer {ADMIN}"}, 1000),
                                (sign(body, 8, uid=1001), 1001),                        # its credential's uid
                                ({**headers, MUNGE_HEADER: "not a credential"}, None)]:
            seen.clear()
            reply = client.post("/v1/plan", data=body, headers=given)
            assert reply.status_code == 200, reply.get_json()
            assert seen and set(seen) == {expected}, (given, seen)


def test_a_jobs_step_rows_claim_at_most_the_seconds_it_ran(tmp_path):
    # #24.1: three one-second jobs each posted 20 rows of 0.5 s steps after they ended; a job's rows (each at
    # least one step of its iter_s) now claim at most its run time (+ jobcheck.SLACK) over all its posts
    from predictor.jobcheck import SLACK
    short = facts(12, 1000, "COMPLETED", NOW - 60, started_at_s=NOW - 61)      # ran for one second
    FakeJobs.jobs[12] = short
    app = make_app(tmp_path, token=TOKEN, admin_token=ADMIN, munge_auth=True)
    try:
        client = app.test_client()
        allowed = 1 + SLACK.total_seconds()
        per_row = 0.5
        row = dict(STEP, layout=[2, 2], iter_s=per_row)
        fits = int(allowed // per_row)
        body = body_of([row] * fits)
        assert client.post("/v1/observations", data=body, headers=sign(body, 12)).status_code == 201
        body = body_of([row])
        refused = client.post("/v1/observations", data=body, headers=sign(body, 12))
        assert refused.status_code == 403 and refused.json["reason"] == "record_mismatch", refused.json
        assert "ran for" in refused.json["error"]
        stored = app.extensions["elastic_predictor"].store.observations(kind="step")
        assert len(stored) == fits
        # a calibration probe's row claims one plain and one DDP step of its probe: refused past the claim too
        probe = dict(DDP_OVERHEAD, world=2, plain_s=0.3, ddp_s=0.4, extra_s=0.1)
        body = body_of([probe])
        refused = client.post("/v1/observations", data=body, headers=sign(body, 12))
        assert refused.status_code == 403 and "ran for" in refused.json["error"], refused.json
        assert app.extensions["elastic_predictor"].store.observations(kind="ddp_overhead") == []
        body = body_of([dict(row, iter_s=10.0)] * 100)   # a long-running job is not limited by a short one's claim
        assert client.post("/v1/observations", data=body, headers=sign(body, 7)).status_code == 201
    finally:
        del FakeJobs.jobs[12]
        app.extensions["elastic_predictor"].store.close()
