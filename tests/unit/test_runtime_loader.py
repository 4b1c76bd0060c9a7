"""Issue 23: ElasticTrainer loads batches with torch's DataLoader in worker processes, and the elastic sampler stays
exact through resizes and rollbacks (gloo, spawned workers, each with DataLoader workers of its own)."""
from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch

from elastic_launcher.loading import STALE, Basis, Cancellable, Pipeline, StepsAhead, Work
from elastic_launcher.sampler import ElasticSampler
from tests.unit.test_runtime_harness import Cluster, check_accounting, port_closed, read_logs

W = ["w0", "w1", "w2", "w3"]
LOADER = {"num_workers": 2, "prefetch_factor": 2, "persistent_workers": True}


class _Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_loader_workers_deliver_each_sample_once_across_grow_failure_rollback_and_shrink(tmp_path):
    # w0, w1 train with 2 DataLoader workers each; w2, w3 prepare meanwhile; 2 -> 4, w3 is SIGKILLed in a backward
    # pass (-> 3, a recovery rolls back), a local error on w1 rolls everyone back, then 3 -> 1. Every committed
    # batch was loaded in a DataLoader worker, never in the trainer, by the same 2 worker processes all along (none
    # respawned by a resize), and the sample ids the models received (carried by the items) cover each completed
    # epoch exactly once across the ranks (#42: checked on what was delivered, not on the sampler's bookkeeping;
    # the mutant "every rank loads rank 0's slice" fails it).
    cl = Cluster(str(tmp_path), target_world=1, after=10, loader=LOADER, error_at=("w1", 40), commit_every=3,
                 fail_at=("w3", 3, 30))
    try:
        cl.coord.start(W[:2])
        cl.spawn(W)
        cl.wait_joined(W)
        cl.wait_step("w0", 6)
        grown = cl.coord.request_resize(W)
        cl.coord.wait_switched(grown)
        assert cl.coord.current() == grown
        cl.wait_step("w0", 46)
        recovered = cl.coord.current()
        shrunk = cl.coord.request_resize(W[:1])
        stats = cl.coord.wait_switched(shrunk)
        res = cl.results(3)
    finally:
        codes = cl.close()
    assert codes == {"w0": 0, "w1": 0, "w2": 0, "w3": -9}, codes
    assert mp.active_children() == [] and port_closed(cl.port)
    assert recovered.kind == "recovery" and recovered.members == tuple(W[:3])
    assert stats["old_world"] == 3 and stats["world"] == 1
    assert res["w1"]["left"] and res["w2"]["left"] and not res["w0"]["left"]
    entries = read_logs(str(tmp_path))
    assert any(e["step"] == 40 and e["wid"] == "w1" for e in entries)  # trained again after the rollback
    assert any(e["wid"] == "w3" for e in entries)  # the killed rank's committed steps count too
    assert len({e["step"] for e in entries if e["wid"] == "w0"}) == res["w0"]["step"]
    check_accounting(entries, res["w0"]["sampler"])
    for wid in W[:3]:
        mine = [e for e in entries if e["wid"] == wid]
        loaders = {p for e in mine for p in e["loaders"]}
        assert mine and mine[0]["pid"] not in loaders, f"{wid}: a batch was loaded in the training process"
        assert len(loaders) == LOADER["num_workers"], f"{wid}: loaded by {sorted(loaders)} (respawned?)"
    assert res["w0"]["sampler"]["epoch"] >= 1  # the run crossed an epoch boundary


def test_the_loader_refuses_options_the_sampler_owns():
    s = ElasticSampler(10)
    with pytest.raises(ValueError, match="sampler, shuffle: the elastic sampler decides"):
        Pipeline(_Items(), s, lambda step: Basis(0, (2,)), None, {"shuffle": True, "sampler": None})


def _steps(pipe: Pipeline, s: ElasticSampler, basis_of, n: int, start: int = 0) -> list[list[int]]:
    out = []
    for step in range(start, start + n):
        b = basis_of(step)
        got = pipe.get(step, s.epoch, s.pos, b).tolist()
        assert got == (lambda sl: sl.indices or sl.padding)(s.slice_at(s.epoch, s.pos, b.rank, b.batches))
        out.append(got)
        s.advance(b.batches)
    return out


