"""The calibration job (issue #38.2): what this cluster's links and hosts cost DDP, measured in about a minute.

`elastic-predictor calibrate` writes (or submits) an sbatch script that runs this module once per rank with
`srun` inside an allocation of 1-2 nodes (one rank a GPU; CPU ranks with gloo where there are no GPUs). Rank r is
`SLURM_PROCID`, the world `SLURM_NTASKS`, the rendezvous `MASTER_ADDR:MASTER_PORT` (the batch host, set by the
script). The job:

1. **links**: every rank probes its host (`links.HostFacts.probe`); the facts are gathered and the layout's links
   labelled by the launcher's own rules (`links.links_for`), so the rows speak of the links jobs' rows name;
2. **all-reduce sweeps per link**, at world 2: two ranks of one node (the intra-node link) and the first ranks of
   two nodes (the inter-node link), each pair alone while the others wait, with `sweep` (the sweep of
   bench/coldstart_collect.py: 4 KiB up, two timed windows per size, within a time budget): `collective` rows;
3. **DDP's host overhead**: each probe model of `PROBES` (many small tensors, a few large ones at two sizes, one
   in between with a small bucket cap, so that per-step, per-bucket, per-tensor and per-byte costs separate) is
   timed in `rounds` rounds of a plain window (forward, backward, optimizer step, no DDP) and a DDP window, at
   world 1 (rank 0 alone on a group of one, the others waiting) and at the job's world: `ddp_overhead` rows with
   the buckets, gradient tensors and bytes of the probe as DDP's reducer built them (`ddp_shape`, else counted
   by a communication hook: `hooked_shape`), `plain_s` and `ddp_s` (median windows, the slowest rank's) and
   `extra_s` (median over rounds of DDP minus plain);
4. rank 0 posts the rows to the prediction service signed with the job's munge credential (`PredictorClient`,
   as the launcher posts a job's rows; never a bearer token), writes them to `--out` (JSON lines, importable
   with `elastic-predictor import`) and prints each probe (the service fits the host constants on them:
   `elastic-predictor model show`). Exit status 0 only when every row was stored.

The job's sbatch script is `slurm_plugin.calibration.job_script`'s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_launcher.links import HostFacts, gpu_type_of, links_for
from elastic_launcher.observations import postable
from elastic_launcher.reporting import PredictorClient
from slurm_plugin.calibration import ROUNDS, SWEEP_BUDGET_S, WINDOW_S

__all__ = ["PROBES", "Probe", "agree", "measure_probe", "sweep", "sync", "windows"]

SWEEP_BYTES = [2**k for k in range(12, 29)]  # 4 KiB .. 256 MiB
CPU_SWEEP_MAX_BYTES = 1 << 26                 # gloo on CPU: up to 64 MiB (a larger one takes seconds)
SOURCE = "calibrate"


# ---------------------------------------------------------------------------------------------- timing helpers
def sync(device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agree(x: float, device, group=None) -> float:
    """The largest of every rank's x in `group` (ranks must run the same number of collectives and steps)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def windows(run_steps: Callable[[int], None], device, est_s: float, target_s: float, n_windows: int,
            max_steps: int = 30) -> list[float]:
    """Mean seconds per step of `n_windows` windows, each long enough for ~target_s (2..max_steps), one sync each."""
    n = max(2, min(max_steps, math.ceil(target_s / max(est_s, 1e-4))))
    out = []
    for _ in range(n_windows):
        sync(device)
        t0 = time.perf_counter()
        run_steps(n)
        sync(device)
        out.append((time.perf_counter() - t0) / n)
    return out


def sweep(device, world: int, link: str, budget_s: float, emit, group=None, sizes: Sequence[int] = SWEEP_BYTES) -> None:
    """All-reduce seconds per size on this transport: two windows per size, ~0.15 s each (2..50 ops), sizes in
    order until `budget_s` has passed (agreed over `group`). Emits `{"kind": "collective", "link", "op", "world",
    "bytes", "seconds", "rep", "n_ops"}`."""
    deadline = time.monotonic() + budget_s
    for nbytes in sizes:
        if agree(float(time.monotonic() > deadline), device, group):
            break
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(t, group=group)
        sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        sync(device)
        est = agree(time.perf_counter() - t0, device, group)
        n = max(2, min(50, math.ceil(0.15 / max(est, 1e-6))))
        for rep in range(2):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t, group=group)
            sync(device)
            emit({"kind": "collective", "link": link, "op": "allreduce", "world": world, "bytes": nbytes,
                  "seconds": (time.perf_counter() - t0) / n, "rep": rep, "n_ops": n})
        del t


