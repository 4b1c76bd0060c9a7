"""sbatch templates: list them and render one with parameters (`elastic-slurm template list|new|show`).

The templates are runnable batch scripts in `sbatch_templates/` (header comment, `#SBATCH` lines, `#ELASTIC`
lines, then one `elastic-launch ... -- python -m <module> ...` command). Rendering edits a template in
place of its values, so what comes out is the same script with other numbers:

- `#SBATCH --opt=value` lines are replaced by long option name (missing ones are added after the last);
- `#ELASTIC key=value` tokens are replaced by key (missing ones are appended to the last directive line);
- options of the command are replaced by name, before `--` (elastic-launch's) or after it (the training
  script's); `--command` replaces the wrapped command of `wrap-train-py`.

`--gpus MIN-MAX` sets the directive and sizes the written request to MIN GPUs (what runs without the hook;
with it, the planner rewrites the request). `--cpu-test` renders the small variant for the CPU testbed:
2 nodes x 1 slot (fewer or more nodes where `--gpus` bounds ask: the written request always lies within
them), a tiny model, 20 steps on the CPU. The `#ELASTIC model=` directive and the script's
`--profile` (the name its measurements are posted under) always name the model that really trains: the
tiny one's profile name with `--cpu-test` (`CPU_PROFILES`), the `--model` value when one is given. Every
rendering is checked: its directives must parse (slurm_plugin.contracts.directives) and its command must hold
`elastic-launch`.
"""
from __future__ import annotations

import dataclasses
import math
import re
import shlex
import sys
from pathlib import Path

import click

from slurm_plugin.contracts.directives import parse_script
from slurm_plugin.errors import DirectiveError

def _template_dir() -> Path:
    """The checkout's sbatch_templates/ (editable install), else the copy setup.py installs under sys.prefix."""
    checkout = Path(__file__).resolve().parents[1] / "sbatch_templates"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "elastic-slurm" / "sbatch_templates"


TEMPLATE_DIR = _template_dir()
_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+\Z")
_SBATCH = re.compile(r"^#SBATCH\s+--([a-z-]+)(?:=(.*))?$")


class TemplateError(ValueError):
    """A template that does not exist, or parameters that make an invalid script (the message says which)."""


@dataclasses.dataclass(frozen=True)
class Template:
    """One template: its file and the small variant's values.

    Attributes:
        name: the name users type (the file's stem).
        path: the .sbatch file.
        cpu_test: training-script options of the `--cpu-test` variant.
        cpu_directives: `#ELASTIC` values of the `--cpu-test` variant.
    """

    name: str
    path: Path
    cpu_test: dict
    cpu_directives: dict

    @property
    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")

    @property
    def summary(self) -> str:
        """The first header line after the shebang, without the `# name:` prefix."""
        for line in self.text.splitlines()[1:]:
            if line.startswith("# "):
                return line[2:].split(":", 1)[-1].strip()
        return ""


_CPU_COMMON = {"--steps": "20", "--device": "cpu", "--log-every": "5"}
# The profile names of the models the --cpu-test variants really train (never the full model's name: their
# measurements would teach the predictor the full model's history from a tiny one's step times).
CPU_PROFILES = {"resnet50": "resnet-tiny", "transformer-finetune": "encoder-tiny", "gpt-lm": "gpt-tiny",
                "wrap-train-py": "plain-train-linear", "torchrun-restart": "plain-train-linear"}
# the templates whose command is a plain script of the user's (elastic_launcher.examples.plain_train stands in): no
# model options (--per-gpu-batch, --profile, --device, --save) are set on it
PLAIN_SCRIPT = {"wrap-train-py": {}, "torchrun-restart": {"--steps": "20", "--log-every": "5", "--checkpoint-every": "5",
                                                          "--checkpoint-dir": "checkpoints/torchrun-restart-cpu-test"}}
