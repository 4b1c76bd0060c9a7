"""What-if replay: one job history on a simulated cluster under each sizing policy (issue #40).

A SimPy discrete-event simulation. Each job is a SimPy process that trains for its steps at the step time of its
current layout and is interrupted when the launcher's rules resize it. Policies, all on the same history:

    as-submitted  Slurm's main scheduler (in order) and backfill (conservative) on the GPUs the job asked for
    right-sized   the job_submit hook's planner (predictor.planner.plan) rewrites the request at submit, on the
                  predictions of a Predictor fitted on what the replay has measured so far
    elastic       right-sized, then the launcher's grow/shrink rules every `tick_s` (AutoscalePolicy.decide,
                  yield_to_pending, settle_decision; advice from the planner with the job's current layout),
                  each resize paying the measured pause; a hand-back only for a shorter job, grown back after
                  (Replay._elastic_tick)
    oracle        the elastic rules with every prediction answered by the truth tables

Truth and decisions are kept apart: progress comes only from the truth tables (`replay_inputs.PolluxTruth`);
decisions come only from the planner on predictions. Under the prediction-driven policies the Predictor
(predictor.engine.Predictor, through the planner's models interface) is refitted on the step rows the running jobs
have reported so far, when a row of a (model, batch, layout) not seen before arrived and `refit_s` of simulated
time passed since the last fit: a live site's service, fitted on its own history.

Placement: a job asking G GPUs without a node count is packed on as few nodes as the free GPUs allow (most free
first); a planned job asks `nodes x gpus_per_node` and gets nodes with that many free (fullest-fitting first).
Backfill plans with each job's time limit (right-sized: the planner's longer one where it chose a layout predicted
slower than the one asked, as the hook sets it); jobs are not killed at it. A finished job's GPUs are free again
`release_s` later (Slurm's COMPLETING). Resizes: a grow takes whole idle nodes (the launcher's helper job), a shrink
gives back the job's last nodes.

The launcher's shrinks go only as far as finishes inside the job's time limit (its limit at submit, the hook's longer
one for right-sized jobs; AutoscalePolicy.within_limit), as the launcher reads it from Slurm.

Left out: GPU types (one partition: the one the cluster model names first or `partition`), the planner's mixed-type
and cross-partition choices, the launcher's revert measurements' noise, failures, stragglers, preemption, job
priorities other than submit order, and time limits killing jobs.
"""
from __future__ import annotations

import dataclasses
import math
import time
import zlib
from typing import Callable

import numpy as np
import requests
import simpy

from elastic_launcher.autoscale import (YIELD_RATIO, AutoscalePolicy, Measurement, PendingJob, TimeBudget,
                                        advice_from_plan, yield_to_pending)
from elastic_launcher.steering import settle_decision
from predictor.cluster import Cluster
from predictor.datasets import POLLUX_MODELS, _profiles
from predictor.engine import Predictor
from predictor.planner import parse_request, plan
from predictor.replay_inputs import PolluxTruth, ReplayJob
from predictor.service import ModelUnavailable
from slurm_plugin.contracts.directives import parse_lines

POLICIES = ("as-submitted", "right-sized", "elastic", "oracle")
# Measured resize pauses (bench/results/launcher_transitions.md, Slurm 22.05 testbed): the controller's request to
# the first step at the new size, charged in full as time the job does not train (its training continues
# meanwhile in fact): grow 2->4 with a helper job 0.811 s, shrink 4->2 1.112 s.
GROW_PAUSE_S = 0.811
SHRINK_PAUSE_S = 1.112
KEEP_ROWS = 5  # newest step rows kept per (model, per-GPU batch, layout): the fit's cost stays bounded


