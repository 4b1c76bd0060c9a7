"""`elastic-predictor`: the service's command line, thin over the library the API uses.

Every command reads the environment once (`Config.from_env(os.environ, ...)`) and passes explicit values
down; library errors become `click.ClickException` here.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import click

from predictor.admin_cli import COMMANDS as _ADMIN_COMMANDS
from predictor.cli_support import load_config as _config  # also imported from here by bench/slow_clients.py
from predictor.cli_support import open_store as _open_store  # and by tests/unit/test_api.py
from predictor.cli_support import require_db
from predictor.cluster import Cluster
from predictor.config import ENV_ADMIN_TOKEN, ENV_MUNGE, ENV_READ_AUTH, ENV_TOKEN, Config
from predictor.errors import NotFoundError, ValidationError
from slurm_plugin import calibration as _calibration
from slurm_plugin.contracts.records import layout_name
from slurm_plugin.errors import DirectiveError, SlurmError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table: columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else format(row[k], f)) for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@click.group()
def main():
    """Throughput predictor and job planner for elastic GPU training on Slurm."""


def _slurm_cluster(spec: str):
    from slurm_plugin.client import Backend, CommandBackend  # noqa: PLC0415 - Slurm client: only --from-slurm

    parts = spec.split(":")
    if len(parts) != 3 or not all(parts):
        raise click.BadParameter(f"expected GPU:INTRA:INTER, got {spec!r}", param_hint="--from-slurm")
    backend: Backend = CommandBackend()
    try:
        return Cluster.from_slurm(backend.nodes(), backend.partitions(), *parts)
    except (SlurmError, ValidationError) as exc:
        raise click.ClickException(f"cannot read the cluster from Slurm: {exc}") from None


def auth_policy(config: Config) -> list[str]:
    """What `serve` says at start about who may write and read (predictor.auth's rules on this config)."""
    writers = []
    if config.admin_token:
        writers.append(f"the admin token ({ENV_ADMIN_TOKEN})")
    if config.token:
        writers.append(f"the tool token ({ENV_TOKEN})")
    if config.munge_auth:
        writers.append(f"munge-signed job credentials ({ENV_MUNGE}=1)")
    reads = "reads need the same credentials" if config.read_auth else "reads are open"
    if not writers and not config.open_writes:
        return [f"writes are closed: none of {ENV_TOKEN}, {ENV_ADMIN_TOKEN}, {ENV_MUNGE} is set (`--allow-dev "
                "open-writes` opens them to anyone, for development); admin operations (replacing a profile) need "
                f"a token: none is set, so they are refused; {reads}"]
    if not writers:
        lines = [f"warning: writes are open to anyone (--allow-dev open-writes): none of {ENV_TOKEN}, "
                 f"{ENV_ADMIN_TOKEN}, {ENV_MUNGE} is set"]
        if config.read_auth:
            lines.append(f"warning: {ENV_READ_AUTH} is on but no credential is configured: every read except "
                         "/healthz is refused")
        return lines
    admin = ("the admin token" if config.admin_token else "the tool token" if config.token else None)
    lines = [f"writes need {' or '.join(writers)}; admin operations (replacing a profile) need "
             f"{admin or 'a token: none is set, so they are refused'}; {reads}"]
    if not (config.token or config.admin_token):
        lines.append(f"warning: neither {ENV_TOKEN} nor {ENV_ADMIN_TOKEN} is set: only running jobs can write")
    return lines


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
@click.option("--port", default=8470, show_default=True, type=int, help="port to bind")
@click.option("--db", default=None, help="SQLite database (default $ELASTIC_PREDICTOR_DB or predictor.db)")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 64), help="gunicorn worker processes")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1, 64),
              help="threads per worker (>1: gthread workers with keep-alive; 1: sync workers, lowest tail)")
@click.option("--cluster", default=None, type=click.Path(exists=True, dir_okay=False), help="cluster model JSON file")
@click.option("--timeout", default=30, show_default=True, type=int, help="gunicorn worker timeout, seconds")
@click.option("--from-slurm", "from_slurm", default=None, metavar="GPU:INTRA:INTER",
              help="build the cluster model from sinfo/scontrol, with the GPU type and link names given, e.g. H200:nvlink:ib")
@click.option("--allow-dev", "allow_dev", multiple=True, type=click.Choice(["open-writes"]),
              help="development setups, each named: open-writes (anyone writes while no token and no munge is "
                   "configured)")
@click.option("--read-timeout", default=10.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="seconds nginx waits for a request's head, between two reads of its body, and on an idle "
                   "keep-alive connection")
@click.option("--max-connections", default=2048, show_default=True, type=click.IntRange(16, 1_000_000),
              help="nginx: client connections at once, all addresses")
@click.option("--per-address", default=256, show_default=True, type=click.IntRange(1, 1_000_000),
              help="nginx: client connections at once from one address, idle ones included (more are closed)")
@click.option("--per-address-requests", default=64, show_default=True, type=click.IntRange(1, 1_000_000),
              help="nginx: requests in progress from one address (more: 429)")