_CPU = {
    "resnet50": ({"--arch": "resnet-tiny", "--image-size": "32", "--classes": "10", "--dataset-size": "512",
                  "--per-gpu-batch": "8", "--lr": "0.05"}, {"per_gpu_batch": "8", "max_global_batch": "64"}),
    "transformer-finetune": ({"--size": "tiny", "--seq-len": "32", "--dataset-size": "512", "--per-gpu-batch": "8",
                              "--lr": "0.001"}, {"per_gpu_batch": "8", "max_global_batch": "64"}),
    "gpt-lm": ({"--size": "tiny", "--dataset-size": "512", "--per-gpu-batch": "4", "--lr": "0.003"},
               {"per_gpu_batch": "4", "max_global_batch": "32"}),
    "wrap-train-py": ({}, {"per_gpu_batch": "16"}),
    "torchrun-restart": ({}, {"per_gpu_batch": "16"}),
}
_CPU_WRAPPED = ["python", "-m", "elastic_launcher.examples.plain_train", "--steps", "20",
                "--checkpoint-dir", "checkpoints/wrap-train-py-cpu-test", "--checkpoint-every", "5", "--resume"]


def _cpu_saving(name: str) -> dict:
    """The --cpu-test variant's checkpoints and model: beside the full model's, never in them (a tiny model's
    checkpoint does not fit the full one)."""
    return {"--checkpoint-dir": f"checkpoints/{name}-cpu-test", "--checkpoint-every": "5",
            "--save": f"models/{name}-cpu-test"}


def templates(directory: Path = TEMPLATE_DIR) -> dict[str, Template]:
    """The templates in `directory`, by name."""
    out = {}
    for path in sorted(directory.glob("*.sbatch")):
        cpu, cpu_dir = _CPU.get(path.stem, ({}, {}))
        if path.stem in CPU_PROFILES:
            cpu_dir = {"model": CPU_PROFILES[path.stem], **cpu_dir}
        script = PLAIN_SCRIPT[path.stem] if path.stem in PLAIN_SCRIPT else {**_CPU_COMMON, **cpu,
                                                                            **_cpu_saving(path.stem)}
        out[path.stem] = Template(path.stem, path, script, cpu_dir)
    return out


def get(name: str, directory: Path = TEMPLATE_DIR) -> Template:
    """Raises: TemplateError naming the known templates."""
    found = templates(directory)
    if name not in found:
        raise TemplateError(f"no template {name!r} in {directory} (known: {', '.join(found) or 'none'})")
    return found[name]


@dataclasses.dataclass
class Params:
    """What a rendering changes; None leaves the template's value.

    Attributes:
        gpus: `N` or `MIN-MAX` (directive `gpus`, and the written request sized to MIN).
        gpus_per_node: GPUs per node of the written request (default: the template's, at most MIN).
        directives: other `#ELASTIC` keys (per_gpu_batch also sets the script's `--per-gpu-batch`).
        sbatch: `#SBATCH` long options (job-name, time, partition, account, ...).
        script_options: options of the training script (`--steps`, `--data`, ...).
        launcher_options: options of elastic-launch (`--workers-per-node`, ...).
        python: the interpreter of the command.
        launcher: what runs in place of `elastic-launch` (a path, or e.g. `python -m elastic_launcher.cli`).
        command: the wrapped command (wrap-train-py only).
        cpu_test: render the small CPU variant.
    """

    gpus: str | None = None
    gpus_per_node: int | None = None
    directives: dict = dataclasses.field(default_factory=dict)
    sbatch: dict = dataclasses.field(default_factory=dict)
    script_options: dict = dataclasses.field(default_factory=dict)
    launcher_options: dict = dataclasses.field(default_factory=dict)
    python: str | None = None
    launcher: list[str] | None = None
    command: list[str] | None = None
    cpu_test: bool = False


