"""`elastic-slurm`, the console entry point: a plain click group holding the core's commands (`install-plugin`,
`template`) and the lab's (`testbed`, `demo`: `slurm_plugin.lab.cli.COMMANDS`). It is the top of the import
order (docs/design.md): it imports the core and the lab, and nothing imports it. Entry points read the
environment once into frozen config objects and convert library errors into click errors at the boundary.
"""
from __future__ import annotations

import click

from slurm_plugin.installer import install_plugin
from slurm_plugin.lab.cli import COMMANDS as LAB_COMMANDS
from slurm_plugin.templates import template_group


@click.group()
def main() -> None:
    """Right-sized and elastic distributed training on Slurm GPU clusters."""


for _command in (install_plugin, template_group, *LAB_COMMANDS):
    main.add_command(_command)


if __name__ == "__main__":
    main()
