"""A service a site can open to every user (issue #14, items 4-6): what one unauthenticated client can make a
worker draw, hold in memory or write to disk is bounded.

4. Plots: no request draws; a plot is drawn by the worker's background thread, bounded in what it draws.
5. Memory: the prediction cache is bounded in bytes, and predictions leave the fitted model as it was; one request's candidate
   layouts are bounded in nodes (413 naming the field).
6. Disk: /v1/plan stores the validated request, never the raw body; `reused` names decision ids only; the
   decisions are pruned on write to a row, age and byte bound.

No test here asserts on speed; waits have deadlines that only turn a hang into a failure.
"""
from __future__ import annotations

import io
import json
import sqlite3
import threading
import time
from datetime import timedelta

import pytest

from predictor import plots
from predictor.cluster import Cluster
from predictor.engine import Predictor
from predictor.plotcache import MAX_PENDING, PlotKey, PlotRenderer
from predictor.profiles import Profile
from predictor.service import PredictionCache, prediction_entry_bytes
from predictor.store import DecisionRetention, Store
from tests.unit._service_fakes import COLLECTIVE, PROFILE, STEP, FakePredictor, seeded_app

WAIT = timedelta(seconds=60)
PLAN = {"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=2-16", "#ELASTIC per_gpu_batch=64 "
                                               "min_efficiency=0.3"],
        "job": {"min_nodes": 1, "tres_per_node": "gres:gpu:4", "partition": "debug", "user": "alice"}}


def _app(tmp_path, **config):
    return seeded_app(tmp_path, wait=WAIT, **config)


def _close(app) -> None:
    svc = app.extensions["elastic_predictor"]
    svc.plots.stop()
    svc.models.stop()
    svc.store.close()


@pytest.fixture
def app(tmp_path):
    application = _app(tmp_path)
    yield application
    _close(application)


def _until(condition, timeout: timedelta = WAIT):
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


# --- 4. plots ---------------------------------------------------------------------------------------------------
def _many_gpus(n: int) -> list[dict]:
    return [dict(STEP, gpu=f"G{i}", layout=[1 + i % 4], intra_link="nvlink") for i in range(n)]


@pytest.mark.slow  # matplotlib drawings or worker processes: seconds
def test_a_plot_of_many_gpu_names_is_drawn_off_the_request_and_bounded(app, monkeypatch):
    """Issue #14.4: after one POST of step records on 60 GPU names, the plot request answers without drawing
    (the first drawing is the background thread's), and what the figure draws is bounded."""
    client = app.test_client()
    svc = app.extensions["elastic_predictor"]
    assert client.post("/v1/observations", json=_many_gpus(60)).status_code == 201
    assert svc.models.wait_fresh(WAIT)
    drawn_in: list[str] = []
    real_png = plots._png

    def recording_png(fig):
        drawn_in.append(threading.current_thread().name)
        return real_png(fig)

    monkeypatch.setattr(plots, "_png", recording_png)
    first = client.get("/admin/plots/scaling.png")
    assert first.status_code == 202 and first.mimetype == "image/png" and first.headers["Retry-After"] == "1"
    assert threading.current_thread().name not in drawn_in            # the request drew nothing
    ready = _until(lambda: (r := client.get("/admin/plots/scaling.png")).status_code == 200 and r)
    assert ready, "the background thread never drew the plot"
    assert ready.headers["X-Plot-State"] == "fresh" and ready.headers["X-Plot-Model-Version"] == svc.models.version
    assert drawn_in and set(drawn_in) <= {"predictor-plots"}          # every figure came from the renderer
    from matplotlib.image import imread  # matplotlib loads with the first plot, not at collection

    image = imread(io.BytesIO(ready.data), format="png")
    assert image.shape[0] <= 6 * 420 + 200                             # 12 panels, 2 columns, and the note
    data = plots.scaling_data(svc.store, svc.models.predictor())
    assert len(data.items) == plots.MAX_PANELS
    assert any(note.startswith("49 model/GPU panels not drawn") for note in data.omitted)
    assert client.get("/admin/plots/scaling.png").data == ready.data  # answered from the cache


