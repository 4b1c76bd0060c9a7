"""Registered training state: snapshot for rollback, broadcast to newcomers.

:class:`TrainingState` holds references to the model, optimizer, LR scheduler, sampler and a dict of plain
counters (step, epoch, user extras). It can

* :meth:`snapshot` everything into memory (tensors cloned on their device) at a commit point, and
  :meth:`restore` it after a failure (in memory; elastic_launcher/checkpoint.py writes the snapshot to files);
* :meth:`broadcast` everything from one rank of a group to all others: the small, non-tensor part (optimizer
  hyper-parameters, scheduler, counters, sampler position, tiny or CPU tensors) travels pickled through the
  store; large device tensors travel by collective broadcast, flattened into one buffer per dtype. Receivers
  that lack optimizer state (a newcomer before its first step) allocate it from the sender's description.

Contract: every rank registers a model and optimizer of the same architecture and parameter order.
"""
from __future__ import annotations

import copy

import io
import math
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from elastic_launcher.errors import RendezvousTimeout, StateMismatch
from elastic_launcher.process_group import ProcessGroupWrapper

__all__ = ["TrainingState", "Snapshot", "wait_posted"]

_SMALL = 1  # tensors with at most this many elements travel pickled


@dataclass
class Snapshot:
    """An in-memory commit: cloned tensors and plain state."""

    model: dict
    optim: dict
    sched: Optional[dict]
    sampler: Optional[dict]
    counters: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)


def _clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_clone_tree(v) for v in x)
    return x


