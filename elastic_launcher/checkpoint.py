"""A job's checkpoints on disk, with torch.distributed.checkpoint (DCP).

The state of a data-parallel job is the same on every rank, so one rank writes it (``no_dist``: no collective;
the state is copied to host memory and a thread writes the copy, so training goes on meanwhile) and any number
of ranks read it back: a checkpoint written at 4 workers resumes at 1 or 8. Layout of ``--checkpoint-dir DIR``::

    DIR/step-00000120/      one DCP checkpoint (.metadata, __0_0.distcp): "model", "optim", "meta"
    DIR/latest              "step-00000120": written (atomically) after that directory is complete

"model" and "optim" are torch's FQN-keyed state dicts (``torch.distributed.checkpoint.state_dict``), so a plain
script reads them too; "meta" is JSON: the step, the sampler's position, the LR counters, the scheduler's and
the extra objects' (GradScaler) state. A checkpoint is taken only where the state is committed (every rank
agreed on it), so it never holds a step that a rollback undid. :func:`save_model` writes the final weights
alone (``--save DIR``); ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, "model.pt")`` turns
that into one ``torch.load``-able file.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

from elastic_launcher.state import Snapshot

__all__ = ["Checkpoints", "Resumed", "save_model", "load_model"]

LATEST = "latest"


def _quiet(fn, *args, **kwargs):
    """DCP warns that it runs in one process when no default group exists: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


@dataclass(frozen=True)
class Resumed:
    """What :meth:`Checkpoints.load` put back: the checkpoint's directory and its step."""

    path: Path
    step: int


