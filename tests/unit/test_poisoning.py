"""History poisoning (#14.2): one job posting 200 made-up step rows must not move other users' predictions by
more than 10% nor change their plan. Every estimate of the step model is one vote per owner (its user, else its
job): a ladder point and a sweep point are the median of the owners' medians, and the constants' fit weighs each
owner's rows together as one (predictor/stepmodel.py); a job's own measurements answer only its own plans."""
from __future__ import annotations

import numpy as np
import pytest

from predictor import planner
from predictor.cluster import Cluster
from predictor.engine import Predictor
from predictor.profiles import Profile, profile_from_spec
from predictor import stepmodel
from predictor.outliers import job_weights, outlier_report
from tests.unit._service_fakes import PROFILE, FittedModels

PROFILES = {"resnet50": Profile.from_dict(PROFILE)}
CLUSTER = Cluster.default()
PART = CLUSTER.partition()
LAYOUTS = ([1], [2], [4], [4, 4], [4, 4, 4, 4])


def _t(layout) -> float:
    """A workload that scales well across nodes (efficiency from 4 to 16 GPUs about 0.9)."""
    return 0.1 + 0.002 * np.log2(sum(layout)) + 0.006 * (len(layout) > 1) + 0.002 * (len(layout) - 1)


def _row(layout, iter_s, job):
    return {"kind": "step", "profile": "resnet50", "gpu": PART.gpu, "layout": list(layout), "per_gpu_batch": 64,
            "intra_link": PART.intra_link, "inter_link": PART.inter_link, "iter_s": float(iter_s), "job_id": job}


def _history():
    rng = np.random.default_rng(0)
    return [_row(lay, _t(lay) * np.exp(0.02 * rng.standard_normal()), job)
            for job in range(1, 9) for lay in LAYOUTS for _ in range(3)]


ATTACK = [_row(lay, 5 * _t(lay), 999) for lay in ([4, 4], [4, 4, 4, 4]) for _ in range(100)]  # 5x slower
CANDS = [{"layout": [4], "intra_link": PART.intra_link}] + [
    {"layout": lay, "intra_link": PART.intra_link, "inter_link": PART.inter_link} for lay in ([4, 4], [4, 4, 4, 4])]


def _plan(predictor):
    body = {"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=4-16 per_gpu_batch=64"], "job": {}}
    return planner.plan(planner.parse_request(body), CLUSTER, FittedModels(predictor, PROFILES),
                        default_min_efficiency=0.7)


@pytest.mark.parametrize("one_vote", [True, False])
def test_two_hundred_made_up_rows_move_others_by_at_most_ten_percent_and_change_no_plan(one_vote, monkeypatch):
    if not one_vote:   # the mutant: every row its own vote, none weighed by trust (the fit before #14.2)
        monkeypatch.setattr(stepmodel, "_weights", lambda rows: np.ones(len(rows)))
        monkeypatch.setattr(stepmodel, "TRUST_ROUNDS", 0)
    clean = Predictor().fit(PROFILES, _history())
    poisoned = Predictor().fit(PROFILES, _history() + ATTACK)
    before = clean.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    after = poisoned.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    moved = max(abs(a["samples_per_s"] / b["samples_per_s"] - 1) for a, b in zip(after, before))
    same_plan = _plan(clean)["layout"] == _plan(poisoned)["layout"]
    if one_vote:   # the default
        assert moved <= 0.10 and same_plan, (moved, _plan(clean)["layout"], _plan(poisoned)["layout"])
    else:
        assert moved > 0.10, moved


def test_the_attacker_still_sees_its_own_rows():
    poisoned = Predictor().fit(PROFILES, _history() + ATTACK)
    (own,) = poisoned.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS[1:2], job_id=999)
    assert own["basis"].startswith("measured") and own["iter_s"] == pytest.approx(5 * _t([4, 4]))


def test_job_weights_cap_a_job_and_leave_unnamed_rows_whole():
    rows = [{"job_id": 1}] * 40 + [{"job_id": 2}] * 5 + [{}] * 3
    w = job_weights(rows, 20)
    assert w[:40].sum() == pytest.approx(20) and w[40:45].tolist() == [1.0] * 5 and w[45:].tolist() == [1.0] * 3


