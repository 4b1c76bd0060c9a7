"""Survivors' pause on a resize: our in-process path vs two baselines, same run, same machine.

Pause = from the decision (the step boundary at which the resize is taken) to the end of the first completed
training step at the new size (CUDA-synchronised), measured on rank 0 of the survivors.

Paths, each for grow 2->4 and shrink 4->2 of data-parallel training (one process per GPU):
  ours     ElasticTrainer: newcomers start, build the model, warm up (``ElasticTrainer(warm_up=...)``: two local
           training steps before the worker announces itself, state put back) and build the next communicator
           while the survivors keep training; at a commit point the old group is aborted, state is broadcast to
           newcomers, DDP is re-wrapped (no init sync) and training goes on.
  plain    (a) destroy_process_group, init_process_group on a new store prefix, broadcast of the state
           (DDP's init sync for the model, per-tensor broadcasts for optimizer state), first DDP step. Newcomers
           are already running and have built their model (same head start as ours, but no communicator).
  ours-compute  ours, but newcomers warm up forward and backward only (no optimizer step): what warm_up saves.
  restart  (b) checkpoint-and-restart: rank 0 saves model+optimizer to local disk, every process exits, new
           interpreters start, import, build, init NCCL, load, first step.

Models: resnet50 (torchvision, batch 64/GPU, synthetic 224x224, SGD), gpt2 (transformers GPT-2 small config,
random init, batch 8x1024 tokens/GPU, AdamW); bf16 autocast. ``--device cpu --models tiny`` runs the same
protocol on gloo for debugging.

Usage (GPU host, 4 GPUs):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python3 bench/gpu_transition.py --models resnet50,gpt2 --out bench/results/gpu_transition.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

T_PROC = time.perf_counter()  # this process's start (before torch's import): a newcomer's start-up phases

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo: elastic_launcher

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import interleaved  # noqa: E402
import steady_goodput  # noqa: E402
from gpu_common import (ROOT, STORE_TIMEOUT, Controller, LoadedItems, Synthetic, build, client, device_of,  # noqa: E402
                        local_warmup, sync, to_device)

WARM_STEPS = 12      # steps before a resize is requested
AFTER_STEPS = 8      # steps at a size before the next request


def worker_ours(args) -> None:
    from elastic_launcher.batch_policy import BatchPolicy
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
    dev = device_of(args)
    model, opt, b, make_batch, loss_fn = build(args.model, dev)
    bench = client(args, "bench")

    def local_step(m):
        loss_fn(m, make_batch(b)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if args.newcomer and args.compute_warmup:
        local_warmup(model, opt, make_batch, loss_fn, b, dev)
    cfg = TrainerConfig(backend="nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=120),
                        heartbeat_interval=timedelta(seconds=0.05))
    et = ElasticTrainer(model, opt, store_addr=f"{args.host}:{args.port}/job", worker_id=args.wid,
                        policy=BatchPolicy(per_gpu_batch=b, lr_scaling="none"), device=dev, config=cfg,
                        warm_up=local_step if args.newcomer and not args.compute_warmup else None)
    if args.loader_workers:  # items built on the CPU by DataLoader workers (item_ms each), pinned, copied over
        data = LoadedItems(make_batch, args.item_ms)
        options = dict(num_workers=args.loader_workers, pin_memory=dev.type == "cuda", persistent_workers=True,
                       prefetch_factor=4)
        et.prepare_loader(data, **options)  # workers started and a batch loaded before the worker announces itself
    et.join()
    times, last, stop_at, phases = [], None, None, []
    if args.loader_workers:
        batches = et.loader(data, **options)
        batches = (to_device(batch, dev) for batch in batches)
    else:
        batches = et.loader(Synthetic(100_000), collate_fn=lambda items: make_batch(len(items)))
    for batch in batches:
        ph = [time.perf_counter()]
        loss = loss_fn(et.model, batch)
        if args.phases:
            sync(dev)
            ph.append(time.perf_counter())
        loss.backward()
        if args.phases:
            sync(dev)
            ph.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.phases:
            sync(dev)
            ph.append(time.perf_counter())
        world = et.world_size
        alive = et.commit()  # a commit point's vote syncs the device
        now = time.perf_counter()
        if args.phases:  # (world of the step, forward, backward, optimizer, commit) seconds
            phases.append([world] + [b_ - a_ for a_, b_ in zip(ph, ph[1:] + [now])])
        if last is not None:
            times.append((et.world_size if alive else 0, now - last))
        last = now
        if not alive:
            break
        bench.set(f"prog/{args.wid}", str(et.step))
        if et.step % 4 == 0 and bench.check(["stop_at"]):
            stop_at = int(bench.get("stop_at"))
        if stop_at is not None and et.step >= stop_at:
            break
    loading = et.loading
    bench.set(f"res/{args.wid}", json.dumps({"times": times, "switches": et.switches, "phases": phases,
                                             "dropped": loading.dropped, "resets": loading.resets}))
    et.close()


def _bcast_optimizer(opt, src: int = 0) -> None:
    for st in opt.state.values():
        for k in sorted(st):
            t = st[k]
            if torch.is_tensor(t) and t.numel() > 1:
                dist.broadcast(t, src)


def worker_plain(args) -> None:
    """Baseline (a): default group, destroyed and re-initialised at the resize."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = device_of(args)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    model, opt, b, make_batch, loss_fn = build(args.model, dev)
    bench = client(args, "bench")
    ids = dict(device_ids=[args.gpu]) if dev.type == "cuda" else {}
    epoch = args.epoch
    if args.newcomer:
        local_warmup(model, opt, make_batch, loss_fn, b, dev)
        loss_fn(model, make_batch(b)).backward()
        for p in model.parameters():
            p.grad.zero_()
        opt.step()  # allocates optimizer state (overwritten by the broadcast)
        opt.zero_grad(set_to_none=True)
        sync(dev)
        bench.set(f"ready/{args.wid}", "1")
    members = json.loads(bench.get(f"plain/members/{epoch}"))
    t_decide = None
    step = 0
    times: list = []
    last = 0.0
    while True:
        rank = members.index(args.wid)
        dist.init_process_group(backend, store=client(args, f"plain/pg/{epoch}"), rank=rank,
                                world_size=len(members), timeout=timedelta(seconds=120))
        ddp = DDP(model, **ids)  # init sync: broadcast of parameters and buffers from rank 0
        if t_decide is not None or args.newcomer:
            _bcast_optimizer(opt)
        first = True
        estep = 0  # steps in this group: the same count on every rank, unlike the global step
        while True:
            loss = loss_fn(ddp, make_batch(b))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            sync(dev)
            step += 1
            estep += 1
            now = time.perf_counter()
            if not first and rank == 0:
                times.append(now - last)
            last = now
            if first and t_decide is not None and rank == 0:
                bench.set(f"plain/pause/{epoch}", repr(time.perf_counter() - t_decide))
            first = False
            bench.set(f"prog/{args.wid}", str(step))
            key = f"plain/at/{epoch}"
            if rank == 0 and not bench.check([key]) and (bench.check([f"plain/members/{epoch + 1}"])
                                                         or bench.check(["stop"])):
                bench.set(key, str(estep + 3))
            if bench.check([key]) and estep >= int(bench.get(key)):
                if bench.check(["stop"]):
                    dist.destroy_process_group()
                    if rank == 0:
                        bench.set("plain/step_s", repr(statistics.median(times)))
                    return
                break
        t_decide = time.perf_counter()  # the decision: this step boundary
        epoch += 1
        members = json.loads(bench.get(f"plain/members/{epoch}"))
        del ddp
        dist.destroy_process_group()
        if args.wid not in members:
            return
        args.newcomer = False


