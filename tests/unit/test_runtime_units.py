"""Unit tests of the elastic runtime's parts (single process; a one-rank gloo group where a group is needed)."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_launcher.batch_policy import BatchPolicy, split_batch
from elastic_launcher.epoch_decisions import Phase
from elastic_launcher.errors import (InvalidPlan, NotConfiguredError, RendezvousTimeout, ResizeConflict,
                                     StateMismatch, StoreAddressError, TooManyFailures)
from elastic_launcher.membership import Coordinator, Membership, Plan
from elastic_launcher.rendezvous_state import RecordStore
from elastic_launcher.process_group import (ProcessGroupWrapper, StoreAddr, drain_reaper, release_retired,
                                            retired_groups)
from elastic_launcher.sampler import ElasticSampler
from elastic_launcher.state import TrainingState
from elastic_launcher.telemetry import Telemetry, tensor_profile
from elastic_launcher.testing import FakeProcessGroupWrapper, FaultPlan, InjectedFault


# ---- sampler -------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 200), seed=st.integers(0, 5),
       worlds=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 9)), min_size=1, max_size=12))
def test_sampler_sees_each_sample_once_per_epoch_across_resizes(size, seed, worlds):
    s = ElasticSampler(size, seed=seed)
    seen: dict[int, list[int]] = {}
    for world, per_rank in worlds * 3:  # resize every step, through several epochs
        batches = [per_rank + (r % 2) for r in range(world)]  # heterogeneous
        ep = s.epoch
        for r in range(world):
            sl = s.slice_for(r, batches)
            assert sl.step_total == len(sl.indices) + sum(len(s.slice_for(q, batches).indices)
                                                          for q in range(world) if q != r)
            seen.setdefault(ep, []).extend(sl.indices)
            assert (not sl.indices) == bool(sl.padding)
        s.advance(batches)
    for ep, idx in seen.items():
        assert len(idx) == len(set(idx)), f"epoch {ep} saw a sample twice"
        if ep < s.epoch:
            assert sorted(idx) == list(range(size)), f"epoch {ep} skipped samples"
        else:
            assert len(idx) == s.pos


def test_sampler_state_roundtrip_and_size_check():
    s = ElasticSampler(10, seed=3)
    s.advance([2, 2])
    t = ElasticSampler(10, seed=0)
    t.load_state_dict(s.state_dict())
    assert t.slice_for(1, [3, 3]).indices == s.slice_for(1, [3, 3]).indices
    with pytest.raises(ValueError, match="10 samples loaded into one of 11"):
        ElasticSampler(11).load_state_dict(s.state_dict())


# ---- batch policy --------------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(g=st.integers(1, 5000), speeds=st.lists(st.floats(0.1, 100.0), min_size=1, max_size=16))
def test_split_batch_invariants(g, speeds):
    if g < len(speeds):
        with pytest.raises(ValueError):
            split_batch(g, speeds)
        return
    out = split_batch(g, speeds)
    assert sum(out) == g and min(out) >= 1
    for i in range(len(speeds)):  # a faster rank never gets fewer samples than a slower one
        for j in range(len(speeds)):
            if speeds[i] > speeds[j]:
                assert out[i] >= out[j]


def test_heterogeneous_split_balances_compute_time():
    out = split_batch(120, [3.0, 1.0])  # rank 0 three times as fast
    assert out == [90, 30]


def test_policy_modes_and_lr_scaling():
    keep = BatchPolicy(per_gpu_batch=64, max_global_batch=192)
    assert [keep.global_for(w) for w in (1, 2, 4)] == [64, 128, 192]
    assert keep.split(4) == [48, 48, 48, 48]
    glob = BatchPolicy(mode="keep_global", global_batch=256)
    assert glob.split(3) == [86, 85, 85]
    assert BatchPolicy(lr_scaling="sqrt").lr_factor(256, 64) == pytest.approx(2.0)
    assert BatchPolicy(lr_scaling="linear").lr_factor(256, 64) == pytest.approx(4.0)
    assert BatchPolicy(lr_scaling="none").lr_factor(256, 64) == 1.0
    with pytest.raises(ValueError, match="keep_global needs global_batch"):
        BatchPolicy(mode="keep_global")
    with pytest.raises(ValueError, match="lr_scaling 'cube'"):
        BatchPolicy(lr_scaling="cube")


# ---- membership ----------------------------------------------------------------------------------------------
@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server
    del server


def _member(store, wid, **kw):
    return Membership(lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False),
                      wid, timeout=timedelta(seconds=2), heartbeat_interval=timedelta(seconds=0.02), **kw)


def test_plan_chain_resize_and_conflict(store):
    coord = Coordinator(store, timeout=timedelta(seconds=2))
    first = coord.start(["a", "b"])
    assert coord.current() == first and first.rank_of("b") == 1 and first.rank_of("z") == -1
    newcomer = _member(store, "c")
    plan = coord.request_resize(["a", "b", "c"])
    assert newcomer.wait_for_plan() == plan and plan.prev == first.id and plan.kind == "resize"
    with pytest.raises(ResizeConflict, match=f"epoch {first.id} already has successor plan {plan.id}"):
        coord.request_resize(["a"], base=first)
    with pytest.raises(InvalidPlan, match="duplicate"):
        coord.request_resize(["a", "a"])
    with pytest.raises(InvalidPlan, match="keeps no member"):
        coord.request_resize(["x", "y"])
    with pytest.raises(RendezvousTimeout, match="no plan includes it"):
        _member(store, "nobody").wait_for_plan(timeout=timedelta(seconds=0.2))
    assert Plan.from_json(plan.to_json()) == plan


def test_poll_thread_sees_next_plan_and_heartbeats(store):
    coord = Coordinator(store, timeout=timedelta(seconds=2), heartbeat_timeout=timedelta(seconds=1))
    first = coord.start(["a"])
    m = _member(store, "a")
    m.start()
    try:
        m.watch(first)
        assert m.next_plan() is None
        plan = coord.request_resize(["a", "b"])
        deadline = time.monotonic() + 5
        while m.next_plan() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m.next_plan() == plan
        assert coord.alive(["a", "b"]) == {"a": True, "b": False}
        assert "a" in coord.joined()
    finally:
        m.stop()


def test_recovery_declares_silent_member_dead(store):
    coord = Coordinator(store)
    failed = coord.start(["a", "b", "c"])
    hb = timedelta(seconds=0.3)
    a, b = _member(store, "a", heartbeat_timeout=hb), _member(store, "b", heartbeat_timeout=hb)
    a.start(), b.start()
    store.set("elastic/hb/c", repr(time.time() - 60))  # c stopped beating (unchanged for 0.3 s of a's clock: dead)
    try:
        plan_b = {}
        import threading
        t = threading.Thread(target=lambda: plan_b.setdefault("p", b.recover(failed)))
        t.start()
        plan_a = a.recover(failed)
        t.join(5)
        assert plan_a.members == ("a", "b") and plan_a.kind == "recovery" and plan_b["p"] == plan_a
    finally:
        a.stop(), b.stop()


def test_a_survivor_that_dies_right_after_opening_the_recovery_holds_nobody_up(store):
    # #27: the survivor that won recover/<id>/leader decided alone; if it died then, every other survivor waited
    # the whole rendezvous timeout for its plan and failed. #27.1: there is no leader; whoever opened the recovery
    # in the record and died is judged like any member: it arrived, but its beat never changed after that
    import threading
    coord = Coordinator(store)
    failed = coord.start(["a", "b", "c", "d"])
    store.set("elastic/hb/a", repr(time.time()))                  # a beat, opened the recovery, and died
    RecordStore(store).update(lambda r: r.arrived(failed.id, "a"))
    hb = timedelta(seconds=0.3)
    b, c, d = (_member(store, w, heartbeat_timeout=hb) for w in "bcd")
    for m in (b, c, d):
        m.start()
    try:
        plans = {}
        threads = [threading.Thread(target=lambda m=m: plans.setdefault(m.wid, m.recover(failed))) for m in (c, d)]
        for t in threads:
            t.start()
        plans["b"] = b.recover(failed)
        for t in threads:
            t.join(10)
        assert plans["b"].members == ("b", "c", "d") and plans["b"].kind == "recovery"
        assert plans["c"] == plans["d"] == plans["b"]                 # one plan, whoever wrote it
        rec = coord.record()
        assert rec.epoch == plans["b"] and rec.prev == failed and rec.recovery is None
    finally:
        for m in (b, c, d):
            m.stop()


def test_liveness_is_judged_by_beats_changing_not_by_the_writers_wall_clock(store):
    # #27: the controller judged a worker by comparing its own wall clock with timestamps other hosts wrote
    from elastic_launcher.peer_watch import BeatClock
    now = [0.0]
    coord = Coordinator(store, heartbeat_timeout=timedelta(seconds=5))
    coord.beats = BeatClock(clock=lambda: now[0])
    behind, ahead = time.time() - 30, time.time() + 30
    store.set("elastic/hb/slow", repr(behind))       # alive, its clock 30 s behind
    store.set("elastic/hb/fast", repr(ahead))        # its clock 30 s ahead; it will die
    assert coord.alive(["slow", "fast"]) == {"slow": True, "fast": True}
    for t in range(1, 12):                           # 11 s: slow beats every second, fast no more
        now[0] = float(t)
        store.set("elastic/hb/slow", repr(behind + t))
        seen = coord.alive(["slow", "fast"])
        assert seen["slow"], t                                   # never dead for being 30 s behind
        assert seen["fast"] == (t < 5), t                        # dead 5 s after its last beat, not 35 s


# ---- process group -------------------------------------------------------------------------------------------
def test_store_addr_parse():
    assert StoreAddr.parse("h:1234/job/x") == StoreAddr("h", 1234, "job/x")
    assert str(StoreAddr("h", 1, "p")) == "h:1/p"
    with pytest.raises(StoreAddressError, match="'nohost' is not host:port/prefix"):
        StoreAddr.parse("nohost")


def test_wrapper_configure_collective_abort(store):
    w = ProcessGroupWrapper("gloo", timeout=timedelta(seconds=5), connect_timeout=timedelta(seconds=5))
    with pytest.raises(NotConfiguredError):
        w.allreduce([torch.ones(1)])
    w.configure(f"127.0.0.1:{store.port}/g1", 0, 1)
    t = torch.tensor([3.0])
    w.allreduce([t], dist.ReduceOp.MIN).wait()
    assert t.item() == 3.0 and w.size() == 1 and w.prefix == "g1"
    before = retired_groups()
    w.configure(f"127.0.0.1:{store.port}/g2", 0, 1)  # reconfigure: the old group is retired, not torn down
    assert w.prefix == "g2" and retired_groups() == before + 1
    w.abort()
    w.abort()
    assert not w.configured and drain_reaper(timedelta(seconds=5))
    assert retired_groups() == before + 2
    assert release_retired(timedelta(seconds=10)) and retired_groups() == 0


@pytest.mark.slow  # waits out a real 2 s gloo collective timeout (the retired teardown): 2 s
def test_abort_never_tears_a_gloo_group_down_on_the_caller(store):
    """A peer's group whose other rank is gone (its pending allreduce can only time out): abort returns at once
    and the process's other threads keep running (the teardown would hold the GIL until the timeout)."""
    w = ProcessGroupWrapper("gloo", timeout=timedelta(seconds=2), connect_timeout=timedelta(seconds=5))
    peer = ProcessGroupWrapper("gloo", timeout=timedelta(seconds=2), connect_timeout=timedelta(seconds=5))
    import threading
    t = threading.Thread(target=peer.configure, args=(f"127.0.0.1:{store.port}/g3", 1, 2))
    t.start()
    w.configure(f"127.0.0.1:{store.port}/g3", 0, 2)
    t.join()
    w.allreduce([torch.ones(1)])  # unmatched: the peer never joins it
    ticks: list[float] = []
    stop = threading.Event()
    ticker = threading.Thread(target=lambda: [ticks.append(time.monotonic()) for _ in iter(lambda: stop.wait(0.01), True)])
    ticker.start()
    t0 = time.monotonic()
    w.abort()
    peer.abort()
    took = time.monotonic() - t0
    time.sleep(0.3)
    stop.set()
    ticker.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    # half the collective timeout (2 s): abort did not wait for it, nor hold the GIL until it (the times
    # themselves: bench/unit_timings.py)
    assert took < 1.0 and max(gaps) < 1.0
    assert release_retired(timedelta(seconds=10))


