"""The API a training script adopts: :class:`ElasticTrainer`.

Typical use (the entry point builds ``store_addr`` and ``worker_id`` from what the launcher passes)::

    et = ElasticTrainer(model, optimizer, store_addr=addr, worker_id=wid, policy=BatchPolicy(per_gpu_batch=64),
                        warm_up=one_local_step).join()  # warm_up optional: first-use costs paid before joining
    for x, y in et.loader(dataset, num_workers=4, pin_memory=True):  # torch's DataLoader options
        loss = loss_fn(et.model(x), y)       # et.model is the current DDP wrapper: re-read it every step
        et.watch_loss(loss)                  # optional: a non-finite loss rolls back at the next commit point
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
        et.commit()                          # once per batch; membership changes happen here
    et.close()

The constructor only stores and checks its arguments (no store, no thread, no group): a trainer can be built and
inspected (``config``, ``phase``) without a job. :meth:`ElasticTrainer.join` connects, warms up, announces the
worker, waits for a plan that includes it and builds that plan's group; the training API needs it first.

Contracts the script must keep: do not hold on to ``et.model``, rank or world size across steps (they change at
commit points); call :meth:`ElasticTrainer.commit` exactly once per batch the loader yields; the loss is the
*mean over the local batch* (the communication hook weights ranks by their share of the global batch).

Commit points (at steps every rank agreed on: :mod:`elastic_launcher.commit_schedule`) run one tiny allreduce
vote on the current group carrying (ready-for-next-epoch, collective ok, local ok, count, proposed interval),
broadcast the floating-point buffers and take the in-memory snapshot that is the rollback point. Between
commit points a step queues its device work and returns: no host synchronisation, no store access. At a commit
point, all ranks together: a failed collective -> recovery
(abort, agree on survivors through the store, build a fresh group, roll back to the last in-memory commit,
re-sync from rank 0); a local error -> roll back and retry (at most ``max_retries`` in a row); everyone ready for
the posted next plan -> switch. Newcomers and survivors build the next group in the background while training
goes on, so the switch costs: abort of the old group, the state broadcast to newcomers (none on a shrink), a
DDP re-wrap on the new group (no init sync), and the first step. The epoch changes themselves are decided by
pure functions (:mod:`elastic_launcher.epoch_decisions`) and executed apart (:mod:`elastic_launcher.epochs`).
"""
from __future__ import annotations

import json
import logging
import math
import numbers
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_launcher import store_keys as keys
from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.commit_schedule import CommitSchedule
from elastic_launcher.epoch_decisions import CommitAction, CommitOutcome, Phase, VoteTally, decide_commit
from elastic_launcher.epochs import Epoch, EpochExecutor, ExecutorSettings, NextEpoch, PeerFailureRelay, SwitchLog
from elastic_launcher.errors import (LeftGroup, ProcessGroupError, StateMismatch, StoreAddressError,
                                     TooManyFailures, TrainerPhaseError)
from elastic_launcher.links import HostFacts
from elastic_launcher.loading import Basis, Pipeline
from elastic_launcher.membership import Membership, Plan
from elastic_launcher.process_group import (ProcessGroupWrapper, StoreAddr, abandon_retired, connect_store,
                                            drain_given_up_builds, drain_reaper)
from elastic_launcher.sampler import ElasticSampler
from elastic_launcher.state import TrainingState
from elastic_launcher.telemetry import HookState, Telemetry

logger = logging.getLogger("elastic_launcher.trainer")

__all__ = ["TrainerConfig", "ElasticTrainer", "VoteTally"]  # VoteTally: from epoch_decisions

WARM_UP_STEPS = 2  # local steps of ElasticTrainer(warm_up=...): the optimizer's first step and a later one


@dataclass(frozen=True)
class TrainerConfig:
    """Timeouts and knobs of :class:`ElasticTrainer` (all waits bounded).

    Attributes:
        backend: ``gloo`` or ``nccl``.
        timeout: per-collective timeout (a hung peer is detected within this).
        connect_timeout: building a group (store rendezvous + communicator).
        rendezvous_timeout: waiting for a plan, a recovery decision or the state skeleton.
        heartbeat_interval: heartbeat and next-plan polling period.
        heartbeat_timeout: silence after which a peer is declared dead during recovery; also how long this
            worker's own beat may go unwritten (store errors, retried with backoff) before it ends
            (:attr:`ElasticTrainer.end_reason`).
        arrival_timeout: a recovery's arrival deadline: a member that still beats but has not arrived this long
            after the recovery opened (hung outside a collective) is fenced out and the survivors go on. None:
            ``timeout`` + ``heartbeat_timeout`` (a survivor stuck in a collective with the hung member arrives once
            that collective times out, so it is never fenced by a shorter deadline).
        commit_every: batches between commit points (vote, buffer broadcast, rollback snapshot); None: chosen
            from measurements (``commit_period``, ``commit_overhead``), agreed in the vote.
        commit_period: auto mode: training time between commit points to aim at.
        commit_overhead: auto mode: the largest fraction of that time a commit point may cost.
        max_commit_every: upper bound on the batches between commit points: a failure (a dead peer, a local
            error) rolls back at most this many batches (auto mode: about ``commit_period`` of training).
        max_retries: consecutive failed commits tolerated before TooManyFailures.
        bucket_cap_mb: DDP bucket size.
        try_shrink: on failure, try the backend's communicator shrink before a fresh build.
        peer_watchdog: watch the epoch's peers from the heartbeat thread and abort the communicator when one
            stops beating for ``heartbeat_timeout`` (None: on for NCCL, whose collectives otherwise wait for a
            dead peer until ``timeout``; gloo's fail on their own when a peer's connection drops).
        seed: sampler seed.
        observations_every: committed steps between hand-offs of the telemetry's observation records to the
            progress hook (``progress.publish``), when both are given.
    """

    backend: str = "gloo"
    timeout: timedelta = timedelta(seconds=60)
    connect_timeout: timedelta = timedelta(seconds=120)
    rendezvous_timeout: timedelta = timedelta(seconds=180)
    heartbeat_interval: timedelta = timedelta(seconds=0.2)
    heartbeat_timeout: timedelta = timedelta(seconds=5)
    arrival_timeout: Optional[timedelta] = None
    commit_every: Optional[int] = None
    commit_period: timedelta = timedelta(seconds=0.5)
    commit_overhead: float = 0.01
    max_commit_every: int = 256
    max_retries: int = 3
    bucket_cap_mb: float = 25.0
    try_shrink: bool = True
    peer_watchdog: Optional[bool] = None
    seed: int = 0
    observations_every: int = 50

    def __post_init__(self) -> None:
        """Raises ValueError naming the field of a value the trainer cannot run with (#27: none was checked)."""
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"TrainerConfig.{field}={getattr(self, field)!r}: {why}")

        if self.backend not in ("gloo", "nccl"):
            raise bad("backend", "expected gloo or nccl")
        for field in ("timeout", "connect_timeout", "rendezvous_timeout", "heartbeat_interval", "heartbeat_timeout",
                      "commit_period"):
            value = getattr(self, field)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise bad(field, "expected a positive timedelta")
        if self.arrival_timeout is not None and (not isinstance(self.arrival_timeout, timedelta)
                                                 or self.arrival_timeout <= timedelta(0)):
            raise bad("arrival_timeout", "expected None or a positive timedelta")
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise bad("heartbeat_timeout", f"must exceed two heartbeat intervals ({self.heartbeat_interval}): a "
                                           "live peer would be declared dead between two beats")
        if self.commit_every is not None and self.commit_every < 1:
            raise bad("commit_every", "expected None (auto) or an integer >= 1")
        if not 0 < self.commit_overhead < 1:
            raise bad("commit_overhead", "expected a fraction in (0, 1)")
        for field, low in (("max_commit_every", 1), ("max_retries", 0), ("observations_every", 1)):
            if getattr(self, field) < low:
                raise bad(field, f"expected an integer >= {low}")
        if not self.bucket_cap_mb > 0:
            raise bad("bucket_cap_mb", "expected a positive size in MB")


