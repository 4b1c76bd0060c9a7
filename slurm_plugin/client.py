"""The one module that runs Slurm commands.

Everything else (hook installer, launcher, predictor's cluster model, tests) talks to Slurm through a
`Backend`. `CommandBackend` implements it with the command-line tools of 22.05 and 24.11: `sinfo --json` (22.05;
24.11's groups nodes by sinfo line, so there it is `scontrol --json show nodes`), `squeue --json` and
`sacct --json` (whose filters 22.05 ignores, so results are filtered here), `scontrol` text output and
`scontrol update` for changes. The JSON of the two releases differs (24.11: states are lists, numbers may be
`{"set", "number"}` objects, a job's cores are under `job_resources.nodes.allocation`); the parsers read both.
`PyslurmBackend` implements the same protocol with pyslurm (for sites whose Slurm matches a pyslurm release:
24.11 here, inside the testbed's root; none builds against 22.05).

Every command runs through `CommandBackend._run(argv, timeout)`, which raises `SlurmError` on a
non-zero exit, a timeout, or an unreachable slurmctld (22.05's `squeue/sinfo --json` and `scontrol show
topology` then still exit 0, with an `errors` list and no jobs or nodes: without this check a controller
restart would look like "every job is gone"). `is_transient` tells such passing failures from refusals (the
launcher retries its Slurm changes through them, `elastic_launcher.release.SlurmChange`). Commands get an explicit
environment (`SLURM_CONF` plus a fixed PATH unless a full `env` mapping is given); in particular
`SLURM_JOBID` is not passed, so `scontrol update` never writes `slurm_job_<id>_resize.sh` files into the
caller's cwd. `shrink` returns the refreshed environment instead (see `ResizeResult`).

Callers must assume job state changes between calls: every method re-reads Slurm.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Protocol, Sequence, Union

from slurm_plugin.contracts.tres import gpu_tres, gpus_in_tres, gres_gpu_type
from slurm_plugin.errors import JobNotFoundError, ResizeError, SlurmError
from slurm_plugin.hostlist import compress as compress_hostlist
from slurm_plugin.hostlist import expand as expand_hostlist
from slurm_plugin.hostlist import split_top

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What `scontrol update ... NumNodes=` tells a job to unset after a resize.
RESIZE_UNSET = ("SLURM_NPROCS", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE")
# stderr of a client that could not reach slurmctld (22.05 prints it even where it exits 0).
UNREACHABLE = "Unable to contact slurm controller"
JSON_ERRORS = "errors in the JSON output"  # a query that answered with errors instead of results
# Failures that pass on their own: slurmctld restarting, busy, or a message lost on the way.
_TRANSIENT = (UNREACHABLE, JSON_ERRORS, "Socket timed out", "Zero Bytes were transmitted", "Connection refused",
              "Slurm temporarily unable", "try again")
log = logging.getLogger("slurm_plugin.client")


@dataclasses.dataclass(frozen=True)
class Node:
    """A compute node. `state` is Slurm's base state in lower case (idle, mixed, allocated, down...), then its
    flags sorted, joined with `+` (`idle+drain`: only a plain `idle` node is free), the same on every backend;
    `switch` is the lowest-level switch above the node in topology.conf, None without topology;
    `gpu_type` its GPUs' GRES type as slurm.conf names it (`Gres=gpu:h100:4`), None for untyped GPUs."""

    name: str
    state: str
    gpus: int
    gpus_alloc: int
    switch: str | None
    partitions: tuple[str, ...]
    gpu_type: str | None = None   # the GRES type of its GPUs (`gpu:h100:4` -> `h100`); None when untyped


@dataclasses.dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[str, ...]
    default: bool
    state: str


@dataclasses.dataclass(frozen=True)
class Job:
    """A job as squeue shows it. Per-node tuples line up with `nodes`; they are empty while pending.

    Attributes:
        state: Slurm's state in upper case (PENDING, RUNNING, COMPLETED...).
        nodelist: the node list as Slurm prints it (`node[1-2]`), "" while pending.
        tres_per_node: the per-node request (`gres:gpu:4`), "" if none.
        reason: why a job is pending ("None" when it is not).
        partition: the partition(s) it runs in or asked for (comma-separated while pending on several).
        node_count: nodes it holds, or asks for while pending (0: unknown).
        end_time: when it ends at the latest (Unix seconds: start plus its time limit while it runs; 0: unknown).
        priority: Slurm's priority (a pending job with a higher one starts first; 0: unknown).
        time_limit_s: its time limit in seconds (0: none set or unlimited).
    """

    job_id: int
    name: str
    state: str
    nodes: tuple[str, ...]
    nodelist: str
    cpus_per_node: tuple[int, ...]
    gpus_per_node: tuple[int, ...]
    tres_per_node: str
    comment: str
    batch_host: str
    reason: str
    partition: str = ""
    node_count: int = 0
    end_time: int = 0
    priority: int = 0
    time_limit_s: int = 0

    def resize_env(self) -> dict[str, str]:
        """The variables `scontrol`'s resize.sh would export for this allocation."""
        return {
            "SLURM_NODELIST": self.nodelist,
            "SLURM_JOB_NODELIST": self.nodelist,
            "SLURM_NNODES": str(len(self.nodes)),
            "SLURM_JOB_NUM_NODES": str(len(self.nodes)),
            "SLURM_JOB_CPUS_PER_NODE": compress_counts(self.cpus_per_node),
        }


@dataclasses.dataclass(frozen=True)
class ResizeResult:
    """The job after a resize and the environment change a launcher must make before its next srun.

    Attributes:
        job: the job as Slurm shows it after the resize.
        env: variables to set (SLURM_NODELIST, SLURM_JOB_NODELIST, SLURM_NNODES, ...).
        unset: variables to remove (SLURM_NPROCS, SLURM_NTASKS, SLURM_TASKS_PER_NODE).
    """

    job: Job
    env: Mapping[str, str]
    unset: tuple[str, ...] = RESIZE_UNSET

    def apply(self, environ: Mapping[str, str]) -> dict[str, str]:
        """A copy of `environ` with the change made."""
        out = {k: v for k, v in environ.items() if k not in self.unset}
        out.update(self.env)
        return out


