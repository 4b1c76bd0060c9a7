"""One model per service (issue #13): one fitter elected by a file lock, every worker on the stored model,
versions a client can name and wait for (`model_version_pending`, `min_model_version`).

Two ModelCaches (or two apps) on one database file stand for two gunicorn workers; the fit lock is an flock,
which two descriptors of one process contend for just as two processes do.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from predictor.api.predict import version_wait
from predictor.app import create_app
from predictor.config import Config
from predictor.fitlock import FitLock, fit_lock_path
from predictor.profiles import Profile
from predictor.service import (MAX_VERSION_WAIT, MODEL_FORMAT, FittedModel, ModelCache, ModelVersionUnavailable,
                               code_fingerprint)
from predictor.store import Store
from tests.unit._service_fakes import COLLECTIVE, PROFILE, STEP, FakePredictor

WAIT = timedelta(seconds=10)   # bounded waits for background work; nothing here asserts on speed
PREDICT = {"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 64,
           "candidates": [{"layout": [4], "intra_link": "nvlink"}]}
PLAN = {"source": "launcher", "directives": ["#ELASTIC model=resnet50 per_gpu_batch=64 gpus=1-4"],
        "job": {"partition": "debug"}}


class CountingFactory:
    """A predictor factory that counts the fits its predictors were asked for (`calls`); a predictor built to load a
    stored model's document is not a fit."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self):
        factory = self

        class Counted(FakePredictor):
            def fit(self, profiles, observations):
                with factory._lock:
                    factory.calls += 1
                return super().fit(profiles, observations)

        return Counted(fail=self.fail)


def _worker(db: str, factory, **kwargs) -> ModelCache:
    """What create_app builds in one gunicorn worker: its own Store handle and ModelCache on the shared file."""
    store = Store(db)
    store.migrate()
    return ModelCache(store, factory, debounce=timedelta(0), poll=timedelta(milliseconds=20),
                      check=timedelta(milliseconds=20), min_interval=timedelta(0), **kwargs)


def _until(condition, timeout: timedelta = WAIT) -> bool:
    deadline = time.monotonic() + timeout.total_seconds()
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def workers():
    made: list[ModelCache] = []
    yield made
    for worker in made:
        worker.stop()
        worker.store.close()


def _seed(db: str) -> None:
    store = Store(db)
    store.migrate()
    store.put_profile("resnet50", PROFILE)
    store.add_observations([STEP])
    store.close()


def test_two_workers_fit_each_generation_once_and_answer_from_the_same_model(tmp_path, workers):
    db = str(tmp_path / "shared.db")
    _seed(db)
    factory = CountingFactory()
    workers += [_worker(db, factory).start() for _ in range(2)]
    assert all(w.wait_fresh(WAIT) for w in workers)
    assert factory.calls == 1, "the second worker must load the first one's model, not fit its own"

    written = workers[0].store.write_observations([COLLECTIVE])
    views = [w.view(written.generation, WAIT) for w in workers]
    assert [v.generation for v in views] == [written.generation] * 2
    assert views[0].model.fitted_at_s == views[1].model.fitted_at_s      # one fit, loaded by both
    assert factory.calls == 2
    assert sorted(w.status()["fitter"] for w in workers) == [False, True]
    assert sorted(w.fits for w in workers) == [0, 2]
    assert [w.status()["model_version"] for w in workers] == [f"g{written.generation}"] * 2


def test_a_worker_started_after_a_fit_answers_at_once_from_the_stored_model(tmp_path, workers):
    db = str(tmp_path / "shared.db")
    _seed(db)
    factory = CountingFactory()
    first = _worker(db, factory).start()
    workers.append(first)
    assert first.wait_fresh(WAIT)
    fits = factory.calls

    second = _worker(db, factory).start()
    workers.append(second)
    assert second.version == first.version is not None      # no wait: start() loaded it
    profile = Profile.from_dict(PROFILE)
    assert second.predict(profile, "H200", 64, PREDICT["candidates"])[0]["basis"] == "fake"
    assert second.known("resnet50", "H200")
    assert factory.calls == fits

    first.stop()                           # the fitter goes away; so does its lock (as when a process dies)
    assert _until(lambda: second.status()["fitter"])
    assert second.wait_fresh(WAIT) and factory.calls == fits, "the stored model is current: nothing to fit"
    written = second.store.write_observations([COLLECTIVE])
    assert second.view(written.generation, WAIT).generation == written.generation
    assert factory.calls == fits + 1 and second.fits == 1