@click.option("--per-credential-requests", default=16, show_default=True, type=click.IntRange(1, 1_000_000),
              help="nginx: requests in progress with one bearer token (the tool's or the admin's), from all "
                   "addresses together (more: 429; docs/admin-guide.md, Security)")
@click.option("--side-workers", default=1, show_default=True, type=click.IntRange(0, 64),
              help="nginx: worker processes of a second gunicorn (4 threads each, nice 10) that answers every "
                   "request but the hook's (POST /v1/plan without a munge credential, /healthz), which --workers "
                   "answer (0: one gunicorn for all)")
@click.option("--hook-from", default="", metavar="ADDR[,ADDR]",
              help="nginx: the hosts slurmctld's job_submit hook calls from (addresses or networks): their "
                   "connections get --hook-connections slots of their own and only their plans reach the plan pool, "
                   "so other clients holding every other slot cannot starve the hook (#41.4)")
@click.option("--hook-connections", default=64, show_default=True, type=click.IntRange(1, 1_000_000),
              help="nginx: connections at once from the --hook-from hosts, apart from --max-connections")
def serve(host, port, db, workers, threads, cluster, timeout, from_slurm, allow_dev, read_timeout,
          max_connections, per_address, per_address_requests, per_credential_requests, side_workers, hook_from,
          hook_connections):
    """Run the HTTP API under gunicorn behind nginx, which reads each request whole and caps connections per
    client address (needs nginx-light libnginx-mod-stream); prints at start who may write and read
    (docs/admin-guide.md, Security; slow clients: "Run the predictor").

    Writes need $ELASTIC_PREDICTOR_ADMIN_TOKEN, $ELASTIC_PREDICTOR_TOKEN or, with ELASTIC_PREDICTOR_MUNGE=1, a
    munge-signed job credential; with none of them set, writes are closed (`--allow-dev open-writes`: open to
    anyone, a warning).

    Example: ELASTIC_PREDICTOR_TOKEN=s3cret elastic-predictor serve --host 0.0.0.0 --port 8470 --db /var/lib/ep.db
    """
    from predictor.app import create_app  # noqa: PLC0415 - Flask, numpy, scipy: only `serve`
    from predictor.front_nginx import NginxLimits, NginxMissing, nginx_missing, run_nginx  # noqa: PLC0415 - only `serve`

    missing = nginx_missing()
    if missing:                       # before anything is created
        raise click.ClickException(f"serve's front end is nginx with its stream module; {missing}")
    config = _config(db, cluster).replace(open_writes="open-writes" in allow_dev)
    if from_slurm:
        config = config.replace(cluster=_slurm_cluster(from_slurm))
    for line in auth_policy(config):
        click.echo(line, err=True)
    _open_store(config.db_path, writable=True).close()   # migrate once, before the workers fork
    # the engine (numpy, scipy, sklearn: ~0.8 s of CPU to import) is imported once here, before gunicorn forks, so
    # a worker that gunicorn starts again (after a crash or a SIGKILL) does not take that CPU from the others
    import predictor.engine  # noqa: F401, PLC0415 - preloaded before gunicorn forks (see above)

    def load():
        return create_app(config)         # per worker: its own connections and refit thread

    try:
        nginx_limits = NginxLimits(max_body=config.max_body_bytes, read_timeout=read_timeout,
                                   upstream_timeout=timeout + 5, max_connections=max_connections,
                                   per_address=min(per_address, max_connections),
                                   per_address_requests=per_address_requests,
                                   per_credential_requests=per_credential_requests,
                                   hook_from=tuple(a.strip() for a in hook_from.split(",") if a.strip()),
                                   hook_connections=hook_connections)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--hook-from") from None
    plan_config = config.replace(fits=False, plot_prerender=False) if side_workers else config

    def load_plan_pool():
        return create_app(plan_config)   # it answers only /v1/plan and /healthz: fits and drawings are the side's

    try:
        status = run_nginx(load_plan_pool, host=host, port=port, workers=workers, threads=threads,
                           timeout=timeout, limits=nginx_limits, log=lambda line: click.echo(line, err=True),
                           side_workers=side_workers, side_load=load)
    except NginxMissing as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    sys.exit(status)


