"""The launcher's frozen configuration: CLI options + `#ELASTIC` directives + the Slurm allocation.

`elastic-launch` (elastic_launcher/cli.py) is the only place that reads the environment and the batch
script; it builds one `LaunchConfig` and hands it to the controller. Nothing below the CLI reads
`os.environ`. Timeouts are `timedelta`; each one covers exactly the wait named in its docstring.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Optional

from slurm_plugin.contracts.directives import parse_script

HELPER_COMMENT_PREFIX = "elastic-helper:"
HELPER_NAME_PREFIX = "elastic-helper-"
UNKNOWN_GPU = "unknown"  # the job named no GPU type (predictor/jobcheck.py fills it from Slurm)


def helper_comment(main_job_id: str) -> str:
    """Comment of a grow helper job; the job_submit hook skips jobs whose comment starts with the prefix."""
    return f"{HELPER_COMMENT_PREFIX}{main_job_id}"


def helper_name(main_job_id: str) -> str:
    return f"{HELPER_NAME_PREFIX}{main_job_id}"


@dataclasses.dataclass(frozen=True)
class Directives:
    """The `#ELASTIC` keys the launcher uses, with the launcher's defaults applied.

    Attributes:
        model: predictor profile name (None: the predictor cannot plan, heuristic only).
        per_gpu_batch: per-worker micro-batch, in samples.
        max_global_batch: upper limit on workers * per_gpu_batch when growing (Or et al.).
        gpus_min / gpus_max: bounds on the total worker count.
        min_efficiency: throughput scaling efficiency a grow must reach to be kept.
        objective: throughput | efficiency | cost (sent to /v1/plan).
        elastic: False: never resize at run time (`elastic=off`).
        gpu_type: GPU type reported in observations.
        mode: `inprocess` (ElasticTrainer resizes in the running processes) or `restart` (torchrun's agent restarts
            the unchanged script at each resize, restart.py).
        raw_lines: the directive lines verbatim, as /v1/plan wants them.
        given: the keys the script's lines set (the others are the launcher's defaults).
    """

    model: Optional[str] = None
    per_gpu_batch: int = 32
    max_global_batch: int = 1 << 24
    gpus_min: int = 1
    gpus_max: int = 4096
    min_efficiency: float = 0.7
    objective: str = "throughput"
    elastic: bool = True
    gpu_type: str = UNKNOWN_GPU
    mode: str = "inprocess"
    raw_lines: tuple[str, ...] = ()
    given: frozenset = frozenset()

    def worker_env(self) -> dict[str, str]:
        """What the workers get of the directives (#26.2: one owner for the batch a job runs with): the per-GPU
        batch and the global batch cap the script's lines set; the training script takes them as its defaults and
        refuses a different value of its own (`examples.common.WorkerEnv`); and the profile `model=` names, which
        the script's own profile must equal (#42: rows are labelled with the model that ran)."""
        out = {}
        if self.model is not None:
            out["ELASTIC_MODEL"] = self.model
        if "per_gpu_batch" in self.given:
            out["ELASTIC_PER_GPU_BATCH"] = str(self.per_gpu_batch)
        if "max_global_batch" in self.given:
            out["ELASTIC_MAX_GLOBAL_BATCH"] = str(self.max_global_batch)
        return out

    @classmethod
    def from_script(cls, script: str) -> "Directives":
        """Parse a batch script's directives; a script without any gives the defaults.

        Raises:
            slurm_plugin.errors.DirectiveError: a malformed `#ELASTIC` line.
        """
        parsed = parse_script(script) or {}
        raw = tuple(line for line in script.splitlines() if line.startswith("#ELASTIC"))
        return cls.from_mapping(parsed, raw)

    @classmethod
    def from_mapping(cls, parsed: Mapping[str, Any], raw_lines: tuple[str, ...] = ()) -> "Directives":
        gpus = parsed.get("gpus") or {}
        kwargs: dict[str, Any] = {"raw_lines": tuple(raw_lines), "given": frozenset(parsed)}
        for key in ("model", "per_gpu_batch", "max_global_batch", "min_efficiency", "objective", "gpu_type", "mode"):
            if key in parsed:
                kwargs[key] = parsed[key]
        if gpus:
            kwargs["gpus_min"], kwargs["gpus_max"] = gpus["min"], gpus["max"]
        if "elastic" in parsed:
            kwargs["elastic"] = parsed["elastic"] == "on"
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The Slurm allocation the controller runs in, as read once at the entry point.

    Attributes:
        job_id: the main job's id.
        nodes: node names of the allocation, batch host first.
        batch_host: the node running the batch step (cannot be released by a shrink).
        gpus_per_node: GPU slots per node (1 when the job asked for none).
        partition: partition of the job (helpers are submitted there).
        env: the Slurm variables `srun` reads; refreshed after every shrink.
    """

    job_id: str
    nodes: tuple[str, ...]
    batch_host: str
    gpus_per_node: int = 1
    partition: Optional[str] = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def with_nodes(self, nodes: tuple[str, ...], env: Mapping[str, str]) -> "Allocation":
        return dataclasses.replace(self, nodes=tuple(nodes), env=dict(env))


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything the controller needs, fixed for the life of the job.

    Attributes:
        command: the worker command (`python train.py ...`).
        allocation: the Slurm allocation at start.
        directives: the job's `#ELASTIC` directives with defaults.
        workers_per_node: workers started per node (default: one per GPU slot).
        predictor_url: base URL of the predictor service; None: heuristic only.
        predictor_token: bearer token for POST /v1/observations.
        munge_socket: munged's socket the job signs its posts with (`ELASTIC_MUNGE_SOCKET`; None: munge's own
            default, e.g. `/run/munge/munge.socket.2`); the test lab exports its own.
        intra_link / inter_link: override the link labels of the observation records (within a node / between
            nodes, as the predictor names them, e.g. `nvlink` / `ib`); None: detected from what each worker
            reports about its host (`links.links_for`: `loopback` for gloo on one host, as on the testbed).
        run_dir: where the controller writes `controller.json` (its address) and `records.jsonl`.
        store_host / store_port: address the rendezvous TCPStore binds (port 0: any free port).
        grow_step_nodes: nodes added per grow step (one helper job each).
        measure_steps: committed steps averaged for one throughput measurement.
        warmup_steps: committed steps ignored after a resize before measuring.
        autoscale: False: resize only on operator requests and failures.
        yield_to_pending: hand nodes above the job's minimum back to a job of the partition pending for them
            (and grow no further while one waits); `elastic-launch --no-yield` turns it off.
        straggler_ratio: a node whose mean step time is this many times the median is slow.
        straggler_windows: consecutive slow measurement windows before a node is shrunk away.
        max_failures: failed resizes or worker losses in a row before the controller gives up.
        poll_interval: period of the controller loop.
        rendezvous_timeout: wait for started workers to join and a new membership to form.
        leave_timeout: wait for leaving ranks' srun steps to end after they left at a commit point.
        store_timeout: each TCPStore get/set/connect.
        slurm_timeout: each Slurm command (through slurm_plugin.client).
        http_timeout: each predictor request.
        helper_start_timeout: wait for a submitted helper job to start running (then cancel it).
        helper_orphan_timeout: a helper agent that cannot reach the controller this long exits.
        restart: run the script under torchrun's agent and resize by restarting it (`--restart` or
            `#ELASTIC mode=restart`; restart.py).
        checkpoint_dir: restart mode: the script's checkpoint directory; a planned resize waits for an entry newer
            than its SIGUSR1 (None: the whole `checkpoint_timeout`).
        checkpoint_timeout: restart mode: after SIGUSR1, the wait for the script's checkpoint (the grace period).
        rendezvous_last_call: restart mode: torchrun's wait for more nodes once the minimum joined a round.
        max_restarts: restart mode: torchrun's restarts after worker failures (a shrink is one) before it gives up.
        end_time: the job's end (Unix seconds, SLURM_JOB_END_TIME where Slurm exports it), for the time it has left;
            None: restart mode asks Slurm (squeue's end_time).
    """

    command: tuple[str, ...]
    allocation: Allocation
    directives: Directives = Directives()
    workers_per_node: Optional[int] = None
    predictor_url: Optional[str] = None
    predictor_token: Optional[str] = None
    munge_socket: Optional[str] = None
    intra_link: Optional[str] = None
    inter_link: Optional[str] = None
    run_dir: Path = Path(".")
    store_host: str = "127.0.0.1"
    store_port: int = 0
    grow_step_nodes: int = 2
    measure_steps: int = 8
    warmup_steps: int = 2
    autoscale: bool = True
    yield_to_pending: bool = True
    straggler_ratio: float = 1.5
    straggler_windows: int = 3
    max_failures: int = 3
    poll_interval: timedelta = timedelta(seconds=0.2)
    rendezvous_timeout: timedelta = timedelta(seconds=120)
    leave_timeout: timedelta = timedelta(seconds=20)
    store_timeout: timedelta = timedelta(seconds=30)
    slurm_timeout: timedelta = timedelta(seconds=20)
    http_timeout: timedelta = timedelta(seconds=2)
    helper_start_timeout: timedelta = timedelta(seconds=60)
    helper_orphan_timeout: timedelta = timedelta(seconds=30)
    restart: bool = False
    checkpoint_dir: Optional[Path] = None
    checkpoint_timeout: timedelta = timedelta(seconds=60)
    rendezvous_last_call: timedelta = timedelta(seconds=3)
    max_restarts: int = 100
    end_time: Optional[float] = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("LaunchConfig.command: no worker command given (elastic-launch [options] -- CMD ...)")
        if self.workers_per_node is not None and self.workers_per_node < 1:
            raise ValueError(f"LaunchConfig.workers_per_node: must be >= 1, got {self.workers_per_node}")
        if self.grow_step_nodes < 1:
            raise ValueError(f"LaunchConfig.grow_step_nodes: must be >= 1, got {self.grow_step_nodes}")

    @property
    def slots_per_node(self) -> int:
        """Workers per node actually started."""
        return self.workers_per_node or max(1, self.allocation.gpus_per_node)

    def to_json(self) -> str:
        """A JSON summary (for the records log, which the job's `.out` file and `records.jsonl` show): secrets are
        left out (``predictor_token`` says only whether one is set)."""
        def convert(value: Any) -> Any:
            if isinstance(value, timedelta):
                return value.total_seconds()
            if isinstance(value, Path):
                return str(value)
            if isinstance(value, (set, frozenset)):
                return sorted(value)   # a JSON list, not a Python repr (#45.6)
            return value
        data = dataclasses.asdict(self)
        flat = {key: convert(val) for key, val in data.items() if key not in ("allocation", "directives")}
        flat["predictor_token"] = "(set)" if self.predictor_token else None
        flat["allocation"] = {k: convert(v) for k, v in data["allocation"].items() if k != "env"}
        flat["directives"] = {k: convert(v) for k, v in data["directives"].items()}
        return json.dumps(flat, sort_keys=True)