def test_a_plain_view_answers_from_the_newest_stored_model_at_once(tmp_path, workers):
    # a worker whose poll has not run yet answered the hook's /v1/plan from its older model: the demo's sbatch
    # line said "no step history" right after the calibration's model was fitted and read through another worker
    db = str(tmp_path / "shared.db")
    _seed(db)
    factory = CountingFactory()
    fitter = _worker(db, factory).start()
    other = _worker(db, factory)          # not started: no poll thread, only what each request reads
    workers += [fitter, other]
    assert fitter.wait_fresh(WAIT)
    before = other.view().generation
    written = fitter.store.write_observations([COLLECTIVE])
    assert fitter.view(written.generation, WAIT).generation == written.generation > before
    assert other.view().generation == written.generation   # no wait, no poll: the request itself looked


def test_a_request_waits_for_a_load_in_progress_rather_than_answer_from_an_older_model(tmp_path, workers):
    # #24.16: after a write was reflected, 2 of the next 300 answers were stale: a request that found another
    # thread loading the newer model answered from the old one
    from predictor.service import FittedModel

    db = str(tmp_path / "shared.db")
    _seed(db)
    factory = CountingFactory()
    fitter = _worker(db, factory).start()
    other = _worker(db, factory)
    workers += [fitter, other]
    assert fitter.wait_fresh(WAIT)
    old = other.view().generation
    written = fitter.store.write_observations([COLLECTIVE])
    assert fitter.view(written.generation, WAIT).generation == written.generation

    other._load_lock.acquire()          # another request thread of `other` is loading the new model right now

    def finish_loading():
        time.sleep(0.3)
        other._swap(FittedModel.from_stored(other.store.newest_model(), FakePredictor))
        other._load_lock.release()
    loader = threading.Thread(target=finish_loading)
    loader.start()
    assert other.view().generation == written.generation > old   # not the old model while the load ran
    loader.join()


def test_the_fit_lock_passes_on_when_its_holder_dies(tmp_path):
    path = fit_lock_path(str(tmp_path / "p.db"))
    script = ("import sys, time; from predictor.fitlock import FitLock; "
              "assert FitLock(sys.argv[1]).try_acquire(); print('held', flush=True); time.sleep(60)")
    with subprocess.Popen([sys.executable, "-c", script, path], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout.readline().strip() == "held"
            mine = FitLock(path)
            assert not mine.try_acquire() and not mine.held
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=10)
            assert _until(mine.try_acquire) and mine.held
            other = FitLock(path)                   # a second descriptor in this process is refused too
            assert not other.try_acquire()
            mine.release()
            assert other.try_acquire()
            other.release()
        finally:
            holder.kill()


def test_a_failed_fit_is_reported_by_every_worker_and_answers_a_waiting_request(tmp_path, workers):
    db = str(tmp_path / "shared.db")
    _seed(db)
    workers += [_worker(db, CountingFactory(fail=True)).start() for _ in range(2)]
    assert _until(lambda: all("fit exploded" in (w.status()["last_error"] or "") for w in workers))
    generation = workers[0].store.generation()
    for worker in workers:
        with pytest.raises(ModelVersionUnavailable) as info:
            worker.view(generation, WAIT)         # the fit of that data failed: no point in waiting
        assert info.value.wanted == generation and info.value.available is None
        assert "fit of that data failed" in info.value.reason and "fit exploded" in info.value.reason


