"""#42: no single fault wedges a job. A store error in the heartbeat is retried (the worker stays); a beat that
cannot be written for ``heartbeat_timeout`` ends the worker with a reason; a member that beats but never arrives at
a recovery is fenced out at the arrival deadline and the survivors go on (its node rejoining: test_resize_tick); so
is a state source that hangs in a recovery's or a grow's state round, and a newcomer's wait for its state ends when
the survivors give the round up. Clocks are stepped by the tests (no real-time windows)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.commit_protocol import CommitProtocol, Current
from elastic_launcher.epoch_decisions import Phase
from elastic_launcher.epochs import EpochExecutor, ExecutorSettings, PeerFailureRelay
from elastic_launcher.errors import LeftGroup, ProcessGroupError, RendezvousTimeout
from elastic_launcher.feed import DataFeed
from elastic_launcher.membership import Coordinator, Membership, backoff
from elastic_launcher.peer_watch import BeatClock
from elastic_launcher.process_group import StoreAddr, connect_store
from elastic_launcher.rendezvous_client import RendezvousClient
from elastic_launcher.state import TrainingState
from elastic_launcher.trainer_config import TrainerConfig
from tests.unit.test_runtime_units import store  # noqa: F401 - a fixture


class FlakyStore(dist.Store):
    """A client of the job's store whose writes of beats fail while ``failing`` says so (a count, or True)."""

    def __init__(self, port: int, failing) -> None:
        super().__init__()
        self.base = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        self.failing = failing  # shared list: [n] -> fail the next n beat writes; [True] -> fail every one

    def set(self, key, value):
        if "/hb/" in key and self.failing[0]:
            if self.failing[0] is not True:
                self.failing[0] -= 1
            raise RuntimeError("injected store error (connection reset)")
        return self.base.set(key, value)

    def get(self, key):
        return self.base.get(key)

    def check(self, keys):
        return self.base.check(keys)

    def compare_set(self, key, expected, desired):
        return self.base.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        return self.base.wait(keys) if timeout is None else self.base.wait(keys, timeout)

    def add(self, key, n):
        return self.base.add(key, n)

    def append(self, key, value):
        return self.base.append(key, value)

    def multi_get(self, keys):
        return self.base.multi_get(keys)


def _flaky_member(store, wid: str, failing: list, **kw) -> Membership:
    clients = []  # a Python store must outlive the C++ PrefixStore that wraps it

    def connect() -> FlakyStore:
        clients.append(FlakyStore(store.port, failing))
        return clients[-1]
    return Membership(connect, wid, timeout=timedelta(seconds=5),
                      heartbeat_interval=timedelta(seconds=0.02), heartbeat_timeout=timedelta(seconds=5), **kw)


def _beats_changing(store, wid: str, n: int = 3, within: float = 10.0) -> bool:
    """True when ``wid``'s beat value changes ``n`` times within ``within`` seconds of real time."""
    seen, deadline = [], time.monotonic() + within
    while time.monotonic() < deadline:
        v = store.get(f"elastic/hb/{wid}")
        if not seen or seen[-1] != v:
            seen.append(v)
            if len(seen) > n:
                return True
        time.sleep(0.01)
    return False


def test_the_backoff_doubles_from_an_eighth_of_the_interval_up_to_one():
    assert [backoff(n, 0.8) for n in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.8, 0.8]


