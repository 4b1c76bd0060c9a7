"""The step model's timeline and intervals: when DDP's buckets are ready, what gates a step, and which residuals an
interval reads (predictor/stepmodel.py)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from predictor import stepmodel as sm
from predictor.profiles import Profile, TensorSpec, profile_from_spec


def test_buckets_are_ready_by_the_layers_behind_them_not_by_their_bytes():
    bert = profile_from_spec("bert-base-uncased")
    ready = sm.shares(bert)
    by_bytes = np.cumsum(bert.buckets_bytes) / sum(bert.buckets_bytes)
    assert np.all(np.diff(ready) >= 0) and ready[-1] == 1.0
    # the word embedding (a fifth of the bytes, one tensor) is the last bucket: the encoder's are ready just before
    assert ready[-2] > 0.95 > by_bytes[-2] + 0.15
    # ResNet-50's last stage (most of its bytes, few of its layers) is ready early in the backward
    r50 = profile_from_spec("resnet50")
    assert sm.shares(r50)[2] < 0.25 < np.cumsum(r50.buckets_bytes)[2] / sum(r50.buckets_bytes)


def test_a_bucket_of_many_small_tensors_is_ready_after_all_of_them():
    tensors = tuple(TensorSpec(f"t{i}", n) for i, n in enumerate([1000] * 9 + [9000]))
    p = Profile("m", tensors, (36000, 36000))   # 9 small tensors, then one as large as all of them
    assert list(sm.shares(p)) == [0.9, 1.0]
    assert list(sm.shares(dataclasses.replace(p, tensors=()))) == [0.5, 1.0]   # no tensors: the bytes


def test_the_gate_is_the_longer_path_then_the_larger_part_of_the_device_step():
    t1 = np.array([0.010, 0.010, 0.050, 0.050])
    share = np.tile([0.5, 1.0], (4, 1))
    comm = np.array([[0.001, 0.001], [0.001, 0.001], [0.040, 0.040], [0.005, 0.005]])
    host = np.array([0.020, 0.0, 0.0, 0.0])
    r = sm.simulate(t1, t1, share, comm, np.zeros(4), np.zeros(4), host, np.ones(4, dtype=bool))
    assert list(r["gate"]) == [sm.HOST_GATED, sm.COMPUTE_GATED, sm.LINK_GATED, sm.COMPUTE_GATED]
    one = sm.simulate(t1[:1], t1[:1], share[:1], comm[:1], np.zeros(1), np.zeros(1), host[:1], np.zeros(1, dtype=bool))
    assert list(one["gate"]) == [""]


def test_an_interval_reads_its_gates_residuals_where_there_are_enough():
    wide, narrow = list(np.linspace(-0.3, 0.3, 20)), list(np.linspace(-0.02, 0.02, 20))
    p = sm.Params(residuals={"observed": wide + narrow, f"observed {sm.COMPUTE_GATED}": narrow,
                             f"observed {sm.HOST_GATED}": wide, f"observed {sm.LINK_GATED}": narrow[:3]})
    host, compute, link, pooled = (p.interval("observed", g) for g in (sm.HOST_GATED, sm.COMPUTE_GATED,
                                                                       sm.LINK_GATED, None))
    assert host[1] / host[0] > 1.5 and compute[1] / compute[0] < 1.05
    assert link == pooled                     # three residuals are too few: the basis's pool
    assert math.exp(-0.02) <= compute[0] < 1.0 < compute[1] <= math.exp(0.02)


def _rows(profile: Profile, ladder: sm.Ladder, host_s: float, uid: int) -> list[dict]:
    """Host-gated steps of one owner whose host adds `host_s` a step under DDP."""
    out = []
    for b in ladder.batches:
        t = float(ladder.at(b)[0])
        out += [{"profile": profile.name, "gpu": "G", "layout": [g], "intra_link": "nvlink", "per_gpu_batch": b,
                 "iter_s": max(t, ladder.floor + host_s), "uid": uid} for g in (2, 4)]
    return out


def test_interval_residuals_are_held_out_by_owner():
    # four owners whose DDP host cost differs (0, 10, 20, 30 ms a step): a fit on all of them sits in the middle,
    # and its in-sample residuals are what one constant cannot reach; held out, each owner is also predicted by
    # constants the others set, so the spread is at least as wide
    p = dataclasses.replace(profile_from_spec("resnet50"), name="m")
    lad = sm.Ladder.from_points({16.0: 0.030, 32.0: 0.030, 64.0: 0.031})
    rows = [r for uid, h in enumerate((0.0, 0.010, 0.020, 0.030)) for r in _rows(p, lad, h, uid)]
    coll = sm.Collectives({("nvlink", w): (np.array([1e3, 1e9]), np.array([1e-5, 1e-2])) for w in (2, 4)})
    fitted = sm.fit_params({"m": p}, coll, {("m", "G"): lad}, rows)
    res = np.array(fitted.residuals["observed"])
    assert len(res) == len(rows) and len(fitted.residuals[f"observed {sm.HOST_GATED}"]) >= sm.MIN_RESIDUALS
    single = sm.fit_params({"m": p}, coll, {("m", "G"): lad}, [{**r, "uid": 0} for r in rows])  # one owner: in-sample
    spread = np.quantile(res, 0.9) - np.quantile(res, 0.1)
    in_sample = np.quantile(single.residuals["observed"], 0.9) - np.quantile(single.residuals["observed"], 0.1)
    assert spread >= in_sample > 0.05
    assert sm.OWNER_FOLDS >= 2


@pytest.mark.parametrize("gate", [sm.HOST_GATED, sm.LINK_GATED, sm.COMPUTE_GATED])
def test_params_round_trip_keeps_the_gates_pools(gate):
    p = sm.Params(residuals={f"observed {gate}": [0.1] * 9, "observed": [0.0] * 9})
    assert sm.Params.from_dict(p.to_dict()).interval("observed", gate) == p.interval("observed", gate)


def test_admin_lists_the_interval_of_each_gate_the_fit_pooled():
    from predictor.admin_tables import interval_rows

    wide, narrow = list(np.linspace(-0.3, 0.3, 20)), list(np.linspace(-0.02, 0.02, 20))
    doc = sm.Params(residuals={"observed": wide + narrow, f"observed {sm.HOST_GATED}": wide,
                               f"observed {sm.LINK_GATED}": narrow[:3]}).to_dict()
    rows = {r["basis"]: r for r in interval_rows(doc)}
    host, link = rows[f"observed {sm.HOST_GATED}"], rows[f"observed {sm.LINK_GATED}"]
    assert host["residuals"] == 20 and host["source"] == "held-out residuals" and host["high"] / host["low"] > 1.5
    assert link["source"] == "the basis's residuals" and (link["low"], link["high"]) == (rows["observed"]["low"],
                                                                                      rows["observed"]["high"])
    assert rows["calibrated"]["source"] == "prior spread" and f"calibrated {sm.HOST_GATED}" not in rows
