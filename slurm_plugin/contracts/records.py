"""Validation of observation records (design.md: `POST /v1/observations`): the records' one schema, a contract
of the runtime and the service (issue #26.1). The service validates every post with it; the launcher drops what it
would refuse before posting (`elastic_launcher.observations.postable`).

Four kinds of record:
    collective:   {"kind": "collective", "op": "allreduce", "link": "nvlink", "world": 4,
                   "bytes": 67108864, "seconds": 0.00037, "gpu": "H200"}
    step:         {"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [2, 2],
                   "intra_link": "nvlink", "inter_link": "ib", "per_gpu_batch": 64, "iter_s": 0.0322}
                  optional: `gpu_by_node` (["H100", "A100"]: a mixed job's, whose `gpu` is "A100+H100"),
                  `rank_batches` ([82, 82, 46, 46]: what each rank ran)
    ddp_overhead: {"kind": "ddp_overhead", "gpu": "H200", "world": 2, "probe": "many-small", "buckets": 2,
                   "tensors": 400, "plain_s": 0.0101, "ddp_s": 0.0183, "extra_s": 0.0082}
                  one probe model of the calibration job (`elastic-predictor calibrate`,
                  elastic_launcher/calibrate.py): its DDP step and its plain step (no DDP) at `world` ranks, and
                  `extra_s`, DDP's extra seconds a step (between -plain_s and ddp_s: a paired median of the two
                  is not their difference); `buckets`/`tensors`: DDP's buckets and gradient tensors of the probe,
                  `bytes` (optional) their gradient bytes
    restart:      {"kind": "restart", "from_nodes": 1, "to_nodes": 2, "cost_s": 21.4, "checkpointed": true}
                  one restart resize of a `mode=restart` job (#43, elastic_launcher/restart.py): its signal to the
                  first step at the new size (`cost_s`); optional `profile` (`#ELASTIC model=`), `world` (workers
                  after), `checkpoint_s` (signal to the script's checkpoint, at most `cost_s`). Never fit: the
                  planner prices restart resizes with them (predictor/restart_price.py)

Every value is checked for type, finiteness and a plausible range, and unknown fields are rejected;
errors name the field as a JSON path, e.g. `observations[2].seconds`. A batch is validated whole
before anything is stored (all-or-nothing).
"""
from __future__ import annotations

import math
import re
from typing import Any

from slurm_plugin.errors import ValidationError

NAME_RE = re.compile(r"^[A-Za-z0-9_.:/+-]{1,128}\Z")      # profile names, as in the directive grammar
LINK_RE = re.compile(r"^[A-Za-z0-9_.:+-]{1,64}\Z")        # link classes and GPU types
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv")
MAX_BATCH = 4096                                          # records in one POST
MAX_SECONDS = 3600.0                                      # one collective or one step taking an hour is absurd
MIN_STEP_SECONDS = 1e-5                                   # a training step under 10 us is no measurement (#24.14)
MIN_COLLECTIVE_SECONDS = 1e-7                             # nor a collective under 0.1 us
MAX_BYTES = 1 << 44                                       # 16 TiB in one collective is absurd
MAX_WORLD = 65536
MAX_GPUS_PER_NODE = 64
MAX_NODES = 4096

_COMMON_OPTIONAL = {"job_id", "timestamp_s", "source", "link_source"}
_COLLECTIVE = {"required": {"kind", "op", "link", "world", "bytes", "seconds"},
               "optional": {"gpu", "nodes", "dtype"} | _COMMON_OPTIONAL}
_STEP = {"required": {"kind", "profile", "gpu", "layout", "per_gpu_batch", "iter_s", "intra_link"},
         "optional": {"inter_link", "samples_per_s", "sync_s", "dtype", "gpu_by_node", "rank_batches"}
         | _COMMON_OPTIONAL}
_DDP_OVERHEAD = {"required": {"kind", "gpu", "world", "buckets", "tensors", "extra_s", "plain_s", "ddp_s", "probe"},
                 "optional": {"bytes", "job_id", "source", "timestamp_s"}}
_RESTART = {"required": {"kind", "from_nodes", "to_nodes", "cost_s", "checkpointed"},
             "optional": {"profile", "world", "checkpoint_s", "job_id", "source", "timestamp_s"}}
MAX_TENSORS = 1 << 20                                     # gradient tensors of one model (a probe has ~400)
DTYPES = ("float32", "float16", "bfloat16", "float64", "fp8", "int8", "mixed")