def worker_restart(args) -> None:
    """Baseline (b): one generation of processes; resumes from a checkpoint if one is named."""
    t_start = time.time()
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = device_of(args)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    model, opt, b, make_batch, loss_fn = build(args.model, dev)
    bench = client(args, "bench")
    gen = args.epoch
    members = json.loads(bench.get(f"restart/members/{gen}"))
    rank = members.index(args.wid)
    dist.init_process_group(backend, store=client(args, f"restart/pg/{gen}"), rank=rank,
                            world_size=len(members), timeout=timedelta(seconds=120))
    if args.ckpt:
        state = torch.load(args.ckpt, map_location=dev, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    ddp = DDP(model, **(dict(device_ids=[args.gpu]) if dev.type == "cuda" else {}))
    step = 0
    while True:
        loss = loss_fn(ddp, make_batch(b))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        sync(dev)
        step += 1
        if step == 1 and rank == 0:
            bench.set(f"restart/first/{gen}", json.dumps({"t": time.time(), "t_start": t_start}))
        bench.set(f"prog/{args.wid}", str(step))
        key = f"restart/at/{gen}"
        if rank == 0 and not bench.check([key]) and (bench.check([f"restart/req/{gen + 1}"]) or bench.check(["stop"])):
            bench.set(key, str(step + 3))
        if bench.check([key]) and step >= int(bench.get(key)):
            if rank == 0 and not bench.check(["stop"]):
                t = time.time()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.ckpt_out)
                bench.set(f"restart/decide/{gen}", repr(t))
            break
    dist.destroy_process_group()


