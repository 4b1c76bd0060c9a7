"""The cheap /v1/plan path (issue #5): one encode, one INSERT, no re-decoding, same contract and bytes."""
from __future__ import annotations

import http.client
import json
import re
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from predictor.service import candidates_key
from predictor.store import Store
from tests.unit._service_fakes import COLLECTIVE, PROFILE, STEP, FakePredictor, seeded_app

PLAN = {"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=2-16", "#ELASTIC per_gpu_batch=64 "
                                               "min_efficiency=0.3"],
        "job": {"min_nodes": 1, "tres_per_node": "gres:gpu:4", "partition": "debug", "name": "tr\u00e4in"}}


@pytest.fixture
def app(tmp_path):
    app = seeded_app(tmp_path)
    yield app
    app.extensions["elastic_predictor"].models.stop()
    app.extensions["elastic_predictor"].store.close()


def _rows(app) -> list[tuple]:
    with sqlite3.connect(app.extensions["elastic_predictor"].config.db_path) as conn:
        return conn.execute("SELECT id, request, response FROM decisions ORDER BY id").fetchall()


def test_reply_is_the_stored_text_and_byte_identical_to_jsonify(app):
    client = app.test_client()
    response = client.post("/v1/plan", json=PLAN)
    body = response.get_json()
    assert response.status_code == 200 and response.mimetype == "application/json"
    assert body["action"] == "rewrite" and list(body)[0] == "decision_id"
    with app.app_context():
        assert response.get_data() == app.json.response(body).get_data()     # what `return dict` sent before
    (oid, request_text, response_text), = _rows(app)
    assert f'{response_text}\n'.encode() == response.get_data() and body["decision_id"] == f"d-{oid}"
    assert json.loads(request_text) == PLAN
    shown = client.get(f"/v1/decisions/{body['decision_id']}").get_json()
    assert shown["response"] == body and shown["request"] == PLAN


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8-sig"])
def test_a_body_json_accepts_in_another_encoding_is_stored_as_its_document(app, encoding):
    client = app.test_client()
    response = client.post("/v1/plan", data=json.dumps(PLAN).encode(encoding), content_type="application/json")
    assert response.status_code == 200
    (_, request_text, _), = _rows(app)
    assert json.loads(request_text) == PLAN


def test_decision_ids_stay_unique_and_match_their_rows_with_concurrent_writers(tmp_path):
    path = str(tmp_path / "c.db")
    Store(path).migrate()
    stores = [Store(path), Store(path)]            # as two gunicorn workers
    answers: list[str] = []
    lock = threading.Lock()

    def write(store: Store, n: int) -> None:
        for i in range(n):
            text = store.add_decision_text(json.dumps({"i": i}), {"action": "keep", "reason": "r"}, "cli", None)
            with lock:
                answers.append(text)

    threads = [threading.Thread(target=write, args=(store, 60)) for store in stores for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ids = [json.loads(text)["decision_id"] for text in answers]
    assert len(set(ids)) == 240
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT id, response FROM decisions").fetchall()
    assert sorted(oid for oid, _ in rows) == list(range(1, 241))
    assert all(json.loads(text)["decision_id"] == f"d-{oid}" for oid, text in rows)
    assert sorted(text for _, text in rows) == sorted(answers)
    for store in stores:
        store.close()


def test_a_non_finite_response_stores_nothing(tmp_path):
    store = Store(str(tmp_path / "n.db"))
    store.migrate()
    with pytest.raises(ValueError):
        store.add_decision_text("{}", {"action": "keep", "reason": "r", "x": float("nan")}, "cli", None)
    assert store.list_decisions() == []
    assert store.add_decision({"a": 1}, {"action": "keep", "reason": "r"}, "cli", None)["decision_id"] == "d-1"
    store.close()


def _decisions_total(client) -> dict[str, float]:
    text = client.get("/metrics").get_data(as_text=True)
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^elastic_predictor_decisions_total(\{.*\}) (\S+)$",
                                                                text, re.M)}


