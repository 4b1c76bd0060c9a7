"""Worker processes: one `srun` step per node, one task per GPU slot, tracked by the controller.

A node's workers are one srun step (`srun --overlap -N1 -n<slots> -w <node> CMD`), so that a node can be
ended, waited for and accounted for as a unit: a shrink ends the leaving node's step after its ranks left
at a commit point, and a step that ends while its node is still a member is a failure of that node.
The step runs inside whichever allocation owns the node (the main job, or a grow helper job): the
environment given to `start` decides that (srun trusts SLURM_JOB_ID / SLURM_NODELIST / SLURM_NNODES).

Each task gets its slot from Slurm (SLURM_LOCALID) plus the launcher's variables (`worker_env`): the
rendezvous store address, the job id, the node and a unique group id per step, which the runtime uses to
name the worker.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from elastic_launcher import store_keys as keys

log = logging.getLogger("elastic_launcher.workers")

# start_step(env, node, ntasks, argv, stdout_path) -> Popen of `srun ...` (slurm_plugin.client owns srun).
StepStarter = Callable[[Mapping[str, str], str, int, Sequence[str], Path], subprocess.Popen]


def worker_env(store_addr: str, job_id: str, node: str, group: str, slots: int) -> dict[str, str]:
    """The launcher's variables for the workers of one step (the runtime reads them at its entry point)."""
    return {
        "ELASTIC_STORE_ADDR": store_addr,
        "ELASTIC_JOB_ID": str(job_id),
        "ELASTIC_NODE": node,
        "ELASTIC_GROUP": group,
        "ELASTIC_SLOTS": str(slots),
    }


# The worker-id rule, owned here alone: a node's step in an allocation is `j<owner job>-<node>-g<n>`
# (step_group) and its workers are `<group>-<slot>` (worker_id), so every worker of a node in an allocation starts
# with node_prefix(owner, node) and its slot is worker_slot(wid).
def step_group(owner_job: str, node: str, generation: int) -> str:
    """Id of the `generation`-th step started by one pool, on `node` inside allocation `owner_job`."""
    return f"{node_prefix(owner_job, node)}g{generation}"


def node_prefix(owner_job: str, node: str) -> str:
    """What the id of every worker on `node` inside allocation `owner_job` starts with (whichever pool started it)."""
    return f"j{owner_job}-{node}-"


def step_prefix(group: str) -> str:
    """What the id of every worker of step `group` starts with."""
    return f"{group}-"


def worker_id(group: str, slot: int) -> str:
    """Id of the worker in `slot` (SLURM_LOCALID) of step `group`; unique in the job, no '/'."""
    return f"{step_prefix(group)}{slot}"


def worker_slot(wid: str) -> int:
    """The slot (SLURM_LOCALID) of a worker id built by :func:`worker_id`.

    Raises:
        ValueError: `wid` does not end in `-<slot>`.
    """
    return int(wid.rsplit("-", 1)[1])


def worker_identity(environ: Mapping[str, str]) -> tuple[str, str]:
    """`(worker id, store address)` of a worker started by this module, from its environment.

    For the training process's entry point (the runtime), which alone reads its environment.

    Raises:
        KeyError: not started by elastic-launch (ELASTIC_GROUP / ELASTIC_STORE_ADDR / SLURM_LOCALID missing).
    """
    return worker_id(environ["ELASTIC_GROUP"], int(environ["SLURM_LOCALID"])), environ["ELASTIC_STORE_ADDR"]