def test_stored_models_are_the_fitted_predictor_and_its_profiles(tmp_path, workers):
    db = str(tmp_path / "shared.db")
    _seed(db)
    worker = _worker(db, CountingFactory(), keep_models=2).start()
    workers.append(worker)
    for _ in range(3):
        written = worker.store.write_observations([STEP])
        assert worker.view(written.generation, WAIT).generation == written.generation
    stored = worker.store.newest_model()
    assert stored.head.version == written.generation
    doc = json.loads(stored.blob)           # a JSON document, never a pickle: reading it runs no code
    assert doc["format"] == MODEL_FORMAT and set(doc["profiles"]) == {"resnet50"}
    assert doc["predictor"]["known"] == [["resnet50", STEP["gpu"]]]
    loaded = FittedModel.from_stored(stored, FakePredictor)
    assert loaded.predictor.known("resnet50", STEP["gpu"]) and loaded.profiles["resnet50"].grad_bytes > 0
    versions = [row[0] for row in worker.store.db.execute("SELECT version FROM models ORDER BY version")]
    assert versions == [written.generation - 1, written.generation]      # the newest `keep_models` only


def test_a_model_stored_by_other_code_answers_until_the_fitter_fits_it_again(tmp_path, workers):
    db = str(tmp_path / "shared.db")
    _seed(db)
    store = Store(db)
    generation = store.generation()
    blob = FittedModel(FakePredictor().fit({}, []), {}, generation, 1.0, 0.1, "fitted-by-other-code").blob()
    store.put_model(generation, blob, "fitted-by-other-code", 1.0, 0.1)     # e.g. the service was upgraded since
    store.close()
    factory = CountingFactory()
    worker = _worker(db, factory)
    worker.load_newest()                  # what start() does first: a model to answer from, rather than a 503
    assert worker.version == f"g{generation}" and worker.current.code == "fitted-by-other-code"
    workers.append(worker.start())
    assert _until(lambda: worker.current.code == code_fingerprint())      # the fitter fitted it again
    assert factory.calls == 1 and worker.version == f"g{generation}" and worker.last_error is None
    assert worker.store.newest_model_head().code == code_fingerprint()


def test_a_stored_model_that_cannot_be_read_is_reported_and_fitted_again(tmp_path, workers):
    db = str(tmp_path / "shared.db")
    _seed(db)
    store = Store(db)
    store.put_model(store.generation(), b"not a pickle", code_fingerprint(), 1.0, 0.1)
    store.close()
    factory = CountingFactory()
    worker = _worker(db, factory)
    worker.load_newest()
    assert worker.version is None and "loading stored model g2 failed" in worker.last_error
    workers.append(worker.start())
    assert worker.wait_fresh(WAIT) and factory.calls == 1 and worker.last_error is None


# --- the HTTP API -----------------------------------------------------------------------------------------
def _config(tmp_path, name: str = "p.db") -> Config:
    return Config(db_path=str(tmp_path / name), refit_debounce=timedelta(0), refit_min_interval=timedelta(0),
                  refit_poll=timedelta(milliseconds=20))


@pytest.fixture
def apps():
    made = []
    yield made
    for app in made:
        app.extensions["elastic_predictor"].models.stop()
        app.extensions["elastic_predictor"].store.close()


def test_observations_name_the_pending_version_and_predict_waits_for_it(tmp_path, apps):
    apps.append(create_app(_config(tmp_path), predictor_factory=FakePredictor))
    client = apps[0].test_client()
    assert client.post("/v1/profiles", json=PROFILE).status_code == 201
    posted = client.post("/v1/observations", json=[STEP, COLLECTIVE])
    pending = posted.get_json()["model_version_pending"]
    assert posted.status_code == 201 and pending == client.get("/v1/observations").get_json()["generation"]

    answer = client.post("/v1/predict", json=dict(PREDICT, min_model_version=pending, wait_ms=10_000))
    body = answer.get_json()
    assert answer.status_code == 200, body
    assert body["model_generation"] >= pending and body["model_version"] == f"g{body['model_generation']}"
    assert body["known"] is True                               # the step record just posted is in that model

    plan = client.post(f"/v1/plan?min_model_version=g{pending}&wait_ms=10000", json=PLAN)
    assert plan.status_code == 200, plan.get_json()
    assert plan.get_json()["model_generation"] >= pending and plan.get_json()["model_version"]