class Checkpoints:
    """The checkpoints of one job in ``directory``; the last ``keep`` are kept.

    Args:
        directory: created on the first save.
        keep: checkpoints kept (older ones are removed after a newer one is complete).
    """

    def __init__(self, directory: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"Checkpoints(keep={keep}): keep at least one")
        self.directory = Path(directory)
        self.keep = keep
        self._writing: Optional[_Writer] = None

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint, or None (no directory, or nothing written to the end yet)."""
        try:
            name = (self.directory / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        path = self.directory / name
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{self.directory / LATEST} names {name}, which is not a complete checkpoint "
                                    f"(no {path / '.metadata'})")
        return path

    def save(self, state, snapshot: Optional[Snapshot] = None) -> Path:
        """Writes a checkpoint and waits for it: :meth:`begin` then :meth:`wait`. Returns its directory."""
        self.begin(state, snapshot)
        return self.wait()

    def begin(self, state, snapshot: Optional[Snapshot] = None) -> Path:
        """Starts writing ``snapshot`` (default: ``state.capture()``, the state as it is) of ``state`` (a
        :class:`~elastic_launcher.state.TrainingState`) as the checkpoint of its step; returns the directory it
        will have. Pass the trainer's rollback point (``state.last_snapshot``): that is the state every rank
        agreed on at the last commit point, whatever the current step. Its tensors are copied to host memory here
        (the next commit point overwrites them); a thread writes the copy, then points ``latest`` at it and removes
        all but the last ``keep``. A save still under way is waited for first.

        Raises:
            TypeError: the scheduler's or an extra object's state is not plain data (JSON).
            Whatever the previous save raised.
        """
        self.wait()
        snap = snapshot if snapshot is not None else state.capture()
        step = int(snap.counters["step"])
        tensors = _to_host({"model": dict(snap.model), "optim": _by_name(snap.optim, state.model, state.optimizer)})
        meta = {"step": step, "counters": {k: v for k, v in snap.counters.items() if k != "step"},
                "sampler": snap.sampler, "scheduler": _to_host(snap.sched), "extras": snap.extras}
        try:
            tensors["meta"] = json.dumps(meta)
        except TypeError as exc:
            raise TypeError(f"checkpoint of step {step}: the scheduler's or an extra object's state is not plain "
                            f"data ({exc})") from None
        name = f"step-{step:08d}"
        self._writing = _Writer(self, tensors, name)
        self._writing.start()
        return self.directory / name

    def wait(self) -> Optional[Path]:
        """Waits for the save under way (if any); returns its directory (None: none was under way).

        Raises:
            What the save raised (OSError: disk full, permissions, ...).
        """
        writer, self._writing = self._writing, None
        if writer is None:
            return None
        writer.join()
        if writer.error is not None:
            raise writer.error
        return self.directory / writer.name

    def _write(self, tensors: dict, name: str) -> None:
        final, part = self.directory / name, self.directory / f".{name}.partial"
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        _quiet(dcp.save, tensors, checkpoint_id=part, no_dist=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(part, final)
        tmp = self.directory / f".{LATEST}.tmp"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.directory / LATEST)
        self._prune(keep=name)

    def _prune(self, keep: str) -> None:
        done = sorted(p for p in self.directory.glob("step-*") if p.is_dir())
        for old in done[:-self.keep]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, state, path: Optional[Path] = None) -> Optional[Resumed]:
        """Loads the checkpoint ``path`` (default: the latest) into ``state``: model, optimizer, scheduler, extra
        objects, sampler position and counters. Returns what was loaded, or None when there is no checkpoint.

        Raises:
            ValueError: the checkpoint does not fit the model or the dataset (names what differs).
        """
        path = path or self.latest()
        if path is None:
            return None
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)  # allocates the optimizer's state
        loaded = {"model": model_sd, "optim": optim_sd, "meta": ""}
        try:
            _quiet(dcp.load, loaded, checkpoint_id=path, no_dist=True)
        except CheckpointException as exc:  # a BaseException holding each rank's error
            why = "; ".join(str(f[0] if isinstance(f, tuple) else f) for f in exc.failures.values())  # (error, stack)
            raise ValueError(f"checkpoint {path} does not fit this model and optimizer: {why}") from None
        meta = json.loads(loaded["meta"])
        set_state_dict(state.model, state.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
        if state.sampler is not None and meta["sampler"] is not None:
            try:
                state.sampler.load_state_dict(meta["sampler"])
            except ValueError as exc:
                raise ValueError(f"checkpoint {path}: {exc} (a different dataset?)") from None
        if state.scheduler is not None and meta["scheduler"] is not None:
            state.scheduler.load_state_dict(meta["scheduler"])
        for name, obj in state.extras.items():
            if name in meta["extras"]:
                obj.load_state_dict(meta["extras"][name])
        state.counters.update(meta["counters"], step=meta["step"])
        return Resumed(path, meta["step"])


def _by_name(optim_sd: dict, model: torch.nn.Module, optimizer) -> dict:
    """``optimizer.state_dict()`` (parameters by position) keyed by parameter name, the form of
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, which ``set_state_dict`` loads."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[i]: v for i, v in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_sd["param_groups"]]}


def _to_host(x):
    """A copy of a state dict tree with every tensor copied to host memory (the live ones train on)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _to_host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(v) for v in x)
    return x


class _Writer(threading.Thread):
    """Writes one checkpoint's host copy (``Checkpoints.begin``); keeps what it raised for ``wait``."""

    def __init__(self, owner: Checkpoints, tensors: dict, name: str) -> None:
        super().__init__(name=f"checkpoint-{name}", daemon=True)
        self.owner, self.tensors, self.name = owner, tensors, name
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.owner._write(self.tensors, self.name)
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), on the caller's thread
            self.error = exc
        finally:
            self.tensors = {}


def save_model(model: torch.nn.Module, directory: Path) -> Path:
    """The model's weights alone as a DCP checkpoint in ``directory`` (replaced if there); returns it."""
    directory = Path(directory)
    part = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    _quiet(dcp.save, {"model": get_model_state_dict(model)}, checkpoint_id=part, no_dist=True)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(part, directory)
    return directory


def load_model(model: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """Loads weights written by :func:`save_model` (or the "model" of a checkpoint) into ``model``; returns it."""
    sd = {"model": get_model_state_dict(model)}
    _quiet(dcp.load, sd, checkpoint_id=Path(directory), no_dist=True)
    model.load_state_dict(sd["model"])
    return model