@main.command("import")
@click.argument("file", type=click.File("rb"))
@click.option("--db", default=None, help="SQLite database (default $ELASTIC_PREDICTOR_DB or predictor.db)")
@click.option("--skip-bad", is_flag=True, help="store the good lines even when some are bad (exit status 0)")
def import_(file, db, skip_bad):
    """Import JSON lines of observations and profiles (`"kind": "profile"` or an object with `tensors`).

    Every line is read and validated before anything is written. A bad line is reported as
    FILE:LINE: FIELD: what is wrong; then the import is all or nothing: nothing is stored and the exit
    status is 1, unless --skip-bad, which stores the good lines. Profiles are written first (one of the
    same name is replaced), then all observations in one transaction; if the database fails in between,
    the error says what was written, and running the same import again is safe.

    Example: elastic-predictor import --db predictor.db history.jsonl
    """
    from predictor.importer import read_jsonl  # noqa: PLC0415 - only `import`

    name = "<stdin>" if getattr(file, "name", "-") in ("-", "<stdin>") else file.name
    parsed = read_jsonl(file, name)
    for message in parsed.bad:
        click.echo(message, err=True)
    if parsed.bad and not skip_bad:
        raise click.ClickException(f"{name}: {len(parsed.bad)} bad line(s); nothing imported "
                                   "(use --skip-bad to keep the good ones)")
    _write_import(_config(db).db_path, parsed.profiles, parsed.records)
    click.echo(f"imported {len(parsed.records)} observation(s) and {len(parsed.profiles)} profile(s); "
               f"{len(parsed.bad)} bad line(s)")


def _write_import(db_path: str, profiles: dict[str, dict], records: list[dict]) -> None:
    """Profiles, then the observations in one transaction; a database error says what got written."""
    import sqlite3  # noqa: PLC0415 - only `import` writes rows

    store = _open_store(db_path)
    written = 0
    try:
        for profile_name, body in profiles.items():
            store.put_profile(profile_name, body)
            written += 1
        if records:
            store.add_observations(records)
    except (sqlite3.Error, ValueError) as exc:
        raise click.ClickException(f"cannot write to {db_path}: {exc}; {written} of {len(profiles)} profile(s) "
                                   "and no observation written (running the import again is safe)") from None
    finally:
        store.close()


@main.command()
@click.argument("spec")
@click.option("--db", default=None, help="also register the profile in this database")
@click.option("--dtype", default=None, help="parameter dtype, e.g. bfloat16 (default: the model's own)")
@click.option("--json", "as_json", is_flag=True, help="print the full profile as JSON (importable)")
@click.option("--name", default=None, help="the profile's name: your jobs' `#ELASTIC model=` (default: the part of "
                                           "SPEC after the colon)")
def profile(spec, db, dtype, as_json, name):
    """Build a tensor profile from a spec (no weights downloaded), print it, optionally register it.

    SPEC: torchvision:NAME, transformers:NAME, a built-in name, or package.module:callable (your own model: a
    callable that returns the torch.nn.Module when called without arguments).

    Example: elastic-predictor profile torchvision:resnet50 --db predictor.db (your own model:
    elastic-predictor profile mylab.nets:build_unet --name unet --db predictor.db)
    """
    from predictor.api.profiles import register, summary  # noqa: PLC0415 - Flask: only `profile`
    from predictor.profiles import profile_from_spec  # noqa: PLC0415 - off elastic-predictor's start

    try:
        built = profile_from_spec(spec, dtype=dtype, name=name)
    except NotFoundError as exc:
        raise click.ClickException(_did_you_mean(str(exc), spec, _builtin_specs(spec))) from None
    except ValidationError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(built.to_dict()))
    else:
        click.echo(_table([summary(built)], [("name", "profile", "s"), ("tensors", "tensors", "d"),
                                             ("params", "params", ","), ("grad_bytes", "grad bytes", ","),
                                             ("buckets", "buckets", "d")]))
    if db:
        store = _open_store(_config(db).db_path)
        _, created = register(store, built.to_dict())
        store.close()
        click.echo(f"{'registered' if created else 'replaced'} profile {built.name!r} in {db}", err=True)
    elif not as_json:
        click.echo(f"(printed only: add --db DB to register {built.name!r} in a database)", err=True)


def _did_you_mean(message: str, name: str, candidates) -> str:
    """`message`, plus the candidate that differs from `name` only in letter case, if there is one."""
    close = sorted({c for c in candidates if c.lower() == name.lower() and c != name})
    if not close:
        return message
    return f"{message.split(';', 1)[0]}; did you mean {close[0]!r}? (names are case-sensitive)"


def _builtin_specs(spec: str) -> list[str]:
    """The specs `profile` can build with the same library prefix as `spec` (built-ins and their aliases)."""
    from predictor import profiles  # noqa: PLC0415 - off elastic-predictor's start

    lib, sep, _ = spec.rpartition(":")
    names = [*profiles.BUILTIN, *getattr(profiles, "_ALIASES", {})]
    return [f"{lib}{sep}{name}" for name in names]


def _fitted_cache(config: Config, db_option: str | None, needed_for: str = "no history to fit"):
    """The model fitted on the database, which must exist (a read command never creates one)."""
    from predictor.service import ModelCache  # noqa: PLC0415 - the store and model cache: only read commands

    require_db(config.db_path, db_option, needed_for)
    store = _open_store(config.db_path)
    cache = ModelCache(store)
    try:
        cache.refit()
    except (ValidationError, RuntimeError, ValueError) as exc:
        raise click.ClickException(f"cannot fit the model on {config.db_path}: {exc}") from None
    return cache