def test_one_users_jobs_together_weigh_one_cap():
    # #24.1: three jobs of one user (20 rows each, under the per-job cap) weighed 60 rows and moved another
    # user's plan from 4x4 to 1x4; rows carry the signer's uid and the cap is per user
    rows = [{"job_id": j, "uid": 1000} for j in (1, 2, 3) for _ in range(20)] + [{"job_id": 4, "uid": 1001}] * 20
    w = job_weights(rows, 20)
    assert w[:60].sum() == pytest.approx(20) and w[60:].sum() == pytest.approx(20)


THREE_JOBS = [dict(_row(lay, 5 * _t(lay), job), uid=666) for job in (997, 998, 999)
              for lay in ([4, 4], [4, 4, 4, 4]) for _ in range(10)]   # #24.1: three jobs of one user, 20 rows each


def _signed(users: int) -> list[dict]:
    """The eight honest jobs, signed by `users` users (jobs dealt round-robin)."""
    return [dict(r, uid=1001 + (r["job_id"] - 1) % users) for r in _history()]


def _moved(users: int) -> tuple[float, bool]:
    """(largest |change| of another user's predictions, plan unchanged) when THREE_JOBS join `users`' history."""
    clean = Predictor().fit(PROFILES, _signed(users))
    poisoned = Predictor().fit(PROFILES, _signed(users) + THREE_JOBS)
    before = clean.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    after = poisoned.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    return (max(abs(a["samples_per_s"] / b["samples_per_s"] - 1) for a, b in zip(after, before)),
            _plan(clean)["layout"] == _plan(poisoned)["layout"])


@pytest.mark.parametrize("users", [1, 2, 3, 8])
def test_three_jobs_of_one_user_move_others_by_at_most_ten_percent_and_change_no_plan(users):
    # #41.1: with the history of one or two users, one vote per user split the fit between them (-14.7% and
    # -12.4% at one user's history before each owner's vote was weighed by its agreement with the fit)
    moved, same_plan = _moved(users)
    assert moved <= 0.10 and same_plan, moved


def test_without_the_owners_trust_one_honest_users_history_is_outvoted(monkeypatch):
    monkeypatch.setattr(stepmodel, "TRUST_ROUNDS", 0)    # the mutant: one plain vote per user
    assert _moved(1)[0] > 0.10


def _lab_case(users: int) -> tuple[dict, list[dict], list[dict]]:
    """bench/hostile_round3.py's item 1 as the lab's service sees it: ResNet-50's real profile (161 gradient
    tensors: DDP's per-tensor host cost can reach 80 ms, so one attacker pulls a first fit halfway), the seeded
    sweeps, the honest history signed by `users` users, and THREE_JOBS. Returns (profiles, clean rows, poisoned)."""
    profiles = {"resnet50": profile_from_spec("resnet50")}
    sweeps = [{"kind": "collective", "op": "allreduce", "link": link, "world": world, "bytes": size,
               "seconds": 2e-5 + 2 * (world - 1) / world * size / bw}
              for link, bw in (("nvlink", 3e11), ("ib", 2.5e10)) for world in (2, 4, 8)
              for size in (1 << 20, 1 << 24, 1 << 27)]
    clean = sweeps + [dict(r, kind="step") for r in _signed(users)]
    return profiles, clean, clean + [dict(r, iter_s=float(r["iter_s"])) for r in THREE_JOBS]


@pytest.mark.parametrize("users", [1, 2])
def test_the_trust_reaches_its_fixed_point_where_a_first_fit_was_pulled_halfway(users, monkeypatch):
    # the lab's item 1 against one honest user moved the 1-node prediction 7.9% with two fixed refits (the first
    # fit sat at a median 0.54 log from the honest rows); refitting until no weight moves reaches what 50 refits do
    profiles, clean, poisoned = _lab_case(users)

    def moved() -> list[float]:
        a, b = (Predictor().fit(profiles, rows).predict(profiles["resnet50"], PART.gpu, 64, CANDS)
                for rows in (clean, poisoned))
        return [y["samples_per_s"] / x["samples_per_s"] - 1 for x, y in zip(a, b)]

    default = moved()
    monkeypatch.setattr(stepmodel, "TRUST_ROUNDS", 50)
    settled = moved()
    assert max(map(abs, default)) <= 0.10 and np.allclose(default, settled, atol=0.01), (default, settled)