# ---------------------------------------------------------------------------------------------- probe models
@dataclass(frozen=True)
class Probe:
    """A probe model: `layers` bias-free square Linear layers of `width` (one gradient tensor of width^2 elements
    each), trained at `batch` rows, under DDP with `bucket_cap_mb` (None: DDP's default, a first bucket of 1 MiB
    then 25 MiB; a cap given to DDP is its first bucket's too, torch 2.13)."""

    name: str
    layers: int
    width: int
    bucket_cap_mb: Optional[float] = None
    batch: int = 8

    def build(self, device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(self.width, self.width, bias=False)
                                      for _ in range(self.layers)])
        with torch.no_grad():
            for layer in model:   # variance-preserving, so 400 layers neither vanish (denormals) nor blow up
                torch.nn.init.normal_(layer.weight, std=self.width ** -0.5)
        return model.to(device)

    def ddp(self, device, group):
        """A fresh copy of the probe under DDP on `group`, with the probe's bucket cap (DDP's default where None)."""
        cap = {} if self.bucket_cap_mb is None else {"bucket_cap_mb": self.bucket_cap_mb}
        return DDP(self.build(device), process_group=group, device_ids=[device.index] if device.type == "cuda"
                   else None, **cap)


# many small tensors (host-bound: DDP's per-tensor work), a few large ones (per bucket and per byte: DDP copies
# each gradient into its bucket and back, host work on CPU), the same at a quarter of the bytes, and one in
# between whose small bucket cap gives it a bucket a tensor: the shapes (buckets, tensors, MiB) are (2, 400, 1.6),
# (3, 4, 64), (2, 4, 16) and (40, 40, 10), so a per-step, per-bucket, per-tensor and per-byte cost are each
# pinned by a probe.
PROBES = (Probe("many-small-400x1k", 400, 32), Probe("few-large-4x4m", 4, 2048), Probe("few-mid-4x1m", 4, 1024),
          Probe("mid-40x64k-cap0.25", 40, 256, bucket_cap_mb=0.25))


def _stepper(model, opt, x) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
    return run


def ddp_shape(ddp_model) -> tuple[int, int, int] | None:
    """(buckets, gradient tensors, gradient bytes) of a DDP model as its reducer holds them now (after its first
    step: the buckets it rebuilt in gradient-ready order); None where this torch's reducer does not say."""
    try:
        buckets = ddp_model.reducer._get_zeros_like_grad_buckets()
    except (AttributeError, RuntimeError):
        return None
    return (len(buckets), sum(len(b.parameters()) for b in buckets),
            sum(b.buffer().numel() * b.buffer().element_size() for b in buckets))