def test_a_plot_bounds_points_per_series_and_curve_points(tmp_path):
    store = Store(str(tmp_path / "b.db"))
    store.migrate()
    store.put_profile(PROFILE["name"], PROFILE)
    many = [dict(STEP, iter_s=0.03 + i * 1e-6) for i in range(plots.MAX_POINTS + 50)]
    wide = [dict(STEP, layout=[1] * 4096, iter_s=1.0)]
    store.add_observations(many + wide + [COLLECTIVE])
    fake = FakePredictor().fit({"resnet50": Profile.from_dict(PROFILE)}, store.observations())
    data = plots.scaling_data(store, fake)
    for series in data.items[0]["series"]:
        assert len(series["observed"]) <= plots.MAX_POINTS and len(series["predicted"]) <= plots.MAX_CURVE_POINTS
    assert any("the newest 400 of 450 records drawn" in note for note in data.omitted)
    store.close()


def test_the_renderer_queue_is_bounded_and_a_stale_drawing_is_served_while_the_next_is_drawn(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "r.db"))
    store.migrate()

    class Models:
        current = None

    gate, drawing = threading.Event(), threading.Event()

    def blocked_scaling(store_, predictor, profile=None, gpu=None):
        drawing.set()
        assert gate.wait(30)
        return b"\x89PNG scaling " + str(profile).encode()

    monkeypatch.setattr(plots, "scaling_png", blocked_scaling)
    renderer = PlotRenderer(store, Models(), duty=1.0)
    try:
        assert renderer.answer(PlotKey("scaling")).status == 202
        assert drawing.wait(30)                                         # the thread is busy with the first
        answers = [renderer.answer(PlotKey("scaling", f"p{i}")).status for i in range(MAX_PENDING + 2)]
        assert answers == [202] * (MAX_PENDING - 1) + [429] * 3        # the one drawn counts; then 429 (Retry-After)
        gate.set()
        done = _until(lambda: renderer.answer(PlotKey("scaling")).status == 200)
        assert done and renderer.answer(PlotKey("scaling")).png == b"\x89PNG scaling None"
        Models.current = type("Model", (), {"key": (7, 1.0), "version": "g7", "predictor": None})()
        stale = renderer.answer(PlotKey("scaling"))                    # a new model: old drawing, redrawn behind
        assert stale.status == 200 and stale.state == "stale" and stale.model_version == "none"
        assert _until(lambda: renderer.answer(PlotKey("scaling")).model_version == "g7")
    finally:
        gate.set()
        renderer.stop()
        store.close()


def test_admin_page_plots_are_drawn_before_they_are_asked_when_prerendering(tmp_path):
    app = _app(tmp_path, plot_prerender=True)
    try:
        svc = app.extensions["elastic_predictor"]
        svc.plots.start()
        assert _until(lambda: svc.plots.status()["drawings"] >= 2)
        for url in ("/admin/plots/scaling.png", "/admin/plots/links.png"):
            assert app.test_client().get(url).status_code == 200, url
    finally:
        _close(app)


# --- 5. memory --------------------------------------------------------------------------------------------------
def _wide_request(seed: int, candidates: int = 16, nodes: int = 4096) -> dict:
    return {"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 64,
            "candidates": [{"layout": [1 + (seed + c) % 8] * nodes, "intra_link": "nvlink", "inter_link": "ib"}
                           for c in range(candidates)]}


def test_the_prediction_cache_stays_under_its_byte_budget_after_many_distinct_large_requests(tmp_path):
    budget = 3 * 1024 * 1024
    app = _app(tmp_path, prediction_cache_bytes=budget)
    try:
        client = app.test_client()
        cache = app.extensions["elastic_predictor"].models.predictions
        one = prediction_entry_bytes(_wide_request(0)["candidates"])
        assert one > 1024 * 1024                                         # each answer is over a MiB
        for seed in range(40):
            response = client.post("/v1/predict", data=json.dumps(_wide_request(seed), separators=(",", ":")),
                                   content_type="application/json")
            assert response.status_code == 200
            assert cache.bytes <= budget
        assert 1 <= len(cache) <= budget // one
        again = client.post("/v1/predict", json=_wide_request(39))   # the newest is still cached
        assert again.status_code == 200 and len(cache) >= 1
    finally:
        _close(app)


def test_prediction_cache_refuses_an_entry_larger_than_its_budget_and_evicts_lru():
    cache = PredictionCache(size=100, max_bytes=10_000)
    small = [{"layout": [1], "intra_link": "x"}]
    big = [{"layout": [1] * 1000, "intra_link": "x"}] * 2
    cache.put(("big",), ["v"], big)
    assert len(cache) == 0 and cache.bytes == 0
    for i in range(20):
        cache.put((i,), ["v"], small)
        assert cache.bytes <= 10_000
    assert cache.get((19,)) == ["v"] and cache.get((0,)) is None


