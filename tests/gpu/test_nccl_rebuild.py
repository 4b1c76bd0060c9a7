"""NCCL rebuilds in-process (GPU host only): grow N/2->N and shrink N->N/2 (N = min(4, GPUs)).

Same checks as the gloo tests: identical parameters, loss still falling, exact sample accounting, nothing left.
"""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from tests.unit.test_runtime_harness import Cluster, check_accounting, port_closed, read_logs

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

N = min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 4
ALL = [f"w{i}" for i in range(N)]
HALF = ALL[:max(1, N // 2)]


def _check(res: dict, stats: dict, logdir: str) -> None:
    kept = {w: r for w, r in res.items() if not r["left"]}
    ref = next(iter(kept.values()))["params"]
    for w, r in kept.items():
        assert r["params"] == ref, f"{w} parameters differ"
    r0 = res["w0"]
    losses = dict(r0["losses"])
    assert losses[max(losses)] < losses[stats["step"]] < losses[1]
    check_accounting(read_logs(logdir), r0["sampler"])


@pytest.mark.parametrize("start,target", [(HALF, ALL), (ALL, HALF)], ids=["grow", "shrink"])
def test_nccl_resize(tmp_path, start, target):
    cl = Cluster(str(tmp_path), target_world=len(target), cuda=True)
    try:
        cl.coord.start(start)
        cl.spawn(ALL)
        cl.wait_step("w0", 5)
        plan = cl.coord.request_resize(target)
        stats = cl.coord.wait_switched(plan)
        res = cl.results(N)
    finally:
        codes = cl.close()
    assert codes == {w: 0 for w in ALL}
    assert mp.active_children() == [] and port_closed(cl.port)
    assert stats["world"] == len(target)
    _check(res, stats, str(tmp_path))


def test_nccl_sigkill_one_rank_recovers(tmp_path):
    """The last rank SIGKILLs itself mid-backward (its NCCL peers are then stuck in the all-reduce): the
    survivors detect it, abort the broken communicator, rebuild on NCCL without it, roll back to the last
    commit and finish."""
    victim = ALL[-1]
    cl = Cluster(str(tmp_path), target_world=N - 1, fail_at=(victim, N - 1, 8), cuda=True)
    try:
        cl.coord.start(ALL)
        cl.spawn(ALL)
        res = cl.results(N - 1)
    finally:
        codes = cl.close()
    assert codes[victim] == -9 and all(codes[w] == 0 for w in ALL if w != victim)
    assert mp.active_children() == [] and port_closed(cl.port)
    kept = {w: r for w, r in res.items() if w != victim}
    ref = kept["w0"]["params"]
    assert all(r["params"] == ref for r in kept.values())
    rec = [s for s in res["w0"]["switches"] if s["kind"] == "recovery"]
    assert len(rec) == 1 and (rec[0]["old_world"], rec[0]["world"]) == (N, N - 1)
    # rolled back to the last commit point before the failed (9th) batch, at most one commit interval back; on
    # NCCL the host may queue a step or two past the failed one before the watchdog wakes it (4x H200: 7 + 3)
    assert rec[0]["step"] <= 8 and rec[0]["step"] + rec[0]["lost_steps"] >= 9
    assert 1 <= rec[0]["lost_steps"] <= rec[0]["commit_interval"]
    assert rec[0]["recover_s"] < 15  # heartbeat timeout 2 s, collective timeout 20 s
    print(f"NCCL recovery {N}->{N - 1}: {rec[0]['recover_s']:.2f} s, {rec[0]['lost_steps']} steps trained again")
    losses = dict(res["w0"]["losses"])
    assert losses[max(losses)] < losses[rec[0]["step"]] < losses[1]
    check_accounting(read_logs(str(tmp_path)), res["w0"]["sampler"])
