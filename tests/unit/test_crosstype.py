"""Cross-type prediction (predictor/crosstype.py) and its use by the engine for pairs never measured."""
import math
import json

import numpy as np
import pytest

from predictor.crosstype import CrossTypeModel, features
from predictor.engine import Predictor
from predictor.profiles import profile_from_spec

CAND = [{"layout": [1], "intra_link": "pcie"}]


def _rows(rng, models=(1e6, 1e7, 1e8), batches=(8, 16, 32, 64, 128)):
    """Synthetic history: the newer type's speedup grows with model size and batch (more compute-bound)."""
    X, y = [], []
    for n in models:
        for b in batches:
            t_src = 1e-3 + n * b * 1e-11
            X.append((n, b, t_src))
            y.append(-0.2 * np.log10(n) - 0.15 * np.log2(b) + 0.03 * rng.standard_normal())
    n, b, t = zip(*X)
    return features(n, [None] * len(n), b, [1] * len(n), t), np.array(y)


def test_a_training_row_is_answered_within_its_noise():
    X, y = _rows(np.random.default_rng(0))
    m, sd = CrossTypeModel().fit(X, y).predict(X, return_std=True)
    assert np.all(np.abs(m - y) < 3 * np.maximum(sd, 0.03))


def test_monotone_in_batch_where_the_data_is():
    X, y = _rows(np.random.default_rng(1))
    model = CrossTypeModel().fit(X, y)
    b = np.array([8, 12, 16, 24, 32, 48, 64, 96, 128])
    pred = model.predict(features([1e7] * len(b), [None] * len(b), b, [1] * len(b), 1e-3 + 1e7 * b * 1e-11))
    assert np.all(np.diff(pred) < 0)  # log(step_T / step_S) falls: T's advantage grows with batch


def test_far_from_every_model_is_the_centre_with_a_wider_spread():
    X, y = _rows(np.random.default_rng(2))
    model = CrossTypeModel().fit(X, y)
    near_m, near_sd = model.predict(X[:1], return_std=True)
    far = features([1e15], [None], [1e6], [512], [1e4])
    far_m, far_sd = model.predict(far, return_std=True)
    assert far_m[0] == pytest.approx(np.median(y), abs=0.05) and far_sd[0] > 3 * near_sd[0]


def test_a_model_outside_the_history_gets_the_pooled_centre_and_its_leave_one_model_out_spread():
    """Each model one vote: a model with many rows does not pull the centre (the rows' median) towards itself,
    and the new model's spread is at least what leaving each training model out of the centre cost."""
    rng = np.random.default_rng(3)
    ratios = {1e6: -0.2, 1e7: -0.5, 1e8: -0.9}
    counts = {1e6: 12, 1e7: 2, 1e8: 2}
    n, b, y = [], [], []
    for size, r in ratios.items():
        for i in range(counts[size]):
            n.append(size), b.append(8 * 2 ** (i % 5)), y.append(r + 0.01 * rng.standard_normal())
    X = features(n, [None] * len(n), b, [1] * len(n), [0.1] * len(n))
    model = CrossTypeModel().fit(X, np.array(y))
    m, sd = model.predict(features([3e7], [None], [32], [1], [0.1]), return_std=True)
    assert m[0] == pytest.approx(np.mean(list(ratios.values())), abs=0.02)
    assert abs(m[0] - np.median(y)) > 0.2
    left_out = [r - np.mean([v for k, v in ratios.items() if k != size]) for size, r in ratios.items()
                for _ in range(counts[size])]
    assert sd[0] >= np.sqrt(np.mean(np.square(left_out))) - 1e-3
    seen_m, seen_sd = model.predict(X[12:13], return_std=True)               # a model of the history: its own
    assert seen_m[0] == pytest.approx(-0.5, abs=0.1) and seen_sd[0] < sd[0] / 2