@dataclasses.dataclass(frozen=True)
class AcctRecord:
    """One sacct record. A resized job has several: one per size, the earlier ones state RESIZING."""

    job_id: int
    name: str
    state: str
    nodelist: str
    gpus: int


class Backend(Protocol):
    """What the rest of the project may ask of Slurm: the type callers hold a client as (the launcher, the lab,
    the installer, `elastic-predictor cluster`). `CommandBackend` (22.05, 24.11) and `PyslurmBackend` (24.11)
    implement it; a slurmrestd backend would only have to provide these methods with the same dataclasses.
    Every call takes an optional `timeout`
    (the client's default otherwise). Implementations raise `SlurmError`, `JobNotFoundError` or `ResizeError`
    (slurm_plugin.errors). tests/unit/test_client_parse.py checks that each backend matches it and that
    the launcher calls nothing else on its client.
    """

    def nodes(self, timeout: timedelta | None = None) -> list[Node]: ...

    def partitions(self, timeout: timedelta | None = None) -> list[Partition]: ...

    def jobs(self, timeout: timedelta | None = None) -> list[Job]: ...

    def job(self, job_id: int, timeout: timedelta | None = None) -> Job: ...

    def sacct(self, job_id: int, timeout: timedelta | None = None) -> list[AcctRecord]: ...

    def sbatch(self, script: Union[str, Path], args: Sequence[str] = (),
               timeout: timedelta | None = None) -> "Submission": ...

    def submit(self, script: Union[str, Path], args: Sequence[str] = (), timeout: timedelta | None = None) -> int: ...

    def cancel(self, job_id: int, timeout: timedelta | None = None) -> None: ...

    def update_comment(self, job_id: int, text: str, timeout: timedelta | None = None) -> None: ...

    def update_admin_comment(self, job_id: int, text: str, timeout: timedelta | None = None) -> None: ...

    def reconfigure(self, timeout: timedelta | None = None) -> None: ...

    def shrink(self, job_id: int, keep: Union[int, Sequence[str]],
               timeout: timedelta | None = None) -> ResizeResult: ...

    def job_owner(self, job_id: int, timeout: timedelta | None = None) -> "JobOwner": ...

    def version(self, timeout: timedelta | None = None) -> tuple[int, int, int]: ...


@dataclasses.dataclass(frozen=True)
class Submission:
    job_id: int
    stderr: str  # job_submit hook messages (`slurm.user_msg`) arrive here


