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
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from slurm_plugin.hostlist import split_top
from slurm_plugin.contracts.tres import TresError, gpu_types, gpus_in_tres, gres_gpu_type, requested_shape

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
  parse = function(c)
    local n, t, err = M.gpu_tres(v(c.tres))
    if err then return { error = true } end
    return { gpus = nul(n), type = nul(t), types = M.gpu_types(v(c.tres)) }
  end,
  rewrite = function(c)
    local got, why = M.set_gpu_tres(v(c.tres), v(c.gpus), v(c.gpu), v(c.prefix))
    return { got = nul(got), error = why }
  end,
  job_desc = function(c)
    local f, why, changed = M.rewrite_fields(c.job_desc, c.reply, c.prefix)
    if not f then return { error = why } end
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


def python_reading(tres) -> dict:
    """What the Python reader says of ``tres``, shaped as the Lua driver's parse results."""
    try:
        return {"gpus": gpus_in_tres(tres), "type": gres_gpu_type(tres), "types": gpu_types(tres)}
    except TresError:
        return {"error": True}


def lua_reading(got: dict) -> dict:
    """A Lua parse result with an empty ``types`` (cjson writes an empty table as {}) as []."""
    return {**got, "types": list(got["types"] or [])} if "types" in got else got


def expected(case: dict) -> dict:
    if case.get("error"):
        return {"error": True}
    return {"gpus": case["gpus"], "type": case["type"], "types": case.get("types", [case["type"]] if case["type"] else
                                                                    sorted({case["type"]} - {None}))}


@pytest.mark.parametrize("i", range(len(VECTORS["parse"])), ids=ids("parse"))
def test_parse_python(i):
    case = VECTORS["parse"][i]
    got = python_reading(case["tres"])
    want = expected(case)
    if "types" not in case and "error" not in got:  # older vectors name no types: the one type, or none known
        got["types"] = want["types"] = None
    assert got == want


@pytest.mark.parametrize("i", range(len(VECTORS["parse"])), ids=ids("parse"))
def test_parse_lua(lua_results, i):
    case = VECTORS["parse"][i]
    got = lua_reading(lua_results["parse"][i])
    want = expected(case)
    if "types" not in case and "error" not in got:
        got["types"] = want["types"] = None
    assert got == want
    assert got == {**python_reading(case["tres"]), **({"types": None} if "types" in got and got["types"] is None
                                                       else {})}


@pytest.mark.parametrize("i", range(len(VECTORS["shape"])), ids=ids("shape"))
def test_requested_shape(i):
    """Python only: the service reads the job's shape; the hook decides nothing from it (issue 26.3)."""
    case = VECTORS["shape"][i]
    expect = {"nodes": case["nodes"], "per_node": case["per_node"], "total": case["total"]}
    assert dict(zip(("nodes", "per_node", "total"), requested_shape(case["job"]))) == expect


@pytest.mark.parametrize("i", range(len(VECTORS["rewrite"])), ids=ids("rewrite"))
def test_rewrite_writes_one_canonical_gpu_entry(lua_results, i):
    case, got = VECTORS["rewrite"][i], lua_results["rewrite"][i]
    if case.get("error"):  # refused: several GPU types, or a malformed entry; the request stays as written
        assert got["got"] is None and case["error"] in got["error"], got
        return
    assert got == {"got": case["expect"]}
    assert gpus_in_tres(case["expect"]) == case["gpus"]       # the Python reader agrees with what was written


@pytest.mark.parametrize("i", range(len(VECTORS["job_desc"])), ids=ids("job_desc"))
def test_job_desc_rewrite_per_node_per_job_per_task(lua_results, i):
    case, got = VECTORS["job_desc"][i], lua_results["job_desc"][i]
    if case.get("error"):
        assert case["error"] in got["error"], got
        return
    assert "error" not in got, got
    assert {k: got["fields"].get(k) for k in case["expect"]} == case["expect"]
    assert got["changed"] == case["changed"]


@pytest.mark.parametrize("i", range(len(VECTORS["option"])), ids=ids("option"))
def test_cli_filter_options_as_tres(lua_results, i):
    assert lua_results["option"][i] == {"got": VECTORS["option"][i]["expect"]}