def _own_profile_attack() -> tuple[dict, list[dict]]:
    """THREE_JOBS' claim on a profile of the attacker's own ("junk", registered by it; no one else measured it):
    its 1-GPU rows as the honest ones, 2 and 4 nodes 5x slower. Returns (its profiles, its rows)."""
    junk = {"junk": Profile.from_dict({**PROFILE, "name": "junk"})}
    rows = [dict(_row(lay, float(_t(lay) * (5 if len(lay) > 1 else 1)), job), profile="junk", uid=666)
            for job in (997, 998, 999) for lay in [[1]] * 4 + [[4, 4], [4, 4, 4, 4]] * 8]
    return junk, rows


@pytest.mark.parametrize("trust", [True, False])
def test_made_up_rows_on_an_own_profile_move_one_honest_users_predictions_by_at_most_ten_percent(trust, monkeypatch):
    # an owner judged loosely on a profile no one else measured (OWN_PROFILE_TAU) still weighs a tenth at 5x
    if not trust:     # the mutant: one plain vote per user
        monkeypatch.setattr(stepmodel, "TRUST_ROUNDS", 0)
    junk, attack = _own_profile_attack()
    profiles = {**PROFILES, **junk}
    a, b = (Predictor().fit(profiles, rows).predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
            for rows in (_signed(1), _signed(1) + attack))
    moved = max(abs(y["samples_per_s"] / x["samples_per_s"] - 1) for x, y in zip(a, b))
    assert (moved <= 0.10) if trust else (moved > 0.10), moved


def test_an_owner_is_judged_strictly_where_others_measured_the_same_profile_and_loosely_where_not():
    rows = [{"profile": "p", "gpu": "g", "uid": 1}, {"profile": "p", "gpu": "g", "uid": 2},
            {"profile": "q", "gpu": "g", "uid": 3}]
    trust = stepmodel.owner_trust(rows, np.full(3, stepmodel.OWNER_TAU))
    assert trust[("uid", 1)] == trust[("uid", 2)] == pytest.approx(0.5)
    assert trust[("uid", 3)] == pytest.approx(1 / (1 + (stepmodel.OWNER_TAU / stepmodel.OWN_PROFILE_TAU) ** 2))


class _Rows:
    """The two calls of a Store that the outlier report makes."""

    def __init__(self, rows: list[dict]):
        self.rows = [dict(r, id=i + 1) for i, r in enumerate(rows)]

    def observations(self, kind: str):
        return [r for r in self.rows if r["kind"] == kind]

    def get_profile(self, name: str) -> dict:
        return PROFILE


@pytest.mark.parametrize("users", [1, 2, 8])
def test_the_outlier_report_names_the_attacker_not_the_honest_users(users):
    rows = _signed(users) + THREE_JOBS
    report = outlier_report(_Rows(rows), Predictor().fit(PROFILES, rows))
    assert sorted(j["job_id"] for j in report.jobs) == [997, 998, 999] and {j["uid"] for j in report.jobs} == {666}
    assert {r["job_id"] for r in report.rows} <= {997, 998, 999}


def test_the_fits_document_names_the_user_it_trusts_least():
    model = Predictor().fit(PROFILES, _signed(1) + THREE_JOBS)
    trust = model.to_params()["model"]["trust"]
    assert set(trust) == {"uid:666"} and trust["uid:666"] < 0.1


