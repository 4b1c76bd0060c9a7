"""What every `elastic-predictor` command shares: the config from the environment and the options, and the
database, opened the way a read or a write command needs it.

Used by predictor/cli.py and predictor/admin_cli.py; imports neither of them nor the web app, so the command
modules and the pure table builders (predictor/admin_tables.py) form no circle of imports.
"""
from __future__ import annotations

import os

import click

from predictor.cluster import Cluster
from predictor.config import ENV_CLUSTER, ENV_DB, Config
from predictor.errors import ValidationError


def load_config(db: str | None, cluster: str | None = None) -> Config:
    """The config from the environment and the options; a bad cluster file is an error naming it."""
    try:
        model = Cluster.from_file(cluster) if cluster else None
    except ValidationError as exc:
        raise click.ClickException(in_file(cluster, exc)) from None
    try:
        return Config.from_env(os.environ, db_path=db, cluster=model)
    except ValidationError as exc:
        if not exc.field.startswith("ELASTIC_PREDICTOR_") and os.environ.get(ENV_CLUSTER):
            raise click.ClickException(in_file(f"{os.environ[ENV_CLUSTER]} (${ENV_CLUSTER})", exc)) from None
        raise click.ClickException(str(exc)) from None


def in_file(name: str, exc: ValidationError) -> str:
    """`FILE: FIELD: message` (the cluster loader's own read errors already name the file)."""
    return str(exc) if exc.field == "cluster" else f"{name}: {exc}"


def require_db(db_path: str, db_option: str | None, needed_for: str) -> None:
    """Refuse a read command on a database file that does not exist (opening it would create an empty one).

    Args:
        db_path: the resolved path (`Config.db_path`).
        db_option: the command's `--db` value (None: it came from the environment or the default).
        needed_for: what the command reads, for the message (e.g. "no history to fit").

    Raises:
        click.ClickException: naming the path, where it came from, and what creates a database.
    """
    if db_path == ":memory:" or os.path.isfile(db_path):
        return
    origin = ("--db" if db_option else f"${ENV_DB}" if os.environ.get(ENV_DB)
              else f"the default: neither --db nor ${ENV_DB} is set")
    where = os.path.abspath(db_path)
    problem = f"{where} is not a file" if os.path.exists(db_path) else f"no database at {where}"
    raise click.ClickException(f"{problem} ({origin}): {needed_for}; check the path "
                               "(`elastic-predictor import` and `serve` create a database)")


def open_store(db_path: str, writable: bool = False):
    """The store at `db_path`, migrated (and, with `writable`, checked by a real write).

    Raises:
        click.ClickException: the file cannot be opened or migrated (missing folder, not a database...), or
            with `writable`, cannot be written (read-only file or mount, full disk).
    """
    import sqlite3  # noqa: PLC0415 - only the commands that open the database

    from predictor.store import Store  # noqa: PLC0415 - only the commands that open the database

    store = Store(db_path)
    try:
        store.migrate()
    except sqlite3.Error as exc:
        store.close()
        raise click.ClickException(f"cannot open database {db_path}: {exc}") from None
    if writable and (problem := store.write_problem()) is not None:
        store.close()
        raise click.ClickException(f"database {db_path} cannot be written ({problem}): the service would answer "
                                   "every write with an error; check the file's permissions, its file system "
                                   "(read-only mount?) and free disk space")
    return store
