"""Observation records the launcher sends, checked against the predictor's own validator; the workers'
observation and progress channel; the controller's predictor client (token, fail soft)."""
from __future__ import annotations

import contextlib
import http.server
import json
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.membership import Coordinator
from elastic_launcher.links import Links
from elastic_launcher.observations import ObservationInbox, layout_of, relabel, step_record
from elastic_launcher.reporting import PredictorClient
from elastic_launcher.telemetry import Telemetry
from elastic_launcher.workers import ProgressReporter
from predictor.errors import ValidationError
from slurm_plugin.contracts.records import validate_batch


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server
    del server


@pytest.mark.parametrize("layout", [[4], [2, 2], [1, 1, 1]])
def test_controller_step_records_pass_the_predictor_validator(layout):
    rec = step_record("resnet50", "H200", layout, Links("nvlink", "ib"), 64, 0.032)
    assert validate_batch([rec]) == [rec]
    assert rec["intra_link"] == "nvlink"
    assert rec.get("inter_link") == ("ib" if len(layout) > 1 else None)


def test_a_multi_node_step_record_without_inter_link_is_what_the_predictor_rejects():
    rec = step_record("tiny", "cpu", [1, 1], Links("shm", "socket"), 4, 0.15)
    del rec["inter_link"]
    with pytest.raises(ValidationError, match="inter_link"):
        validate_batch([rec])


def test_worker_records_relabelled_with_the_layout_and_links_pass_the_validator():
    tel = Telemetry(profile="whatever", gpu="cpu")  # the worker only knows its world size
    tel.record_collective(4, 1 << 20, 0.002)
    tel.record_collective(3, 1 << 10, 0.001)       # an epoch whose layout the controller never saw
    tel.record_step([4], 8, 0.2)
    tel.record_step([2], 8, 0.1)
    links = Links("shm", "socket", "flag")
    out = relabel(tel.drain(), {4: [2, 2], 2: [2]}, {4: links, 2: links}, "tiny", "H100")
    assert validate_batch(out) == out
    coll = [r for r in out if r["kind"] == "collective"]
    steps = {tuple(r["layout"]): r for r in out if r["kind"] == "step"}
    assert [(r["world"], r["link"], r["nodes"], r["gpu"]) for r in coll] == [(4, "socket", 2, "H100")]
    assert steps[(2, 2)]["inter_link"] == "socket" and steps[(2, 2)]["intra_link"] == "shm"
    assert "inter_link" not in steps[(2,)] and steps[(2,)]["profile"] == "tiny"
    assert {r["link_source"] for r in out} == {"flag"}
    # under elastic-launch the controller's own window record is the step row: the workers' are left out
    only_coll = relabel(tel.drain() or [], {4: [2, 2]}, {4: links}, "tiny", "H100", steps=False)
    assert only_coll == []
    tel.record_step([4], 8, 0.2)
    tel.record_collective(4, 1 << 20, 0.002)
    assert [r["kind"] for r in relabel(tel.drain(), {4: [2, 2]}, {4: links}, "tiny", "H100", steps=False)] == \
        ["collective"]


def test_telemetry_multi_node_step_records_carry_inter_link():
    tel = Telemetry(profile="mlp", gpu="H200", intra_link="nvlink", inter_link="ib", multi_node=True)
    tel.record_collective(4, 1 << 20, 0.002)
    tel.record_step([2, 2], 64, 0.03)
    recs = tel.drain()
    assert validate_batch(recs) == recs
    assert recs[0]["link"] == "ib" and recs[1]["inter_link"] == "ib"


def test_layout_of_members():
    node_of = {"a-0": "n1", "a-1": "n1", "b-0": "n2", "b-1": "n2"}
    assert layout_of(["a-0", "a-1", "b-0", "b-1"], node_of) == [2, 2]
    assert layout_of(["a-0", "b-0"], node_of) == [1, 1]
    assert layout_of(["a-0", "x"], node_of) is None