@main.command()
@click.option("--profile", "profile_name", required=True, help="registered profile name")
@click.option("--gpu", required=True, help="GPU type, e.g. H200")
@click.option("--per-gpu-batch", required=True, type=click.IntRange(1, 65536), help="per-GPU micro-batch")
@click.option("--gpus", default=None, help="GPU counts: N or MIN-MAX (default: 1 up to the partition)")
@click.option("--partition", default=None, help="partition of the cluster model (default: one with that GPU type)")
@click.option("--db", default=None, help="SQLite database (default $ELASTIC_PREDICTOR_DB or predictor.db)")
@click.option("--cluster", default=None, type=click.Path(exists=True, dir_okay=False), help="cluster model JSON file")
def predict(profile_name, gpu, per_gpu_batch, gpus, partition, db, cluster):
    """Fit on the database and print predicted throughput of every candidate layout.

    The GPU type and partition come from the cluster model (--cluster, else $ELASTIC_PREDICTOR_CLUSTER, else
    the built-in testbed): pass the one the service runs with.

    Example: elastic-predictor predict --profile resnet50 --gpu H200 --per-gpu-batch 64 --gpus 4-8
    """
    from predictor.api.predict import enumerate_candidates  # noqa: PLC0415 - Flask, numpy: only `predict`
    from predictor.profiles import Profile  # noqa: PLC0415 - off elastic-predictor's start

    config = _config(db, cluster)
    low, _, high = (gpus or "1").partition("-")
    if not low.isdigit() or (high and not high.isdigit()):
        raise click.BadParameter(f"expected N or MIN-MAX, got {gpus!r}", param_hint="--gpus")
    low_n, high_n = int(low), int(high or low) if gpus else None
    cache = _fitted_cache(config, db, "no history to predict from")
    prof = cache.profile(profile_name)
    if prof is None:
        if not cache.store.has_profile(profile_name):
            names = [row["name"] for row in cache.store.list_profiles()]
            raise click.ClickException(_did_you_mean(
                f"profile {profile_name!r} not found in {config.db_path}", profile_name, names)
                + f" (register one with: elastic-predictor profile torchvision:NAME or "
                  f"package.module:callable --name {profile_name} --db {config.db_path})")
        prof = Profile.from_dict(cache.store.get_profile(profile_name))
    try:
        candidates = enumerate_candidates(config.cluster, gpu, partition, high_n)
    except NotFoundError as exc:
        raise click.ClickException(
            f"{exc}; pass --cluster FILE (or set $ELASTIC_PREDICTOR_CLUSTER) with the cluster model the service "
            "runs with (a demo lab's is LAB/predictor/cluster.json)") from None
    candidates = [c for c in candidates if sum(c["layout"]) >= low_n]
    if not candidates:
        raise click.ClickException(f"no layout of {gpus} GPU{'' if gpus == '1' else 's'} fits the partition")
    rows = cache.predict(prof, gpu, per_gpu_batch, candidates)
    for row, cand in zip(rows, candidates):
        row.update(gpus=sum(cand["layout"]), shape="x".join(map(str, (len(cand["layout"]), cand["layout"][0]))),
                   links=cand["intra_link"] + ("+" + cand["inter_link"] if "inter_link" in cand else ""))
    click.echo(f"{profile_name} on {gpu}, per-GPU batch {per_gpu_batch}, model {cache.version}"
               f" ({'observed' if cache.known(profile_name, gpu) else 'never observed: estimate'})")
    click.echo(_table(rows, [("gpus", "gpus", "d"), ("shape", "nodes x gpus", "s"), ("links", "links", "s"),
                             ("samples_per_s", "samples/s", ".1f"), ("iter_s", "iter s", ".4f"),
                             ("compute_s", "compute s", ".4f"), ("comm_s", "comm s", ".4f"),
                             ("uncertainty", "log std", ".2f"), ("basis", "basis", "s")]))


