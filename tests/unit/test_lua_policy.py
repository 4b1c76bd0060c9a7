"""job_submit.lua's copy of the policy's last step (elastic_common.lua `M.last_step`) under apt's lua5.1,
against tests/vectors/policy.json: the decisions predictor.planner.last_step gives (test_policy_vectors.py)."""
import json
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).parents[2]
LUA_DIR = ROOT / "slurm_plugin" / "lua"
SHARED = json.loads((ROOT / "tests" / "vectors" / "policy.json").read_text())
VECTORS = SHARED["vectors"]

# arg[1]: the Lua directory, arg[2]: the vectors file; prints one decision per vector.
DRIVER = r"""
local cjson = require("cjson")
local M = dofile(arg[1] .. "/elastic_common.lua")
local f = io.open(arg[2]); local shared = cjson.decode(f:read("*a")); f:close()
local out = {}
for i, v in ipairs(shared.vectors) do
  local lines = {}
  for n, line in ipairs(v.directives) do lines[n] = { no = n, line = line } end
  local d = assert(M.parse_lines(lines))
  local job = {}
  for k, value in pairs(v.job) do job[k] = value end
  local got = M.last_step(shared.tables[v.table + 1], d, M.requested(job))
  got.switches = got.switches or cjson.null
  out[i] = got
end
io.write(cjson.encode(out))
"""


@pytest.fixture(scope="module")
def lua_results():
    code = f"arg = {{[1] = {json.dumps(str(LUA_DIR))}, [2] = {json.dumps(str(ROOT / 'tests' / 'vectors' / 'policy.json'))}}}\n"
    proc = subprocess.run(["lua5.1", "-"], input=code + DRIVER, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("index", range(len(VECTORS)), ids=[v["name"] for v in VECTORS])
def test_vector(lua_results, index):
    expect, got = VECTORS[index]["expect"], lua_results[index]
    assert got["judged"] == expect["judged"] and got["action"] == expect["action"]
    if expect["judged"]:       # an unjudged keep is the service's to word: the hook asks it
        assert {k: got.get(k) for k in expect if k != "judged"} == {k: v for k, v in expect.items() if k != "judged"}
        assert got["switches"] == expect.get("switches")
