"""Issue #26 item 6 (newcomer items): each test fails before its fix."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from slurm_plugin import templates
from slurm_plugin.cli import main as slurm_cli
from slurm_plugin.directives import parse_script


def _request(text: str) -> int:
    block = templates.split_script(text)[0]
    value = {l.split("=")[0]: int(l.split("=")[1]) for l in block if l.startswith(("#SBATCH --nodes=",
                                                                                   "#SBATCH --gpus-per-node="))}
    return value["#SBATCH --nodes"] * value["#SBATCH --gpus-per-node"]


@pytest.mark.parametrize("gpus", ["3-4", "1-1", "1-2", "1-4", "2-2", "5-7"])
@pytest.mark.parametrize("name", sorted(templates.templates()))
def test_cpu_test_request_lies_within_its_gpu_bounds(tmp_path, name, gpus):
    out = tmp_path / "x.sbatch"
    made = CliRunner().invoke(slurm_cli, ["template", "new", name, "--cpu-test", "--gpus", gpus, "--out", str(out)])
    assert made.exit_code == 0, made.output
    text = out.read_text()
    bounds = parse_script(text)["gpus"]
    assert f"{bounds['min']}-{bounds['max']}" == gpus
    assert bounds["min"] <= _request(text) <= bounds["max"], text
    if bounds["min"] <= 2 <= bounds["max"]:
        assert "#SBATCH --nodes=2" in text        # the multi-node variant where the bounds allow it


def test_request_never_overshoots_the_maximum_with_gpus_per_node():
    tpl = templates.get("gpt-lm")
    text = templates.render(tpl, templates.Params(gpus="3-3"))
    assert _request(text) == 3
    with pytest.raises(templates.TemplateError, match="above the maximum 3"):
        templates.render(tpl, templates.Params(gpus="3-3", gpus_per_node=2))
    with pytest.raises(templates.TemplateError, match=r"1 node x 32 GPUs = 32\) is outside #ELASTIC gpus=2-16"):
        templates.render(templates.get("resnet50"), templates.Params(gpus_per_node=32))