def test_a_projection_that_a_commit_point_did_not_confirm_is_dropped_and_read_again():
    # in one process (num_workers=0 loads when asked; the projection logic is the same): a rollback and a
    # change of rank/batches both yield exactly the sampler's slice
    s = ElasticSampler(len(_Items()), seed=3)
    basis = {"b": Basis(1, (3, 4))}
    pipe = Pipeline(_Items(), s, lambda step: basis["b"], None, {})
    _steps(pipe, s, lambda step: basis["b"], 5)
    s.load_state_dict({"epoch": 0, "pos": 14, "size": 50, "seed": 3})  # rolled back two steps
    _steps(pipe, s, lambda step: basis["b"], 3, start=2)
    basis["b"] = Basis(0, (5,))
    _steps(pipe, s, lambda step: basis["b"], 12, start=5)
    assert s.epoch >= 1
    pipe.close()


def test_steps_ahead_walks_the_sampler_without_moving_it():
    s = ElasticSampler(20, seed=1)
    ahead = StepsAhead(s, lambda step: Basis(1, (4, 4)) if step < 2 else Basis(0, (6,)))
    ahead.reset(0, 0, 0)
    lists = [next(ahead).indices for _ in range(5)]
    assert (s.epoch, s.pos) == (0, 0)
    assert lists[0] == s.slice_at(0, 0, 1, (4, 4)).indices
    assert lists[2] == s.slice_at(0, 16, 0, (6,)).indices and len(lists[2]) == 4  # the epoch's last 4
    assert lists[3] == s.slice_at(1, 0, 0, (6,)).indices  # the next epoch's permutation
    assert [k[:2] for k in ahead.pending] == [(0, 0), (0, 8), (0, 16), (1, 0), (1, 6)]
    assert ahead.walk(0, 0, 0, 3) == (1, 0)


def test_cancelled_work_loads_nothing_more():
    mark = torch.zeros(2, dtype=torch.int64)
    data = Cancellable(_Items(), mark)
    assert data.__getitems__(Work(4, 7, [1, 2])) == [1, 2]
    mark.copy_(torch.tensor([5, 7]))  # work handed out before #5 for step 7 on is stale
    assert data.__getitems__(Work(4, 7, [1, 2])) is STALE
    assert data.__getitems__(Work(4, 6, [1, 2])) == [1, 2]  # an earlier step stays valid
    assert data.__getitems__(Work(5, 9, [3])) == [3]  # handed out after the cancellation
    assert pickle.loads(pickle.dumps(STALE)) is STALE


def test_a_dataset_that_fetches_batches_gets_its_indices_at_once():
    class Batched(_Items):
        def __getitems__(self, indices):
            return [("batched", i) for i in indices]

    mark = torch.zeros(2, dtype=torch.int64)
    data = Cancellable(Batched(), mark)
    assert data.__getitems__(Work(0, 3, [5, 6])) == [("batched", 5), ("batched", 6)]
    mark.copy_(torch.tensor([1, 0]))
    assert data.__getitems__(Work(0, 3, [5, 6])) is STALE