def _int(record: dict, key: str, where: str, low: int, high: int) -> int:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        # integral floats (64.0) are accepted: JSON has one number type
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        else:
            raise ValidationError(f"{where}.{key}", f"expected an integer, got {value!r}")
    if not low <= value <= high:
        raise ValidationError(f"{where}.{key}", f"{value} is outside {low}..{high}")
    return value


def _seconds(record: dict, key: str, where: str, high: float = MAX_SECONDS, low: float = 0.0) -> float:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"{where}.{key}", f"expected a number of seconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValidationError(f"{where}.{key}", f"must be finite, got {value}")
    if value <= 0:
        raise ValidationError(f"{where}.{key}", f"must be positive, got {value}")
    if value > high:
        raise ValidationError(f"{where}.{key}", f"{value} s is implausible (more than {high:g} s)")
    if value < low:
        raise ValidationError(f"{where}.{key}", f"{value:g} s is implausible (less than {low:g} s)")
    return value


def _str(record: dict, key: str, where: str, pattern: re.Pattern = LINK_RE) -> str:
    value = record[key]
    if not isinstance(value, str) or not pattern.match(value):
        raise ValidationError(f"{where}.{key}", f"expected a name matching {pattern.pattern}, got {value!r}")
    return value


def _fields(record: Any, spec: dict, where: str) -> None:
    if not isinstance(record, dict):
        raise ValidationError(where, f"expected an object, got {type(record).__name__}")
    for key in record:
        if key not in spec["required"] | spec["optional"]:
            allowed = ", ".join(sorted(spec["required"] | spec["optional"]))
            raise ValidationError(f"{where}.{key}", f"unknown field (allowed: {allowed})")
    for key in sorted(spec["required"]):
        if key not in record:
            raise ValidationError(f"{where}.{key}", "required field is missing")


def _optional(record: dict, out: dict, where: str) -> None:
    if "job_id" in record:
        out["job_id"] = _int(record, "job_id", where, 0, 2**53)
    if "timestamp_s" in record:
        out["timestamp_s"] = _seconds(record, "timestamp_s", where, high=1e11)
    if "source" in record:
        out["source"] = _str(record, "source", where)
    if "link_source" in record:  # how the launcher found the link labels (free text, kept for the admin)
        value = record["link_source"]
        if not isinstance(value, str) or not 0 < len(value) <= 512 or not value.isprintable():
            raise ValidationError(f"{where}.link_source", f"expected printable text of 1-512 characters, got "
                                  f"{str(value)[:80]!r}")
        out["link_source"] = value
    if "dtype" in record:
        if record["dtype"] not in DTYPES:
            raise ValidationError(f"{where}.dtype", f"expected one of {'|'.join(DTYPES)}, got {record['dtype']!r}")
        out["dtype"] = record["dtype"]


def validate_collective(record: Any, where: str) -> dict:
    """Check one collective record and return its normalised copy.

    Raises:
        ValidationError: naming `where.<field>`.
    """
    _fields(record, _COLLECTIVE, where)
    if record["op"] not in OPS:
        raise ValidationError(f"{where}.op", f"expected one of {'|'.join(OPS)}, got {record['op']!r}")
    world = _int(record, "world", where, 1, MAX_WORLD)
    if world == 1:  # an all-reduce of one process moves nothing over any link: not a link's timing
        raise ValidationError(f"{where}.world", "a collective of 1 process uses no link; post collectives of 2 or "
                                                "more processes")
    out = {"kind": "collective", "op": record["op"], "link": _str(record, "link", where), "world": world,
           "bytes": _int(record, "bytes", where, 0, MAX_BYTES),
           "seconds": _seconds(record, "seconds", where, low=MIN_COLLECTIVE_SECONDS)}
    if "gpu" in record:
        out["gpu"] = _str(record, "gpu", where)
    if "nodes" in record:
        out["nodes"] = _int(record, "nodes", where, 1, min(MAX_NODES, out["world"]))
    _optional(record, out, where)
    return out


def counted(n: int, noun: str) -> str:
    """`1 GPU`, `4 GPUs`, `1 node`: a count and its noun as user-facing text says it."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def layout_name(layout) -> str:
    """The one name of a layout (GPUs per node): `2x4` for [4, 4], `1x4` for [4], `4+2` for a ragged one, `-` for
    none. The planner's reasons, the CLI, `/admin` and the plots all print this."""
    if not layout:
        return "-"
    if len(set(layout)) == 1:
        return f"{len(layout)}x{layout[0]}"
    return "+".join(str(n) for n in layout)