def hooked_shape(probe: Probe, device, group, steps: int = 3) -> tuple[int, int, int]:
    """(buckets, gradient tensors, gradient bytes) of the probe under DDP, counted by a communication hook (public
    API) over the last of `steps` backward passes of a fresh copy: after the first, DDP has rebuilt its buckets."""
    model = probe.ddp(device, group)
    seen: list[tuple[int, int]] = []

    def hook(_state, bucket):
        seen.append((len(bucket.parameters()), bucket.buffer().numel() * bucket.buffer().element_size()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, hook)
    x = torch.randn(probe.batch, probe.width, device=device)
    for _ in range(steps):
        seen.clear()
        model(x).square().mean().backward()
    return len(seen), sum(t for t, _ in seen), sum(b for _, b in seen)


def measure_probe(probe: Probe, device, group, world: int, rounds: int, window_s: float, warmup: int = 3) -> dict:
    """Time `probe` plain and under DDP on `group` (`world` ranks; every rank of the group calls this) in `rounds`
    rounds of a plain window then a DDP window; returns the `ddp_overhead` row (without `gpu` and job fields).

    Both steps train the same parameters with the same optimizer: the plain step calls the wrapped module itself
    (DDP's reducer then expects no gradients and its hooks return at once, as under `no_sync()`), so the two
    differ by what DDP does, not by where two copies' memory lies (two copies stepped at different speeds on
    the lab's CPU).
    plain_s and ddp_s are the medians of the windows' mean steps, extra_s the median over rounds of DDP minus
    plain (each window the slowest rank's: `agree` over the group)."""
    ddp_model = probe.ddp(device, group)
    x = torch.randn(probe.batch, probe.width, device=device)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=1e-4)
    run_plain = _stepper(ddp_model.module, opt, x)
    run_ddp = _stepper(ddp_model, opt, x)
    est = {}
    for name, run in (("ddp", run_ddp), ("plain", run_plain)):    # DDP rebuilds its buckets after its first step
        run(1)
        sync(device)
        t0 = time.perf_counter()
        run(warmup)
        sync(device)
        est[name] = agree((time.perf_counter() - t0) / warmup, device, group)
    plain_w, ddp_w = [], []
    for _ in range(rounds):
        plain_w.append(agree(windows(run_plain, device, est["plain"], window_s, 1)[0], device, group))
        ddp_w.append(agree(windows(run_ddp, device, est["ddp"], window_s, 1)[0], device, group))
    buckets, tensors, nbytes = ddp_shape(ddp_model) or hooked_shape(probe, device, group)
    return {"kind": "ddp_overhead", "world": world, "probe": probe.name, "buckets": buckets, "tensors": tensors,
            "bytes": nbytes,
            "plain_s": statistics.median(plain_w), "ddp_s": statistics.median(ddp_w),
            "extra_s": statistics.median(d - p for d, p in zip(ddp_w, plain_w))}


# ---------------------------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class Rank:
    """This process's place: rank, world, node index (SLURM_NODEID), local rank (SLURM_LOCALID)."""

    rank: int
    world: int
    node: int
    local: int

    @classmethod
    def from_env(cls, env=os.environ) -> "Rank":
        return cls(int(env.get("SLURM_PROCID", env.get("RANK", "0"))),
                   int(env.get("SLURM_NTASKS", env.get("WORLD_SIZE", "1"))),
                   int(env.get("SLURM_NODEID", "0")), int(env.get("SLURM_LOCALID", env.get("LOCAL_RANK", "0"))))


