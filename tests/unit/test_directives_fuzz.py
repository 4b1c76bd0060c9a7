"""Differential fuzzing of what the hook reads of `#ELASTIC` lines (slurm_plugin/lua/elastic_common.lua, under
apt's lua5.1: the lines of the directive block and a request's one min_efficiency value for the decision bands)
against the Python parser (slurm_plugin/contracts/directives.py), which the service runs (docs/directives.md).

Both get the SAME batch of scripts: hypothesis-generated ones (derandomized, so CI sees the same cases every
run) and structured mutations of the valid vectors in tests/vectors/directives.json (random and duplicate keys,
unicode, huge/negative/float numbers, reversed ranges, empty values, odd whitespace and line ends, `#ELASTIC`
after commands and inside heredocs, very long lines, NUL bytes, trailing garbage). The Lua runs once per batch.
For every script: the same lines with the same numbers, and a band value only where the service reads that
value (tests/unit/test_lua_directives.py `disagreement`).

`python -m tests.unit.test_directives_fuzz --count N` prints a summary table and writes nothing.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from slurm_plugin.contracts.directives import KEYS, parse_script
from slurm_plugin.errors import DirectiveError
from tests.unit.test_lua_directives import disagreement, lua_read

ROOT = pathlib.Path(__file__).parents[2]
VECTORS = json.loads((ROOT / "tests" / "vectors" / "directives.json").read_text())
VALID_SCRIPTS = [v["script"] for v in VECTORS if v.get("result")]

KEY_NAMES = sorted(KEYS)
EDGE_VALUES = [
    "", "0", "1", "-1", "-", "1-", "-4", "8-2", "2-8", "2-2", "0-4", "4-0", "1--2", "1-2-3", "1-4096", "4096",
    "4097", "65536", "65537", "16777216", "16777217", "9" * 30, "0" * 50 + "1", "08", "+4", "1_000", "1e3",
    "0x10", "1.0", "1.", ".5", "0.5", "00.5", "1.5", "-0.5", "0.000", "0.99999999999999999999",
    "1.00000000000000000001", "0." + "0" * 400 + "1", "1" * 400 + ".5", "nan", "inf", "\u0663", "\uff14",
    "\u00e9", "on", "off", "ON", "cost", "sqrt", "none", "linear", "grow_global", "keep_global", "throughput",
    "efficiency", "resnet50", "torchvision:resnet50", "a:b/c+d-e.f_g", "a" * 128, "a" * 129, "H100", "x" * 64,
    "x" * 65, "res;net", "x'y", 'x"y', "x'\"y", "\\", "=", "==", "a=b", "4#x", "\x00", "4\x00", "\x7f",
    "\U0001F600", "r\u00e9snet",
]
# Characters that are whitespace or line ends to one language or the other (or to neither).
SPACES = [" ", "\t", "  ", "\v", "\f", "\x1c", "\x1f", "\xa0", "\u2003", "\x85", "\u3000", "\x00"]
LINE_ENDS = ["\n", "\r\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\n\r"]
PREFIXES = ["#ELASTIC ", "#ELASTIC\t", "#ELASTIC", "#ELASTIC\v", "#ELASTIC\f", "#ELASTIC\xa0", "#ELASTICX ",
            " #ELASTIC ", "\t#ELASTIC ", "#elastic ", "#ELASTIC=", "\ufeff#ELASTIC ", "#ELASTIC\x00"]
OTHER_LINES = ["", " ", "\t", "\v", "\f", "\xa0", "\x1c", "\u3000", "#SBATCH -N1", "# note", "#!/bin/bash",
               "echo start", "cat <<EOF", "EOF", "  # indented comment", "\x00", "#"]


# ---------------------------------------------------------------- both readings
def python_kind(script: str) -> str:
    try:
        return "none" if parse_script(script) is None else "accepted"
    except DirectiveError:
        return "rejected"


def run_batch(scripts: list[str]) -> tuple[dict, list[tuple[str, str]]]:
    """Both readings of `scripts`: counts by the service's verdict and the (script, what differs) pairs."""
    counts = {"cases": len(scripts), "none": 0, "accepted": 0, "rejected": 0, "band values": 0, "disagreements": 0}
    found = []
    for script, lua in zip(scripts, lua_read(scripts)):
        counts[python_kind(script)] += 1
        counts["band values"] += lua["v"] is not None
        try:
            what = disagreement(script, lua)
        except Exception as exc:  # noqa: BLE001 - a crash of the Python side is a finding, reported as such
            what = f"python crashed: {exc!r}"
        if what:
            counts["disagreements"] += 1
            found.append((script, what))
    return counts, found