def validate_layout(value: Any, field: str) -> list[int]:
    """A layout: GPUs per node, e.g. `[2, 2]`.

    Raises:
        ValidationError: not a non-empty list of integers 1..64, or too many nodes.
    """
    if not isinstance(value, list) or not value:
        raise ValidationError(field, "expected a non-empty list of GPUs per node, e.g. [2, 2]")
    if len(value) > MAX_NODES:
        raise ValidationError(field, f"more than {MAX_NODES} nodes")
    for index, count in enumerate(value):
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_GPUS_PER_NODE:
            raise ValidationError(f"{field}[{index}]", f"expected an integer in 1..{MAX_GPUS_PER_NODE}, got {count!r}")
    return list(value)


def validate_step(record: Any, where: str) -> dict:
    """Check one step record and return its normalised copy.

    Raises:
        ValidationError: naming `where.<field>`.
    """
    _fields(record, _STEP, where)
    layout = validate_layout(record["layout"], f"{where}.layout")
    out = {"kind": "step", "profile": _str(record, "profile", where, NAME_RE), "gpu": _str(record, "gpu", where),
           "layout": layout, "intra_link": _str(record, "intra_link", where),
           "per_gpu_batch": _int(record, "per_gpu_batch", where, 1, 65536),
           "iter_s": _seconds(record, "iter_s", where, low=MIN_STEP_SECONDS)}
    if "inter_link" in record:
        out["inter_link"] = _str(record, "inter_link", where)
    elif len(layout) > 1:
        raise ValidationError(f"{where}.inter_link", "required when the layout spans several nodes")
    if "sync_s" in record:            # seconds of the step blocked in gradient sync (engine.py uses it)
        sync = record["sync_s"]
        if isinstance(sync, bool) or not isinstance(sync, (int, float)) or not math.isfinite(sync) \
                or not 0 <= sync <= out["iter_s"]:
            raise ValidationError(f"{where}.sync_s", f"expected seconds in [0, iter_s={out['iter_s']:g}], got {sync!r}")
        out["sync_s"] = float(sync)
    if "samples_per_s" in record:
        out["samples_per_s"] = _seconds(record, "samples_per_s", where, high=1e9)
    _ran_as(record, out, where)
    _optional(record, out, where)
    return out


def mixed_gpu(types) -> str:
    """The `gpu` of a step row whose nodes are of several types: the types, sorted, joined by `+` (`A100+H100`)."""
    return "+".join(sorted(set(types)))


def _ran_as(record: dict, out: dict, where: str) -> None:
    """What a step row says of what ran (#42.7): `gpu_by_node`, each node's GPU type in the layout's order (several
    types: a mixed job, whose `gpu` is `mixed_gpu` of them), and `rank_batches`, each rank's local batch."""
    layout = out["layout"]
    if "gpu_by_node" in record:
        types = record["gpu_by_node"]
        if not isinstance(types, list) or len(types) != len(layout) or not all(
                isinstance(t, str) and LINK_RE.match(t) for t in types):
            raise ValidationError(f"{where}.gpu_by_node", f"expected {len(layout)} GPU type names (one per node of "
                                  f"the layout), got {str(types)[:120]}")
        expected = types[0] if len(set(types)) == 1 else mixed_gpu(types)
        if out["gpu"] != expected:
            raise ValidationError(f"{where}.gpu", f"expected {expected!r} for nodes of {sorted(set(types))}, got "
                                  f"{out['gpu']!r}")
        out["gpu_by_node"] = list(types)
    elif "+" in out["gpu"]:
        raise ValidationError(f"{where}.gpu_by_node", "required for a step of several GPU types")
    if "rank_batches" in record:
        batches = record["rank_batches"]
        if not isinstance(batches, list) or len(batches) != sum(layout) or not all(
                isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 65536 for b in batches):
            raise ValidationError(f"{where}.rank_batches", f"expected {sum(layout)} local batches in 1..65536 (one "
                                  f"per rank of the layout), got {str(batches)[:120]}")
        out["rank_batches"] = list(batches)


def is_mixed(record: dict) -> bool:
    """A step row of several GPU types: it is no one type's step time."""
    return len(set(record.get("gpu_by_node") or ())) > 1


