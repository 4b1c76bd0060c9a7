"""The Lua directive parser (slurm_plugin/lua/elastic_common.lua) under apt's lua5.1, against the same
vectors as the Python parser, and message for message against the Python parser on generated scripts."""
import json
import pathlib
import random
import subprocess

import pytest

from slurm_plugin.directives import parse_script
from slurm_plugin.errors import DirectiveError

ROOT = pathlib.Path(__file__).parents[2]
LUA_DIR = ROOT / "slurm_plugin" / "lua"
VECTORS = json.loads((ROOT / "tests" / "vectors" / "directives.json").read_text())

# Parses the JSON list SCRIPTS, prints one JSON result per script; arg[1] is the Lua directory.
DRIVER = r"""
local cjson = require("cjson")
local M = dofile(arg[1] .. "/elastic_common.lua")
local out = {}
for i, script in ipairs(cjson.decode(SCRIPTS)) do
  local lines = M.directive_lines(script)
  if #lines == 0 then
    out[i] = { result = cjson.null }
  else
    local result, err = M.parse_lines(lines)
    if result then
      out[i] = { result = result }
    else
      out[i] = { error = err }
    end
  end
end
io.write(cjson.encode(out))
"""


def lua_parse(scripts):
    """Run the Lua parser over `scripts` in one lua5.1 process; returns one dict per script."""
    code = ("arg = {[1] = %s}\n" % json.dumps(str(LUA_DIR))) + DRIVER
    code = "SCRIPTS = %s\n" % _lua_string(json.dumps(scripts)) + code
    proc = subprocess.run(["lua5.1", "-"], input=code, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _lua_string(text):
    level = "=" * 8
    assert f"]{level}]" not in text
    return f"[{level}[\n{text}]{level}]"


@pytest.fixture(scope="module")
def lua_results():
    return lua_parse([v["script"] for v in VECTORS])


@pytest.mark.parametrize("index", range(len(VECTORS)), ids=[v["name"] for v in VECTORS])
def test_vector(lua_results, index):
    vector, got = VECTORS[index], lua_results[index]
    if "error" in vector:
        assert "error" in got, got
        assert got["error"]["line_no"] == vector["error"]["line"]
        assert vector["error"]["contains"] in got["error"]["message"]
        assert got["error"]["line"] in vector["script"]
    else:
        assert got.get("result") == vector["result"]


def test_vectors_cover_both_outcomes():
    assert any("error" in v for v in VECTORS) and any("error" not in v for v in VECTORS)


def _generated_scripts(count, seed):
    rng = random.Random(seed)
    keys = ["model", "gpus", "per_gpu_batch", "max_global_batch", "min_efficiency", "gpu_type",
            "objective", "elastic", "batch_policy", "lr_scaling", "colour", ""]
    values = ["", "0", "1", "007", "64", "65537", "2-16", "8-2", "1-2-3", "-4", "4-", "0.5", ".5", "1.0",
              "1.5", "nan", "H100", "res;net", "resnet50", "torchvision:resnet50", "a" * 130, "on", "off",
              "cost", "speed", "sqrt", "grow_global", "x'y", "99999999999999999999"]
    valid = {"model": "resnet50", "gpus": "2-8", "per_gpu_batch": "64", "max_global_batch": "4096",
             "min_efficiency": "0.7", "gpu_type": "H100", "objective": "cost", "elastic": "off",
             "batch_policy": "keep_global", "lr_scaling": "linear"}
    prefixes = ["#ELASTIC "] * 6 + ["#ELASTIC\t", "#ELASTIC", "#ELASTICX ", " #ELASTIC ", "#SBATCH -N1 ", "# "]
    scripts = []
    for _ in range(count):
        lines = ["#!/bin/bash"]
        for _ in range(rng.randint(1, 4)):
            tokens = []
            for _ in range(rng.randint(0, 3)):
                shape = rng.random()
                key = rng.choice(keys)
                value = valid.get(key, "") if rng.random() < 0.7 else rng.choice(values)
                if shape < 0.1:
                    tokens.append(key)
                elif shape < 0.15:
                    tokens.append("#" + key)
                else:
                    tokens.append(f"{key}={value}")
            lines.append(rng.choice(prefixes) + " ".join(tokens))
        if rng.random() < 0.3:
            lines.insert(rng.randint(1, len(lines)), "echo start")
        scripts.append("\n".join(lines) + rng.choice(["\n", "\r\n", ""]))
    return scripts


def test_lua_matches_python_message_for_message():
    scripts = _generated_scripts(400, seed=5)
    for script, got in zip(scripts, lua_parse(scripts)):
        try:
            expected = parse_script(script)
        except DirectiveError as exc:
            assert "error" in got, (script, got)
            assert got["error"]["message"] == str(exc), script
            assert got["error"]["line_no"] == exc.line_no
        else:
            assert got.get("result") == expected, script
