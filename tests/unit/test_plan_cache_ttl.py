"""/v1/plan's side of the hook's decision cache: `cache_ttl_s` in the reply, `reused` in the request."""
from __future__ import annotations

import json
import pathlib
from datetime import timedelta

import pytest

from predictor.config import Config
from predictor.errors import ValidationError
from tests.unit._service_fakes import seeded_app

PLAN = {"source": "job_submit",
        "directives": ["#ELASTIC model=resnet50 gpus=2-16", "#ELASTIC per_gpu_batch=64 min_efficiency=0.3"],
        "job": {"min_nodes": 1, "tres_per_node": "gres:gpu:4", "partition": "debug"}}


def _client(tmp_path, ttl: timedelta | None = None):
    app = seeded_app(tmp_path, **({} if ttl is None else {"plan_cache_ttl": ttl}))
    return app, app.test_client()


@pytest.fixture
def service(tmp_path):
    app, client = _client(tmp_path)
    yield client
    app.extensions["elastic_predictor"].models.stop()
    app.extensions["elastic_predictor"].store.close()


def test_predicted_decisions_carry_the_configured_ttl(service):
    body = service.post("/v1/plan", json=PLAN).get_json()
    assert body["action"] == "rewrite" and body["cache_ttl_s"] == 30
    stored = service.get(f"/v1/decisions/{body['decision_id']}").get_json()
    assert stored["response"]["cache_ttl_s"] == 30


def test_cant_judge_keeps_are_not_reusable(service):
    body = service.post("/v1/plan", json={**PLAN, "directives": ["#ELASTIC model=vgg99 per_gpu_batch=8"]}).get_json()
    assert body["action"] == "keep" and body["cache_ttl_s"] == 0


def test_zero_ttl_disables(tmp_path):
    app, client = _client(tmp_path, ttl=timedelta(0))
    try:
        assert client.post("/v1/plan", json=PLAN).get_json()["cache_ttl_s"] == 0
    finally:
        app.extensions["elastic_predictor"].models.stop()
        app.extensions["elastic_predictor"].store.close()


def test_ttl_from_the_environment_and_bounds():
    assert Config.from_env({"ELASTIC_PREDICTOR_PLAN_CACHE_TTL_S": "2.5"}).plan_cache_ttl == timedelta(seconds=2.5)
    with pytest.raises(ValueError):
        Config.from_env({"ELASTIC_PREDICTOR_PLAN_CACHE_TTL_S": "soon"})
    with pytest.raises(ValueError):
        Config(plan_cache_ttl=timedelta(seconds=-1))


@pytest.mark.parametrize("var, value", [("ELASTIC_PREDICTOR_PLAN_CACHE_TTL_S", "7200"),
                                        ("ELASTIC_PREDICTOR_CACHE_SIZE", "-1"),
                                        ("ELASTIC_PREDICTOR_REFIT_DEBOUNCE_S", "-2")])
def test_an_out_of_range_variable_is_named_in_the_error(var, value):
    with pytest.raises(ValidationError) as err:
        Config.from_env({var: value})
    assert err.value.field == var and str(err.value).startswith(f"{var}: ")


def test_reuse_counts_are_stored_with_the_request(service):
    body = service.post("/v1/plan", json={**PLAN, "reused": {"d-1": 3, "d-7": 1}}).get_json()
    stored = service.get(f"/v1/decisions/{body['decision_id']}").get_json()
    assert stored["request"]["reused"] == {"d-1": 3, "d-7": 1}


@pytest.mark.parametrize("reused", [[1], {"d-1": 0}, {"d-1": "3"}, {"d-1": True}, {f"d-{i}": 1 for i in range(4097)}])
def test_malformed_reuse_counts_are_400(service, reused):
    response = service.post("/v1/plan", json={**PLAN, "reused": reused})
    assert response.status_code == 400 and response.get_json()["field"].startswith("reused")


def test_a_test_only_request_is_answered_alike_and_stores_nothing(service):
    # #42.6: `sbatch --test-only` (the hooks send test_only) recorded a decision for a job that never exists, and
    # the hook reused it for the next real job; now the same plan comes back with no id, nothing to reuse or keep
    real = service.post("/v1/plan", json=PLAN).get_json()
    tried = service.post("/v1/plan", json={**PLAN, "test_only": True}).get_json()
    assert tried["action"] == real["action"] == "rewrite" and tried["layout"] == real["layout"]
    assert tried["reason"] == real["reason"] and tried["test_only"] is True and real["bands"]
    assert "decision_id" not in tried and "bands" not in tried and tried["cache_ttl_s"] == 0
    assert [d["decision_id"] for d in service.get("/v1/decisions").get_json()["decisions"]] == [real["decision_id"]]


@pytest.mark.parametrize("body, field", [({"test_only": "yes"}, "test_only"),
                                         ({"test_only": True, "reused": {"d-1": 2}}, "reused")])
def test_a_malformed_test_only_request_is_a_400_naming_the_field(service, body, field):
    reply = service.post("/v1/plan", json={**PLAN, **body})
    assert reply.status_code == 400 and reply.get_json()["field"] == field, reply.get_json()
    assert service.get("/v1/decisions").get_json()["decisions"] == []