# ---------------------------------------------------------------- structured mutations of the valid vectors
def _token(rng: random.Random) -> str:
    shape = rng.random()
    key = rng.choice(KEY_NAMES) if shape < 0.8 else rng.choice(["colour", "", "GPUS", "gpus ", "mod\u00e9l", "#x"])
    value = rng.choice(EDGE_VALUES)
    if rng.random() < 0.05:
        return key
    return f"{key}={value}"


def _mutate(script: str, rng: random.Random) -> str:
    lines = script.split("\n")
    directive_at = [i for i, line in enumerate(lines) if line.startswith("#ELASTIC")] or [0]
    at = rng.choice(directive_at)
    op = rng.randrange(14)
    if op == 0:      # a random, maybe unknown or duplicate, key on an existing or a new line
        if rng.random() < 0.5:
            lines[at] += " " + _token(rng)
        else:
            lines.insert(at + 1, "#ELASTIC " + _token(rng))
    elif op == 1:    # duplicate a token, here or on the next line
        tokens = lines[at].split(" ")[1:] or ["gpus=4"]
        lines.insert(at + rng.randint(0, 1), "#ELASTIC " + rng.choice(tokens))
    elif op == 2:    # replace a value with an edge value
        lines[at] = re.sub(r"=[^ \t]*", lambda m: "=" + rng.choice(EDGE_VALUES), lines[at], count=1)
    elif op == 3:    # odd separators
        lines[at] = lines[at].replace(" ", rng.choice(SPACES), rng.randint(1, 3))
    elif op == 4:    # odd line ends
        return rng.choice(LINE_ENDS).join(lines)
    elif op == 5:    # a command (or heredoc) and then a directive that must be ignored
        body = rng.choice([["echo start"], ["cat <<EOF", "#ELASTIC gpus=oops", "EOF"], ["srun x # #ELASTIC"]])
        lines[at + 1:at + 1] = body + ["#ELASTIC " + _token(rng)]
    elif op == 6:    # a very long line
        lines[at] += rng.choice([" model=", " gpu_type=", " x=", " gpus=1-", " "]) + rng.choice("a9 ") * 20000
    elif op == 7:    # NUL bytes and control characters anywhere
        pos = rng.randrange(len(lines[at]) + 1)
        lines[at] = lines[at][:pos] + rng.choice(["\x00", "\x01", "\x1b[0m", "\x7f", "\x00\x00"]) + lines[at][pos:]
    elif op == 8:    # trailing garbage after a token or the line
        lines[at] += rng.choice(["", " "]) + rng.choice(["x", "#", "# c", ";rm -rf", "\u00e9", "=", "\U0001F600"])
    elif op == 9:    # odd prefixes
        lines[at] = rng.choice(PREFIXES) + lines[at][len("#ELASTIC "):]
    elif op == 10:   # odd blank or comment lines before the directives
        lines.insert(rng.randint(0, at), rng.choice(OTHER_LINES))
    elif op == 11:   # unicode inside a token
        pos = rng.randrange(len(lines[at]) + 1)
        lines[at] = lines[at][:pos] + rng.choice(["\u00e9", "\u2028", "\u0663", "\uff14", "\u200b", "\xad"]) \
            + lines[at][pos:]
    elif op == 12:   # truncated script
        return "\n".join(lines)[:rng.randrange(len(script) + 1)]
    else:            # a brand-new directive line of a few random tokens
        lines.insert(at, rng.choice(PREFIXES) + rng.choice(SPACES).join(_token(rng) for _ in range(rng.randint(0, 4))))
    return "\n".join(lines)


def mutated_scripts(count: int, seed: int = 8) -> list[str]:
    rng = random.Random(seed)
    scripts = []
    for _ in range(count):
        script = rng.choice(VALID_SCRIPTS)
        for _ in range(rng.randint(1, 3)):
            script = _mutate(script, rng)
        scripts.append(script)
    return scripts


