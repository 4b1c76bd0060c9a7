"""The Python directive parser against the shared vectors (the Lua parser runs the same file)."""
import json
import pathlib

import pytest

from slurm_plugin.contracts.directives import parse_script
from slurm_plugin.errors import DirectiveError

VECTORS = json.loads((pathlib.Path(__file__).parents[1] / "vectors" / "directives.json").read_text())


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector(vector):
    if "error" in vector:
        with pytest.raises(DirectiveError) as info:
            parse_script(vector["script"])
        assert info.value.line_no == vector["error"]["line"]
        assert vector["error"]["contains"] in str(info.value)
        assert info.value.line in vector["script"]
    else:
        assert parse_script(vector["script"]) == vector["result"]
