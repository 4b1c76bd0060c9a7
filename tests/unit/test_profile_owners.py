"""#24.6: a profile name is owned by who registered it, listings are summaries a page at a time, and the database
does not keep extra copies of the profiles (the fitted models' blobs, the WAL).

The app is tests/unit/test_auth.py's: fake munge and Slurm, where jobs 7 and 9 are uid 1000's and job 8 is uid
1001's, with the tool and admin tokens configured.
"""
from __future__ import annotations

import json

import pytest

from predictor.store import WAL_SIZE_LIMIT, Store
from tests.unit._service_fakes import PROFILE, STEP
from tests.unit.test_auth import ADMIN, TOKEN, app, client, sign  # noqa: F401  (app, client: fixtures)

SQUAT = {"name": "llama-70b", "tensors": [{"name": "a", "numel": 1, "dtype": "float32"},
                                          {"name": "b", "numel": 1, "dtype": "float32"}]}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
TOOL_H = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def post_signed(client, body: dict, job: int, uid: int):
    data = json.dumps(body).encode()
    return client.post("/v1/profiles", data=data, headers=sign(data, job, uid))


def plan_for(client, uid: int, model: str = "llama-70b") -> dict:
    body = {"source": "job_submit", "directives": [f"#ELASTIC model={model} gpus=1-8 per_gpu_batch=64"],
            "job": {"partition": "debug", "user": f"user{uid}", "uid": uid}}
    r = client.post("/v1/plan", json=body)
    assert r.status_code == 200, r.json
    return r.json


def test_another_user_cannot_replace_a_users_profile_and_an_admin_can(client, app):
    store = app.extensions["elastic_predictor"].store
    assert post_signed(client, SQUAT, 7, 1000).status_code == 201
    other = dict(SQUAT, tensors=SQUAT["tensors"] * 3)
    r = post_signed(client, other, 8, 1001)           # uid 1001 gets its own (below), uid 1000's stays
    assert r.status_code == 201 and r.json["name"] == "llama-70b@u1001", r.json
    assert post_signed(client, other, 8, 1001).status_code == 200          # the same body: nothing written
    r = post_signed(client, SQUAT, 8, 1001)                                # its own: only an admin replaces it
    assert (r.status_code, r.json["reason"]) == (403, "admin_required"), r.json
    assert store.profile_owner("llama-70b") == (True, 1000)
    assert len(store.get_profile("llama-70b")["tensors"]) == 2
    assert client.post("/v1/profiles", data=json.dumps(other), headers=ADMIN_H).status_code == 200
    assert store.profile_owner("llama-70b") == (True, None)                # the admin's: the site's now
    assert len(store.get_profile("llama-70b")["tensors"]) == 6


def test_a_squat_does_not_block_the_name_for_another_user(client, app):
    """#24: a user who registered `llama-70b` first (2 tensors) kept every other user's jobs from registering it
    until an admin did (403 name_owned); their plans of it stayed the unknown-model keep. Now another user's job
    gets its own `llama-70b`, which plans, predicts and takes step rows for that user's jobs only."""
    store = app.extensions["elastic_predictor"].store
    assert post_signed(client, SQUAT, 7, 1000).status_code == 201
    real = dict(SQUAT, tensors=[{"name": f"l{i}", "numel": 4_000_000, "dtype": "bfloat16"} for i in range(40)])
    r = post_signed(client, real, 8, 1001)
    assert r.status_code == 201, r.json
    assert store.profile_owner("llama-70b@u1001") == (True, 1001) and store.profile_owner("llama-70b") == (True, 1000)
    steps = [dict(STEP, profile="llama-70b", layout=layout) for layout in ([1], [2], [4], [4, 4])]
    data = json.dumps(steps).encode()
    assert client.post("/v1/observations", data=data, headers=sign(data, 8, 1001)).status_code == 201
    rows = [o for o in store.observations() if o.get("uid") == 1001]
    assert rows and {o["profile"] for o in rows} == {"llama-70b@u1001"}    # the user's rows: its own profile's
    app.extensions["elastic_predictor"].models.refit()
    mine = plan_for(client, 1001)
    assert "unknown model" not in mine["reason"] and mine["cache_ttl_s"] == 0, mine
    assert "unknown model" not in plan_for(client, 1000)["reason"]          # the squatter's own, still
    assert "unknown model 'llama-70b'" in plan_for(client, 1002)["reason"]  # a third user: neither
    query = json.dumps({"profile": "llama-70b", "gpu": "H200", "per_gpu_batch": 8, "max_gpus": 2}).encode()
    r = client.post("/v1/predict", data=query, headers=sign(query, 8, 1001))
    assert r.status_code == 200, r.json