@main.command()
@click.argument("script", type=click.File("rb"))
@click.option("--nodes", default=None, type=click.IntRange(1, 4096), help="nodes the job asks for (-N)")
@click.option("--gpus-per-node", default=None, type=click.IntRange(1, 64), help="GPUs per node it asks for")
@click.option("--partition", default=None, help="partition (default: the cluster model's default)")
@click.option("--db", default=None, help="SQLite database (default $ELASTIC_PREDICTOR_DB or predictor.db)")
@click.option("--cluster", default=None, type=click.Path(exists=True, dir_okay=False), help="cluster model JSON file")
def plan(script, nodes, gpus_per_node, partition, db, cluster):
    """Plan a batch script as the job_submit hook would; the decision is stored like the service's.

    Example: elastic-predictor plan train.sbatch --nodes 1 --gpus-per-node 4
    """
    from predictor import planner  # noqa: PLC0415 - numpy, scipy: only `plan`
    from slurm_plugin.contracts.directives import directive_lines, parse_lines  # noqa: PLC0415 - only `plan`

    config = _config(db, cluster)
    job = {"min_nodes": nodes, "partition": partition,
           "tres_per_node": f"gres:gpu:{gpus_per_node}" if gpus_per_node else None}
    data = script.read()
    try:
        lines = directive_lines(data.decode("utf-8"))
        parse_lines(lines)                  # line numbers of the file (the planner counts directives only)
    except UnicodeDecodeError as exc:
        line_no = data[:exc.start].count(b"\n") + 1
        raise click.ClickException(f"{script.name}:{line_no}: not UTF-8 text ({exc.reason})") from None
    except DirectiveError as exc:
        raise click.ClickException(f"{script.name}:{exc.line_no}: {exc.reason}: {exc.line!r}") from None
    body = {"source": "cli", "directives": [line for _, line in lines], "job": job}
    try:
        request = planner.parse_request(body)
    except planner.DirectiveProblem as exc:
        raise click.ClickException(_directive_problem(script.name, lines, exc)) from None
    except ValidationError as exc:
        raise click.ClickException(f"{script.name}: {exc}") from None
    cache = _fitted_cache(config, db, "no history to plan with")
    try:   # a directive the cluster cannot meet (gpus above every partition) is refused, as the service answers 422
        decision = planner.plan(request, config.cluster, cache, config.default_min_efficiency,
                                config.max_plan_candidates, cache.store.path)
    except planner.DirectiveProblem as exc:
        raise click.ClickException(_directive_problem(script.name, lines, exc)) from None
    decision = cache.store.add_decision(body, decision, "cli", cache.version)
    click.echo(f"{decision['decision_id']} {decision['action']}: {decision['reason']}")
    if decision["curve"]:
        for point in decision["curve"]:
            point["shape"] = layout_name(point["layout"])
        click.echo(_table(decision["curve"], [("gpus", "gpus", "d"), ("shape", "nodes x gpus", "s"),
                                              ("samples_per_s", "samples/s", ".1f"), ("efficiency", "efficiency", ".2f"),
                                              ("global_batch", "global batch", "d")]))


def _directive_problem(name: str, lines: list[tuple[int, str]], exc) -> str:
    """`FILE:LINE: message` for a directive the planner refused (`planner.DirectiveProblem`): its field
    `directives[i]` is the i-th `#ELASTIC` line, numbered here as in the file (the planner counts directives)."""
    match = re.fullmatch(r"directives\[(\d+)\]", exc.field)
    if not match or int(match.group(1)) >= len(lines):
        return f"{name}: {exc}"
    return f"{name}:{lines[int(match.group(1))][0]}: {re.sub(r'^line [0-9]+: ', '', exc.message)}"


@main.command()
@click.option("--db", default=None, help="with --fit-errors: SQLite database (default $ELASTIC_PREDICTOR_DB or "
                                         "predictor.db)")
@click.option("--datasets", default=None, metavar="NAME[,NAME...]",
              help="benchmark datasets (vendored in predictor/data): pollux-t4, morphling-a800, elasticflow-a100 "
                   "(default: all)")
@click.option("--write", is_flag=True, help="let bench/accuracy.py write bench/results")
@click.option("--full", is_flag=True, help="also the layouts-held-out and small-to-large protocols (half an hour "
                                           "or more; the default, leave-one-model-out, takes a few minutes)")
@click.option("--fit-errors", is_flag=True, help="print the fit errors on the database instead of the benchmark")
def evaluate(db, datasets, write, full, fit_errors):
    """Run the accuracy benchmark (bench/accuracy.py of a source checkout) on the vendored public datasets, or
    with --fit-errors print how well the model fits a database's history.

    Example: elastic-predictor evaluate --datasets pollux-t4
    """
    if not fit_errors:
        _run_accuracy_bench(db, datasets, write, full)
    if datasets or write or full:
        raise click.UsageError("--datasets, --write and --full are options of the benchmark, not of --fit-errors")
    config = _config(db)
    require_db(config.db_path, db, "no history to fit")
    click.echo(f"evaluate: fitting the model on {config.db_path} ...", err=True)
    cache = _fitted_cache(config, db)
    predictor = cache.predictor()
    click.echo(f"evaluate: fitted ({len(predictor.log_rmse_)} step model(s)); the fit errors follow", err=True)
    rows = [{"key": f"{name} on {gpu}", "log_rmse": err} for (name, gpu), err in sorted(predictor.log_rmse_.items())]
    click.echo(_table(rows, [("key", "step model", "s"), ("log_rmse", "log RMSE", ".3f")]))
    click.echo(_table(predictor.link_stats(), [("link", "link", "s"), ("n", "collectives", "d"),
                                               ("log_rmse", "log RMSE", ".3f")]))


