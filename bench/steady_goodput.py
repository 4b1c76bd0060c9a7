"""Steady step and goodput over a resize schedule: ElasticTrainer against plain DDP, same run, same machine.

plain   one process per GPU (``--role plain-steady``); for each size n: ``init_process_group`` over the first n,
        ``DDP(model)`` with the trainer's settings (no buffer broadcast in every forward, which the trainer skips:
        like for like, bench/interleaved.py's ``ddp``; 25 MB buckets, built-in allreduce),
        ``--warm`` steps, a device sync, ``--steps`` timed steps with no sync between them (as a torchrun
        script runs), a device sync. Step time = window / steps (``mean``); ``median`` of the host periods.
        Run before ours (after ``--preheat-s`` seconds of plain steps at the largest size, so the GPUs are at
        their working clocks) and again after; the baseline is the mean of the two (``bracket``), and the
        table gives both, so a drift of the machine during the run shows instead of landing on one side.
ours    ElasticTrainer as the templates build it (default TrainerConfig, so the auto commit schedule; Telemetry;
        a ProgressReporter on the job store; newcomers warm up through ``warm_up=``), one run through the size
        schedule ``--schedule`` (default 1,S,L,S,L,S), ``--seg-steps`` steps per size: the controller asks for
        each resize once rank 0 reports the segment's end, newcomers are started a third of a segment earlier
        (helper jobs start while the job trains) and a grow's plan is posted once they announced themselves, as
        the launcher's Resizer does (ALLOCATED -> JOINED), not before (survivors hurry their commit points while a
        plan waits for its newcomers); leavers exit at the commit point that shrinks.

With ``--loader-workers W`` (and ``--item-ms``: CPU time to build one item) both sides load their batches with
torch's DataLoader, the same options (W workers, pinned memory, persistent workers): plain DDP over a
DistributedSampler as a torchrun script does, ours through ``ElasticTrainer.loader``; so the ideal carries the
loader's cost too and the goodput is the runtime's, loader included (issue #23). Without it both step one fixed
batch.

Since session 8 the steady ratio comes from ``bench/interleaved.py`` (plain DDP and ours in interleaved blocks in
one process set: on 4x H200 the host-bound ResNet-50 step moved by 20% between blocks a minute apart), against
``ddp`` (DDP with the trainer's own settings: no buffer broadcast in every forward) first and ``ddp-default``
beside it. Goodput's ideal is *measured* in the same run: plain DDP at each size right before and right after
ours' schedule run (``bracket``), never derived from the steady ratio; the faster of the two at each size is
the ideal (an upper bound: a drift of the host between them lowers goodput, never lifts it); a goodput above 1.0
is a bench bug and fails the run (bench/gpu_transition.py exits 1).

Steady (ours): per size, windows between commit points (the vote synchronises the device there, so a window is
exact device time), from ``SEG_WARM`` steps after entering the size to the last commit point before the step
that switches away or before newcomers are started on the same host (their start-up loads the host CPU);
``mean`` = window time / steps over all windows of that size, ``median`` of the host periods
inside them. Goodput: from the first step after the 1 -> S switch to the end, samples trained over the ideal,
where ideal = sum over sizes n of (time spent at n) x (plain DDP's samples/s at n). Every second counts: a
step's period (end of its commit to the end of the next) goes to the size it ran at, so the resize pauses, the
commit points and the first steps at a new size are all in the denominator. GPU-time goodput charges the GPUs
held instead of those trained on: from the moment a grow's newcomers are started (their helper job holds its
GPUs while they start and warm up) to the switch, a step's period counts the newcomers' GPUs too, each at plain
DDP's per-GPU rate at the size the job runs at.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_launcher import store_keys as keys
from interleaved import BUFFERS
from gpu_common import STORE_TIMEOUT, Controller, LoadedItems, Synthetic, build, client, device_of, sync, to_device

SEG_WARM = 10  # steps after entering a size that the steady figures leave out


def _step(model, opt, batch, loss_fn) -> None:
    loss_fn(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def loader_options(args, dev) -> dict:
    """``--loader-workers``: the DataLoader options both sides use (a torchrun script's and the template's)."""
    return dict(num_workers=args.loader_workers, pin_memory=dev.type == "cuda", persistent_workers=True)


def loader_extra(args) -> tuple:
    return ("--loader-workers", str(args.loader_workers), "--item-ms", str(args.item_ms))


def _plain_batches(args, dev, make_batch, b: int, n: int, me: int):
    """Plain DDP's batches at size ``n``: with ``--loader-workers``, a DataLoader over a DistributedSampler as a
    torchrun script builds it (items of ``--item-ms`` CPU time each), else the one fixed batch forever."""
    if not args.loader_workers:
        batch = make_batch(b)
        while True:
            yield batch
    data = LoadedItems(make_batch, args.item_ms)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=n, rank=me, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=b, sampler=sampler, **loader_options(args, dev))
    while True:
        for batch in loader:
            yield to_device(batch, dev)


def _barrier(bench, key: str, n: int, timeout: float = 300) -> None:
    bench.add(key, 1)
    deadline = time.monotonic() + timeout
    while bench.add(key, 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {key}: {bench.add(key, 0)} of {n}")
        time.sleep(0.01)


def worker_plain_steady(args) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = device_of(args)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    model, opt, b, make_batch, loss_fn = build(args.model, dev)
    bench = client(args, "bench")
    me = int(args.wid[1:])
    sizes = [int(x) for x in args.sizes.split(",")]
    ids = dict(device_ids=[args.gpu]) if dev.type == "cuda" else {}
    ids[BUFFERS] = False  # the trainer's setting: the ideal pays no buffer broadcast the trainer skips
    if args.preheat_s > 0:  # bring the GPUs to the clocks and temperature they train at before any timing
        n = max(sizes)
        if me < n:
            dist.init_process_group(backend, store=client(args, "steady/pg/preheat"), rank=me, world_size=n,
                                    timeout=timedelta(seconds=120))
            ddp = DDP(model, **ids)
            go = torch.ones(1, device=dev)
            t_end = time.perf_counter() + args.preheat_s
            batch = make_batch(b)  # the fixed batch: heat, not loading
            while go.item() > 0:  # rank 0's clock decides; every rank steps the same number of times
                for _ in range(20):
                    _step(ddp, opt, batch, loss_fn)
                go.fill_(1.0 if me != 0 or time.perf_counter() < t_end else 0.0)
                dist.all_reduce(go, op=dist.ReduceOp.MIN)
            del ddp
            dist.destroy_process_group()
        _barrier(bench, "steady/done/preheat", max(sizes))
    for n in sizes:
        if me < n:
            dist.init_process_group(backend, store=client(args, f"steady/pg/{n}"), rank=me, world_size=n,
                                    timeout=timedelta(seconds=120))
            ddp = DDP(model, **ids)
            batches = _plain_batches(args, dev, make_batch, b, n, me)
            for _ in range(args.warm):
                _step(ddp, opt, next(batches), loss_fn)
            sync(dev)
            periods, calls = [], []
            t0 = last = time.perf_counter()
            for _ in range(args.steps):
                _step(ddp, opt, next(batches), loss_fn)
                now = time.perf_counter()
                periods.append(now - last)
                calls.append(now - last)
                last = now
            sync(dev)
            t1 = time.perf_counter()
            if me == 0:
                bench.set(f"steady/res/{n}", json.dumps({"mean_s": (t1 - t0) / args.steps, "steps": args.steps,
                                                          "median_s": statistics.median(periods),
                                                          "step_calls_us": 1e6 * statistics.median(calls)}))
            batches.close()  # the DataLoader's workers go with it
            del ddp
            dist.destroy_process_group()
        _barrier(bench, f"steady/done/{n}", max(sizes))


def worker_ours_sched(args) -> None:
    from elastic_launcher.batch_policy import BatchPolicy
    from elastic_launcher.telemetry import Telemetry
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
    from elastic_launcher.workers import ProgressReporter
    t_fn = time.perf_counter()  # interpreter and imports done (the script stamps its own start: T_PROC)
    dev = device_of(args)
    model, opt, b, make_batch, loss_fn = build(args.model, dev)
    batch = make_batch(b)
    t_built = time.perf_counter()
    bench = client(args, "bench")
    cuda = dev.type == "cuda"
    tel = Telemetry(profile=args.model, gpu=torch.cuda.get_device_name(dev) if cuda else "cpu",
                    intra_link="nvlink" if cuda else "shm")
    progress = ProgressReporter(client(args), args.wid, "localhost")
    cfg = TrainerConfig(backend="nccl" if cuda else "gloo")
    et = ElasticTrainer(model, opt, store_addr=f"{args.host}:{args.port}/job", worker_id=args.wid,
                        policy=BatchPolicy(per_gpu_batch=b, lr_scaling="none"), device=dev, config=cfg,
                        telemetry=tel, progress=progress,
                        warm_up=(lambda m: _step(m, opt, batch, loss_fn)) if args.newcomer else None)
    if args.loader_workers:  # the loader's workers start and load a batch before the worker announces itself
        data, options = LoadedItems(make_batch, args.item_ms), loader_options(args, dev)
        et.prepare_loader(data, **options)
    t_join = time.perf_counter()
    et.join()
    t_joined = time.perf_counter()
    # (world the step ran at, end of its commit, step after it, a commit point, host s in commit, host s in the
    # step's forward/backward/optimizer calls)
    recs = []
    stop_at = None
    if args.loader_workers:  # the same DataLoader options as the plain side's
        batches = (to_device(x, dev) for x in et.loader(data, **options))
    else:
        batches = (batch for _ in et.loader(Synthetic(10 ** 6), collate_fn=lambda items: None))
    t_first = None
    for step_batch in batches:
        world = et.world_size
        t_first = t_first or time.perf_counter()
        t0 = time.perf_counter()
        _step(et.model, opt, step_batch, loss_fn)
        t1 = time.perf_counter()
        alive = et.commit()
        t2 = time.perf_counter()
        at_commit = et.committed_step == et.step
        recs.append((world, t2, et.step, at_commit, t2 - t1, t1 - t0))
        if not alive:
            break
        if at_commit and stop_at is None:  # the controller names the last step (see run_ours_schedule)
            if et.rank == 0:
                bench.set("sched/interval", str(et.schedule.interval))
            if bench.check(["sched/stop_at"]):
                stop_at = int(bench.get("sched/stop_at"))
        if stop_at is not None and et.step >= stop_at:
            break
    bench.set(f"res/{args.wid}", json.dumps({"recs": recs, "switches": et.switches, "b": b,
                                             "commit_interval": et.schedule.interval,
                                             "commit_cost_s": et.schedule.cost_s,
                                             "commit_history": list(et.schedule.history),
                                             "startup": {"t_proc": sys.modules["__main__"].__dict__.get("T_PROC"),
                                                         "t_fn": t_fn, "t_built": t_built, "t_join": t_join,
                                                         "t_joined": t_joined, "t_first_batch": t_first,
                                                         "warm_up_s": et.warm_up_s, "loader_warm_s": et.loader_warm_s}}))
    et.close()


def _progress_step(c: Controller, wid: str) -> int:
    key = keys.progress(wid)
    return json.loads(c.server.get(key))["step"] if c.server.check([key]) else 0


def _wait_progress(c: Controller, wid: str, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while _progress_step(c, wid) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{wid} did not commit step {step}")
        time.sleep(0.02)


def run_plain_steady(c: Controller, sizes: list[int], preheat_s: float = 0.0) -> dict:
    """Plain DDP's steady step at each size (after ``preheat_s`` seconds of plain steps at the largest)."""
    extra = ("--sizes", ",".join(map(str, sizes)), "--steps", str(c.args.steps), "--warm", str(c.args.warm),
             "--preheat-s", str(preheat_s)) + loader_extra(c.args)
    ps = [c.spawn("plain-steady", f"s{i}", i, extra=extra) for i in range(max(sizes))]
    c.reap(ps, timeout=600)
    return {n: json.loads(c.bench.get(f"steady/res/{n}")) for n in sizes}