class CommandBackend:
    """`Backend` over the Slurm command-line tools.

    Args:
        slurm_conf: the cluster's slurm.conf (exported as SLURM_CONF); None uses Slurm's default.
        env: the full environment for the commands; default: PATH=`DEFAULT_PATH` only.
        timeout: limit for each query (sinfo, squeue, sacct, scontrol show).
        update_timeout: limit for each change (sbatch, scancel, scontrol update, which waits on slurmdbd).
    """

    def __init__(
        self,
        slurm_conf: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout: timedelta = timedelta(seconds=10),
        update_timeout: timedelta = timedelta(seconds=30),
    ):
        self.slurm_conf = slurm_conf
        self.env = env
        self.timeout = timeout
        self.update_timeout = update_timeout

    # -- the seam --------------------------------------------------------------------------------
    def _run(self, argv: Sequence[str], timeout: timedelta, stdin: str | None = None) -> subprocess.CompletedProcess:
        """Run one Slurm command; raise `SlurmError` unless it exits 0 within `timeout`."""
        env = dict(self.env) if self.env is not None else {"PATH": DEFAULT_PATH}
        if self.slurm_conf is not None:
            env["SLURM_CONF"] = str(self.slurm_conf)
        conf = env.get("SLURM_CONF")
        if conf and not Path(conf).is_file():   # Slurm would look for a config over DNS until the timeout
            raise SlurmError(argv, None, "", f"SLURM_CONF {conf} is not a file")
        seconds = timeout.total_seconds()
        try:
            proc = subprocess.run(
                list(argv), input=stdin, capture_output=True, text=True, timeout=seconds, env=env, check=False
            )
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            raise SlurmError(argv, None, stderr, f"timed out after {seconds:g} s") from exc
        except OSError as exc:
            raise SlurmError(argv, None, "", f"cannot run: {exc}") from exc
        if proc.returncode != 0:
            raise SlurmError(argv, proc.returncode, proc.stderr)
        if UNREACHABLE in proc.stderr:  # e.g. `scontrol show topology` exits 0 without a controller
            raise SlurmError(argv, 0, proc.stderr)
        return proc

    def _json(self, argv: Sequence[str], timeout: timedelta | None) -> dict:
        """Parsed `--json` output.

        :raises SlurmError: not JSON, or it carries `errors` (22.05's squeue/sinfo exit 0 with
            `{"errors": [{"error": "Unspecified error"}], "jobs": []}` when slurmctld is down).
        """
        proc = self._run(argv, timeout or self.timeout)
        try:
            data = json.loads(proc.stdout)
        except json.JSONDecodeError as exc:
            raise SlurmError(argv, 0, proc.stderr, f"output is not JSON: {exc}") from exc
        errors = data.get("errors") if isinstance(data, dict) else None
        if errors:
            detail = "; ".join(str(e.get("description") or e.get("error") or e) if isinstance(e, dict) else str(e)
                               for e in errors)
            raise SlurmError(argv, 0, proc.stderr, f"{JSON_ERRORS}: {detail}")
        return data

    def _update(self, job_id: int, fields: Sequence[str], timeout: timedelta | None) -> None:
        argv = ["scontrol", "update", f"JobId={job_id}", *fields]
        try:
            self._run(argv, timeout or self.update_timeout)
        except SlurmError as exc:
            _raise_if_unknown_job(job_id, exc)
            raise

    # -- queries ---------------------------------------------------------------------------------
    def nodes(self, timeout: timedelta | None = None) -> list[Node]:
        """All nodes with GPU counts and leaf switch (`sinfo --json`, or `scontrol --json show nodes` where
        sinfo's JSON lists sinfo lines instead of nodes (24.11), + `scontrol show topology`)."""
        data = self._json(["sinfo", "--json"], timeout)
        if "nodes" not in data and "sinfo" in data:
            data = self._json(["scontrol", "--json", "show", "nodes"], timeout)
        topo = self._run(["scontrol", "show", "topology"], timeout or self.timeout).stdout
        return parse_nodes(data, parse_topology(topo))

    def partitions(self, timeout: timedelta | None = None) -> list[Partition]:
        out = self._run(["scontrol", "show", "partition", "-o"], timeout or self.timeout).stdout
        return parse_partitions(out)

    def version(self, timeout: timedelta | None = None) -> tuple[int, int, int]:
        """The Slurm release of these commands, from `scontrol --version` (no slurmctld needed; 24.11 reads
        slurm.conf for it).

        :raises SlurmError: scontrol failed, or its output is not `slurm[-wlm] X.Y.Z` (the error quotes it).
        """
        argv = ["scontrol", "--version"]
        proc = self._run(argv, timeout or self.timeout)
        found = parse_version(proc.stdout)
        if found is None:
            raise SlurmError(argv, 0, proc.stderr, f"no Slurm version in its output {proc.stdout!r}")
        return found

    def jobs(self, timeout: timedelta | None = None) -> list[Job]:
        """Jobs squeue still lists (finished ones stay for MinJobAge)."""
        # --states=all: 24.11 applies squeue's default filter (pending and running only) to its JSON; 22.05 lists all
        return parse_jobs(self._json(["squeue", "--json", "--states=all"], timeout))

    def job(self, job_id: int, timeout: timedelta | None = None) -> Job:
        """:raises JobNotFoundError: squeue does not list `job_id` (use `sacct` for old jobs)."""
        for job in self.jobs(timeout):
            if job.job_id == job_id:
                return job
        raise JobNotFoundError(job_id, "not in squeue; finished jobs are only in sacct")

    def sacct(self, job_id: int, timeout: timedelta | None = None) -> list[AcctRecord]:
        """Accounting records of `job_id`, oldest first.

        :raises JobNotFoundError: slurmdbd has no record (yet: it can lag the controller by a second).
        """
        records = parse_sacct(self._json(["sacct", "--json", "-j", str(job_id)], timeout), job_id)
        if not records:
            raise JobNotFoundError(job_id, "no accounting record")
        return records

    # -- changes ---------------------------------------------------------------------------------
    def sbatch(self, script: Union[str, Path], args: Sequence[str] = (), timeout: timedelta | None = None) -> Submission:
        """Submit a batch script given as text or as a path; keep sbatch's stderr (hook messages)."""
        if isinstance(script, Path):
            argv, stdin = ["sbatch", "--parsable", *args, str(script)], None
        else:
            argv, stdin = ["sbatch", "--parsable", *args], script
        proc = self._run(argv, timeout or self.update_timeout, stdin=stdin)
        first = proc.stdout.strip().split(";")[0]
        if not first.isdigit():
            raise SlurmError(argv, 0, proc.stderr, f"no job id in sbatch output {proc.stdout!r}")
        return Submission(int(first), proc.stderr)

    def submit(self, script: Union[str, Path], args: Sequence[str] = (), timeout: timedelta | None = None) -> int:
        """Submit a batch script (text or path) with extra sbatch `args`; return the job id."""
        return self.sbatch(script, args, timeout).job_id

    def cancel(self, job_id: int, timeout: timedelta | None = None) -> None:
        """:raises JobNotFoundError: squeue does not list `job_id` (scancel itself exits 0 for those)."""
        self.job(job_id, timeout)
        try:
            self._run(["scancel", str(job_id)], timeout or self.update_timeout)
        except SlurmError as exc:
            _raise_if_unknown_job(job_id, exc)
            raise

    def update_comment(self, job_id: int, text: str, timeout: timedelta | None = None) -> None:
        self._update(job_id, [f"Comment={text}"], timeout)

    def update_admin_comment(self, job_id: int, text: str, timeout: timedelta | None = None) -> None:
        """Set the job's AdminComment (admins only; the user's Comment, which the hook and launcher read,
        stays as it is)."""
        self._update(job_id, [f"AdminComment={text}"], timeout)

    def reconfigure(self, timeout: timedelta | None = None) -> None:
        """`scontrol reconfigure`: slurmctld and the slurmd re-read slurm.conf."""
        self._run(["scontrol", "reconfigure"], timeout or self.update_timeout)

    def shrink(self, job_id: int, keep: Union[int, Sequence[str]], timeout: timedelta | None = None) -> ResizeResult:
        """Shrink a running job to `keep` nodes (a count, or a node list / names of the nodes to keep).

        A count keeps the batch host and the lowest other nodes. Tasks on released nodes are
        SIGKILLed by Slurm, so ranks there should leave first. The returned environment must be
        applied before the next `srun` of the job (srun trusts SLURM_NNODES etc.).

        :raises JobNotFoundError: unknown `job_id`.
        :raises ResizeError: the job is not running, `keep` is not a subset of its nodes, is empty,
            asks for more nodes than the job has, drops the batch host, or Slurm refuses the update.
        :raises SlurmError: Slurm could not be asked (`is_transient`); calling again is safe: a job that
            already has exactly `keep` is left alone.
        """
        job = self.job(job_id, timeout)
        target = _shrink_target(job, [keep] if isinstance(keep, str) else keep)
        if target != job.nodes:
            try:
                self._update(job_id, [f"NodeList={compress_hostlist(target)}"], timeout)
            except JobNotFoundError:
                raise
            except SlurmError as exc:
                if is_transient(exc):  # the controller was away: the caller may retry (shrink is idempotent)
                    raise
                raise ResizeError(job_id, f"Slurm refused NodeList={compress_hostlist(target)}: {exc}") from exc
            job = self.job(job_id, timeout)
        return ResizeResult(job=job, env=job.resize_env())

    def job_owner(self, job_id: int, timeout: timedelta | None = None) -> "JobOwner":
        """Who owns `job_id`, its state, run window and allocation (for checking a signed write against Slurm).

        Asks squeue for that one job (`-O`, text: `squeue --json` ignores `-j` in 22.05 and lists every job,
        which takes a second on a busy controller), then sacct for its accounting records: one per size of a
        resized job, so the allocation is the largest the job has held, and the only source once slurmctld
        has forgotten the job. Without slurmdbd (sacct fails) a job squeue lists gets its current allocation.

        :raises JobNotFoundError: neither squeue nor sacct knows `job_id`.
        :raises SlurmError: squeue failed (slurmctld unreachable, timed out).
        """
        try:
            out = self._run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-O", _OWNER_SQUEUE],
                            timeout or self.timeout).stdout
        except SlurmError as exc:
            if "Invalid job id" not in exc.stderr:
                raise
            out = ""
        try:
            acct = self._run(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", _OWNER_SACCT],
                             timeout or self.timeout).stdout
        except SlurmError as exc:
            if not out.strip():
                raise JobNotFoundError(job_id, f"not in squeue and sacct failed: {exc}") from exc
            log.warning("sacct failed for job %s (%s): its current allocation only", job_id, exc)
            acct = ""
        owner = parse_owner(out, acct, job_id)
        if owner is None:
            raise JobNotFoundError(job_id, "neither squeue nor sacct lists it")
        return owner


