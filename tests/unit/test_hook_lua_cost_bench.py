"""bench/hook_lua_cost.py times what the hook does: every path's submissions are planned and applied (the driver
asserts the decision landed in the job_desc), for this checkout and for another revision's Lua."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import hook_lua_cost  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("lua5.1") is None, reason="needs apt's lua5.1 (.ci/setup installs it)")


@pytest.mark.parametrize("path", ["cached", "bands", "plain"])
def test_each_path_runs_the_hook_and_applies_its_decision(tmp_path, path):
    assert hook_lua_cost.run(hook_lua_cost.lua_dir(None, tmp_path / "lua"), path, 50) > 0


def test_a_path_whose_decision_is_not_applied_fails(tmp_path):
    lua = hook_lua_cost.lua_dir(None, tmp_path / "lua")
    common = lua / "elastic_common.lua"
    common.write_text(common.read_text().replace("for key, value in pairs(fields) do job_desc[key] = value end", ""))
    with pytest.raises(Exception):
        hook_lua_cost.run(lua, "cached", 50)


def test_a_revision_without_the_hook_is_refused_by_name():
    with pytest.raises(SystemExit, match="--against no-such-rev: no slurm_plugin/lua/job_submit.lua there"):
        hook_lua_cost.lua_files("no-such-rev")