# ---- state ---------------------------------------------------------------------------------------------------
def _model_opt():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    return m, o


def _train_step(m, o):
    m(torch.randn(16, 4)).pow(2).mean().backward()
    o.step()
    o.zero_grad()


@pytest.mark.slow  # a peer that starts 2 s late, then a 1-s collective timeout waited out: about 4 s
def test_a_gloo_group_is_built_under_the_build_timeout_and_then_runs_under_the_collective_one(store):
    """gloo's constructor waits on the store for every peer's address: a peer still starting (a busy host) is
    waited for up to ``connect_timeout``, not the collective ``timeout``; once built, a collective that a peer
    never joins fails at the collective timeout, not the build's."""
    def wrapper():
        return ProcessGroupWrapper("gloo", timeout=timedelta(seconds=1), connect_timeout=timedelta(seconds=30))
    w, peer = wrapper(), wrapper()
    import threading
    late = threading.Thread(target=lambda: (time.sleep(2.0), peer.configure(f"127.0.0.1:{store.port}/g4", 1, 2)))
    late.start()
    w.configure(f"127.0.0.1:{store.port}/g4", 0, 2)   # before: "wait timeout after 1000ms" on the peer's key
    late.join()
    t = torch.ones(1)
    work = w.allreduce([t])                           # unmatched: the peer never joins it
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        work.wait()
    # the collective timeout (1 s), not the build's 30 s: a wide margin for a busy host
    assert time.monotonic() - t0 < 15
    w.abort()
    peer.abort()
    assert release_retired(timedelta(seconds=10))


