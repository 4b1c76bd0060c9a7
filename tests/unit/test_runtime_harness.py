"""Multi-process harness for the elastic runtime tests (gloo, spawned workers, controller in the test).

Each worker trains a small MLP regression with :class:`ElasticTrainer`, logs the sample ids its model received in
every step (each item carries its dataset index through the DataLoader: what was delivered, not what the sampler
said) to its own file once a commit point covers the step (a rollback takes back the steps after the
last commit point; line-buffered, so a SIGKILLed worker's committed steps survive), and returns its final
parameters, its full-dataset loss history and its switch records through a queue.
"""
from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import queue
import socket
import time
from datetime import timedelta

import torch

N_SAMPLES = 96
DIM = 8


def make_dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(N_SAMPLES, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class LoaderTagged(torch.utils.data.Dataset):
    """The harness's items, each with the pid of the process that loaded it (a DataLoader worker, or the trainer)
    and its own index (the sample id the model receives)."""

    def __init__(self, base: torch.utils.data.Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x, y, os.getpid(), i


def make_model() -> torch.nn.Module:
    torch.manual_seed(os.getpid())  # different on every rank: the initial broadcast must align them
    return torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def worker(wid: str, port: int, opts: dict, out: "mp.Queue") -> None:
    """One elastic worker (spawned)."""
    torch.set_num_threads(1)
    from elastic_launcher.batch_policy import BatchPolicy
    from elastic_launcher.committed import CommittedSteps
    from elastic_launcher.errors import LeftGroup
    from elastic_launcher.testing import FaultPlan
    from elastic_launcher.trainer import ElasticTrainer, TrainerConfig

    ds = make_dataset()
    model = make_model()
    dev = torch.device("cpu")
    if opts.get("cuda"):
        dev = torch.device("cuda", int(wid[1:]) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        model = model.to(dev)
        ds = torch.utils.data.TensorDataset(*(t.to(dev) for t in ds.tensors))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
    fault = None
    if opts.get("fail_at") and opts["fail_at"][0] == wid:
        fault = FaultPlan().fail_at(opts["fail_at"][1], opts["fail_at"][2])
    # ("at", rank, step, after_s), ("recovery", event[, hang_s]), ("switch", event), ("hang", step, seconds)
    hang = {}
    for kind, *args in opts.get("faults", {}).get(wid, ()):
        if kind == "hang":  # beats all along, but the training thread sleeps (a hung loader, a slow file system)
            hang[args[0]] = args[1]
            continue
        fault = fault or FaultPlan()
        if kind == "at":
            fault.fail_at(args[0], args[1], after_s=args[2])
        elif kind == "switch":
            fault.fail_in_switch(args[0])
        else:
            fault.fail_in_recovery(*args)  # (event,) or (event, hang_s)
    cfg = TrainerConfig(backend="nccl" if opts.get("cuda") else "gloo", timeout=timedelta(seconds=opts.get("timeout_s", 20)),
                        connect_timeout=timedelta(seconds=opts.get("connect_timeout_s", 40)),
                        rendezvous_timeout=timedelta(seconds=opts.get("rendezvous_timeout_s", 60)), heartbeat_interval=timedelta(seconds=0.1),
                        heartbeat_timeout=timedelta(seconds=2), peer_watchdog=opts.get("peer_watchdog"),
                        arrival_timeout=(timedelta(seconds=opts["arrival_timeout_s"])
                                         if opts.get("arrival_timeout_s") else None),
                        commit_every=opts.get("commit_every"))
    warm = None
    if opts.get("warm_up_s") is not None:  # a real local step, made slow: it must stay off the critical path
        x0, y0 = ds.tensors[0][:4], ds.tensors[1][:4]

        def warm(m):
            torch.nn.functional.mse_loss(m(x0), y0).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(opts["warm_up_s"])
    et = ElasticTrainer(model, opt, store_addr=f"127.0.0.1:{port}/job", worker_id=wid,
                        policy=BatchPolicy(per_gpu_batch=4, lr_scaling="sqrt"), scheduler=sched, config=cfg,
                        fault=fault, warm_up=warm).join()
    log = open(os.path.join(opts["logdir"], f"{wid}.jsonl"), "a", buffering=1)
    full_x, full_y = ds.tensors
    losses = []
    store = et._store
    steps = CommittedSteps()  # steps trained since the last commit point: a rollback takes them back
    try:
        stop_at = None  # all ranks reach the target world at the same step, so they stop together
        source = LoaderTagged(ds)
        injected = False
        for batch in et.loader(source, **opts.get("loader", {})):
            x, y = batch[0], batch[1]
            step, epoch, idx = et.step, et.epoch, list(et.batch_indices)
            entry = {"wid": wid, "step": step, "epoch": epoch, "idx": idx, "ids": batch[3].tolist()}
            if opts.get("loader"):
                entry.update(pid=os.getpid(), loaders=sorted(set(batch[2].tolist())))
            if step in hang:
                time.sleep(hang.pop(step))
            if opts.get("error_at") == (wid, step) and not injected:
                injected = True
                et.report_error(RuntimeError(f"injected at step {step}"))  # rolls back at the next commit point
            loss = torch.nn.functional.mse_loss(et.model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if stop_at is None and wid in opts.get("skew", {}):  # out of phase with its peers until the resize
                time.sleep(opts["skew"][wid])
            try:
                alive = et.commit()
            except LeftGroup as e:  # fenced out by the survivors (it was declared dead)
                out.put({"wid": wid, "fenced": str(e), "step": et.step})
                return
            steps.add(step, entry)
            for e in steps.ready(et.step, et.committed_step):  # committed; a leaver's last step counts too
                log.write(json.dumps(e) + "\n")
            if not alive:
                break
            with torch.no_grad():
                losses.append((et.step, torch.nn.functional.mse_loss(model(full_x), full_y).item()))
            store.set(f"test/prog/{wid}", str(et.step))
            if stop_at is None and et.world_size == opts["target_world"] and et.plan.kind != "initial":
                stop_at = et.epoch_start_step + opts["after"]
            if stop_at is not None and et.step >= stop_at:
                break
            if stop_at is None:
                time.sleep(opts["slow"])  # train slowly until the resize, so the test controls when it lands
        for e in steps.rest():  # a clean end: the steps after the last commit point stand
            log.write(json.dumps(e) + "\n")
        out.put({"wid": wid, "left": et.left, "step": et.step, "world": et.world_size if not et.left else 0,
                 "params": [p.detach().cpu().reshape(-1).tolist() for p in model.parameters()], "losses": losses,
                 "switches": et.switches, "sampler": et.sampler.state_dict(), "lr": opt.param_groups[0]["lr"],
                 "obs": et.observations() if et.telemetry else [], "committed_step": et.committed_step,
                 "commit_interval": et.schedule.interval,
                 "warm_up_s": et.warm_up_s,
                 "loading": ({"dropped": et.loading.dropped, "resets": et.loading.resets}
                             if et.loading is not None else None)})
    finally:
        log.close()
        et.close()


class Cluster:
    """The controller side of a test: store server, coordinator, spawned workers."""

    def __init__(self, logdir: str, target_world: int, after: int = 12, slow: float = 0.05, **opts) -> None:
        from elastic_launcher.membership import Coordinator
        import torch.distributed as dist
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
        self.port = self.server.port
        self.coord = Coordinator(dist.PrefixStore("job", self.server), timeout=timedelta(seconds=90))
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.opts = {"logdir": logdir, "target_world": target_world, "after": after, "slow": slow, **opts}
        self.procs: dict[str, mp.Process] = {}

    def spawn(self, wids) -> None:
        for w in wids:
            # a daemonic process may not start DataLoader workers
            p = self.ctx.Process(target=worker, args=(w, self.port, self.opts, self.out),
                                 daemon=not self.opts.get("loader", {}).get("num_workers"))
            p.start()
            self.procs[w] = p

    def wait_step(self, wid: str, step: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        key = f"job/elastic-state/test/prog/{wid}"
        while time.monotonic() < deadline:
            if self.server.check([key]) and int(self.server.get(key)) >= step:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{wid} did not reach step {step}")

    def wait_joined(self, wids, timeout: float = 120) -> None:
        """Until every worker of ``wids`` announced itself, as the launcher's Resizer waits (ALLOCATED -> JOINED)
        before it posts a grow: a plan posted earlier has the members build its group while a newcomer still
        imports torch, a wait bounded by the collective timeout (4 s in some tests; longer on a busy host)."""
        deadline = time.monotonic() + timeout
        while not set(wids) <= set(self.coord.joined()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sorted(set(wids) - set(self.coord.joined()))} did not announce themselves")
            time.sleep(0.05)

    def results(self, n: int, timeout: float = 90) -> dict:
        res = {}
        deadline = time.monotonic() + timeout
        while len(res) < n:
            try:
                r = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"only {sorted(res)} reported") from None
            res[r["wid"]] = r
        return res

    def close(self) -> dict:
        """Joins every worker (kills stragglers) and closes the store; returns exit codes."""
        codes = {}
        for w, p in self.procs.items():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
            codes[w] = p.exitcode
        self.out.close()
        self.out.join_thread()
        self.coord = self.server = None
        gc.collect()
        return codes


def port_closed(port: int, within_s: float = 20.0) -> bool:
    """Whether nothing listens on ``port`` any more, within ``within_s``: the store's server thread closes its
    socket after the object is gone, on its own time (beside busy loops once after the harness had returned)."""
    deadline = time.monotonic() + within_s
    while True:
        s = socket.socket()
        try:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return True
        finally:
            s.close()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def read_logs(logdir: str) -> list[dict]:
    out = []
    for f in sorted(os.listdir(logdir)):
        with open(os.path.join(logdir, f)) as fh:
            out += [json.loads(line) for line in fh if line.strip()]
    return out


def check_accounting(entries: list[dict], final_sampler: dict) -> None:
    """On the sample ids the models received (``ids``, carried by the items, not the sampler's ``idx``): every
    completed epoch delivered each sample exactly once across the ranks; the current epoch has no duplicate and its
    count equals the sampler position."""
    by_epoch: dict[int, list[int]] = {}
    for e in entries:
        by_epoch.setdefault(e["epoch"], []).extend(e["ids"])
    for ep, idx in by_epoch.items():
        if ep < final_sampler["epoch"]:
            assert sorted(idx) == list(range(N_SAMPLES)), f"epoch {ep}: {len(idx)} samples, " \
                f"{len(set(idx))} distinct"
        else:
            assert len(idx) == len(set(idx)), f"epoch {ep} saw duplicates"
            assert len(idx) == final_sampler["pos"], (len(idx), final_sampler)
