"""What a checkpoint costs the training loop (issue #45.1): the main thread's part (`Checkpoints.begin`: the
rollback snapshot copied to host memory, then a writer thread starts) beside a training step, the writer's
part (DCP files, off the training thread), and a load into a fresh model and optimizer, for the templates'
models on this machine's device.

    python bench/checkpoint_cost.py --model resnet50 --batch 64 --repeats 5 --out DIR

Prints one table row per model: step ms (median), begin ms (median), write s (median), load s, checkpoint MB.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from elastic_launcher.checkpoint import Checkpoints
from elastic_launcher.examples import models
from elastic_launcher.state import TrainingState


def build(name: str, device: torch.device):
    if name == "resnet50":
        model = models.build_resnet("resnet50", 1000).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, optimizer, lambda b: F.cross_entropy(model(torch.randn(b, 3, 224, 224, device=device)),
                                                           torch.randint(0, 1000, (b,), device=device))
    size = models.GPT_SIZES[name]
    model = models.GPT(size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def loss(b):
        tokens = torch.randint(0, size.vocab, (b, size.context), device=device)
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))
    return model, optimizer, loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None, help="resnet50, gpt2-small, tiny (repeatable)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp()))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print(f"{'model':<12} {'params M':>8} {'step ms':>8} {'begin ms':>9} {'write s':>8} {'load s':>7} {'MB':>7}")
    for name in args.model or ["resnet50", "gpt2-small"]:
        model, optimizer, loss_of = build(name, device)
        state = TrainingState(model, optimizer, device=device)
        steps, begins, writes = [], [], []
        ckpts = Checkpoints(args.out / name)
        for i in range(args.repeats + 2):
            sync(device)
            t0 = time.perf_counter()
            loss_of(args.batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(device)
            t1 = time.perf_counter()
            state.counters["step"] = i + 1
            snap = state.snapshot()          # what the trainer does at a commit point
            sync(device)
            t2 = time.perf_counter()
            ckpts.begin(state, snap)         # what rank 0 adds at a commit point when a checkpoint is due
            t3 = time.perf_counter()
            ckpts.wait()
            t4 = time.perf_counter()
            if i >= 2:                       # the first two: allocator and CUDA warm-up
                steps.append(t1 - t0)
                begins.append(t3 - t2)
                writes.append(t4 - t3)
        latest = ckpts.latest()
        mb = sum(p.stat().st_size for p in latest.iterdir()) / 2 ** 20
        fresh_model, fresh_opt, _ = build(name, device)
        t0 = time.perf_counter()
        resumed = Checkpoints(args.out / name).load(TrainingState(fresh_model, fresh_opt, device=device))
        sync(device)
        load_s = time.perf_counter() - t0
        assert resumed.step == args.repeats + 2
        for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()):
            assert torch.equal(a, b)
        n = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"{name:<12} {n:>8.1f} {statistics.median(steps) * 1e3:>8.1f} {statistics.median(begins) * 1e3:>9.1f} "
              f"{statistics.median(writes):>8.2f} {load_s:>7.2f} {mb:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
