"""What a resize costs the loader: the wait for the first batch of the new layout, our ``loading.Pipeline`` against
torchdata's ``StatefulDataLoader`` and torch's ``DataLoader`` with persistent workers (issue #46: is the
hand-written part needed?).

A loader-bound map-style dataset (each item sleeps ``--item-ms``), ``--workers`` processes with ``--prefetch``
batches each in flight, a world of 2 that becomes 3 at step ``--at`` (rank 0's slice changes). Each loader is fed
by the elastic sampler; the layout change is unannounced (a recovery, or a switch no loader armed for) or, for
the Pipeline, armed ``depth`` steps ahead (what the commit protocol does before a switch):

    pipeline         Pipeline.get with the new basis: in-flight work cancelled in shared memory, cursor reset
    pipeline-armed   Pipeline.rewind at the ARM commit point: the batches of the new layout are in flight
    stateful         StatefulDataLoader.state_dict() at the commit point, load_state_dict(), iter(): new workers
    persistent       DataLoader(persistent_workers=True), iter() again: the workers finish what is queued first

Every loader hands out the same indices (checked). Usage: python bench/loader_resume.py [--item-ms 2] [--reps 3]
(torchdata: ``pip install torchdata``, or PYTHONPATH to a ``pip install --target`` copy; without it that row
says so).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from elastic_launcher.loading import Basis, Pipeline
from elastic_launcher.sampler import ElasticSampler

BEFORE, AFTER = Basis(0, (32, 32)), Basis(0, (22, 21, 21))


class Slow(torch.utils.data.Dataset):
    def __init__(self, n: int, item_s: float) -> None:
        self.n, self.item_s = n, item_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        time.sleep(self.item_s)
        return torch.tensor([i])


class Batches:
    """A stateful batch sampler over the elastic sampler: the index lists of rank ``basis().rank`` from a global
    ``(epoch, pos)``, the shape StatefulDataLoader snapshots and restores."""

    def __init__(self, sampler: ElasticSampler, basis) -> None:
        self.sampler, self.basis, self.epoch, self.pos = sampler, basis, 0, 0

    def __iter__(self):
        return self

    def __next__(self) -> list:
        b = self.basis()
        sl = self.sampler.slice_at(self.epoch, self.pos, b.rank, b.batches)
        self.epoch, self.pos = self.sampler.after(self.epoch, self.pos, b.batches)
        return sl.indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


def expected(sampler: ElasticSampler, steps: int, at: int) -> list:
    epoch, pos, out = 0, 0, []
    for t in range(steps):
        b = BEFORE if t < at else AFTER
        out.append(sampler.slice_at(epoch, pos, b.rank, b.batches).indices)
        epoch, pos = sampler.after(epoch, pos, b.batches)
    return out


def run(kind: str, args) -> tuple[float, bool]:
    """Trains ``--steps`` steps of ``--step-ms``; returns the wait for the first batch after the change, and
    whether the batches were the expected ones."""
    sampler = ElasticSampler(args.items, seed=0)
    ds, opts = Slow(args.items, args.item_ms / 1000), dict(num_workers=args.workers, prefetch_factor=args.prefetch)
    want, got, wait = expected(sampler, args.steps, args.at), [], 0.0
    state = {"known": False, "basis": BEFORE}  # the loader knows of the change; the layout in force
    if kind.startswith("pipeline"):
        pipe = Pipeline(ds, sampler, lambda s: AFTER if s >= args.at and state["known"] else BEFORE, None, opts)
        epoch = pos = 0
        for t in range(args.steps):
            if kind == "pipeline-armed" and t == args.at - pipe.depth:  # the ARM commit point
                state["known"] = True
                pipe.rewind(t, epoch, pos, args.at)
            if t == args.at:
                state["known"], state["basis"] = True, AFTER
            t0 = time.perf_counter()
            got.append(pipe.get(t, epoch, pos, state["basis"]).flatten().tolist())
            wait = time.perf_counter() - t0 if t == args.at else wait
            epoch, pos = sampler.after(epoch, pos, state["basis"].batches)
            time.sleep(args.step_ms / 1000)
        pipe.close()
        return wait, got == want
    batches = Batches(sampler, lambda: state["basis"])
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader
        loader = StatefulDataLoader(ds, batch_sampler=batches, **opts)
    else:
        loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, persistent_workers=True, **opts)
    it, snap = iter(loader), None
    for t in range(args.steps):
        if t == args.at:  # resume from the commit point before the change, with the new layout
            state["basis"] = AFTER
            t0 = time.perf_counter()
            if kind == "stateful":
                loader.load_state_dict(snap)
            else:
                batches.load_state_dict(snap)
            it = iter(loader)
        got.append(next(it).flatten().tolist())
        wait = time.perf_counter() - t0 if t == args.at else wait
        if t == args.at - 1:  # the commit point
            snap = loader.state_dict() if kind == "stateful" else position(sampler, args.at)
        time.sleep(args.step_ms / 1000)
    del it, loader
    return wait, got == want


def position(sampler: ElasticSampler, steps: int) -> dict:
    """The sampler's (epoch, pos) after ``steps`` steps of the layout before the change."""
    epoch, pos = 0, 0
    for _ in range(steps):
        epoch, pos = sampler.after(epoch, pos, BEFORE.batches)
    return {"epoch": epoch, "pos": pos}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=4096)
    p.add_argument("--item-ms", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--at", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    batch_s = 32 * args.item_ms / 1000
    print(f"{args.workers} workers x prefetch {args.prefetch}, 32 items x {args.item_ms} ms = {batch_s * 1000:.0f} ms "
          f"a batch; change at step {args.at}; median of {args.reps} (interleaved)")
    kinds = ["pipeline", "pipeline-armed", "stateful", "persistent"]
    waits: dict = {k: [] for k in kinds}
    ok: dict = {k: True for k in kinds}
    for _ in range(args.reps):
        for k in kinds:
            try:
                w, same = run(k, args)
            except ImportError as e:
                waits[k], ok[k] = None, str(e)
                continue
            if waits[k] is not None:
                waits[k].append(w)
                ok[k] = ok[k] and same
    print(f"{'loader':<16}{'first batch after the change (ms)':>36}  same indices")
    for k in kinds:
        if waits[k] is None:
            print(f"{k:<16}{'not installed':>36}  {ok[k]}")
        else:
            print(f"{k:<16}{statistics.median(waits[k]) * 1000:>36.0f}  {ok[k]}")


if __name__ == "__main__":
    main()
