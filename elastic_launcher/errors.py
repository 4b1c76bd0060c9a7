"""Exceptions of the elastic runtime.

Each names the thing that failed and where (epoch, rank, worker id, store key), so a log line is enough to
find the cause. Entry points (the launcher CLI) convert them at the boundary.
"""
from __future__ import annotations


class ElasticError(RuntimeError):
    """Base class of every error raised by :mod:`elastic_launcher`."""


class StoreAddressError(ElasticError, ValueError):
    """A store address is not of the form ``host:port/prefix``."""


class ProcessGroupError(ElasticError):
    """Building, using or aborting a process group failed.

    Attributes:
        epoch_prefix: the store prefix of the group concerned.
    """

    def __init__(self, message: str, epoch_prefix: str = "") -> None:
        super().__init__(message)
        self.epoch_prefix = epoch_prefix


class PeerFailure(ProcessGroupError):
    """A peer of the current epoch stopped beating (or its recovery began): the group is failed from the
    heartbeat thread, not by a collective."""


class NotConfiguredError(ProcessGroupError):
    """A collective was issued on a wrapper whose ``configure`` has not succeeded."""


class RendezvousTimeout(ElasticError, TimeoutError):
    """Waiting on the membership store (plan, recovery, state) took longer than its timeout."""


class ResizeConflict(ElasticError):
    """``request_resize`` lost the race: the epoch already has a successor (a resize or a recovery).

    Attributes:
        epoch: the epoch whose successor was taken.
        successor: the id of the plan that won.
    """

    def __init__(self, epoch: int, successor: int) -> None:
        super().__init__(f"epoch {epoch} already has successor plan {successor}; re-read current() and retry")
        self.epoch = epoch
        self.successor = successor


class InvalidPlan(ElasticError, ValueError):
    """A requested membership is empty, has duplicates or is otherwise unusable."""


class StateMismatch(ElasticError):
    """Registered state differs between ranks (tensor names, shapes or dtypes) during a state broadcast."""


class TooManyFailures(ElasticError):
    """Steps failed ``max_retries`` times in a row; the count is in the message."""


class TrainerPhaseError(ElasticError):
    """An :class:`~elastic_launcher.trainer.ElasticTrainer` call its phase does not allow: the training API
    (``loader``, ``commit``, ``model``, ``rank``, ...) before ``join()`` returned, or ``join()`` a second time.

    Attributes:
        phase: the trainer's phase at the call (an ``epoch_decisions.Phase``).
    """

    def __init__(self, message: str, phase) -> None:
        super().__init__(message)
        self.phase = phase


class LeftGroup(ElasticError):
    """This worker was removed from the group by a resize; it must exit cleanly."""
