"""A signed job's records checked against what Slurm says about that job (issue #14.2).

A munge credential binds a request to one job and its owner; this binds each record to that job's facts
(`slurm_plugin.client.JobOwner`, from the `OwnerCache` lookup the credential check already made):

    gpu        a step record's (or a collective record's, when given) GPU type is the job's: the type of a typed
               GRES allocation (`gres/gpu:h100`), else the GPU of the job's partition in the cluster model.
               A job with no GPUs, or whose GPU type neither tells, posts no record that names a GPU.
    layout     a step record's layout fits the job's allocation: at most the most nodes the job has held (over
               all sizes of a resized job), at most its GPUs per node (`--gres=gpu:N`, else its partition's
               node size in the cluster model, else all its GPUs) on each, at most its GPUs in all.
    world      a collective or ddp_overhead record's ranks are at most the job's GPUs (its CPUs for a job without
               GPUs);
    nodes      and a collective's nodes at most the job's nodes.
    links      a record's links (`link`, `intra_link`, `inter_link`) are ones the job could have crossed: its
               partition's intra- and inter-node links in the cluster model, or a transport any host falls back
               to (`shm`, `socket`, `loopback`); a job without GPUs only the latter (#24.11).
    restart    a restart record's sizes are not checked: a grown restart job's nodes are its helper jobs' too
               (elastic_launcher/restart.py), which this job's Slurm facts do not hold; its time is.
    timestamp_s  within the job's run window: from its start to its end (now while it runs), `SLACK` either side
               (clock skew between hosts, a window measured just before the end).
    iter_s     the job's step rows, each at least one step of `iter_s` (a ddp_overhead row: one plain and one DDP
               step of its probe), claim in all (over every post) at most
               the seconds it ran, `SLACK` added (`run_seconds`; the store keeps the sum, #24.1: a job of one
               second posted 20 rows of 0.5 s steps).

`check_records` is pure: it raises `RecordMismatch` (403, naming `observations[i].<field>`) on the first record
that does not fit, so nothing of that request is stored. Tool and admin tokens are not bound to a job: their
records are not checked here (admin-guide.md, "What each credential may do").
"""
from __future__ import annotations

from datetime import timedelta
from typing import Sequence

from predictor.auth import AuthError
from predictor.cluster import Cluster
from predictor.errors import NotFoundError
from slurm_plugin.contracts.records import is_mixed, layout_name

SLACK = timedelta(seconds=120)


class RecordMismatch(AuthError):
    """A signed record that does not fit its job's Slurm facts: 403 `record_mismatch`, `field` the record field."""

    def __init__(self, field: str, message: str):
        super().__init__(403, f"{field}: {message}", field, "record_mismatch")


UNKNOWN_GPU = "unknown"  # elastic_launcher.launch_config's gpu_type when the job gave none


def _job_gpu(job, cluster: Cluster) -> tuple[str | None, str]:
    """The job's GPU type and where it came from ("" source: unknown)."""
    if job.gpu_type:
        return job.gpu_type, f"its GRES type ({job.gpu_type})"
    try:
        part = cluster.partition(job.partition) if job.partition else None
    except NotFoundError:
        part = None
    if part is not None:
        return part.gpu, f"partition {part.name}'s GPU in the cluster model ({part.gpu})"
    return None, ""


def _per_node(job, cluster: Cluster) -> int:
    if job.gpus_per_node:
        return job.gpus_per_node
    try:
        return min(cluster.partition(job.partition).gpus_per_node, job.max_gpus) if job.partition else job.max_gpus
    except NotFoundError:
        return job.max_gpus


def _check_gpu(record: dict, where: str, job, cluster: Cluster) -> None:
    if "gpu" not in record:
        return
    if job.max_gpus <= 0:
        raise RecordMismatch(f"{where}.gpu", f"job {job.job_id} holds no GPUs, the record names GPU "
                                             f"{record['gpu']!r}")
    if is_mixed(record):  # what a mixed job ran, per node: kept as a record, never fit (engine), so not confirmed
        return
    gpu, source = _job_gpu(job, cluster)
    if gpu is None:
        raise RecordMismatch(f"{where}.gpu", f"cannot confirm GPU {record['gpu']!r} for job {job.job_id}: its "
                                             f"GRES is untyped and partition {job.partition!r} is not in the "
                                             "cluster model")
    if record["gpu"].lower() == UNKNOWN_GPU:  # the launcher's default when no gpu_type= was given: Slurm knows
        record["gpu"] = gpu
        return
    if record["gpu"].lower() != gpu.lower():
        raise RecordMismatch(f"{where}.gpu", f"the record says {record['gpu']!r}, job {job.job_id} runs on "
                                             f"{gpu!r} ({source})")


