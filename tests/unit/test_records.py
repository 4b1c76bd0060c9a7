"""Observation record validation: every bad value is rejected naming its field; good records survive."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.errors import ValidationError
from slurm_plugin.contracts.records import validate_batch, validate_record
from tests.unit._service_fakes import COLLECTIVE, DDP_OVERHEAD, STEP


def test_design_examples_are_valid():
    assert validate_batch([COLLECTIVE, STEP, DDP_OVERHEAD]) == [COLLECTIVE, STEP, DDP_OVERHEAD]
    assert validate_batch({"observations": [STEP]}) == [STEP]


@pytest.mark.parametrize("base,key,value,message", [
    (COLLECTIVE, "seconds", float("nan"), "finite"),
    (COLLECTIVE, "seconds", float("inf"), "finite"),
    (COLLECTIVE, "seconds", -0.1, "positive"),
    (COLLECTIVE, "seconds", 0, "positive"),
    (COLLECTIVE, "seconds", 1e9, "implausible"),
    (COLLECTIVE, "seconds", "fast", "number"),
    (COLLECTIVE, "bytes", -1, "outside"),
    (COLLECTIVE, "bytes", 2**60, "outside"),
    (COLLECTIVE, "world", 0, "outside"),
    (COLLECTIVE, "world", True, "integer"),
    (COLLECTIVE, "world", 1, "uses no link"),
    (COLLECTIVE, "world", 2.5, "integer"),
    (COLLECTIVE, "op", "allsmash", "expected one of"),
    (COLLECTIVE, "link", "", "expected a name"),
    (COLLECTIVE, "link", "nv link", "expected a name"),
    (COLLECTIVE, "colour", "blue", "unknown field"),
    (STEP, "iter_s", float("nan"), "finite"),
    (STEP, "iter_s", 1e-300, "less than 1e-05 s"),  # #24.14: it headed the outlier table
    (COLLECTIVE, "seconds", 1e-12, "less than 1e-07 s"),
    (STEP, "per_gpu_batch", 0, "outside"),
    (STEP, "layout", [], "non-empty"),
    (STEP, "profile", "res net", "expected a name"),
    (STEP, "sync_s", 1.0, "iter_s"),
    (STEP, "kind", "stepp", "expected one of 'collective', 'step', 'ddp_overhead'"),
    (STEP, "kind", ["step"], "expected one of"),
    (DDP_OVERHEAD, "world", 0, "outside"),
    (DDP_OVERHEAD, "world", 1.5, "integer"),
    (DDP_OVERHEAD, "buckets", 0, "outside"),
    (DDP_OVERHEAD, "buckets", 401, "outside 1..400"),       # more buckets than gradient tensors
    (DDP_OVERHEAD, "tensors", -3, "outside"),
    (DDP_OVERHEAD, "tensors", "400", "integer"),
    (DDP_OVERHEAD, "plain_s", 0, "positive"),
    (DDP_OVERHEAD, "plain_s", 1e-9, "less than 1e-05 s"),
    (DDP_OVERHEAD, "ddp_s", float("nan"), "finite"),
    (DDP_OVERHEAD, "ddp_s", 7200.0, "implausible"),
    (DDP_OVERHEAD, "extra_s", float("inf"), "finite"),
    (DDP_OVERHEAD, "extra_s", "0.01", "finite seconds"),
    (DDP_OVERHEAD, "extra_s", True, "finite seconds"),
    (DDP_OVERHEAD, "extra_s", 0.02, "outside [-plain_s, ddp_s]"),    # above the DDP step itself
    (DDP_OVERHEAD, "extra_s", -0.011, "outside [-plain_s, ddp_s]"),  # below minus the plain step
    (DDP_OVERHEAD, "probe", "many small", "expected a name"),
    (DDP_OVERHEAD, "gpu", 7, "expected a name"),
    (DDP_OVERHEAD, "link", "nvlink", "unknown field"),
    (DDP_OVERHEAD, "bytes", 0, "outside"),
    (DDP_OVERHEAD, "uid", 0, "unknown field"),
    (STEP, "uid", 0, "unknown field"),  # the service sets it from the credential; a client cannot
])
def test_bad_values_name_the_field(base, key, value, message):
    record = dict(base, **{key: value})
    with pytest.raises(ValidationError) as info:
        validate_batch([STEP, STEP, record])
    assert info.value.field == f"observations[2].{key}"
    assert message in info.value.message


def test_nested_layout_entry_is_named():
    with pytest.raises(ValidationError) as info:
        validate_record(dict(STEP, layout=[2, 0]), "observations[0]")
    assert info.value.field == "observations[0].layout[1]"


def test_missing_fields_and_multi_node_without_inter_link():
    with pytest.raises(ValidationError) as info:
        validate_record({k: v for k, v in COLLECTIVE.items() if k != "bytes"}, "r")
    assert info.value.field == "r.bytes" and "missing" in info.value.message
    with pytest.raises(ValidationError) as info:
        validate_record({k: v for k, v in STEP.items() if k != "inter_link"}, "r")
    assert info.value.field == "r.inter_link"
    with pytest.raises(ValidationError) as info:
        validate_record({k: v for k, v in DDP_OVERHEAD.items() if k != "extra_s"}, "r")
    assert info.value.field == "r.extra_s" and "missing" in info.value.message
    single = {k: v for k, v in STEP.items() if k != "inter_link"}
    assert validate_record(dict(single, layout=[4]), "r")["layout"] == [4]


@pytest.mark.parametrize("body", [None, {}, [], "x", [1], [None], {"observations": 3}, [STEP] * 4097])
def test_bad_batches(body):
    with pytest.raises(ValidationError):
        validate_batch(body)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from([COLLECTIVE, STEP, DDP_OVERHEAD]),
       key=st.sampled_from(sorted(set(COLLECTIVE) | set(STEP) | set(DDP_OVERHEAD))), value=JSON)
def test_any_mutation_is_accepted_clean_or_rejected_with_a_field(base, key, value):
    record = dict(base, **{key: value})
    try:
        out = validate_record(record, "observations[0]")
    except ValidationError as exc:
        assert exc.field.startswith("observations[0]")
        return
    text = json.dumps(out, allow_nan=False)            # what is accepted is storable JSON
    assert "NaN" not in text and "Infinity" not in text
    for number in (out.get("seconds"), out.get("iter_s"), out.get("plain_s"), out.get("ddp_s")):
        assert number is None or (math.isfinite(number) and number > 0)
    if out["kind"] == "ddp_overhead":
        assert -out["plain_s"] <= out["extra_s"] <= out["ddp_s"] and 1 <= out["buckets"] <= out["tensors"]


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_arbitrary_json_never_escapes_as_another_error(body):
    try:
        validate_batch(body)
    except ValidationError:
        pass


def test_ddp_overhead_is_normalised_and_keeps_its_optional_fields():
    record = dict(DDP_OVERHEAD, world=1.0, extra_s=-0.0001, job_id=12, source="calibrate")
    out = validate_record(record, "r")
    assert out["world"] == 1 and isinstance(out["world"], int)   # an integral float: JSON has one number type
    assert out["extra_s"] == -0.0001 and out["job_id"] == 12 and out["source"] == "calibrate"


MIXED = {**STEP, "gpu": "A100+H100", "gpu_by_node": ["H100", "A100"], "rank_batches": [82, 82, 46, 46]}


def test_a_step_row_says_what_ran_mixed_types_included():
    # #42.7: each node's GPU type and each rank's local batch; a mixed job's row is no longer left unposted
    assert validate_record(MIXED, "o") == MIXED
    one = {**STEP, "gpu_by_node": ["H200", "H200"], "rank_batches": [64] * 4}
    assert validate_record(one, "o") == one


@pytest.mark.parametrize("change, field", [
    ({"gpu": "H100"}, "o.gpu"),                                  # a mixed row's gpu is its types joined
    ({"gpu": "H100+A100"}, "o.gpu"),                             # sorted
    ({"gpu_by_node": ["H100"]}, "o.gpu_by_node"),                # one per node of the layout
    ({"gpu_by_node": ["H100", "a b"]}, "o.gpu_by_node"),
    ({"rank_batches": [82, 82, 46]}, "o.rank_batches"),          # one per rank
    ({"rank_batches": [82, 82, 46, 0]}, "o.rank_batches"),
    ({"rank_batches": [82, 82, 46, True]}, "o.rank_batches"),
])
def test_a_step_row_that_misstates_what_ran_is_refused_naming_the_field(change, field):
    with pytest.raises(ValidationError) as err:
        validate_record({**MIXED, **change}, "o")
    assert err.value.field == field


def test_a_step_row_of_several_types_needs_its_nodes_types():
    with pytest.raises(ValidationError) as err:
        validate_record({k: v for k, v in MIXED.items() if k != "gpu_by_node"}, "o")
    assert err.value.field == "o.gpu_by_node"