def test_one_failed_store_write_and_the_worker_stays(store):
    failing = [0]
    ended = []
    m = _flaky_member(store, "a", failing, on_end=ended.append)
    m.start()
    try:
        assert _beats_changing(store, "a")
        failing[0] = 3  # three beats in a row fail (the client is replaced after two): the beat goes on
        deadline = time.monotonic() + 10
        while failing[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failing[0] == 0
        assert _beats_changing(store, "a"), "the heartbeat stopped after a transient store error"
        assert m.ended is None and ended == []
        assert m._thread is not None and m._thread.is_alive()
    finally:
        m.stop()


def test_a_beat_unwritten_for_heartbeat_timeout_ends_the_worker_with_a_reason(store):
    now = [0.0]
    ended = []
    failing = [0]
    m = _flaky_member(store, "a", failing, on_end=ended.append, clock=lambda: now[0])
    m.start()
    failing[0] = True  # from now on every beat fails (the store is unreachable)
    try:
        for _ in range(40):  # 0.2 s of the worker's clock a round: under 5 s, it keeps trying
            now[0] += 0.1
            time.sleep(0.01)
        assert ended == [] and m._thread.is_alive(), "gave up before heartbeat_timeout"
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            now[0] += 0.5
            time.sleep(0.01)
        assert len(ended) == 1 and m.ended == ended[0]
        assert "heartbeat not written for" in ended[0] and "heartbeat_timeout 5 s" in ended[0]
        assert "injected store error" in ended[0]
        m._thread.join(5)
        assert not m._thread.is_alive()
    finally:
        m.stop()


# ---- arrival deadline ------------------------------------------------------------------------------------------
class _Host:
    """A worker's membership on a clock the test steps; its recovery runs on a thread."""

    def __init__(self, store, wid: str, now: list, arrival_s: float = 3.0, factory=None) -> None:
        self.m = Membership(factory or (lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                                              wait_for_workers=False)),
                            wid, timeout=timedelta(seconds=15), heartbeat_interval=timedelta(seconds=0.01),
                            heartbeat_timeout=timedelta(seconds=5))
        self.m.clock = lambda: now[0]
        self.m.beats = BeatClock(clock=lambda: now[0])
        self.m.arrival_timeout = timedelta(seconds=arrival_s)
        self.result: dict = {}

    def recover(self, failed) -> threading.Thread:
        def run():
            try:
                self.result["plan"] = self.m.recover(failed)
            except LeftGroup as e:
                self.result["left"] = e
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.result["error"] = e
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


def _hung_member_fenced(store, now):
    """a, b recover from epoch [a, b, hung]; hung beats all along but never arrives."""
    coord = Coordinator(store)
    failed = coord.start(["a", "b", "hung"])
    hosts = {w: _Host(store, w, now) for w in ("a", "b", "hung")}
    for h in hosts.values():
        h.m.start()
    threads = [hosts[w].recover(failed) for w in ("a", "b")]
    return coord, failed, hosts, threads


def test_a_hung_but_beating_member_is_fenced_at_the_arrival_deadline(store):
    now = [0.0]
    coord, failed, hosts, threads = _hung_member_fenced(store, now)
    try:
        for t in range(1, 12):  # up to 2.75 s of the observers' clocks: hung is still waited for
            now[0] = t * 0.25
            time.sleep(0.02)
        assert all(t.is_alive() for t in threads), "decided before the arrival deadline"
        # past the 3 s arrival deadline, short of the 5 s heartbeat timeout, and held there: the observers must
        # decide on the deadline alone (stepping the clock on while they decide made the bound depend on how fast
        # the host ran their threads: under two pytest workers it passed 5 s)
        now[0] = 3.5
        for t in threads:
            t.join(10)
        plans = {w: hosts[w].result.get("plan") for w in ("a", "b")}
        assert plans["a"] is not None and plans["a"].members == ("a", "b"), {w: h.result for w, h in hosts.items()}
        assert plans["a"] == plans["b"] and now[0] == 3.5  # by the deadline, not by heartbeat_timeout
        # the hung member comes back to the recovery: it was fenced out, and leaves
        with pytest.raises(LeftGroup, match="was recovered without it"):
            hosts["hung"].m.recover(failed)
    finally:
        for h in hosts.values():
            h.m.stop()