def _gpu_bounds(text: str) -> tuple[int, int]:
    low, dash, high = text.partition("-")
    if not low.isdigit() or (dash and not high.isdigit()) or int(low) < 1 or int(high or low) < int(low):
        raise TemplateError(f"--gpus: expected N or MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high or low)


def _quote(token: str) -> str:
    if token == "$0" or re.fullmatch(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", token):
        return f'"{token}"'
    return token if _SAFE.match(token) else shlex.quote(token)


def _set_option(tokens: list[str], flag: str, value: str | None) -> list[str]:
    """Replace `flag VALUE` (or `flag=VALUE`) in tokens, or append it; value None removes it."""
    out, i, done = [], 0, False
    while i < len(tokens):
        tok = tokens[i]
        if tok == flag or tok.startswith(flag + "="):
            width = 1 if "=" in tok else 2
            if value is not None and not done:
                out += [flag, value]
                done = True
            i += width
            continue
        out.append(tok)
        i += 1
    if value is not None and not done:
        out += [flag, value]
    return out


def split_script(text: str) -> tuple[list[str], list[str]]:
    """(directive block lines, command lines) of a batch script."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")), len(lines))
    return lines[:end], lines[end:]


def command_parts(command_lines: list[str], where: str = "script") -> tuple[list[str], list[str], list[str]]:
    """Split a template's command into (elastic-launch and its options, the worker command, `--` and a
    wrapped command or nothing).

    Raises:
        TemplateError: the command is not `elastic-launch ... -- <worker command>`.
    """
    tokens = shlex.split(" ".join(line.rstrip("\\").strip() for line in command_lines if line.strip()))
    if not tokens or tokens[0] != "elastic-launch" or "--" not in tokens:
        raise TemplateError(f"{where}: the command must be `elastic-launch ... -- python -m ...`")
    cut = tokens.index("--")
    launcher, worker = tokens[:cut], tokens[cut + 1:]
    nested = worker.index("--") if "--" in worker else len(worker)
    return launcher, worker[:nested], worker[nested:]


def _edit_sbatch(block: list[str], options: dict) -> list[str]:
    out, seen, last = [], set(), -1
    for line in block:
        match = _SBATCH.match(line)
        if match and match.group(1) in options:
            seen.add(match.group(1))
            value = options[match.group(1)]
            if value is None:
                continue
            line = f"#SBATCH --{match.group(1)}={value}"
        out.append(line)
        if line.startswith("#SBATCH"):
            last = len(out) - 1
    extra = [f"#SBATCH --{k}={v}" for k, v in options.items() if k not in seen and v is not None]
    return out[:last + 1] + extra + out[last + 1:]


def _edit_directives(block: list[str], values: dict) -> list[str]:
    out, seen, last = [], set(), -1
    for line in block:
        if line.startswith("#ELASTIC"):
            tokens = []
            for tok in line.split()[1:]:
                key = tok.partition("=")[0]
                if key in values:
                    seen.add(key)
                    tok = f"{key}={values[key]}"
                tokens.append(tok)
            line = "#ELASTIC " + " ".join(tokens)
            last = len(out)
        out.append(line)
    extra = [f"{k}={v}" for k, v in values.items() if k not in seen]
    if extra and last >= 0:
        out[last] += " " + " ".join(extra)
    elif extra:
        out.append("#ELASTIC " + " ".join(extra))
    return out


def _format_command(launcher: list[str], worker: list[str]) -> list[str]:
    lines = [" ".join(_quote(t) for t in launcher) + " -- \\"]
    current = "    "
    for tok in (_quote(t) for t in worker):
        if len(current) + len(tok) > 100 and current.strip():
            lines.append(current.rstrip() + " \\")
            current = "    "
        current += tok + " "
    lines.append(current.rstrip())
    return lines


def render(template: Template, params: Params) -> str:
    """The template's script with `params` applied.

    Raises:
        TemplateError: bad parameters, or a result whose directives do not parse.
    """
    block, command_lines = split_script(template.text)
    sbatch = dict(params.sbatch)
    directives = dict(params.directives)
    script = dict(params.script_options)
    launcher_opts = dict(params.launcher_options)
    wrapped = params.command
    if params.cpu_test:
        sbatch = {"job-name": f"{template.name}-cpu-test", "time": "00:10:00", **sbatch}
        directives = {"gpus": "1-2", **template.cpu_directives, **directives}
        script = {**template.cpu_test, **script}
        launcher_opts = {"--workers-per-node": "1", **launcher_opts}
        if template.name == "wrap-train-py" and wrapped is None:
            wrapped = list(_CPU_WRAPPED)
    if params.gpus is not None or params.cpu_test:
        low, high = _gpu_bounds(params.gpus or directives["gpus"])
        directives["gpus"] = params.gpus or directives["gpus"]
        if params.cpu_test and params.gpus_per_node is None:   # one slot a node, 2 nodes where the bounds allow
            nodes, per_node = min(max(2, low), high), 1
        else:
            nodes, per_node = _request(low, high, params.gpus_per_node, _current_gpus_per_node(block))
        sbatch.setdefault("nodes", str(nodes))
        sbatch.setdefault("gpus-per-node", str(per_node))
    elif params.gpus_per_node is not None:
        sbatch.setdefault("gpus-per-node", str(params.gpus_per_node))
    if "per_gpu_batch" in directives and template.name not in PLAIN_SCRIPT:
        script.setdefault("--per-gpu-batch", str(directives["per_gpu_batch"]))
    if template.name not in PLAIN_SCRIPT and directives.get("model") not in (None, _own_model(template)):
        script.setdefault("--profile", str(directives["model"]))   # its measurements go in under that name
    block = _edit_directives(_edit_sbatch(block, sbatch), directives)

    launcher, worker, inner = command_parts(command_lines, str(template.path))
    for flag, value in launcher_opts.items():
        launcher = _set_option(launcher, flag, value)
    for flag, value in script.items():
        worker = _set_option(worker, flag, value)
    if "--checkpoint-dir" in script and "--checkpoint-dir" in launcher:   # restart mode waits where the script saves
        launcher = _set_option(launcher, "--checkpoint-dir", script["--checkpoint-dir"])
    if params.python:
        worker[0] = params.python
    if params.launcher:
        launcher = list(params.launcher) + launcher[1:]
    if wrapped is not None:
        if not inner:
            raise TemplateError(f"--command applies to wrap-train-py only, not {template.name}")
        inner = ["--", *wrapped]
    if params.python and inner[1:2] == ["python"]:
        inner[1] = params.python
    text = "\n".join(block + _format_command(launcher, worker + inner)) + "\n"
    try:
        bounds = parse_script(text).get("gpus")
    except DirectiveError as exc:
        raise TemplateError(f"the rendered script has a bad directive: {exc}") from None
    _check_request(block, bounds)
    return text


def _request(low: int, high: int, asked: int | None, template_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of a written request for MIN = `low` GPUs that stays within [low, high].

    `asked` is the user's --gpus-per-node (kept, or refused when no node count fits the bounds); without it the
    template's value is lowered to the largest one that fits (a divisor of MIN at worst).

    Raises:
        TemplateError: `asked` GPUs per node cannot make a request within the bounds.
    """
    per_node = asked or min(template_per_node, low)   # the user's value as given (#45.7: 4 became 3 silently)
    while per_node > 1 and math.ceil(low / per_node) * per_node > high and asked is None:
        per_node -= 1
    nodes = math.ceil(low / per_node)
    if nodes * per_node > high:
        raise TemplateError(f"--gpus {low}-{high} with --gpus-per-node {per_node}: {_count(nodes, 'node')} x "
                            f"{per_node} = {nodes * per_node} GPUs, above the maximum {high} (pick a per-node count that "
                            f"divides {low}, or raise the maximum)")
    return nodes, per_node


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _check_request(block: list[str], bounds: dict | None) -> None:
    """Raises TemplateError when the written #SBATCH request (nodes x gpus-per-node) is outside `gpus` bounds."""
    values = {m.group(1): m.group(2) for m in map(_SBATCH.match, block) if m}
    nodes, per_node = values.get("nodes") or "", values.get("gpus-per-node") or ""
    if not bounds or not nodes.isdigit() or not per_node.isdigit():
        return
    total = int(nodes) * int(per_node)
    if not bounds["min"] <= total <= bounds["max"]:
        raise TemplateError(f"the written request ({_count(int(nodes), 'node')} x {_count(int(per_node), 'GPU')} = "
                            f"{total}) is outside "
                            f"#ELASTIC gpus={bounds['min']}-{bounds['max']}; change --gpus or --gpus-per-node")


def _own_model(template: Template) -> str | None:
    """The template's own `model=` (its script's default `--profile`, tests/unit/test_templates.py checks)."""
    try:
        return parse_script(template.text).get("model")
    except DirectiveError:
        return None


def _current_gpus_per_node(block: list[str]) -> int:
    for line in block:
        match = _SBATCH.match(line)
        if match and match.group(1) == "gpus-per-node" and (match.group(2) or "").isdigit():
            return int(match.group(2))
    return 1


# --- CLI --------------------------------------------------------------------------------------------------
@click.group("template")
def template_group() -> None:
    """sbatch templates for elastic training jobs: list, show, render with your values."""


@template_group.command("list")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=TEMPLATE_DIR,
              show_default=False, help="Template directory (default: the installed sbatch_templates/).")