def test_a_newcomer_has_its_loader_workers_and_a_batch_before_it_announces_itself(monkeypatch):
    # ElasticTrainer.prepare_loader(): join() starts the DataLoader's worker processes during warm_up and waits for
    # a batch to come through them before the worker announces itself (Membership.start), so a grow never waits for
    # a newcomer's loader to start. The announcement is stopped here; a join that fails stops the workers.
    from datetime import timedelta

    import torch.distributed as dist

    from elastic_launcher.batch_policy import BatchPolicy
    from elastic_launcher.membership import Membership
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    m = torch.nn.Linear(4, 1)
    warmed_up = []
    et = ElasticTrainer(m, torch.optim.SGD(m.parameters(), lr=0.01), store_addr=f"127.0.0.1:{server.port}/job",
                        worker_id="w9", policy=BatchPolicy(per_gpu_batch=4),
                        config=TrainerConfig(connect_timeout=timedelta(seconds=10)),
                        warm_up=lambda model: warmed_up.append(et.loading._it is not None))
    ds = _Items()
    assert et.prepare_loader(ds, **LOADER) is et
    seen = {}

    def announce(self):
        pipe = et.loading
        seen.update(iterator=pipe._it is not None, warmed=pipe.warmed, held=pipe._held is not None,
                    pending=len(pipe.ahead.pending),
                    alive=[w.is_alive() for w in pipe._it._workers] if pipe._it is not None else [])
        raise RuntimeError("stopped at the announcement")

    monkeypatch.setattr(Membership, "start", announce)
    with pytest.raises(RuntimeError, match="stopped at the announcement"):
        et.join()
    assert warmed_up == [True, True]  # the workers were started before warm_up
    assert seen["iterator"] and seen["alive"] == [True, True]
    assert seen["warmed"] == 1 and seen["held"]  # a batch came through a worker before the announcement
    assert seen["pending"] == LOADER["num_workers"] * LOADER["prefetch_factor"]  # and the next ones are in flight
    assert et.loading._it is None  # the failed join stopped them
    del server


def test_workers_warmed_at_a_guess_are_redirected_to_the_steps_asked_for():
    # a newcomer's loader is warmed before it knows its rank and place; start() then redirects the running
    # workers: every batch is exactly the sampler's slice, loaded by the same worker processes
    s = ElasticSampler(len(_Items()), seed=5)
    basis = {"b": Basis(0, (4,))}
    pipe = Pipeline(_Items(), s, lambda step: basis["b"], None, dict(LOADER))
    pipe.warm(0, 0, 0)
    workers = [w.pid for w in pipe._it._workers]
    basis["b"] = Basis(1, (3, 3))
    s.load_state_dict({"epoch": 0, "pos": 12, "size": 50, "seed": 5})
    pipe.start(7, 0, 12)
    assert pipe.ahead.pending[0] == (0, 12, 1, (3, 3))  # the new steps are asked for already
    _steps(pipe, s, lambda step: basis["b"], 10, start=7)
    assert [w.pid for w in pipe._it._workers] == workers and pipe.resets == 0
    pipe.close()


def test_to_device_finishes_the_next_batch_while_this_one_trains_and_drops_it_if_the_plan_changed():
    # with loader workers, the batch of step s + 1 is handed to to_device before step s's batch is returned; a
    # basis change (a resize at a commit point) drops what was staged: every batch is still exactly the slice
    s = ElasticSampler(len(_Items()), seed=7)
    basis = {"b": Basis(0, (4,))}
    finished: list[list[int]] = []

    def finish(batch):
        finished.append(batch.tolist())
        return batch * 10
    pipe = Pipeline(_Items(), s, lambda step: basis["b"], None, dict(LOADER), to_device=finish)
    for step in range(12):
        if step == 5:
            basis["b"] = Basis(1, (3, 3))   # the plan of step 5 on is not the one step 5 was staged under
        b = basis["b"]
        sl = s.slice_at(s.epoch, s.pos, b.rank, b.batches)
        assert pipe.get(step, s.epoch, s.pos, b).tolist() == [10 * i for i in sl.indices or sl.padding]
        s.advance(b.batches)
        pipe._staged[1].result()   # to_device has run on the next batch already, before it is asked for
        if step != 4:
            nxt = s.slice_at(s.epoch, s.pos, b.rank, b.batches)
            assert finished[-1] == (nxt.indices or nxt.padding)
    assert len(finished) == 12 + 2   # for nothing: the one staged under the plan step 5 did not keep, and step 12
    pipe.close()


def test_a_to_device_error_is_raised_where_the_batch_is_taken():
    s = ElasticSampler(len(_Items()), seed=7)

    def broken(batch):
        raise ValueError("corrupt JPEG in this batch")
    pipe = Pipeline(_Items(), s, lambda step: Basis(0, (4,)), None, dict(LOADER), to_device=broken)
    with pytest.raises(ValueError, match="corrupt JPEG"):
        pipe.get(0, 0, 0, Basis(0, (4,)))
    pipe.close()
