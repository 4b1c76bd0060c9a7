"""Python work on the training step's hot path, counted instead of timed: how many function calls (Python and C,
through ``sys.setprofile``) one plain step (no commit point) makes in the trainer's three hot-path parts:

    next      the loader handing out the next batch (``next(it)``)
    backward  ``loss.backward()`` (DDP's communication hook runs inside)
    commit    ``ElasticTrainer.commit()``

World of one, gloo, a ``Linear(4, 1)`` model, the default ``Telemetry``; commit points are pushed out of the counted
steps (``commit_every=10**6``). Counts do not depend on the machine's load, so a restructuring of the trainer can be
compared with an older checkout in one run on a shared machine where step timings drown in noise
(issue #12: the steady step gains no work). Telemetry times a varying share of the steps (its ``time_every`` adapts
to measured times), so a fractional difference in its calls (``perf_counter``, ``dict.setdefault``) is sampling, not
code; likewise the hook's ``finish`` callback (and its ``.value``), which runs on the training thread only when gloo's
allreduce completed before ``then`` was called (a race) and on gloo's thread otherwise, uncounted.

Usage: python bench/step_calls.py [--against DIR] [--out FILE]
    --against DIR: another checkout's root (e.g. ``git worktree add /tmp/base <commit>`` or ``git archive``), run
    in a subprocess beside this one; the table then gives both and the calls that differ.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("next", "backward", "commit")
FIRST, COUNTED = 100, 100  # steps before counting (the first ones hold commit points), steps counted


def count_calls() -> dict:
    """Runs the counted steps with the elastic_launcher first on sys.path; returns {part: {call: per step}}."""
    import torch
    import torch.distributed as dist

    from elastic_launcher.batch_policy import BatchPolicy
    from elastic_launcher.membership import Coordinator
    from elastic_launcher.telemetry import Telemetry
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig

    torch.manual_seed(0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    Coordinator(dist.PrefixStore("job", store)).start(["solo"])
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    et = ElasticTrainer(model, opt, store_addr=f"127.0.0.1:{store.port}/job", worker_id="solo",
                        policy=BatchPolicy(per_gpu_batch=4), telemetry=Telemetry(profile="mlp"),
                        config=TrainerConfig(commit_every=10 ** 6, max_commit_every=10 ** 6))
    if hasattr(et, "join"):  # #27.3: the constructor no longer joins (an --against checkout before it does)
        et.join()
    data = torch.utils.data.TensorDataset(torch.randn(4096, 4), torch.randn(4096, 1))
    counts = {p: collections.Counter() for p in PARTS}
    part = [PARTS[0]]

    def profile(frame, event, arg):
        if event == "call":
            counts[part[0]][frame.f_code.co_name] += 1
        elif event == "c_call":
            counts[part[0]]["C:" + getattr(arg, "__qualname__", str(arg))] += 1

    def counted(name: str, on: bool, fn):
        if on:
            part[0] = name
            sys.setprofile(profile)
        try:
            return fn()
        finally:
            sys.setprofile(None)

    it = et.loader(data, max_steps=FIRST + COUNTED + 10)
    try:
        for step in range(FIRST + COUNTED):
            on = step >= FIRST
            x, y = counted("next", on, lambda: next(it))
            loss = torch.nn.functional.mse_loss(et.model(x), y)
            counted("backward", on, loss.backward)
            opt.step()
            opt.zero_grad()
            counted("commit", on, et.commit)
    finally:
        et.close()
    return {p: {k: v / COUNTED for k, v in c.items() if k != "C:setprofile"} for p, c in counts.items()}


def _run(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], env=env, cwd=str(root),
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"step_calls in {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rev(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "?"
    except OSError:
        return "?"


def table(runs: dict[str, dict]) -> str:
    names = list(runs)
    lines = ["| part | " + " | ".join(f"{n} calls a step" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for p in PARTS:
        lines.append(f"| {p} | " + " | ".join(f"{sum(runs[n][p].values()):.2f}" for n in names) + " |")
    if len(names) == 2:
        a, b = (runs[n] for n in names)
        lines.append("")
        lines.append(f"Calls that differ ({names[0]} -> {names[1]}, per step):")
        for p in PARTS:
            diff = {k: (a[p].get(k, 0), b[p].get(k, 0)) for k in set(a[p]) | set(b[p])
                    if abs(a[p].get(k, 0) - b[p].get(k, 0)) > 1e-9}
            text = ", ".join(f"{k} {x:g} -> {y:g}" for k, (x, y) in sorted(diff.items())) or "none"
            lines.append(f"- {p}: {text}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, help="another checkout's root, counted beside this one")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(count_calls()))
        return
    runs = {}
    if args.against is not None:
        rev = _rev(args.against)
        runs[args.against.name if rev == "?" else f"{args.against.name} ({rev})"] = _run(args.against.resolve())
    runs[f"this checkout ({_rev(ROOT)})"] = _run(ROOT)
    text = (f"# step_calls: function calls a plain step makes on the hot path\n\n"
            f"`python bench/step_calls.py{' --against ' + args.against.name if args.against else ''}`; "
            f"world of one, gloo, {COUNTED} steps counted after {FIRST}.\n\n" + table(runs))
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