def run_ours(c: Controller, compute_warmup: bool = False) -> dict:
    from elastic_launcher.membership import Coordinator
    extra = (("--compute-warmup",) if compute_warmup else ()) + (("--phases",) if c.args.phases else ()) + \
        ("--loader-workers", str(c.args.loader_workers), "--item-ms", str(c.args.item_ms))
    coord = Coordinator(dist.PrefixStore("job", c.server), timeout=STORE_TIMEOUT)
    S, L = c.args.small, c.args.large
    keep = [f"w{i}" for i in range(S)]
    coord.start(keep)
    ps = [c.spawn("ours", w, i, extra=extra) for i, w in enumerate(keep)]
    out = {"grow": [], "shrink": []}
    nxt = S
    for cycle in range(c.args.cycles):
        news = [f"w{nxt + i}" for i in range(L - S)]
        c.wait_step("w0", WARM_STEPS if cycle == 0 else coord_step(c) + AFTER_STEPS)
        newps = [c.spawn("ours", w, S + i, True, extra=extra) for i, w in enumerate(news)]
        plan = coord.request_resize(keep + news)
        out["grow"].append(coord.wait_switched(plan))
        c.wait_step("w0", coord_step(c) + AFTER_STEPS)
        plan = coord.request_resize(keep)
        out["shrink"].append(coord.wait_switched(plan))
        c.reap(newps)
        nxt += L - S
    c.wait_step("w0", coord_step(c) + 2)
    c.bench.set("stop_at", str(coord_step(c) + 8))
    c.reap(ps)
    res = json.loads(c.bench.get("res/w0"))
    news = [json.loads(c.bench.get(f"res/w{i}")) for i in range(S, nxt)]
    out["newcomers"] = [sw for r in news for sw in r["switches"]]
    out["loading"] = {"w0": (res["dropped"], res["resets"]), "newcomers": [(r["dropped"], r["resets"]) for r in news]}
    print(f"# loader ({c.args.loader_workers} workers, {c.args.item_ms} ms an item): batches dropped / projection "
          f"resets: w0 {out['loading']['w0']}, newcomers {out['loading']['newcomers']}", flush=True)
    if c.args.phases:
        out["phases"] = {"w0": res["phases"], "newcomers": [r["phases"] for r in news]}
    steady = [t for w, t in res["times"] if w == S]
    out["step_s_small"] = statistics.median(steady) if steady else float("nan")
    steady4 = [t for w, t in res["times"] if w == L]
    out["step_s_large"] = statistics.median(steady4) if steady4 else float("nan")
    return out


def coord_step(c: Controller) -> int:
    return int(c.bench.get("prog/w0"))