def test_published_observations_are_collected_once(store):
    rep = ProgressReporter(store, "w1", "n1")
    inbox = ObservationInbox(store)
    assert inbox.collect(["w1", "w2"]) == []
    rep.publish([{"kind": "step", "layout": [1]}])
    rep.publish([{"kind": "collective", "world": 1}])
    assert [r["kind"] for r in inbox.collect(["w1"])] == ["step", "collective"]
    assert inbox.collect(["w1"]) == []
    rep.publish([{"kind": "step", "layout": [1]}])
    assert len(inbox.collect(["w1"])) == 1


def test_trainer_reports_progress_and_publishes_observations(store):
    """ElasticTrainer(progress=...) reports every committed step (not a rolled-back one) and hands its
    observation records over; rank 0 of the first epoch writes elastic/switched/<id>."""
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
    coord = Coordinator(dist.PrefixStore("job", store))
    plan = coord.start(["solo"])
    rep = ProgressReporter(store, "solo", "n1")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = TrainerConfig(timeout=timedelta(seconds=5), connect_timeout=timedelta(seconds=5),
                        rendezvous_timeout=timedelta(seconds=5), observations_every=2)
    et = ElasticTrainer(model, opt, store_addr=f"127.0.0.1:{store.port}/job", worker_id="solo",
                        policy=BatchPolicy(per_gpu_batch=4), config=cfg, telemetry=Telemetry(profile="mlp"),
                        progress=rep).join()
    ds = torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
    try:
        it = et.loader(ds)
        for _ in range(3):
            x, y = next(it)
            torch.nn.functional.mse_loss(et.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert et.commit()
        assert coord.switched(plan)["kind"] == "initial"
        x, y = next(it)
        et.report_error(ValueError("nan"))
        assert et.commit()  # rolled back: no report
        progress = json.loads(store.get(keys.progress("solo")))
        assert (progress["epoch"], progress["step"], progress["samples"], progress["steps"]) == (plan.id, 3, 12, 3)
        assert progress["compute_total_s"] > 0
        published = ObservationInbox(store).collect(["solo"])
        assert {r["kind"] for r in published} == {"step"}  # one process: its all-reduce used no link, no record
    finally:
        et.close()


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Recorder.seen.append((self.path, self.headers.get("Authorization"), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"stored": 1}')

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _serving(handler):
    """An HTTP server on a free local port answering with `handler`; yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)  # shutdown() waits a poll
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_predictor_client_posts_observations_with_the_token_and_fails_soft():
    rec = step_record("tiny", "cpu", [1, 1], Links("shm", "socket"), 4, 0.15)
    with _serving(_Recorder) as url:
        client = PredictorClient(url, "s3cret", timeout_s=2)
        assert client.observe([rec])
        assert _Recorder.seen[-1] == ("/v1/observations", "Bearer s3cret", [rec])
    down = PredictorClient("http://127.0.0.1:9", "s3cret", timeout_s=1, retry_delay_s=0.01)   # a retry waits 0.01 s, not 0.5
    assert down.observe([rec]) is False and "/v1/observations" in down.last_error
    assert down.observe([rec]) is False  # breaker open: no second wait


class _ColdThenWarm(http.server.BaseHTTPRequestHandler):
    """/v1/predict: 503 on the first request (a service worker still loading its model), then an answer."""
    calls = 0

    def do_POST(self):  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers["Content-Length"]))
        _ColdThenWarm.calls += 1
        cold = _ColdThenWarm.calls == 1
        self.send_response(503 if cold else 200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "loading"}' if cold else
                         b'{"known": true, "predictions": [{"compute_s": 0.03, "iter_s": 0.03, "basis": "measured"}]}')

    def log_message(self, *args):
        pass


def test_compute_time_is_retried_so_one_slow_answer_neither_loses_the_speeds_nor_opens_the_breaker():
    _ColdThenWarm.calls = 0
    with _serving(_ColdThenWarm) as url:
        client = PredictorClient(url, "t", timeout_s=2, retry_delay_s=0.01)
        assert client.compute_s("resnet50", "H100", 64, "nvlink") == (0.03, "predicted")
        assert client.compute_s("resnet50", "A100", 64, "nvlink") == (0.03, "predicted")  # breaker still closed
        assert _ColdThenWarm.calls == 3