def test_snapshot_restore_roundtrip():
    m, o = _model_opt()
    s = ElasticSampler(100)
    st_ = TrainingState(m, o, None, s)
    with pytest.raises(StateMismatch, match="before the first commit"):
        st_.restore()
    _train_step(m, o)
    s.advance([4, 4])
    st_.counters["step"] = 1
    st_.snapshot()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    ref_opt = o.state_dict()["state"][0]["exp_avg"].clone()
    _train_step(m, o)
    s.advance([4, 4])
    st_.counters["step"] = 2
    st_.restore()
    assert all(torch.equal(ref[k], v) for k, v in m.state_dict().items())
    assert torch.equal(o.state_dict()["state"][0]["exp_avg"], ref_opt)
    assert s.pos == 8 and st_.counters["step"] == 1


def test_broadcast_gives_a_fresh_optimizer_the_senders_state(store):
    m, o = _model_opt()
    _train_step(m, o)
    src = TrainingState(m, o)
    src.counters["step"] = 7
    g = ProcessGroupWrapper("gloo", timeout=timedelta(seconds=5))
    g.configure(f"127.0.0.1:{store.port}/b", 0, 1)
    kv = dist.PrefixStore("state", store)
    n = src.broadcast(g, 0, kv, "k")
    assert n > 0
    m2, o2 = _model_opt()  # no optimizer state yet
    dst = TrainingState(m2, o2)
    flat = dst._receive_buffers(__import__("pickle").loads(kv.get("k")))
    assert len(flat) > 0 and all(not t.requires_grad for t in flat)
    bad = torch.nn.Linear(4, 2)
    with pytest.raises(StateMismatch, match="model tensor"):
        TrainingState(bad, torch.optim.SGD(bad.parameters(), lr=0.1))._receive_buffers(
            __import__("pickle").loads(kv.get("k")))
    g.abort()


