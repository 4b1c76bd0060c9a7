"""Slurm host lists, parsed in one place: `node[1-3,05],gpu7` <-> node names.

The client reads them from Slurm's output (squeue, scontrol) and writes them back (`NodeList=`); the predictor
reads them from the cluster description an admin writes. Both use :func:`expand` and :func:`compress`.
"""
from __future__ import annotations

import re

__all__ = ["HostlistError", "expand", "compress", "split_top"]

_NAME_RE = re.compile(r"[A-Za-z0-9_.:+-]{1,64}")
_GROUP_RE = re.compile(r"([A-Za-z0-9_.:+-]*)\[([0-9,\-]+)\]([A-Za-z0-9_.:+-]*)")


class HostlistError(ValueError):
    """A malformed host list; the message names the part."""


def split_top(expr: str) -> list[str]:
    """Split on commas outside brackets and parentheses: `a[1-2],b3` -> [`a[1-2]`, `b3`],
    `gpu:2(IDX:0,2),nic:1` -> [`gpu:2(IDX:0,2)`, `nic:1`] (empty parts dropped)."""
    parts, depth, cur = [], 0, ""
    for ch in expr:
        depth += (ch in "[(") - (ch in "])")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in (s.strip(" \t\n\v\f\r") for s in parts) if p]  # ASCII whitespace, as Lua's %s


def expand(spec: str) -> list[str]:
    """`node[1-2,4],gpu07` -> [node1, node2, node4, gpu07]; a zero-padded bound (`[08-10]`) keeps its width.

    Raises:
        HostlistError: a part that is neither a name nor `prefix[ranges]suffix`, a bad range, or a node named
            twice (`n[1-2],n2`).
    """
    names: list[str] = []
    for part in split_top(spec):
        match = _GROUP_RE.fullmatch(part)
        if match is None:
            if not _NAME_RE.fullmatch(part):
                raise HostlistError(f"not a host name or host list: {part!r}")
            names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or (high and not high.isdigit()) or int(high or low) < int(low):
                raise HostlistError(f"bad range {item!r} in {part!r}")
            width = len(low) if low.startswith("0") else 0
            names.extend(f"{prefix}{number:0{width}d}{suffix}" for number in range(int(low), int(high or low) + 1))
    if len(set(names)) != len(names):
        raise HostlistError(f"host list {spec!r} names a node twice")
    return names


def compress(names) -> str:
    """Inverse of :func:`expand`: [node1, node2, node4] -> `node[1-2,4]`."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain = []
    for name in sorted(set(names)):
        m = re.fullmatch(r"(.*?)(\d+)", name)
        if m:
            width = len(m.group(2)) if m.group(2).startswith("0") else 0
            groups.setdefault((m.group(1), width), []).append(int(m.group(2)))
        else:
            plain.append(name)
    parts = list(plain)
    for (prefix, width), nums in sorted(groups.items()):
        nums.sort()
        if len(nums) == 1:
            parts.append(f"{prefix}{nums[0]:0{width}d}")
            continue
        runs, start = [], nums[0]
        for prev, cur in zip(nums, nums[1:] + [None]):
            if cur != prev + 1:
                runs.append(f"{start:0{width}d}" + (f"-{prev:0{width}d}" if prev != start else ""))
                start = cur
        parts.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(parts)