def test_a_write_through_one_worker_is_read_through_another(tmp_path, apps):
    factory = CountingFactory()
    config = _config(tmp_path, "shared.db")
    apps += [create_app(config, predictor_factory=factory) for _ in range(2)]
    writer, reader = (app.test_client() for app in apps)
    assert writer.post("/v1/profiles", json=PROFILE).status_code == 201
    pending = writer.post("/v1/observations", json=[STEP]).get_json()["model_version_pending"]
    answer = reader.post(f"/v1/predict?min_model_version={pending}", json=PREDICT)
    assert answer.status_code == 200 and answer.get_json()["model_generation"] >= pending
    assert answer.get_json()["known"] is True
    fits = sorted(app.extensions["elastic_predictor"].models.fits for app in apps)
    assert fits[0] == 0 and fits[1] == factory.calls, "only the worker holding the fit lock fits"


def test_a_version_not_reached_is_a_503_naming_both_versions(tmp_path, apps):
    apps.append(create_app(_config(tmp_path), predictor_factory=FakePredictor, start_refit=False))  # no fitter runs
    client = apps[0].test_client()
    client.post("/v1/profiles", json=PROFILE)
    apps[0].extensions["elastic_predictor"].models.refit()
    pending = client.post("/v1/observations", json=[STEP]).get_json()["model_version_pending"]

    behind = client.post("/v1/predict", json=dict(PREDICT, min_model_version=pending, wait_ms=100))
    body = behind.get_json()
    assert behind.status_code == 503 and behind.headers["Retry-After"]
    assert body["field"] == "min_model_version" and body["min_model_version"] == pending
    assert body["model_version"] == f"g{pending - 1}" and body["model_generation"] == pending - 1
    assert body["store_generation"] == pending and 0 <= body["waited_ms"] <= MAX_VERSION_WAIT.total_seconds() * 1000
    assert f"g{pending}" in body["error"] and f"g{pending - 1}" in body["error"]

    too_high = client.post(f"/v1/plan?min_model_version={pending + 5}&wait_ms=20000", json=PLAN)
    body = too_high.get_json()
    assert too_high.status_code == 503 and too_high.headers["Retry-After"]
    assert body["min_model_version"] == pending + 5 and body["model_version"] == f"g{pending - 1}"
    assert "no write has produced" in body["error"]
    assert body["waited_ms"] <= MAX_VERSION_WAIT.total_seconds() * 1000
    assert client.get("/v1/decisions").get_json()["decisions"] == []      # nothing decided, nothing stored

    plain = client.post("/v1/predict", json=PREDICT)                       # without asking: the model in use
    assert plain.status_code == 200 and plain.get_json()["model_generation"] == pending - 1


V, W = ("min_model_version", "model_version_pending"), ("wait_ms", "milliseconds")


@pytest.mark.parametrize("query,body,expected", [
    ("min_model_version=-1", {}, V),
    ("min_model_version=gg1", {}, V),
    ("", {"min_model_version": 1.5}, V),
    ("", {"min_model_version": True}, V),
    ("", {"min_model_version": None}, V),
    ("", {"min_model_version": 10**18}, V),
    ("min_model_version=1&wait_ms=soon", {}, W),
    ("", {"min_model_version": 1, "wait_ms": -1}, W),
    ("", {"min_model_version": 1, "wait_ms": "100"}, W),       # digits as text only in the query string
    ("wait_ms=100", {}, ("wait_ms", "only means something with min_model_version")),
    ("min_model_version=1", {"min_model_version": 1}, ("min_model_version", "give it once")),
])
def test_a_bad_version_request_is_a_400_naming_the_field(tmp_path, apps, query, body, expected):
    apps.append(create_app(_config(tmp_path), predictor_factory=FakePredictor))
    response = apps[0].test_client().post(f"/v1/predict?{query}", json=dict(PREDICT, **body))
    field, says = expected
    assert response.status_code == 400 and response.get_json()["field"] == field, response.get_json()
    assert says in response.get_json()["error"]


def test_wait_ms_is_capped_by_the_server(tmp_path, apps):
    apps.append(create_app(_config(tmp_path), predictor_factory=FakePredictor, start_refit=False))
    with apps[0].test_request_context("/v1/plan?min_model_version=g3&wait_ms=99999999999"):
        assert version_wait(None) == (3, MAX_VERSION_WAIT)
    with apps[0].test_request_context("/v1/predict"):
        assert version_wait({"min_model_version": 4, "wait_ms": 250}) == (4, timedelta(milliseconds=250))
        assert version_wait({})[0] is None