def _check_layout(layout: Sequence[int], where: str, job, cluster: Cluster) -> None:
    per_node = _per_node(job, cluster)
    name = layout_name(layout)
    if len(layout) > job.max_nodes:
        raise RecordMismatch(f"{where}.layout", f"{name} spans {len(layout)} nodes, job {job.job_id} has held at "
                                                f"most {job.max_nodes}")
    if max(layout) > per_node:
        raise RecordMismatch(f"{where}.layout", f"{name} puts {max(layout)} GPUs on a node, job {job.job_id} has "
                                                f"{per_node} per node")
    if sum(layout) > job.max_gpus:
        raise RecordMismatch(f"{where}.layout", f"{name} uses {sum(layout)} GPUs, job {job.job_id} has held at "
                                                f"most {job.max_gpus}")


def _check_collective(record: dict, where: str, job) -> None:
    ranks = job.max_gpus or job.max_cpus
    if record["world"] > ranks:
        what = "GPUs" if job.max_gpus else "CPUs"
        raise RecordMismatch(f"{where}.world", f"{record['world']} ranks, job {job.job_id} has held at most "
                                               f"{ranks} {what}")
    if record.get("nodes", 1) > job.max_nodes:   # only a collective row has `nodes`
        raise RecordMismatch(f"{where}.nodes", f"{record['nodes']} nodes, job {job.job_id} has held at most "
                                               f"{job.max_nodes}")


FALLBACK_LINKS = ("shm", "socket", "loopback")  # what any host's NCCL or gloo may fall back to


def _allowed_links(job, cluster: Cluster) -> tuple[str, ...] | None:
    """The links a job could have crossed; None when its partition is not in the cluster model (not checked)."""
    if not job.max_gpus:
        return FALLBACK_LINKS
    try:
        part = cluster.partition(job.partition) if job.partition else None
    except NotFoundError:
        part = None
    return None if part is None else (part.intra_link, part.inter_link) + FALLBACK_LINKS


def _check_links(record: dict, where: str, job, allowed: tuple[str, ...] | None) -> None:
    if allowed is None:
        return
    for key in ("link", "intra_link", "inter_link"):
        link = record.get(key)
        if link is not None and link not in allowed:
            raise RecordMismatch(f"{where}.{key}", f"link {link!r}: job {job.job_id} could only have crossed "
                                                   f"{', '.join(allowed)}")


def _check_time(record: dict, where: str, job, now: float, slack: timedelta) -> None:
    if "timestamp_s" not in record:
        return
    when, pad = record["timestamp_s"], slack.total_seconds()
    start = job.started_at_s
    end = job.ended_at_s if job.ended_at_s is not None else now
    if start is None or not start - pad <= when <= end + pad:
        window = f"{start:.0f}..{end:.0f}" if start is not None else "none (not started)"
        raise RecordMismatch(f"{where}.timestamp_s", f"{when:.0f} is outside job {job.job_id}'s run window "
                                                     f"{window} (+-{pad:.0f} s)")


def run_seconds(job, now: float, slack: timedelta = SLACK) -> float:
    """How many seconds of steps a job's rows may claim: from its start to its end (now while it runs), plus
    ``slack``; 0 for a job that has not started."""
    if job.started_at_s is None:
        return 0.0
    end = job.ended_at_s if job.ended_at_s is not None else now
    return max(0.0, end - job.started_at_s) + slack.total_seconds()


def check_records(records: Sequence[dict], job, cluster: Cluster, now: float, field: str = "observations",
                  slack: timedelta = SLACK) -> None:
    """Check validated records (`slurm_plugin.contracts.records.validate_batch`) against their job's Slurm facts.

    Args:
        job: the signed job's `slurm_plugin.client.JobOwner`.
        cluster: the service's cluster model (a partition's GPU type and node size).
        now: Unix time (the end of a running job's window).

    A record whose GPU is `unknown` (a launcher started without `#ELASTIC gpu_type=`) gets the job's GPU type
    as Slurm and the cluster model give it, in place; it is refused only where that is unknown too.

    Raises:
        RecordMismatch: the first record that does not fit, naming e.g. `observations[3].layout`.
    """
    allowed = _allowed_links(job, cluster)
    for index, record in enumerate(records):
        where = f"{field}[{index}]"
        _check_gpu(record, where, job, cluster)
        _check_links(record, where, job, allowed)
        if record["kind"] == "step":
            _check_layout(record["layout"], where, job, cluster)
        elif record["kind"] != "restart":   # a restart's sizes count the helper jobs' nodes too: not this job's
            _check_collective(record, where, job)   # a ddp_overhead row: its world
        _check_time(record, where, job, now, slack)