def _check_args(model, optimizer, store_addr, worker_id, policy, scheduler, device, config, telemetry, speed, fault,
                progress, warm_up, extra_state) -> None:
    """The checks of :class:`ElasticTrainer`'s constructor: ``TypeError`` for a wrong kind of object, ``ValueError``
    (``StoreAddressError`` for ``store_addr``) for an unusable value; each message names the argument."""
    def bad(arg: str, why: str, value: Any = None, kind=ValueError) -> Exception:
        shown = f"={value!r}" if value is not None and not isinstance(value, torch.nn.Module) else ""
        return kind(f"ElasticTrainer({arg}{shown}): {why}")

    def has_methods(obj, *names: str) -> bool:
        return all(callable(getattr(obj, n, None)) for n in names)

    if not isinstance(model, torch.nn.Module):
        raise bad("model", f"expected a torch.nn.Module, got {type(model).__name__}", kind=TypeError)
    if not has_methods(optimizer, "step", "zero_grad", "state_dict", "load_state_dict"):
        raise bad("optimizer", f"expected a torch.optim.Optimizer (step, zero_grad, state_dict, load_state_dict), "
                               f"got {type(optimizer).__name__}", kind=TypeError)
    if isinstance(store_addr, str):
        try:
            StoreAddr.parse(store_addr)
        except StoreAddressError as e:
            raise StoreAddressError(f"ElasticTrainer(store_addr={store_addr!r}): expected host:port/prefix "
                                    f"(e.g. 127.0.0.1:29500/job)") from e
    elif not isinstance(store_addr, StoreAddr):
        raise bad("store_addr", f"expected a StoreAddr or a 'host:port/prefix' string, got "
                                f"{type(store_addr).__name__}", kind=TypeError)
    if not isinstance(worker_id, str) or not worker_id or "/" in worker_id or "," in worker_id:
        raise bad("worker_id", "expected a non-empty string without '/' or ','", worker_id,
                  kind=ValueError if isinstance(worker_id, str) else TypeError)
    if not isinstance(policy, BatchPolicy):
        raise bad("policy", f"expected a BatchPolicy, got {type(policy).__name__}", kind=TypeError)
    if scheduler is not None and not has_methods(scheduler, "state_dict", "load_state_dict"):
        raise bad("scheduler", f"expected None or an LR scheduler (state_dict, load_state_dict), got "
                               f"{type(scheduler).__name__}", kind=TypeError)
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise bad("device", f"not a torch device: {e}", device) from e
    elif next(iter(model.parameters()), None) is None:
        raise bad("model", "the model has no parameters (and no device= was given)")
    if not isinstance(config, TrainerConfig):
        raise bad("config", f"expected a TrainerConfig, got {type(config).__name__}", kind=TypeError)
    if telemetry is not None and not isinstance(telemetry, Telemetry):
        raise bad("telemetry", f"expected None or a Telemetry, got {type(telemetry).__name__}", kind=TypeError)
    if isinstance(speed, bool) or not isinstance(speed, numbers.Real):
        raise bad("speed", f"expected a positive number, got {type(speed).__name__}", speed, kind=TypeError)
    if not (math.isfinite(speed) and speed > 0):
        raise bad("speed", "expected a finite number > 0 (relative samples/s of this worker)", speed)
    if fault is not None and not has_methods(fault, "maybe_fail"):
        raise bad("fault", f"expected None or an object with a callable maybe_fail(rank, step), got "
                           f"{type(fault).__name__}", kind=TypeError)
    if progress is not None:
        if not has_methods(progress, "report"):
            raise bad("progress", f"expected None or an object with a callable report(epoch, step, samples, "
                                  f"compute_s, steps=...), got {type(progress).__name__}", kind=TypeError)
        for hook in ("publish", "publish_host"):
            if getattr(progress, hook, None) is not None and not has_methods(progress, hook):
                raise bad("progress", f"its {hook} is not callable", kind=TypeError)
    if warm_up is not None and not callable(warm_up):
        raise bad("warm_up", f"expected None or a callable warm_up(model), got {type(warm_up).__name__}",
                  kind=TypeError)
    if extra_state is not None:
        if not isinstance(extra_state, dict):
            raise bad("extra_state", f"expected None or a dict name -> object, got {type(extra_state).__name__}",
                      kind=TypeError)
        for name, obj in extra_state.items():
            if not isinstance(name, str) or not has_methods(obj, "state_dict", "load_state_dict"):
                raise bad("extra_state", f"entry {name!r}: expected a str name -> an object with state_dict and "
                                         f"load_state_dict, got {type(obj).__name__}", kind=TypeError)


