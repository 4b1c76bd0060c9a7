"""Dataset loaders: records have the step shape the engine fits, profiles exist for every model."""
from pathlib import Path

import pytest

from predictor.datasets import DEFAULT_ROOT, even_layout, load_elasticflow, load_morphling, load_pollux

pytestmark = pytest.mark.skipif(not Path(DEFAULT_ROOT).is_dir(), reason="shared data not present")


@pytest.mark.parametrize("loader,gpu,min_rows", [(load_pollux, "T4", 5000), (load_morphling, "A800", 60),
                                                 (load_elasticflow, "A100", 80)])
def test_loader_rows_are_valid_step_records(loader, gpu, min_rows):
    ds = loader()
    assert len(ds.steps) >= min_rows
    for r in ds.steps + ds.extra:
        assert r["kind"] == "step" and r["gpu"] == gpu and r["profile"] in ds.profiles
        assert r["iter_s"] > 0 and r["per_gpu_batch"] > 0 and all(k > 0 for k in r["layout"])
        assert (len(r["layout"]) > 1) == ("inter_link" in r)
        assert r["source"]
    for name, p in ds.profiles.items():
        assert p.name == name and p.grad_bytes > 0


def test_pollux_has_sync_and_scalability_up_to_64_gpus():
    ds = load_pollux()
    assert all(0 <= r["sync_s"] <= r["iter_s"] * 1.01 for r in ds.steps)
    assert max(sum(r["layout"]) for r in ds.extra) == 64
    assert {"bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"} == set(ds.profiles)


def test_each_models_trace_is_one_owner_and_pollux_ncf_is_the_benchmarks_neumf():
    """One vote per model's trace in a fit (stepmodel.owner_of reads `uid`); Pollux's NCF is AdaptDL's benchmark
    model (MovieLens-1M, factor 32, 3 layers: 1.60 M parameters), not the 5.9 M of NeuMF on MovieLens-20M."""
    for ds in (load_pollux(), load_elasticflow()):
        owners = {}
        for r in ds.steps + ds.extra:
            owners.setdefault(r["profile"], set()).add(r["uid"])
        assert all(len(v) == 1 for v in owners.values()) and len(set.union(*owners.values())) == len(owners)
    ncf = load_pollux().profiles["ncf"]
    assert ncf.n_params == 1_602_657 and len(ncf.tensors) == 12


def test_morphling_splits_each_models_global_batch_over_its_gpus():
    ds = load_morphling()
    per_model = {}
    for r in ds.steps:
        per_model.setdefault(r["profile"], set()).add(round(r["per_gpu_batch"] * sum(r["layout"]), 9))
    assert per_model == {"bert": {32}, "roberta": {64}, "vit": {64}}   # the origin's local_bsz, every placement


def test_even_layout():
    assert even_layout(6, 7) == [2, 1, 1, 1, 1, 1]
    assert even_layout(16, 64) == [4] * 16
    assert sum(even_layout(12, 40)) == 40


def test_gavel_rows_cover_three_types_and_skip_unmeasured():
    from predictor.datasets import load_gavel

    rows = load_gavel()
    assert {r["gpu"] for r in rows} == {"K80", "P100", "V100"} and len(rows) == 245  # 3 x 83 keys, 4 zeros left out
    assert all(r["steps_per_s"] > 0 and r["batch"] > 0 and r["gpus"] in (1, 2, 4, 8) for r in rows)
    assert not [r for r in rows if r["gpu"] == "K80" and r["job_type"] == "ResNet-50 (batch size 128)"]