def pairs(nodes: Sequence[int]) -> list[tuple[str, tuple[int, int]]]:
    """The rank pairs of the per-link sweeps, from each rank's node index: ("intra", two ranks of the first node
    with two) and ("inter", the first ranks of the first two nodes), where the allocation has them."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    out = []
    two = next((ranks for ranks in by_node.values() if len(ranks) >= 2), None)
    if two:
        out.append(("intra", (two[0], two[1])))
    if len(by_node) >= 2:
        first = [ranks[0] for ranks in by_node.values()]
        out.append(("inter", (first[0], first[1])))
    return out


def run(args) -> int:
    started = time.monotonic()
    me = Rank.from_env()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(me.local)
        device = torch.device("cuda", me.local)
        gpu = gpu_type_of(torch.cuda.get_device_name(device))
    else:
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        device = torch.device("cpu")
        gpu = "cpu"
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, rank=me.rank, world_size=me.world, device_id=device if cuda else None)
    side = dist.new_group(backend="gloo")      # others wait here: a CPU barrier, no NCCL kernel spinning
    facts = HostFacts.probe(backend, gpu_index=me.local if cuda else None,
                            gpu_name=torch.cuda.get_device_name(device) if cuda else None)
    every: list = [None] * me.world
    dist.all_gather_object(every, {"node": me.node, "facts": facts.to_json()}, group=side)
    nodes = [e["node"] for e in every]
    layout = [nodes.count(n) for n in sorted(set(nodes), key=nodes.index)]
    node_facts = [HostFacts.from_json(every[nodes.index(n)]["facts"]) for n in sorted(set(nodes), key=nodes.index)]
    links = links_for(layout, node_facts)
    rows: list[dict] = []
    sizes = SWEEP_BYTES if cuda else [b for b in SWEEP_BYTES if b <= CPU_SWEEP_MAX_BYTES]
    swept = set()
    for which, pair in pairs(nodes):
        link = links.intra if which == "intra" else links.inter
        group = dist.new_group(list(pair))          # every rank makes every group, in one order
        if link in swept:
            continue
        swept.add(link)
        if me.rank in pair:
            timed: list[dict] = []
            sweep(device, 2, link, args.sweep_budget_s, timed.append, group=group, sizes=sizes)
            if me.rank == pair[0]:                  # the pair's first rank's timings: one row per window
                rows += [{**{k: v for k, v in rec.items() if k not in ("rep", "n_ops")},
                          "nodes": 1 if which == "intra" else 2, "link_source": links.source} for rec in timed]
        dist.barrier(group=side)
    solo = dist.new_group([0])
    for probe in PROBES:
        if me.rank == 0:
            rows.append(measure_probe(probe, device, solo, 1, args.rounds, args.window_s))
        dist.barrier(group=side)
        if me.world > 1:
            rows.append(measure_probe(probe, device, None, me.world, args.rounds, args.window_s))
    if me.rank != 0:
        rows = [r for r in rows if r["kind"] == "collective"]
    gathered: list = [None] * me.world
    dist.all_gather_object(gathered, rows, group=side)
    dist.barrier(group=side)
    dist.destroy_process_group()
    if me.rank != 0:
        return 0
    job = os.environ.get("SLURM_JOB_ID")
    extra = {"source": SOURCE, **({"job_id": int(job)} if job and job.isdigit() else {})}
    rows = [dict(r, gpu=gpu, **extra) for rank_rows in gathered for r in rank_rows]
    return report(rows, args, job, layout, links, time.monotonic() - started)


def report(rows: list[dict], args, job: Optional[str], layout, links, wall_s: float) -> int:
    """Rank 0: write the rows, post them signed for the job, print what they say; 0 when all were stored."""
    kept, refused = postable(rows)
    if args.out:
        with open(args.out, "w") as out:
            out.writelines(json.dumps(r, sort_keys=True) + "\n" for r in kept)
    coll = [r for r in kept if r["kind"] == "collective"]
    probes = [r for r in kept if r["kind"] == "ddp_overhead"]
    print(f"calibrate: layout {layout}, links intra {links.intra} inter {links.inter} ({links.source}); "
          f"{len(coll)} collective rows over {sorted({r['link'] for r in coll}) or 'no link (one rank)'}, "
          f"{len(probes)} ddp_overhead rows; {wall_s:.1f} s", flush=True)
    for r in probes:
        print(f"  probe {r['probe']:<20} world {r['world']}  buckets {r['buckets']:>3}  tensors {r['tensors']:>4}  "
              f"MiB {r['bytes'] / 2**20:5.1f}  "
              f"plain {r['plain_s'] * 1e3:8.2f} ms  ddp {r['ddp_s'] * 1e3:8.2f} ms  extra {r['extra_s'] * 1e3:7.2f} ms",
              flush=True)
    for why in refused:
        print(f"calibrate: not posted: {why}", file=sys.stderr, flush=True)
    if not args.predictor:
        print("calibrate: no --predictor: rows written only", flush=True)
        return 0 if not refused else 1
    client = PredictorClient(args.predictor, None, timeout_s=args.timeout_s,
                             job_id=int(job) if job and job.isdigit() else None,
                             munge_socket=os.environ.get("ELASTIC_MUNGE_SOCKET") or None, retries=2)
    if client.job_id is None:
        print("calibrate: not in a Slurm job (no SLURM_JOB_ID): nothing posted (rows are signed for their job)",
              file=sys.stderr, flush=True)
        return 1
    ok = client.observe(kept)
    print(f"calibrate: {'posted' if ok else 'NOT posted'} {len(kept)} rows to {args.predictor} signed for job {job}"
          + ("" if ok else f": {client.last_error}"), flush=True)
    return 0 if ok and not refused else 1


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous of rank 0, which binds it moments later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m elastic_launcher.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--predictor", default=None, help="the prediction service's URL (rows are posted there)")
    ap.add_argument("--out", default=None, help="also write the rows to this JSON lines file (rank 0)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--sweep-budget-s", type=float, default=SWEEP_BUDGET_S, help="seconds of each link's sweep")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of (plain, DDP) windows per probe and world")
    ap.add_argument("--window-s", type=float, default=WINDOW_S, help="target length of one timing window")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="limit of one post to the service")
    ap.add_argument("--free-port", action="store_true", help="print a free TCP port and exit (the job script's)")
    args = ap.parse_args(argv)
    if args.free_port:
        print(free_port())
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