def validate_ddp_overhead(record: Any, where: str) -> dict:
    """Check one ddp_overhead record (a calibration probe) and return its normalised copy.

    Raises:
        ValidationError: naming `where.<field>`.
    """
    _fields(record, _DDP_OVERHEAD, where)
    out = {"kind": "ddp_overhead", "gpu": _str(record, "gpu", where), "world": _int(record, "world", where, 1, MAX_WORLD),
           "probe": _str(record, "probe", where, NAME_RE),
           "tensors": _int(record, "tensors", where, 1, MAX_TENSORS),
           "plain_s": _seconds(record, "plain_s", where, low=MIN_STEP_SECONDS),
           "ddp_s": _seconds(record, "ddp_s", where, low=MIN_STEP_SECONDS)}
    out["buckets"] = _int(record, "buckets", where, 1, out["tensors"])   # every bucket holds a tensor at least
    extra = record["extra_s"]
    if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not math.isfinite(extra):
        raise ValidationError(f"{where}.extra_s", f"expected finite seconds, got {extra!r}")
    if not -out["plain_s"] <= extra <= out["ddp_s"]:   # ddp_s - plain_s, or a paired median of it
        raise ValidationError(f"{where}.extra_s", f"{extra:g} s is outside [-plain_s, ddp_s] = "
                                                  f"[{-out['plain_s']:g}, {out['ddp_s']:g}]")
    out["extra_s"] = float(extra)
    if "bytes" in record:             # the probe's gradient bytes (its buckets' sum): DDP copies each one twice
        out["bytes"] = _int(record, "bytes", where, 1, MAX_BYTES)
    _optional(record, out, where)
    return out


def validate_restart(record: Any, where: str) -> dict:
    """Check one restart record (a restart resize's measured cost) and return its normalised copy.

    Raises:
        ValidationError: naming `where.<field>`.
    """
    _fields(record, _RESTART, where)
    out = {"kind": "restart", "from_nodes": _int(record, "from_nodes", where, 1, MAX_NODES),
           "to_nodes": _int(record, "to_nodes", where, 1, MAX_NODES), "cost_s": _seconds(record, "cost_s", where)}
    if out["to_nodes"] == out["from_nodes"]:
        raise ValidationError(f"{where}.to_nodes", f"a resize changes the node count: from_nodes is "
                                                   f"{out['from_nodes']} too")
    if not isinstance(record["checkpointed"], bool):
        raise ValidationError(f"{where}.checkpointed", f"expected true or false, got {record['checkpointed']!r}")
    out["checkpointed"] = record["checkpointed"]
    if "profile" in record:
        out["profile"] = _str(record, "profile", where, NAME_RE)
    if "world" in record:
        out["world"] = _int(record, "world", where, 1, MAX_WORLD)
    if "checkpoint_s" in record:      # the signal to the checkpoint: part of the cost
        value = record["checkpoint_s"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= out["cost_s"]:
            raise ValidationError(f"{where}.checkpoint_s", f"expected seconds in [0, cost_s={out['cost_s']:g}], "
                                                           f"got {value!r}")
        out["checkpoint_s"] = float(value)
    _optional(record, out, where)
    return out


KINDS = {"collective": validate_collective, "step": validate_step, "ddp_overhead": validate_ddp_overhead,
         "restart": validate_restart}
FITTED = ("collective", "step", "ddp_overhead")           # the kinds the step model is fitted on (predictor.engine)


def validate_record(record: Any, where: str) -> dict:
    """Dispatch on `kind`.

    Raises:
        ValidationError: unknown kind or a bad field.
    """
    if not isinstance(record, dict):
        raise ValidationError(where, f"expected an object, got {type(record).__name__}")
    kind = record.get("kind")
    if isinstance(kind, str) and kind in KINDS:
        return KINDS[kind](record, where)
    raise ValidationError(f"{where}.kind", f"expected one of {', '.join(map(repr, KINDS))}, got {kind!r}")


def validate_batch(records: Any, field: str = "observations") -> list[dict]:
    """Validate a whole POST body; nothing is returned unless every record is valid.

    Raises:
        ValidationError: the first bad record, e.g. `observations[2].seconds`.
    """
    if isinstance(records, dict) and set(records) == {"observations"}:
        records = records["observations"]
    if not isinstance(records, list):
        raise ValidationError(field, "expected a list of observation records")
    if not records:
        raise ValidationError(field, "expected at least one record")
    if len(records) > MAX_BATCH:
        raise ValidationError(field, f"at most {MAX_BATCH} records per request, got {len(records)}")
    return [validate_record(record, f"{field}[{index}]") for index, record in enumerate(records)]
