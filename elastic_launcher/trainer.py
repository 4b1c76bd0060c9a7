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

The trainer is a thin front over three parts with one job each (as torchft's Manager): the rendezvous client
(:mod:`~elastic_launcher.rendezvous_client`), the commit protocol (:mod:`~elastic_launcher.commit_protocol`: commit
points, and what they decide) and the data feed (:mod:`~elastic_launcher.feed`: sampler and loader).
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch

from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.commit_protocol import CommitProtocol, Current
from elastic_launcher.epoch_decisions import Phase, VoteTally
from elastic_launcher.epochs import EpochExecutor, ExecutorSettings
from elastic_launcher.errors import TrainerPhaseError
from elastic_launcher.feed import DataFeed
from elastic_launcher.links import HostFacts
from elastic_launcher.process_group import ProcessGroupWrapper, StoreAddr
from elastic_launcher.rendezvous_client import RendezvousClient
from elastic_launcher.state import TrainingState
from elastic_launcher.teardown import before_exit
from elastic_launcher.telemetry import Telemetry
from elastic_launcher.trainer_config import TrainerConfig, check_trainer_args

__all__ = ["TrainerConfig", "ElasticTrainer", "VoteTally"]  # TrainerConfig, VoteTally: from their own modules

WARM_UP_STEPS = 2  # local steps of ElasticTrainer(warm_up=...): the optimizer's first step and a later one


def _view(part: str, name: str, doc: str, settable: bool = False) -> property:
    """An attribute of the trainer that is ``name`` of one of its parts (``part``); read-only unless ``settable``."""
    return property(lambda self: getattr(getattr(self, part), name),
                    (lambda self, value: setattr(getattr(self, part), name, value)) if settable else None, doc=doc)


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
            took). CUDA loads a kernel the first time it runs: a newcomer whose first optimizer step is its first
            ever pays for that inside the first step at the new size, and every rank waits (ResNet-50 on 2x H100:
            30 ms against 2.4 ms steady; bench/results/gpu_transition.md). Two steps take both optimizer paths
            (creating its state, then updating it). Running before the announcement keeps it off the survivors'
            critical path, and a step that raises fails :meth:`join` before anyone counts on this worker. What it
            changes beyond model, optimizer, scheduler and gradients (random streams, buffers outside ``state_dict``)
            stays changed.
        extra_state: name -> object with ``state_dict``/``load_state_dict`` and small plain state that every rank
            must hold alike, e.g. ``{"scaler": torch.amp.GradScaler()}`` for fp16: it is rolled back with the
            model, put back after ``warm_up`` and sent to newcomers.

    The constructor stores the arguments and checks them (``ValueError`` / ``TypeError`` naming the argument); it
    connects to nothing and starts nothing, and the trainer is in phase ``CREATED``. :meth:`join` connects to the
    store, (warms up,) announces the worker, waits for a plan that includes it and builds that plan's group (the
    slow part: newcomers do it while the survivors keep training); it returns the trainer, so
    ``et = ElasticTrainer(...).join()``. State is synchronised when the loader starts. Calling the training API
    (``loader``, ``commit``, ``model``, ``rank``, ``world_size``, ``watch_loss``, ``report_error``) before
    ``join()`` returned raises :class:`~elastic_launcher.errors.TrainerPhaseError`. Its parts share the epoch
    (``Current``); :mod:`elastic_launcher.epoch_decisions` decides epoch changes, ``epochs.EpochExecutor`` applies.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, store_addr,
                 worker_id: str, policy: BatchPolicy, scheduler=None, device: Optional[torch.device] = None,
                 config: TrainerConfig = TrainerConfig(), telemetry: Optional[Telemetry] = None,
                 speed: float = 1.0, fault=None, progress=None,
                 warm_up: Optional[Callable[[torch.nn.Module], Any]] = None,
                 extra_state: Optional[dict] = None) -> None:
        check_trainer_args(model, optimizer, store_addr, worker_id, policy, scheduler, device, config, telemetry,
                           speed, fault, progress, warm_up, extra_state)
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
        self.warm_up_s = 0.0
        self.loader_warm_s = 0.0  # join(): waiting for the prepared loader's first batch after warm_up
        self._join_times: dict = {}  # join()'s phases, for the join record (join_s)
        # the three parts, and the epoch trained in that they share (None fields until join() returned)
        self._now = Current()
        self._rdzv = RendezvousClient(self.addr, worker_id, config, self._now, fault)
        self._feed = DataFeed(config.seed, policy, self.state, self._now)
        self._commits = CommitProtocol(config, self.state, self._now, self._rdzv, self._feed, self.device, worker_id,
                                       telemetry, progress, fault)

    # the parts' state, read through the front (the training loop and tests read these)
    phase = _view("_now", "phase", "Where this worker is (:class:`Phase`).")
    plan = _view("_now", "plan", "The current epoch's plan (None until ``join()`` returned).")
    group = _view("_now", "group", "The current epoch's process group (None until ``join()`` returned).")
    ddp = _view("_now", "ddp", "The current epoch's DDP wrapper (None between epochs).")
    batches = _view("_now", "batches", "Every rank's local batch in the current epoch.")
    committed_step = _view("_now", "committed_step", "The step of the last commit point (the rollback point).")
    epoch_start_step = _view("_now", "epoch_start_step", "The step the current epoch began at.")
    membership = _view("_rdzv", "membership", "The heartbeat and plans (None until ``join()`` built it).")
    end_reason = _view("_rdzv", "end_reason", "Why this worker ended on its own (its heartbeat could not be written).")
    _store = _view("_rdzv", "store", "The store's state channel (None until ``join()`` connected).")
    schedule = _view("_commits", "schedule", "When commit points come (:class:`CommitSchedule`).")
    failures = _view("_commits", "failures", "Failed commits in a row.")
    stopping = _view("_commits", "stop_agreed", "The last commit point's vote said stop (on every rank).")
    batch_indices = _view("_feed", "batch_indices", "The dataset indices of the batch handed out last.")
    loading = _view("_feed", "pipeline", "The data loader of the last :meth:`loader` call (its ``dropped`` and "
                                         "``resets`` counts), if any.")
    sampler = _view("_feed", "sampler", "The elastic sampler (built by the first ``loader``/``prepare_loader`` "
                    "call); a resuming script may set it before the loader starts (and in ``state``).", True)

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
        self._now.phase = Phase.JOINING
        try:
            self._join()
        except BaseException:
            self._now.phase = Phase.FAILED
            self._feed.close()  # prepare_loader()'s workers
            self._rdzv.stop()  # no plan or no group: no heartbeat left behind
            raise
        return self

    def _join(self) -> None:
        config, rdzv = self.config, self._rdzv
        store = rdzv.connect()
        # before the worker announces itself: the launcher counts an announced worker as ready to join a plan
        pipe = self._feed.start_prepared()  # prepare_loader(): its workers start during warm_up
        if self._warm_up_fn is not None:
            self.warm_up_s = self.state.rehearse(self._warm_up_fn, WARM_UP_STEPS)
        if pipe is not None:
            s = self.sampler
            self.loader_warm_s = pipe.warm(0, s.epoch, s.pos)  # a batch has come through
        publish_host = getattr(self.progress, "publish_host", None)
        if publish_host is not None:  # the launcher labels this worker's records with the links it really uses
            gpu = self.device.index if self.device.type == "cuda" else None
            name = torch.cuda.get_device_name(self.device) if gpu is not None else None
            publish_host(HostFacts.probe(config.backend, gpu, gpu_name=name).to_json())
        executor = EpochExecutor(
            ExecutorSettings(config.backend, config.timeout, config.connect_timeout, config.rendezvous_timeout,
                             config.bucket_cap_mb),
            wid=self.wid, addr=self.addr, store=store, membership=rdzv.open(), state=self.state,
            module=self.module, optimizer=self.optimizer, scheduler=self.scheduler, policy=self.policy,
            device=self.device, telemetry=self.telemetry, fault=self.fault, relay=rdzv.relay)
        self._commits.executor = executor
        plan, group, times = rdzv.announce(self.speed, executor.new_group)
        self._now.group, self._now.plan = group, plan
        self._join_times = {"loader_warm_s": self.loader_warm_s, **times}

    def _joined(self, what: str) -> ProcessGroupWrapper:
        """The current epoch's group; raises TrainerPhaseError for ``what`` before ``join()`` returned."""
        group = self._now.group
        if group is None:
            why = {Phase.CREATED: "call join() first: et = ElasticTrainer(...).join()",
                   Phase.JOINING: "join() has not returned yet",
                   Phase.FAILED: "its join() failed: build a new ElasticTrainer"}.get(self.phase, "it has not joined")
            raise TrainerPhaseError(f"ElasticTrainer.{what}: worker {self.wid} is {self.phase.value}; {why}",
                                    self.phase)
        return group

    # ---- public accessors -----------------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The DDP wrapper of the current epoch (re-read every step); the bare module between ``join()`` and the
        loader's first batch.

        Raises:
            TrainerPhaseError: before ``join()`` returned (:attr:`module` is the bare module at any time).
        """
        ddp = self._now.ddp
        if ddp is None:
            self._joined("model")
        return ddp if ddp is not None else self.module

    @property
    def rank(self) -> int:
        """This worker's rank in the current epoch (raises TrainerPhaseError before ``join()`` returned)."""
        return self._joined("rank").rank()

    @property
    def world_size(self) -> int:
        """The current epoch's size (raises TrainerPhaseError before ``join()`` returned)."""
        return self._joined("world_size").size()

    @property
    def step(self) -> int:
        return int(self.state.counters["step"])

    @property
    def epoch(self) -> int:
        return self.sampler.epoch if self.sampler is not None else 0

    @property
    def left(self) -> bool:
        """This worker left the job (shrunk out, declared dead, or its heartbeat gave up: :attr:`end_reason`)."""
        return self.phase is Phase.LEFT

    @property
    def switches(self) -> list[dict]:
        """The completed records of this worker's epoch changes (join, resize, recovery), oldest first."""
        return self._commits.switch_log.done

    def report_error(self, e: BaseException) -> None:
        """Marks this step as failed locally; the next commit point rolls everyone back to the one before."""
        self._joined("report_error()")
        self._commits.report_error(e)

    def watch_loss(self, loss: torch.Tensor) -> None:
        """A non-finite ``loss`` fails the step like :meth:`report_error`, without a host synchronisation: the flag
        stays on the device and the next commit point's vote reads it."""
        self._joined("watch_loss()")
        self._commits.watch_loss(loss)

    def request_stop(self) -> None:
        """Every rank stops at the next commit point (:attr:`stopping`); safe in a signal handler."""
        self._commits.stop_requested = True

    def observations(self) -> list[dict]:
        """Predictor observation records collected since the last call (design.md shapes)."""
        return self.telemetry.drain() if self.telemetry is not None else []

    # ---- data -----------------------------------------------------------------------------------------------
    def loader(self, dataset, collate_fn: Optional[Callable] = None, max_steps: Optional[int] = None,
               epochs: Optional[int] = None, to_device: Optional[Callable] = None, **options) -> Iterator:
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
        self._joined("loader()")
        return self._batches(dataset, collate_fn, max_steps, epochs, options, to_device)

    def prepare_loader(self, dataset, collate_fn: Optional[Callable] = None, to_device: Optional[Callable] = None,
                       **options) -> "ElasticTrainer":
        """Before :meth:`join`: the ``DataLoader`` that :meth:`loader` will use on ``dataset`` (same arguments).
        ``join()`` starts its worker processes (and pin-memory thread) before ``warm_up`` and waits for a first
        batch after it, all before the worker announces itself, so a grow never waits for a newcomer's loader to
        start; once the plan is known the running workers are redirected to the batches this worker will train on.
        ``loader(dataset, ...)`` with the same dataset, ``collate_fn``, ``to_device`` (the same object) and options
        reuses it (others build a new one). Returns the trainer:
        ``ElasticTrainer(...).prepare_loader(ds, num_workers=8).join()``.

        Raises:
            ValueError: an option the elastic sampler decides (see :meth:`loader`).
            TrainerPhaseError: ``join()`` was called already.
        """
        if self.phase is not Phase.CREATED:
            raise TrainerPhaseError(f"ElasticTrainer.prepare_loader(): worker {self.wid} is {self.phase.value}; "
                                    "call it before join()", self.phase)
        self._feed.prepare(dataset, collate_fn, options, to_device)
        return self


    def _batches(self, dataset, collate_fn: Optional[Callable], max_steps: Optional[int], epochs: Optional[int],
                 options: dict, to_device: Optional[Callable]) -> Iterator:
        feed, commits, now = self._feed, self._commits, self._now
        feed.ensure_sampler(dataset)
        pipe = feed.pipeline_for(dataset, collate_fn, options, to_device)
        if now.phase is Phase.JOINING:
            commits.enter_joined(pipe, self._join_times)
        try:
            while now.phase is not Phase.LEFT:
                if (max_steps is not None and self.step >= max_steps) or \
                        (epochs is not None and feed.sampler.epoch >= epochs):
                    if now.committed_step < self.step:
                        commits.end_commit_point()  # may roll back or recover: the loop then trains those steps again
                        continue
                    return
                batch, wait_s = feed.next_batch(pipe, self.step)
                commits.batch_waited(wait_s)
                yield batch
        finally:
            if not pipe.persistent:
                pipe.close()

    # ---- commit ---------------------------------------------------------------------------------------------
    def commit(self, compute_s: Optional[float] = None) -> bool:
        """Ends the current batch. Returns True if training goes on in this process, False once it left.

        Most batches end here at once (their device work stays queued). At a commit point (a step every rank
        agreed on, see :attr:`schedule`) the ranks vote, and may roll back to the last commit point, recover
        from a failed peer, switch to the next epoch or leave (:class:`CommitProtocol`).

        Args:
            compute_s: this rank's local compute time for the batch, for the progress hook. Default: from the
                batch being handed out to its first gradient bucket (forward and the first part of backward,
                no wait on peers), else to this call.

        Raises:
            TooManyFailures: ``max_retries`` failed commits in a row.
            TrainerPhaseError: before ``join()`` returned.
        """
        now = time.perf_counter()
        self._joined("commit()")
        return self._commits.commit(now, compute_s, self._feed.batch_t)

    # ---- shutdown -------------------------------------------------------------------------------------------
    def close(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stops the heartbeat and releases the groups (idempotent); waits up to ``timeout`` for NCCL aborts and
        for group builds a recovery gave up on (their threads end within the backend's timeouts; one still in C++
        at the interpreter's exit aborts the process). Before ``join()`` (or after a failed one) there is nothing
        to release.

        Old gloo groups are left to the process exit (``teardown.before_exit``): their teardown can
        block until the collective timeout. A process that goes on for long after training can call
        ``process_group.release_retired`` instead.
        """
        self._rdzv.stop()
        if self._now.group is None:  # never joined: no group, no pipeline, nothing published
            return
        with contextlib.suppress(Exception):  # the store may be gone (the controller ended)
            self._commits.publish_observations()
        self._rdzv.next_epoch.drop()
        self._feed.close()
        self._now.ddp = None
        self._now.group.abort()
        before_exit(timeout)

    def __enter__(self) -> "ElasticTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