def _run_accuracy_bench(db: str | None, datasets: str | None, write: bool, full: bool = False) -> None:
    """bench/accuracy.py of the checkout this package runs from; exits with its status.

    Raises:
        click.UsageError / click.ClickException: --db given, an unknown or incomplete dataset, or no
            bench/accuracy.py (an installed package is not a checkout).
    """
    from predictor import datasets as vendored  # noqa: PLC0415 - csv, gzip, profiles: only `evaluate`

    if db:
        raise click.UsageError("--db goes with --fit-errors: the benchmark reads the vendored datasets, not a database")
    names = [n.strip() for n in (datasets or ",".join(vendored.LOADERS)).split(",") if n.strip()]
    for name in names:
        try:
            vendored.check(name)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--datasets") from None
        except vendored.DatasetError as exc:
            raise click.ClickException(str(exc)) from None
    script = REPO_ROOT / "bench" / "accuracy.py"
    if not script.is_file():
        raise click.ClickException(
            f"the accuracy benchmark is bench/accuracy.py of a source checkout, and {REPO_ROOT} (where this package "
            "runs from) has none: run `elastic-predictor evaluate` in a clone installed with `pip install -e .`, "
            "or use --fit-errors for the fit errors on a database")
    argv = [sys.executable, str(script)] + ([] if write else ["--no-write"]) + ["--datasets", ",".join(names)] \
        + (["--full"] if full else [])
    raise SystemExit(_run_with_progress(argv, names, full))


PROGRESS_EVERY_S = 15.0    # `evaluate`: how often it says the benchmark still runs


def _run_with_progress(argv: list[str], names: list[str], full: bool = False) -> int:
    """Run the benchmark with its stdout untouched; on stderr say what it runs and about how long it takes, which
    dataset runs, the bench's own lines (each fit with the time left, `NAME: done at N s`), every
    PROGRESS_EVERY_S that it still runs, and the end."""
    def say(line: str) -> None:
        click.echo(f"evaluate: {line}", err=True)

    started = time.monotonic()
    running = {"index": 0}
    say(f"running bench/accuracy.py on {len(names)} dataset(s) ({', '.join(names)}); the table comes at the end")
    say("leave-one-model-out, two fits a held-out model: a few minutes" + (
        "; --full adds about a hundred fits (half an hour or more)" if full else " (--full for protocols A and B)"))
    say(f"[1/{len(names)}] {names[0]}")
    proc = subprocess.Popen(argv, cwd=str(REPO_ROOT), stderr=subprocess.PIPE, text=True, errors="replace")

    def relay() -> None:   # the bench's own stderr, line by line, plus which dataset comes next
        for line in proc.stderr:
            click.echo(line, err=True, nl=False)
            index = running["index"]
            if index < len(names) and line.startswith(f"{names[index]}: done"):
                running["index"] = index + 1
                if index + 1 < len(names):
                    say(f"[{index + 2}/{len(names)}] {names[index + 1]}")

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    while True:
        try:
            status = proc.wait(timeout=PROGRESS_EVERY_S)
            break
        except subprocess.TimeoutExpired:
            index = running["index"]
            what = names[index] if index < len(names) else "the table"
            say(f"still running: {what} ({time.monotonic() - started:.0f} s so far)")
    reader.join()
    say(f"{'finished' if status == 0 else f'failed (exit status {status})'} after {time.monotonic() - started:.0f} s")
    return status


@main.command()
@click.option("--db", default=None, help="SQLite database (default $ELASTIC_PREDICTOR_DB or predictor.db)")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 1000), help="how many, newest first")
def decisions(db, limit):
    """Print the stored /v1/plan decisions, newest first.

    Example: elastic-predictor decisions --db predictor.db --limit 5
    """

    config = _config(db)
    require_db(config.db_path, db, "no decisions to show")
    store = _open_store(config.db_path)
    rows = store.list_decisions(limit=limit)
    store.close()
    click.echo(_table(rows, [("decision_id", "id", "s"), ("source", "source", "s"), ("action", "action", "s"),
                             ("model", "model", "s"), ("reason", "reason", "s")]))


@main.command()
@click.option("--predictor", "predictor_url", required=True, metavar="URL",
              help="the prediction service the job posts its rows to (as the launcher's --predictor)")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(1, 2),
              help="nodes of the allocation: 2 also sweeps the inter-node link")
@click.option("--gpus-per-node", default=2, show_default=True, type=click.IntRange(0, 64),
              help="GPUs a node (one rank each, NCCL); 0: CPU ranks with gloo")
@click.option("--ranks-per-node", default=None, type=click.IntRange(1, 64),
              help="ranks a node (default: --gpus-per-node, 1 without GPUs); 2 on a node sweeps its intra-node link")
@click.option("--partition", default=None, help="partition to calibrate (its nodes' GPU type and links)")
@click.option("--time", "time_limit", default="00:10:00", show_default=True, help="the job's time limit")
@click.option("--output", default="elastic-calibrate-%j.out", show_default=True, help="the job's log (sbatch --output)")
@click.option("--rows", "rows_file", default="elastic-calibrate-%j.jsonl", show_default=True,
              help="where rank 0 also writes the rows (JSON lines, for `elastic-predictor import`); '' for none")
@click.option("--python", "python", default=sys.executable, show_default=True,
              help="interpreter on the nodes with this package and torch")