def list_cmd(directory: Path) -> None:
    """List the templates with what each trains.

    Example: elastic-slurm template list
    """
    found = templates(directory)
    if not found:
        raise click.ClickException(f"no *.sbatch templates in {directory}")
    width = max(len(n) for n in found)
    for name, tpl in found.items():
        click.echo(f"{name:{width}}  {tpl.summary}")


@template_group.command("show")
@click.argument("name")
def show_cmd(name: str) -> None:
    """Print a template as it is.

    Example: elastic-slurm template show gpt-lm
    """
    try:
        click.echo(get(name).text, nl=False)
    except TemplateError as exc:
        raise click.ClickException(str(exc)) from None


def _pairs(values: tuple[str, ...], what: str) -> dict:
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=what)
        out[key if key.startswith("-") else "--" + key] = value
    return out


@template_group.command("new")
@click.argument("name")
@click.option("--gpus", help="GPU bounds N or MIN-MAX (#ELASTIC gpus); the written request asks for MIN.")
@click.option("--gpus-per-node", type=click.IntRange(1, 64), help="GPUs per node of the written request.")
@click.option("--per-gpu-batch", type=click.IntRange(1, 65536), help="Per-GPU batch (directive and script).")
@click.option("--max-global-batch", type=click.IntRange(1, 16777216), help="#ELASTIC max_global_batch.")
@click.option("--min-efficiency", help="#ELASTIC min_efficiency, in [0, 1].")
@click.option("--objective", type=click.Choice(["throughput", "efficiency", "cost"]), help="#ELASTIC objective.")
@click.option("--gpu-type", help="#ELASTIC gpu_type (e.g. H100).")
@click.option("--model", help="#ELASTIC model: the predictor profile name (also the script's --profile, the name "
                                "its measurements go in under; --cpu-test: the tiny model's name).")