def _tensor_leaves(x: Any, out: list) -> list:
    """Appends the tensors of a state tree to ``out`` in traversal order; returns ``out``."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _tensor_leaves(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _tensor_leaves(v, out)
    return out


def _with_leaves(x: Any, leaves) -> Any:
    """A copy of the tree ``x`` (new containers, as ``_clone_tree``) whose tensors are taken from ``leaves``."""
    if isinstance(x, torch.Tensor):
        return next(leaves)
    if isinstance(x, dict):
        return {k: _with_leaves(v, leaves) for k, v in x.items()}
    if isinstance(x, list):
        return [_with_leaves(v, leaves) for v in x]
    if isinstance(x, tuple):
        return tuple(_with_leaves(v, leaves) for v in x)
    return x


def _copy_tree(x: Any, reuse: list) -> tuple[Any, list]:
    """``_clone_tree(x)``, but copying into the tensors of ``reuse`` (an earlier result's leaves) when they match
    ``x``'s tensors one to one (shape, dtype, device): one ``_foreach_copy_`` per device and dtype instead of
    one clone per tensor. Returns the copy and its leaves."""
    src = _tensor_leaves(x, [])
    if len(reuse) != len(src) or any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                                     for a, b in zip(reuse, src)):
        out = _clone_tree(x)
        return out, _tensor_leaves(out, [])
    groups: dict[tuple, tuple[list, list]] = {}
    for a, b in zip(reuse, src):
        ds, ss = groups.setdefault((a.device, a.dtype), ([], []))
        ds.append(a)
        ss.append(b.detach())
    with torch.no_grad():
        for ds, ss in groups.values():
            torch._foreach_copy_(ds, ss)
    return _with_leaves(x, iter(reuse)), reuse


class _Ref:
    """Placeholder for a tensor sent by collective: position in the flat list, shape, dtype."""

    __slots__ = ("i", "shape", "dtype")

    def __init__(self, i: int, shape: tuple, dtype: torch.dtype) -> None:
        self.i, self.shape, self.dtype = i, shape, dtype


class TrainingState:
    """The state a resize or recovery must preserve.

    Args:
        model: the bare module (not the DDP wrapper).
        optimizer: its optimizer.
        scheduler: an LR scheduler or None.
        sampler: an object with ``state_dict``/``load_state_dict`` (the elastic sampler) or None.
        device: where large tensors live (collectives run there).
        extras: name -> object with ``state_dict``/``load_state_dict`` whose state is small and plain (e.g. a
            ``torch.amp.GradScaler``: every rank must scale by the same factor); travels pickled.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None,
                 sampler=None, device: Optional[torch.device] = None, extras: Optional[dict] = None) -> None:
        self.extras: dict = dict(extras or {})
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.device = device or next(model.parameters()).device
        self.counters: dict = {"step": 0, "epoch": 0}
        self._snap: Optional[Snapshot] = None
        self._snap_leaves: list[torch.Tensor] = []  # the rollback snapshot's tensors, reused by the next one

    # ---- rollback -------------------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Copies everything into memory; becomes the rollback point.

        The tensors go into the previous snapshot's buffers when the state still has the same tensors (shapes,
        dtypes, devices): one ``_foreach_copy_`` per device and dtype, so a commit point allocates nothing and
        launches a handful of copies instead of one clone per tensor.
        """
        tree = (self.model.state_dict(), self.optimizer.state_dict(),
                self.scheduler.state_dict() if self.scheduler is not None else None)
        (model, optim, sched), self._snap_leaves = _copy_tree(tree, self._snap_leaves)
        self._snap = Snapshot(model, optim, sched,
                              dict(self.sampler.state_dict()) if self.sampler is not None else None,
                              dict(self.counters), self._extras_state())
        return self._snap

    def capture(self) -> Snapshot:
        """Clones everything into memory, for ``restore(snap)``; the rollback point stays as it was."""
        return Snapshot(
            model=_clone_tree(self.model.state_dict()),
            optim=_clone_tree(self.optimizer.state_dict()),
            sched=_clone_tree(self.scheduler.state_dict()) if self.scheduler is not None else None,
            sampler=dict(self.sampler.state_dict()) if self.sampler is not None else None,
            counters=dict(self.counters),
            extras=self._extras_state(),
        )

    def rehearse(self, step_fn: Callable[[torch.nn.Module], Any], steps: int) -> float:
        """Runs ``step_fn(model)`` ``steps`` times, then puts the state back as it was (the rollback point stays)
        and clears every gradient of the model. Returns the seconds it took (a CUDA device synchronised)."""
        t0 = time.perf_counter()
        saved = self.capture()  # not the rollback point
        try:
            for _ in range(steps):
                step_fn(self.model)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)  # parameters outside the optimizer too
            self.restore(saved)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _extras_state(self) -> dict:
        return {name: copy.deepcopy(obj.state_dict()) for name, obj in self.extras.items()}

    def _load_extras(self, states: dict) -> None:
        for name, obj in self.extras.items():
            if name in states:
                obj.load_state_dict(copy.deepcopy(states[name]))

    @property
    def last_snapshot(self) -> Optional[Snapshot]:
        return self._snap

    def restore(self, snap: Optional[Snapshot] = None) -> None:
        """Restores the last (or the given) snapshot in place.

        Raises:
            StateMismatch: there is no snapshot to restore.
        """
        snap = snap or self._snap
        if snap is None:
            raise StateMismatch("rollback requested before the first commit snapshot")
        with torch.no_grad():
            self.model.load_state_dict(snap.model)
        self.optimizer.load_state_dict(_clone_tree(snap.optim))
        if self.scheduler is not None and snap.sched is not None:
            self.scheduler.load_state_dict(snap.sched)
        if self.sampler is not None and snap.sampler is not None:
            self.sampler.load_state_dict(snap.sampler)
        self._load_extras(snap.extras)
        self.counters = dict(snap.counters)

    # ---- broadcast ------------------------------------------------------------------------------------------
    def _split(self, obj: Any, flat: list[torch.Tensor]) -> Any:
        """Replaces large device tensors by _Ref placeholders (appending them to ``flat``)."""
        if isinstance(obj, torch.Tensor):
            if obj.numel() > _SMALL and obj.device == self.device:
                flat.append(obj.detach())
                return _Ref(len(flat) - 1, tuple(obj.shape), obj.dtype)
            return obj.detach().cpu()
        if isinstance(obj, dict):
            return {k: self._split(v, flat) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._split(v, flat) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._split(v, flat) for v in obj)
        return obj

    def _join(self, obj: Any, flat: list[torch.Tensor]) -> Any:
        if isinstance(obj, _Ref):
            return flat[obj.i]
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, dict):
            return {k: self._join(v, flat) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._join(v, flat) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._join(v, flat) for v in obj)
        return obj

    def _describe(self) -> tuple[bytes, list[torch.Tensor]]:
        flat: list[torch.Tensor] = []
        skel = {
            "model": self._split(self.model.state_dict(), flat),
            "optim": self._split(self.optimizer.state_dict(), flat),
            "sched": self.scheduler.state_dict() if self.scheduler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "counters": dict(self.counters),
            "extras": self._extras_state(),
        }
        buf = io.BytesIO()
        pickle.dump(skel, buf)
        return buf.getvalue(), flat

    def broadcast(self, group: ProcessGroupWrapper, src: int, store: dist.Store, key: str,
                  timeout: timedelta = timedelta(seconds=60), give_up: Optional[Callable[[], str]] = None,
                  poll: float = 0.05) -> int:
        """Makes every rank of ``group`` hold rank ``src``'s state. Collective over ``group``.

        Args:
            group: a configured group (all its ranks call this).
            src: the group rank whose state wins.
            store: where the pickled skeleton is exchanged (use a per-epoch prefix).
            key: store key of the skeleton (unique per broadcast).
            timeout: bound for receivers waiting on the skeleton.
            give_up: asked every ``poll`` seconds while a receiver waits on the skeleton: a reason to stop waiting
                ("" to go on; a round's watch, ``EpochExecutor._round_watch``: the source is silent, a recovery of
                the plan began, or the round's arrival deadline passed).

        Returns:
            bytes moved by the collective broadcast.

        Raises:
            RendezvousTimeout: the skeleton did not arrive in time, or ``give_up`` gave a reason.
            StateMismatch: the local model does not match the sender's.
        """
        if group.rank() == src:
            blob, flat = self._describe()
            store.set(key, blob)
            skel = None
        else:
            wait_posted(store, key, timeout, give_up, poll)
            skel = pickle.loads(store.get(key))
            flat = self._receive_buffers(skel)
        nbytes = _broadcast_flat(group, flat, src)
        if skel is not None:
            self._apply(skel, flat)
        return nbytes

    def _receive_buffers(self, skel: dict) -> list[torch.Tensor]:
        """Receive buffers in the sender's order: local model tensors in place, fresh ones for the rest."""
        local = self.model.state_dict()
        flat: list[torch.Tensor] = []
        for name, v in skel["model"].items():
            if isinstance(v, _Ref):
                t = local.get(name)
                if t is None or tuple(t.shape) != v.shape or t.dtype != v.dtype:
                    raise StateMismatch(f"model tensor {name}: local {None if t is None else tuple(t.shape)} "
                                        f"vs sender {v.shape} {v.dtype}")
                flat.append(t.detach())
        for r in sorted(_iter_refs(skel["optim"]), key=lambda r: r.i):
            flat.append(torch.empty(r.shape, dtype=r.dtype, device=self.device))
        return flat

    def _apply(self, skel: dict, flat: list[torch.Tensor]) -> None:
        model_sd = self._join(skel["model"], flat)
        with torch.no_grad():
            self.model.load_state_dict(model_sd)  # copies only where not already the same storage
        self.optimizer.load_state_dict(self._join(skel["optim"], flat))
        if self.scheduler is not None and skel["sched"] is not None:
            self.scheduler.load_state_dict(skel["sched"])
        if self.sampler is not None and skel["sampler"] is not None:
            self.sampler.load_state_dict(skel["sampler"])
        self._load_extras(skel.get("extras", {}))
        self.counters = dict(skel["counters"])

    def broadcast_buffers(self, group: ProcessGroupWrapper, src: int = 0) -> None:
        """Broadcasts the model's floating-point buffers (e.g. BatchNorm statistics) from ``src``; collective.

        Constant buffers (integer counters, boolean masks) are left alone; they travel with full broadcasts.
        """
        bufs = [b for b in self.model.buffers()
                if b.numel() > 0 and b.device == self.device and b.is_floating_point()]
        if bufs:
            _broadcast_flat(group, bufs, src)


def _iter_refs(o: Any):
    if isinstance(o, _Ref):
        yield o
    elif isinstance(o, dict):
        for v in o.values():
            yield from _iter_refs(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            yield from _iter_refs(v)


CHECK_MAX_S = 0.005  # wait_posted: the longest sleep between two checks of the key (one store round trip each)


def wait_posted(store: dist.Store, key: str, timeout: timedelta, give_up: Optional[Callable[[], str]],
                poll: float, what: str = "state skeleton") -> None:
    """Waits until ``key`` (``what``, for the error) is in ``store``: up to ``timeout``, and while ``give_up()`` (if
    given: asked every ``poll`` seconds; a round's watch, ``EpochExecutor._round_watch``) says nothing.

    Raises:
        RendezvousTimeout: not posted in time, or ``give_up`` gave a reason.
    """
    if give_up is None:
        try:
            store.wait([key], timeout)
        except Exception as e:  # noqa: BLE001 - the store raises a generic error on timeout
            raise RendezvousTimeout(f"{what} {key} not posted within {timeout}") from e
        return
    start = time.monotonic()
    deadline, asked = start + timeout.total_seconds(), -math.inf
    while not store.check([key]):
        now = time.monotonic()
        if now - asked >= poll:
            asked = now
            why = give_up() or ("" if now < deadline else f"not posted within {timeout}")
            if why:
                raise RendezvousTimeout(f"{what} {key}: {why}")
        # checked again after a quarter of the wait so far, 1 ms at first and CHECK_MAX_S at most: a switch's
        # receivers (and a newcomer waiting for its loader start) see the key at most that late, not a poll later
        time.sleep(min(CHECK_MAX_S, max(0.001, (now - start) / 4)))


def _broadcast_flat(group: ProcessGroupWrapper, tensors: list[torch.Tensor], src: int) -> int:
    """Broadcasts ``tensors`` in place, one flat buffer per dtype. Returns bytes moved."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    works, pending, nbytes = [], [], 0
    for dtype, ts in by_dtype.items():
        flat = torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1).clone()
        nbytes += flat.numel() * flat.element_size()
        works.append(group.broadcast([flat], src))
        pending.append((flat, ts))
    for w in works:
        w.wait()
    if group.rank() != src:
        with torch.no_grad():
            for flat, ts in pending:
                parts = flat.split([t.numel() for t in ts])
                torch._foreach_copy_(ts, [p.view_as(t) for p, t in zip(parts, ts)])
    return nbytes