def test_job_submits_decisions_are_unclaimed_until_the_hook_sees_a_job_holding_them(service):
    # #42.6: with job_submit alone a `--test-only` cannot be told from a job (Slurm 22.05), so its decision is stored
    # unclaimed; the hook names the ones jobs hold (X-Elastic-Claimed) and only those become a job's
    tried = service.post("/v1/plan", json=PLAN).get_json()["decision_id"]
    real = service.post("/v1/plan", json=PLAN).get_json()["decision_id"]
    launcher = service.post("/v1/plan", json={**PLAN, "source": "cli_filter"}).get_json()["decision_id"]
    service.post("/v1/plan", json=PLAN, headers={"X-Elastic-Claimed": f"{real} d-999 x-1"})
    listed = {d["decision_id"]: d["unclaimed"] for d in service.get("/v1/decisions").get_json()["decisions"]}
    assert listed[tried] is True and listed[real] is False and listed[launcher] is False
    assert service.get(f"/v1/decisions/{tried}").get_json()["unclaimed"] is True


def test_an_unclaimed_decision_expires_and_a_claimed_one_stays(tmp_path):
    from predictor.store import DecisionRetention, Store
    store = Store(str(tmp_path / "h.db"), decision_retention=DecisionRetention(unclaimed_max_age=timedelta(hours=1)))
    store.migrate()
    try:
        reply = {"action": "keep", "reason": "elastic: kept"}
        old = [store.add_decision({}, reply, "job_submit", None, "hook:uid:1", unclaimed=True)["decision_id"]
               for _ in range(3)]
        store.claim_decisions([old[1]], "hook:uid:2")  # the hook claims for every user's jobs
        store.db.execute("UPDATE decisions SET created_at_s = created_at_s - 7200")  # two hours ago
        store.db.conn.commit()
        new = store.add_decision({}, reply, "job_submit", None, "hook:uid:1", unclaimed=True)["decision_id"]
        kept = [d["decision_id"] for d in store.list_decisions()]
        assert kept == [new, old[1]], kept
    finally:
        store.close()



def test_the_unclaimed_age_is_a_service_setting_read_from_the_environment_and_applied(tmp_path):
    # #42.6: how long an unclaimed decision lives was fixed at 1 day (DecisionRetention's default); it is the
    # service's ELASTIC_PREDICTOR_DECISIONS_UNCLAIMED_MAX_AGE_S. Set to one hour, a decision unclaimed for two is gone
    # at the next write and one unclaimed for half an hour stays (at the default both would stay).
    var = "ELASTIC_PREDICTOR_DECISIONS_UNCLAIMED_MAX_AGE_S"
    config = Config.from_env({var: "3600"})
    assert config.decisions_unclaimed_max_age == timedelta(hours=1)
    assert Config().decisions_unclaimed_max_age == timedelta(days=1)
    app = seeded_app(tmp_path, decisions_unclaimed_max_age=config.decisions_unclaimed_max_age)
    client, store = app.test_client(), app.extensions["elastic_predictor"].store
    try:
        old, recent = (client.post("/v1/plan", json=PLAN).get_json()["decision_id"] for _ in range(2))
        store.db.execute("UPDATE decisions SET created_at_s = created_at_s - CASE id WHEN ? THEN 7200 ELSE 1800 END",
                         [int(old[2:])])
        store.db.conn.commit()
        new = client.post("/v1/plan", json=PLAN).get_json()["decision_id"]
        assert [d["decision_id"] for d in client.get("/v1/decisions").get_json()["decisions"]] == [new, recent]
    finally:
        app.extensions["elastic_predictor"].models.stop()
        store.close()


@pytest.mark.parametrize("value", ["0", "-5", "a day", "nan", "inf"])
def test_a_bad_unclaimed_age_is_refused_naming_the_variable(value):
    var = "ELASTIC_PREDICTOR_DECISIONS_UNCLAIMED_MAX_AGE_S"
    with pytest.raises(ValidationError) as err:
        Config.from_env({var: value})
    assert err.value.field == var and str(err.value).startswith(f"{var}: "), str(err.value)
    with pytest.raises(ValidationError) as err:
        Config(decisions_unclaimed_max_age=timedelta(0))
    assert err.value.field == "decisions_unclaimed_max_age"


TEST_ONLY = json.loads((pathlib.Path(__file__).parents[1] / "vectors" / "test_only.json").read_text())["cases"]
SENDS = [(c["name"], s) for c in TEST_ONLY for s in c["sends"]]


@pytest.mark.parametrize("send", [s for _, s in SENDS], ids=[f"{n}: {s['source']}" for n, s in SENDS])
def test_test_only_vectors_what_the_service_keeps(service, send):
    # tests/vectors/test_only.json (the hooks' side of the same vectors: test_lua_hook_cache.py, the lab)
    body = {**PLAN, "source": send["source"], **({"test_only": True} if send["test_only"] else {})}
    reply = service.post("/v1/plan", json=body).get_json()
    listed = {d["decision_id"]: d["unclaimed"] for d in service.get("/v1/decisions").get_json()["decisions"]}
    if send["stored"] == "nothing":
        assert "decision_id" not in reply and listed == {} and reply["cache_ttl_s"] == 0
    else:
        assert listed == {reply["decision_id"]: send["stored"] == "unclaimed"}
