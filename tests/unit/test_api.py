"""The Flask service on a temporary database with a fake Predictor: contract, auth, errors, caching."""
from __future__ import annotations

import dataclasses
import io
import json
from datetime import timedelta

import pytest
from werkzeug.test import EnvironBuilder

from predictor.app import create_app
from predictor.config import Config
from tests.unit._service_fakes import COLLECTIVE, PROFILE, STEP, FakePredictor

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def app(tmp_path):
    config = Config(db_path=str(tmp_path / "p.db"), token=TOKEN, refit_debounce=timedelta(0), refit_min_interval=timedelta(0),
                    refit_poll=timedelta(milliseconds=50), max_body_bytes=64 * 1024)
    app = create_app(config, predictor_factory=FakePredictor)
    yield app
    app.extensions["elastic_predictor"].models.stop()
    app.extensions["elastic_predictor"].store.close()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def seeded(app, client):
    assert client.post("/v1/profiles", json=PROFILE, headers=AUTH).status_code == 201
    assert client.post("/v1/observations", json=[STEP, COLLECTIVE], headers=AUTH).status_code == 201
    assert app.extensions["elastic_predictor"].models.wait_fresh(timedelta(seconds=10))
    return client


def test_healthz_reports_schema_and_model(client):
    body = client.get("/healthz").get_json()
    assert body["status"] == "ok"
    assert body["schema"] == ["0001_initial", "0002_link_fits_and_generation", "0003_models", "0004_decision_bytes",
                              "0005_write_keys", "0006_decision_clients", "0007_profile_owners",
                              "0008_job_claims", "0009_profile_summaries",
                              "0010_write_key_digests", "0011_write_quotas",
                              "0012_observation_summary", "0013_models_json", "0014_unclaimed_decisions"]


