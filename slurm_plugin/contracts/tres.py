"""Slurm's job_desc values and TRES/GRES strings read once for Python (issue #26.1): the job_submit hook posts
the job_desc fields as `/v1/plan`'s `job`, the planner reads the request's shape from them, and the Slurm client
reads nodes' GRES and jobs' TRES with the same functions. elastic_common.lua's `M.gpu_tres` is the Lua reading,
checked against the same vectors (tests/vectors/tres.json).
"""
from __future__ import annotations

import re
from typing import Mapping

from slurm_plugin.hostlist import split_top

# Slurm's sentinels and TRES strings stop here: the planner sees plain numbers and None.
NO_VAL = 0xFFFFFFFE          # "unset" in a 32-bit job_desc field (INFINITE, 0xFFFFFFFF, is above it)
NO_VAL16 = 0xFFFE            # "unset" in a 16-bit one (ntasks_per_node; INFINITE16 is NO_VAL16 + 1)


class TresError(ValueError):
    """A GPU entry of a TRES/GRES string that Slurm's grammar does not allow (the service answers 400)."""


# docs/directives.md's whitespace plus line ends: C's isspace in the C locale, Lua's %s (ASCII only)
_SPACE = " \t\n\v\f\r"
_DIGITS = re.compile(r"[0-9]+")                 # a field of ASCII digits is a count ("²" is not a digit here)
_COUNT = re.compile(r"[0-9]{1,10}")             # ... of at most 10 digits, at most MAX_COUNT
_GPU_TYPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # ASCII: `a100`, `nvidia_a100-sxm4-80gb`, MIG `1g.10gb`
MAX_COUNT = 2**31 - 1


def _count(text: str, item: str) -> int:
    if not _COUNT.fullmatch(text) or int(text) > MAX_COUNT:
        raise TresError(f"GPU entry {item!r}: count {text!r} is not a number in 0..{MAX_COUNT}")
    return int(text)


def _type(text: str, item: str) -> str:
    if not _GPU_TYPE.fullmatch(text):
        raise TresError(f"GPU entry {item!r}: type {text!r} is not 1-64 of A-Z a-z 0-9 _ . -")
    return text


def _gpu_item(item: str) -> tuple[str | None, int, bool] | None:
    """One TRES/GRES entry read as (GPU type or None, count, key=value form) when it is a GPU entry, None when it
    is another entry. The grammar (Slurm's `name[:type][:count]`, and the accounting `gres/gpu[:type]=count`):
    whitespace around the entry and a `(IDX:..)`/`(S:..)` suffix are ignored; `[gres:|gres/]gpu` then nothing
    (1 GPU), `=N`, `:N`, `:TYPE` (1 GPU, as Slurm counts a MIG profile such as `gpu:1g.10gb`), `:TYPE:N` or
    `:TYPE=N`. Counts are ASCII digits up to MAX_COUNT, types 1-64 of `[A-Za-z0-9_.-]`.

    Raises:
        TresError: a `gpu` entry outside that grammar (`gpu:²`, `gpu:a100:`, `gpu:a:1:2`, `gpu: a100`).
    """
    body = item.split("(", 1)[0].strip(_SPACE)
    body = body[5:] if body[:5] in ("gres:", "gres/") else body
    if body[:3] != "gpu" or body[3:4] not in ("", ":", "="):
        return None
    rest = body[3:]
    if rest == "":
        return None, 1, False
    if rest[0] == "=":
        return None, _count(rest[1:], item), True
    rest = rest[1:]
    if "=" in rest:
        head, _, count = rest.partition("=")
        return _type(head, item), _count(count, item), True
    fields = rest.split(":")
    if len(fields) == 1:
        if _DIGITS.fullmatch(rest):
            return None, _count(rest, item), False
        return _type(rest, item), 1, False
    if len(fields) == 2:
        return _type(fields[0], item), _count(fields[1], item), False
    raise TresError(f"GPU entry {item!r}: expected gpu[:type][:count], got {len(fields)} fields after gpu")


def gpu_items(tres: str | None) -> list[tuple[str | None, int, bool]]:
    """The GPU entries of a TRES/GRES list, in order (`_gpu_item`); entries are split at commas outside brackets
    and parentheses.

    Raises:
        TresError: a malformed GPU entry.
    """
    return [e for e in (_gpu_item(item) for item in split_top(tres or "")) if e]


def gpu_tres(tres: str | None) -> tuple[int | None, str | None]:
    """The one reading of GPUs in a TRES or GRES list (job_desc `tres_per_*`, sinfo's gres and gres_used,
    squeue/sacct TRES); tests/vectors/tres.json, which elastic_common.lua's `M.gpu_tres` passes too.

    Returns (GPU count, GPU type). Entries add up (`gres/gpu:a100:2,gres/gpu:h100:2` is 4), except in the
    accounting form, where an untyped `gres/gpu=N` is the total of the typed `gres/gpu:T=N` beside it. The
    count is None without a gpu entry (`gres:shard:2`, "", None); the type is the one type of the typed
    entries when no untyped request entry stands beside them, else None (`gpu_types` lists them all).

    Raises:
        TresError: a malformed GPU entry (`gres:gpu:²`).
    """
    items = gpu_items(tres)
    if not items:
        return None, None
    has_total = any(t is None and kv for t, _, kv in items)
    count = sum(n for t, n, kv in items if not (has_total and kv and t is not None))
    types = {t for t, _, _ in items if t is not None}
    untyped = any(t is None and not kv for t, _, kv in items)
    return count, (types.pop() if len(types) == 1 and not untyped else None)


def gpu_types(tres: str | None) -> list[str]:
    """The distinct GPU types a TRES/GRES list names, sorted (`gpu:h100:2,gpu:a100:1` -> [a100, h100]); a request
    of several is not rewritten (the hook would lose its types), it is kept as written.

    Raises:
        TresError: a malformed GPU entry.
    """
    return sorted({t for t, _, _ in gpu_items(tres) if t is not None})


def gpus_in_tres(tres: str | None) -> int | None:
    """GPUs in a TRES or GRES list (`gpu_tres`); None when it has no gpu entry."""
    return gpu_tres(tres)[0]


def gres_gpu_type(gres: str | None) -> str | None:
    """The GPU type of a node's GRES list (`gpu:h100:4(S:0)` -> `h100`); None when its GPUs are untyped
    (`gpu:4`), when it has none, or when it has GPUs of several types (`gpu_tres`)."""
    return gpu_tres(gres)[1]


def job_desc_number(key: str, value: int) -> int | None:
    """A job_desc integer as the job asked it, None for Slurm's "unset" (NO_VAL and above; NO_VAL16 and
    INFINITE16 in `ntasks_per_node`; 0 in `min_nodes`/`max_nodes`)."""
    if value >= NO_VAL or (key == "ntasks_per_node" and value in (NO_VAL16, NO_VAL16 + 1)):
        return None
    return None if value == 0 and key.endswith("nodes") else value


def requested_shape(job: Mapping) -> tuple[int | None, int | None, int | None]:
    """(nodes, GPUs per node, total GPUs) a job asked for, from its `min_nodes`, `tres_per_node` and
    `tres_per_job` (sentinels already read as None); each None when not derivable."""
    nodes = job.get("min_nodes")
    per_node = gpus_in_tres(job.get("tres_per_node"))
    total = gpus_in_tres(job.get("tres_per_job"))
    if total is None and per_node is not None:
        total = per_node * (nodes or 1)
    return nodes, per_node, total
