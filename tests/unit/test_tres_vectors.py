"""GPU counts in TRES/GRES strings, one reader a language, both against tests/vectors/tres.json (hand-written).

Python: slurm_plugin.contracts.tres (gpus_in_tres, gres_gpu_type, requested_shape). Lua (apt's lua5.1):
slurm_plugin/lua/elastic_common.lua (M.gpu_tres, M.set_gpu_tres, M.rewrite_fields) and cli_filter.lua
(option_tres). A property test generates TRES strings and checks that both read them alike and that what
the hook writes back reads as the count it meant, with one gpu entry and the other entries kept.
"""
from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_plugin.contracts.tres import gpus_in_tres, gres_gpu_type, requested_shape

ROOT = pathlib.Path(__file__).parents[2]
LUA_DIR = ROOT / "slurm_plugin" / "lua"
VECTORS = json.loads((ROOT / "tests" / "vectors" / "tres.json").read_text())

# stdin: cases shaped like tres.json's sections; stdout: one result a case ({error = ...} when it raised).
DRIVER = r"""
local cjson = require("cjson")
local M = dofile(arg[1] .. "/elastic_common.lua")
slurm = {}
dofile(arg[1] .. "/cli_filter.lua")
local cases = cjson.decode(CASES)
local function v(x) if x == cjson.null then return nil end return x end
local function nul(x) if x == nil then return cjson.null end return x end
local run = {
  parse = function(c) local n, t = M.gpu_tres(v(c.tres)); return { gpus = nul(n), type = nul(t) } end,
  rewrite = function(c) return { got = M.set_gpu_tres(v(c.tres), v(c.gpus), v(c.gpu)) } end,
  job_desc = function(c)
    local f, _, changed = M.rewrite_fields(c.job_desc, c.reply, c.prefix)
    return { fields = f, changed = changed }
  end,
  option = function(c) return { got = nul(option_tres(c.option, v(c.value))) } end,
}
local out = {}
for section, list in pairs(cases) do
  out[section] = {}
  for i, c in ipairs(list) do
    local ok, r = pcall(run[section], c)
    out[section][i] = ok and r or { error = tostring(r) }
  end
  if #list == 0 then out[section] = nil end
end
io.write(cjson.encode(out))
"""


def lua(cases: dict) -> dict:
    """Run `cases` (sections of tres.json) through elastic_common.lua and cli_filter.lua in one lua5.1 process."""
    text = json.dumps(cases)
    assert "]==]" not in text
    code = f"arg = {{[1] = {json.dumps(str(LUA_DIR))}}}\nlocal CASES = [==[{text}]==]\n" + DRIVER
    proc = subprocess.run(["lua5.1", "-"], input=code, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def lua_results():
    return lua({k: v for k, v in VECTORS.items() if isinstance(v, list) and k != "shape"})


def ids(section):
    return [f"{c.get('option', '')}{'=' if 'option' in c else ''}{c.get('tres', c.get('value', c.get('why', c.get('job'))))}"
            f"{'->' + str(c['gpus']) if section == 'rewrite' else ''}" for c in VECTORS[section]]


@pytest.mark.parametrize("i", range(len(VECTORS["parse"])), ids=ids("parse"))
def test_parse_python(i):
    case = VECTORS["parse"][i]
    assert (gpus_in_tres(case["tres"]), gres_gpu_type(case["tres"])) == (case["gpus"], case["type"])


@pytest.mark.parametrize("i", range(len(VECTORS["parse"])), ids=ids("parse"))
def test_parse_lua(lua_results, i):
    case = VECTORS["parse"][i]
    assert lua_results["parse"][i] == {"gpus": case["gpus"], "type": case["type"]}


@pytest.mark.parametrize("i", range(len(VECTORS["shape"])), ids=ids("shape"))
def test_requested_shape(i):
    """Python only: the service reads the job's shape; the hook decides nothing from it (issue 26.3)."""
    case = VECTORS["shape"][i]
    expect = {"nodes": case["nodes"], "per_node": case["per_node"], "total": case["total"]}
    assert dict(zip(("nodes", "per_node", "total"), requested_shape(case["job"]))) == expect


@pytest.mark.parametrize("i", range(len(VECTORS["rewrite"])), ids=ids("rewrite"))
def test_rewrite_writes_one_canonical_gpu_entry(lua_results, i):
    case = VECTORS["rewrite"][i]
    assert lua_results["rewrite"][i] == {"got": case["expect"]}
    assert gpus_in_tres(case["expect"]) == case["gpus"]       # the Python reader agrees with what was written


@pytest.mark.parametrize("i", range(len(VECTORS["job_desc"])), ids=ids("job_desc"))
def test_job_desc_rewrite_per_node_per_job_per_task(lua_results, i):
    case, got = VECTORS["job_desc"][i], lua_results["job_desc"][i]
    assert "error" not in got, got
    assert {k: got["fields"].get(k) for k in case["expect"]} == case["expect"]
    assert got["changed"] == case["changed"]


@pytest.mark.parametrize("i", range(len(VECTORS["option"])), ids=ids("option"))
def test_cli_filter_options_as_tres(lua_results, i):
    assert lua_results["option"][i] == {"got": VECTORS["option"][i]["expect"]}


# -- property: generated TRES strings read alike in both languages ------------------------------------
_TYPES = st.sampled_from(["a100", "h100", "tesla", "A100", "v100_32g", "l4.x"])
_COUNTS = st.integers(0, 64)


@st.composite
def gpu_entry(draw):
    prefix = draw(st.sampled_from(["gres:", "gres/", ""]))
    gtype = draw(st.none() | _TYPES)
    count = draw(st.none() | _COUNTS)
    sep = "=" if prefix == "gres/" and count is not None and draw(st.booleans()) else ":"
    return f"{prefix}gpu" + (f":{gtype}" if gtype else "") + (f"{sep}{count}" if count is not None else "")


_OTHER = st.sampled_from(["gres:nic:1", "gres/shard:2", "gres:mps:100", "cpu=4", "mem=100M", "node=2", "billing=3",
                          "gres:gpus:2", "gres/shard:gpu:2", "gres:gpu_mig:1", "license/x=1"])
TRES = st.lists(gpu_entry() | _OTHER, max_size=5).map(",".join)


@settings(max_examples=25, deadline=None)
@given(st.lists(TRES, min_size=1, max_size=40), st.lists(st.none() | st.integers(1, 16), min_size=40, max_size=40))
def test_generated_tres_read_alike_in_python_and_lua(strings, counts):
    counts = counts[:len(strings)]
    got = lua({"parse": [{"tres": s} for s in strings],
               "rewrite": [{"tres": s, "gpus": n} for s, n in zip(strings, counts)]})
    for s, n, parsed, written in zip(strings, counts, got["parse"], got["rewrite"]):
        assert parsed == {"gpus": gpus_in_tres(s), "type": gres_gpu_type(s)}, s
        out = written["got"]
        assert gpus_in_tres(out) == n, (s, n, out)
        others = [e for e in s.split(",") if e and gpus_in_tres(e) is None]
        gpu = [e for e in out.split(",") if e and gpus_in_tres(e) is not None]
        assert [e for e in out.split(",") if e and e not in gpu] == others, (s, out)
        assert len(gpu) == (0 if n is None else 1), (s, out)
        if n is not None:
            kept = gres_gpu_type(s)
            assert gpu[0] == f"gres:gpu:{kept + ':' if kept else ''}{n}", (s, out)