class PyslurmBackend:
    """`Backend` over pyslurm (the release series of the cluster's Slurm: 24.11 here, built in the testbed's root).

    Queries and changes go through libslurm: `Nodes/Partitions/Jobs.load`, `Job.load`, `JobSubmitDescription.submit`,
    `Job.cancel`, `Job.modify` (comment, admin comment, and a shrink as `required_nodes`, what scontrol's
    `NodeList=` sets), `slurmctld.reconfigure`, `slurm_api_version`. These stay on the commands (a `CommandBackend`
    inside), because pyslurm 24.11 cannot give what the protocol promises:
    - the switch of each node: pyslurm has no topology call (`scontrol show topology`);
    - `sacct`: `pyslurm.db.Jobs` keys records by job id, so a resized job's one-record-per-size collapses
      into one (pyslurm/db/job.pyx, "TODO: How to handle the possibility of duplicate job ids");
    - `job_owner`, which reads those per-size records.
    - `--switches` at submission: pyslurm 24.11's `_set_switches` reads an undefined name, so the job goes in
      held, `scontrol update Switches=` sets it, and pyslurm releases it.
    `Submission.stderr` stays empty: `JobSubmitDescription.submit` drops the job_submit hook's user message
    (`submit_response_msg_t.job_submit_user_msg`). `timeout` is Slurm's own MessageTimeout for libslurm calls
    (a call blocks in C holding the interpreter); the commands honour it as `CommandBackend` does.

    Args:
        slurm_conf: the cluster's slurm.conf; libslurm reads SLURM_CONF once, when pyslurm is first imported,
            so one process talks to one cluster.
        env, timeout, update_timeout: as `CommandBackend` (for the commands named above).
    """

    def __init__(
        self,
        slurm_conf: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout: timedelta = timedelta(seconds=10),
        update_timeout: timedelta = timedelta(seconds=30),
    ):
        if slurm_conf is not None:
            if os.environ.get("SLURM_CONF", str(slurm_conf)) != str(slurm_conf) and "pyslurm" in sys.modules:
                raise SlurmError(["pyslurm"], None, "", f"pyslurm was initialised for {os.environ['SLURM_CONF']}, "
                                                        f"not {slurm_conf}: one cluster per process")
            os.environ["SLURM_CONF"] = str(slurm_conf)
        try:
            import pyslurm  # noqa: PLC0415 - optional: pyslurm, built in the 24.11 testbed
        except ImportError as exc:
            raise SlurmError(["pyslurm"], None, "", f"pyslurm is not installed here ({exc}); it is built inside "
                                                    f"the 24.11 testbed's root: run there") from exc
        self.pyslurm = pyslurm
        self.commands = CommandBackend(slurm_conf=slurm_conf, env=env, timeout=timeout, update_timeout=update_timeout)
        self.timeout = timeout
        self.update_timeout = update_timeout

    def _call(self, what: str, fn, *args, job_id: int | None = None):
        """Run one pyslurm call; an unknown `job_id` becomes `JobNotFoundError`, any other failure `SlurmError`."""
        try:
            return fn(*args)
        except self.pyslurm.RPCError as exc:
            if job_id is not None and "Invalid job id" in str(exc):
                raise JobNotFoundError(job_id, str(exc)) from exc
            raise SlurmError(["pyslurm", what], getattr(exc, "errno", None) or 1, str(exc)) from exc

    # -- queries ---------------------------------------------------------------------------------
    def nodes(self, timeout: timedelta | None = None) -> list[Node]:
        topo = self.commands._run(["scontrol", "show", "topology"], timeout or self.timeout).stdout
        switches = parse_topology(topo)
        loaded = self._call("Nodes.load", self.pyslurm.Nodes.load)
        return [
            Node(name=n.name, state=_node_state(n.state), gpus=_gpu_count(_gres_text(n.configured_gres)),
                 gpus_alloc=_gpu_count(_gres_text(n.allocated_gres)), switch=switches.get(n.name),
                 partitions=tuple(n.partitions or ()), gpu_type=gres_gpu_type(_gres_text(n.configured_gres)))
            for n in sorted(loaded.values(), key=lambda n: n.name)
        ]

    def version(self, timeout: timedelta | None = None) -> tuple[int, int, int]:
        """The Slurm release pyslurm was built against (libslurm's SLURM_VERSION_NUMBER, `slurm_api_version`: no
        RPC, as `scontrol --version`). Not `pyslurm.__version__`, whose last number is pyslurm's own patch level."""
        major, minor, micro = self.pyslurm.slurm_api_version()
        return int(major), int(minor), int(micro)

    def partitions(self, timeout: timedelta | None = None) -> list[Partition]:
        loaded = self._call("Partitions.load", self.pyslurm.Partitions.load)
        return [Partition(name=p.name, nodes=tuple(expand_hostlist(p.nodes)) if p.nodes else (),
                          default=bool(p.is_default), state=str(p.state or "").upper())
                for p in loaded.values()]

    def jobs(self, timeout: timedelta | None = None) -> list[Job]:
        loaded = self._call("Jobs.load", self.pyslurm.Jobs.load)
        return [self._job(j) for j in sorted(loaded.values(), key=lambda j: j.id)]

    def job(self, job_id: int, timeout: timedelta | None = None) -> Job:
        return self._job(self._call("Job.load", self.pyslurm.Job.load, job_id, job_id=job_id))

    def _job(self, j) -> Job:
        nodelist = j.allocated_nodes or ""
        nodes = tuple(expand_hostlist(nodelist)) if nodelist else ()
        layout = j.get_resource_layout_per_node() if nodes else {}
        cpus = {name: _count_ids(per.get("cpu_ids", "")) for name, per in layout.items()}
        # per-node GPUs only for a job with GRES: squeue's JSON has no `gres_detail` for one without (`()`, not zeros)
        gpus = {name: _gpu_count(_gres_text(per["gres"])) for name, per in layout.items()} \
            if any(per.get("gres") for per in layout.values()) else {}
        return Job(
            job_id=int(j.id), name=j.name or "", state=_job_state(j.state), nodes=nodes, nodelist=nodelist,
            cpus_per_node=tuple(cpus.get(n, 0) for n in nodes) if cpus else (),
            gpus_per_node=tuple(gpus.get(n, 0) for n in nodes) if len(gpus) == len(nodes) else (),
            tres_per_node=_gres_text(j.gres_per_node or {}), comment=j.comment or "",
            batch_host=j.batch_host or "", reason=j.state_reason or "", partition=j.partition or "",
            node_count=int(j.num_nodes or 0), end_time=int(getattr(j, "end_time", None) or 0),
            priority=int(getattr(j, "priority", None) or 0),
            time_limit_s=_limit_s(getattr(j, "time_limit", None)),
        )

    def sacct(self, job_id: int, timeout: timedelta | None = None) -> list[AcctRecord]:
        """The sacct command's records (class docstring: pyslurm.db collapses a resized job's records)."""
        return self.commands.sacct(job_id, timeout)

    def job_owner(self, job_id: int, timeout: timedelta | None = None) -> "JobOwner":
        return self.commands.job_owner(job_id, timeout)

    # -- changes ---------------------------------------------------------------------------------
    def sbatch(self, script: Union[str, Path], args: Sequence[str] = (),
               timeout: timedelta | None = None) -> Submission:
        """Submit like `sbatch [args] script`: `args` go in as `#SBATCH` lines ahead of the script's own (which
        pyslurm reads with `load_sbatch_options`), so a command-line option wins as with sbatch."""
        text = script.read_text() if isinstance(script, Path) else script
        lines = text.splitlines(keepends=True)
        shebang = lines.pop(0) if lines and lines[0].startswith("#!") else "#!/bin/sh\n"
        # pyslurm reads one option per #SBATCH line: split the script's own lines as sbatch does
        lines = ["".join(f"#SBATCH {o}\n" for o in _sbatch_lines(shlex.split(ln[len("#SBATCH"):].split("#")[0])))
                 if ln.startswith("#SBATCH") else ln for ln in lines]
        extra = "".join(f"#SBATCH {arg}\n" for arg in _sbatch_lines(args))

        with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="elastic-sbatch-") as f:  # pyslurm reads a path
            f.write(shebang + extra + "".join(lines))
            f.flush()
            # the environment given explicitly: pyslurm's default ("ALL", from C's environ) reaches slurmctld empty
            # here ("batch job cannot run without an environment"), as libslurm is loaded with RTLD_DEEPBIND
            desc = self.pyslurm.JobSubmitDescription(script=f.name, environment=dict(os.environ))
            try:
                desc.load_sbatch_options()
            except ValueError as exc:
                raise SlurmError(["pyslurm", "JobSubmitDescription", *args], 1, str(exc)) from exc
            if desc.ntasks is None and desc.nodes is not None:   # sbatch -N2 alone runs 2 tasks; pyslurm sends 1,
                desc.ntasks = int(str(desc.nodes).split("-")[0])  # which leaves the job pending on Resources forever
            # pyslurm 24.11 cannot send --switches (its _set_switches reads an undefined `kwargs`): submit held,
            # set the switch request with scontrol, then release (unless the caller asked for a held job)
            switches, desc.switches = desc.switches, None
            held = desc.priority == 0
            if switches:
                desc.priority = 0
            job_id = int(self._call("JobSubmitDescription.submit", desc.submit))
        if switches:
            self.commands._update(job_id, [f"Switches={switches}"], timeout)
            if not held:
                self._call("Job.release", self.pyslurm.Job(job_id).release, job_id=job_id)
        return Submission(job_id, "")

    def submit(self, script: Union[str, Path], args: Sequence[str] = (), timeout: timedelta | None = None) -> int:
        return self.sbatch(script, args, timeout).job_id

    def cancel(self, job_id: int, timeout: timedelta | None = None) -> None:
        self.job(job_id, timeout)
        self._call("Job.cancel", self.pyslurm.Job(job_id).cancel, job_id=job_id)

    def _modify(self, job_id: int, **changes) -> None:
        desc = self.pyslurm.JobSubmitDescription(**changes)
        self._call("Job.modify", self.pyslurm.Job(job_id).modify, desc, job_id=job_id)

    def update_comment(self, job_id: int, text: str, timeout: timedelta | None = None) -> None:
        self._modify(job_id, comment=text)

    def update_admin_comment(self, job_id: int, text: str, timeout: timedelta | None = None) -> None:
        self._modify(job_id, admin_comment=text)

    def reconfigure(self, timeout: timedelta | None = None) -> None:
        self._call("slurmctld.reconfigure", self.pyslurm.slurmctld.reconfigure)

    def shrink(self, job_id: int, keep: Union[int, Sequence[str]], timeout: timedelta | None = None) -> ResizeResult:
        """As `CommandBackend.shrink` (same checks, same result), through `Job.modify(required_nodes=...)`."""
        job = self.job(job_id, timeout)
        target = _shrink_target(job, [keep] if isinstance(keep, str) else keep)
        if target != job.nodes:
            try:
                self._modify(job_id, required_nodes=compress_hostlist(target))
            except SlurmError as exc:
                raise ResizeError(job_id, f"Slurm refused NodeList={compress_hostlist(target)}: {exc}") from exc
            job = self.job(job_id, timeout)
        return ResizeResult(job=job, env=job.resize_env())