# ---- the trainer ends cleanly when its beat cannot be written --------------------------------------------------
def test_a_trainer_whose_heartbeat_gave_up_leaves_at_its_next_commit_with_the_reason(store):
    import torch
    from elastic_launcher.batch_policy import BatchPolicy
    from elastic_launcher.epoch_decisions import Phase
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    cfg = TrainerConfig(timeout=timedelta(seconds=10), connect_timeout=timedelta(seconds=10),
                        rendezvous_timeout=timedelta(seconds=10), commit_every=2)
    Coordinator(dist.PrefixStore("job", store)).start(["solo"])
    et = ElasticTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                        store_addr=f"127.0.0.1:{store.port}/job", worker_id="solo",
                        policy=BatchPolicy(per_gpu_batch=4), config=cfg).join()
    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    try:
        it = et.loader(data)
        x, y = next(it)
        torch.nn.functional.mse_loss(et.model(x), y).backward()
        assert et.commit() and et.end_reason is None
        et.membership.on_end("worker solo: heartbeat not written for 5.0 s")  # what the heartbeat thread calls
        x, y = next(it)
        torch.nn.functional.mse_loss(et.model(x), y).backward()
        assert et.commit() is False
        assert et.left and et.phase is Phase.LEFT and "heartbeat not written" in et.end_reason
        assert list(it) == []  # the loader ends: the training loop stops
    finally:
        et.close()


# ---- the recovery's state round has the arrival deadline too ---------------------------------------------------
class _Stuck:
    """A user's extra state whose ``state_dict`` hangs once ``hang`` is set (a slow file system), until ``go``."""

    def __init__(self) -> None:
        self.hang, self.entered, self.go = threading.Event(), threading.Event(), threading.Event()

    def state_dict(self) -> dict:
        if self.hang.is_set():
            self.entered.set()
            self.go.wait(30)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _executor(store, wid: str, now: list, extras: dict):
    """A worker's executor on the test's clock: a real membership, gloo groups, a one-layer model at step 4."""
    addr = StoreAddr("127.0.0.1", store.port, "job")
    host = _Host(store, wid, now, factory=lambda: connect_store(addr, timedelta(seconds=10)))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(model, opt, extras=extras)
    state.counters.update(step=4, lr_factor=1.0)
    state.snapshot()  # the last commit point: the recovery rolls back to it
    kv = connect_store(addr.with_prefix(keys.state_channel(addr.prefix)), timedelta(seconds=10))
    kv.set(keys.speed(wid), "1.0")
    settings = ExecutorSettings("gloo", timedelta(seconds=1), timedelta(seconds=10), timedelta(seconds=60), 25.0)
    ex = EpochExecutor(settings, wid=wid, addr=addr, store=kv, membership=host.m, state=state, module=model,
                       optimizer=opt, scheduler=None, policy=BatchPolicy(per_gpu_batch=4), device=torch.device("cpu"),
                       telemetry=None, fault=None, relay=PeerFailureRelay())
    return host, ex


def test_a_state_source_hung_before_posting_the_skeleton_is_fenced_at_the_rounds_deadline(store):
    # #42: a, b recover from [a, b, gone] (gone never beats) into [a, b]; its group is built, and a, the state
    # source (rank 0, the newest commit), hangs in its user's extra state before it posts the state skeleton, beating
    # all along. b gives the skeleton up at the round's arrival deadline (3 s of the observers' clock from the round's
    # start), recovers from [a, b] without a (never arrived: fenced) and trains alone; a, back, is out. Before, b
    # waited for the skeleton until rendezvous_timeout (60 s here), so it was still waiting when the clock was past
    # every deadline.
    now = [0.0]
    coord = Coordinator(dist.PrefixStore("job", store))
    failed = coord.start(["a", "b", "gone"])
    stuck = _Stuck()
    (ha, ea), (hb, eb) = _executor(store, "a", now, {"user": stuck}), _executor(store, "b", now, {})
    results: dict = {}

    def recover(wid, ex):
        try:
            results[wid] = ex.recover(failed, None, RuntimeError("gone died"), False, 0, 1, lambda: 4)[0].plan
        except Exception as e:  # noqa: BLE001 - asserted below
            results[wid] = e

    stuck.hang.set()  # from now on: a's state snapshot so far is taken (its last commit point)
    ha.m.start()
    hb.m.start()
    threads = {w: threading.Thread(target=recover, args=(w, ex), daemon=True) for w, ex in (("a", ea), ("b", eb))}
    try:
        for t in threads.values():
            t.start()
        limit = time.monotonic() + 20
        while coord.record().epoch.kind != "recovery" and time.monotonic() < limit:
            now[0] += 0.25  # gone is judged dead (late, then silent); a and b beat and arrive
            time.sleep(0.02)
        plan = coord.record().epoch
        assert plan.members == ("a", "b"), plan
        # the clock stands still while the group of [a, b] is built (no round deadline passes)
        assert stuck.entered.wait(20), f"a never became the state source: {results}"
        while threads["b"].is_alive() and time.monotonic() < limit:
            now[0] += 0.25  # a beats on, but its skeleton never comes
            time.sleep(0.02)
        assert not threads["b"].is_alive(), "b still waits for the hung source's state skeleton"
        assert results["b"].members == ("b",) and coord.record().epoch.members == ("b",), results
        assert eb.state.counters["step"] == 4  # rolled back to its own last commit, the only one left
    finally:
        stuck.go.set()
        for t in threads.values():
            t.join(30)
        ha.m.stop()
        hb.m.stop()
    assert isinstance(results["a"], LeftGroup) and "recovered without it" in str(results["a"]), results["a"]


