"""The guides are checked against the code:

- every CLI command (all three entry points, every subcommand) is named in README.md or docs/*.md and has help;
- every `elastic-*` command line shown in a code block of the guides (and in the templates' headers) names
  an existing command with existing options;
- the blocks marked `<!-- doc-test -->` run as written (in a temporary directory with a seeded history),
  and a following `<!-- doc-test: output -->` block is what they print.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest

from elastic_launcher.cli import agent as launch_agent
from elastic_launcher.cli import ctl as launch_ctl
from elastic_launcher.cli import launch as launch_cmd
from predictor.cli import main as predictor_main
from slurm_plugin.cli import main as slurm_main
from tests.unit.test_admin_views import seed_records

ROOT = Path(__file__).resolve().parents[2]
GUIDES = [ROOT / "docs" / "user-guide.md", ROOT / "docs" / "admin-guide.md"]
ENTRY_POINTS = {"elastic-slurm": slurm_main, "elastic-predictor": predictor_main,
                "elastic-launch": click.Group("elastic-launch", commands={"ctl": launch_ctl, "agent": launch_agent})}
LAUNCH_OPTIONS = {opt for p in launch_cmd.params for opt in getattr(p, "opts", [])}
BLOCK = re.compile(r"(<!-- doc-test(?:: output)? -->\n)?```(\w+)\n(.*?)```", re.S)


def _walk(name: str, command: click.Command):
    yield name, command
    if isinstance(command, click.Group):
        for sub_name, sub in sorted(command.commands.items()):
            yield from _walk(f"{name} {sub_name}", sub)


ALL_COMMANDS = [(path, cmd) for entry, group in ENTRY_POINTS.items() for path, cmd in _walk(entry, group)]


def _corpus() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


@pytest.mark.parametrize("path", [p for p, _ in ALL_COMMANDS])
def test_every_command_is_documented_and_has_help(path):
    command = dict(ALL_COMMANDS)[path]
    assert re.search(rf"(?<![\w-]){re.escape(path)}(?![\w-])", _corpus()), f"`{path}` is not in README.md or docs/"
    assert path == "elastic-launch" or (command.help or "").strip(), f"`{path}` has no help text"


def test_the_guides_have_their_sections():
    user, admin = (g.read_text(encoding="utf-8") for g in GUIDES)
    for heading in ("## Directives", "## What the sbatch message means", "## Opting out", "## Start from a template"):
        assert heading in user
    for heading in ("## Install", "## Run the predictor", "## Install the hook", "## Security", "## Upgrade",
                    "## Monitor", "### Reading the plots"):
        assert heading in admin


def _code_lines() -> list[tuple[str, str]]:
    """(where, line) of every command line in the guides' shell blocks and the templates' headers."""
    out = []
    for guide in GUIDES:
        for _, lang, body in BLOCK.findall(guide.read_text(encoding="utf-8")):
            if lang == "bash":
                out += [(guide.name, line) for line in body.replace("\\\n", " ").splitlines()]
    for template in sorted((ROOT / "sbatch_templates").glob("*.sbatch")):
        out += [(template.name, line.split(":", 1)[1]) for line in template.read_text().splitlines()
                if line.startswith("# Other values:")]
    return out


def _resolve(tokens: list[str]) -> tuple[str, click.Command, list[str]]:
    path, command = tokens[0], ENTRY_POINTS[tokens[0]]
    rest = tokens[1:]
    while isinstance(command, click.Group) and rest and rest[0] in command.commands:
        path, command, rest = f"{path} {rest[0]}", command.commands[rest[0]], rest[1:]
    if path == "elastic-launch":
        command = launch_cmd
    return path, command, rest


def test_every_command_line_in_the_guides_names_real_commands_and_options():
    checked = 0
    for where, line in _code_lines():
        for match in re.finditer(r"(?<![\w/-])elastic-(?:slurm|predictor|launch)\b[^|;&>)\"\n]*", line):
            tokens = shlex.split(match.group(0).split("#")[0])
            path, command, rest = _resolve(tokens)
            assert not isinstance(command, click.Group), f"{where}: `{match.group(0)}` stops at a group"
            known = {opt for p in command.params for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
            for token in rest:
                if token == "--":
                    break
                if token.startswith("--"):
                    assert token.split("=")[0] in known, f"{where}: `{path}` has no option {token}"
            checked += 1
    assert checked >= 25


def _doc_tests(guide: Path) -> list[tuple[str, str | None]]:
    """(script, expected output or None) of each `<!-- doc-test -->` block, in order."""
    tests: list[list] = []
    for marker, lang, body in BLOCK.findall(guide.read_text(encoding="utf-8")):
        if marker.startswith("<!-- doc-test -->"):
            assert lang == "bash"
            tests.append([body, None])
        elif marker.startswith("<!-- doc-test: output -->"):
            tests[-1][1] = body
    return [tuple(t) for t in tests]


@pytest.mark.slow  # every doc-test block as a shell script, one CLI process per command
@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_guide_commands_run_as_written(guide, tmp_path):
    (tmp_path / "history.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in seed_records() if r["kind"] != "profile"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["ELASTIC_PREDICTOR_DB"] = str(tmp_path / "predictor.db")
    blocks = _doc_tests(guide)
    assert blocks, f"{guide.name} has no doc-test block"
    for script, expected in blocks:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, f"{guide.name}:\n{script}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        if expected is not None:
            assert expected.strip() in proc.stdout, f"{guide.name}: shown output differs:\n{proc.stdout}"
    if guide.name == "admin-guide.md":
        for png in ("scaling.png", "links.png"):
            assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    else:
        assert "#ELASTIC model=resnet50 gpus=2-16 per_gpu_batch=64" in (tmp_path / "job.sbatch").read_text()