def _gres_text(gres) -> str:
    """pyslurm's GRES dict as Slurm writes it: a node's (`{"gpu:h100": 4}`) or a job layout's per node
    (`{"gpu:h100": {"count": 2, ...}}`) -> `gpu:h100:4`; a job's request keeps its `gres/` (`{"gres/gpu": 4}` ->
    `gres/gpu:4`, as 24.11's squeue)."""
    items = []
    for name, value in (gres or {}).items():
        count = value.get("count") if isinstance(value, dict) else value
        items.append(f"{name}:{count}")
    return ",".join(items)


def _count_ids(ids: str) -> int:
    """`0-3,6` -> 5 (CPU ids of a node in pyslurm's resource layout)."""
    total = 0
    for part in str(ids or "").split(","):
        lo, _, hi = part.partition("-")
        if lo.strip().isdigit():
            total += int(hi) - int(lo) + 1 if hi.strip().isdigit() else 1
    return total


def _sbatch_lines(args: Sequence[str]) -> list[str]:
    """sbatch arguments as `#SBATCH` line bodies: `-w node2` and `--nodes=2` stay pairs/single; a bare flag alone.

    :raises SlurmError: a positional argument (the script is passed separately).
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            raise SlurmError(["pyslurm", *args], 1, f"unexpected argument {arg!r}: pass the script itself apart")
        if "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("-") and arg not in _SBATCH_FLAGS:
            out.append(f"{arg} {args[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


# sbatch options that take no value (what may stand right before a value-looking word)
_SBATCH_FLAGS = ("--exclusive", "-H", "--hold", "--requeue", "--no-requeue", "-O", "--overcommit", "--contiguous",
                 "-k", "--no-kill", "-s", "--oversubscribe", "--reboot", "--parsable", "-Q", "--quiet", "-W", "--wait")


def is_transient(exc: BaseException) -> bool:
    """True for a `SlurmError` that may pass when asked again: the command timed out or could not reach
    slurmctld (restarting, overloaded). Refusals (`ResizeError`), unknown jobs and bad output are not."""
    if not isinstance(exc, SlurmError):
        return False
    if exc.rc is None:
        return "timed out" in str(exc)
    return any(mark in exc.stderr or mark in str(exc) for mark in _TRANSIENT)


def _raise_if_unknown_job(job_id: int, exc: SlurmError) -> None:
    if "Invalid job id" in exc.stderr:
        raise JobNotFoundError(job_id, exc.stderr.strip().splitlines()[-1]) from exc


def _shrink_target(job: Job, keep: Union[int, Sequence[str]]) -> tuple[str, ...]:
    if job.state != "RUNNING":
        raise ResizeError(job.job_id, f"it is {job.state}; only running jobs can be shrunk")
    have = f"it has {len(job.nodes)} ({job.nodelist})"
    if isinstance(keep, int):
        if keep < 1:
            raise ResizeError(job.job_id, f"asked for {keep} nodes; keep at least 1")
        if keep > len(job.nodes):
            raise ResizeError(job.job_id, f"asked for {keep} nodes but {have}; shrink cannot grow")
        others = [n for n in job.nodes if n != job.batch_host]
        chosen = {job.batch_host, *others[: keep - 1]}
    else:
        chosen = {n for expr in keep for n in expand_hostlist(expr)}
        if not chosen:
            raise ResizeError(job.job_id, "the node list to keep is empty")
        foreign = sorted(chosen - set(job.nodes))
        if foreign:
            raise ResizeError(job.job_id, f"{','.join(foreign)} not in its allocation; {have}")
        if job.batch_host not in chosen:
            raise ResizeError(job.job_id, f"keeping {compress_hostlist(chosen)} would drop its batch host {job.batch_host}")
    return tuple(n for n in job.nodes if n in chosen)


# -- parsing (pure functions; unit-tested on output captured from the 22.05 testbed) -------------
def _gpu_count(gres: str) -> int:
    """`gpu:4`, `gpu:4(S:0)`, `gpu:2(IDX:0-1)`, `gpu:tesla:2(...)` -> GPU count; 0 if no gpu entry."""
    return gpus_in_tres(gres) or 0


def parse_version(text: str) -> tuple[int, int, int] | None:
    """`scontrol --version` (`slurm 24.11.5`, Debian's `slurm-wlm 22.05.8`, `slurm 24.05.0-0rc1`) -> (24, 11, 5);
    None for anything else."""
    found = re.fullmatch(r"slurm(?:-wlm)?\s+(\d+)\.(\d+)\.(\d+)\S*", text.strip())
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


def parse_topology(text: str) -> dict[str, str]:
    """`scontrol show topology` -> {node: lowest-level switch name}."""
    best: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "SwitchName" not in fields or not fields.get("Nodes"):
            continue
        level = int(fields.get("Level", "0"))
        for node in expand_hostlist(fields["Nodes"]):
            if node not in best or level < best[node][0]:
                best[node] = (level, fields["SwitchName"])
    return {node: name for node, (_, name) in best.items()}


def _node_state(state, flags=()) -> str:
    """A node's state, the same string from every backend: its base state, then its flags sorted, lower case, joined
    with `+` (`idle`, `idle+drain`, `mixed+drain`). 22.05's JSON gives the base state and a `state_flags` list
    (`"idle"`, `["DRAIN"]`), 24.11's one list (`["IDLE", "DRAIN"]`), pyslurm libslurm's string (`IDLE+DRAIN`): a
    drained node reads `idle+drain` on each, never `idle` (which is what a grow may take)."""
    parts = [str(p) for p in state] if isinstance(state, list) else str(state or "").split("+")
    base, own = (parts[0], parts[1:]) if parts else ("", [])
    return "+".join([base.lower(), *sorted({str(f).lower() for f in (*own, *flags) if f})])


# The flags libslurm's job_state_string names instead of the base state, in its order (22.05's squeue and sacct JSON
# and pyslurm's `Job.state` are that string; 24.11's JSON lists the base state and its flags).
_JOB_STATE_FLAGS = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                    "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING")


def _job_state(value) -> str:
    """A job's (or an accounting record's) state, the same string from every backend: libslurm's job_state_string,
    which 22.05's JSON and pyslurm give as it is (`COMPLETING`, `RESIZING`); 24.11's JSON gives the base state and
    its flags (`["TIMEOUT", "COMPLETING"]`, a former size's sacct record `["PENDING", "RESIZING"]`), read here as
    job_state_string reads them: the first flag of `_JOB_STATE_FLAGS` set, else the base state. So a job whose
    processes are still being ended is COMPLETING on each: it has not ended until it is gone."""
    if isinstance(value, list):
        named = [str(v).upper() for v in value]
        return next((f for f in _JOB_STATE_FLAGS if f in named), named[0] if named else "")
    return str(value or "").split("+")[0].upper()


def parse_nodes(sinfo_json: dict, switches: Mapping[str, str]) -> list[Node]:
    """22.05's `sinfo --json` or 24.11's `scontrol --json show nodes` (both a `nodes` list)."""
    return [
        Node(
            name=n["name"],
            state=_node_state(n.get("state", ""), n.get("state_flags") or ()),
            gpus=_gpu_count(n.get("gres", "")),
            gpus_alloc=_gpu_count(n.get("gres_used", "")),
            switch=switches.get(n["name"]),
            partitions=tuple(n.get("partitions", [])),
            gpu_type=gres_gpu_type(n.get("gres", "")),
        )
        for n in sinfo_json.get("nodes", [])
    ]


def most_gpus_per_node(nodes: Sequence[Node], partitions: Sequence[Partition]) -> dict[str, int]:
    """The most GPUs one node of each partition has (0: none), as Slurm reports its nodes' GRES: the bound
    job_submit.lua holds every decision's GPUs per node to (elastic.conf's `max_gpus_per_node`, #24.5)."""
    gpus = {n.name: n.gpus for n in nodes}
    return {p.name: max((gpus.get(n, 0) for n in p.nodes), default=0) for p in partitions}


def parse_partitions(text: str) -> list[Partition]:
    """`scontrol show partition -o` (one partition per line, values without spaces)."""
    out = []
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "PartitionName" in fields:
            nodes = fields.get("Nodes", "(null)")
            out.append(
                Partition(
                    name=fields["PartitionName"],
                    nodes=tuple(expand_hostlist(nodes)) if nodes != "(null)" else (),
                    default=fields.get("Default") == "YES",
                    state=fields.get("State", ""),
                )
            )
    return out


def parse_jobs(squeue_json: dict) -> list[Job]:
    jobs = []
    for j in squeue_json.get("jobs", []):
        nodelist = j.get("nodes") or ""
        nodes = tuple(expand_hostlist(nodelist)) if nodelist else ()
        resources = j.get("job_resources") or {}
        alloc = resources.get("allocated_nodes") or []               # 22.05
        cpus = {a.get("nodename"): _allocated_cores(a) for a in alloc}
        layout = resources.get("nodes")                                # 24.11 (22.05: the node list, a string)
        for a in (layout.get("allocation") or []) if isinstance(layout, dict) else []:
            cpus[a.get("name")] = _number((a.get("cpus") or {}).get("count"))
        gres = list(j.get("gres_detail") or [])
        jobs.append(
            Job(
                job_id=int(j["job_id"]),
                name=j.get("name", ""),
                state=_job_state(j.get("job_state", "")),
                nodes=nodes,
                nodelist=nodelist,
                cpus_per_node=tuple(cpus.get(n, 0) for n in nodes) if cpus else (),
                gpus_per_node=tuple(_gpu_count(g) for g in gres) if len(gres) == len(nodes) else (),
                tres_per_node=j.get("tres_per_node") or "",
                comment=j.get("comment") or "",
                batch_host=j.get("batch_host") or "",
                reason=j.get("state_reason") or "",
                partition=j.get("partition") or "",
                node_count=_number(j.get("node_count")),
                end_time=_number(j.get("end_time")),
                priority=_number(j.get("priority")),
                time_limit_s=_limit_s(j.get("time_limit")),
            )
        )
    return jobs


def _number(value) -> int:
    """An integer of squeue's JSON: a plain number (22.05), or `{"set": true, "number": N}` (later versions)."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set", True) else 0
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _limit_s(minutes) -> int:
    """A time limit in seconds from squeue's JSON minutes (a number in 22.05; `{"set", "infinite", "number"}` later)
    or pyslurm's; 0 when none is set, it is unlimited, or it is Slurm's NO_VAL/INFINITE sentinel."""
    if isinstance(minutes, dict) and minutes.get("infinite"):
        return 0
    value = _number(minutes)
    return value * 60 if 0 < value < 0xFFFFFFFE else 0


def _allocated_cores(node: dict) -> int:
    """Allocated cores of one `job_resources.allocated_nodes` entry (= CPUs, one thread per core)."""
    return sum(
        state == "allocated"
        for sock in (node.get("sockets") or {}).values()
        for state in (sock.get("cores") or {}).values()
    )


def parse_sacct(sacct_json: dict, job_id: int) -> list[AcctRecord]:
    """Records of `job_id`, oldest first (sacct's own order is not). Events within one second share
    a record in slurmdbd, so a resize right after the start replaces the first size's record."""
    out = []
    rows = [j for j in sacct_json.get("jobs", []) if int(j.get("job_id", -1)) == job_id]
    rows.sort(key=lambda j: ((j.get("time") or {}).get("start") or 0, (j.get("time") or {}).get("end") or 2**63))
    for j in rows:
        allocated = (j.get("tres") or {}).get("allocated") or []
        gpus = sum(int(t.get("count") or 0) for t in allocated if t.get("type") == "gres" and t.get("name") == "gpu")
        state = j.get("state") or {}
        out.append(
            AcctRecord(
                job_id=job_id,
                name=j.get("name", ""),
                state=_job_state(state.get("current", "") if isinstance(state, dict) else state),
                nodelist=j.get("nodes") or "",
                gpus=gpus,
            )
        )
    return out


# -- host lists ----------------------------------------------------------------------------------
def compress_counts(counts: Sequence[int]) -> str:
    """Slurm's repeated-count form: (8, 8, 4) -> `8(x2),4`."""
    out: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(f"{counts[i]}(x{j - i})" if j - i > 1 else str(counts[i]))
        i = j
    return ",".join(out)


# -- job steps (added by the launcher, issue 6) ----------------------------------------------------
def srun_step_argv(node: str, ntasks: int, argv: Sequence[str]) -> list[str]:
    """The `srun` command of one node's worker step inside a running allocation.

    `--overlap` lets steps share the allocation (one per node, started and ended independently) and
    `--overcommit` allows more tasks than CPUs the job holds on the node (one task per GPU slot).
    `--kill-on-bad-exit=0`: one task failing does not take the others of the step down.
    """
    return ["srun", "--overlap", "--overcommit", "--nodes=1", f"--ntasks={ntasks}", f"--nodelist={node}",
            "--kill-on-bad-exit=0", "--export=ALL", *argv]


def start_step(env: Mapping[str, str], node: str, ntasks: int, argv: Sequence[str], stdout: Path) -> subprocess.Popen:
    """Start a long-running `srun` step and return its process (the caller waits for or signals it).

    `env` must be the allocation's Slurm environment (SLURM_JOB_ID, SLURM_NODELIST, SLURM_NNODES...,
    refreshed after a resize: srun trusts it) plus what the tasks need.

    :raises SlurmError: srun could not be started.
    """
    command = srun_step_argv(node, ntasks, argv)
    try:
        with open(stdout, "ab") as out:
            return subprocess.Popen(command, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        raise SlurmError(command, None, "", f"cannot start: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class JobOwner:
    """A job's owner, life-cycle and allocation as far as a signed write needs them.

    Attributes:
        user_id: the numeric uid the job runs as (-1 when sacct names a user unknown on this host).
        state: Slurm's state in upper case (RUNNING, COMPLETED...).
        ended_at_s: Unix time the job ended; None while it is pending or running.
        started_at_s: Unix time the job started; None while pending (or when Slurm did not say).
        max_nodes: the most nodes it has held (a resized job: over all its sizes); 0 while pending.
        max_gpus: the most GPUs it has held in all.
        max_cpus: the most CPUs it has held in all.
        gpus_per_node: GPUs on each of its nodes when it asked per node (`--gres=gpu:N`), else None.
        gpu_type: the GPU type of a typed GRES allocation (`gres/gpu:h100`), None when untyped.
        partition: the partition it runs in.
    """

    job_id: int
    user_id: int
    state: str
    ended_at_s: float | None
    started_at_s: float | None = None
    max_nodes: int = 0
    max_gpus: int = 0
    max_cpus: int = 0
    gpus_per_node: int | None = None
    gpu_type: str | None = None
    partition: str = ""


# a job in one of these states has not ended (a requeued or suspended one comes back)
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "RESIZING", "REQUEUED")
_OWNER_SQUEUE = "JobID:|,UserID:|,State:|,StartTime:|,EndTime:|,NumNodes:|,Partition:|,tres-alloc:|,tres-per-node:|"
_OWNER_SACCT = "JobID,UID,State,Start,End,NNodes,Partition,AllocTRES"


def _slurm_time(text: str) -> float | None:
    """`2026-11-26T07:49:48` (Slurm prints local time) -> Unix time; None for Unknown, N/A, NONE."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _tres(text: str) -> tuple[int, int, str | None]:
    """`cpu=2,node=2,billing=2,gres/gpu=4,gres/gpu:h100=4` -> (cpus 2, gpus 4, type `h100` or None)."""
    cpus = next((int(v) for k, _, v in (item.partition("=") for item in text.split(",")) if k == "cpu" and v.isdigit()), 0)
    gpus, gpu_type = gpu_tres(text)
    return cpus, gpus or 0, gpu_type


def parse_owner(squeue: str, sacct: str, job_id: int) -> JobOwner | None:
    """`job_id`'s owner and facts from squeue `-O` (`_OWNER_SQUEUE`, one `|`-ended line) and sacct `-X -P`
    (`_OWNER_SACCT`, one line per size of a resized job); None when neither lists it. squeue's line, when
    there is one, gives the state (sacct lags slurmctld); the allocation is the largest of all lines."""
    def lines(text: str, columns: int) -> list[list[str]]:
        rows = [line.strip().removesuffix("|").split("|") for line in text.splitlines()]
        return [r[:columns] + [""] * (9 - columns) for r in rows
                if len(r) >= columns and r[0] == str(job_id) and r[1].isdigit()]

    live_rows, acct_rows = lines(squeue, 9), lines(sacct, 8)
    rows = live_rows + acct_rows
    if not rows:
        return None
    # the state: squeue's (sacct lags slurmctld), else the newest accounting record (not a former size's)
    current = [r for r in acct_rows if not r[2].startswith("RESIZING")] or acct_rows
    first = live_rows[0] if live_rows else current[-1]
    state = first[2].split()[0].upper() if first[2].strip() else ""   # sacct: "CANCELLED by 0"
    live = state in LIVE_STATES
    ended = None if live else _slurm_time(first[4])
    starts = [t for t in (_slurm_time(r[3]) for r in rows) if t is not None]
    tres = [_tres(r[7]) for r in rows]
    per_node = [_gpu_count(g.removeprefix("gres:")) for g in split_top(first[8])] if first[8] not in ("", "N/A") \
        else []
    nodes = [int(r[5]) for r in rows if r[5].isdigit()]
    return JobOwner(job_id, int(first[1]), state, ended,
                    started_at_s=min(starts) if starts and state != "PENDING" else None,
                    max_nodes=max(nodes, default=0) if state != "PENDING" else 0,
                    max_gpus=max((t[1] for t in tres), default=0), max_cpus=max((t[0] for t in tres), default=0),
                    gpus_per_node=sum(per_node) or None,
                    gpu_type=next((t[2] for t in tres if t[2]), None), partition=first[6])
