"""The lab's commands of `elastic-slurm`: `testbed up|down|status|env` (this module) and `demo`
(`slurm_plugin.lab.demo`). The entry point (`slurm_plugin.cli`) adds them to its group; the lab sits on top of
the import order, so nothing in slurm_plugin's core, predictor or elastic_launcher imports it.
"""
from __future__ import annotations

import functools
import os
import shlex
from pathlib import Path

import click

from slurm_plugin.errors import TestbedError
from slurm_plugin.lab.demo import LabLock, busy_message, demo_command, stop_lab_services
from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.root import HOST_VERSION, VERSIONS, checkout
from slurm_plugin.lab.testbed_conf import (DEFAULT_LAB, DEFAULT_PORT_BASE, PORT_SPAN, TestbedConfig, recorded_gpus,
                                           recorded_port_base, recorded_slurm)

@click.group("testbed")
def testbed_group() -> None:
    """A local 4-node Slurm cluster (4 fake GPUs per node) for tests and the demo."""


def _lab_options(func):
    @click.option("--lab", type=click.Path(file_okay=False, path_type=Path), envvar="ELASTIC_SLURM_LAB",
                  default=DEFAULT_LAB, show_default=True, help="Lab directory (env ELASTIC_SLURM_LAB).")
    @click.option("--port-base", type=click.IntRange(1024, 65535 - PORT_SPAN), envvar="ELASTIC_SLURM_PORT_BASE",
                  help=f"First of the {PORT_SPAN} TCP ports the lab uses (env ELASTIC_SLURM_PORT_BASE; default: "
                       f"the one the lab last used, else {DEFAULT_PORT_BASE}).")
    @click.option("--slurm", type=click.Choice(VERSIONS), envvar="ELASTIC_SLURM_VERSION",
                  help=f"Slurm release (env ELASTIC_SLURM_VERSION): {HOST_VERSION} is the host's slurm-wlm; the others "
                       f"run from a Debian root built on first use and cached (minutes the first time). Default: the "
                       f"one the lab last ran, else {HOST_VERSION}.")
    @functools.wraps(func)
    def wrapper(lab: Path, port_base: int | None, slurm: str | None, gpus: str | None = None, **kwargs):
        lab = lab.absolute()
        base = port_base or recorded_port_base(lab) or DEFAULT_PORT_BASE
        untyped = (gpus or recorded_gpus(lab) or "typed") == "untyped"
        version = slurm or recorded_slurm(lab) or HOST_VERSION
        config = TestbedConfig(lab=lab, port_base=base, slurm=version, **({"gpu_types": ()} if untyped else {}))
        return func(Testbed(config), **kwargs)

    return wrapper


def _timings(timings: dict[str, float]) -> str:
    return "  ".join(f"{name}={seconds:.2f}s" for name, seconds in timings.items())


@testbed_group.command()
@click.option("--gpus", type=click.Choice(["typed", "untyped"]),
              help="typed: GRES gpu:h100 / gpu:a100 and a partition per type (the default); untyped: plain "
                   "`Gres=gpu:4` on every node and only the `debug` partition (what SchedMD's test_gpu_options.py "
                   "needs). Default: what the lab last used, else typed.")
@_lab_options
def up(bed: Testbed) -> None:
    """Start the cluster (idempotent) and wait until all nodes are idle.

    Example: elastic-slurm testbed up --lab /var/tmp/my-lab --port-base 16900 [--gpus untyped]
    """
    try:
        timings = bed.up()
    except TestbedError as exc:
        hint = ""
        if any(st.running for st in bed.status()):
            hint = f"\n(stop what did start with: elastic-slurm testbed down --lab {bed.config.lab})"
        raise click.ClickException(f"{exc}{hint}") from exc
    click.echo(f"testbed up: Slurm {bed.config.slurm}, {bed.config.nodes} nodes idle, lab {bed.config.lab}, "
               f"port base {bed.config.port_base}, {'typed' if bed.config.gpu_types else 'untyped'} GPUs")
    click.echo(f"timings: {_timings(timings)}")


@testbed_group.command()
@_lab_options
@click.option("--wipe", is_flag=True, help="Also delete state, spool, database and logs.")
def down(bed: Testbed, wipe: bool) -> None:
    """Stop everything the lab runs: cancel its jobs, stop its predictor service (the one `elastic-slurm demo
    --keep` leaves in LAB/predictor), then exactly the daemons this lab started (SIGTERM, then SIGKILL).
    Refused while a demo is running in the lab (it stops everything itself when it ends).

    Example: elastic-slurm testbed down --wipe
    """
    holder = LabLock.holder(bed.config.lab)
    if holder is not None:
        raise click.ClickException(busy_message(bed.config.lab, holder, elsewhere=False))
    cancelled, predictor_stopped = stop_lab_services(bed)
    try:
        timings = bed.down(wipe=wipe)
    except TestbedError as exc:
        raise click.ClickException(str(exc)) from exc
    stopped = [f"{cancelled} job{'' if cancelled == 1 else 's'} cancelled"] if cancelled else []
    stopped += ["predictor stopped"] if predictor_stopped else []
    click.echo(f"testbed down: lab {bed.config.lab}" + (" (wiped)" if wipe else "")
               + (f"; {', '.join(stopped)}" if stopped else ""))
    click.echo(f"timings: {_timings(timings)}")


@testbed_group.command()
@_lab_options
def status(bed: Testbed) -> None:
    """Show the lab's daemons and nodes; exit 1 unless the cluster is up.

    Example: elastic-slurm testbed status
    """
    for st in bed.status():
        click.echo(f"{st.name:14} {'running' if st.running else 'stopped':8} {st.pid or ''}")
    if not bed.is_up():
        raise click.ClickException(f"testbed in {bed.config.lab} is not up")
    for node in bed.client.nodes():
        click.echo(f"{node.name:8} {node.state:10} gpu {node.gpus_alloc}/{node.gpus} switch {node.switch}")


@testbed_group.command()
@_lab_options
def env(bed: Testbed) -> None:
    """Print shell exports for this lab.

    Example: eval "$(elastic-slurm testbed env)" && sinfo
    """
    exports = {**bed.env(), "ELASTIC_SLURM_LAB": str(bed.config.lab)}
    for key, value in exports.items():
        if key == "PATH":   # the lab's wrappers in front of the caller's own PATH
            click.echo(f'export PATH={shlex.quote(str(bed.config.bin_dir))}:"$PATH"')
        else:
            click.echo(f"export {key}={shlex.quote(value)}")


@testbed_group.command("exec", context_settings={"ignore_unknown_options": True})
@_lab_options
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(bed: Testbed, argv: tuple[str, ...]) -> None:
    """Run a command where the lab's Slurm lives: inside its root for 24.11 (the root's /usr/bin first on PATH,
    this checkout on PYTHONPATH: pyslurm is there), as is for 22.05; with the lab's SLURM_CONF.

    Example: elastic-slurm testbed exec --lab /var/tmp/lab24 -- python3 -m pytest tests/integration/test_client.py
    """
    env = {**os.environ, **bed.env(), "ELASTIC_SLURM_LAB": str(bed.config.lab)}
    if bed.root is not None:
        env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
        env["PYTHONPATH"] = str(checkout())
        argv = tuple(bed.root.command(list(argv)))
    try:
        os.execvpe(argv[0], list(argv), env)
    except OSError as exc:
        raise click.ClickException(f"cannot run {argv[0]}: {exc}") from exc


COMMANDS = (testbed_group, demo_command)   # what the entry point adds to `elastic-slurm`