@dataclasses.dataclass
class WorkerStep:
    """One node's workers: an srun process and what it was started for.

    Attributes:
        node: the node the step runs on.
        group: unique id of this step (`j<job>-<node>-g<n>`); worker ids are `<group>-<slot>`.
        owner_job: id of the allocation the step runs in (main job or helper job).
        slots: tasks in the step.
        proc: the srun process.
        started_at: `time.monotonic()` at start.
        leaving: set once the controller asked its ranks to leave (its end is then expected).
    """

    node: str
    group: str
    owner_job: str
    slots: int
    proc: subprocess.Popen
    started_at: float
    leaving: bool = False

    def returncode(self) -> Optional[int]:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerPool:
    """Starts, tracks and stops the per-node worker steps.

    Args:
        command: the worker command (`python train.py ...`).
        store_addr: `host:port` of the rendezvous store.
        job_id: the main job's id (workers of helper jobs join the same job).
        start_step: how to start an srun step (slurm_plugin.client's `start_step`).
        log_dir: where each step's output goes (`worker-<group>.log`).
        stop_timeout: wait for a step to end after SIGTERM before SIGKILL.
    """

    def __init__(self, command: Sequence[str], store_addr: str, job_id: str, start_step: StepStarter,
                 log_dir: Path, stop_timeout: timedelta = timedelta(seconds=10)):
        self.command = tuple(command)
        self.store_addr = store_addr
        self.job_id = str(job_id)
        self.start_step = start_step
        self.log_dir = Path(log_dir)
        self.stop_timeout = stop_timeout
        self.steps: dict[str, WorkerStep] = {}
        # node -> extra variables of its workers (gpu_speeds.JobTypes.env: ELASTIC_GPU_TYPE, ELASTIC_SPEED)
        self.node_env: dict[str, dict[str, str]] = {}
        self.job_env: dict[str, str] = {}  # every worker's (launch_config.Directives.worker_env)
        self._generation = 0

    def start(self, node: str, slots: int, alloc_env: Mapping[str, str], owner_job: str) -> WorkerStep:
        """Start `slots` workers on `node` inside the allocation whose Slurm env is `alloc_env`.

        Raises:
            ValueError: the node already has a running step.
            slurm_plugin.errors.SlurmError: srun could not be started.
        """
        if node in self.steps and self.steps[node].alive():
            raise ValueError(f"WorkerPool.start: node {node} already runs step {self.steps[node].group}")
        self._generation += 1
        group = step_group(owner_job, node, self._generation)
        env = dict(alloc_env)
        env.update(worker_env(self.store_addr, self.job_id, node, group, slots))
        env.update(self.job_env)
        env.update(self.node_env.get(node, {}))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = self.start_step(env, node, slots, self.command, self.log_dir / f"worker-{group}.log")
        step = WorkerStep(node, group, str(owner_job), slots, proc, time.monotonic())
        self.steps[node] = step
        log.info("started %d workers on %s (group %s, job %s, pid %d)", slots, node, group, owner_job, proc.pid)
        return step

    def running(self) -> list[WorkerStep]:
        return [s for s in self.steps.values() if s.alive()]

    def ended(self) -> list[WorkerStep]:
        """Steps that have ended and are still tracked (the caller decides and then `forget`s them)."""
        return [s for s in self.steps.values() if not s.alive()]

    def forget(self, node: str) -> Optional[WorkerStep]:
        return self.steps.pop(node, None)

    def wait_ended(self, nodes: Sequence[str], timeout: timedelta) -> list[str]:
        """Wait until the steps on `nodes` ended; return the nodes still running after `timeout`."""
        deadline = time.monotonic() + timeout.total_seconds()
        pending = [n for n in nodes if n in self.steps]
        while pending and time.monotonic() < deadline:
            pending = [n for n in pending if self.steps[n].alive()]
            if pending:
                time.sleep(0.05)
        return [n for n in pending if self.steps[n].alive()]

    def signal_step(self, node: str, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to a node's step (srun forwards it to the tasks) without waiting; nothing when it ended."""
        step = self.steps.get(node)
        if step is not None and step.alive():
            step.proc.send_signal(sig)

    def stop(self, node: str, timeout: Optional[timedelta] = None) -> Optional[int]:
        """End a node's step: SIGTERM to srun (forwarded to the tasks), SIGKILL after the timeout.

        Returns the step's exit status, None when the node had no step.
        """
        step = self.steps.get(node)
        if step is None:
            return None
        if step.alive():
            step.proc.send_signal(signal.SIGTERM)
            try:
                step.proc.wait((timeout or self.stop_timeout).total_seconds())
            except subprocess.TimeoutExpired:
                log.warning("step %s on %s ignored SIGTERM; killing srun", step.group, node)
                step.proc.kill()
                step.proc.wait()
        return step.proc.returncode

    def stop_all(self, timeout: Optional[timedelta] = None) -> None:
        for node in list(self.steps):
            self.stop(node, timeout)


class ProgressReporter:
    """Worker side of the launcher's progress channel: one small JSON key per worker.

    The controller measures throughput (samples/s between two reports of one worker) and per-node compute
    time (straggler detection) from these keys. `ElasticTrainer(progress=...)` calls `report` at every commit
    point (with the steps since the last one) and `publish` with its telemetry's observation records (which the
    controller relabels with the layout and links and posts to the predictor; see observations.py).

    Args:
        store: a client of the job's store (no prefix; keys `store_keys.progress(wid)` and `observations(wid)`).
        wid: this worker's id (`worker_identity`).
        node: this worker's node.
    """

    def __init__(self, store, wid: str, node: str, history: int = 8):
        self.store = store
        self.wid = wid
        self.node = node
        self.history = history
        self._progress_key, self._observations_key = keys.progress(wid), keys.observations(wid)  # built once
        self.compute_total_s = 0.0
        self.steps = 0
        self.recent: list[tuple[int, int, float]] = []

    def report(self, epoch: int, step: int, samples: int, compute_s: float, steps: int = 1) -> None:
        """Publish progress at a commit point.

        Args:
            epoch: membership epoch (plan id) the worker is in after the commit.
            step: global committed step count.
            samples: global committed sample count (all ranks).
            compute_s: this worker's local compute time in the ``steps`` steps since its last report
                (forward/backward without waiting for peers); slow hardware shows here, while the synchronous
                step time is the same everywhere.
            steps: steps this report covers (commit points come every few steps).
        """
        now = time.time()
        self.compute_total_s += compute_s
        self.steps += steps
        self.recent = (self.recent + [(epoch, step, now)])[-self.history:]
        self.store.set(self._progress_key, json.dumps(
            {"epoch": epoch, "step": step, "samples": samples, "t": now, "node": self.node,
             "compute_total_s": self.compute_total_s, "steps": self.steps, "recent": self.recent}))

    def publish(self, records: list) -> None:
        """Hand observation records to the controller (appended as one JSON line; it reads what is new)."""
        self.store.append(self._observations_key, json.dumps(records) + "\n")

    def publish_host(self, facts_json: str) -> None:
        """Tell the controller what this worker's host offers (``links.HostFacts.to_json``), once at start."""
        self.store.set(keys.hosts(self.wid), facts_json)

    def publish_total(self, steps: int) -> None:
        """Tell the controller how many steps the script trains (its progress lines and ``ctl --status`` show the
        step out of this and an ETA)."""
        self.store.set(keys.TOTAL_STEPS, str(int(steps)))

    def publish_profile(self, body: dict) -> None:
        """Tell the controller the shapes of the model this worker built (``contracts.profiles.profile_body``), once
        at start: the launcher registers it with the predictor when the service does not know the model yet."""
        self.store.set(keys.MODEL_PROFILE, json.dumps(body))


def transition_idle_s(recent: list, epoch: int) -> tuple[Optional[float], Optional[float]]:
    """`(idle, step)`: idle time of the switch into `epoch` and the normal step time, from one survivor's
    recent (epoch, step, t) reports.

    Reports come at commit points, every few steps. The report that crosses into `epoch` follows the one
    before it by its steps plus the transition; the median per-step time between other consecutive reports
    is one step. Idle is clamped at 0 (step-time jitter can exceed a very short switch). (None, None) when
    the boundary is not in `recent`.
    """
    gaps = [(b[2] - a[2], max(b[1] - a[1], 1), b[0] == epoch and a[0] != epoch) for a, b in zip(recent, recent[1:])]
    boundary = [(gap, n) for gap, n, crosses in gaps if crosses]
    normal = sorted(gap / n for gap, n, crosses in gaps if not crosses)
    if not boundary or not normal:
        return None, None
    step = normal[len(normal) // 2]
    gap, n = boundary[0]
    return max(0.0, gap - n * step), step

