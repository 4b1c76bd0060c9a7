"""The trainer's data loading: torch's ``DataLoader`` (worker processes, prefetch, pinned memory), fed the steps
ahead of the elastic sampler.

The sampler's state is global (``epoch, pos``) and a step's slice depends on the rank and every rank's batch
(:meth:`ElasticSampler.slice_at`), which change only at commit points. So the loader is handed a *projection*:
an endless batch sampler (:class:`StepsAhead`) that walks the sampler forward from a cursor, one step at a time,
with the (rank, batches) the trainer expects for that step (:class:`Basis`, from a callable the trainer gives:
the current epoch's, or the prepared next epoch's after the commit point where the switch is expected). Every
index list it hands to the ``DataLoader`` is remembered with its key ``(epoch, pos, rank, batches)``, in the order
the ``DataLoader`` delivers them (``in_order``).

:meth:`Pipeline.get` asks for the batch of an exact key. Batches ahead of it are dropped (their key was projected
under a basis that a commit point did not confirm: a rollback, a recovery, a switch that came later or not at
all); if the key is not among those in flight, the cursor is reset to it first, so the next index lists the
``DataLoader`` asks for are the right ones. The worker processes keep running across all of this: nothing is
respawned on a resize, only the batches in flight are read again. A projection the trainer learns is wrong
before the loader reaches it (a next epoch became ready) is corrected with :meth:`Pipeline.rewind`, which keeps
what is still valid in flight.

A ``DataLoader`` cannot take back work it has queued to its workers, and on a loader-bound job the batches in
flight are seconds of work, which the batch of the new epoch would wait behind. So every index list travels as
a :class:`Work` (its sequence number and step), and the dataset is wrapped (:class:`Cancellable`) to check, before
each item, a cancellation mark in shared memory: work that a rewind or reset made stale is skipped, item by item,
and arrives as :data:`STALE`, which the trainer drops like any other unconfirmed batch.

A batch that is finished on the device (``to_device``: GPU decode, data made on the GPU, the copy) is finished one
step ahead by :class:`DeviceStage`, on a thread and CUDA stream of its own, while the trainer's step runs: the host
work of a decode (nvJPEG waits for its own stream) then no longer stops the trainer's thread from queueing kernels.
The batch staged ahead carries its key, and is dropped like a batch in flight when the key asked for differs.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from elastic_launcher.sampler import ElasticSampler

__all__ = ["Basis", "DeviceStage", "StepsAhead", "Pipeline", "OWNED_OPTIONS"]

# DataLoader options the elastic sampler decides: a user's value would break the exact accounting
OWNED_OPTIONS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "in_order")

Key = tuple  # (epoch, pos, rank, batches): a step's slice for one rank


class _Stale:
    """What a cancelled :class:`Work` arrives as: one object in every process (unpickled as the same one)."""

    def __reduce__(self):
        return (_stale, ())

    def __repr__(self) -> str:
        return "STALE"


def _stale() -> "_Stale":
    return STALE


STALE = _Stale()


@dataclass(frozen=True)
class Work:
    """One index list handed to the ``DataLoader``: ``indices`` of the step ``step``, the ``seq``-th list handed out."""

    seq: int
    step: int
    indices: list

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        return iter(self.indices)


class Cancellable(torch.utils.data.Dataset):
    """The user's dataset as the ``DataLoader`` workers see it: a :class:`Work` marked stale in ``mark`` (a shared
    ``[cancel_seq, cancel_step]``: work handed out before ``cancel_seq`` for a step at or after ``cancel_step``)
    loads nothing more. Other attributes are the dataset's (``get_worker_info().dataset.x`` still works)."""

    def __init__(self, dataset, mark: torch.Tensor) -> None:
        self.dataset = dataset
        self.mark = mark

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    def __getattr__(self, name: str):
        if name in ("dataset", "mark"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def _stale(self, work: Work) -> bool:
        cancel_seq, cancel_step = self.mark.tolist()
        return work.seq < cancel_seq and work.step >= cancel_step

    def __getitems__(self, work: Work):
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is not None:  # the dataset fetches a batch at once: checked before, not item by item
            return STALE if self._stale(work) else batched(list(work.indices))
        items = []
        for i in work.indices:
            if self._stale(work):
                return STALE
            items.append(self.dataset[i])
        return items


@dataclass(frozen=True)
class CollateUnlessStale:
    """The user's ``collate_fn``, passing :data:`STALE` through."""

    collate: Callable

    def __call__(self, items):
        return STALE if items is STALE else self.collate(items)


@dataclass(frozen=True)
class Basis:
    """What a step is loaded with: this worker's rank and every rank's batch."""

    rank: int
    batches: tuple[int, ...]


class StepsAhead:
    """The ``DataLoader``'s batch sampler: the index lists of the steps ahead, without end.

    Args:
        sampler: the trainer's elastic sampler (read for its permutation and size, never advanced here).
        basis: ``basis(step) -> Basis`` for the batch the trainer takes when its step count is ``step``.

    Attributes:
        pending: keys of the index lists handed out and not yet taken back by :meth:`take`, oldest first.
    """

    def __init__(self, sampler: ElasticSampler, basis: Callable[[int], Basis]) -> None:
        self._sampler = sampler
        self._basis = basis
        self._cursor: tuple[int, int, int] = (0, 0, 0)  # (step, epoch, pos) of the next index list
        self.pending: deque = deque()
        self.seq = 0  # index lists handed out so far

    def reset(self, step: int, epoch: int, pos: int) -> None:
        """The next index list is the one of ``step`` at ``(epoch, pos)``."""
        self._cursor = (step, epoch, pos)

    @property
    def next_step(self) -> int:
        return self._cursor[0]

    def basis_of(self, step: int) -> Basis:
        return self._basis(step)

    def key(self, epoch: int, pos: int, basis: Basis) -> Key:
        return (epoch, pos, basis.rank, basis.batches)

    def walk(self, step: int, epoch: int, pos: int, to_step: int) -> tuple[int, int]:
        """The position of ``to_step`` reached from ``step`` at ``(epoch, pos)`` under the bases."""
        for t in range(step, to_step):
            epoch, pos = self._sampler.after(epoch, pos, self._basis(t).batches)
        return epoch, pos

    def __iter__(self) -> "StepsAhead":
        return self

    def __next__(self) -> Work:
        step, epoch, pos = self._cursor
        basis = self._basis(step)
        sl = self._sampler.slice_at(epoch, pos, basis.rank, basis.batches)
        self.pending.append(self.key(epoch, pos, basis))
        self._cursor = (step + 1, *self._sampler.after(epoch, pos, basis.batches))
        self.seq += 1
        return Work(self.seq - 1, step, sl.indices or sl.padding)

    def take(self) -> Key:
        """The key of the batch the ``DataLoader`` just delivered (the oldest handed out)."""
        return self.pending.popleft()


def _tensors(batch):
    """The tensors of a batch of (nested) tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (tuple, list)):
        for b in batch:
            yield from _tensors(b)
    elif isinstance(batch, dict):
        for b in batch.values():
            yield from _tensors(b)


class DeviceStage:
    """``to_device(batch) -> batch`` run one batch ahead, in a thread of its own (:meth:`submit` returns at once);
    on a CUDA ``device`` on a stream of its own, and :meth:`take` makes the caller's stream wait for it (an event)
    and marks its tensors used there (``record_stream``: the caching allocator keeps their memory until that stream
    is done with them). An exception of ``to_device`` is raised by :meth:`take`."""

    def __init__(self, to_device: Callable, device: torch.device) -> None:
        self.to_device = to_device
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="device-stage")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def submit(self, batch) -> Future:
        return self._pool.submit(self._finish, batch)

    def _finish(self, batch):
        if self._stream is None:
            return self.to_device(batch), None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            out = self.to_device(batch)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return out, ready

    def take(self, staged: Future):
        out, ready = staged.result()
        if ready is not None:
            here = torch.cuda.current_stream(self.device)
            here.wait_event(ready)
            for t in _tensors(out):
                if t.is_cuda:
                    t.record_stream(here)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Pipeline:
    """One ``DataLoader`` over the dataset, its worker processes alive until :meth:`close`.

    Args:
        dataset: map-style dataset.
        sampler: the elastic sampler.
        basis: see :class:`StepsAhead`.
        collate_fn: as ``DataLoader``'s.
        options: further ``DataLoader`` options (``num_workers``, ``pin_memory``, ``prefetch_factor``,
            ``persistent_workers``, ``worker_init_fn``, ``multiprocessing_context``, ``timeout``, ...).
        to_device: ``batch -> batch`` on ``device`` (a :class:`DeviceStage`: on a GPU the next batch is finished
            while this one trains), or None: batches are handed out as the ``DataLoader`` delivers them.

    Raises:
        ValueError: an option the elastic sampler owns (``OWNED_OPTIONS``).

    Attributes:
        dropped: batches loaded and then dropped (projected under a basis a commit point did not confirm).
        resets: times the projection was reset to a key not in flight (the batch then waits for its load).
    """

    def __init__(self, dataset, sampler: ElasticSampler, basis: Callable[[int], Basis],
                 collate_fn: Optional[Callable], options: dict[str, Any], to_device: Optional[Callable] = None,
                 device: Optional[torch.device] = None) -> None:
        owned = sorted(set(options) & set(OWNED_OPTIONS))
        if owned:
            raise ValueError(f"loader option(s) {', '.join(owned)}: the elastic sampler decides these "
                             "(every sample once per epoch across resizes); leave them out")
        self.dataset = dataset
        self.arguments = (collate_fn, dict(options), to_device)  # as given (prepare_loader compares them)
        self.stage = DeviceStage(to_device, device or torch.device("cpu")) if to_device is not None else None
        self._staged: Optional[tuple] = None  # (key, Future): the next batch, being finished on the device
        self.persistent = bool(options.get("persistent_workers", False))
        self.ahead = StepsAhead(sampler, basis)
        self._mark = torch.zeros(2, dtype=torch.int64).share_memory_()  # Cancellable's [cancel_seq, cancel_step]
        kw = dict(options)
        kw["collate_fn"] = CollateUnlessStale(collate_fn or torch.utils.data.default_collate)
        self.loader = torch.utils.data.DataLoader(Cancellable(dataset, self._mark), batch_sampler=self.ahead, **kw)
        self._it: Optional[Any] = None
        self.dropped = 0
        self.resets = 0
        self.warmed = 0  # batches loaded by warm()
        self._held: Optional[tuple] = None  # (key, batch) warm() loaded, not handed out yet

    @property
    def depth(self) -> int:
        """Batches in flight at most: one asked for now arrives after these (0 when loading in this process)."""
        staged = 1 if self.stage is not None and self.loader.num_workers else 0
        return self.loader.num_workers * (self.loader.prefetch_factor or 0) + staged

    def start(self, step: int, epoch: int, pos: int) -> None:
        """Starts the workers now, loading from ``step`` at ``(epoch, pos)`` (a guess: :meth:`get` checks it).
        Workers already running (:meth:`warm`) are redirected there: what they have in flight is cancelled and
        taken off the queue (it arrives at once, stale), so the ``DataLoader`` asks for the new steps now."""
        if self._it is None:
            self.ahead.reset(step, epoch, pos)
            self._it = iter(self.loader)
            return
        want = self.ahead.key(epoch, pos, self.ahead.basis_of(step))
        if self._staged is not None and self._staged[0] != want:
            self._staged = None
            self.dropped += 1
        if self._staged is not None or (self._held is not None and self._held[0] == want):
            return  # this very batch is loaded (warm()) or being finished, and the next ones are in flight
        if self._held is not None:
            self._held = None
            self.dropped += 1
        if self.ahead.pending and self.ahead.pending[0] == want:
            return  # already loading from there
        self._cancel(0)
        self.ahead.reset(step, epoch, pos)
        for _ in range(len(self.ahead.pending)):  # each one taken off lets the DataLoader ask for a new step
            next(self._it)
            self.ahead.take()
            self.dropped += 1

    def warm(self, step: int, epoch: int, pos: int) -> float:
        """Starts the workers (their processes, ``worker_init_fn``, the pin-memory thread) and waits for one batch
        loaded from ``step`` at ``(epoch, pos)`` under the basis then in force, kept for :meth:`get` (dropped if
        another key is asked for); the next batches stay in flight. Returns the seconds it took. For a worker that
        does not know its place yet (a newcomer before it announces itself): :meth:`start` then redirects them."""
        t0 = time.perf_counter()
        self.start(step, epoch, pos)
        if self.loader.num_workers and self._held is None:
            batch = next(self._it)
            self._held = (self.ahead.take(), batch)
            self.warmed += 1
        return time.perf_counter() - t0

    def get(self, step: int, epoch: int, pos: int, basis: Basis) -> Any:
        """The batch of ``step`` at ``(epoch, pos)`` under ``basis``: the collated items of
        ``sampler.slice_at(epoch, pos, basis.rank, basis.batches)`` (its indices, or its padding), finished by
        ``to_device`` where there is one (the next batch in flight is then handed to it before this one returns)."""
        if self.stage is None:
            return self._delivered(step, epoch, pos, basis)
        want = self.ahead.key(epoch, pos, basis)
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] != want:
            staged = None
            self.dropped += 1
        if staged is None:
            staged = (want, self.stage.submit(self._delivered(step, epoch, pos, basis)))
        if self.ahead.pending:   # the next step's batch as projected now, loaded or being loaded by the workers
            batch = next(self._it)
            key = self.ahead.take()
            if batch is STALE:
                self.dropped += 1
            else:
                self._staged = (key, self.stage.submit(batch))
        return self.stage.take(staged[1])

    def _delivered(self, step: int, epoch: int, pos: int, basis: Basis) -> Any:
        want = self.ahead.key(epoch, pos, basis)
        if self._it is None:  # the first call starts the workers and fills the prefetch queue
            self.start(step, epoch, pos)
        held, self._held = self._held, None
        if held is not None:
            if held[0] == want and held[1] is not STALE:
                return held[1]
            self.dropped += 1
        reset = False
        while True:
            if want not in self.ahead.pending:
                if reset:  # the projection, reset to this step, did not hand out this key
                    raise RuntimeError(f"loader: the basis of step {step} asked for is not the projection's")
                self._cancel(0)  # nothing in flight is of use
                self.ahead.reset(step, epoch, pos)
                self.resets += 1
                reset = True
            batch = next(self._it)
            if self.ahead.take() == want and batch is not STALE:
                return batch
            self.dropped += 1

    def _cancel(self, from_step: int) -> None:
        """Work handed out so far for ``from_step`` and later loads nothing more."""
        self._mark.copy_(torch.tensor([self.ahead.seq, from_step]))

    def rewind(self, step: int, epoch: int, pos: int, from_step: int) -> None:
        """The bases of the steps from ``from_step`` on changed: index lists handed out for them are stale. The
        cursor goes back to ``from_step`` (walked from the trainer's ``step`` at ``(epoch, pos)``); what is in
        flight before it stays valid, what is in flight after it is dropped when it arrives."""
        from_step = max(from_step, step)
        if self._it is not None and self.ahead.next_step > from_step:
            self._cancel(from_step)
            self.ahead.reset(from_step, *self.ahead.walk(step, epoch, pos, from_step))

    def close(self) -> None:
        """Stops the worker processes (idempotent)."""
        it, self._it = self._it, None
        self._held = self._staged = None
        if self.stage is not None:
            self.stage.close()
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.ahead.pending.clear()