@dataclasses.dataclass
class Params:
    """Knobs of a replay.

    Attributes:
        tick_s: the launcher's measurement window (one decision per running elastic job per tick).
        yield_s: how soon after a job queues that cannot start the running elastic jobs hand nodes back for it
            (the launcher checks the partition's pending jobs at every measurement, seconds apart; a handback
            waits for no tick).
        refit_s: least simulated time between two fits of the prediction service.
        bf_depth: queued jobs backfill tests, in order (Slurm's bf_max_job_test: 500 by default).
        min_efficiency: the planner's default and the launcher's grow test.
        grow_pause_s / shrink_pause_s: training time a resize costs the job.
        noise: log-normal spread of the step times jobs report to the service (seeded).
        seed: the noise's seed.
        release_s: seconds a finished job's GPUs stay held (Slurm's COMPLETING state: epilog, step cleanup, and the
            wait for slurmctld's next scheduling pass) before another job may start on them; fitted on a history
            run as submitted (calibrate_release).
        fewer_nodes_within: a what-if of a planner rule it does not have (0 = off, the planner as it is): of the
            layouts of the planned GPU count, the hook takes the one on the fewest nodes whose predicted samples/s
            is within this share of the planned one's (a layout on every node waits for all of them to be free).
        yield_ratio: a running job hands nodes back to the head pending job only when that job's time limit is at
            most this share of the time the running job has left at its current size (default: the launcher's
            autoscale.YIELD_RATIO; inf: always, the launcher's rule before session 21).
    """

    tick_s: float = 300.0
    yield_s: float = 30.0
    refit_s: float = 600.0
    bf_depth: int = 100
    min_efficiency: float = 0.5
    grow_pause_s: float = GROW_PAUSE_S
    shrink_pause_s: float = SHRINK_PAUSE_S
    noise: float = 0.03
    seed: int = 0
    fewer_nodes_within: float = 0.0
    release_s: float = 0.0
    yield_ratio: float = YIELD_RATIO


@dataclasses.dataclass(frozen=True)
class _Named:
    name: str


class _Models:
    """The planner's models interface (`predictor()`, `profile()`, `known()`, `predict()`, `version`) over a fitted
    Predictor, or nothing fitted yet (ModelUnavailable)."""

    def __init__(self, profiles: dict, predictor: Predictor | None, version: str):
        self._p, self._profiles, self.version = predictor, profiles, version

    def predictor(self):
        if self._p is None:
            raise ModelUnavailable("nothing fitted yet: no job has reported a step")
        return self._p

    def profile(self, name: str):
        return self._profiles.get(name)

    def known(self, name: str, gpu: str) -> bool:
        return self.predictor().known(name, gpu)

    def predict(self, profile, gpu, per_gpu_batch, candidates, job_id=None, uid=None):
        return self.predictor().predict(profile, gpu, per_gpu_batch, candidates, job_id=job_id, uid=uid)


class _TruthModels(_Models):
    """The same interface answered from the truth tables: what the oracle plans with (the planner reads only a
    profile's name on this path, so no tensor profile is built)."""

    def __init__(self, truth: PolluxTruth):
        super().__init__({m: _Named(m) for m in truth.apps}, None, "truth")
        self.truth = truth

    def predictor(self):
        return self

    def known(self, name: str, gpu: str) -> bool:
        return name in self.truth.apps

    def predict(self, profile, gpu, per_gpu_batch, candidates, job_id=None, uid=None):
        out = []
        for c in candidates:
            g = sum(c["layout"])
            step, sync = self.truth.step(profile.name, tuple(c["layout"]), int(per_gpu_batch * g))
            out.append({"layout": list(c["layout"]), "samples_per_s": g * per_gpu_batch / step, "iter_s": step,
                        "compute_s": step - sync, "comm_s": sync, "uncertainty": 0.0, "basis": "truth"})
        return out


class Advisor:
    """Plans through predictor.planner.plan on a models interface; answers cached per request for the current
    model version (a new version empties the cache)."""

    def __init__(self, cluster: Cluster, models: _Models, min_efficiency: float):
        self.cluster, self.models, self.min_efficiency = cluster, models, min_efficiency
        self._cache: dict = {}
        self._version = models.version
        self.calls = 0

    def plan(self, lines: tuple[str, ...], job: dict, current: list[int] | None = None) -> dict:
        if self.models.version != self._version:
            self._cache, self._version = {}, self.models.version
        key = (lines, tuple(sorted(job.items())), tuple(current or ()))
        hit = self._cache.get(key)
        if hit is None:
            self.calls += 1
            body = {"source": "launcher" if current else "job_submit", "directives": list(lines), "job": job}
            if current:
                body["current"] = {"layout": list(current)}
            hit = plan(parse_request(body), self.cluster, self.models, default_min_efficiency=self.min_efficiency)
            self._cache[key] = hit
        return hit