# -- property: generated TRES strings read alike in both languages ------------------------------------
# Drawn from Slurm's GRES/TRES grammar (`[gres:|gres/]name[:type][:count|=count][(IDX:..)|(S:..)]`, comma-separated)
# and its near misses: types with digits, dots and dashes (MIG profiles such as 1g.10gb, a100_3g.40gb), counts in
# and out of range, ASCII and Unicode whitespace, Unicode digits and letters, empty fields, stray separators.
_MIG = st.builds(lambda g, m: f"{g}g.{m}gb", st.integers(1, 7), st.sampled_from([5, 10, 20, 40, 80]))
_TYPE = (st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True) | _MIG
         | st.sampled_from(["a100", "h100", "nvidia_a100-sxm4-80gb", "tesla", "l4.x", "v100_32g", "A100"])
         | st.text(alphabet=st.characters(codec="utf-8", exclude_characters=",()[]:="), min_size=1, max_size=6))
_COUNT = (st.integers(0, 64).map(str) | st.integers(0, 10**12).map(str) | st.sampled_from(["", "²", "２", "٣", "1k",
                                                                                           "-1", "0x2", "02"]))
_WS = st.sampled_from(["", "", "", " ", "\t", "  ", "\n", "\r", "\v", "\f", "\u00a0", "\u2003"])
_SUFFIX = st.sampled_from(["", "", "", "(IDX:0-1)", "(S:0)", "(IDX:0,2)", "(IDX:N/A)"])


@st.composite
def gres_entry(draw):
    prefix = draw(st.sampled_from(["gres:", "gres/", "", ""]))
    name = draw(st.sampled_from(["gpu", "gpu", "gpu", "gpus", "gpu_mig", "shard", "nic", "mps", "GPU"]))
    parts = [draw(st.sampled_from([":", "="])) + draw(_TYPE if i == 0 else _COUNT)
             for i in range(draw(st.integers(0, 3)))]
    return draw(_WS) + prefix + name + "".join(parts) + draw(_SUFFIX) + draw(_WS)


_OTHER = st.sampled_from(["cpu=4", "mem=100M", "node=2", "billing=3", "license/x=1", "gres/shard:gpu:2"])
TRES = st.lists(gres_entry() | _OTHER, max_size=4).map(",".join)
BATCH = 400  # strings per Lua process; examples x BATCH = 10,000 strings per run


@pytest.mark.slow
@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])  # 400 strings
@given(st.lists(TRES, min_size=BATCH, max_size=BATCH), st.lists(st.none() | st.integers(1, 16), min_size=BATCH,
                                                                 max_size=BATCH))
def test_generated_tres_read_alike_in_python_and_lua(strings, counts):
    got = lua({"parse": [{"tres": s} for s in strings],
               "rewrite": [{"tres": s, "gpus": n} for s, n in zip(strings, counts)]})
    for s, n, parsed, written in zip(strings, counts, got["parse"], got["rewrite"]):
        mine = python_reading(s)
        assert lua_reading(parsed) == mine, s
        if "error" in mine or len(mine["types"]) > 1 and n is not None:  # refused: nothing is rewritten
            assert written["got"] is None and written["error"], (s, written)
            continue
        out = written["got"]
        assert gpus_in_tres(out) == n, (s, n, out)
        others = [e for e in split_top(s) if gpus_in_tres(e) is None]
        gpu = [e for e in split_top(out) if gpus_in_tres(e) is not None]
        assert [e for e in split_top(out) if e not in gpu] == others, (s, out)
        assert len(gpu) == (0 if n is None else 1), (s, out)
        if n is not None:
            kept = gres_gpu_type(s)
            assert gpu[0] == f"gres:gpu:{kept + ':' if kept else ''}{n}", (s, out)


# -- the service: a malformed GPU entry is the request's fault (400 naming the field), never a 500 -------------------
from tests.unit.test_api import app, client  # noqa: E402,F401 - fixtures


@pytest.mark.parametrize("field", ["tres_per_node", "tres_per_job"])
def test_a_malformed_gpu_entry_at_plan_is_a_400_naming_the_field(client, field):
    for case in [c for c in VECTORS["parse"] if c.get("error")]:
        r = client.post("/v1/plan", json={"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=2-8"],
                                          "job": {"partition": "debug", field: case["tres"]}})
        assert r.status_code == 400, (case["tres"], r.status_code, r.get_data(as_text=True)[:200])
        assert f"job.{field}" in r.get_data(as_text=True), case["tres"]


def test_a_request_of_several_gpu_types_is_kept_as_written(client):
    r = client.post("/v1/plan", json={"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=2-8"],
                                      "job": {"partition": "debug", "tres_per_node": "gres:gpu:h100:2,gres:gpu:a100:1"}})
    body = r.get_json()
    assert r.status_code == 200 and body["action"] == "keep", body
    assert "several GPU types (a100, h100)" in body["reason"]