@click.option("--sweep-budget-s", default=_calibration.SWEEP_BUDGET_S, show_default=True, type=click.FloatRange(1, 300),
              help="seconds of each link's all-reduce sweep")
@click.option("--rounds", default=_calibration.ROUNDS, show_default=True, type=click.IntRange(1, 50),
              help="rounds of (plain, DDP) timing windows per probe and world size")
@click.option("--window-s", default=_calibration.WINDOW_S, show_default=True, type=click.FloatRange(0.01, 10),
              help="target seconds of one timing window")
@click.option("--sbatch", "extra_sbatch", multiple=True, metavar="OPTION",
              help="another #SBATCH line for the script, e.g. --sbatch=--account=ops (repeatable)")
@click.option("--out", "out_file", default=None, type=click.Path(dir_okay=False, writable=True),
              help="write the script to this file (default: print it)")
@click.option("--submit", is_flag=True, help="submit it with sbatch (the environment goes with it, as sbatch's "
                                             "--export=ALL) and print the job id")
def calibrate(predictor_url, nodes, gpus_per_node, ranks_per_node, partition, time_limit, output, rows_file,
              python, sweep_budget_s, rounds, window_s, extra_sbatch, out_file, submit):
    """The calibration job: what this cluster's links and hosts cost DDP, measured in about a minute.

    Writes (or, with --submit, submits) an sbatch script that runs `python -m elastic_launcher.calibrate` on
    every rank of 1-2 nodes (one rank a GPU; CPU ranks with gloo without GPUs). The job measures:

    \b
    - the all-reduce sweep of each link of the allocation at 2 ranks (4 KiB up, within --sweep-budget-s),
      labelled with the link the launcher detects: `collective` rows;
    - DDP's host overhead: three probe models (400 tensors of 1k elements, 4 of 4M, 40 of 64k with a bucket a
      tensor) timed with DDP and without, at 1 rank and at all ranks: `ddp_overhead` rows (buckets,
      tensors, plain_s, ddp_s, extra_s), which the step model fits its per-step, per-bucket and per-tensor
      host constants on.

    The rows are posted signed with the job's munge credential (the service needs ELASTIC_PREDICTOR_MUNGE=1)
    and written to --rows. Run it once per partition (GPU type), and again after a driver, NCCL or torch change.

    Example: elastic-predictor calibrate --predictor http://predictor:8470 --nodes 2 --gpus-per-node 2 --submit
    """
    script = _calibration.job_script(predictor_url, nodes, ranks_per_node or gpus_per_node or 1, gpus_per_node, python=python,
                        partition=partition, time_limit=time_limit, output=output, out=rows_file or None,
                        sweep_budget_s=sweep_budget_s, rounds=rounds, window_s=window_s, extra_sbatch=extra_sbatch)
    if out_file:
        pathlib.Path(out_file).write_text(script)
        click.echo(f"wrote {out_file}", err=True)
    elif not submit:
        click.echo(script, nl=False)
    if submit:
        from slurm_plugin.client import CommandBackend  # noqa: PLC0415 - Slurm client: only `calibrate --submit`

        try:
            sub = CommandBackend(env=dict(os.environ)).sbatch(script)
        except SlurmError as exc:
            raise click.ClickException(f"sbatch refused the calibration job: {exc}") from None
        for line in sub.stderr.splitlines():
            click.echo(line, err=True)
        click.echo(sub.job_id)


