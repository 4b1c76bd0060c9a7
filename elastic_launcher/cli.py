"""`elastic-launch`: the entry point. It alone reads the environment and the batch script.

    elastic-launch [options] -- python train.py ...      # the command of an sbatch script (batch step)
    elastic-launch ctl JOBID --nodes N                    # an operator resizes a running job
    elastic-launch ctl JOBID --status                     # what the controller is doing
    elastic-launch agent --main-job J --store H:P ...     # batch step of a grow helper job (internal)

Errors of the library are turned into click errors here.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional

import click

from elastic_launcher.launch_config import Allocation, Directives, LaunchConfig
from slurm_plugin.errors import DirectiveError, SlurmError

SUBCOMMANDS = ("ctl", "agent")


def _registry(path: Optional[Path]) -> Path:
    """Where controllers publish their address (`<registry>/<job>.json`), for `ctl`."""
    if path is not None:
        return path
    env = os.environ.get("ELASTIC_LAUNCH_REGISTRY")
    return Path(env) if env else Path.home() / ".elastic-launch" / "jobs"


def _gpus_on_node(environ) -> int:
    for key in ("SLURM_GPUS_ON_NODE",):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    gpus = environ.get("SLURM_JOB_GPUS") or environ.get("CUDA_VISIBLE_DEVICES") or ""
    return len([g for g in gpus.split(",") if g]) or 1


def allocation_from_env(environ) -> Allocation:
    """The Slurm allocation of the batch step this process runs in.

    Raises:
        click.ClickException: not inside a Slurm job.
    """
    from slurm_plugin.hostlist import expand as expand_hostlist  # noqa: PLC0415 - off elastic-launch's start

    job_id = environ.get("SLURM_JOB_ID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        raise click.ClickException("not inside a Slurm allocation: SLURM_JOB_ID / SLURM_JOB_NODELIST are not set "
                                   "(run elastic-launch as the command of an sbatch script)")
    nodes = expand_hostlist(nodelist)
    batch_host = environ.get("SLURMD_NODENAME") or nodes[0]
    ordered = tuple([batch_host] + [n for n in nodes if n != batch_host])
    return Allocation(job_id=job_id, nodes=ordered, batch_host=batch_host, gpus_per_node=_gpus_on_node(environ),
                      partition=environ.get("SLURM_JOB_PARTITION"), env=dict(environ))


def _directives(script: Optional[Path], extra: tuple[str, ...]) -> Directives:
    """The directives of the script's leading comment block plus `--directive` items.

    Raises:
        click.ClickException: `SCRIPT:LINE: what is wrong` (unreadable, not UTF-8, a bad #ELASTIC line), or
            `--directive: ...` for a bad item.
    """
    try:
        data = script.read_bytes() if script is not None else b""
        text = data.decode("utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot read {script}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        line_no = data[:exc.start].count(b"\n") + 1
        raise click.ClickException(f"{script}:{line_no}: not UTF-8 text ({exc.reason})") from None
    lines = [line for line in text.splitlines()]
    prefix_end = next((i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")), len(lines))
    block = lines[:prefix_end] + [f"#ELASTIC {item}" for item in extra]
    try:
        return Directives.from_script("\n".join(block) + "\n")
    except DirectiveError as exc:
        where = f"{script}:{exc.line_no}" if script is not None and exc.line_no <= prefix_end else "--directive"
        raise click.ClickException(f"{where}: {exc.reason}: {exc.line!r}") from None


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--script", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Batch script to read #ELASTIC directives from (in an sbatch script: \"$0\").")
@click.option("--directive", "directive_items", multiple=True, metavar="KEY=VALUE ...",
              help="Extra directive tokens, as on an #ELASTIC line (repeatable).")
@click.option("--workers-per-node", type=click.IntRange(1, 64), help="Workers per node (default: GPUs per node).")
@click.option("--predictor", "predictor_url", envvar="ELASTIC_PREDICTOR_URL",
              help="Predictor base URL (env ELASTIC_PREDICTOR_URL; default: the hook's, predictor_url in the "
                   "elastic.conf beside $SLURM_CONF); unreachable: own heuristic, and the records say so.")
@click.option("--intra-link", default=None,
              help="Override the detected link class between the GPUs of a node (e.g. nvlink, pcie, shm).")
@click.option("--inter-link", default=None,
              help="Override the detected link class between nodes (e.g. ib, roce, tcp).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Records and logs (default: $SLURM_SUBMIT_DIR/elastic-<job>).")
@click.option("--registry", type=click.Path(file_okay=False, path_type=Path),
              help="Where the controller publishes its address for `ctl` (env ELASTIC_LAUNCH_REGISTRY).")
@click.option("--grow-step-nodes", default=2, show_default=True, type=click.IntRange(1, 64),
              help="Nodes added per grow step (one helper job each).")
@click.option("--measure-steps", default=8, show_default=True, type=click.IntRange(1, 10000),
              help="Committed steps per throughput measurement.")
@click.option("--warmup-steps", default=2, show_default=True, type=click.IntRange(0, 10000),
              help="Committed steps ignored after each resize.")
@click.option("--no-autoscale", is_flag=True, help="Resize only on operator requests and failures.")
@click.option("--no-yield", "no_yield", is_flag=True,
              help="Keep nodes above the job's minimum even while another job of the partition waits for them.")
@click.option("--test-throughput", type=click.Choice(["linear"]),
              help="Test seam (CPU testbeds only, never for production): take throughput as linear in workers "
                   "(elastic_launcher.testing.LinearThroughput) so grow can be exercised where nothing scales.")
@click.option("--straggler-ratio", default=1.5, show_default=True, type=float,
              help="A node whose mean step time is this many times the median is slow.")
@click.option("--straggler-windows", default=3, show_default=True, type=click.IntRange(1, 1000),
              help="Consecutive slow measurement windows before a slow node is shrunk away.")
@click.option("--rendezvous-timeout", default=120.0, show_default=True, type=float,
              help="Seconds started workers get to join and form a new membership.")
@click.option("--leave-timeout", default=20.0, show_default=True, type=float,
              help="Seconds leaving workers get to leave at a commit point before their steps are stopped.")
@click.option("--helper-start-timeout", default=60.0, show_default=True, type=float,
              help="Seconds a submitted grow helper job gets to start running before it is cancelled.")
@click.option("--helper-orphan-timeout", default=30.0, show_default=True, type=float,
              help="Seconds a helper agent that cannot see the controller's heartbeat waits before it exits.")
@click.option("--restart", is_flag=True,
              help="Run the unchanged script under torchrun's elastic agent and resize by restarting it at the new "
                   "size from its last checkpoint (also `#ELASTIC mode=restart`; user guide, \"Restart or "
                   "in-process\").")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Restart mode: the script's checkpoint directory; a planned resize waits, after SIGUSR1, for an "
                   "entry newer than the signal (without it: the whole --checkpoint-timeout).")
@click.option("--checkpoint-timeout", default=60.0, show_default=True, type=float,
              help="Restart mode: seconds the script gets, after SIGUSR1, to checkpoint before a planned resize.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(script, directive_items, workers_per_node, predictor_url, intra_link, inter_link, run_dir,
           registry, grow_step_nodes, measure_steps, warmup_steps, no_autoscale, no_yield, test_throughput,
           straggler_ratio, straggler_windows, rendezvous_timeout, leave_timeout, helper_start_timeout,
           helper_orphan_timeout, restart, checkpoint_dir, checkpoint_timeout, verbose, command):
    """Run COMMAND as elastic workers in this Slurm allocation.

    Example (last line of an sbatch script):

        elastic-launch --script "$0" --workers-per-node 1 -- python train.py --steps 200

    \b
    Subcommands (each has --help):
      elastic-launch ctl JOBID --nodes N | --status   resize a running elastic job, or show its state
      elastic-launch agent ...                        batch step of a grow helper job (internal)
    """
    from elastic_launcher.controller import Controller  # noqa: PLC0415 - torch: only `launch`
    from elastic_launcher.steering import MeasuredThroughput  # noqa: PLC0415 - only `launch`

    _logging(verbose)
    if predictor_url is None:  # the service the site's hook asks (elastic.conf), so both halves use one planner
        from slurm_plugin.installer import site_predictor_url  # noqa: PLC0415 - only `launch`
        predictor_url = site_predictor_url(os.environ)
    allocation = allocation_from_env(os.environ)
    submit_dir = Path(os.environ.get("SLURM_SUBMIT_DIR", "."))
    directives = _directives(script, directive_items)
    end_time = os.environ.get("SLURM_JOB_END_TIME", "")
    config = LaunchConfig(
        command=tuple(command), allocation=allocation, directives=directives,
        restart=restart or directives.mode == "restart", checkpoint_dir=checkpoint_dir,
        checkpoint_timeout=_seconds(checkpoint_timeout), end_time=float(end_time) if end_time.isdigit() else None,
        workers_per_node=workers_per_node, predictor_url=predictor_url,
        predictor_token=os.environ.get("ELASTIC_PREDICTOR_TOKEN"),
        munge_socket=os.environ.get("ELASTIC_MUNGE_SOCKET") or None, intra_link=intra_link, inter_link=inter_link,
        run_dir=run_dir or submit_dir / f"elastic-{allocation.job_id}",
        store_host=socket.gethostname() if os.environ.get("ELASTIC_STORE_HOST") is None
        else os.environ["ELASTIC_STORE_HOST"],
        grow_step_nodes=grow_step_nodes, measure_steps=measure_steps, warmup_steps=warmup_steps,
        autoscale=not no_autoscale, yield_to_pending=not no_yield,
        straggler_ratio=straggler_ratio,
        straggler_windows=straggler_windows, rendezvous_timeout=_seconds(rendezvous_timeout),
        leave_timeout=_seconds(leave_timeout),
        helper_start_timeout=_seconds(helper_start_timeout), helper_orphan_timeout=_seconds(helper_orphan_timeout),
    )
    from slurm_plugin.client import Backend, start_step  # noqa: PLC0415 - Slurm client: only `launch`

    slurm: Backend = _slurm_from_env(timeout=config.slurm_timeout, update_timeout=config.slurm_timeout)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    if config.restart:
        from elastic_launcher.restart import RestartLauncher  # noqa: PLC0415 - torch: only `launch --restart`
        _run(RestartLauncher(config, registry=_registry(registry), slurm=slurm, start_step=start_step))
        return
    throughput = MeasuredThroughput()
    if test_throughput == "linear":  # the injection point of the testbed's throughput model
        from elastic_launcher.testing import LinearThroughput  # noqa: PLC0415 - torch: only the testbed's model
        throughput = LinearThroughput()
    _run(Controller(config, registry=_registry(registry), slurm=slurm, start_step=start_step, throughput=throughput))


def _run(controller) -> None:
    """Run the job's controller (in-process or restart mode) and print its summary. scancel / the time limit send
    SIGTERM to the batch step: the handler installed before unwinds, so the controller ends its helper jobs."""
    try:
        summary = controller.run()
    except Exception as exc:  # boundary: library errors become a click error with the cause
        raise click.ClickException(f"elastic-launch: {type(exc).__name__}: {exc}") from exc
    click.echo(json.dumps(summary, sort_keys=True))


def _slurm_from_env(**timeouts):
    """The Slurm client of the launcher, its agent and `ctl`: the commands get this process's environment without the
    job's SLURM_* (sbatch of a helper must not inherit the main job's variables; scontrol must not write resize.sh
    files) but with PATH (a lab's release from a root: its bin/ first), HOME, ... and SLURM_CONF."""
    from slurm_plugin.client import CommandBackend  # noqa: PLC0415 - Slurm client: only where a command needs it
    conf = os.environ.get("SLURM_CONF")
    return CommandBackend(slurm_conf=Path(conf) if conf else None,
                          env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **timeouts)


def _ended(job_id: int) -> str:
    """How a job without a launcher ended, as sacct tells (``reporting.ended_job``), or where to look."""
    from elastic_launcher.reporting import ended_job  # noqa: PLC0415 - requests: only after the job ends

    try:
        return ended_job(job_id, _slurm_from_env().sacct(int(job_id)))
    except Exception as exc:  # noqa: BLE001 - no sacct here (no slurmdbd, no Slurm): say where to look
        return f"its end in `sacct -j {job_id} -X` (the last record; not read here: {type(exc).__name__})"


@click.command()
@click.argument("job_id")
@click.option("--nodes", type=click.IntRange(1, 4096), help="Resize the job to this many nodes.")
@click.option("--auto", "lift", is_flag=True, help="Lift the operator's size set with --nodes: the autoscaler "
                                                     "decides again.")
@click.option("--status", is_flag=True, help="Print the controller's current state (a table; --json: JSON).")
@click.option("--json", "as_json", is_flag=True, help="With --status: the state as one JSON object.")
@click.option("--registry", type=click.Path(file_okay=False, path_type=Path),
              help="Where controllers publish their addresses (env ELASTIC_LAUNCH_REGISTRY; default: "
                   "~/.elastic-launch/jobs).")
@click.option("--timeout", default=30.0, show_default=True, type=float,
              help="Seconds to wait for the controller to answer.")
def ctl(job_id, nodes, lift, status, as_json, registry, timeout):
    """Ask the controller of a running elastic job to resize it, or show its state.

    The operator's size (--nodes N) holds until --auto lifts it: the autoscaler never moves the job away from
    it (only a job of the partition waiting for nodes gets some back, unless the job runs with --no-yield).

    Examples: elastic-launch ctl 42 --nodes 2; elastic-launch ctl 42 --auto; elastic-launch ctl 42 --status
    """
    from elastic_launcher.control import ControlClient  # noqa: PLC0415 - torch's TCPStore: only `ctl`
    from elastic_launcher.reporting import status_table  # noqa: PLC0415 - requests: only `ctl`

    if sum((nodes is not None, lift, status)) != 1:
        raise click.UsageError("give one of --nodes N, --auto or --status")
    path = _registry(registry) / f"{job_id}.json"
    if not path.exists():
        raise click.ClickException(f"job {job_id} has no running elastic-launch (it ended, or has not started "
                                   f"yet): its records are in elastic-{job_id}/records.jsonl where it was "
                                   f"submitted; {_ended(job_id)}")
    host, port = _controller_address(path)
    client = ControlClient(host, port, timeout=_seconds(timeout))
    try:
        reply = client.status() if status else client.request_nodes("auto" if lift else nodes)
    except Exception as exc:
        raise click.ClickException(f"job {job_id}: {type(exc).__name__}: {exc}") from exc
    click.echo(status_table(reply) if status and not as_json else json.dumps(reply, sort_keys=True))
    if reply.get("ok") is False:
        sys.exit(1)


def _controller_address(path: Path) -> tuple[str, int]:
    """`host` and `port` from a controller's registry file.

    Raises:
        click.ClickException: `PATH: FIELD: what is wrong` (unreadable, not JSON, a missing or bad field).
    """
    try:
        address = json.loads(path.read_bytes())
    except OSError as exc:
        raise click.ClickException(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise click.ClickException(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(address, dict):
        raise click.ClickException(f"{path}: expected an object with host and port")
    host, port = address.get("host"), address.get("port")
    if not isinstance(host, str) or not host:
        raise click.ClickException(f"{path}: host: expected a host name, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise click.ClickException(f"{path}: port: expected a port number, got {port!r}")
    return host, port


@click.command()
@click.option("--main-job", required=True, help="Job id of the elastic job this helper grows.")
@click.option("--store", "store_addr", required=True, help="host:port of the main job's store.")
@click.option("--workers-per-node", required=True, type=click.IntRange(1, 64), help="Workers per node.")
@click.option("--orphan-timeout", default=30.0, show_default=True, type=float,
              help="Seconds without the controller's heartbeat (or the store) before the helper exits.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              help="Directory of the workers' logs (default: the current one).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def agent(main_job, store_addr, workers_per_node, orphan_timeout, log_dir, command):
    """Batch step of a grow helper job (submitted by the controller; not for users)."""
    from elastic_launcher.helper_agent import HelperAgent  # noqa: PLC0415 - only `agent`
    from elastic_launcher.control import launcher_store  # noqa: PLC0415 - torch's TCPStore: only `agent`
    from elastic_launcher.workers import WorkerPool  # noqa: PLC0415 - only `agent`
    from slurm_plugin.client import Backend, is_transient, start_step  # noqa: PLC0415 - only `agent`

    _logging(False)
    allocation = allocation_from_env(os.environ)
    host, _, port = store_addr.rpartition(":")
    slurm: Backend = _slurm_from_env()

    def main_running() -> bool:
        try:
            return slurm.job(int(main_job)).state == "RUNNING"
        except SlurmError as exc:  # unreachable (slurmctld restarting): can't tell, the heartbeat rule decides
            if not is_transient(exc):
                return False
            logging.getLogger("elastic_launcher.helper_agent").warning(
                "helper %s: cannot ask Slurm whether main job %s runs (Slurm unreachable, carrying on): %s",
                allocation.job_id, main_job, exc)
            return True
        except Exception:  # unknown job, bad output: treat as gone
            return False

    pool = WorkerPool(command, store_addr, main_job, start_step, log_dir)
    helper = HelperAgent(allocation.job_id, main_job, allocation.nodes, workers_per_node, allocation.env, pool,
                         connect=lambda: launcher_store(host, int(port), timedelta(seconds=5)),
                         main_job_running=main_running, orphan_timeout=_seconds(orphan_timeout))
    helper.install_signal_handlers()
    click.echo(f"helper {allocation.job_id} of job {main_job}: {helper.run()}")


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv: Optional[list[str]] = None) -> None:
    """Dispatch: `ctl` and `agent` are subcommands; anything else is a launch."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "ctl":
        ctl.main(args[1:], prog_name="elastic-launch ctl")
    elif args and args[0] == "agent":
        agent.main(args[1:], prog_name="elastic-launch agent")
    else:
        launch.main(args, prog_name="elastic-launch")


if __name__ == "__main__":
    main()