class HttpAdvisor:
    """Plans from a running prediction service (POST /v1/plan, source `cli`; `launcher` with the job's current
    layout): the replay then decides exactly as that service's hook would, on its fitted model."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._cache: dict = {}
        self.calls = 0

    def plan(self, lines: tuple[str, ...], job: dict, current: list[int] | None = None) -> dict:
        key = (lines, tuple(sorted(job.items())), tuple(current or ()))
        hit = self._cache.get(key)
        if hit is None:
            self.calls += 1
            body = {"source": "launcher" if current else "cli", "directives": list(lines),
                    "job": {k: v for k, v in job.items() if k != "partition"}}
            if current:
                body["current"] = {"layout": list(current)}
            reply = requests.post(self.url + "/v1/plan", json=body, timeout=self.timeout_s)
            reply.raise_for_status()
            hit = self._cache[key] = reply.json()
        return hit


class OnlineService:
    """The prediction service as the replay sees it: step rows the jobs reported (the newest KEEP_ROWS of each
    model, per-GPU batch and layout), a Predictor refitted on them."""

    def __init__(self, cluster: Cluster, params: Params):
        self.profiles = _profiles(POLLUX_MODELS)
        self.rows: dict[tuple, list[dict]] = {}
        self.fresh = False
        self.fits, self.fit_s, self.last_fit = 0, 0.0, -math.inf
        self.params = params
        self.advisor = Advisor(cluster, _Models(self.profiles, None, "g0"), params.min_efficiency)

    def report(self, row: dict) -> None:
        key = (row["profile"], row["per_gpu_batch"], tuple(row["layout"]))
        if key not in self.rows:
            self.fresh = True
        kept = self.rows.setdefault(key, [])
        kept.append(row)
        del kept[:-KEEP_ROWS]

    def maybe_refit(self, now: float) -> None:
        if not self.fresh or now - self.last_fit < self.params.refit_s:
            return
        t = time.perf_counter()
        p = Predictor().fit(self.profiles, [r for rows in self.rows.values() for r in rows])
        self.fit_s += time.perf_counter() - t
        self.fits += 1
        self.fresh, self.last_fit = False, now
        self.advisor.models = _Models(self.profiles, p, f"g{self.fits}")


@dataclasses.dataclass
class _Run:
    """A job in the replay: its request, where it runs, and what happened to it."""

    job: ReplayJob
    request: tuple[int | None, int]          # (nodes or None: packed, GPUs)
    lines: tuple[str, ...]
    start: float | None = None
    end: float | None = None
    alloc: list = dataclasses.field(default_factory=list)  # [(node, gpus)]
    remaining: float = 0.0                   # steps (model jobs) or seconds (fixed jobs)
    step_s: float = 1.0
    pending_pause: float = 0.0
    gpu_seconds: float = 0.0
    since: float = 0.0                        # start of the current allocation (GPU-seconds accounting)
    resizes: int = 0
    proc: object = None
    policy: AutoscalePolicy | None = None
    planned: dict | None = None
    began: float = 0.0                        # start of the current training segment (after its pause)

    @property
    def gpus(self) -> int:
        return sum(g for _, g in self.alloc)

    @property
    def layout(self) -> tuple[int, ...]:
        return tuple(sorted((g for _, g in self.alloc), reverse=True))


class Replay:
    """One policy on one history and cluster shape. `run()` returns `Result`."""

    def __init__(self, jobs: list[ReplayJob], cluster: Cluster, truth: PolluxTruth, policy: str,
                 params: Params | None = None, partition: str | None = None, service_url: str | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {'|'.join(POLICIES)}, got {policy!r}")
        self.jobs, self.cluster, self.truth, self.policy = jobs, cluster, truth, policy
        self.params = params or Params()
        self.part = cluster.partition(partition)
        self.per_node = self.part.gpus_per_node
        self.free = np.full(len(self.part.nodes), self.per_node, dtype=np.int64)
        self.total = int(self.free.sum())
        self.env = simpy.Environment()
        self.queue: list[_Run] = []
        self.running: list[_Run] = []
        self.done: list[_Run] = []
        self.releasing: list[_Run] = []
        self.rng = np.random.default_rng(self.params.seed)
        predicted = policy in ("right-sized", "elastic")
        self.service = OnlineService(cluster, self.params) if predicted and not service_url else None
        self.http = HttpAdvisor(service_url) if predicted and service_url else None
        self.oracle = Advisor(cluster, _TruthModels(truth), self.params.min_efficiency) \
            if policy == "oracle" else None
        self._sched_soon = False
        self.decisions: dict[str, int] = {}       # resize decisions taken, by kind (grow, shrink, revert, handback)
        self.busy_samples: list[tuple[float, int]] = []

    # ------------------------------------------------------------------ advice
    def _advisor(self) -> Advisor | None:
        if self.oracle is not None or self.http is not None:
            return self.oracle or self.http
        return self.service.advisor if self.service else None

    def _job_fields(self, request: tuple[int | None, int], limit_s: float | None = None) -> dict:
        nodes, gpus = request
        limit = {"time_limit_min": math.ceil(limit_s / 60)} if limit_s else {}   # Slurm's --time: whole minutes
        if nodes:
            return {"partition": self.part.name, "min_nodes": nodes, "tres_per_node": f"gres:gpu:{gpus // nodes}",
                    **limit}
        return {"partition": self.part.name, "tres_per_job": f"gres:gpu:{gpus}", **limit}

    def _size_at_submit(self, run: _Run) -> None:
        adv = self._advisor()
        if adv is None or not run.lines or run.job.model is None:
            return
        out = _fewer_nodes(adv.plan(run.lines, self._job_fields(run.request, run.job.limit_s)),
                           self.params.fewer_nodes_within)
        if out["action"] == "rewrite" and out.get("layout"):
            run.request = (out["nodes"], out["nodes"] * out["gpus_per_node"])
            run.planned = out
            if out.get("time_limit_min"):   # the hook's longer limit for a slower layout (issue #40)
                run.job = dataclasses.replace(run.job, limit_s=60.0 * out["time_limit_min"])

    # ------------------------------------------------------------------ cluster
    def _place(self, request: tuple[int | None, int], free: np.ndarray | None = None) -> list | None:
        """[(node, GPUs)] for the request on the GPUs free now (or on `free` GPUs a node), or None where it does
        not fit."""
        free = self.free if free is None else free
        nodes, gpus = request
        if gpus > free.sum():
            return None
        if nodes:
            k = gpus // nodes
            ok = np.flatnonzero(free >= k)
            if len(ok) < nodes:
                return None
            pick = ok[np.argsort(free[ok], kind="stable")[:nodes]]   # fullest nodes that fit first
            return [(int(n), k) for n in pick]
        if gpus <= self.per_node:                                     # one node: best fit
            ok = np.flatnonzero(free >= gpus)
            if len(ok):
                return [(int(ok[np.argmin(free[ok])]), gpus)]
        order = np.argsort(-free, kind="stable")
        out, left = [], gpus
        for n in order:
            if left == 0 or free[n] == 0:
                break
            take = int(min(free[n], left))
            out.append((int(n), take))
            left -= take
        return out if left == 0 else None

    def _take(self, alloc: list) -> None:
        for n, g in alloc:
            self.free[n] -= g

    def _give(self, alloc: list) -> None:
        for n, g in alloc:
            self.free[n] += g

    # ------------------------------------------------------------------ jobs
    def _step_of(self, run: _Run) -> float:
        j = run.job
        if j.model is None:
            return 1.0
        return self.truth.step(j.model, run.layout, j.global_batch)[0]

    def _report(self, run: _Run) -> None:
        """The step row the job's launcher posts at its current layout (truth with measurement noise)."""
        if self.service is None or run.job.model is None:
            return
        j, lay = run.job, list(run.layout)
        step, sync = self.truth.step(j.model, run.layout, j.global_batch)
        noise = float(np.exp(self.rng.normal(0.0, self.params.noise)))
        row = {"kind": "step", "profile": j.model, "gpu": self.part.gpu, "layout": lay,
               "intra_link": self.part.intra_link, "per_gpu_batch": max(1, j.global_batch // sum(lay)),
               "iter_s": step * noise, "sync_s": min(sync * noise, step * noise),
               "job_id": zlib.crc32(j.name.encode()) % 2**31}
        if len(lay) > 1:
            row["inter_link"] = self.part.inter_link
        self.service.report(row)

    def _start(self, run: _Run, alloc: list) -> None:
        self._take(alloc)
        run.alloc, run.start, run.since = alloc, self.env.now, self.env.now
        j = run.job
        run.remaining = j.steps if j.model is not None else j.duration_s
        run.step_s = self._step_of(run)
        self.queue.remove(run)
        self.running.append(run)
        self._report(run)
        if self.policy in ("elastic", "oracle") and run.lines and j.model is not None:
            d = _directives(run.lines)
            bounds = d.get("gpus") or {"min": j.gpus, "max": j.gpus}
            run.policy = AutoscalePolicy(min_efficiency=d.get("min_efficiency", self.params.min_efficiency),
                                         per_gpu_batch=1, slots_per_node=run.layout[0], min_workers=bounds["min"],
                                         max_workers=bounds["max"])
        run.proc = self.env.process(self._train(run))

    def _train(self, run: _Run):
        while True:
            began, step, pause = self.env.now, run.step_s, run.pending_pause
            run.pending_pause, run.began = 0.0, began + pause
            try:
                yield self.env.timeout(pause + run.remaining * step)
                run.remaining = 0.0
                break
            except simpy.Interrupt:
                spent = self.env.now - began
                if spent < pause:
                    run.pending_pause += pause - spent
                else:
                    run.remaining = max(0.0, run.remaining - (spent - pause) / step)
        self._account(run)
        run.end = self.env.now
        self.running.remove(run)
        self.done.append(run)
        if self.params.release_s > 0:       # the nodes are COMPLETING (epilog, step cleanup) before they are free
            self.releasing.append(run)
            yield self.env.timeout(self.params.release_s)
            self.releasing.remove(run)
        self._give(run.alloc)
        self._schedule_soon()

    def _account(self, run: _Run) -> None:
        run.gpu_seconds += run.gpus * (self.env.now - run.since)
        run.since = self.env.now

    def _resize(self, run: _Run, alloc: list, pause: float) -> None:
        self._account(run)
        run.alloc = alloc
        run.step_s = self._step_of(run)
        run.pending_pause += pause
        run.resizes += 1
        self._report(run)
        run.proc.interrupt("resize")

    # ------------------------------------------------------------------ scheduling
    def _schedule_soon(self) -> None:
        if not self._sched_soon:
            self._sched_soon = True
            self.env.process(self._deferred())

    def _deferred(self):
        yield self.env.timeout(0)
        self._sched_soon = False
        self.schedule()

    def schedule(self) -> None:
        """Slurm's two schedulers: the main one starts queued jobs in order until one does not fit; backfill then
        gives every queued job (in order, up to bf_depth) the earliest time its nodes are free for its whole time
        limit, and starts those whose time is now. The profile is per node, as sched/backfill's: the GPUs of running
        jobs come back at their time limits (COMPLETING ones after release_s), and a queued job's reservation takes
        its nodes whole for its limit, as backfill's node-space map does. Agreement with the lab's slurmctld:
        tests/integration/test_replay_fidelity.py (a GPU-count profile started 1-GPU jobs on nodes Slurm keeps for
        a reservation, and ran 13% long on average JCT of a right-sized slice)."""
        if self.service is not None:
            self.service.maybe_refit(self.env.now)
        while self.queue:
            alloc = self._place(self.queue[0].request)
            if alloc is None:
                break
            self._start(self.queue[0], alloc)
        if not self.queue:
            return
        times, free = self._profile()
        held = np.zeros(free.shape, dtype=bool)          # held[k, n]: node n is reserved from times[k] on
        for run in list(self.queue[:self.params.bf_depth]):
            limit = run.job.limit_s or math.inf
            stops = np.maximum(np.searchsorted(times, times + limit, "left"), np.arange(1, len(times) + 1))
            for k in range(len(times)):
                window = slice(k, int(stops[k]))
                room = np.where(held[window].any(axis=0), 0, free[window].min(axis=0))
                alloc = self._place(run.request, room)
                if alloc is not None:
                    break
            else:
                continue
            stop, end = int(stops[k]), times[k] + limit
            if math.isfinite(end) and (stop == len(times) or times[stop] != end):   # a row where it ends
                times = np.insert(times, stop, end)
                free = np.insert(free, stop, free[stop - 1], axis=0)
                held = np.insert(held, stop, held[stop - 1], axis=0)
            nodes = [n for n, _ in alloc]
            if k == 0:                                    # backfilled: its GPUs are taken until its limit
                self._start(run, alloc)
                free[:stop, nodes] -= np.array([g for _, g in alloc])
            else:
                held[k:stop, nodes] = True

    def _profile(self) -> tuple[np.ndarray, np.ndarray]:
        """(times from now, free[k, n]: GPUs free on node n from times[k] on, counting only running jobs, each
        until its time limit, and COMPLETING ones until release_s after their end)."""
        now = self.env.now
        frees = [(max(r.start + (r.job.limit_s or 0.0), np.nextafter(now, math.inf)), r.alloc) for r in self.running]
        frees += [(r.end + self.params.release_s, r.alloc) for r in self.releasing]
        times = np.array(sorted({now} | {t for t, _ in frees}))
        free = np.tile(self.free, (len(times), 1))
        for t, alloc in frees:
            k = int(np.searchsorted(times, t))
            for n, g in alloc:
                free[k:, n] += g
        return times, free

    # ------------------------------------------------------------------ elastic
    def _ticker(self):
        while len(self.done) < len(self.jobs):
            yield self.env.timeout(self.params.tick_s)
            self._elastic_tick()

    def _yield_soon(self):
        yield self.env.timeout(self.params.yield_s)
        if self.queue:
            self._elastic_tick(handback_only=True)

    def _elastic_tick(self, handback_only: bool = False) -> None:
        """One launcher decision per running elastic job (`handback_only`: only yield_to_pending's shrinks), by the
        launcher's own rules (AutoscalePolicy.decide, yield_to_pending, settle_decision), among them those the
        replay's per-job output found (bench/results/replay/README.md): a hand-back only to a head pending job at
        most `Params.yield_ratio` as long as the job's time left, the nodes lent grown back once nobody waits, and
        the plan's shrinks only while a job waits."""
        adv = self._advisor()
        changed = False
        pending = [PendingJob(k, -(-r.request[1] // self.per_node) if not r.request[0] else r.request[0], "Resources",
                              r.job.limit_s or math.inf) for k, r in enumerate(self.queue[:8])]
        for run in list(self.running):
            if run.policy is None or (self.env.now - run.start < self.params.tick_s and not handback_only):
                continue
            slots, nodes = run.layout[0], len(run.alloc)
            idle = int(np.sum(self.free == self.per_node))
            steps_left = max(0.0, run.remaining - max(0.0, self.env.now - run.began) / run.step_s)
            left = steps_left * run.step_s
            limit = run.job.limit_s
            budget = TimeBudget(max(0.0, run.start + limit - self.env.now) if limit else None, steps_left)
            if not handback_only or not run.policy.history_ or run.policy.history_[-1].nodes != nodes:
                run.policy.record(Measurement(nodes, run.gpus, run.job.global_batch / run.step_s, run.step_s))
            handback = yield_to_pending(nodes, run.policy.min_nodes(), idle, pending, left, self.params.yield_ratio)
            if handback is not None:   # the launcher's time-limit rule (Controller._measure_and_decide)
                handback = run.policy.within_limit(handback, nodes, budget, whole=True)
                handback = None if handback.action == "keep" else handback
            if handback_only:
                if handback is None:
                    continue
                decision = handback
            else:
                reply = adv.plan(_at_size(run.lines, run.job.global_batch, run.gpus),
                                 self._job_fields(run.request), current=list(run.layout))
                advice = advice_from_plan(reply, nodes, slots)
                decision = settle_decision(run.policy.decide(idle, advice, waiting=bool(pending), budget=budget),
                                           nodes, handback, pending, None, advice)
            kind = "handback" if handback is not None and decision is handback else decision.action
            if decision.action == "grow" and decision.target_nodes > nodes:
                idle_nodes = np.flatnonzero(self.free == self.per_node)[:decision.target_nodes - nodes]
                add = [(int(n), slots) for n in idle_nodes]
                if add:
                    self.decisions[kind] = self.decisions.get(kind, 0) + 1
                    self._take(add)
                    self._resize(run, run.alloc + add, self.params.grow_pause_s)
                    changed = True
            elif decision.action in ("shrink", "revert") and decision.target_nodes < nodes:
                self.decisions[kind] = self.decisions.get(kind, 0) + 1
                if kind == "handback":   # lent: grown back once nobody waits (AutoscalePolicy.lent_nodes_)
                    run.policy.lent_nodes_ = max(run.policy.lent_nodes_, nodes)
                keep, drop = run.alloc[:decision.target_nodes], run.alloc[decision.target_nodes:]
                self._give(drop)
                self._resize(run, keep, self.params.shrink_pause_s)
                changed = True
                if handback is not None:
                    pending = pending[1:]
        if changed or self.queue:
            self._schedule_soon()

    # ------------------------------------------------------------------ run
    def _arrivals(self):
        for job in sorted(self.jobs, key=lambda j: j.submit_s):
            if job.submit_s > self.env.now:
                yield self.env.timeout(job.submit_s - self.env.now)
            request = (job.nodes, job.gpus)
            if request[1] > self.total:
                raise ValueError(f"job {job.name} asks {job.gpus} GPUs; the cluster has {self.total}")
            run = _Run(job, request, tuple(job.directives) if self.policy != "as-submitted" else ())
            self._size_at_submit(run)
            self.queue.append(run)
            self._schedule_soon()
            if self.policy in ("elastic", "oracle"):
                self.env.process(self._yield_soon())

    def _sampler(self, every: float):
        while len(self.done) < len(self.jobs):
            self.busy_samples.append((self.env.now, self.total - int(self.free.sum())))
            yield self.env.timeout(every)

    def run(self, sample_s: float = 600.0) -> "Result":
        t = time.perf_counter()
        self.env.process(self._arrivals())
        if self.policy in ("elastic", "oracle"):
            self.env.process(self._ticker())
        self.env.process(self._sampler(sample_s))
        self.env.run()
        if len(self.done) != len(self.jobs):
            stuck = [r.job.name for r in self.queue[:5]]
            raise RuntimeError(f"replay ended with {len(self.jobs) - len(self.done)} jobs unfinished: {stuck}")
        fits = (self.service.fits, self.service.fit_s) if self.service else (0, 0.0)
        return Result(self.policy, self.done, self.total, time.perf_counter() - t, fits, self.busy_samples,
                      dict(self.decisions))


def _at_size(lines: tuple[str, ...], global_batch: int, gpus: int) -> tuple[str, ...]:
    """The job's lines with `per_gpu_batch` at its current size. With `batch_policy=keep_global` the planner takes
    the global batch as per_gpu_batch x the GPUs it runs on now (planner._plan_on), so the submit-time line asked
    from a job resized since would plan another global batch than the one it trains at."""
    return tuple(f"#ELASTIC per_gpu_batch={max(1, global_batch // gpus)}" if "per_gpu_batch=" in ln else ln
                 for ln in lines)


def _fewer_nodes(reply: dict, within: float) -> dict:
    """`reply` with its layout moved to the fewest-node layout of the same GPU count whose predicted samples/s is
    within `within` of the chosen one (Params.fewer_nodes_within); `reply` itself when off or nothing closer."""
    if within <= 0 or not reply.get("layout") or not reply.get("predicted"):
        return reply
    best = reply["predicted"]["samples_per_s"]
    gpus = sum(reply["layout"])
    near = [e for e in reply.get("curve", []) if e["gpus"] == gpus and e["samples_per_s"] >= (1 - within) * best]
    pick = min(near, key=lambda e: e["nodes"], default=None)
    if pick is None or pick["nodes"] >= reply["nodes"]:
        return reply
    return {**reply, "action": "rewrite", "layout": pick["layout"], "nodes": pick["nodes"],
            "gpus_per_node": pick["layout"][0]}


def _directives(lines: tuple[str, ...]) -> dict:
    """The job's `#ELASTIC` lines parsed as the hook and the launcher parse them."""
    return parse_lines(list(enumerate(lines, start=1)))


@dataclasses.dataclass
class Result:
    """One policy's replay: per-job records and what it cost to run."""

    policy: str
    runs: list
    total_gpus: int
    wall_s: float
    fits: tuple[int, float]
    busy: list
    decisions: dict = dataclasses.field(default_factory=dict)

    def jobs(self) -> dict[str, dict]:
        return {r.job.name: {"submit": r.job.submit_s, "start": r.start, "end": r.end, "jct": r.end - r.job.submit_s,
                             "queue": r.start - r.job.submit_s, "gpu_s": r.gpu_seconds, "gpus_asked": r.job.gpus,
                             "gpus_start": r.request[1], "resizes": r.resizes} for r in self.runs}

    def summary(self) -> dict:
        js = list(self.jobs().values())
        jct = np.array([j["jct"] for j in js])
        q = np.array([j["queue"] for j in js])
        first = min(j["submit"] for j in js)
        makespan = max(j["end"] for j in js) - first
        gpu_h = sum(j["gpu_s"] for j in js) / 3600
        return {"policy": self.policy, "jobs": len(js), "avg_jct_s": float(jct.mean()),
                "p99_jct_s": float(np.percentile(jct, 99)), "avg_queue_s": float(q.mean()),
                "makespan_s": float(makespan), "gpu_hours": gpu_h,
                "utilisation": gpu_h * 3600 / (self.total_gpus * makespan) if makespan > 0 else 0.0,
                "resizes": int(sum(j["resizes"] for j in js)), "decisions": self.decisions, "wall_s": self.wall_s,
                "fits": self.fits[0],
                "fit_s": self.fits[1]}


def later_than(base: Result, other: Result, factor: float = 1.1) -> list[tuple[str, float, float]]:
    """Jobs whose JCT under `other` exceeds `factor` x their JCT under `base`: (name, base JCT, other JCT)."""
    a, b = base.jobs(), other.jobs()
    return sorted(((n, a[n]["jct"], b[n]["jct"]) for n in a if b[n]["jct"] > factor * a[n]["jct"]),
                  key=lambda t: t[2] / t[1], reverse=True)


def calibrate_release(jobs: list[ReplayJob], cluster: Cluster, truth: PolluxTruth, avg_jct_s: float,
                      params: Params | None = None, hi_s: float = 5.0, tol_s: float = 0.02) -> float:
    """The `release_s` at which the as-submitted replay of `jobs` (a history at its submit times, the sizes it ran
    at) has the average JCT `avg_jct_s` that Slurm measured for it: a site's scheduler constant, fitted on its own
    history before its what-if policies are replayed. It holds what the replay does not model of slurmctld: COMPLETING,
    and that its schedulers start jobs on a one-second loop, not on the event (a job that ends between two passes
    holds its GPUs until the next). Bisection on [0, hi_s] to `tol_s`, returning the value tried whose average JCT
    came closest (the average steps as jobs pass one another); 0 when even no release replays slower than measured;
    ValueError when even `hi_s` replays faster (the history is not this cluster's, or not as submitted)."""
    if not jobs or not avg_jct_s > 0:
        raise ValueError(f"calibrate_release needs jobs and a measured average JCT above 0 (got {len(jobs)} jobs, "
                         f"{avg_jct_s!r} s)")
    base = params or Params()

    def excess(release: float) -> float:
        runs = Replay(jobs, cluster, truth, "as-submitted", dataclasses.replace(base, release_s=release)).run()
        return float(np.mean([j["jct"] for j in runs.jobs().values()])) - avg_jct_s

    lo, hi = 0.0, hi_s
    if excess(lo) >= 0:
        return 0.0
    if excess(hi) < 0:
        raise ValueError(f"calibrate_release: even release_s={hi_s} s replays the history faster than its measured "
                         f"average JCT of {avg_jct_s:.1f} s")
    tried = []       # a queue's average JCT steps as release_s moves jobs past one another: the closest one tried
    while hi - lo > tol_s:
        mid = (lo + hi) / 2
        off = excess(mid)
        tried.append((abs(off), mid))
        lo, hi = (mid, hi) if off < 0 else (lo, mid)
    return min(tried)[1] if tried else (lo + hi) / 2


def replay_all(jobs: list[ReplayJob], cluster: Cluster, truth: PolluxTruth, policies=POLICIES,
               params: Params | None = None, progress: Callable[[str], None] | None = None,
               service_url: str | None = None) -> dict[str, Result]:
    """Each policy on the same history (`service_url`: prediction-driven policies plan from that running service
    instead of a Predictor fitted in the replay)."""
    out = {}
    for p in policies:
        out[p] = Replay(jobs, cluster, truth, p, params, service_url=service_url).run()
        if progress:
            progress(p)
    return out