def run_plain(c: Controller) -> dict:
    out = {"grow": [], "shrink": []}
    S, L = c.args.small, c.args.large
    keep = [f"p{i}" for i in range(S)]
    c.bench.set("plain/members/0", json.dumps(keep))
    ps = [c.spawn("plain", w, i, epoch=0) for i, w in enumerate(keep)]
    epoch, nxt = 0, S
    for cycle in range(c.args.cycles):
        c.wait_step("p0", WARM_STEPS if cycle == 0 else int(c.bench.get("prog/p0")) + AFTER_STEPS)
        news = [f"p{nxt + i}" for i in range(L - S)]
        newps = [c.spawn("plain", w, S + i, True, epoch + 1) for i, w in enumerate(news)]
        for w in news:  # newcomers have started, built and warmed up their model (same head start as ours)
            c.wait_key(f"ready/{w}")
        c.bench.set(f"plain/members/{epoch + 1}", json.dumps(keep + news))
        epoch += 1
        out["grow"].append({"pause_s": float(c.wait_key(f"plain/pause/{epoch}"))})
        c.wait_step("p0", int(c.bench.get("prog/p0")) + AFTER_STEPS)
        c.bench.set(f"plain/members/{epoch + 1}", json.dumps(keep))
        epoch += 1
        out["shrink"].append({"pause_s": float(c.wait_key(f"plain/pause/{epoch}"))})
        c.reap(newps)
        nxt += L - S
    c.wait_step("p0", int(c.bench.get("prog/p0")) + 2)
    c.bench.set("stop", "1")
    c.reap(ps)
    c.bench.delete_key("stop")
    out["step_s"] = float(c.bench.get("plain/step_s"))
    return out


def run_restart(c: Controller) -> dict:
    out = {"grow": [], "shrink": []}
    ck = os.path.join(c.args.tmp, f"ckpt_{c.args.model}_{{}}.pt")
    sizes = [c.args.small, c.args.large, c.args.small]
    ps: list = []
    for gen, n in enumerate(sizes):
        if gen:
            c.bench.set(f"restart/req/{gen}", "1")  # ask the running generation to save and exit
            decide = float(c.wait_key(f"restart/decide/{gen - 1}"))
            c.reap(ps)
        wids = [f"r{gen}_{i}" for i in range(n)]
        c.bench.set(f"restart/members/{gen}", json.dumps(wids))
        ps = [c.spawn("restart", w, i, epoch=gen, ckpt=ck.format(gen - 1) if gen else "", ckpt_out=ck.format(gen))
              for i, w in enumerate(wids)]
        if gen:
            first = json.loads(c.wait_key(f"restart/first/{gen}"))
            out["grow" if n > sizes[gen - 1] else "shrink"].append(
                {"pause_s": first["t"] - decide, "startup_s": first["t_start"] - decide})
        c.wait_step(wids[0], WARM_STEPS if gen == 0 else AFTER_STEPS)
    c.bench.set("stop", "1")
    c.reap(ps)
    c.bench.delete_key("stop")
    for gen in range(len(sizes)):
        if os.path.exists(ck.format(gen)):
            os.remove(ck.format(gen))
    return out


def phase_rows(model: str, path: str, ph: dict, S: int, L: int) -> list[str]:
    """Where the first step at a new size goes: forward / backward / optimizer / commit, medians in ms."""
    def med(steps: list) -> str:
        return " | ".join(f"{statistics.median(s[i] for s in steps) * 1e3:.1f}" for i in range(1, 5)) if steps \
            else "- | - | - | -"
    w0 = ph["w0"]
    first = [i for i in range(1, len(w0)) if w0[i][0] != w0[i - 1][0]]
    # not steady: the step whose commit switched, and the first two at the new size (DDP rebuilds buckets in its 2nd)
    after = {i for j in first for i in (j - 1, j, j + 1)}
    rows = [(f"rank 0 steady @{S}", [x for i, x in enumerate(w0) if x[0] == S and i not in after and i > 2]),
            (f"rank 0 steady @{L}", [x for i, x in enumerate(w0) if x[0] == L and i not in after]),
            ("rank 0 first step after grow", [w0[i] for i in first if w0[i][0] == L]),
            ("rank 0 second step after grow", [w0[i + 1] for i in first if w0[i][0] == L and i + 1 < len(w0)]),
            ("rank 0 first step after shrink", [w0[i] for i in first if w0[i][0] == S]),
            ("newcomers' first step", [n[0] for n in ph["newcomers"] if n])]
    return [f"| {model} | {path} | {name} | {len(steps)} | {med(steps)} |" for name, steps in rows]


