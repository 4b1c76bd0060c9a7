"""Issue #26 item 6 (newcomer items): each test fails before its fix."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess

import click
import pytest
from click.testing import CliRunner

from predictor import planner
from slurm_plugin import templates
from slurm_plugin.cli import main as slurm_cli
from slurm_plugin.contracts.directives import parse_script


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


# --- reasons never contradict their own rounding; plurals -------------------------------------------------
ROOT = pathlib.Path(__file__).parents[2]
LUA_DIR = ROOT / "slurm_plugin" / "lua"


def _lua(code: str) -> str:
    proc = subprocess.run(["lua5.1", "-"], input=f"local M = dofile({json.dumps(str(LUA_DIR / 'elastic_common.lua'))})"
                          "\nlocal cjson = require('cjson')\n" + code, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _reads_true(text: str) -> bool:
    value, bound = (float(x) for x in re.fullmatch(r"(\S+) < (\S+)", text).groups())
    return value < bound


@pytest.mark.parametrize("value, bound, expect", [
    (0.6996, 0.7, "0.6996 < 0.7"), (0.8994, 0.9, "0.899 < 0.9"), (0.5, 0.7, "0.50 < 0.7"),
    (0.69999, 0.7, "0.69999 < 0.7"), (0.1234, 0.12345678, "0.12 < 0.12345678"),
    (0.70000004, 0.70000005, "0.70 < 0.70000004999999998")])
def test_below_prints_enough_digits_to_read_true(value, bound, expect):
    assert planner._below(value, bound) == expect and _reads_true(expect)


def test_every_policy_vector_reason_reads_true():
    vectors = json.loads((ROOT / "tests" / "vectors" / "policy.json").read_text())["vectors"]
    found = 0
    for v in vectors:
        for m in re.finditer(r"efficiency (\S+ < [0-9.]+)", v["expect"]["reason"]):
            found += 1
            assert _reads_true(m.group(1)), v["expect"]["reason"]
    assert found > 10


def test_per_task_split_reason_counts_its_nouns():
    out = json.loads(_lua(f"slurm = {{}}\ndofile({json.dumps(str(LUA_DIR / 'cli_filter.lua'))})\n" + """
local got = {}
for i, case in ipairs({{1, 2}, {2, 3}, {2}}) do
  local _, why = apply_cli_options({["gpus-per-task"] = "1"}, {nodes = 1, gpus_per_node = case[1],
                                                               tasks_per_node = case[2]})
  got[i] = why
