"""Parser for `#ELASTIC` batch-script directives (grammar: docs/directives.md).

The Lua hooks implement the same grammar; both are checked against tests/vectors/directives.json.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from slurm_plugin.errors import DirectiveError

PREFIX = "#ELASTIC"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/+-]{1,128}\Z")
_GPU_TYPE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")
_INT_RE = re.compile(r"^[0-9]+\Z")
_DECIMAL_RE = re.compile(r"^(?:[0-9]+(\.[0-9]+)?|\.[0-9]+)\Z")
# docs/directives.md, as sbatch reads #SBATCH (Slurm 22.05, checked on the lab): lines end at \n only, so a lone \r
# ends no line; whitespace is space, tab, \v, \f and \r (C's isspace less \n; ASCII only, as Lua's %s).
_SPACE = " \t\v\f\r"
_TOKEN_RE = re.compile(f"[^{_SPACE}]+")
_PREFIXES = (PREFIX + " ", PREFIX + "\t")    # as predictor/planner.py checks the lines the hooks send


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not _INT_RE.match(value):
            raise ValueError(f"expected an integer, got {value!r}")
        digits = value.lstrip("0") or "0"    # int() refuses more than 4300 digits: compare lengths first
        if len(digits) > len(str(hi)) or not lo <= int(digits) <= hi:
            raise ValueError(f"{digits} is outside {lo}..{hi}")
        return int(digits)
    return parse


def _choice(*options: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in options:
            raise ValueError(f"expected one of {'|'.join(options)}, got {value!r}")
        return value
    return parse


def _matching(pattern: re.Pattern, what: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if not pattern.match(value):
            raise ValueError(f"{value!r} is not a valid {what}")
        return value
    return parse


def _gpus(value: str) -> dict:
    parts = value.split("-")
    if len(parts) > 2:
        raise ValueError(f"expected N or MIN-MAX, got {value!r}")
    count = _int_in(1, 4096)
    low = count(parts[0])
    high = count(parts[-1])
    if low > high:
        raise ValueError(f"minimum {low} is above maximum {high}")
    return {"min": low, "max": high}


def _fraction(value: str) -> float:
    if not _DECIMAL_RE.match(value):
        raise ValueError(f"expected a decimal in [0, 1], got {value!r}")
    number = float(value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{value} is outside [0, 1]")
    return number


KEYS: dict[str, Callable[[str], Any]] = {
    "model": _matching(_NAME_RE, "model name"),
    "gpus": _gpus,
    "per_gpu_batch": _int_in(1, 65536),
    "max_global_batch": _int_in(1, 16777216),
    "min_efficiency": _fraction,
    "gpu_type": _matching(_GPU_TYPE_RE, "GPU type"),
    "objective": _choice("throughput", "efficiency", "cost"),
    "elastic": _choice("on", "off"),
    "batch_policy": _choice("grow_global", "keep_global"),
    "lr_scaling": _choice("linear", "sqrt", "none"),
    "mode": _choice("inprocess", "restart"),   # restart: torchrun's agent restarts the script at each resize (#43)
}


# The first lines of the script `sbatch --wrap` writes (Slurm 22.05, checked with `scontrol write batch_script`):
# sbatch reads no #SBATCH line in it, so the hook reads no #ELASTIC line either (#26.3).
WRAP_HEADER = "#!/bin/sh\n# This script was created by sbatch --wrap.\n"


# Only lines that end within the first MAX_HEADER_BYTES bytes (UTF-8), and the first MAX_HEADER_LINES lines, are
# read (#41.11: the hook scans under slurmctld's locks); elastic_common.lua holds the same two numbers.
MAX_HEADER_BYTES, MAX_HEADER_LINES = 65536, 1024


def directive_lines(script: str) -> list[tuple[int, str]]:
    """Return the `(line_no, line)` pairs of the script's directive block (1-based numbers), read where sbatch
    reads `#SBATCH`: up to the first line whose first non-whitespace character is not `#` (blank lines and
    comments, indented ones too, do not end it); none in the script of `sbatch --wrap` (WRAP_HEADER), none in a
    script whose lines end at a lone `\r` (one line, the `#!` line)."""
    found: list[tuple[int, str]] = []
    if script.startswith(WRAP_HEADER):
        return found
    data = script.encode("utf-8", "surrogateescape")
    cut = len(data) > MAX_HEADER_BYTES
    lines = (data[:MAX_HEADER_BYTES].decode("utf-8", "ignore") if cut else script).split("\n")
    if lines[-1] == "" or cut:
        lines.pop()    # a line end after the last line starts no new line; a line the cut ends is not read
    for number, line in enumerate(lines[:MAX_HEADER_LINES], start=1):
        text = line.lstrip(_SPACE)
        if text and not text.startswith("#"):
            break
        if line == PREFIX or line.startswith(_PREFIXES):
            found.append((number, line))
    return found


def parse_lines(lines: list[tuple[int, str]]) -> dict[str, Any]:
    """Parse numbered directive lines into a dict of typed values.

    Raises:
        DirectiveError: naming the line number, quoting the line and saying what is wrong.
    """
    result: dict[str, Any] = {}
    where: dict[str, tuple[int, str]] = {}  # key -> the line that gave it (for errors across keys)
    for number, line in lines:
        tokens = _TOKEN_RE.findall(line[len(PREFIX):])
        if tokens and tokens[0].startswith("#") or not tokens:
            raise DirectiveError(number, line, "no key=value after #ELASTIC")
        for token in tokens:
            if token.startswith("#"):
                break
            key, sep, value = token.partition("=")
            if not sep or not key or not value:
                raise DirectiveError(number, line, f"expected key=value, got {token!r}")
            if key not in KEYS:
                raise DirectiveError(number, line, f"unknown key {key!r} (known: {', '.join(sorted(KEYS))})")
            if key in result:
                raise DirectiveError(number, line, f"key {key!r} given twice")
            try:
                result[key] = KEYS[key](value)
            except ValueError as exc:
                raise DirectiveError(number, line, f"{key}: {exc}") from None
            where[key] = (number, line)
    cap, batch, gpus = result.get("max_global_batch"), result.get("per_gpu_batch"), result.get("gpus")
    if cap is not None and batch is not None and gpus is not None and cap < batch * gpus["min"]:
        raise DirectiveError(*where["max_global_batch"], f"max_global_batch {cap} is below per_gpu_batch {batch} x "
                             f"gpus min {gpus['min']} = {batch * gpus['min']}: no allowed size fits")
    return result


def line_of(lines: list[tuple[int, str]], key: str) -> tuple[int, str] | None:
    """The `(line_no, line)` of parsed `lines` that gives `key` (for errors found after parsing), None if none does."""
    for number, line in lines:
        for token in _TOKEN_RE.findall(line[len(PREFIX):]):
            if token.startswith("#"):
                break
            if token.partition("=")[0] == key:
                return number, line
    return None


def parse_script(script: str) -> dict[str, Any] | None:
    """Parse the directives of a batch script; None when it has no `#ELASTIC` line.

    Raises:
        DirectiveError: on the first malformed line.
    """
    lines = directive_lines(script)
    if not lines:
        return None
    return parse_lines(lines)