class ElasticTrainer:
    """Elastic data-parallel training inside the current process.

    Args:
        model: the bare module, already on ``device``.
        optimizer: its optimizer.
        store_addr: the controller's TCPStore (``StoreAddr`` or ``host:port/prefix``).
        worker_id: unique id of this worker in the job.
        policy: batch/LR policy.
        scheduler: LR scheduler (optional).
        device: device of the model (default: the first parameter's).
        config: timeouts and knobs.
        telemetry: timing collector (optional).
        speed: relative samples/s of this worker (a finite number > 0), for heterogeneous splits (see ``BatchPolicy``).
        fault: test seam with ``maybe_fail(rank, step)`` (see :mod:`elastic_launcher.testing`).
        progress: optional hook called after every committed step with
            ``report(epoch, step, samples, compute_s)`` (e.g. ``workers.ProgressReporter``, which elastic-launch
            reads for throughput and stragglers); if it has ``publish(records)``, the telemetry's observation
            records go there every ``observations_every`` committed steps and at ``close``.
        warm_up: optional ``warm_up(model)`` running one local training step on a representative batch with the
            bare model given (no collectives): forward, backward, ``optimizer.step()``, ``optimizer.zero_grad()``.
            :meth:`join` runs it ``WARM_UP_STEPS`` times before this worker announces itself (so before it
            joins a plan's rendezvous), then puts model and optimizer state back (``warm_up_s`` says how long it
            took). CUDA loads a kernel the first time it runs: a newcomer whose first optimizer step is its first ever pays for that inside the
            first step at the new size, and every rank waits (ResNet-50 on 2x H100: 30 ms against 2.4 ms steady;
            bench/results/gpu_transition.md). Two steps take both optimizer paths (creating its state, then
            updating it). Running before the announcement keeps it off the survivors' critical path, and a step
            that raises fails :meth:`join` before anyone counts on this worker. Model, optimizer and scheduler
            state are put back and every gradient of the model is cleared; what else the step changes (random
            number streams, buffers outside ``state_dict``) stays changed.
        extra_state: name -> object with ``state_dict``/``load_state_dict`` and small plain state that every rank
            must hold alike, e.g. ``{"scaler": torch.amp.GradScaler()}`` for fp16: it is rolled back with the
            model, put back after ``warm_up`` and sent to newcomers.

    The constructor stores the arguments and checks them (``ValueError`` / ``TypeError`` naming the argument); it
    connects to nothing and starts nothing, and the trainer is in phase ``CREATED``. :meth:`join` connects to the
    store, (warms up,) announces the worker, waits for a plan that includes it and builds that plan's group (the
    slow part: newcomers do it while the survivors keep training); it returns the trainer, so
    ``et = ElasticTrainer(...).join()``. State is synchronised when the loader starts. Calling the training API
    (``loader``, ``commit``, ``model``, ``rank``, ``world_size``, ``watch_loss``, ``report_error``) before
    ``join()`` returned raises :class:`~elastic_launcher.errors.TrainerPhaseError`. Epoch changes are decided by
    the pure ``decide_*`` functions of :mod:`elastic_launcher.epoch_decisions` and applied by
    :class:`~elastic_launcher.epochs.EpochExecutor`; this class adopts what the executor hands back.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, store_addr,
                 worker_id: str, policy: BatchPolicy, scheduler=None, device: Optional[torch.device] = None,
                 config: TrainerConfig = TrainerConfig(), telemetry: Optional[Telemetry] = None,
                 speed: float = 1.0, fault=None, progress=None,
                 warm_up: Optional[Callable[[torch.nn.Module], Any]] = None,
                 extra_state: Optional[dict] = None) -> None:
        _check_args(model, optimizer, store_addr, worker_id, policy, scheduler, device, config, telemetry, speed,
                    fault, progress, warm_up, extra_state)
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.policy = policy
        self.config = config
        self.telemetry = telemetry
        self.wid = worker_id
        self.speed = float(speed)
        self.fault = fault
        self.progress = progress
        self._warm_up_fn = warm_up
        self.addr = StoreAddr.parse(store_addr) if isinstance(store_addr, str) else store_addr
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.state = TrainingState(model, optimizer, scheduler, None, self.device, extra_state)
        self.state.counters.update(lr_factor=1.0, ref_global=0)
        self.phase = Phase.CREATED
        self.warm_up_s = 0.0
        self.loader_warm_s = 0.0  # join(): waiting for the prepared loader's first batch after warm_up
        self._prepared = False  # prepare_loader() was called: the pipeline's workers start in join()
        self._join_times: dict = {}  # join()'s phases, for the join record (join_s)
        # built by join(): the store connections, the heartbeat thread (membership) and the executor
        self._store: Optional[dist.Store] = None
        self.membership: Optional[Membership] = None
        self._relay = PeerFailureRelay()
        self._executor: Optional[EpochExecutor] = None
        self._next_epoch: Optional[NextEpoch] = None
        self._switch_log = SwitchLog(worker_id, self.device)
        self.sampler: Optional[ElasticSampler] = None
        self._pipeline: Optional[Pipeline] = None  # the DataLoader of the last loader() call
        self._forecast: Optional[Basis] = None  # the next epoch's (armed, or being joined) rank and batches
        self._switch_at: Optional[int] = None  # the commit point an ARM set for the switch
        # the current epoch (what EpochExecutor hands back), flat: the step reads these; None until join() returned
        self.plan: Optional[Plan] = None
        self.group: Optional[ProcessGroupWrapper] = None
        self.ddp: Optional[DDP] = None
        self._hook: Optional[HookState] = None
        self.batches: list[int] = []
        self.batch_indices: list[int] = []
        self.failures = 0
        self.end_reason: Optional[str] = None  # why this worker ended on its own (its heartbeat could not be written)
        self._local_error: Optional[BaseException] = None
        self._nonfinite: Optional[torch.Tensor] = None  # device flag of watch_loss, read by the next vote
        self._last_commit_t = time.perf_counter()
        self._batch_t = self._last_commit_t
        self.schedule = CommitSchedule(config.commit_every, config.commit_period.total_seconds(),
                                       config.commit_overhead, config.max_commit_every)
        self.committed_step = 0  # the step of the last commit point (the rollback point)
        self.epoch_start_step = 0  # the step the current epoch began at (the same on every rank of its plan)
        self._uncommitted = (0, 0.0)  # (steps, compute seconds) since the last commit point, for the progress hook

    # ---- joining --------------------------------------------------------------------------------------------
    def join(self) -> "ElasticTrainer":
        """Joins the job: connects to the store, runs ``warm_up`` (if given), publishes the host's links and this
        worker's speed, announces the worker (starts the heartbeat thread), waits for a plan that includes it and
        builds that plan's group. Returns the trainer (phase ``JOINING``: the loader receives the state).

        Raises:
            TrainerPhaseError: ``join()`` was called before (it returned, is under way, or failed).
            ProcessGroupError: the store cannot be reached within ``connect_timeout``, or the group not built.
            RendezvousTimeout: no plan that includes this worker within ``rendezvous_timeout``.
            Whatever ``warm_up`` raises.

        A join that raises leaves nothing running (no heartbeat thread, no group) and the trainer in phase
        ``FAILED``: build a new one to try again (the worker may have been announced already).
        """
        if self.phase is not Phase.CREATED:
            raise TrainerPhaseError(f"ElasticTrainer.join(): worker {self.wid} is {self.phase.value}; join() is "
                                    "called once, on a new trainer" +
                                    ("" if self.phase is not Phase.FAILED else " (the last join failed: build a "
                                     "new ElasticTrainer)"), self.phase)
        self.phase = Phase.JOINING
        try:
            self._join()
        except BaseException:
            self.phase = Phase.FAILED
            if self._pipeline is not None:  # prepare_loader()'s workers
                self._pipeline.close()
            if self.membership is not None:
                self.membership.stop()  # no plan or no group: leave no heartbeat behind
            raise
        return self

    def _join(self) -> None:
        config, wid = self.config, self.wid
        self._store = connect_store(self.addr.with_prefix(keys.state_channel(self.addr.prefix)),
                                    config.connect_timeout)
        # before the worker announces itself: the launcher counts an announced worker as ready to join a plan
        pipe = self._pipeline if self._prepared else None
        if pipe is not None:  # prepare_loader(): the workers start (processes, pin-memory thread) during warm_up
            self._forecast = Basis(0, tuple(self.policy.split(1)))  # a guess: redirected once the plan is known
            pipe.start(0, self.sampler.epoch, self.sampler.pos)
        if self._warm_up_fn is not None:
            self.warm_up_s = self._warm_up(self._warm_up_fn)
        if pipe is not None:
            self.loader_warm_s = pipe.warm(0, self.sampler.epoch, self.sampler.pos)  # a batch has come through
        publish_host = getattr(self.progress, "publish_host", None)
        if publish_host is not None:  # the launcher labels this worker's records with the links it really uses
            gpu = self.device.index if self.device.type == "cuda" else None
            name = torch.cuda.get_device_name(self.device) if gpu is not None else None
            publish_host(HostFacts.probe(config.backend, gpu, gpu_name=name).to_json())
        watchdog = config.peer_watchdog if config.peer_watchdog is not None else config.backend == "nccl"
        self.membership = Membership(lambda: connect_store(self.addr, config.connect_timeout), wid,
                                     config.rendezvous_timeout, config.heartbeat_interval, config.heartbeat_timeout,
                                     on_peer_failure=self._relay if watchdog else None,
                                     on_recovery=getattr(self.fault, "on_recovery", None),
                                     arrival_timeout=(config.arrival_timeout
                                                      or config.timeout + config.heartbeat_timeout),
                                     on_end=self._heartbeat_ended)
        self._executor = EpochExecutor(
            ExecutorSettings(config.backend, config.timeout, config.connect_timeout, config.rendezvous_timeout,
                             config.bucket_cap_mb),
            wid=wid, addr=self.addr, store=self._store, membership=self.membership, state=self.state,
            module=self.module, optimizer=self.optimizer, scheduler=self.scheduler, policy=self.policy,
            device=self.device, telemetry=self.telemetry, fault=self.fault, relay=self._relay)
        self._next_epoch = NextEpoch(self.membership, wid, self._executor.new_group)
        self._store.set(keys.speed(wid), repr(self.speed))  # read by every member of a plan that includes it
        t_announce = time.perf_counter()
        self.membership.start()  # announced: from here on a failure must stop the heartbeat
        plan = self.membership.wait_for_plan()
        t_plan = time.perf_counter()
        self.group = self._executor.new_group(plan)
        self.plan = plan
        self._join_times = {"loader_warm_s": self.loader_warm_s, "plan_wait_s": t_plan - t_announce,
                            "group_s": time.perf_counter() - t_plan, "t_joined": time.perf_counter()}

    def _not_joined(self, what: str) -> TrainerPhaseError:
        why = {Phase.CREATED: "call join() first: et = ElasticTrainer(...).join()",
               Phase.JOINING: "join() has not returned yet",
               Phase.FAILED: "its join() failed: build a new ElasticTrainer"}.get(self.phase, "it has not joined")
        return TrainerPhaseError(f"ElasticTrainer.{what}: worker {self.wid} is {self.phase.value}; {why}",
                                 self.phase)

    # ---- public accessors -----------------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The DDP wrapper of the current epoch (re-read every step); the bare module between ``join()`` and the
        loader's first batch.

        Raises:
            TrainerPhaseError: before ``join()`` returned (:attr:`module` is the bare module at any time).
        """
        ddp = self.ddp
        if ddp is not None:
            return ddp
        if self.group is None:
            raise self._not_joined("model")
        return self.module

    @property
    def rank(self) -> int:
        """This worker's rank in the current epoch (raises TrainerPhaseError before ``join()`` returned)."""
        group = self.group
        if group is None:
            raise self._not_joined("rank")
        return group.rank()

    @property
    def world_size(self) -> int:
        """The current epoch's size (raises TrainerPhaseError before ``join()`` returned)."""
        group = self.group
        if group is None:
            raise self._not_joined("world_size")
        return group.size()

    @property
    def step(self) -> int:
        return int(self.state.counters["step"])

    @property
    def epoch(self) -> int:
        return self.sampler.epoch if self.sampler is not None else 0

    @property
    def left(self) -> bool:
        """This worker left the job (a shrink left it out, a recovery declared it dead, or its heartbeat gave up:
        :attr:`end_reason`)."""
        return self.phase is Phase.LEFT

    @property
    def switches(self) -> list[dict]:
        """The completed records of this worker's epoch changes (join, resize, recovery), oldest first."""
        return self._switch_log.done

    def _warm_up(self, step_fn: Callable[[torch.nn.Module], Any]) -> float:
        """``WARM_UP_STEPS`` local steps, then the state as it was (see ``warm_up`` in the class docstring)."""
        t0 = time.perf_counter()
        saved = self.state.capture()  # not the rollback point
        try:
            for _ in range(WARM_UP_STEPS):
                step_fn(self.module)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.module.zero_grad(set_to_none=True)  # parameters outside the optimizer too
            self.state.restore(saved)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def report_error(self, e: BaseException) -> None:
        """Marks this step as failed locally; the next commit point rolls everyone back to the one before."""
        if self.group is None:
            raise self._not_joined("report_error()")
        self._local_error = self._local_error or e

    def watch_loss(self, loss: torch.Tensor) -> None:
        """A non-finite ``loss`` fails the step like :meth:`report_error`, without a host synchronisation: the flag
        stays on the device and the next commit point's vote reads it."""
        if self.group is None:
            raise self._not_joined("watch_loss()")
        bad = ~torch.isfinite(loss.detach()).all()
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad

    def observations(self) -> list[dict]:
        """Predictor observation records collected since the last call (design.md shapes)."""
        return self.telemetry.drain() if self.telemetry is not None else []

    # ---- data -----------------------------------------------------------------------------------------------
    def loader(self, dataset, collate_fn: Optional[Callable] = None, max_steps: Optional[int] = None,
               epochs: Optional[int] = None, **options) -> Iterator:
        """Yields this rank's batches until ``max_steps`` global steps / ``epochs`` epochs, or until it leaves.

        Batches are loaded by torch's ``DataLoader`` (:mod:`elastic_launcher.loading`), which takes ``options``
        as given: ``num_workers`` (default 0: loading in this process), ``pin_memory``, ``prefetch_factor``,
        ``persistent_workers`` (the workers then also outlive this call, for the next ``loader`` call on the same
        dataset), ``worker_init_fn``, ``multiprocessing_context``, ``timeout``, ...; ``collate_fn`` likewise
        (default: ``default_collate``). The worker processes load the steps ahead as the sampler projects them
        and live through resizes; batches in flight that a commit point invalidates (a rollback, a recovery, a
        switch) are dropped and read again. What a batch holds is decided when it is yielded, from the global
        sampler position, so a resize or rollback at a commit point repartitions the rest of the epoch exactly.

        Raises:
            ValueError: an option the elastic sampler decides (``batch_size``, ``shuffle``, ``sampler``,
                ``batch_sampler``, ``drop_last``, ``in_order``).
            TrainerPhaseError: before ``join()`` returned.
        """
        if self.group is None:
            raise self._not_joined("loader()")
        return self._batches(dataset, collate_fn, max_steps, epochs, options)

    def prepare_loader(self, dataset, collate_fn: Optional[Callable] = None, **options) -> "ElasticTrainer":
        """Before :meth:`join`: the ``DataLoader`` that :meth:`loader` will use on ``dataset`` (same arguments).
        ``join()`` starts its worker processes (and pin-memory thread) before ``warm_up`` and waits for a first
        batch after it, all before the worker announces itself, so a grow never waits for a newcomer's loader to
        start; once the plan is known the running workers are redirected to the batches this worker will train on.
        ``loader(dataset, ...)`` with the same dataset object, ``collate_fn`` and options then reuses it (other
        arguments build a new one). Returns the trainer: ``ElasticTrainer(...).prepare_loader(ds, num_workers=8)
        .join()``.

        Raises:
            ValueError: an option the elastic sampler decides (see :meth:`loader`).
            TrainerPhaseError: ``join()`` was called already.
        """
        if self.phase is not Phase.CREATED:
            raise TrainerPhaseError(f"ElasticTrainer.prepare_loader(): worker {self.wid} is {self.phase.value}; "
                                    "call it before join()", self.phase)
        self._ensure_sampler(dataset)
        self._pipeline_for(dataset, collate_fn, options)
        self._prepared = True
        return self

    def _ensure_sampler(self, dataset) -> None:
        if self.sampler is None:
            self.sampler = ElasticSampler(len(dataset), seed=self.config.seed)
            self.sampler.prefetch()
            self.state.sampler = self.sampler

    def _batches(self, dataset, collate_fn: Optional[Callable], max_steps: Optional[int], epochs: Optional[int],
                 options: dict) -> Iterator:
        self._ensure_sampler(dataset)
        pipe = self._pipeline_for(dataset, collate_fn, options)
        if self.phase is Phase.JOINING:
            times = dict(self._join_times)
            t_joined = times.pop("t_joined", None)
            t0 = time.perf_counter()
            times["to_loader_s"] = t0 - t_joined if t_joined is not None else None
            times.update(self._load_ahead_of_join(pipe))
            times["load_ahead_s"] = time.perf_counter() - t0
            epoch, rec = self._executor.join(self.plan, self.group, self._step_fn)
            rec["join_s"] = times
            self._adopt(epoch, rec)
        left = Phase.LEFT
        try:
            while self.phase is not left:
                if (max_steps is not None and self.step >= max_steps) or \
                        (epochs is not None and self.sampler.epoch >= epochs):
                    if self.committed_step < self.step:
                        self._end_commit_point()  # may roll back or recover: the loop then trains those steps again
                        continue
                    return
                sl = self.sampler.slice_for(self.rank, self.batches)
                self.batch_indices = sl.indices
                if self._hook is not None:
                    self._hook.scale = sl.weight
                t_get = time.perf_counter()
                batch = pipe.get(self.step, self.sampler.epoch, self.sampler.pos, self._load_basis(self.step))
                pending = self._switch_log.pending
                if pending is not None and "batch_wait_s" not in pending:
                    pending["batch_wait_s"] = time.perf_counter() - t_get  # the new epoch's first batch
                self._batch_t = time.perf_counter()
                if self._hook is not None:
                    self._hook.first_sync_t = None
                yield batch
        finally:
            if not pipe.persistent:
                pipe.close()

    @property
    def loading(self) -> Optional[Pipeline]:
        """The data loader of the last :meth:`loader` call (its ``dropped`` and ``resets`` counts), if any."""
        return self._pipeline

    def _pipeline_for(self, dataset, collate_fn: Optional[Callable], options: dict) -> Pipeline:
        old, prepared, self._prepared = self._pipeline, self._prepared, False
        if old is not None and old.dataset is dataset and \
                (old.persistent or (prepared and old.arguments == (collate_fn, options))):
            return old
        if old is not None:
            old.close()
        self._pipeline = Pipeline(dataset, self.sampler, self._load_basis, collate_fn, options)
        return self._pipeline

    def _load_basis(self, step: int) -> Basis:
        """What the batch taken at step count ``step`` is loaded for: the next epoch's rank and batches from the
        commit point its switch was armed for (ARM) or, joining, the epoch being joined; else the current epoch's.
        ``Pipeline.get`` is always asked with this function's answer, so a reset of the loader's projection hands
        out exactly the batch asked for next."""
        nxt = self._forecast
        if nxt is not None and (self.phase is Phase.JOINING or
                                (self._switch_at is not None and step >= self._switch_at)):
            return nxt
        return Basis(self.rank, tuple(self.batches))

    def _lead(self) -> int:
        """Steps this worker's loader needs between the announcement of a switch and the switch: what it has in
        flight (a batch asked for now arrives after those), 0 when it loads in this process or leaves."""
        if self._pipeline is None or self._next_epoch.leaving():
            return 0
        return self._pipeline.depth

    def _arm(self) -> None:
        """ARM: every rank is ready and the switch is at the next commit point (``schedule.next_at``): the loader
        reads the next epoch's batches from there on, and rank 0 says where that epoch starts (newcomers' loaders
        read ahead from there while they wait for the state)."""
        self._switch_at = self.schedule.next_at
        prepared, plan = self._next_epoch.prepared(), self.membership.next_plan()
        if prepared is not None and plan is not None and plan.id == prepared[0]:
            group = prepared[1]
            self._forecast = Basis(group.rank(), tuple(self._executor.batches_for(plan, group.size())))
            if self._pipeline is not None:
                self._pipeline.rewind(self.step, self.sampler.epoch, self.sampler.pos, self._switch_at)
        self._publish_start(self._switch_at)

    def _publish_start(self, at: int) -> None:
        """Rank 0 writes where the next epoch starts when it brings newcomers (``keys.loader_start``)."""
        plan = self.membership.next_plan()
        if self.rank != 0 or plan is None or all(m in self.plan.members for m in plan.members):
            return
        epoch, pos = self.sampler.epoch, self.sampler.pos
        if self._pipeline is not None:
            epoch, pos = self._pipeline.ahead.walk(self.step, epoch, pos, at)
        self._store.set(keys.loader_start(plan.id), json.dumps({"step": at, "epoch": epoch, "pos": pos}))

    def _load_ahead_of_join(self, pipe: Pipeline) -> dict:
        """Starts the loader before the state arrives, where the epoch is expected to start: the beginning for the
        first epoch, else what the current epoch's rank 0 published (:meth:`_publish_start`); the first
        batches are then loaded while the survivors train on. A wrong guess costs a reload, nothing else."""
        t0 = time.perf_counter()
        if self.plan.kind == "initial":
            start = {"step": self.step, "epoch": self.sampler.epoch, "pos": self.sampler.pos}
        else:
            key = keys.loader_start(self.plan.id)
            try:
                self._store.wait([key], self.config.rendezvous_timeout)
                start = json.loads(self._store.get(key))
            except Exception as e:  # noqa: BLE001 - the state broadcast decides; this was only a head start
                logger.info("no loader start for epoch %d: %s", self.plan.id, e)
                return {"start_wait_s": time.perf_counter() - t0}
        t1 = time.perf_counter()
        batches = self._executor.batches_for(self.plan, self.group.size())
        self._forecast = Basis(self.group.rank(), tuple(batches))
        pipe.start(start["step"], start["epoch"], start["pos"])
        return {"start_wait_s": t1 - t0, "loader_start_s": time.perf_counter() - t1}

    # ---- commit ---------------------------------------------------------------------------------------------
    def commit(self, compute_s: Optional[float] = None) -> bool:
        """Ends the current batch. Returns True if training goes on in this process, False once it left.

        Most batches end here at once (their device work stays queued). At a commit point (a step every rank
        agreed on, see :attr:`schedule`) the ranks vote, and may roll back to the last commit point, recover
        from a failed peer, switch to the next epoch or leave.

        Args:
            compute_s: this rank's local compute time for the batch, for the progress hook. Default: from the
                batch being handed out to its first gradient bucket (forward and the first part of backward,
                no wait on peers), else to this call.

        Raises:
            TooManyFailures: ``max_retries`` failed commits in a row.
            TrainerPhaseError: before ``join()`` returned.
        """
        now = time.perf_counter()
        if self.group is None:
            raise self._not_joined("commit()")
        if compute_s is None:
            first = self._hook.first_sync_t if self._hook is not None else None
            compute_s = (first if first is not None and first >= self._batch_t else now) - self._batch_t
        before, committed = self.step, self.committed_step
        went_on = self._commit(now)
        self._settle(committed, compute_s if self.step == before + 1 else None)
        return went_on

    def _end_commit_point(self) -> None:
        """The end of training (``max_steps`` or ``epochs``, the same step on every rank) is a commit point: errors
        since the last one are voted on, buffers synchronised, progress reported."""
        committed = self.committed_step
        self._vote()
        self._settle(committed, None)

    def _settle(self, committed_before: int, step_compute_s: Optional[float]) -> None:
        """Progress bookkeeping after ``commit()`` (``step_compute_s``: the step it ended) or the end's commit point:
        steps since the last commit point accumulate; a new commit point reports them; a rollback drops them."""
        steps, spent = self._uncommitted
        if step_compute_s is not None:
            steps, spent = steps + 1, spent + step_compute_s
        if self.step <= self.committed_step:  # nothing tentative left: committed just now, or rolled back
            if self.committed_step > committed_before and self.progress is not None:
                self._report_progress(steps, spent)
            steps, spent = 0, 0.0
        self._uncommitted = (steps, spent)

    def _report_progress(self, steps: int, compute_s: float) -> None:
        s = self.sampler
        self.progress.report(self.plan.id, self.step, s.epoch * s.size + s.pos, compute_s, steps=steps)
        publish = getattr(self.progress, "publish", None)
        every = self.config.observations_every
        if publish is not None and self.telemetry is not None and self.step // every > (self.step - steps) // every:
            records = self.observations()
            if records:
                publish(records)

    def _heartbeat_ended(self, reason: str) -> None:
        """The membership's ``on_end`` (heartbeat thread): the beat could not be written for ``heartbeat_timeout``,
        so the peers judge this worker dead. The group is failed (a collective blocked on a peer wakes up) and the
        next ``commit()`` ends this worker."""
        self.end_reason = reason
        group = self.group
        if group is not None:
            group.fail(ProcessGroupError(reason))

    def _end_cleanly(self) -> bool:
        """Leaves after the heartbeat gave up (``end_reason``): no recovery (the store is unreachable)."""
        logger.error("worker %s ends at step %d: %s", self.wid, self.step, self.end_reason)
        self.phase = Phase.LEFT
        self.ddp = None
        self._next_epoch.drop()
        self.group.abort()
        return False

    def _commit(self, now: float) -> bool:
        if self.end_reason is not None:
            return self._end_cleanly()
        self.sampler.advance(self.batches)
        self.state.counters["step"] += 1
        self._next_epoch.poll()
        self._record_step(now)
        # A failed collective goes to recovery at once: that needs no collective (survivors agree through the
        # store). Everything else waits for the agreed commit point: a vote some ranks take and others do not
        # would pair the vote's allreduce with a gradient bucket's.
        if self.group.errored() is None and not self.schedule.due(self.step):
            self.schedule.tick(time.perf_counter())
            return True
        return self._vote()

    def _record_step(self, now: float) -> None:
        if self.telemetry is not None:
            self.telemetry.record_step([self.world_size], self.batches[self.rank], now - self._last_commit_t)
            self._hook.timed = self.step % self.telemetry.time_every == 0
        self._last_commit_t = now

    # ---- commit points: vote, decide, execute ---------------------------------------------------------------
    def _tally(self, ready: int) -> Optional[VoteTally]:
        """Runs the vote on the current group; None when it failed (the group's error is recorded)."""
        ok_coll = 0 if self.group.errored() is not None else 1
        ok_local = 0 if self._local_error is not None else 1
        n = self.group.size()
        # SUM of [ready, ok_coll, ok_local, 1, proposal, lead, leading]: the 4th entry counts the ranks that took
        # part (a dead rank cannot be counted, so a vote an aborted communicator hands back, untouched or half
        # reduced, reads as failed); the 5th gives every rank the same next commit interval; the last two say
        # whether a switch must be armed first, and how far ahead (VoteTally.lead)
        lead = self._lead() if ready else 0
        leading = 1 if lead and self._switch_at != self.step else 0  # not armed for this commit point yet
        hurry = self.membership.next_plan() is not None  # a resize is being prepared: newcomers wait on us
        v = torch.tensor([ready, ok_coll, ok_local, 1, self.schedule.proposal(hurry), lead * leading, leading],
                         dtype=torch.int64, device=self.device)
        nonfinite, self._nonfinite = self._nonfinite, None
        if nonfinite is not None:  # watch_loss: a non-finite loss since the last commit point is a local error
            v[2] -= nonfinite.to(device=self.device, dtype=torch.int64)
        try:
            if ok_coll:
                self.group.allreduce([v], dist.ReduceOp.SUM).wait()
                v = v.cpu()
        except Exception as e:  # noqa: BLE001
            self.group.report_error(e)
            ok_coll = 0
        tally = VoteTally.read(v, n, ready) if ok_coll else None
        if tally is not None and not tally.counted:
            self.group.report_error(ProcessGroupError(f"commit vote counted {int(v[3])} of {n} ranks"))
        return tally

    def _vote(self) -> bool:
        """A commit point: vote, ``decide_commit``, apply. Returns False once this worker left."""
        tally = self._tally(self._next_epoch.ready_id())
        action = decide_commit(tally, self.group.errored(), self._local_error, self._next_epoch.leaving(),
                               self.failures, self.config.max_retries)
        on_switch = getattr(self.fault, "on_switch", None)
        if action.outcome is CommitOutcome.SWITCH and on_switch is not None and on_switch("vote"):
            e = ProcessGroupError(f"switch vote at step {self.step} read as failed (FaultPlan.fail_in_switch)")
            self.group.report_error(e)  # test seam: this rank missed the vote its peers read, and recovers
            action = decide_commit(None, e, self._local_error, False, self.failures, self.config.max_retries)
        if action.outcome in _COMMITTING:
            try:
                self.state.broadcast_buffers(self.group, 0)
            except Exception as e:  # noqa: BLE001
                self.group.report_error(e)
                # A switch or a leave the counted vote decided stands: a peer died after the vote, and every rank
                # that read the vote switches (or leaves) too. Recovering from the old epoch instead would split
                # the survivors between the two plans (the record joins such a split into one recovery anyway:
                # rendezvous_state.resolve_failed); the new plan's first collective fails if the dead peer is in it.
                if action.outcome not in (CommitOutcome.SWITCH, CommitOutcome.LEAVE):
                    action = decide_commit(None, e, self._local_error, False, self.failures, self.config.max_retries)
                else:
                    logger.warning("buffer broadcast after the %s vote failed (%s): %s anyway",
                                   action.outcome.value, e, action.outcome.value)
        return self._apply(action, tally)

    def _apply(self, action: CommitAction, tally: Optional[VoteTally]) -> bool:
        """Executes a commit point's decision (``tally``: the vote it came from). Returns False once this worker left.

        Raises:
            TooManyFailures: GIVE_UP.
            LeftGroup: the recovery declared this worker dead.
        """
        self.failures = action.failures
        outcome = action.outcome
        if outcome is CommitOutcome.GIVE_UP:
            raise TooManyFailures(f"{action.failures} failed commits in a row at step {self.step}; "
                                  f"last: {action.error}")
        if outcome is CommitOutcome.RECOVER:
            if self.end_reason is not None:
                return self._end_cleanly()
            self._recover(action.error)
            return True
        switch_at, self._switch_at = self._switch_at, None  # an armed switch holds for one commit point only
        if switch_at is not None and outcome is not CommitOutcome.SWITCH:
            self._forecast = None
        if outcome is CommitOutcome.ROLLBACK:
            self.state.restore()
            self._local_error = self._nonfinite = None
            self.schedule.enter(self.step, time.perf_counter())
            logger.warning("rolled back to step %d after %s", self.step, action.error)
            return True
        t = time.perf_counter()
        rec = self._switch_log.finish(t, self.step)
        if rec is not None and self.rank == 0 and rec["kind"] != "join":
            self.membership.report_switched(self.plan, rec)
        self.state.snapshot()
        self.committed_step = self.step
        self.schedule.committed(self.step, tally.proposals, self.group.size(), time.perf_counter(),
                                tally.lead if outcome is CommitOutcome.ARM else 1)
        if outcome is CommitOutcome.ARM:
            self._arm()
            return True
        if outcome is CommitOutcome.COMMIT:
            return True
        if outcome is CommitOutcome.SWITCH and switch_at is None:
            self._publish_start(self.step)  # no loader needed a lead: newcomers learn the start now
        pid, new_group = self._next_epoch.take()
        old_plan, old_group = self.plan, self.group
        self.ddp = None  # the old reducer (freed later by the cyclic GC; the old group stays retired)
        if outcome is CommitOutcome.LEAVE:
            self.phase = Phase.LEFT
            self._executor.leave(old_plan, old_group, pid, self.step)
            return False
        nxt = self.membership.next_plan()
        try:
            adopted = self._executor.switch(old_plan, old_group, new_group, t, self._step_fn)
        except RuntimeError as e:  # a gloo/NCCL error, ProcessGroupError or RendezvousTimeout (not a bug's)
            if nxt is None or isinstance(e, (StateMismatch, TrainerPhaseError)):
                raise
            # a peer of the new plan failed during the switch's state broadcast: this worker is in the new plan
            # (the old group is aborted), whose state is the commit just made; recover from it
            logger.warning("switch to epoch %d failed: %s; recovering from it", nxt.id, e)
            self.plan, self.group = nxt, new_group
            self._recover(e, split=True)
            return True
        self._adopt(*adopted)
        return True

    def _recover(self, err: Optional[BaseException], split: bool = False) -> None:
        """A collective failed: the executor agrees on survivors, rebuilds, rolls back and resyncs.

        ``split``: a switch may have split the survivors between the old plan and the new one (this worker was
        ready to switch, or it switched and has not committed in the new plan yet, or its switch failed): they
        hold different groups, so none tries a communicator shrink; the record joins them into one recovery.
        """
        lost, interval = self.step - self.committed_step, self.schedule.interval
        split = split or self._next_epoch.ready_id() != 0 or \
            (self.plan.kind == "resize" and self.committed_step == self.epoch_start_step)
        self._next_epoch.drop()
        self.ddp = None
        try:
            adopted = self._executor.recover(self.plan, self.group, err, self.config.try_shrink and not split, lost,
                                             interval, self._step_fn)
        except LeftGroup:
            self.phase = Phase.LEFT
            raise
        self._adopt(*adopted)

    def _adopt(self, epoch: Epoch, record: dict) -> None:
        """The executor entered ``epoch``: train in it from the current step, which is the rollback point."""
        self.plan, self.group, self.ddp, self._hook, self.batches = (epoch.plan, epoch.group, epoch.ddp, epoch.hook,
                                                                     epoch.batches)
        self.phase = Phase.TRAINING
        self._forecast = self._switch_at = None  # the loader now loads for this epoch
        self.epoch_start_step = self.step
        self._local_error = self._nonfinite = None
        self.state.snapshot()
        self.committed_step = self.step
        self.schedule.enter(self.step, time.perf_counter())  # next commit point: the first step of the epoch
        self._switch_log.begin(record)

    def _step_fn(self) -> int:
        return int(self.state.counters["step"])

    # ---- shutdown -------------------------------------------------------------------------------------------
    def close(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stops the heartbeat and releases the groups (idempotent); waits up to ``timeout`` for NCCL aborts and
        for group builds a recovery gave up on (their threads end within the backend's timeouts; one still in C++
        at the interpreter's exit aborts the process). Before ``join()`` (or after a failed one) there is nothing
        to release.

        Old gloo groups are left to the process exit (``process_group.abandon_retired``): their teardown can
        block until the collective timeout. A process that goes on for long after training can call
        ``process_group.release_retired`` instead.
        """
        if self.membership is not None:
            self.membership.stop()
        if self.group is None:  # never joined: no group, no pipeline, nothing published
            return
        publish = getattr(self.progress, "publish", None)
        if publish is not None and self.telemetry is not None:
            try:
                records = self.observations()
                if records:
                    publish(records)
            except Exception as e:  # noqa: BLE001 - the store may be gone (the controller ended)
                logger.debug("last observations not published: %s", e)
        self._next_epoch.drop()
        if self._pipeline is not None:
            self._pipeline.close()
        self.ddp = None
        self.group.abort()
        t0 = time.monotonic()
        if not drain_reaper(timeout):
            logger.warning("group teardown still blocked after %s", timeout)
        # a group build given up on during a recovery ends on its own thread; the process must not exit under it
        left = max(timedelta(0), timeout - timedelta(seconds=time.monotonic() - t0))
        if not drain_given_up_builds(left):
            logger.warning("a group build given up on still runs after %s: the process may abort at exit", timeout)
        abandon_retired()

    def __enter__(self) -> "ElasticTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_COMMITTING = (CommitOutcome.COMMIT, CommitOutcome.ARM, CommitOutcome.SWITCH, CommitOutcome.LEAVE)
