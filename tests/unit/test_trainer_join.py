"""Issue 27.3: ``ElasticTrainer(...)`` only stores and checks its arguments; ``join()`` connects, warms up,
announces the worker, waits for a plan and builds its group.

A trainer is built and inspected without any store or job; each bad argument fails the constructor with an error
that names it; the training API before ``join()`` and a second ``join()`` raise ``TrainerPhaseError``; ``join()``
works on a real gloo job (a world of one in this process, and two spawned processes in the slow tier); a join
that fails (store unreachable, no group) leaves no thread behind.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import re
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.epoch_decisions import Phase
from elastic_launcher.errors import ProcessGroupError, StoreAddressError, TrainerPhaseError
from elastic_launcher.membership import Coordinator
from elastic_launcher.process_group import StoreAddr
from elastic_launcher.telemetry import Telemetry
from elastic_launcher.testing import FaultPlan
from elastic_launcher.trainer import ElasticTrainer, TrainerConfig

FAST = TrainerConfig(timeout=timedelta(seconds=10), connect_timeout=timedelta(seconds=10),
                     rendezvous_timeout=timedelta(seconds=10), commit_every=2)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server
    del server


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_opt():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    return m, torch.optim.SGD(m.parameters(), lr=0.01)


def _args(**over) -> dict:
    m, o = _model_opt()
    args = {"model": m, "optimizer": o, "store_addr": "127.0.0.1:1/job", "worker_id": "w0",
            "policy": BatchPolicy(per_gpu_batch=4)}
    args.update(over)
    return args


def _build(**over) -> ElasticTrainer:
    a = _args(**over)
    return ElasticTrainer(a.pop("model"), a.pop("optimizer"), **a)


def _hb_threads(wid: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"elastic-hb-{wid}"]


def _dataset(n: int = 40):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


# ---- construction: no store, no job ------------------------------------------------------------------------
def test_a_trainer_built_without_a_store_or_job_is_inspectable():
    threads = set(threading.enumerate())
    m, o = _model_opt()
    cfg = TrainerConfig(commit_every=3, connect_timeout=timedelta(seconds=30))
    # nothing listens there: a constructor that connected would block for connect_timeout, then raise
    et = ElasticTrainer(m, o, store_addr=f"127.0.0.1:{_closed_port()}/job", worker_id="w0",
                        policy=BatchPolicy(per_gpu_batch=4), config=cfg, telemetry=Telemetry(profile="mlp"),
                        speed=0.5)
    assert et.phase is Phase.CREATED and et.config is cfg
    assert et.wid == "w0" and et.addr.prefix == "job" and et.speed == 0.5
    assert et.module is m and et.optimizer is o and et.device == torch.device("cpu")
    assert (et.step, et.epoch, et.committed_step, et.warm_up_s) == (0, 0, 0, 0.0)
    assert not et.left and et.switches == [] and et.observations() == []
    assert et.plan is None and et.group is None and et.membership is None and et.loading is None
    assert set(threading.enumerate()) <= threads  # no heartbeat, no store thread
    et.close()  # nothing to release; it stays joinable
    assert et.phase is Phase.CREATED


def test_a_store_addr_object_and_a_device_string_are_taken():
    et = _build(store_addr=StoreAddr("10.0.0.1", 29500, "job7"), device="cpu")
    assert et.addr == StoreAddr("10.0.0.1", 29500, "job7") and et.device == torch.device("cpu")


def test_the_training_api_before_join_raises_a_phase_error():
    et = _build()
    calls = {
        "loader()": lambda: et.loader(_dataset()),  # raises when called, not at the first batch
        "commit()": et.commit,
        "model": lambda: et.model,
        "rank": lambda: et.rank,
        "world_size": lambda: et.world_size,
        "watch_loss()": lambda: et.watch_loss(torch.tensor(1.0)),
        "report_error()": lambda: et.report_error(ValueError("x")),
    }
    for name, call in calls.items():
        expected = f"ElasticTrainer.{name}: worker w0 is created; call join() first"
        with pytest.raises(TrainerPhaseError, match=re.escape(expected)) as info:
            call()
        assert info.value.phase is Phase.CREATED
    assert et.phase is Phase.CREATED


@pytest.mark.parametrize("over, kind, names", [
    ({"model": "resnet"}, TypeError, "ElasticTrainer(model): expected a torch.nn.Module"),
    ({"model": torch.nn.ReLU()}, ValueError, "ElasticTrainer(model): the model has no parameters"),
    ({"optimizer": object()}, TypeError, "ElasticTrainer(optimizer): expected a torch.optim.Optimizer"),
    ({"store_addr": "localhost"}, StoreAddressError, "ElasticTrainer(store_addr='localhost'): expected host:port"),
    ({"store_addr": "host:http/job"}, StoreAddressError, "ElasticTrainer(store_addr='host:http/job')"),
    ({"store_addr": ("127.0.0.1", 29500)}, TypeError, "ElasticTrainer(store_addr): expected a StoreAddr"),
    ({"worker_id": ""}, ValueError, "ElasticTrainer(worker_id=''): expected a non-empty string"),
    ({"worker_id": "a/b"}, ValueError, "ElasticTrainer(worker_id='a/b')"),
    ({"worker_id": "a,b"}, ValueError, "ElasticTrainer(worker_id='a,b')"),
    ({"worker_id": 3}, TypeError, "ElasticTrainer(worker_id=3)"),
    ({"policy": {"per_gpu_batch": 4}}, TypeError, "ElasticTrainer(policy): expected a BatchPolicy"),
    ({"scheduler": object()}, TypeError, "ElasticTrainer(scheduler): expected None or an LR scheduler"),
    ({"device": "gpu0"}, ValueError, "ElasticTrainer(device='gpu0'): not a torch device"),
    ({"config": {"backend": "gloo"}}, TypeError, "ElasticTrainer(config): expected a TrainerConfig"),
    ({"telemetry": object()}, TypeError, "ElasticTrainer(telemetry): expected None or a Telemetry"),
    ({"speed": 0}, ValueError, "ElasticTrainer(speed=0): expected a finite number > 0"),
    ({"speed": -1.5}, ValueError, "ElasticTrainer(speed=-1.5): expected a finite number > 0"),
    ({"speed": math.nan}, ValueError, "ElasticTrainer(speed=nan)"),
    ({"speed": math.inf}, ValueError, "ElasticTrainer(speed=inf)"),
    ({"speed": "fast"}, TypeError, "ElasticTrainer(speed='fast'): expected a positive number"),
    ({"speed": True}, TypeError, "ElasticTrainer(speed=True)"),
    ({"fault": object()}, TypeError, "ElasticTrainer(fault): expected None or an object with a callable maybe_fail"),
    ({"progress": object()}, TypeError, "ElasticTrainer(progress): expected None or an object with a callable report"),
    ({"warm_up": "one_step"}, TypeError, "ElasticTrainer(warm_up): expected None or a callable"),
    ({"extra_state": [1]}, TypeError, "ElasticTrainer(extra_state): expected None or a dict"),
    ({"extra_state": {"scaler": 3}}, TypeError, "ElasticTrainer(extra_state): entry 'scaler'"),
])
def test_a_bad_argument_fails_the_constructor_naming_it(over, kind, names):
    with pytest.raises(kind) as info:
        _build(**over)
    assert names in str(info.value)


def test_a_bad_config_names_its_field_and_good_optional_arguments_pass():
    with pytest.raises(ValueError, match=r"TrainerConfig\.heartbeat_timeout="):
        TrainerConfig(heartbeat_interval=timedelta(seconds=1), heartbeat_timeout=timedelta(seconds=1))
    m, _ = _model_opt()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    et = _build(model=m, optimizer=o, scheduler=torch.optim.lr_scheduler.StepLR(o, 10), speed=2,
                fault=FaultPlan(), warm_up=lambda model: None, extra_state={"scaler": torch.amp.GradScaler("cpu")})
    assert et.phase is Phase.CREATED and et.speed == 2.0


# ---- join() on a real gloo job (a world of one, in this process) --------------------------------------------
def test_join_connects_announces_waits_builds_and_returns_the_trainer(store):
    coord = Coordinator(dist.PrefixStore("job", store))
    et = ElasticTrainer(*_model_opt(), store_addr=f"127.0.0.1:{store.port}/job", worker_id="solo",
                        policy=BatchPolicy(per_gpu_batch=4), config=FAST)
    assert coord.joined() == [] and not _hb_threads("solo")  # built: nothing announced, nothing started
    plan = coord.start(["solo"])
    try:
        assert et.join() is et
        assert et.phase is Phase.JOINING and et.plan == plan
        assert (et.rank, et.world_size) == (0, 1)
        assert coord.joined() == ["solo"] and len(_hb_threads("solo")) == 1
        assert et.model is et.module  # the bare module until the loader receives the state
        with pytest.raises(TrainerPhaseError, match=r"join\(\): worker solo is joining; join\(\) is called once"):
            et.join()
        it = et.loader(_dataset())
        for _ in range(3):
            x, y = next(it)
            torch.nn.functional.mse_loss(et.model(x), y).backward()
            et.optimizer.step()
            et.optimizer.zero_grad()
            assert et.commit()
        assert et.phase is Phase.TRAINING and et.step == 3 and et.committed_step >= 1
        assert [r["kind"] for r in et.switches] == ["initial"]  # the first plan's epoch began
        with pytest.raises(TrainerPhaseError, match="is training"):
            et.join()
    finally:
        et.close()
    assert not _hb_threads("solo")


def test_join_reads_naturally_in_a_with_statement(store):
    Coordinator(dist.PrefixStore("job", store)).start(["solo"])
    with ElasticTrainer(*_model_opt(), store_addr=f"127.0.0.1:{store.port}/job", worker_id="solo",
                        policy=BatchPolicy(per_gpu_batch=4), config=FAST).join() as et:
        steps = 0
        for x, y in et.loader(_dataset(), max_steps=4):
            torch.nn.functional.mse_loss(et.model(x), y).backward()
            et.optimizer.step()
            et.optimizer.zero_grad()
            et.commit()
            steps += 1
        assert steps == 4 and et.step == 4 and et.committed_step == 4
    assert not _hb_threads("solo")


# ---- a join that fails leaves nothing behind ----------------------------------------------------------------
def test_a_join_to_an_unreachable_store_fails_and_leaves_no_thread():
    threads = set(threading.enumerate())
    port = _closed_port()
    cfg = TrainerConfig(connect_timeout=timedelta(seconds=0.5), rendezvous_timeout=timedelta(seconds=1))
    et = _build(store_addr=f"127.0.0.1:{port}/job", worker_id="unreachable", config=cfg)
    with pytest.raises(ProcessGroupError, match=f"cannot reach store 127.0.0.1:{port}"):
        et.join()
    assert et.phase is Phase.FAILED and et.group is None and et.membership is None
    assert set(threading.enumerate()) <= threads
    with pytest.raises(TrainerPhaseError, match="is failed; join\\(\\) is called once.*build a new ElasticTrainer"):
        et.join()
    with pytest.raises(TrainerPhaseError, match="its join\\(\\) failed: build a new ElasticTrainer"):
        et.loader(_dataset())
    et.close()  # nothing to release


def test_a_join_whose_group_cannot_be_built_stops_its_heartbeat(store, monkeypatch):
    from elastic_launcher.epochs import EpochExecutor

    def no_group(self, plan):
        raise ProcessGroupError(f"injected: no group for plan {plan.id}")

    threads = set(threading.enumerate())
    coord = Coordinator(dist.PrefixStore("job", store))
    coord.start(["solo"])
    monkeypatch.setattr(EpochExecutor, "new_group", no_group)
    et = ElasticTrainer(*_model_opt(), store_addr=f"127.0.0.1:{store.port}/job", worker_id="solo",
                        policy=BatchPolicy(per_gpu_batch=4), config=FAST)
    with pytest.raises(ProcessGroupError, match="injected: no group"):
        et.join()
    assert coord.joined() == ["solo"]  # it had announced itself (its heartbeat ran) before the failure
    assert et.phase is Phase.FAILED and et.group is None
    assert not _hb_threads("solo") and set(threading.enumerate()) <= threads


# ---- join() on two gloo processes ------------------------------------------------------------------------------
def _worker(wid: str, port: int, go, out) -> None:
    """One spawned worker: builds its trainer (reports the phase), joins when told, trains 4 steps."""
    torch.set_num_threads(1)
    m, o = _model_opt()
    et = ElasticTrainer(m, o, store_addr=f"127.0.0.1:{port}/job", worker_id=wid,
                        policy=BatchPolicy(per_gpu_batch=4), config=FAST)
    out.put((wid, "built", et.phase.value))
    go.wait()
    try:
        et.join()
        joined = (et.phase.value, et.rank, et.world_size)
        for x, y in et.loader(_dataset(), max_steps=4):
            torch.nn.functional.mse_loss(et.model(x), y).backward()
            o.step()
            o.zero_grad()
            et.commit()
        params = [p.detach().flatten().tolist() for p in m.parameters()]
        out.put((wid, "trained", {"joined": joined, "step": et.step, "params": params}))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((wid, "error", repr(e)))
    finally:
        et.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_processes_build_then_join_one_gloo_group(store):
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    coord = Coordinator(dist.PrefixStore("job", store))
    procs = [ctx.Process(target=_worker, args=(w, store.port, go, out), daemon=True) for w in ("w0", "w1")]
    for p in procs:
        p.start()
    try:
        built = [out.get(timeout=90) for _ in procs]
        assert sorted(built) == [("w0", "built", "created"), ("w1", "built", "created")]
        assert coord.joined() == []  # two trainers exist; neither announced itself
        go.set()
        while coord.joined() != ["w0", "w1"]:  # the launcher's side: post the plan once both are announced
            assert all(p.is_alive() for p in procs), "a worker died before announcing itself"
            time.sleep(0.05)
        coord.start(["w0", "w1"])
        results = {}
        for _ in procs:
            wid, what, payload = out.get(timeout=90)
            assert what == "trained", f"{wid}: {payload}"
            results[wid] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert sorted(r["joined"] for r in results.values()) == [("joining", 0, 2), ("joining", 1, 2)]
    assert results["w0"]["step"] == results["w1"]["step"] == 4
    assert results["w0"]["params"] == results["w1"]["params"]