# ---- a grow's switch and its newcomer's wait have the arrival deadline too -------------------------------------
class _Group:
    """A stand-in for a plan's group in which no collective completes (the others gave the round up): its rank and
    size; a broadcast fails; abort does nothing."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def abort(self) -> None:
        pass

    def broadcast(self, tensors, src):
        raise ProcessGroupError("stand-in group: the others gave the round up")


def _grow(store, now: list, extras_a: dict):
    """[a, b] trains, a grow to [a, b, c] is posted and a and b have read it (their heartbeat threads); c, the
    newcomer, beats. Returns the coordinator, both plans and each worker's (host, executor)."""
    coord = Coordinator(dist.PrefixStore("job", store))
    old = coord.start(["a", "b"])
    workers = {w: _executor(store, w, now, extras_a if w == "a" else {}) for w in "abc"}
    for w, (host, _) in workers.items():
        if w != "c":
            host.m.watch(old)
        host.m.start()
    grow = coord.request_resize(["a", "b", "c"])
    limit = time.monotonic() + 20
    while any(workers[w][0].m.next_plan() != grow for w in "ab") and time.monotonic() < limit:
        time.sleep(0.01)
    assert all(workers[w][0].m.next_plan() == grow for w in "ab"), "the survivors never read the posted grow"
    return coord, old, grow, workers


