"""The admin commands of `elastic-predictor`: `models`, `links`, `plot` and `model show` (registered by
predictor/cli.py).

Thin over the pure row builders of predictor/admin_tables.py, which the /admin page (predictor/api/web.py)
uses too, so both show the same numbers.
"""
from __future__ import annotations

import json

import click

from predictor.admin_tables import (CONSTANT_COLUMNS, INTERVAL_COLUMNS, LINK_COLUMNS, MODEL_COLUMNS, TRUST_COLUMNS,
                                    Column, constant_rows, interval_rows, link_rows, model_rows, render_table,
                                    trust_rows)
from predictor.cli_support import load_config, open_store, require_db
from predictor.errors import NotFoundError, ValidationError


def _open(db: str | None, needed_for: str):
    """The existing database (a read command refuses a missing file instead of creating an empty one)."""
    path = load_config(db).db_path
    require_db(path, db, needed_for)
    return open_store(path)


def _fit(store, skip: bool):
    """A Predictor fitted on the store, or None (skip, or nothing to fit)."""
    if skip:
        return None
    from predictor.engine import Predictor  # noqa: PLC0415 - numpy, scipy, sklearn: only `model fit`
    from predictor.profiles import Profile  # noqa: PLC0415 - off elastic-predictor's start

    profiles = {row["name"]: Profile.from_dict(row["body"]) for row in store.list_profiles()}
    try:
        return Predictor().fit(profiles, store.observations())
    except (ValidationError, RuntimeError, ValueError) as exc:
        raise click.ClickException(f"cannot fit the model on {store.path}: {exc}") from None


_DB = click.option("--db", default=None, help="SQLite database (default $ELASTIC_PREDICTOR_DB or predictor.db)")
_NO_FIT = click.option("--no-fit", is_flag=True, help="do not fit (faster; fit columns from the last service fit)")
_WIDTH = click.option("--width", type=click.IntRange(40, 1000), default=None, help="line width (default: terminal)")


def _with_fitted_store(db: str | None, fit: bool, build, needed_for: str):
    """`build(store, predictor or None)` on the database, closed afterwards; library errors become click's."""
    store = _open(db, needed_for)
    try:
        return build(store, _fit(store, not fit))
    except NotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        store.close()


def _echo_table(rows: list[dict], columns: list[Column], width: int | None, empty: str) -> None:
    if not rows:
        raise click.ClickException(empty)
    click.echo(render_table(rows, columns, width))


def _write_png(out: str, png: bytes) -> None:
    with open(out, "wb") as fh:
        fh.write(png)
    click.echo(f"wrote {out} ({len(png)} bytes)")


@click.command("models")
@_DB
@_NO_FIT
@_WIDTH
def models_cmd(db, no_fit, width):
    """Table of models: each profile and GPU type with its history, layouts seen and fit error.

    Example: elastic-predictor models --db predictor.db
    """
    _echo_table(_with_fitted_store(db, not no_fit, model_rows, "no profiles and no step history to show"),
                MODEL_COLUMNS, width,
                "no profiles and no step history in the database yet")


@click.command("links")
@_DB
@_NO_FIT
@_WIDTH
def links_cmd(db, no_fit, width):
    """Table of link classes: collective records, fitted latency and bandwidth, fit error.

    Example: elastic-predictor links --db predictor.db
    """
    _echo_table(_with_fitted_store(db, not no_fit, link_rows, "no collective history to show"), LINK_COLUMNS, width,
                "no collective history and no link fits in the database yet")


@click.group("model")
def model_group():
    """The fitted model as the service stores it: `model show`."""


@model_group.command("show")
@_DB
@click.option("--json", "as_json", is_flag=True, help="print the stored JSON document whole")
@_WIDTH
def model_show(db, as_json, width):
    """Print the newest stored model: its version, the step model's constants with their basis (calibrated, fitted,
    default), the 80% interval of each basis, and the ladders and sweeps it read (`--json`: the document).

    Example: elastic-predictor model show --db predictor.db
    """
    store = _open(db, "no model to show")
    try:
        stored = store.newest_model()
    finally:
        store.close()
    if stored is None:
        raise click.ClickException(f"no fitted model stored in {store.path} yet: the service stores one after its "
                                   "first fit (elastic-predictor serve), or run `elastic-predictor models` to fit here")
    try:
        doc = json.loads(stored.blob)
        params = doc["predictor"]["model"]
    except (ValueError, KeyError, TypeError) as exc:
        raise click.ClickException(f"stored model g{stored.head.version} is not a JSON document of this release "
                                   f"({exc}); the service replaces it at its next fit") from None
    if as_json:
        click.echo(json.dumps(doc, indent=1))
        return
    click.echo(f"model g{stored.head.version}: step model {params.get('version')}, fitted in {stored.fit_s:.2f} s, "
               f"{'converged' if params.get('converged', True) else 'NOT converged: default constants'}")
    click.echo(f"{len(params.get('ladders', {}))} 1-GPU ladders, {len(params.get('collectives', {}))} swept "
               f"(link, world) curves")
    click.echo("\nconstants:")
    click.echo(render_table(constant_rows(params), CONSTANT_COLUMNS, width))
    trusted = trust_rows(params)
    click.echo("\nvotes weighed down (users whose rows sit far from everyone else's):")
    click.echo(render_table(trusted, TRUST_COLUMNS, width) if trusted else "none")
    click.echo("\nintervals (factor of the prediction):")
    click.echo(render_table(interval_rows(params), INTERVAL_COLUMNS, width))


class _SubcommandFirst(click.Group):
    """A group whose commands take the options: an option given to the group itself (`plot --db X`) is an
    error that names the subcommands, instead of click's bare "No such option"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            names = " | ".join(sorted(self.commands))
            raise click.UsageError(f"{exc.format_message().rstrip('.')}: `{ctx.command_path}` needs a subcommand first "
                                   f"({names}), then its options, e.g. "
                                   f"`{ctx.command_path} scaling --db predictor.db --out scaling.png`", ctx) from None


@click.group("plot", cls=_SubcommandFirst)
def plot_group():
    """Write the admin plots as PNG files (the /admin page serves the same): `plot scaling` or `plot links`,
    then the options (--db, --out).
    """


_OUT = click.option("--out", required=True, type=click.Path(dir_okay=False), help="PNG file to write")


@plot_group.command("scaling")
@_DB
@click.option("--profile", default=None, help="only this profile (default: every profile with history)")
@click.option("--gpu", default=None, help="only this GPU type")
@_OUT
def plot_scaling(db, profile, gpu, out):
    """Predicted vs observed throughput against GPU count, per model and layout family.

    Example: elastic-predictor plot scaling --db predictor.db --profile resnet50 --out scaling.png
    """
    from predictor import plots  # noqa: PLC0415 - numpy: only the plot commands

    _write_png(out, _with_fitted_store(db, True, lambda s, p: plots.scaling_png(s, p, profile=profile, gpu=gpu),
                                       "nothing to plot"))


@plot_group.command("links")
@_DB
@_OUT
def plot_links(db, out):
    """Per-link bandwidth against message size: observed collectives and the fitted model.

    Example: elastic-predictor plot links --db predictor.db --out links.png
    """
    from predictor import plots  # noqa: PLC0415 - numpy: only the plot commands

    _write_png(out, _with_fitted_store(db, True, plots.links_png, "nothing to plot"))


COMMANDS = (models_cmd, links_cmd, plot_group, model_group)


def register(group: click.Group) -> None:
    """Add the admin commands to the `elastic-predictor` group."""
    for command in COMMANDS:
        group.add_command(command)
