"""What the Lua reads of `#ELASTIC` lines (slurm_plugin/lua/elastic_common.lua) under apt's lua5.1, against the
Python parser (slurm_plugin/contracts/directives.py) on the shared vectors and on generated scripts.

The hook parses no directive (the service does, #26.3): it finds the lines of the directive block
(`M.directive_lines`, what it sends) and, for the decision bands, the one `min_efficiency=<v>` value of a request
(`M.cache_key`). Both must read as the Python parser does: the same lines with the same numbers, and a band value
only where the service reads that same value.
"""
import json
import pathlib
import random
import re
import subprocess

import pytest

from slurm_plugin.contracts.directives import directive_lines, parse_script
from slurm_plugin.errors import DirectiveError

ROOT = pathlib.Path(__file__).parents[2]
LUA_DIR = ROOT / "slurm_plugin" / "lua"
VECTORS = json.loads((ROOT / "tests" / "vectors" / "directives.json").read_text())

# A JSON list of scripts on stdin; one {lines = {{no, line}...}, v = "%.17g" or nil} a script on stdout.
DRIVER = r"""
local cjson = require("cjson")
local M = dofile(LUA_DIR .. "/elastic_common.lua")
local out = {}
for i, script in ipairs(cjson.decode(io.read("*a"))) do
  local lines, raw = {}, {}
  for j, entry in ipairs(M.directive_lines(script)) do lines[j], raw[j] = { entry.no, entry.line }, entry.line end
  local _, masked, v = M.cache_key({ source = "job_submit", directives = raw, job = {} })
  assert((masked == nil) == (v == nil))
  out[i] = { lines = lines, v = v and string.format("%.17g", v) or cjson.null }
end
io.write(cjson.encode(out))
"""