end
io.write(cjson.encode(got))"""))
    assert out == ["1 GPU per node does not split over 2 tasks (--gpus-per-task)",
                   "2 GPUs per node do not split over 3 tasks (--gpus-per-task)",
                   "2 GPUs per node do not split over the tasks (--gpus-per-task)"]


# --- elastic-launch --help: subcommands listed, every option explained ------------------------------------
@pytest.mark.parametrize("command", ["launch", "ctl", "agent"])
def test_every_elastic_launch_option_has_help(command):
    from elastic_launcher import cli

    cmd = getattr(cli, command)
    bare = [p.opts for p in cmd.params if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert bare == []
    assert (cmd.help or "").strip()


def test_elastic_launch_help_lists_its_subcommands(capsys):
    from elastic_launcher import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for sub in cli.SUBCOMMANDS:
        assert f"elastic-launch {sub} " in text, text


# --- one default port across docs and code ----------------------------------------------------------------
def test_one_default_port_across_docs_and_code():
    from predictor.cli import main as predictor_cli
    from slurm_plugin import installer

    port = next(p.default for p in predictor_cli.commands["serve"].params if p.name == "port")
    hook_default = json.loads(_lua("local cfg = M.read_config(nil); io.write(cjson.encode(cfg))"))["predictor_url"]
    assert hook_default == f"http://127.0.0.1:{port}"
    texts = {str(path): path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                                                      *sorted((ROOT / "slurm_plugin").rglob("*.py")),
                                                      *sorted((ROOT / "slurm_plugin").rglob("*.lua"))]}
    texts["install-plugin --help"] = CliRunner().invoke(installer.install_plugin, ["--help"]).output
    urls = {(where, m.group(0)) for where, text in texts.items()
            for m in re.finditer(r"https?://[A-Za-z0-9.\[\]:-]+:(\d+)", text) if m.group(1) != str(port)}
    assert urls == set()


# --- demo honours ELASTIC_SLURM_LAB (and the lab's port base) ---------------------------------------------
def test_demo_honours_elastic_slurm_lab(tmp_path, monkeypatch):
    from slurm_plugin.lab import demo

    seen = []

    class Stop(Exception):
        pass

    def fake_demo(lab, port_base, *args):
        seen.append((lab, port_base))
        raise Stop

    monkeypatch.setattr(demo, "Demo", fake_demo)
    for key in ("ELASTIC_SLURM_LAB", "ELASTIC_SLURM_PORT_BASE"):   # CI sets both for its own lab
        monkeypatch.delenv(key, raising=False)
    lab = tmp_path / "lab"
    (lab / "etc").mkdir(parents=True)
    (lab / "etc" / "port_base").write_text("18200\n")
    runner = CliRunner()
    for env, args, expect in [({"ELASTIC_SLURM_LAB": str(lab)}, [], (lab, 18200)),
                              ({"ELASTIC_SLURM_LAB": str(lab), "ELASTIC_SLURM_PORT_BASE": "18400"}, [], (lab, 18400)),
                              ({"ELASTIC_SLURM_LAB": str(lab)}, ["--lab", str(tmp_path / "b")],
                               (tmp_path / "b", demo.DEFAULT_DEMO_PORT_BASE))]:
        result = runner.invoke(demo.demo_command, args, env=env)
        assert isinstance(result.exception, Stop), result.output
        assert seen.pop() == expect


# --- no `sudo` in help texts (the commands are run as root) -----------------------------------------------
def _helps(command, prefix):
    yield prefix, CliRunner().invoke(command, ["--help"], prog_name=prefix).output
    for name, sub in getattr(command, "commands", {}).items():
        yield from _helps(sub, f"{prefix} {name}")


def test_no_sudo_in_help_texts():
    from elastic_launcher import cli as launch_cli
    from predictor.cli import main as predictor_cli

    helps = [*_helps(slurm_cli, "elastic-slurm"), *_helps(predictor_cli, "elastic-predictor"),
             *(pair for cmd in (launch_cli.launch, launch_cli.ctl, launch_cli.agent)
               for pair in _helps(cmd, f"elastic-launch {cmd.name}"))]
    assert len(helps) > 20
    assert [name for name, text in helps if "sudo" in text] == []
    assert "sudo" not in (ROOT / ".ci" / "setup").read_text()


# --- .ci/setup in a second checkout says which checkout the install points at -----------------------------
def _which(checkout: pathlib.Path) -> str:
    import sys

    proc = subprocess.run(["bash", str(checkout / ".ci" / "setup"), "--which"], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _installed_checkout() -> pathlib.Path | None:
    """The checkout the installed package runs from, found as .ci/setup finds it: outside any checkout, without
    PYTHONPATH (a worktree's tests run with PYTHONPATH on their own tree while the editable install may point at
    another checkout)."""
    import sys

    probe = "import os, slurm_plugin; print(os.path.realpath(slurm_plugin.__file__))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/",
                          env={"PATH": "/usr/bin:/bin"})
    return pathlib.Path(proc.stdout.strip()).parents[1] if proc.returncode == 0 else None


def test_ci_setup_says_which_checkout_the_install_points_at(tmp_path):
    installed = _installed_checkout()
    second = tmp_path / "second"
    (second / ".ci").mkdir(parents=True)
    (second / ".ci" / "setup").write_text((ROOT / ".ci" / "setup").read_text())
    said = _which(second)
    if "is not installed" in said:
        pytest.skip("elastic-slurm is not installed for this interpreter (run from a source tree)")
    assert "WARNING" in said and f"another checkout, {installed}," in said and str(second.resolve()) in said
    if installed == ROOT.resolve():
        assert _which(ROOT) == f"setup: elastic-slurm (pip install -e) runs from this checkout, {installed}\n"