def fmt(xs) -> str:
    return "/".join(f"{x:.3f}" for x in xs) if xs else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="controller")
    ap.add_argument("--models", default="resnet50,gpt2")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--paths", default="ours,plain,restart")
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--large", type=int, default=0, help="GPUs after a grow (default: min(4, GPUs))")
    ap.add_argument("--small", type=int, default=0, help="GPUs before a grow (default: large // 2)")
    ap.add_argument("--out", default="")
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--wid", default="")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--newcomer", action="store_true")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--ckpt-out", default="")
    ap.add_argument("--compute-warmup", action="store_true",
                    help="worker: newcomers warm up forward/backward only, not through ElasticTrainer(warm_up=)")
    ap.add_argument("--loader-workers", type=int, default=0,
                    help="load batches with this many DataLoader workers (items built on the CPU, pinned): ours in "
                         "--mode pauses; both plain DDP (goodput's ideal) and ours in --mode steady")
    ap.add_argument("--item-ms", type=float, default=0.0,
                    help="--loader-workers: CPU time to build one item (a JPEG decode is 3-6 ms)")
    ap.add_argument("--phases", action="store_true",
                    help="ours: time forward/backward/optimizer/commit of every step (device synced between them)")
    ap.add_argument("--mode", default="all", choices=("all", "steady", "pauses"),
                    help="steady: plain DDP steady steps and ours through the resize schedule (steady ratio, goodput, "
                         "pauses); pauses: the --paths protocol; all: both (ours' pauses then come from the schedule: "
                         "give --paths plain,restart)")
    ap.add_argument("--seg-steps", type=int, default=300, help="steady: steps at each size of the schedule")
    ap.add_argument("--schedule", default="", help="steady: sizes, comma-separated (default 1,S,L,S,L,S)")
    ap.add_argument("--rounds", type=int, default=8, help="steady: interleaved rounds (bench/interleaved.py)")
    ap.add_argument("--block-steps", type=int, default=40, help="steady: timed steps of a block in a round")
    ap.add_argument("--bracket", action=argparse.BooleanOptionalAction, default=True,
                    help="steady: plain DDP measured right before and after ours' schedule run, goodput's ideal "
                         "(the drift of the host between the two shows); --no-bracket: no goodput")
    ap.add_argument("--steps", type=int, default=250, help="--bracket: plain DDP timed steps at each size")
    ap.add_argument("--warm", type=int, default=20, help="--bracket: plain DDP steps before timing")
    ap.add_argument("--sizes", default="", help="worker: plain-steady sizes")
    ap.add_argument("--preheat-s", type=float, default=-1.0,
                    help="--bracket: seconds of plain DDP steps at the largest size before its first timing "
                         "(default 45 on cuda, 0 on cpu; the interleaved blocks warm up with a round left out)")
    args = ap.parse_args()
    if args.role != "controller":
        {"ours": worker_ours, "plain": worker_plain, "restart": worker_restart,
         "plain-steady": steady_goodput.worker_plain_steady, "ours-sched": steady_goodput.worker_ours_sched}[
            args.role](args)
        return
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[k] = "0" if k == "NCCL_NVLS_ENABLE" else "1"  # NVLink multicast stays off, children too
    if args.preheat_s < 0:
        args.preheat_s = 45.0 if args.device == "cuda" else 0.0
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo)"
    ngpu = torch.cuda.device_count() if args.device == "cuda" else 0
    args.large = args.large or (min(4, ngpu) if ngpu else 4)
    args.small = args.small or max(1, args.large // 2)
    S, L = args.small, args.large
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else "-"
    lines = ["# gpu_transition: survivors' pause on resize (seconds)", "",
             f"card: {card} x{ngpu}; torch {torch.__version__}; NCCL {nccl}; date {time.strftime('%Y-%m-%d %H:%M')}",
             "pause = decision (step boundary) -> first completed step at the new size, rank 0 of the survivors;",
             f"values are per cycle ({args.cycles} grow/shrink cycles for ours/plain, one for restart).", "",
             f"| model | path | grow {S}->{L} pause s | shrink {L}->{S} pause s | notes |", "|---|---|---|---|---|"]
    results: dict = {}
    phase_lines: list[str] = []
    steady_rows: list[str] = []
    bench_bugs: list[str] = []
    goodput_lines: list[str] = []
    schedule = [int(x) for x in args.schedule.split(",")] if args.schedule else \
        ([1] if S > 1 else []) + [S, L, S, L, S]
    sizes = sorted(set(schedule))
    for model in args.models.split(","):
        args.model = model
        steady = None
        if args.mode in ("all", "steady"):
            t0 = time.time()
            c = None
            try:
                # the steady ratio: plain DDP and ours in interleaved blocks in one process set (the host of this
                # host-bound step drifts by 20% within a minute: plain DDP measured before and after ours, as up
                # to session 7, put that drift into the ratio)
                blocks, _ = interleaved.run(model, sizes, ["ddp", "ddp-default", "trainer"], args.device,
                                            rounds=args.rounds, steps=args.block_steps)
                inter = interleaved.ratios(blocks, "trainer", "ddp")  # like for like: the trainer's DDP settings
                inter_default = interleaved.ratios(blocks, "trainer", "ddp-default")
                print(json.dumps({"model": model, "interleaved": inter, "vs_ddp_default": inter_default}), flush=True)
                before = {}
                if args.bracket:
                    c = Controller(args)
                    before = steady_goodput.run_plain_steady(c, sizes, args.preheat_s)
                    c.close()
                c = Controller(args)
                ours_sched = steady_goodput.run_ours_schedule(c, schedule)
                after = {}
                if args.bracket:
                    c.close()
                    c = Controller(args)
                    after = steady_goodput.run_plain_steady(c, sizes)
                measured = steady_goodput.bracket(before, after) if args.bracket else {}
                steady = steady_goodput.analyse(ours_sched, measured, ours_sched["b"], schedule)
                if args.out:  # the raw schedule run (rank 0's steps, the newcomers' start-ups) and plain's runs
                    with open(f"{os.path.splitext(args.out)[0]}_{model}_sched.json", "w") as f:
                        json.dump({"ours": ours_sched, "plain_before": before, "plain_after": after}, f)
                steady_rows += steady_goodput.table(model, inter, steady, inter_default)
                if measured:
                    steady_rows += steady_goodput.bracket_rows(model, steady, measured)
                g = steady["goodput"]
                if g is not None and (g["ratio"] > 1.0 or g["gpu_time_ratio"] > 1.0):
                    bench_bugs.append(f"{model}: goodput {g['ratio']:.3f} / GPU-time {g['gpu_time_ratio']:.3f} "
                                      "above 1.0: a bug in the bench until shown otherwise")
                print(json.dumps({"model": model, "result": steady}), flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                steady_rows.append(f"| {model} | - | - | - | failed: {type(e).__name__}: {str(e)[:160]} | | | |")
            finally:
                if c is not None:
                    c.close()
            print(json.dumps({"model": model, "path": "steady", "wall_s": time.time() - t0}), flush=True)
        for path in (args.paths.split(",") if args.mode in ("all", "pauses") else []):
            c = Controller(args)
            t0 = time.time()
            try:
                r = {"ours": run_ours, "ours-compute": lambda c: run_ours(c, compute_warmup=True), "plain": run_plain,
                     "restart": run_restart}[path](c)
            except Exception as e:  # noqa: BLE001 - report and go on with the other paths
                r = {"error": f"{type(e).__name__}: {e}"}
            finally:
                c.close()
            r["wall_s"] = time.time() - t0
            results[(model, path)] = r
            print(json.dumps({"model": model, "path": path, **r}), flush=True)
        ours, plain, rst = (results.get((model, p), {}) for p in ("ours", "plain", "restart"))
        rows = (("ours", ours), ("ours, compute-only warm-up", results.get((model, "ours-compute"), {})),
                ("plain (a)", plain), ("restart (b)", rst))
        for path, r in ((p, r) for p, r in rows if r):
            if "error" in r:
                lines.append(f"| {model} | {path} | - | - | failed: {r['error'][:120]} |")
                continue
            g = [x["pause_s"] for x in r.get("grow", [])]
            s = [x["pause_s"] for x in r.get("shrink", [])]
            note = ""
            if path.startswith("ours") and g:
                def ph(k, kind):
                    return fmt([x.get(k, float("nan")) for x in r[kind]])
                note = (f"step {r['step_s_small']*1e3:.1f} ms @{S}, {r['step_s_large']*1e3:.1f} ms @{L}; grow phases "
                        f"abort {ph('abort_s', 'grow')}, state sync {ph('state_sync_s', 'grow')} "
                        f"({r['grow'][0]['state_bytes']/2**20:.0f} MiB), rewrap {ph('rewrap_s', 'grow')}, "
                        f"first step {ph('first_step_s', 'grow')}; shrink rewrap {ph('rewrap_s', 'shrink')}, "
                        f"first step {ph('first_step_s', 'shrink')}")
            if path == "plain (a)" and "step_s" in r:
                note = f"median step {r['step_s']*1e3:.1f} ms (plain DDP, no vote/snapshot)"
            if path == "restart (b)" and g:
                note = f"interpreter start after decision: {fmt([x['startup_s'] for x in r['grow'] + r['shrink']])} s"
            lines.append(f"| {model} | {path} | {fmt(g)} | {fmt(s)} | {note} |")
        try:
            og = statistics.median(x["pause_s"] for x in ours["grow"])
            os_ = statistics.median(x["pause_s"] for x in ours["shrink"])
            pg = statistics.median(x["pause_s"] for x in plain["grow"])
            ps = statistics.median(x["pause_s"] for x in plain["shrink"])
            rg = statistics.median(x["pause_s"] for x in rst["grow"])
            rs = statistics.median(x["pause_s"] for x in rst["shrink"])
            lines.append(f"| {model} | speed-up (median) | {pg/og:.1f}x vs (a), {rg/og:.0f}x vs (b) | "
                         f"{ps/os_:.1f}x vs (a), {rs/os_:.0f}x vs (b) | |")
        except (KeyError, statistics.StatisticsError, ZeroDivisionError):
            pass
        if steady is not None:
            goodput_lines.append(steady_goodput.goodput_line(model, steady, schedule, S, L,
                                                             results.get((model, "plain"), {})))
            goodput_lines.append(steady_goodput.startup_line(model, steady.get("startups", [])))
        for path in ("ours", "ours-compute"):
            if "phases" in results.get((model, path), {}):
                phase_lines += phase_rows(model, path, results[(model, path)]["phases"], S, L)
        report = lines if args.mode != "steady" else lines[:3]
        if steady_rows:
            report = report + steady_goodput.header(schedule, args.seg_steps, args.rounds, args.block_steps) + \
                steady_rows + [""] + goodput_lines
        report = report + phase_table(phase_lines)
        if args.out:  # after every model, so a cut-off run still leaves its finished rows
            with open(args.out, "w") as f:
                f.write("\n".join(report) + "\n")
    print("\n".join(report) + "\n", flush=True)
    if bench_bugs:
        print("\n".join(["BENCH FAILED:"] + bench_bugs), flush=True)
        sys.exit(1)


def phase_table(rows: list[str]) -> list[str]:
    if not rows:
        return []
    return ["", "Phases of steps (`--phases`: device synchronised between phases), medians in ms:", "",
            "| model | path | steps | n | forward | backward | optimizer | commit |", "|---|---|---|---|---|---|---|---|"] + rows


if __name__ == "__main__":
    main()