def test_a_site_profile_is_refused_to_a_job_as_owned(client):
    assert client.post("/v1/profiles", data=json.dumps(PROFILE), headers=TOOL_H).status_code == 201
    r = post_signed(client, dict(PROFILE, tensors=PROFILE["tensors"][:1]), 8, 1001)
    assert (r.status_code, r.json["reason"]) == (403, "name_owned")
    assert "the site's" in r.json["error"]


def test_a_users_profile_plans_only_that_users_jobs(client, app):
    # #24.6: the first job to register `llama-70b` decided every user's plans of that model
    assert post_signed(client, SQUAT, 7, 1000).status_code == 201
    steps = [dict(STEP, profile="llama-70b", layout=layout) for layout in ([1], [2], [4], [4, 4])]
    assert client.post("/v1/observations", json=steps, headers=TOOL_H).status_code == 201
    app.extensions["elastic_predictor"].models.refit()
    owner = plan_for(client, 1000)
    assert "unknown model" not in owner["reason"], owner
    assert owner["cache_ttl_s"] == 30           # the hook keeps it under a key holding the uid (#26)
    other = plan_for(client, 1001)
    assert other["action"] == "keep" and "unknown model 'llama-70b'" in other["reason"], other


def test_predict_finds_a_users_profile_for_that_user_and_the_tokens_only(client, app):
    assert post_signed(client, SQUAT, 7, 1000).status_code == 201
    app.extensions["elastic_predictor"].models.refit()
    query = {"profile": "llama-70b", "gpu": "H200", "per_gpu_batch": 8, "max_gpus": 2}
    data = json.dumps(query).encode()
    assert client.post("/v1/predict", data=data, headers=sign(data, 7, 1000)).status_code == 200
    r = client.post("/v1/predict", data=data, headers=sign(data, 8, 1001))
    assert r.status_code == 404 and "uid 1000" in r.json["error"], r.json
    assert client.post("/v1/predict", data=data, headers=TOOL_H).status_code == 200
    assert client.post("/v1/predict", data=data, headers={"Content-Type": "application/json"}).status_code == 404


def test_listing_is_summaries_a_page_at_a_time(client, app, monkeypatch):
    for name in ("a-1", "a-2", "a-3"):
        assert post_signed(client, dict(PROFILE, name=name), 7, 1000).status_code == 201
    assert client.post("/v1/profiles", data=json.dumps(PROFILE), headers=TOOL_H).status_code == 201

    def no_bodies(*_a, **_k):
        raise AssertionError("a listing read the profile bodies")
    monkeypatch.setattr(Store, "list_profiles", no_bodies)    # #24.6: 743 ms a listing with 4 profiles of 3.9 MB
    monkeypatch.setattr(Store, "get_profile", no_bodies)
    first = client.get("/v1/profiles?limit=2").json
    assert [p["name"] for p in first["profiles"]] == ["a-1", "a-2"] and first["next"] == "a-2"
    item = first["profiles"][0]
    assert item["owner"] == 1000 and item["tensors"] == 2 and item["params"] == 2057408
    assert item["bytes"] > 0 and item["created_at_s"] > 0 and "buckets_bytes" not in item
    rest = client.get(f"/v1/profiles?after={first['next']}").json
    assert [p["name"] for p in rest["profiles"]] == ["a-3", "resnet50"] and rest["next"] is None
    assert rest["profiles"][1]["owner"] is None
    assert client.get("/admin").status_code == 200
    for bad in ("0", "x", "1001"):
        r = client.get(f"/v1/profiles?limit={bad}")
        assert (r.status_code, r.json["field"]) == (400, "limit")