# ---- telemetry -----------------------------------------------------------------------------------------------
def test_observation_records_have_design_shapes():
    t = Telemetry(profile="mlp", gpu="H200", intra_link="nvlink")
    t.record_collective(4, 1 << 20, 0.002)
    t.record_collective(4, 1 << 20, 0.004)
    t.record_collective(4, 1 << 20, 0.003)
    t.record_step([4], 64, 0.03)
    recs = t.drain()
    assert recs[0] == {"kind": "collective", "op": "allreduce", "link": "nvlink", "world": 4, "bytes": 1 << 20,
                       "seconds": 0.003, "gpu": "H200"}
    assert recs[1] == {"kind": "step", "profile": "mlp", "gpu": "H200", "layout": [4], "intra_link": "nvlink",
                       "per_gpu_batch": 64, "iter_s": 0.03}
    assert t.drain() == []
    json.dumps(recs)
    prof = tensor_profile(torch.nn.Linear(3, 2), "lin", [32])
    assert prof == {"name": "lin", "tensors": [{"name": "weight", "numel": 6, "dtype": "float32"},
                                               {"name": "bias", "numel": 2, "dtype": "float32"}], "buckets": [32]}


# ---- seams and trainer (world of one) ------------------------------------------------------------------------
def test_fault_plan_and_fake_group():
    f = FaultPlan(mode="raise").fail_at(1, 3)
    f.maybe_fail(1, 2)
    with pytest.raises(InjectedFault, match="rank 1 step 3"):
        f.maybe_fail(1, 3)
    f.maybe_fail(1, 3)  # fires once
    assert f.fired == 1
    g = FakeProcessGroupWrapper()
    with pytest.raises(NotConfiguredError):
        g.allreduce([torch.ones(1)])
    g.configure("x:1/p", 0, 1)
    g.fail_next()
    with pytest.raises(RuntimeError, match="injected"):
        g.allreduce([torch.ones(1)])
    g.allreduce([torch.ones(1)]).wait()