def test_no_rows_answers_the_prior_and_bad_input_is_named():
    model = CrossTypeModel().fit(np.empty((0, 5)), np.empty(0))
    m, sd = model.predict(features([1e6], [None], [8], [1], [0.1]), return_std=True)
    assert m[0] == 0.0 and sd[0] > 0.5
    with pytest.raises(RuntimeError, match="not fitted"):
        CrossTypeModel().predict(np.zeros((1, 5)))
    with pytest.raises(ValueError, match="X must be"):
        CrossTypeModel().fit(np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(ValueError, match="positive"):
        features([1e6], [None], [0], [1], [0.1])


# ---- engine: a (profile, GPU) never measured, its profile measured on another type
SPEEDUP = {"resnet18": 2.0, "resnet50": 3.0, "vgg16": 3.4, "bert-base-uncased": 2.6}  # A100 over V100


def _history(names, skip=()):
    obs = []
    for name in names:
        c1 = profile_from_spec(name).flops_per_sample / 5e12
        for gpu, speed in (("V100", 1.0), ("A100", SPEEDUP[name])):
            if (name, gpu) in skip:
                continue
            for b in (8, 16, 32, 64):
                obs.append({"kind": "step", "profile": name, "gpu": gpu, "layout": [1], "intra_link": "pcie",
                            "per_gpu_batch": b, "iter_s": (2e-3 + c1 * b) / speed})
    return obs


@pytest.fixture(scope="module")
def cross():
    names = ["resnet18", "resnet50", "vgg16", "bert-base-uncased"]
    profiles = {n: profile_from_spec(n) for n in names}
    return Predictor().fit(profiles, _history(names, skip={("vgg16", "A100")})), profiles


def test_a_pair_never_measured_is_answered_cross_type(cross):
    pred, profiles = cross
    assert not pred.known("vgg16", "A100")
    out = pred.predict(profiles["vgg16"], "A100", 32, CAND)[0]
    v100 = pred.predict(profiles["vgg16"], "V100", 32, CAND)[0]
    assert out["basis"] == "cross-type from V100 (3 models on both; roofline)"  # centred on its shape's ratio
    assert out["uncertainty"] > v100["uncertainty"]
    truth = v100["iter_s"] / SPEEDUP["vgg16"]
    assert abs(np.log(out["iter_s"] / truth)) < 2 * out["uncertainty"]
    assert out["iter_s"] < v100["iter_s"]  # every model of the history runs faster on A100


def test_measured_pairs_keep_their_answer(cross):
    pred, profiles = cross
    out = pred.predict(profiles["resnet50"], "A100", 32, CAND)[0]
    assert out["basis"] == "observed"
    alone = Predictor().fit({"resnet50": profiles["resnet50"]}, _history(["resnet50"]))
    assert out["iter_s"] == pytest.approx(alone.predict(profiles["resnet50"], "A100", 32, CAND)[0]["iter_s"],
                                          rel=1e-3)


def test_too_little_shared_history_falls_back_to_the_profile():
    names = ["resnet50", "vgg16"]
    profiles = {n: profile_from_spec(n) for n in names}
    pred = Predictor().fit(profiles, _history(names, skip={("vgg16", "A100")}))
    assert pred.predict(profiles["vgg16"], "A100", 32, CAND)[0]["basis"] == "profile"


def test_cross_type_survives_the_json_document(cross):
    pred, profiles = cross
    again = Predictor().load_params(json.loads(json.dumps(pred.to_params())), pred.profiles_)
    assert again.predict(profiles["vgg16"], "A100", 32, CAND) == pred.predict(profiles["vgg16"], "A100", 32, CAND)


# ---- #25.3: the roofline prior of a model never seen on the target type (predictor/roofline.py)
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from predictor.roofline import GPUPeaks, RooflinePrior, Shape, load_gavel_shapes, load_peaks  # noqa: E402


def test_the_vendored_tables_name_every_type_and_gavel_model():
    peaks = load_peaks()
    for gpu in ("K80", "P100", "V100", "T4", "A10", "A100", "A800", "H100", "H200"):
        p = peaks[gpu]
        assert p.fp32_flops > 1e12 and p.mem_bw > 1e11 and p.link_bw > 1e9 and p.source
    assert set(load_gavel_shapes()) == {"ResNet-18", "ResNet-50", "Transformer", "LM", "Recommendation", "A3C",
                                        "CycleGAN"}


def test_a_model_with_no_shape_keeps_todays_answer():
    X, y = _rows(np.random.default_rng(4))
    model = CrossTypeModel().fit(X, y)
    new = features([3e7, 1e6], [None, None], [32, 8], [1, 1], [0.1, 0.01])
    prior = RooflinePrior("K80", "V100").predict([None, None], [32, 8])
    assert np.isnan(prior).all()
    m0, sd0 = model.predict(new, return_std=True)
    m1, sd1 = model.predict(new, return_std=True, prior=prior)
    assert np.array_equal(m0, m1) and np.array_equal(sd0, sd1)
    m2 = model.predict(new, prior=[-1.0, np.nan])  # a shape for the first row only: only it moves
    assert m2[0] == pytest.approx(-1.0, abs=1e-6) and m2[1] == m0[1]
    seen = model.predict(X[:3], prior=[5.0] * 3)  # a model of the history: the GP's answer, prior or not
    assert np.allclose(seen, model.predict(X[:3]), atol=1e-9)


def test_the_prior_is_monotone_in_peak_flops_for_a_compute_bound_model():
    shape = Shape(flops_per_sample=1e12, bytes_per_sample=1e3, bytes_per_step=0.0, ops_per_step=10)
    src = GPUPeaks("S", 10e12, None, None, 1e12, 32e9, "test")
    ratios = []
    for tflops in (5, 10, 20, 40, 80):
        dst = GPUPeaks("T", tflops * 1e12, None, None, 1e12, 32e9, "test")
        ratios.append(RooflinePrior("S", "T", {"S": src, "T": dst}).predict([shape], [64])[0])
    assert np.all(np.diff(ratios) < 0)  # more FLOP/s on T: a shorter step there
    assert ratios[1] == pytest.approx(0.0, abs=1e-3)  # equal peaks, no host share: ratio 1


def test_each_fold_fits_the_prior_without_its_held_out_model(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import crosstype as bench
    from predictor.datasets import load_gavel

    rows = [r for r in load_gavel() if r["model"] in ("A3C", "CycleGAN", "Recommendation", "LM")
            and r["gpus"] == 1 and r["batch"] in (4, 1, 512, 2048, 10, 40)]
    current, seen_fits = {}, []
    real_fit, real_prior = RooflinePrior.fit, bench.roofline_prior

    def spy_fit(self, shapes, batch, y, model, gpus=1):
        seen_fits.append((current["held"], set(model)))
        return real_fit(self, shapes, batch, y, model, gpus)

    def spy_prior(info, train, key, *a):
        current["held"] = info[key]["model"]
        return real_prior(info, train, key, *a)

    monkeypatch.setattr(RooflinePrior, "fit", spy_fit)
    monkeypatch.setattr(bench, "roofline_prior", spy_prior)
    out = bench.run(rows, lambda key, k: k[0].split(" (")[0] == key[0].split(" (")[0])
    assert out["pairs"] == len(seen_fits) > 0
    for held, models in seen_fits:
        assert held not in models and models


def test_compute_and_memory_efficiency_act_on_their_own_side_and_the_link_on_neither():
    """tm-2026.11.28-2's form: kc_T scales only a compute-bound step, km_T only a memory-bound one, and the ring
    all-reduce stays at the datasheet link figure whatever either is (vectorised over rows)."""
    from predictor.roofline import log_ratio, roofline_terms
    src = GPUPeaks("S", 10e12, None, None, 1e12, 32e9, "test")
    dst = GPUPeaks("T", 20e12, None, None, 2e12, 64e9, "test")
    compute = Shape(flops_per_sample=1e12, bytes_per_sample=1.0)
    memory = Shape(flops_per_sample=1.0, bytes_per_sample=1e11)
    link = Shape(flops_per_sample=1.0, bytes_per_sample=1.0, grad_bytes=1e12)
    shapes, batch, gpus = [compute, memory, link], [8, 8, 8], [1, 1, 8]
    ds, ops = roofline_terms(shapes, batch, src, gpus)
    dt, _ = roofline_terms(shapes, batch, dst, gpus)
    assert ds.shape == (3, 3) and ops.shape == (3,)
    h0 = math.log(1e-12)
    base = log_ratio([h0, 0.0, 0.0], ds, dt, ops)
    assert np.allclose(base, math.log(0.5), atol=1e-6)  # every peak doubled: half the step
    slow_c = log_ratio([h0, math.log(3.0), 0.0], ds, dt, ops)
    slow_m = log_ratio([h0, 0.0, math.log(3.0)], ds, dt, ops)
    assert slow_c[0] == pytest.approx(math.log(1.5), abs=1e-6) and slow_c[1] == pytest.approx(base[1], abs=1e-6)
    assert slow_m[1] == pytest.approx(math.log(1.5), abs=1e-6) and slow_m[0] == pytest.approx(base[0], abs=1e-6)
    assert slow_c[2] == pytest.approx(base[2], abs=1e-4) and slow_m[2] == pytest.approx(base[2], abs=1e-4)


def test_a_profile_without_flops_keeps_the_pooled_centre(cross, monkeypatch):
    """tm-2026.11.28-2: the engine centres a model new to the target type on the roofline prior from its profile
    (FLOPs, parameter bytes, tensor count); a profile with no FLOPs has no shape and is answered as before."""
    import dataclasses

    from predictor import engine
    pred, profiles = cross
    bare = dataclasses.replace(profiles["vgg16"], flops_per_sample=None)
    out = pred.predict(bare, "A100", 32, CAND)[0]
    assert out["basis"] == "cross-type from V100 (3 models on both)"
    monkeypatch.setattr(engine.Predictor, "_roofline", lambda self, *a: None)  # no prior at all: the old answer
    again = Predictor().fit(profiles, _history(list(profiles), skip={("vgg16", "A100")}))
    old = again.predict(profiles["vgg16"], "A100", 32, CAND)[0]
    assert old["basis"] == "cross-type from V100 (3 models on both)"
    assert out["iter_s"] == pytest.approx(old["iter_s"], rel=1e-9)
    with_prior = pred.predict(profiles["vgg16"], "A100", 32, CAND)[0]
    assert with_prior["iter_s"] != pytest.approx(old["iter_s"], rel=1e-6)  # the shape moved the answer


def test_profile_shape_reads_what_a_profile_knows():
    from predictor.roofline import OPS_PER_TENSOR, profile_shape
    p = profile_from_spec("resnet50")
    s = profile_shape(p)
    assert s.flops_per_sample == p.flops_per_sample and s.grad_bytes == p.grad_bytes
    assert s.ops_per_step == OPS_PER_TENSOR * len(p.tensors) and s.bytes_per_step == 4 * p.grad_bytes
    import dataclasses
    assert profile_shape(dataclasses.replace(p, flops_per_sample=None)) is None


def test_gpu_flops_has_one_owner():
    """stepmodel.GPU_FLOPS is the vendored datasheet table's figure per type, nothing of its own."""
    from predictor import stepmodel
    peaks = load_peaks()
    assert stepmodel.GPU_FLOPS == {g.lower(): p.train_flops for g, p in peaks.items()}
    assert peaks["A100"].train_flops == peaks["A100"].tf32_flops and peaks["V100"].train_flops == peaks["V100"].fp32_flops
    for gpu in ("K80", "P100", "V100", "T4", "A10", "A100", "A800", "L40", "H100", "H800", "H200", "B200"):
        assert peaks[gpu].source in (Path(__file__).resolve().parents[2] / "predictor" / "data" / "roofline"
                                     / "SOURCE.md").read_text(encoding="utf-8")
