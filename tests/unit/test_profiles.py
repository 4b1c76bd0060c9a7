"""Profiles: DDP bucket sizes from live modules, spec profiles on the meta device, validation of API profiles."""
import math

import pytest
import torch
import torch.nn as nn
from torch._C._distributed_c10d import _compute_bucket_assignment_by_size

from predictor import builtin_models
from predictor.errors import NotFoundError, ValidationError
from predictor.profiles import BUILTIN, Profile, profile_from_module, profile_from_spec


def _module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(600, 600), nn.Linear(600, 600), nn.Linear(600, 10), nn.Linear(10, 2000),
                         nn.Linear(2000, 900).half(), nn.Linear(900, 300).half(), nn.Linear(300, 3000))


@pytest.mark.parametrize("cap_mb", [1, 2, 25])
def test_bucket_sizes_match_ddp_assignment(cap_mb):
    m = _module()
    ready_order = list(reversed(list(m.parameters())))
    idx, _ = _compute_bucket_assignment_by_size(ready_order, [1024 * 1024, cap_mb * 1024 * 1024],
                                                [False] * len(ready_order))
    expected = tuple(sum(ready_order[i].numel() * ready_order[i].element_size() for i in b) for b in idx)
    assert profile_from_module(m, "m", bucket_cap_mb=cap_mb).buckets_bytes == expected


def test_tensors_in_reverse_registration_order_with_dtypes():
    m = _module()
    p = profile_from_module(m, "m")
    names = [n for n, _ in m.named_parameters()]
    assert [t.name for t in p.tensors] == names[::-1]
    assert {t.dtype for t in p.tensors} == {"float32", "float16"}
    assert p.grad_bytes == sum(q.numel() * q.element_size() for q in m.parameters())


def test_half_precision_halves_bytes():
    full = profile_from_module(nn.Linear(512, 512), "f")
    half = profile_from_module(nn.Linear(512, 512).half(), "h")
    assert half.grad_bytes * 2 == full.grad_bytes


@pytest.mark.parametrize("spec,params", [("torchvision:resnet50", 25_557_032),
                                         ("transformers:bert-base-uncased", 109_482_240), ("gpt2", 124_439_808)])
def test_spec_profiles_match_published_parameter_counts(spec, params):
    p = profile_from_spec(spec)
    assert p.n_params == params
    assert p.flops_per_sample and p.flops_per_sample > 0
    assert len(p.buckets_bytes) >= 2 and p.buckets_bytes[0] >= 1024 * 1024


def test_every_builtin_name_has_its_shapes_and_its_flops():
    """profiles.BUILTIN (name -> FLOPs, torch-free) and builtin_models.BUILDERS (name -> module) name the same
    architectures, and each builds with parameters."""
    assert sorted(builtin_models.BUILDERS) == sorted(BUILTIN)
    for name in BUILTIN:
        assert profile_from_spec(name).n_params > 0, name


def test_spec_dtype_changes_bytes():
    assert profile_from_spec("resnet50", dtype="bfloat16").grad_bytes * 2 == profile_from_spec("resnet50").grad_bytes


def test_unknown_spec_is_not_found():
    with pytest.raises(NotFoundError, match="no-such-net"):
        profile_from_spec("torchvision:no-such-net")


def test_round_trip():
    p = profile_from_spec("resnet18_cifar10")
    q = Profile.from_dict(p.to_dict())
    assert q.tensors == p.tensors and q.buckets_bytes == p.buckets_bytes and q.name == p.name


GOOD = {"name": "tiny", "tensors": [{"name": "w", "numel": 10, "dtype": "float32"},
                                    {"name": "b", "numel": 4, "dtype": "bfloat16"}]}


@pytest.mark.parametrize("patch,field", [
    ({"tensors": [GOOD["tensors"][0], {"name": "b", "numel": -3, "dtype": "float32"}]}, "tensors[1].numel"),
    ({"tensors": [{"name": "w", "numel": math.nan}]}, "tensors[0].numel"),
    ({"tensors": [{"name": "w", "numel": 1e15}]}, "tensors[0].numel"),
    ({"tensors": [{"name": "w", "numel": 2.5}]}, "tensors[0].numel"),
    ({"tensors": [{"name": "w", "numel": True}]}, "tensors[0].numel"),
    ({"tensors": [{"name": "w", "numel": 3, "dtype": "float13"}]}, "tensors[0].dtype"),
    ({"tensors": []}, "tensors"),
    ({"tensors": ["w"]}, "tensors[0]"),
    ({"name": ""}, "name"),
    ({"buckets_bytes": [100, 0]}, "buckets_bytes[1]"),
    ({"flops_per_sample": -1}, "flops_per_sample"),
    ({"compute_s_per_sample": math.inf}, "compute_s_per_sample"),
])
def test_from_dict_rejects_bad_fields_naming_them(patch, field):
    with pytest.raises(ValidationError) as e:
        Profile.from_dict({**GOOD, **patch})
    assert e.value.field == field
    assert field in str(e.value)


def test_from_dict_computes_buckets_when_absent():
    p = Profile.from_dict(GOOD)
    assert p.buckets_bytes == (40, 8)  # one bucket per dtype