def _trainer(store, model_opt=None, commit_every=None, **kw):
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
    m, o = model_opt or _model_opt()
    cfg = TrainerConfig(timeout=timedelta(seconds=5), connect_timeout=timedelta(seconds=5),
                        rendezvous_timeout=timedelta(seconds=5), max_retries=2, commit_every=commit_every)
    et = ElasticTrainer(m, o, store_addr=f"127.0.0.1:{store.port}/job", worker_id="solo",
                        policy=BatchPolicy(per_gpu_batch=4), config=cfg, telemetry=Telemetry(profile="mlp"), **kw)
    return et.join()


def _one_step(et, it, error=None) -> bool:
    x, y = next(it)
    torch.nn.functional.mse_loss(et.model(x), y).backward()
    et.optimizer.step()
    et.optimizer.zero_grad()
    if error is not None:
        et.report_error(error)
    return et.commit()


def test_trainer_world_of_one_rolls_back_local_errors_to_the_last_commit_point_then_gives_up(store):
    # commit points every 3 steps after the epoch's first step: steps 1, 4, 7, ...
    Coordinator(dist.PrefixStore("job", store)).start(["solo"])
    et = _trainer(store, commit_every=3)
    ds = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    try:
        it = et.loader(ds)
        for _ in range(4):
            assert _one_step(et, it)
        assert et.step == 4 and et.committed_step == 4 and et.sampler.pos == 16
        before = [p.clone() for p in et.module.parameters()]
        assert _one_step(et, it, ValueError("loss is nan"))  # step 5: no commit point, the error waits for one
        assert et.step == 5 and et.committed_step == 4
        assert _one_step(et, it)
        assert _one_step(et, it)  # step 7: voted failed, rolled back to step 4 (at most commit_every steps lost)
        assert et.step == 4 and et.committed_step == 4 and et.sampler.pos == 16
        assert all(torch.equal(a, b) for a, b in zip(before, et.module.parameters()))
        obs = et.observations()
        assert {r["kind"] for r in obs} == {"step"}  # a world of one times no collective: it used no link
        # after a rollback the next step is a commit point again: two more failures in a row end it
        assert _one_step(et, it, ValueError("again")) and et.step == 4
        with pytest.raises(TooManyFailures, match="3 failed commits in a row"):
            _one_step(et, it, ValueError("and again"))
    finally:
        et.close()