def test_a_users_own_rows_answer_that_users_plans_and_no_one_elses():
    # #41.1: a user's own signed measurements dominate that user's own predictions
    model = Predictor().fit(PROFILES, _signed(3) + THREE_JOBS)
    cand = CANDS[1:2]
    (own,) = model.predict(PROFILES["resnet50"], PART.gpu, 64, cand, uid=666)
    (other,) = model.predict(PROFILES["resnet50"], PART.gpu, 64, cand, uid=1001)
    assert own["basis"] == "measured (5 rows of this user)" and own["iter_s"] == pytest.approx(5 * _t([4, 4]))
    assert other["basis"].startswith("measured") and other["iter_s"] == pytest.approx(_t([4, 4]), rel=0.05)
    (anyone,) = model.predict(PROFILES["resnet50"], PART.gpu, 64, cand)
    assert anyone["basis"] == "observed" and anyone["iter_s"] == pytest.approx(_t([4, 4]), rel=0.10)
    (reloaded,) = Predictor().load_params(model.to_params(), PROFILES).predict(
        PROFILES["resnet50"], PART.gpu, 64, cand, uid=666)
    assert reloaded == own


def _coll(nbytes: int, seconds: float, job: int, uid: int) -> dict:
    return {"kind": "collective", "op": "allreduce", "link": "ib", "world": 8, "nodes": 2, "bytes": nbytes,
            "seconds": seconds, "job_id": job, "uid": uid}


@pytest.mark.parametrize("one_vote", [True, False])
def test_one_job_flooding_one_link_barely_moves_its_curve(one_vote, monkeypatch):
    # #24.11: 20,480 rows from one job halved the ib bandwidth /admin showed
    if not one_vote:   # the mutant: all rows one pool, each its own vote
        monkeypatch.setattr(stepmodel, "owner_of", lambda row: None)
    sizes = [2 ** k for k in range(16, 28, 2)]
    honest = [_coll(b, 2e-5 + b / 20e9, job, 1000 + job) for job in range(1, 6) for b in sizes for _ in range(3)]
    attack = [_coll(b, 2 * (2e-5 + b / 20e9), 666, 666) for b in sizes for _ in range(20480 // len(sizes))]
    clean = Predictor().fit(PROFILES, _history() + honest)
    poisoned = Predictor().fit(PROFILES, _history() + honest + attack)
    t = [m.params_.collectives.time("ib", 8, [2 ** 26])[0] for m in (clean, poisoned)]
    moved = t[1] / t[0] - 1
    assert (moved <= 0.10) if one_vote else (moved > 0.5), moved


def _many_profiles(n: int, uid: int = 666):
    """`n` profiles of one user, 4 made-up step rows each (#24.2's reproduction, scaled)."""
    profiles = {f"junk{i}": Profile.from_dict({**PROFILE, "name": f"junk{i}"}) for i in range(n)}
    rows = [dict(_row(lay, 0.05 * (1 + i % 7) * _t(lay), 5000 + i), profile=f"junk{i}", uid=uid)
            for i in range(n) for lay in ([1], [2], [4], [4, 4])]
    return profiles, rows


def test_one_users_many_profiles_do_not_grow_the_fit_nor_move_others(monkeypatch):
    # #24.2: a job's 300 profiles (4 rows each) took the joint fit from 0.2 s to 278 s, then LinAlgError; the step
    # model fits constants per link and per GPU type only, so profiles add rows to one vectorised pass, no parameter
    sizes = []
    real = stepmodel.least_squares

    def spy(fun, x0, *args, **kwargs):
        sizes.append(len(x0))
        return real(fun, x0, *args, **kwargs)

    monkeypatch.setattr(stepmodel, "least_squares", spy)
    honest = [dict(r, uid=1000 + r["job_id"]) for r in _history()]
    clean = Predictor().fit(PROFILES, honest)
    extra, junk = _many_profiles(40)
    flooded = Predictor().fit({**PROFILES, **extra}, honest + junk)
    assert sizes[0] > 0 and sizes[1] == sizes[0], sizes
    before = clean.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    after = flooded.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    assert max(abs(a["samples_per_s"] / b["samples_per_s"] - 1) for a, b in zip(after, before)) <= 0.10
    assert all(flooded.known(f"junk{i}", PART.gpu) for i in range(40))


def test_a_numerical_failure_is_a_fit_that_did_not_converge(monkeypatch):
    def broken(*args, **kwargs):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(stepmodel, "least_squares", broken)
    model = Predictor().fit(PROFILES, _history())        # raised before: the fitter then kept no model at all
    assert model.converged_ is False and model.known("resnet50", PART.gpu)
    assert model.params_.host(PART.gpu).basis == "default"      # the no-fit constants stand