# ---------------------------------------------------------------- hypothesis-generated scripts
def _number_text(low: int, high: int):
    return st.one_of(st.integers(low, high).map(str), st.integers(-5, 10 ** 25).map(str))


# Values that are often valid for their key (so that whole scripts get accepted) and often just off.
_VALUES = {
    "model": st.from_regex(r"[A-Za-z0-9_.:/+;-]{0,130}", fullmatch=True),
    "gpu_type": st.from_regex(r"[A-Za-z0-9_.:-]{0,66}", fullmatch=True),
    "gpus": st.one_of(_number_text(0, 4100), st.builds("{}-{}".format, st.integers(-1, 4100), st.integers(0, 4100))),
    "per_gpu_batch": _number_text(0, 65540),
    "max_global_batch": _number_text(0, 2 ** 24 + 2),
    "min_efficiency": st.one_of(st.floats(0, 1.1).map(repr), st.floats(0, 1).map("{:.3f}".format),
                                st.floats().map(repr), st.from_regex(r"[0-9]{0,3}\.?[0-9]{0,20}", fullmatch=True)),
    "objective": st.sampled_from(["throughput", "efficiency", "cost", "Cost", "speed"]),
    "elastic": st.sampled_from(["on", "off", "yes"]),
    "batch_policy": st.sampled_from(["grow_global", "keep_global", "grow"]),
    "lr_scaling": st.sampled_from(["linear", "sqrt", "none", "log"]),
    "mode": st.sampled_from(["inprocess", "restart", "Restart", "torchrun"]),
}
_ODD = st.text(alphabet=st.sampled_from(list("ab09-.=#:_ \t\x00\x0b\x0c\x1c\x85\xa0\u2028\u3000\u00e9'\"\\")),
               max_size=12)


def _script_strategy():
    good = st.sampled_from(KEY_NAMES).flatmap(lambda k: _VALUES[k].map(lambda v: f"{k}={v}"))
    token = st.one_of(good, good, good, good, st.builds("{}={}".format, _ODD, st.sampled_from(EDGE_VALUES)),
                      _ODD, st.text(max_size=10))
    directive = st.builds(lambda p, sep, toks: p + sep.join(toks), st.sampled_from(["#ELASTIC "] * 8 + PREFIXES),
                          st.sampled_from([" "] * 8 + SPACES), st.lists(token, max_size=4))
    line = st.one_of(directive, directive, directive, directive, st.sampled_from(OTHER_LINES), _ODD)
    return st.builds(lambda lines, end, last: end.join(lines) + last, st.lists(line, min_size=1, max_size=5),
                     st.sampled_from(["\n"] * 8 + LINE_ENDS), st.sampled_from(["", "\n", "\r\n"]))


def hypothesis_scripts(count: int) -> list[str]:
    """`count` scripts from the strategy, the same ones every run (derandomized, no example database)."""
    scripts: list[str] = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_script_strategy())
    def collect(script):
        scripts.append(script)

    collect()
    return scripts


def fuzz_scripts(count: int, seed: int = 8) -> list[str]:
    return hypothesis_scripts(count // 2) + mutated_scripts(count - count // 2, seed)


# ---------------------------------------------------------------- tests
@pytest.mark.slow  # 4,000 fuzzed scripts through both
def test_lua_reads_fuzzed_scripts_as_python():
    counts, found = run_batch(fuzz_scripts(4000))
    assert counts["accepted"] > 200 and counts["rejected"] > 1000 and counts["none"] > 200, counts
    assert counts["band values"] > 100, counts
    assert not found, "\n".join(f"{what}\n  script={script[:300]!r}" for script, what in found[:10])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4000, help="scripts to try (half hypothesis, half mutations)")
    parser.add_argument("--seed", type=int, default=8, help="seed of the mutations (the test uses 8)")
    parser.add_argument("--show", type=int, default=5, help="disagreements to print")
    args = parser.parse_args(argv)
    counts, found = run_batch(fuzz_scripts(args.count, args.seed))
    print("| " + " | ".join(counts) + " |")
    print("|" + "---|" * len(counts))
    print("| " + " | ".join(str(v) for v in counts.values()) + " |")
    for script, what in found[:args.show]:
        print(f"- {what}\n  script={script[:300]!r}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
