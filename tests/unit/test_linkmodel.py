"""Per-link collective model: alpha-beta invariants on seeded data, priors, sklearn conformance (documented subset)."""
import warnings

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from predictor.errors import ValidationError
from predictor.linkmodel import LinkModel, link_prior

# Generic checks feed random numeric matrices of any width; ours takes (link, op, participants, bytes)
# rows with participants >= 1 and bytes >= 0, so the checks that need arbitrary numeric features are expected
# to fail. Everything about the estimator API itself (params, clone, init, fitted state) is checked.
_NEEDS_ARBITRARY_NUMERIC_X = {name: "X must be (link, op, participants, bytes) rows" for name in """
check_complex_data check_dict_unchanged check_dont_overwrite_parameters check_dtype_object
check_estimator_sparse_array check_estimator_sparse_matrix check_estimator_sparse_tag check_estimators_dtypes
check_estimators_empty_data_messages check_estimators_fit_returns_self check_estimators_nan_inf
check_estimators_overwrite_params check_estimators_pickle check_f_contiguous_array_estimator check_fit2d_1feature
check_fit2d_1sample check_fit2d_predict1d check_fit_check_is_fitted check_fit_idempotent check_fit_score_takes_y
check_methods_sample_order_invariance check_methods_subset_invariance check_n_features_in
check_n_features_in_after_fitting check_pipeline_consistency check_positive_only_tag_during_fit
check_readonly_memmap_input check_regressor_data_not_an_array check_regressors_int
check_regressors_no_decision_function check_regressors_train check_requires_y_none check_supervised_y_2d
""".split()}


_API_CHECKS = {"check_no_attributes_set_in_init", "check_parameters_default_constructible",
               "check_get_params_invariance", "check_set_params", "check_estimators_unfitted"}


def test_sklearn_api_checks_pass():
    """sklearn's own checks: every check outside the numeric-X list passes, the API ones included."""
    from sklearn.utils.estimator_checks import check_estimator  # 0.5 s of imports (sklearn.datasets, ...): here only

    with warnings.catch_warnings():  # sklearn warns for each expected failure and for skipped array-api input
        warnings.simplefilter("ignore")
        results = check_estimator(LinkModel(), expected_failed_checks=_NEEDS_ARBITRARY_NUMERIC_X, on_fail=None)
    failed = [r["check_name"] for r in results if r["status"] == "failed"]
    passed = {r["check_name"] for r in results if r["status"] == "passed"}
    assert not failed, failed
    assert _API_CHECKS <= passed, _API_CHECKS - passed


TRUE = {"nvlink": (1e-5, 120e9), "ethernet": (6e-5, 2e9), "mystery": (2e-4, 4e8)}


def _data(seed=0, n=60, links=("nvlink", "ethernet"), noise=0.03):
    rng = np.random.default_rng(seed)
    X, y = [], []
    for _ in range(n):
        link = links[rng.integers(len(links))]
        p, b = int(rng.choice([2, 4, 8])), float(10 ** rng.uniform(3, 9))
        a, bw = TRUE[link]
        X.append((link, "allreduce", p, b))
        y.append((2 * (p - 1) * a + 2 * (p - 1) / p * b / bw) * np.exp(noise * rng.standard_normal()))
    return X, np.array(y)


def test_fit_returns_self_and_recovers_rows():
    X, y = _data()
    m = LinkModel()
    assert m.fit(X, y) is m
    rel = np.abs(m.predict(X) / y - 1)
    assert np.median(rel) < 0.1


@pytest.mark.parametrize("seed", range(4))
def test_more_bytes_never_faster_more_participants_never_less(seed):
    X, y = _data(seed)
    m = LinkModel().fit(X, y)
    sizes = np.logspace(0, 11, 40)
    for link in ("nvlink", "ethernet", "never-seen"):
        prev_p = None
        for p in (2, 3, 4, 8, 16, 64, 512):
            t = m.time(link, "allreduce", p, sizes)
            assert np.all(np.diff(t) >= 0)
            if prev_p is not None:
                assert np.all(t >= prev_p - 1e-15)
            prev_p = t


def test_unseen_link_uses_prior_with_larger_uncertainty():
    X, y = _data()
    m = LinkModel().fit(X, y)
    _, std_seen = m.predict_with_std([("nvlink", "allreduce", 4, 1e8)])
    t, std_new = m.predict_with_std([("infiniband-hdr", "allreduce", 4, 1e8)])
    a, bw, _ = link_prior("infiniband-hdr")
    assert t[0] == pytest.approx(6 * a + 1.5 * 1e8 / bw, rel=1e-3)
    assert std_new[0] > std_seen[0]
    assert m.link_log_std("weird-fabric") > m.link_log_std("infiniband-hdr")


def test_improves_with_more_observations():
    Xt, yt = _data(seed=99, n=200, links=("mystery",), noise=0.0)
    errs, stds = [], []
    for n in (2, 20, 300):
        X, y = _data(seed=1, n=n, links=("mystery",), noise=0.1)
        m = LinkModel().fit(X, y)
        errs.append(float(np.median(np.abs(np.log(m.predict(Xt) / yt)))))
        stds.append(m.link_log_std("mystery"))
    assert errs[2] < errs[0] and stds[2] < stds[0]
    assert errs[2] < 0.1


def test_single_participant_costs_nothing_and_ops_scale():
    X, y = _data()
    m = LinkModel().fit(X, y)
    assert m.predict([("nvlink", "allreduce", 1, 1e9)])[0] == 0.0
    ar, ag = m.predict([("nvlink", "allreduce", 8, 1e9), ("nvlink", "all_gather", 8, 1e9)])
    assert ag < ar


def test_not_fitted_and_bad_input():
    with pytest.raises(NotFittedError):
        LinkModel().predict([("nvlink", "allreduce", 2, 10)])
    X, y = _data()
    with pytest.raises(ValidationError, match=r"X\[0\].bytes"):
        LinkModel().fit([("nvlink", "allreduce", 2, float("nan"))], [1.0])
    with pytest.raises(ValidationError, match="op"):
        LinkModel().fit([("nvlink", "gossip", 2, 10)], [1.0])
    with pytest.raises(ValueError):
        LinkModel().fit(X, y[:-1])
    assert clone(LinkModel(gamma_l2=2.0)).get_params()["gamma_l2"] == 2.0


def test_link_stats_report_each_link():
    X, y = _data()
    stats = {s["link"]: s for s in LinkModel().fit(X, y).link_stats()}
    assert set(stats) == {"nvlink", "ethernet"}
    assert stats["nvlink"]["bandwidth_Bps"] > stats["ethernet"]["bandwidth_Bps"]
    assert all(s["n"] > 0 and s["log_rmse"] >= 0 for s in stats.values())


def test_every_collective_the_api_accepts_can_be_fitted():
    """A stored record of any op POST /v1/observations accepts must not fail everyone's fit (it once did for
    `sendrecv`: the service then had no model)."""
    from slurm_plugin.contracts.records import OPS
    X = [("nvlink", op, 4, 2.0**20 * (1 + i)) for i, op in enumerate(OPS)]
    model = LinkModel().fit(X, [1e-4 * (1 + i) for i in range(len(OPS))])
    assert np.all(model.predict(X) > 0)
    # a point-to-point exchange moves its bytes once, whatever the group size
    t2, t8 = model.time("nvlink", "sendrecv", 2, [2.0**24]), model.time("nvlink", "sendrecv", 8, [2.0**24])
    assert t2[0] <= t8[0] < 2 * t2[0]