def test_predictions_of_wide_layouts_leave_the_fitted_model_as_it_was():
    # #24.8: the engine's per-layout sync-time cache grew with every distinct 8 KiB layout key; the step model
    # keeps no per-request state at all
    profile = Profile.from_dict(PROFILE)
    model = Predictor().fit({"resnet50": profile}, [STEP, COLLECTIVE])
    before, attributes = json.dumps(model.to_params()), set(vars(model))
    for i in range(200):
        layout = [4] * 1000
        layout[i] = 1 + i % 3
        model.predict(profile, "H200", 64, [{"layout": layout, "intra_link": "nvlink", "inter_link": "ib"}])
    assert json.dumps(model.to_params()) == before and set(vars(model)) == attributes


def test_too_many_layout_nodes_in_one_request_is_413_naming_candidates(app):
    client = app.test_client()
    body = json.dumps(_wide_request(0, candidates=320), separators=(",", ":"))    # 320 x 4096 nodes, 2.6 MB
    response = client.post("/v1/predict", data=body, content_type="application/json")
    assert response.status_code == 413 and response.get_json()["field"] == "candidates"
    assert "65536" in response.get_json()["error"]
    assert len(app.extensions["elastic_predictor"].models.predictions) == 0


def test_enumerating_a_huge_partition_is_413_naming_max_gpus(tmp_path):
    cluster = Cluster.from_dict({"partitions": [{"name": "big", "nodes": "n[0001-4096]", "gpus_per_node": 8,
                                                 "gpu": "H200", "intra_link": "nvlink", "inter_link": "ib"}]})
    app = _app(tmp_path, cluster=cluster)
    try:
        client = app.test_client()
        response = client.post("/v1/predict", json={"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 64})
        assert response.status_code == 413 and response.get_json()["field"] == "max_gpus"
        small = client.post("/v1/predict", json={"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 64,
                                                 "max_gpus": 16})
        assert small.status_code == 200
    finally:
        _close(app)


# --- 6. disk ----------------------------------------------------------------------------------------------------
def _decision_rows(app) -> list[tuple]:
    with sqlite3.connect(app.extensions["elastic_predictor"].config.db_path) as conn:
        return conn.execute("SELECT id, length(CAST(request AS BLOB)), length(CAST(response AS BLOB)) "
                            "FROM decisions ORDER BY id").fetchall()


def test_plan_stores_the_validated_request_never_the_raw_body(app):
    client = app.test_client()
    padded = json.dumps(PLAN) + " " * 3_000_000                  # 3 MB of whitespace: valid JSON, under the cap
    response = client.post("/v1/plan", data=padded, content_type="application/json")
    assert response.status_code == 200
    (oid, request_bytes, _), = _decision_rows(app)
    assert request_bytes < 1024
    stored = client.get(f"/v1/decisions/d-{oid}").get_json()["request"]
    assert stored == PLAN


@pytest.mark.parametrize("reused", [{"x" * 100_000: 1}, {"d-1": 1, "junk": 2}, {"d-" + "9" * 19: 1}, {"D-1": 1}])
def test_reused_keys_must_be_decision_ids(app, reused):
    response = app.test_client().post("/v1/plan", json={**PLAN, "reused": reused})
    assert response.status_code == 400 and response.get_json()["field"] == "reused"
    assert len(response.get_data()) < 1024                       # the error does not echo the junk back
    assert _decision_rows(app) == []


def test_directive_text_beyond_its_cap_is_413_naming_directives(app):
    lines = ["#ELASTIC model=resnet50 " + "x" * 4000] * 5
    response = app.test_client().post("/v1/plan", json={**PLAN, "directives": lines})
    assert response.status_code == 413 and response.get_json()["field"] == "directives"
    assert _decision_rows(app) == []


def test_200_large_plans_leave_the_decisions_bounded_in_rows_and_bytes(tmp_path):
    keep_rows, keep_bytes = 50, 256 * 1024
    app = _app(tmp_path, decisions_keep=keep_rows, decisions_max_bytes=keep_bytes)
    try:
        client = app.test_client()
        store = app.extensions["elastic_predictor"].store
        ids = []
        for i in range(200):
            reused = {f"d-{1000000 + i * 2000 + k}": 7 for k in range(1500)}     # ~27 KB of valid counts
            response = client.post("/v1/plan", json={**PLAN, "reused": reused})
            assert response.status_code == 200
            ids.append(response.get_json()["decision_id"])
            rows = _decision_rows(app)
            assert len(rows) <= keep_rows
            assert sum(r + s for _, r, s in rows) <= keep_bytes
            assert store.decision_bytes() == sum(r + s for _, r, s in rows)   # the running count is exact
        assert client.get(f"/v1/decisions/{ids[-1]}").status_code == 200      # the newest kept, the oldest gone
        assert client.get(f"/v1/decisions/{ids[0]}").status_code == 404
    finally:
        _close(app)


def test_retention_prunes_in_batches_by_rows_and_by_age(tmp_path):
    keep = DecisionRetention(max_rows=100, max_age=timedelta(days=1), batch_rows=10)
    store = Store(str(tmp_path / "d.db"), decision_retention=keep)
    store.migrate()

    def count() -> int:
        return store.db.execute("SELECT COUNT(*) FROM decisions").fetchone()[0]

    counts = []
    for i in range(130):
        store.add_decision({"i": i}, {"action": "keep", "reason": "r"}, "cli", None)
        counts.append(count())
    assert max(counts) == 100 and counts[100] == keep.row_target == 91   # one prune of a batch, not one per write
    assert sum(b < a for a, b in zip(counts, counts[1:])) == 3
    old = time.time() - 2 * 86400
    store.db.execute("UPDATE decisions SET created_at_s = ? WHERE id <= 60", [old])
    store.db.conn.commit()
    oldest = store.db.execute("SELECT MIN(id) FROM decisions").fetchone()[0]
    store.add_decision({"i": "new"}, {"action": "keep", "reason": "r"}, "cli", None)
    assert store.db.execute("SELECT MIN(id) FROM decisions").fetchone()[0] == oldest + 10     # one batch a write
    for _ in range(3):
        store.add_decision({"i": "new"}, {"action": "keep", "reason": "r"}, "cli", None)
    assert store.db.execute("SELECT MIN(id) FROM decisions").fetchone()[0] == 61               # none too old left
    store.close()


def test_a_store_without_retention_keeps_every_decision_and_counts_their_bytes(tmp_path):
    store = Store(str(tmp_path / "k.db"))
    store.migrate()
    for i in range(30):
        store.add_decision({"i": i}, {"action": "keep", "reason": "r"}, "cli", None)
    (n, total), = store.db.execute("SELECT COUNT(*), SUM(length(request) + length(response)) FROM decisions")
    assert n == 30 and store.decision_bytes() == total
    store.close()


def test_one_clients_flood_evicts_only_its_own_decisions(tmp_path):
    # #24.9: four anonymous threads filled the decision budget in 30 s and deleted every earlier decision, the
    # hook's included; one client now holds at most its share, and a flood prunes its own oldest first
    keep = DecisionRetention(max_rows=100, max_age=timedelta(days=1), batch_rows=10, client_share=0.25)
    store = Store(str(tmp_path / "d.db"), decision_retention=keep)
    store.migrate()
    hook = [store.add_decision({"i": i}, {"action": "keep", "reason": "r"}, "job_submit", None,
                               client="10.0.0.1")["decision_id"] for i in range(20)]
    for i in range(500):
        store.add_decision({"flood": i}, {"action": "keep", "reason": "r"}, "job_submit", None, client="10.9.9.9")
    kept = {row[0]: row[1] for row in store.db.execute("SELECT client, COUNT(*) FROM decisions GROUP BY client")}
    assert kept["10.0.0.1"] == 20 and kept["10.9.9.9"] <= 80
    for d in hook:
        store.get_decision(d)  # raises NotFoundError once pruned
    counted = dict(store.db.execute("SELECT client, rows FROM decision_clients").fetchall())
    assert counted == kept
    (rows,) = store.db.execute("SELECT value FROM meta WHERE key = 'decision_rows'").fetchone()
    assert rows == sum(kept.values())
    (total,) = store.db.execute("SELECT SUM(length(CAST(request AS BLOB)) + length(CAST(response AS BLOB))) "
                                "FROM decisions").fetchone()
    assert store.decision_bytes() == total
    store.close()