def test_warm_up_runs_local_steps_then_puts_the_state_back(store):
    from elastic_launcher.trainer import WARM_UP_STEPS
    Coordinator(dist.PrefixStore("job", store)).start(["solo"])
    m, _ = _model_opt()
    o = torch.optim.Adam(list(m.parameters())[:-1], lr=0.01)  # the last bias trains outside the optimizer
    before = {k: v.clone() for k, v in m.state_dict().items()}  # weights and BatchNorm statistics
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    seen = []

    def step(model):
        torch.nn.functional.mse_loss(model(x), y).backward()
        o.step()
        o.zero_grad()
        seen.append((model, any(not torch.equal(before[k], v) for k, v in model.state_dict().items())))

    et = _trainer(store, model_opt=(m, o), warm_up=step)
    try:
        assert WARM_UP_STEPS == 2 and et.warm_up_s > 0
        assert [model is m for model, _ in seen] == [True, True]  # the bare model, before any DDP wrap
        assert all(changed for _, changed in seen)  # the steps really trained...
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # ...and left no trace
        assert o.state_dict()["state"] == {} and all(p.grad is None for p in m.parameters())
        assert et.state.last_snapshot is None or et.state.last_snapshot.counters["step"] == 0
        ds = torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
        next(et.loader(ds))
        assert et.step == 0
    finally:
        et.close()


def test_a_failing_warm_up_step_fails_join_before_the_worker_announces_itself(store):
    import threading
    coord = Coordinator(dist.PrefixStore("job", store))
    coord.start(["solo"])
    m, o = _model_opt()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(4, 4)

    def step(model):
        model(x).sum().backward()
        o.step()
        raise FloatingPointError("loss is nan in the warm-up batch")

    with pytest.raises(FloatingPointError, match="warm-up batch"):
        _trainer(store, model_opt=(m, o), warm_up=step)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert "solo" not in coord.joined()  # the launcher never counted on it
    assert not [t for t in threading.enumerate() if t.name == "elastic-hb-solo"]


def test_a_join_that_gets_no_plan_leaves_no_heartbeat(store):
    import threading
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
    m, o = _model_opt()  # no coordinator posts a plan
    cfg = TrainerConfig(connect_timeout=timedelta(seconds=5), rendezvous_timeout=timedelta(seconds=0.5))
    et = ElasticTrainer(m, o, store_addr=f"127.0.0.1:{store.port}/job", worker_id="lonely",
                        policy=BatchPolicy(per_gpu_batch=4), config=cfg)
    with pytest.raises(RendezvousTimeout):
        et.join()  # announced (its heartbeat ran), then no plan came
    assert et.phase is Phase.FAILED and et.group is None
    assert not [t for t in threading.enumerate() if t.name == "elastic-hb-lonely"]


def test_the_end_of_training_is_a_commit_point_and_a_late_nan_is_rolled_back(store):
    # commit points every 4 steps (1, 5, 9, ...); training ends at step 7, between two of them
    Coordinator(dist.PrefixStore("job", store)).start(["solo"])
    et = _trainer(store, commit_every=4)
    ds = torch.utils.data.TensorDataset(torch.randn(80, 4), torch.randn(80, 1))
    seen = []
    try:
        for x, y in et.loader(ds, max_steps=7):
            loss = torch.nn.functional.mse_loss(et.model(x), y)
            if et.step == 6 and 6 not in seen:  # once: a NaN in the last steps before the end
                loss = loss * float("nan")
            seen.append(et.step)
            et.watch_loss(loss)
            loss.backward()
            et.optimizer.step()
            et.optimizer.zero_grad()
            assert et.commit()
        # the end voted: the NaN rolled back to step 5, steps 5 and 6 were trained again, then the end committed
        assert seen == [0, 1, 2, 3, 4, 5, 6, 5, 6] and et.step == 7 and et.committed_step == 7
        assert all(torch.isfinite(p).all() for p in et.module.parameters())
    finally:
        et.close()