def _run(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def _step_until(now: list, done, limit_s: float = 20.0) -> None:
    """Steps the test's clock by 0.25 s every 20 ms of real time until ``done()`` (or ``limit_s`` real seconds:
    a third of the rendezvous_timeout of 60 s the waits had before)."""
    limit = time.monotonic() + limit_s
    while not done() and time.monotonic() < limit:
        now[0] += 0.25
        time.sleep(0.02)


def test_a_state_source_hung_in_a_grows_switch_is_fenced_at_the_switchs_arrival_deadline(store):
    # #42: [a, b] switch to [a, b, c] at a commit point; a, the state source (first survivor), hangs in its user's
    # extra state before it posts the state skeleton, beating all along. b gives the switch's round up at its arrival
    # deadline (3 s of the observers' clock from the vote), recovers from [a, b, c] as CommitProtocol does after a
    # failed switch, and trains alone: a never arrived (fenced), nor did c, whose wait ended as b's recovery began. Before,
    # b and c waited for the skeleton until rendezvous_timeout (60 s here), still waiting once the clock was past
    # every deadline.
    now = [0.0]
    stuck = _Stuck()
    coord, old, grow, workers = _grow(store, now, {"user": stuck})
    results: dict = {}

    def survivor(w: str) -> None:
        ex, new = workers[w][1], _Group(grow.rank_of(w), 3)
        try:
            ex.switch(old, _Group(old.rank_of(w), 2), new, 0.0, lambda: 4)
            results[w] = "switched"
        except RuntimeError as e:  # CommitProtocol._apply: a failed switch recovers from the new plan
            try:
                results[w] = ex.recover(grow, new, e, False, 0, 1, lambda: 4)
            except Exception as e2:  # noqa: BLE001 - asserted below
                results[w] = e2

    def newcomer() -> None:
        try:
            workers["c"][1].join(grow, _Group(2, 3), lambda: 0)
            results["c"] = "joined"
        except Exception as e:  # noqa: BLE001 - asserted below
            results["c"] = e

    stuck.hang.set()
    threads = {"a": _run(survivor, "a"), "b": _run(survivor, "b"), "c": _run(newcomer)}
    try:
        assert stuck.entered.wait(20), f"a never became the state source: {results}"
        _step_until(now, lambda: not threads["b"].is_alive() and not threads["c"].is_alive())
        assert not threads["b"].is_alive(), "b still waits for the hung source's state skeleton"
        epoch, rec = results["b"]
        assert epoch.plan.members == ("b",) and coord.record().epoch.members == ("b",), results
        assert "arrival deadline" in rec["error"], rec  # the switch's round, given up at its deadline
        assert workers["b"][1].state.counters["step"] == 4  # the switch's commit point
        assert isinstance(results["c"], RendezvousTimeout) and "given up by another survivor" in str(results["c"]), \
            results["c"]
    finally:
        stuck.go.set()
        for t in threads.values():
            t.join(30)
        for host, _ in workers.values():
            host.m.stop()
    assert isinstance(results["a"], LeftGroup) and "recovered without it" in str(results["a"]), results["a"]


def test_a_newcomers_waits_end_when_the_survivors_recover_without_the_switch(store):
    # #42: c, the newcomer of the grow [a, b] -> [a, b, c], waits for where its epoch starts (rank 0 publishes it when
    # it arms the switch) and then for its state; a hung (beating) before that commit point, so b's vote timed out and
    # b recovers from [a, b] (the switch never happened: the recovery drops the pending grow), fencing a at the
    # recovery's arrival deadline. c's waits end as b's recovery begins ("given up by another survivor"; it never
    # trained, so it ends, and the grow is asked for again). Before, c waited rendezvous_timeout (60 s here) for
    # each: a start and a state skeleton that never come.
    now = [0.0]
    coord, old, grow, workers = _grow(store, now, {})
    ex = workers["c"][1]
    # c's commit protocol as join() left it (its group built), entered by its loader's first call (enter_joined)
    config = TrainerConfig(rendezvous_timeout=timedelta(seconds=60))
    current = Current(phase=Phase.JOINING, plan=grow, group=_Group(2, 3))
    rdzv = RendezvousClient(StoreAddr("127.0.0.1", store.port, "job"), "c", config, current)
    rdzv.store = ex.store  # connected: the state channel
    protocol = CommitProtocol(config, ex.state, current, rdzv, DataFeed(0, BatchPolicy(per_gpu_batch=4), ex.state,
                                                                        current), torch.device("cpu"), "c")
    protocol.executor = ex
    results: dict = {}

    def survivor() -> None:
        try:
            results["b"] = workers["b"][1].recover(old, _Group(1, 2), RuntimeError("vote timed out"), False, 0, 1,
                                                   lambda: 4)
        except Exception as e:  # noqa: BLE001 - asserted below
            results["b"] = e

    def newcomer() -> None:
        try:
            protocol.enter_joined(None, {})  # waits for the epoch's start (no loader: nothing else), then its state
            results["c"] = "joined"
        except Exception as e:  # noqa: BLE001 - asserted below
            results["c"] = e

    threads = {"b": _run(survivor), "c": _run(newcomer)}
    try:
        _step_until(now, lambda: not any(t.is_alive() for t in threads.values()))
        assert not threads["c"].is_alive(), "c still waits for a switch that will not come"
        assert isinstance(results["c"], RendezvousTimeout) and "given up by another survivor" in str(results["c"]), \
            results["c"]
        assert results["b"][0].plan.members == ("b",) and coord.record().pending is None, results
    finally:
        for t in threads.values():
            t.join(30)
        for host, _ in workers.values():
            host.m.stop()