@click.option("--elastic", type=click.Choice(["on", "off"]), help="#ELASTIC elastic: off = never resize at run time.")
@click.option("--steps", type=click.IntRange(1), help="Training steps.")
@click.option("--data", help="Dataset path passed to the script as --data (default: synthetic data).")
@click.option("--time", "time_limit", help="#SBATCH --time, e.g. 02:00:00.")
@click.option("--partition", help="#SBATCH --partition.")
@click.option("--account", help="#SBATCH --account.")
@click.option("--job-name", help="#SBATCH --job-name.")
@click.option("--python", help="Interpreter of the command (default: python on the job's PATH).")
@click.option("--launcher", help="Command in place of elastic-launch, e.g. /opt/venv/bin/elastic-launch.")
@click.option("--command", "wrapped", help="wrap-train-py: your command, e.g. \"python train.py --epochs 3\".")
@click.option("--set", "script_set", multiple=True, metavar="OPT=VALUE",
              help="Another option of the training script, e.g. --set lr=0.05 for --lr 0.05 (repeatable).")
@click.option("--cpu-test", is_flag=True,
              help="The small CPU variant for the testbed (2 nodes x 1, or the node count within --gpus nearest 2; "
                   "tiny model).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=TEMPLATE_DIR,
              help="Template directory (default: the installed sbatch_templates/).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write here (default: stdout).")
def new_cmd(name, gpus, gpus_per_node, per_gpu_batch, max_global_batch, min_efficiency, objective, gpu_type, model,
            elastic, steps, data, time_limit, partition, account, job_name, python, launcher, wrapped, script_set,
            cpu_test,
            directory, out) -> None:
    """Render template NAME with your values into a batch script.

    Example: elastic-slurm template new resnet50 --gpus 2-16 --per-gpu-batch 64 --out job.sbatch
    """
    directives = {k: v for k, v in {"per_gpu_batch": per_gpu_batch, "max_global_batch": max_global_batch,
                                    "min_efficiency": min_efficiency, "objective": objective, "gpu_type": gpu_type,
                                    "model": model, "elastic": elastic}.items() if v is not None}
    sbatch = {k: v for k, v in {"time": time_limit, "partition": partition, "account": account,
                                "job-name": job_name}.items() if v is not None}
    script = {"--steps": str(steps)} if steps else {}
    if data:
        script["--data"] = data
    script.update(_pairs(script_set, "--set"))
    params = Params(gpus=gpus, gpus_per_node=gpus_per_node, directives=directives, sbatch=sbatch,
                    script_options=script, python=python, launcher=shlex.split(launcher) if launcher else None,
                    command=shlex.split(wrapped) if wrapped else None,
                    cpu_test=cpu_test)
    try:
        text = render(get(name, directory), params)
    except TemplateError as exc:
        raise click.ClickException(str(exc)) from None
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
        out.chmod(0o755)
        click.echo(f"wrote {out} (from template {name}); submit it with: sbatch {out}", err=True)