@pytest.mark.parametrize("path,payload", [("/v1/profiles", PROFILE), ("/v1/observations", [STEP])])
def test_writes_need_the_token(client, path, payload):
    missing = client.post(path, json=payload)
    assert missing.status_code == 401 and missing.get_json()["field"] == "Authorization"
    assert "Bearer" in missing.headers["WWW-Authenticate"]
    wrong = client.post(path, json=payload, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and "rejected" in wrong.get_json()["error"]
    assert client.post(path, json=payload, headers=AUTH).status_code == 201


def test_writes_open_without_a_configured_token(tmp_path):
    app = create_app(Config(db_path=str(tmp_path / "o.db")), predictor_factory=FakePredictor, start_refit=False)
    assert app.test_client().post("/v1/profiles", json=PROFILE).status_code == 201


def test_profiles_register_list_show(client):
    assert client.post("/v1/profiles", json=PROFILE, headers=AUTH).status_code == 201
    again = client.post("/v1/profiles", json=dict(PROFILE, layer_kinds=["conv"]), headers=AUTH)
    assert again.status_code == 200 and again.get_json()["tensors"] == 2
    listed = client.get("/v1/profiles").get_json()["profiles"]
    assert [p["name"] for p in listed] == ["resnet50"] and listed[0]["params"] == 2057408
    shown = client.get("/v1/profiles/resnet50").get_json()
    assert shown["tensors"][1]["numel"] == 9408 and shown["layer_kinds"] == ["conv"]


def test_unknown_profile_is_404_with_a_hint(client):
    response = client.get("/v1/profiles/vgg99")
    body = response.get_json()
    assert response.status_code == 404
    assert "POST /v1/profiles" in body["error"] and "elastic-predictor profile package.module:callable --name vgg99" in body["hint"]


@pytest.mark.parametrize("mutate,field", [
    (lambda p: p["tensors"][0].update(numel=-3), "tensors[0].numel"),
    (lambda p: p["tensors"][1].update(dtype="float13"), "tensors[1].dtype"),
    (lambda p: p.update(name="has space"), "name"),
    (lambda p: p.update(tensors=[]), "tensors"),
])
def test_bad_profile_is_400_naming_the_field(client, mutate, field):
    body = json.loads(json.dumps(PROFILE))
    mutate(body)
    response = client.post("/v1/profiles", json=body, headers=AUTH)
    assert response.status_code == 400 and response.get_json()["field"] == field
    assert client.get("/v1/profiles").get_json()["profiles"] == []


def test_observations_all_or_nothing(client):
    assert client.post("/v1/observations", json=[STEP], headers=AUTH).status_code == 201
    bad = dict(COLLECTIVE, seconds=float("nan"))
    response = client.post("/v1/observations", data=json.dumps([STEP, COLLECTIVE, bad]),
                           headers=dict(AUTH, **{"Content-Type": "application/json"}))
    assert response.status_code == 400
    assert response.get_json()["field"] == "observations[2].seconds"
    assert client.get("/v1/observations").get_json()["counts"] == {"collective": 0, "step": 1, "ddp_overhead": 0}


def test_unknown_field_and_bad_json_are_400(client):
    response = client.post("/v1/observations", json=[dict(STEP, colour="blue")], headers=AUTH)
    assert response.get_json()["field"] == "observations[0].colour"
    garbage = client.post("/v1/observations", data="[{", headers=AUTH)
    assert garbage.status_code == 400 and garbage.get_json()["field"] == "body"


def test_body_cap_is_413_json(client):
    response = client.post("/v1/observations", json=[STEP] * 1000, headers=AUTH)
    assert response.status_code == 413 and response.get_json()["field"] == "body"


def test_predict_with_and_without_candidates(seeded):
    body = {"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 64,
            "candidates": [{"layout": [4], "intra_link": "nvlink"},
                           {"layout": [2, 2], "intra_link": "nvlink", "inter_link": "ib"}]}
    predictions = seeded.post("/v1/predict", json=body).get_json()["predictions"]
    assert [p["layout"] for p in predictions] == [[4], [2, 2]]
    assert predictions[0]["samples_per_s"] > predictions[1]["samples_per_s"] > 0
    del body["candidates"]
    enumerated = seeded.post("/v1/predict", json=body).get_json()["predictions"]
    layouts = [p["layout"] for p in enumerated]
    assert [1] in layouts and [4, 4, 4, 4] in layouts and [2, 2, 2, 2] in layouts and [8] not in layouts


def test_predict_candidates_capped_by_config(tmp_path):
    """/v1/predict's `candidates` list and /v1/plan's layouts share one cap, `Config.max_plan_candidates`."""
    app = create_app(Config(db_path=str(tmp_path / "c.db"), max_plan_candidates=2), predictor_factory=FakePredictor,
                     start_refit=False)
    cands = [{"layout": [n], "intra_link": "nvlink"} for n in (1, 2, 3)]
    answer = app.test_client().post("/v1/predict", json={"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 8,
                                                         "candidates": cands})
    assert answer.status_code == 400 and answer.get_json()["field"] == "candidates"
    assert "1..2 candidates" in answer.get_json()["error"]
    app.extensions["elastic_predictor"].store.close()


def test_predict_errors(seeded):
    unknown = seeded.post("/v1/predict", json={"profile": "nope", "gpu": "H200", "per_gpu_batch": 8})
    assert unknown.status_code == 404 and "POST /v1/profiles" in unknown.get_json()["error"]
    bad = seeded.post("/v1/predict", json={"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 8,
                                           "candidates": [{"layout": [2, 2], "intra_link": "nvlink"}]})
    assert bad.status_code == 400 and bad.get_json()["field"] == "candidates[0].inter_link"
    zero = seeded.post("/v1/predict", json={"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 0})
    assert zero.get_json()["field"] == "per_gpu_batch"


def test_predictions_are_cached_per_model_version(app, seeded):
    body = {"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 32}
    before_calls, before_fits = FakePredictor.predict_calls, FakePredictor.fits
    first = seeded.post("/v1/predict", json=body).get_json()
    second = seeded.post("/v1/predict", json=body).get_json()
    assert first == second and FakePredictor.predict_calls == before_calls + 1
    assert FakePredictor.fits == before_fits, "requests must never fit"
    seeded.post("/v1/observations", json=[COLLECTIVE], headers=AUTH)
    assert app.extensions["elastic_predictor"].models.wait_fresh(timedelta(seconds=10))
    third = seeded.post("/v1/predict", json=body).get_json()
    assert third["model_version"] != first["model_version"] and FakePredictor.predict_calls == before_calls + 2


def _plan(client, *lines, job=None, **extra):
    return client.post("/v1/plan", json={"source": "job_submit", "directives": list(lines),
                                         "job": job or {"partition": "debug"}, **extra})


def test_plan_rewrites_stores_and_lists_the_decision(seeded):
    response = _plan(seeded, "#ELASTIC model=resnet50 gpus=2-16", "#ELASTIC per_gpu_batch=64 min_efficiency=0.3",
                     job={"min_nodes": 1, "tres_per_node": "gres:gpu:4", "partition": "debug"})
    body = response.get_json()
    assert response.status_code == 200 and body["action"] == "rewrite"
    assert body["decision_id"].startswith("d-")
    assert body["nodes"] * body["gpus_per_node"] == sum(body["layout"])
    assert body["reason"].startswith("elastic: ") and "\n" not in body["reason"]
    assert {"layout", "gpus", "samples_per_s", "efficiency"} <= set(body["curve"][0])
    listed = seeded.get("/v1/decisions").get_json()["decisions"]
    assert listed[0]["decision_id"] == body["decision_id"] and listed[0]["action"] == "rewrite"
    shown = seeded.get(f"/v1/decisions/{body['decision_id']}").get_json()
    assert shown["response"] == body and shown["request"]["directives"][0].startswith("#ELASTIC model=")


def test_plan_keep_decisions_are_stored_too(seeded):
    unknown = _plan(seeded, "#ELASTIC model=vgg99 per_gpu_batch=8").get_json()
    assert unknown["action"] == "keep" and "unknown model 'vgg99'" in unknown["reason"]
    plain = _plan(seeded).get_json()
    assert plain["action"] == "keep" and "not an elastic job" in plain["reason"]
    assert len(seeded.get("/v1/decisions").get_json()["decisions"]) == 2


def test_plan_malformed_directive_is_422_with_field_and_line(seeded):
    response = _plan(seeded, "#ELASTIC model=resnet50", "#ELASTIC colour=blue")
    body = response.get_json()
    assert response.status_code == 422
    assert body["field"] == "directives[1]" and body["line"] == "#ELASTIC colour=blue"
    assert "unknown key 'colour'" in body["error"] and body["error"].startswith("line 2:")
    assert seeded.get("/v1/decisions").get_json()["decisions"] == []


def test_plan_bad_job_field_is_400(seeded):
    response = _plan(seeded, "#ELASTIC model=resnet50", job={"min_nodes": "two"})
    assert response.status_code == 400 and response.get_json()["field"] == "job.min_nodes"


def test_decision_not_found_and_bad_paging(seeded):
    assert seeded.get("/v1/decisions/d-999").status_code == 404
    assert seeded.get("/v1/decisions/bogus").status_code == 404
    assert seeded.get("/v1/decisions?limit=0").get_json()["field"] == "limit"


def test_links_report_fitted_stats(seeded):
    body = seeded.get("/v1/links").get_json()
    assert body["model_version"] and [link["link"] for link in body["links"]] == ["nvlink"]


def test_failed_fit_keeps_503_json_and_health_says_why(tmp_path):
    app = create_app(Config(db_path=str(tmp_path / "f.db")), predictor_factory=lambda: FakePredictor(fail=True),
                     start_refit=False)
    client = app.test_client()
    client.post("/v1/profiles", json=PROFILE)
    with pytest.raises(RuntimeError):
        app.extensions["elastic_predictor"].models.refit()
    response = client.post("/v1/predict", json={"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 8})
    assert response.status_code == 503 and "fit exploded" in response.get_json()["error"]
    assert "fit exploded" in client.get("/healthz").get_json()["last_error"]
    plan = _plan(client, "#ELASTIC model=resnet50 per_gpu_batch=8").get_json()
    assert plan["action"] == "keep" and "not ready" in plan["reason"]


def test_openapi_documents_every_route(app, client):
    doc = client.get("/v1/openapi.json").get_json()
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = rule.rule.replace("<path:", "{").replace("<", "{").replace(">", "}")
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert (path, method.lower()) in documented, f"{method} {path} is not in openapi.json"


def test_a_burst_of_observations_costs_few_fits(tmp_path):
    config = Config(db_path=str(tmp_path / "b.db"), refit_debounce=timedelta(seconds=1), refit_min_interval=timedelta(0),
                    refit_poll=timedelta(milliseconds=50))
    app = create_app(config, predictor_factory=FakePredictor)
    models = app.extensions["elastic_predictor"].models
    client = app.test_client()
    assert models.wait_fresh(timedelta(seconds=10))
    before = models.fits
    for _ in range(5):
        assert client.post("/v1/observations", json=[STEP]).status_code == 201
    assert models.wait_fresh(timedelta(seconds=20))
    assert 1 <= models.fits - before <= 2
    models.stop()


def test_config_from_env_reads_each_variable_once_and_names_bad_ones(tmp_path):
    from predictor.errors import ValidationError

    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps({"partitions": [{"name": "gpu", "nodes": "g[01-08]", "gpus_per_node": 8,
                                                        "gpu": "A100", "intra_link": "nvlink", "inter_link": "roce"}]}))
    config = Config.from_env({"ELASTIC_PREDICTOR_TOKEN": "t", "ELASTIC_PREDICTOR_CLUSTER": str(cluster_file),
                              "ELASTIC_PREDICTOR_MAX_BODY": "2048", "ELASTIC_PREDICTOR_CACHE_SIZE": "0"},
                             db_path=str(tmp_path / "x.db"))
    assert config.token == "t" and config.max_body_bytes == 2048 and config.prediction_cache_size == 0
    assert config.cluster.partition().layouts(16) == [(8, 8), (4, 4, 4, 4), (2,) * 8]
    assert config.db_path == str(tmp_path / "x.db")
    with pytest.raises(ValidationError) as info:
        Config.from_env({"ELASTIC_PREDICTOR_MAX_BODY": "lots"})
    assert info.value.field == "ELASTIC_PREDICTOR_MAX_BODY"
    with pytest.raises(ValidationError) as info:
        Config.from_env({"ELASTIC_PREDICTOR_CLUSTER": str(tmp_path / "missing.json")})
    assert info.value.field == "cluster"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.token = "changed"


@pytest.mark.parametrize("body,status", [
    ("[" * 20_000 + "]" * 20_000, 400),      # nested 20,000 deep, under the cap (#14.7: 500 from the metrics hook)
    ("x" * (65 * 1024), 413),                 # over the 64 KiB cap of this app (#14.7: 500)
    ('{"source": "launcher", "script": ', 400),
], ids=["nested-20000-deep", "over-the-cap", "truncated"])
def test_a_bad_plan_body_is_a_4xx_never_a_500(client, body, status):
    r = client.post("/v1/plan", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.data[:200]
    assert r.get_json()["field"] == "body"
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'source="other"' in metrics  # counted, under the source it could not read


@pytest.mark.parametrize("size,status", [(1000, 422), (65 * 1024, 413), (5 * 1024 * 1024, 413)])
def test_a_chunked_body_over_the_cap_is_413_and_one_under_it_is_read_whole(app, size, status):
    # #14.7: a chunked body (no Content-Length; the server sets wsgi.input_terminated, as gunicorn does) was cut
    # at the cap by werkzeug without a word, and the truncated JSON answered 400
    body = json.dumps({"source": "launcher", "directives": ["#ELASTIC " + "x" * size]}).encode()
    environ = EnvironBuilder(path="/v1/plan", method="POST", headers={"Transfer-Encoding": "chunked",
                                                                      "Content-Type": "application/json"}).get_environ()
    environ.pop("CONTENT_LENGTH", None)
    environ.update({"wsgi.input": io.BytesIO(body), "wsgi.input_terminated": True})
    status_line = []
    reply = json.loads(b"".join(app(environ, lambda s, h, exc_info=None: status_line.append(s))))
    assert int(status_line[0].split()[0]) == status, reply
    if status == 413:
        assert reply["field"] == "body" and "larger than" in reply["error"]
    else:
        assert "x" * size in reply["error"] or reply.get("line") == 1     # the whole body was read and parsed


def test_nan_and_oversized_extra_profile_fields_are_400_naming_the_field(client):
    nan = json.dumps(dict(PROFILE, note=1.0)).replace("1.0", "NaN")
    r = client.post("/v1/profiles", data=nan, headers={**AUTH, "Content-Type": "application/json"})
    assert (r.status_code, r.get_json()["field"]) == (400, "note") and "NaN" in r.get_json()["error"]
    r = client.post("/v1/profiles", json=dict(PROFILE, junk="x" * 20_000), headers=AUTH)
    assert (r.status_code, r.get_json()["field"]) == (400, "junk")
    assert client.get(f"/v1/profiles/{PROFILE['name']}").status_code == 404  # nothing stored
    assert client.post("/v1/profiles", json=dict(PROFILE, layer_kinds=["conv"] * 10), headers=AUTH).status_code == 201


def test_a_store_that_cannot_be_written_is_reported_by_healthz_and_writes_get_503(app, client):
    # #14.8: a read-only database (or a full disk): the service started, /healthz said ok, every write was a 500
    store = app.extensions["elastic_predictor"].store
    assert client.get("/healthz").get_json()["writable"] is True
    store.db.execute("PRAGMA query_only = ON")   # this thread's connection, as a read-only file or mount answers
    store._probe = None                          # forget the last probe (max_age)
    r = client.get("/healthz")
    assert r.status_code == 503 and r.get_json()["status"] == "degraded"
    assert "readonly" in r.get_json()["store_error"]
    w = client.post("/v1/profiles", json=PROFILE, headers=AUTH)
    assert w.status_code == 503 and "cannot be written" in w.get_json()["error"] and "Retry-After" in w.headers
    store.db.execute("PRAGMA query_only = OFF")
    store._probe = None
    assert client.get("/healthz").status_code == 200


def test_serve_refuses_a_database_it_cannot_write(tmp_path, monkeypatch):
    import click

    from predictor.cli import _open_store
    from predictor.store import Store
    _open_store(str(tmp_path / "ok.db"), writable=True).close()
    monkeypatch.setattr(Store, "write_problem", lambda self, max_age=None: "OperationalError: database or disk is full")
    with pytest.raises(click.ClickException, match="cannot be written .*disk is full.*free disk space"):
        _open_store(str(tmp_path / "ok.db"), writable=True)
