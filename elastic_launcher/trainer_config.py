"""What :class:`~elastic_launcher.trainer.ElasticTrainer` is built with: its timeouts and knobs
(:class:`TrainerConfig`) and the checks of its constructor's arguments (:func:`check_trainer_args`)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch

from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.errors import StoreAddressError
from elastic_launcher.process_group import StoreAddr
from elastic_launcher.telemetry import Telemetry

__all__ = ["TrainerConfig", "check_trainer_args"]


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


def check_trainer_args(model, optimizer, store_addr, worker_id, policy, scheduler, device, config, telemetry,
                       speed, fault, progress, warm_up, extra_state) -> None:
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