def test_summaries_of_profiles_stored_before_the_migration(tmp_path):
    store = Store(str(tmp_path / "old.db"))
    store.migrate()
    store.db.execute("DELETE FROM profile_summaries")       # as a database of migration 0008 had it
    store.db.execute("DELETE FROM migrations WHERE name = '0009_profile_summaries'")
    store.db.execute("DROP TABLE profile_summaries")
    store.db.execute("INSERT INTO profiles (name, body, created_at_s, updated_at_s, owner, bytes) VALUES "
                     "(?, ?, 1.0, 2.0, 1000, 10)", ["old", json.dumps(dict(PROFILE, name="old"))])
    store.db.conn.commit()
    assert store.migrate() == ["0009_profile_summaries"]
    [row] = store.profile_summaries()
    assert (row["name"], row["owner"], row["tensors"], row["params"], row["created_at_s"]) == ("old", 1000, 2,
                                                                                             2057408, 1.0)
    store.close()


def test_the_wal_is_truncated_after_a_checkpoint(tmp_path):
    # #24.6: the WAL stayed at its 18 MB peak beside 16 MB of profiles
    store = Store(str(tmp_path / "w.db"))
    assert store.db.execute("PRAGMA journal_size_limit").fetchone()[0] == WAL_SIZE_LIMIT
    store.close()


def test_a_fitted_model_keeps_no_tensor_names(client, app):
    # #24.6: each kept model stored every profile's tensor names (15 MB a model for one user's 16 MiB)
    from predictor.profiles import Profile
    from predictor.service import FittedModel
    named = dict(PROFILE, name="long-names", tensors=[{"name": "w" * 1000 + str(k), "numel": 10 + k,
                                                       "dtype": "float32" if k < 150 else "bfloat16"}
                                                      for k in range(200)])
    assert client.post("/v1/profiles", data=json.dumps(named), headers=TOOL_H).status_code == 201
    models = app.extensions["elastic_predictor"].models
    models.refit()
    stored = app.extensions["elastic_predictor"].store.newest_model()
    assert len(stored.blob) < 20_000                          # 200 names of 1000 characters: 200 KB before
    original = Profile.from_dict(named)
    loaded = FittedModel.from_stored(stored, models.predictor_factory)
    for fitted in (models.current.profiles["long-names"], loaded.profiles["long-names"]):
        assert [(t.numel, t.dtype) for t in fitted.tensors] == [(t.numel, t.dtype) for t in original.tensors]
        assert (fitted.n_params, fitted.grad_bytes) == (original.n_params, original.grad_bytes)


@pytest.mark.parametrize("path", ["/v1/profiles", "/v1/decisions", "/admin"])
@pytest.mark.parametrize("raw", ["%C2%B2", "9" * 5000, "0", "-1", "x"])
def test_a_bad_limit_is_a_400_naming_it_never_a_500(client, path, raw):
    response = client.get(f"{path}?limit={raw}", headers=TOOL_H)
    assert response.status_code == 400 and response.get_json()["field"] == "limit"


def test_a_worker_loading_a_refit_with_unchanged_profiles_reuses_them(client, app):
    # #24.11: every worker built every profile of every refit again (four of 68,000 tensors: 190 ms), and a plan
    # request arriving meanwhile waited for the load
    from predictor.service import KnownProfiles
    named = dict(PROFILE, name="reused", tensors=[{"name": f"t{k}", "numel": 10 + k,
                                                   "dtype": "float32" if k < 150 else "bfloat16"}
                                                  for k in range(200)])
    assert client.post("/v1/profiles", data=json.dumps(named), headers=TOOL_H).status_code == 201
    svc = app.extensions["elastic_predictor"]
    svc.models.refit()
    docs = json.loads(svc.store.newest_model().blob)["profiles"]
    known = KnownProfiles()
    first = known.build(docs)
    again = known.build(json.loads(json.dumps(docs)))         # the same documents, as a later load reads them
    assert all(again[n] is first[n] for n in docs)
    changed = json.loads(json.dumps(docs))
    changed["reused"]["numels"][0] += 1                        # the profile was posted again, one tensor larger
    rebuilt = known.build(changed)
    assert rebuilt["reused"] is not first["reused"] and rebuilt["reused"].tensors[0].numel == 11
    assert rebuilt["reused"].n_params == first["reused"].n_params + 1
    assert all(rebuilt[n] is first[n] for n in docs if n != "reused")