@main.command()
@click.option("--sacct", "sacct_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="a `sacct -P` export (--format=JobID,JobName,Submit,Start,End,Timelimit,AllocTRES,NNodes,State,Comment)")
@click.option("--pollux-workload", default=None, type=click.IntRange(1, 8), help="Pollux OSDI'21 workload 1-8")
@click.option("--itp", default=None, type=click.Path(exists=True, dir_okay=False),
              help="an ITP / ElasticFlow trace CSV, e.g. bench/data/itp-elasticflow-traces/raw/cluster04.csv")
@click.option("--cluster", default=None, type=click.Path(exists=True, dir_okay=False),
              help="cluster model JSON (the service's format); default: --nodes x --gpus-per-node T4 on pcie/ethernet")
@click.option("--nodes", default=16, show_default=True, type=click.IntRange(1, 100_000), help="nodes (without --cluster)")
@click.option("--gpus-per-node", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--policy", "policies", default="as-submitted,right-sized,elastic,oracle", show_default=True,
              help="comma-separated policies")
@click.option("--min-scale", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="traces without #ELASTIC lines: gpus minimum = this x the GPUs asked")
@click.option("--max-scale", default=1.0, show_default=True, type=click.FloatRange(1, 64),
              help="traces without #ELASTIC lines: gpus maximum = this x the GPUs asked")
@click.option("--tick", "tick_s", default=300.0, show_default=True, type=click.FloatRange(1, 86400),
              help="the launcher's decision period, simulated seconds")
@click.option("--refit", "refit_s", default=600.0, show_default=True, type=click.FloatRange(0, 86400),
              help="least simulated seconds between two fits of the replay's prediction service")
@click.option("--limit", default=None, type=click.IntRange(1), help="replay only the first N jobs of the history")
@click.option("--release", "release", default="0", show_default=True,
              help="seconds a finished job's GPUs stay held before the next job starts on them, or `fit`: fitted so "
                   "that the history replayed as submitted has its measured average JCT (--sacct only)")
@click.option("--out", default=None, type=click.Path(file_okay=False), help="write summary.json, jobs.csv, replay.png here")
def replay(sacct_file, pollux_workload, itp, cluster, nodes, gpus_per_node, policies, min_scale, max_scale, tick_s,
           refit_s, limit, release, out):
    """What-if replay of a job history under each sizing policy (SimPy; docs/admin-guide.md, "What-if replay").

    Job progress comes from the Pollux OSDI'21 measured T4 tables; decisions from the planner on a Predictor fitted
    on what the replay has measured so far (oracle: on the tables themselves).

    Example: elastic-predictor replay --sacct jobs.txt --nodes 16 --out replay/
    """
    from predictor.replay import POLICIES, Params, calibrate_release, replay_all  # noqa: PLC0415 - simpy, numpy
    from predictor import replay_inputs as ri  # noqa: PLC0415 - numpy, scipy: only `replay`
    from predictor import replay_report  # noqa: PLC0415 - simpy, numpy: only `replay`

    chosen = [p for p in policies.split(",") if p]
    bad = [p for p in chosen if p not in POLICIES]
    if bad:
        raise click.BadParameter(f"unknown {', '.join(bad)} (known: {', '.join(POLICIES)})", param_hint="--policy")
    if sum(x is not None for x in (sacct_file, pollux_workload, itp)) != 1:
        raise click.UsageError("give exactly one history: --sacct FILE, --pollux-workload N or --itp FILE")
    if cluster:
        try:
            shape = Cluster.from_file(cluster)
        except (OSError, ValidationError) as exc:
            raise click.ClickException(f"{cluster}: {exc}") from None
    else:
        shape = Cluster.from_dict({"default_partition": "replay", "partitions": [
            {"name": "replay", "nodes": f"n[1-{nodes}]", "gpus_per_node": gpus_per_node, "gpu": "T4",
             "intra_link": "pcie", "inter_link": "ethernet"}]})
    truth = ri.PolluxTruth()
    try:
        if sacct_file:
            jobs, what = ri.load_sacct(sacct_file, truth), sacct_file
        elif pollux_workload:
            jobs, what = ri.load_pollux_workload(pollux_workload, truth), f"Pollux workload {pollux_workload}"
        else:
            jobs, what = ri.load_itp(itp, truth), f"ITP {pathlib.Path(itp).stem}"
    except (ri.InputError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    jobs = jobs[:limit] if limit else jobs
    total = shape.partition().total_gpus
    for j in jobs:
        if j.model is not None and not j.directives and not sacct_file:
            j.directives = ri.elastic_lines(j.model, j.global_batch, j.gpus, truth, max_scale, total, min_scale)
    too_big = [j.name for j in jobs if j.gpus > total]
    if too_big:
        raise click.ClickException(f"{len(too_big)} job(s) ask more than the cluster's {total} GPUs, e.g. "
                                   f"{too_big[0]}: pass a larger --nodes or --cluster")
    click.echo(f"{what}: {len(jobs)} jobs on {shape.partition().name} ({len(shape.partition().nodes)} nodes x "
               f"{shape.partition().gpus_per_node} GPUs)", err=True)
    params = Params(tick_s=tick_s, refit_s=refit_s)
    if release == "fit":
        if not sacct_file:
            raise click.BadParameter("`fit` needs a history with start times: --sacct", param_hint="--release")
        measured = sum(j.start_s + j.duration_s - j.submit_s for j in jobs) / len(jobs)
        try:
            params.release_s = calibrate_release(jobs, shape, truth, measured, params)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"release_s fitted on the history as submitted: {params.release_s:.2f} s", err=True)
    else:
        try:
            params.release_s = float(release)
        except ValueError:
            params.release_s = math.nan
        if not 0 <= params.release_s < math.inf:
            raise click.BadParameter(f"{release!r}: seconds at or above 0, or `fit`", param_hint="--release")
    results = replay_all(jobs, shape, truth, chosen, params,
                         progress=lambda p: click.echo(f"  {p} done", err=True))
    if out:
        summary = replay_report.write(results, pathlib.Path(out), what)
        click.echo(f"wrote {out}/summary.json, jobs.csv, replay.png", err=True)
        rows, gap = summary["rows"], summary["oracle_gap"]
    else:
        rows, gap = replay_report.rows(results), replay_report.oracle_gap(results)
    click.echo(replay_report.markdown(rows, gap))


for _command in _ADMIN_COMMANDS:    # issue 7: models, links, plot (predictor/admin_cli.py)
    main.add_command(_command)


if __name__ == "__main__":
    main()