def bracket(before: dict, after: dict) -> dict:
    """The baseline of a run measured before and after ours: per size, the mean of the two plain runs' mean and
    median step (the steady ratio's), with both runs and their drift (after / before) kept beside, and the faster
    of the two (``best_s``: goodput's ideal, an upper bound that the host's drift can only lower)."""
    out = {}
    for n, a in before.items():
        z = after.get(n)
        if z is None:
            out[n] = a
            continue
        out[n] = {"mean_s": (a["mean_s"] + z["mean_s"]) / 2, "median_s": (a["median_s"] + z["median_s"]) / 2,
                  "steps": a["steps"] + z["steps"], "before_mean_s": a["mean_s"], "after_mean_s": z["mean_s"],
                  "drift": z["mean_s"] / a["mean_s"], "best_s": min(a["mean_s"], z["mean_s"])}
    return out


def run_ours_schedule(c: Controller, schedule: list[int]) -> dict:
    from elastic_launcher.membership import Coordinator
    seg = c.args.seg_steps
    extra = loader_extra(c.args)
    coord = Coordinator(dist.PrefixStore("job", c.server), timeout=STORE_TIMEOUT)
    members = [f"w{i}" for i in range(schedule[0])]
    gpus = {w: i for i, w in enumerate(members)}
    procs = {w: c.spawn("ours-sched", w, gpus[w], extra=extra) for w in members}
    coord.start(members)
    nxt = len(members)
    end = seg  # the step at which the current size has run its segment
    busy: list[float] = []  # when newcomers were started (perf_counter is one clock for all processes here)
    grows: list[tuple[float, list[str]]] = []  # (spawned at, newcomers) per grow
    for n in schedule[1:]:
        leavers: list[str] = []
        if n > len(members):
            _wait_progress(c, "w0", end - seg // 3)
            free = sorted(set(range(max(schedule))) - set(gpus.values()))
            news = [f"w{nxt + i}" for i in range(n - len(members))]
            nxt += len(news)
            busy.append(time.perf_counter())  # newcomers start: not steady until the switch (see analyse)
            grows.append((busy[-1], news))
            for w, g in zip(news, free):
                gpus[w] = g
                procs[w] = c.spawn("ours-sched", w, g, newcomer=True, extra=extra)
            _wait_progress(c, "w0", end)
            _wait_joined(coord, news)  # as the launcher's Resizer: the plan is posted once the newcomers joined
            members = members + news
        else:
            _wait_progress(c, "w0", end)
            leavers = members[n:]
            members = members[:n]
        plan = coord.request_resize(members)
        end = int(coord.wait_switched(plan)["step"]) + seg
        if leavers:
            c.reap([procs.pop(w) for w in leavers])
            for w in leavers:
                gpus.pop(w)
    _wait_progress(c, "w0", end)
    # every rank reads the key at its commit points, which all ranks pass together: a step three intervals
    # after the last commit point seen here is ahead of every rank when it reads it
    c.bench.set("sched/stop_at", str(_progress_step(c, "w0") + 3 * int(c.bench.get("sched/interval")) + 1))
    c.reap(list(procs.values()), timeout=600)
    startups = [[_startup(t0, json.loads(c.bench.get(f"res/{w}"))) for w in news] for t0, news in grows]
    return {**json.loads(c.bench.get("res/w0")), "newcomers_started": busy, "startups": startups}


def _wait_joined(coord, news: list[str], timeout: float = 300) -> None:
    """Until every newcomer announced itself (its warm-up and loader's first batch done, waiting for a plan)."""
    deadline = time.monotonic() + timeout
    while not set(news) <= set(coord.joined()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"newcomers {news} did not announce themselves within {timeout} s")
        time.sleep(0.02)


def _startup(spawned: float, res: dict) -> dict:
    """A newcomer's start-up phases in seconds, from its spawn (perf_counter: one clock for the processes here):
    interpreter and imports, model build, join (its warm-up, the loader's first batch, the wait for a plan, the
    group), then to its first batch and to the switch (the end of its first step)."""
    st = res["startup"]
    join = next((r.get("join_s") for r in res["switches"] if r.get("join_s")), {}) or {}
    first_end = res["recs"][0][1] if res["recs"] else None
    return {"imports_s": st["t_fn"] - spawned, "interpreter_s": (st["t_proc"] - spawned) if st["t_proc"] else None,
            "build_s": st["t_built"] - st["t_fn"], "before_join_s": st["t_join"] - st["t_built"],
            "join_s": st["t_joined"] - st["t_join"], "warm_up_s": st["warm_up_s"], "loader_warm_s": st["loader_warm_s"],
            "plan_wait_s": join.get("plan_wait_s"), "group_s": join.get("group_s"),
            "to_first_batch_s": (st["t_first_batch"] - st["t_joined"]) if st["t_first_batch"] else None,
            "spawn_to_first_step_end_s": (first_end - spawned) if first_end else None}


def startup_line(model: str, startups: list) -> str:
    """One line per grow: the newcomers' start-up phases (seconds from spawn), rank by rank."""
    def f(x):
        return "-" if x is None else f"{x:.2f}"
    parts = []
    for k, grow in enumerate(startups, 1):
        for s in grow:
            parts.append(f"grow {k}: spawn -> first step {f(s['spawn_to_first_step_end_s'])} s = interpreter "
                         f"{f(s['interpreter_s'])} + imports {f(s['imports_s'] - (s['interpreter_s'] or 0))} + "
                         f"build {f(s['build_s'])} + join {f(s['join_s'])} (warm-up {f(s['warm_up_s'])}, loader's "
                         f"first batch {f(s['loader_warm_s'])}, plan wait {f(s['plan_wait_s'])}, group "
                         f"{f(s['group_s'])}) + to the first batch {f(s['to_first_batch_s'])}")
    return f"- {model}: newcomers' start-up: " + "; ".join(parts) if parts else f"- {model}: no grow"


def analyse(ours: dict, plain: dict, b: int, schedule: list[int]) -> dict:
    """Steady step per size, goodput over the schedule after its first segment, pauses (see the module doc)."""
    recs = ours["recs"]
    # segments: runs of steps at one size; the last step of a segment is the one whose commit switched away
    segs, start = [], 0
    for i in range(1, len(recs) + 1):
        if i == len(recs) or recs[i][0] != recs[start][0]:
            segs.append((start, i))
            start = i
    steady: dict[int, dict] = {}
    started = ours.get("newcomers_started", [])
    for a, z in segs:
        world = recs[a][0]
        last = z - 1 if z < len(recs) else z  # leave the switching step out
        # newcomers starting up on the same host (interpreter, CUDA context, model, warm-up) slow the survivors'
        # host: a steady window ends before that (goodput counts it all)
        cut = min((t for t in started if t > recs[a][1]), default=float("inf"))
        s = steady.setdefault(world, {"time": 0.0, "steps": 0, "periods": [], "time_all": 0.0, "steps_all": 0})
        for key, limit in (("", cut), ("_all", float("inf"))):
            points = [i for i in range(a + SEG_WARM, last) if recs[i][3] and recs[i][1] < limit]
            if len(points) < 2:
                continue
            i, j = points[0], points[-1]
            s["time" + key] += recs[j][1] - recs[i][1]
            s["steps" + key] += recs[j][2] - recs[i][2]
            if not key:
                s["periods"] += [recs[m][1] - recs[m - 1][1] for m in range(i + 1, j + 1)]
    plain_steps = [r for r in recs if not r[3]]
    out = {"steady": {}, "goodput": None, "commit_cost_s": ours.get("commit_cost_s"),
           "interval": ours.get("commit_interval"),
           "host_us": {"commit_plain_step": 1e6 * statistics.median(r[4] for r in plain_steps) if plain_steps else None,
                       "commit_point": 1e6 * statistics.median(r[4] for r in recs if r[3]),
                       "step_calls": 1e6 * statistics.median(r[5] for r in recs)}}
    for world, s in sorted(steady.items()):
        if not s["steps"]:
            continue
        mean = s["time"] / s["steps"]
        p = plain.get(world)
        out["steady"][world] = {"mean_s": mean, "median_s": statistics.median(s["periods"]), "steps": s["steps"],
                                "ratio": mean / p["mean_s"] if p else None,
                                "ratio_median": statistics.median(s["periods"]) / p["median_s"] if p else None,
                                "ratio_with_startups": s["time_all"] / s["steps_all"] / p["mean_s"]
                                if p and s["steps_all"] else None}
    # goodput after the first segment
    g0 = segs[0][1] - 1  # the step that switched from the first size
    t_at: dict[int, float] = {}
    samples = 0
    for m in range(g0 + 1, len(recs)):
        world = recs[m][0]
        t_at[world] = t_at.get(world, 0.0) + recs[m][1] - recs[m - 1][1]
        samples += world * b
    held = _gpus_held(recs, started)
    if t_at and all(w in plain for w in t_at):
        # the ideal: plain DDP's faster run at each size (before or after ours), so a drift of the host between
        # them lowers goodput instead of lifting it (at 4 ms an item the loader-bound step moved by 8% between them)
        best = {w: p.get("best_s", p["mean_s"]) for w, p in plain.items()}
        ideal = sum(t * w * b / best[w] for w, t in t_at.items())
        ideal_mean = sum(t * w * b / plain[w]["mean_s"] for w, t in t_at.items())
        # every GPU held could have trained at plain DDP's per-GPU rate at the size the job runs at
        ideal_held = sum((recs[m][1] - recs[m - 1][1]) * held[m] * b / best[recs[m][0]]
                         for m in range(g0 + 1, len(recs)))
        out["goodput"] = {"samples": samples, "ideal": ideal, "ratio": samples / ideal,
                          "ratio_vs_mean": samples / ideal_mean,
                          "gpu_time_ideal": ideal_held, "gpu_time_ratio": samples / ideal_held,
                          "seconds": {w: round(t, 2) for w, t in sorted(t_at.items())},
                          "steps": len(recs) - g0 - 1}
    sw = [s for s in ours["switches"] if s["kind"] == "resize"]
    out["startups"] = ours.get("startups", [])
    out["pauses"] = [("grow" if s["world"] > s["old_world"] else "shrink", s["old_world"], s["world"], s["pause_s"])
                     for s in sw]
    return out


def _gpus_held(recs: list, started: list[float]) -> list[int]:
    """Per step, the GPUs the job holds: its world, or the next size from when that grow's newcomers were started
    (``started``: their start times) until the switch."""
    held = [r[0] for r in recs]
    for ts in started:
        k = next((i for i in range(1, len(recs)) if recs[i][0] > recs[i - 1][0] and recs[i][1] > ts), None)
        if k is None:
            continue
        for m in range(k - 1, -1, -1):
            if recs[m][1] <= ts:  # this step's period ended before the newcomers started
                break
            held[m] = max(held[m], recs[k][0])
    return held


def _ms(xs) -> str:
    return "/".join(f"{x:.3f}" for x in xs) if xs else "-"


def table(model: str, inter: dict, res: dict, inter_default: dict) -> list[str]:
    """Rows of the steady table for one model: the interleaved ratio per size against ``ddp`` (``inter``) and
    ``ddp-default`` (``inter_default``), and the schedule run's figures."""
    rows = []
    h, cost = res["host_us"], res["commit_cost_s"]
    cost_ms = "-" if cost is None else f"{cost * 1e3:.1f}"
    plain_us = "-" if h["commit_plain_step"] is None else f"{h['commit_plain_step']:.0f}"
    notes = (f"schedule run: commit points every {res['interval']} steps at the end, measured cost {cost_ms} ms; "
             f"host time in commit() {plain_us} us a plain step, {h['commit_point']:.0f} us a commit point")
    for world, i in sorted(inter.items()):
        rr = i["round_ratios"]
        s = res["steady"].get(world)
        sched = f"{s['mean_s'] * 1e3:.2f} ({s['steps']} steps)" if s else "-"
        d = inter_default.get(world)
        vs_default = f"{d['ratio']:.3f} (ddp-default {d['plain_mean_s'] * 1e3:.2f} ms)" if d else "-"
        rows.append(f"| {model} | {world} | {i['plain_mean_s'] * 1e3:.2f} | {i['mean_s'] * 1e3:.2f} | "
                    f"**{i['ratio']:.3f}** | {statistics.median(rr):.3f} ({min(rr):.3f}-{max(rr):.3f}), {len(rr)} | "
                    f"{vs_default} | {sched} | {notes} |")
    return rows


def bracket_rows(model: str, res: dict, plain: dict) -> list[str]:
    """Rows of ours' schedule run against plain DDP measured right before and after it (goodput's ideal)."""
    rows = []
    for world, s in res["steady"].items():
        p = plain.get(world)
        if not p or s["ratio"] is None:
            continue
        g = res["goodput"]
        goodput = f"; goodput against it {g['ratio']:.3f}" if g else ""
        rows.append(f"| {model} (schedule run) | {world} | {p['mean_s'] * 1e3:.2f} | {s['mean_s'] * 1e3:.2f} | "
                    f"{s['ratio']:.3f} | - | - | - | plain DDP (the trainer's settings) before / after ours "
                    f"{p.get('before_mean_s', float('nan')) * 1e3:.2f} / {p.get('after_mean_s', float('nan')) * 1e3:.2f}"
                    f" ms{goodput} |")
    return rows


def goodput_line(model: str, res: dict, schedule: list[int], S: int, L: int, rebuild: dict) -> str:
    """The goodput and pause line for one model (``rebuild``: the plain rebuild path's pauses, if run)."""
    g = res["goodput"]
    if not g:
        return f"- {model}: no goodput (a size lacks a plain DDP baseline)"
    grows = [p for k, a, z, p in res["pauses"] if k == "grow" and (a, z) == (S, L)]
    shrinks = [p for k, a, z, p in res["pauses"] if k == "shrink" and (a, z) == (L, S)]
    reb = ""
    if rebuild.get("grow") and grows and shrinks:
        rg = [x["pause_s"] for x in rebuild["grow"]]
        rs = [x["pause_s"] for x in rebuild["shrink"]]
        reb = (f"; plain rebuild (a) grow {_ms(rg)} s, shrink {_ms(rs)} s: ours "
               f"{statistics.median(rg) / statistics.median(grows):.1f}x / "
               f"{statistics.median(rs) / statistics.median(shrinks):.1f}x shorter (medians)")
    return (f"- {model}: goodput **{g['ratio']:.3f}** of ideal over {g['steps']} steps of "
            f"{'->'.join(map(str, schedule[1:]))} ({g['samples']} samples against {g['ideal']:.0f}, the ideal from "
            f"plain DDP's faster step at each size, measured right before and after in this run; against the mean "
            f"of the two {g.get('ratio_vs_mean', float('nan')):.3f}; seconds at each size {g['seconds']}); "
            f"GPU-time goodput **{g['gpu_time_ratio']:.3f}** (GPUs held from the newcomers' start); "
            f"grow {S}->{L} pauses {_ms(grows)} s, shrink {L}->{S} {_ms(shrinks)} s{reb}")


def header(schedule: list[int], seg: int, rounds: int, block: int) -> list[str]:
    return ["", f"Steady step (bench/interleaved.py): DDP with the trainer's settings (ddp), DDP's defaults (ddp-default) and ElasticTrainer "
            f"(auto commit schedule, Telemetry) at each size in one process set, {rounds} rounds of interleaved "
            f"blocks of {block} steps after a warm-up round; ms a step = window / steps (device-synchronised ends), "
            "pooled over the rounds; ratio = ours / plain. Then ours alone through the resize schedule "
            f"{'->'.join(map(str, schedule))}, {seg} steps a size (its steady step at each size beside).",
            "", "| model | GPUs | DDP ms (ddp: the trainer's settings) | ElasticTrainer ms | ratio to ddp | "
            "per-round ratio, median (range), rounds | ratio to ddp-default | ours in the schedule run, ms | notes |",
            "|---|---|---|---|---|---|---|---|---|"]