def lua_read(scripts: list[str]) -> list[dict]:
    """The Lua reading of every script, in one lua5.1 process."""
    code = f"LUA_DIR = {json.dumps(str(LUA_DIR))}\n" + DRIVER
    proc = subprocess.run(["lua5.1", "-e", code], input=json.dumps(scripts).encode(), capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    got = json.loads(proc.stdout)
    assert len(got) == len(scripts)
    return [{"lines": [tuple(x) for x in g["lines"] or []], "v": None if g["v"] is None else float(g["v"])}
            for g in got]


_TOKEN = re.compile(r"(?<=[ \t\v\f\r])min_efficiency=([^ \t\v\f\r\n]+)")


def disagreement(script: str, lua: dict) -> str | None:
    """How the Lua reading of `script` differs from the Python parser's, or None.

    Lines: the same (number, line) pairs. Band value: when Lua reads one, the service either rejects the script
    (a band is only looked up under the key of a request it accepted) or reads the same value, or none where the
    token stood in a comment (the service sends no bands then); and with any other valid value in its place the
    script reads that value. When the service reads a min_efficiency from a line holding the only such token, Lua
    reads it too (else every such request would ask the service).
    """
    expect = [tuple(x) for x in directive_lines(script)]
    if lua["lines"] != expect:
        return f"lines: python {expect}, lua {lua['lines']}"
    try:
        parsed = parse_script(script)
    except DirectiveError:
        return None
    wanted = (parsed or {}).get("min_efficiency")
    tokens = [m for _, line in expect for m in _TOKEN.findall(line)]
    if lua["v"] is None:
        return f"band value: python {wanted}, lua none" if wanted is not None and len(tokens) == 1 else None
    if wanted is None:
        return None
    if lua["v"] != wanted:
        return f"band value: python {wanted}, lua {lua['v']}"
    other = _TOKEN.sub("min_efficiency=.25", script)
    if parse_script(other).get("min_efficiency") != 0.25:
        return "another value in its place does not read as that value"
    return None


def generated_scripts(count, seed):
    rng = random.Random(seed)
    keys = ["model", "gpus", "per_gpu_batch", "min_efficiency", "min_efficiency", "objective", "colour", ""]
    values = ["", "0", "1", "007", "64", "2-16", "8-2", "0.5", ".5", "1.0", "1.5", "0.", "1e-3", "0x1", "nan",
              "-0.5", "0.5#x", "resnet50", "cost", "x'y", "0.99999999999999999999"]
    valid = {"model": "resnet50", "gpus": "2-8", "per_gpu_batch": "64", "min_efficiency": "0.7", "objective": "cost"}
    prefixes = ["#ELASTIC "] * 6 + ["#ELASTIC\t", "#ELASTIC", "#ELASTICX ", " #ELASTIC ", "#SBATCH -N1 ", "# "]
    scripts = []
    for _ in range(count):
        lines = ["#!/bin/bash"]
        for _ in range(rng.randint(1, 4)):
            tokens = []
            for _ in range(rng.randint(0, 3)):
                key = rng.choice(keys)
                value = valid.get(key, "") if rng.random() < 0.7 else rng.choice(values)
                tokens.append(rng.choice([f"{key}={value}"] * 8 + [key, "#" + key, "# " + key + "=" + value]))
            lines.append(rng.choice(prefixes) + rng.choice([" ", "\t", "  "]).join(tokens))
        if rng.random() < 0.3:
            lines.insert(rng.randint(1, len(lines)), "echo start")
        scripts.append(rng.choice(["\n", "\r\n", "\r"]).join(lines) + rng.choice(["\n", "\r\n", ""]))
    return scripts


@pytest.fixture(scope="module")
def lua_results():
    return lua_read([v["script"] for v in VECTORS])


@pytest.mark.parametrize("index", range(len(VECTORS)), ids=[v["name"] for v in VECTORS])
def test_vector(lua_results, index):
    assert disagreement(VECTORS[index]["script"], lua_results[index]) is None


def test_lua_reads_as_python_on_generated_scripts():
    scripts = generated_scripts(500, seed=5)
    found = [(s, what) for s, got in zip(scripts, lua_read(scripts)) if (what := disagreement(s, got))]
    assert not found, found[:5]
    assert sum(got["v"] is not None for got in lua_read(scripts)) > 50     # the band value is exercised


def test_a_band_value_needs_exactly_one_valid_token():
    scripts = ["#ELASTIC model=x min_efficiency=0.5\n", "#ELASTIC min_efficiency=0.5 min_efficiency=0.6\n",
               "#ELASTIC min_efficiency=0.5\n#ELASTIC min_efficiency=0.6\n", "#ELASTIC min_efficiency=1.5\n",
               "#ELASTIC min_efficiency=0x1\n", "#ELASTIC min_efficiency=1e-1\n", "#ELASTIC min_efficiency=.5\n",
               "#ELASTIC gpus=2 # min_efficiency=0.5\n", "#ELASTIC xmin_efficiency=0.5\n"]
    assert [got["v"] for got in lua_read(scripts)] == [0.5, None, None, None, None, None, 0.5, 0.5, None]


def test_disagreement_check_can_fail():
    script = "#ELASTIC gpus=2-4 min_efficiency=0.5\n"
    assert disagreement(script, {"lines": [(1, script.strip())], "v": 0.5}) is None
    assert "lines" in disagreement(script, {"lines": [], "v": 0.5})
    assert "band value" in disagreement(script, {"lines": [(1, script.strip())], "v": 0.6})
    assert "band value" in disagreement(script, {"lines": [(1, script.strip())], "v": None})


def _header(comment_lines: int, width: int = 1, tail: str = "#ELASTIC gpus=2\n", end: str = "\n") -> str:
    """A script of `comment_lines` comment lines of `width` characters (with the line end), then `tail`."""
    return "#" * (width - len(end)) + end if comment_lines == 1 else ("#" * (width - len(end)) + end) * comment_lines + tail


@pytest.mark.parametrize("script, read", [
    (_header(1023), True),                                   # the directive is line 1024: read
    (_header(1024), False),                                  # line 1025: past the line cap
    (_header(64, width=1024), False),                        # 64 KiB of comments, then the directive
    (_header(63, width=1024, tail="#ELASTIC gpus=2\n"), True),
    (_header(63, width=1024, tail="#ELASTIC " + "x" * (1024 - 10) + "\n"), True),    # ends at byte 65536
    (_header(63, width=1024, tail="#ELASTIC " + "x" * (1024 - 9) + "\n"), False),    # its line end is past it
    (_header(63, width=1024, tail="#ELASTIC " + "x" * 1000 + "é" * 8 + "\n"), False),  # cut inside a character
    (_header(32, width=2048, end="\r\n"), False),
    ("#ELASTIC gpus=2\n" + "#" * (2 << 20) + "\n", True),    # a 2 MB comment after it
], ids=["line-1024", "line-1025", "64KiB-then", "63KiB-then", "ends-at-cap", "ends-past-cap", "cut-char", "crlf",
        "2MB-after"])
def test_the_header_is_read_up_to_its_caps_alike_in_both_languages(script, read):
    """#41.11: the scan stops at MAX_HEADER_LINES lines and at MAX_HEADER_BYTES bytes (a line must end within them),
    in the hook and in the Python parser alike."""
    [lua] = lua_read([script])
    assert disagreement(script, lua) is None
    assert bool(lua["lines"]) == read


def test_the_scan_says_where_a_cap_stopped_it():
    code = f"LUA_DIR = {json.dumps(str(LUA_DIR))}\n" + r"""
local M = dofile(LUA_DIR .. "/elastic_common.lua")
local function at(script) local _, capped = M.directive_lines(script); return tostring(capped) end
print(at(string.rep("#\n", 2000)), at(string.rep("#\n", 1024)), at(string.rep("#" .. string.rep("x", 99) .. "\n", 700)),
      at("#!/bin/bash\n" .. string.rep("x", 70000)), at("#!/bin/bash\n#" .. string.rep("x", 70000)))
"""
    proc = subprocess.run(["lua5.1", "-e", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.rstrip("\n").split("\t") == ["line 1025", "nil", "byte 65536", "nil", "byte 65536"], proc.stderr