def test_metrics_label_decisions_as_before_without_decoding_again(app):
    client = app.test_client()
    no_source = {k: v for k, v in PLAN.items() if k != "source"}
    assert client.post("/v1/plan", json=no_source).status_code == 200                  # stored as cli, counted other
    assert client.post("/v1/plan", data=json.dumps(PLAN), content_type="text/plain").status_code == 200
    assert client.post("/v1/plan", json={**PLAN, "source": "launcher", "job": {"min_nodes": "x"}}).status_code == 400
    assert client.post("/v1/plan", data=b"{not json", content_type="application/json").status_code == 400
    assert client.post("/v1/plan", json={**PLAN, "directives": ["#ELASTIC model=vgg99"]}).status_code == 200
    counts = _decisions_total(client)
    assert counts == {'{source="other",action="rewrite"}': 2, '{source="launcher",action="error"}': 1,
                      '{source="other",action="error"}': 1, '{source="job_submit",action="keep"}': 1}


def test_candidates_key_tells_links_apart_and_matches_equal_lists():
    a = [{"layout": [4, 4], "intra_link": "nvlink", "inter_link": "ib"}]
    assert candidates_key(a) == candidates_key(json.loads(json.dumps(a)))
    assert candidates_key(a) != candidates_key([{"layout": [4, 4], "intra_link": "nvlink", "inter_link": "eth"}])
    assert candidates_key(a) != candidates_key([{"layout": [4, 4], "intra_link": "nvlink"}])
    assert candidates_key(a + a) != candidates_key(a)
    hash(candidates_key(a))


@pytest.mark.slow  # gunicorn, SIGKILLed
def test_sigkill_during_a_plan_burst_loses_no_acknowledged_decision(tmp_path):
    """Issue #8's rule on the /v1/plan path: a decision whose 200 reached the client survives SIGKILL."""
    from tests.unit.test_store_durability import _free_port, _kill, _serve  # noqa: PLC0415

    db, port = tmp_path / "plans.db", _free_port()
    proc = _serve(db, port, tmp_path / "serve.log")
    acked: dict[str, tuple[dict, dict]] = {}
    lock, stop = threading.Lock(), threading.Event()
    errors: list = []
    killing = threading.Event()

    def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            body = {**PLAN, "job": {**PLAN["job"], "name": f"j{n}-{i}"}}
            i += 1
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/plan", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    reply = json.loads(answer.read())
            except urllib.error.HTTPError as exc:
                if not killing.is_set():   # after the kill is sent, nginx may outlive a worker by microseconds
                    errors.append((exc.code, exc.read()[:200]))
                return
            except (OSError, ValueError, http.client.HTTPException):
                return                                     # killed: refused, reset or cut mid-answer
            with lock:
                acked[reply["decision_id"]] = (body, reply)

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while len(acked) < 300 and time.monotonic() < deadline and not errors:
        time.sleep(0.01)
    killing.set()
    _kill(proc)                                            # the whole process group, mid-burst
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert len(acked) >= 300, "the burst did not get going before the kill"
    _kill(_serve(db, port, tmp_path / "serve.log"))        # restart on the same file (WAL recovery)
    store = Store(str(db))
    try:
        for decision_id, (body, reply) in acked.items():
            stored = store.get_decision(decision_id)
            assert stored["request"] == body and stored["response"] == reply
    finally:
        store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


FREEZE_PROBE = """
import gc, json, sys
from predictor.service import ModelCache
from predictor.store import Store
from tests.unit._service_fakes import COLLECTIVE, PROFILE, STEP, FakePredictor
store = Store(sys.argv[1]); store.migrate()
store.put_profile(PROFILE["name"], PROFILE); store.add_observations([STEP, COLLECTIVE])
cache = ModelCache(store, FakePredictor)
counts = [gc.get_freeze_count()]
cache.refit(); counts.append(gc.get_freeze_count())
store.add_observations([STEP]); cache.refit(); counts.append(gc.get_freeze_count())
print(json.dumps(counts))
"""


def test_the_first_fit_of_a_process_freezes_the_heap_once(tmp_path):
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE, str(tmp_path / "f.db")], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    before, first, second = json.loads(out.stdout)
    assert before == 0 and first > 10000 and second <= first      # frozen objects can still be freed
