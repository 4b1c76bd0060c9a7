"""What the what-if replay (predictor/replay.py) replays: job histories, and the truth that runs them.

Truth (`PolluxTruth`): the Pollux OSDI'21 measured tables (predictor/data/pollux-osdi21), read the way Pollux's own
simulator reads them (adaptdl `osdi21-artifact`, simulator/applications.py), so a job's progress never comes from
a model:
- step and sync time of a placement at a per-GPU batch: `placements.csv` interpolated over the batch (linear) where
  the placement (rotated to its smallest rotation) was measured, else a linear interpolation over (nodes,
  replicas, batch) of the placement means and `scalability.csv` (nodes capped at 16);
- a global batch B on G GPUs runs ceil(B / G) per GPU, with gradient accumulation past the model's largest
  measured per-GPU batch (`accum` extra micro-steps, each costing step - sync);
- a job at global batch B is done after the validation table's iteration count at its last epoch (interpolated
  between the measured batches), so every size trains to the same statistical progress.

Histories (`ReplayJob` lists):
- `load_pollux_workload(n)`: the paper's 160-job workloads (arrival, model, GPUs asked, global batch);
- `load_itp(path)`: the ITP / ElasticFlow traces (submit, duration, GPUs). They name no model: each job gets
  one of the six Pollux models from a seeded hash of its id and the largest measured global batch its GPUs hold
  without accumulation; its duration at its GPU count becomes steps;
- `load_sacct(path)`: a site's `sacct -P` export (`--format=JobID,JobName,Submit,Start,End,Timelimit,AllocTRES,
  NNodes,State,Comment`). A job whose Comment holds `#ELASTIC` lines naming a model the truth tables know runs
  in steps (its measured duration at its allocation becomes its work); any other job runs its measured duration
  at its own size, whatever the policy.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import math
import re
from datetime import datetime
from pathlib import Path

import numpy as np
from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator, interp1d

from predictor.datasets import DEFAULT_ROOT, _read
from slurm_plugin.contracts.directives import PREFIX

# Pollux's simulator: max_local_bsz overridden for yolov3 (applications.py, APPLICATIONS)
MAX_LOCAL_BSZ = {"yolov3": 8}
POLLUX_APPS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")
GPUS_PER_NODE = 4  # the tables' nodes (g4dn.12xlarge)


class InputError(ValueError):
    """A history that cannot be replayed; the message names the file, line and field."""


@dataclasses.dataclass
class ReplayJob:
    """One job of a history.

    Attributes:
        name: the job's name in the report (sacct JobID, the workload's name, the trace's id).
        submit_s: submit time, seconds from the history's start.
        gpus: GPUs the job asked for.
        nodes: nodes it asked for (None: Slurm packs the GPUs on as few nodes as it can).
        model: the truth table's model (None: a job of fixed duration, never resized).
        global_batch: its global batch (kept whatever the size: `batch_policy=keep_global`).
        steps: its work in optimizer steps (model jobs).
        duration_s: its run time at its own size (jobs without a model; for model jobs, at the size asked).
        limit_s: its time limit (what backfill plans with).
        directives: its `#ELASTIC` lines (empty: not an elastic job; the planner keeps it as asked).
        start_s: when it started in the history, seconds from the history's start (sacct exports; None: unknown).
    """

    name: str
    submit_s: float
    gpus: int
    nodes: int | None = None
    model: str | None = None
    global_batch: int | None = None
    steps: float | None = None
    duration_s: float | None = None
    limit_s: float | None = None
    directives: tuple[str, ...] = ()
    start_s: float | None = None


class PolluxTruth:
    """Measured step time of the six Pollux models on T4 placements (see the module docstring)."""

    def __init__(self, root: Path = DEFAULT_ROOT):
        base = Path(root) / "pollux-osdi21" / "traces"
        self.apps = {}
        for app in POLLUX_APPS:
            rows = _read(base / app / "placements.csv")
            scal = _read(base / app / "scalability.csv")
            validation = {}
            for path in sorted((base / app).glob("validation-*.csv")):
                validation[int(path.stem.split("-")[1])] = [int(float(r["iteration"])) for r in _read(path)]
            if not validation:
                raise InputError(f"{base / app}: no validation-<batch>.csv tables (see its SOURCE.md)")
            local = [int(r["local_bsz"]) for r in rows]
            self.apps[app] = {"rows": rows, "scal": scal, "validation": dict(sorted(validation.items())),
                              "min_local": min(local), "max_local": MAX_LOCAL_BSZ.get(app, max(local)),
                              "init_batch": min(validation), "by_placement": {}}
            for r in rows:
                self.apps[app]["by_placement"].setdefault(int(r["placement"]), []).append(
                    (int(r["local_bsz"]), float(r["step_time"]), float(r["sync_time"])))

    def batches(self, app: str) -> list[int]:
        return list(self.apps[app]["validation"])

    def min_local(self, app: str) -> int:
        return self.apps[app]["min_local"]

    def steps_to_finish(self, app: str, batch: int) -> float:
        """Steps at global batch `batch` to its last epoch (interpolated between the measured batches)."""
        val = self.apps[app]["validation"]
        bs = list(val)
        batch = min(max(batch, bs[0]), bs[-1])
        lo = max(b for b in bs if b <= batch)
        hi = min(b for b in bs if b >= batch)
        epochs = min(len(v) for v in val.values())
        it_lo, it_hi = val[lo][epochs - 1], val[hi][epochs - 1]
        return float(it_lo if lo == hi else ((batch - lo) * it_hi + (hi - batch) * it_lo) / (hi - lo))

    def feasible(self, app: str, gpus: int, batch: int) -> bool:
        """Whether `batch` split over `gpus` is at least the smallest per-GPU batch measured."""
        return math.ceil(batch / gpus - 1e-8) >= self.apps[app]["min_local"]

    def step(self, app: str, layout: tuple[int, ...], batch: int) -> tuple[float, float]:
        """(seconds per optimizer step, seconds of it in gradient sync) of global batch `batch` on `layout`."""
        return self._step(app, tuple(sorted((int(g) for g in layout if g), reverse=True)), int(batch))

    @functools.lru_cache(maxsize=None)
    def _step(self, app: str, layout: tuple[int, ...], batch: int) -> tuple[float, float]:
        a = self.apps[app]
        gpus = sum(layout)
        local = math.ceil(batch / gpus - 1e-8)
        accum = math.ceil(local / a["max_local"] - 1e-8) - 1
        if gpus == 1 and batch > a["init_batch"]:
            accum = max(1, accum)
        atomic = max(math.ceil(local / (accum + 1) - 1e-8), a["min_local"])
        step, sync = self._throughput(app, layout, atomic)
        return step + accum * (step - sync), sync

    @functools.lru_cache(maxsize=None)
    def _throughput(self, app: str, layout: tuple[int, ...], atomic: int) -> tuple[float, float]:
        a = self.apps[app]
        rot = min(layout[i:] + layout[:i] for i in range(len(layout)))
        pid = int("".join(map(str, rot)))
        found = a["by_placement"].get(pid)
        if found:
            found = sorted(found)
            xs = np.array([f[0] for f in found], float)
            ys = np.array([[f[1], f[2]] for f in found])
            if len(xs) == 1:
                return float(ys[0, 0]), float(ys[0, 1])
            x = float(np.clip(atomic, xs[0], xs[-1]))
            v = interp1d(xs, ys, axis=0)(x)
            return float(v[0]), float(v[1])
        interp, near = self._nd(app)
        point = [min(len(layout), 16), sum(layout), atomic]
        v = interp(point)[0]
        if not np.all(np.isfinite(v)):
            v = near(point)[0]
        return float(v[0]), float(v[1])

    @functools.lru_cache(maxsize=None)
    def _nd(self, app: str):
        a = self.apps[app]
        groups: dict[tuple, list] = {}
        for r in a["rows"]:
            p = r["placement"]
            key = (len(p), sum(int(c) for c in p), int(r["local_bsz"]))
            groups.setdefault(key, []).append((float(r["step_time"]), float(r["sync_time"])))
        pts = [list(k) for k in groups] + [[int(r["num_nodes"]), int(r["num_replicas"]), int(r["local_bsz"])]
                                          for r in a["scal"]]
        vals = [list(np.mean(v, axis=0)) for v in groups.values()] + [[float(r["step_time"]), float(r["sync_time"])]
                                                                      for r in a["scal"]]
        pts, vals = np.array(pts, float), np.array(vals, float)
        return LinearNDInterpolator(pts, vals), NearestNDInterpolator(pts, vals)


def packed_layout(gpus: int, per_node: int = GPUS_PER_NODE) -> tuple[int, ...]:
    """GPUs on as few nodes as they fit: 6 -> (4, 2)."""
    return tuple(min(per_node, gpus - i) for i in range(0, gpus, per_node))


def elastic_lines(model: str, global_batch: int, gpus: int, truth: PolluxTruth, max_scale: float,
                  max_gpus: int, min_scale: float = 0.0, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The `#ELASTIC` lines a job of `model` at `global_batch` asking `gpus` GPUs carries in the replay: its model,
    its per-GPU batch at the size asked, the global batch kept, and GPU bounds max(1, min_scale x asked) ..
    max_scale x asked (never below the smallest per-GPU batch measured, nor above the cluster); `extra`: more
    lines (`#ELASTIC objective=efficiency`, `#ELASTIC min_efficiency=0.7`)."""
    high = max(1, min(int(max_scale * gpus), global_batch // truth.min_local(model), max_gpus))
    low = min(high, max(1, int(min_scale * gpus)))
    per_gpu = max(1, global_batch // gpus)
    return ("#ELASTIC model=" + model, f"#ELASTIC per_gpu_batch={per_gpu}", "#ELASTIC batch_policy=keep_global",
            f"#ELASTIC gpus={low}-{high}", *extra)


def load_pollux_workload(number: int, truth: PolluxTruth, root: Path = DEFAULT_ROOT) -> list[ReplayJob]:
    """Pollux workload `number` (1..8): one model job per row, its work the steps to its last epoch at its batch;
    time limit = its run time at the size asked (backfill then plans with exact estimates)."""
    path = Path(root) / "pollux-osdi21" / "workloads" / f"workload-{number}.csv"
    jobs = []
    for i, r in enumerate(_read(path)):
        app, gpus, batch = r["application"], int(r["num_replicas"]), int(r["batch_size"])
        if app not in truth.apps:
            raise InputError(f"{path}:{i + 2}: application {app!r} has no truth table")
        steps = truth.steps_to_finish(app, batch)
        dur = steps * truth.step(app, packed_layout(gpus), batch)[0]
        jobs.append(ReplayJob(r["name"], float(r["time"]), gpus, None, app, batch, steps, dur, dur))
    return jobs


def _model_for(job_id: str, gpus: int, truth: PolluxTruth, seed: int) -> tuple[str, int]:
    """A model and global batch for a trace job naming none: a seeded hash of its id picks among the models whose
    measured batches can spread over `gpus` GPUs; the batch is the largest measured one that runs on `gpus` GPUs
    without gradient accumulation (the user filled the GPUs' memory), else the smallest that spreads over them."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{job_id}".encode()).digest()[:8], "big")
    fits = []
    for m in POLLUX_APPS:
        ok = [b for b in truth.batches(m) if truth.feasible(m, gpus, b)]
        if ok:
            full = [b for b in ok if math.ceil(b / gpus) <= truth.apps[m]["max_local"]]
            fits.append((m, max(full) if full else min(ok)))
    return fits[h % len(fits)]


def load_itp(path: str | Path, truth: PolluxTruth, seed: int = 0, limit: int | None = None) -> list[ReplayJob]:
    """An ITP / ElasticFlow trace file (`job_id,submission_time,duration,num_gpu`; the ten clusters are vendored in
    bench/data/itp-elasticflow-traces/raw) as model jobs (see the module docstring); time limit = the trace's
    duration (exact estimates)."""
    path = Path(path)
    jobs = []
    for i, r in enumerate(_read(path)):
        try:
            gpus, dur, sub = int(r["num_gpu"]), float(r["duration"]), float(r["submission_time"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path}:{i + 2}: {exc}") from None
        if gpus < 1 or not dur > 0:
            continue
        model, batch = _model_for(r["job_id"], gpus, truth, seed)
        steps = dur / truth.step(model, packed_layout(gpus), batch)[0]
        jobs.append(ReplayJob(r["job_id"][:13], sub, gpus, None, model, batch, steps, dur, dur))
        if limit and len(jobs) >= limit:
            break
    jobs.sort(key=lambda j: j.submit_s)
    return jobs


SACCT_FIELDS = ("JobID", "Submit", "Start", "End", "AllocTRES", "NNodes", "State")


def _time(value: str, where: str) -> float:
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise InputError(f"{where}: not a time: {value!r}") from None


def _limit(value: str) -> float | None:
    """Slurm's time limit `[D-]HH:MM:SS` / `MM:SS` in seconds; None for UNLIMITED / Partition_Limit / empty."""
    if not value or not value[0].isdigit():
        return None
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days or 0) * 86400) + parts[0] * 3600 + parts[1] * 60 + parts[2]


def load_sacct(path: str | Path, truth: PolluxTruth) -> list[ReplayJob]:
    """Jobs of a `sacct -P` export (header line, `|` separated; see the module docstring). Steps (`123.batch`),
    jobs that never started and jobs without GPUs are left out.

    Raises:
        InputError: a missing column, or a bad time or number (named as `file:line: field`).
    """
    path = Path(path)
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="|")
        missing = [c for c in SACCT_FIELDS if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"{path}:1: missing column(s) {', '.join(missing)} (export with sacct -P "
                             "--format=JobID,JobName,Submit,Start,End,Timelimit,AllocTRES,NNodes,State,Comment)")
        jobs, t0 = [], None
        for line, r in enumerate(reader, start=2):
            if "." in r["JobID"] or r["Start"] in ("", "Unknown", "None") or r["End"] in ("", "Unknown"):
                continue
            where = f"{path}:{line}"
            tres = dict(kv.split("=", 1) for kv in r["AllocTRES"].split(",") if "=" in kv)
            try:
                gpus = int(tres.get("gres/gpu", "0"))
                nodes = int(r["NNodes"])
            except ValueError:
                raise InputError(f"{where}: AllocTRES/NNodes: not a number: {r['AllocTRES']!r} / "
                                 f"{r['NNodes']!r}") from None
            if gpus < 1:
                continue
            sub, start, end = _time(r["Submit"], f"{where}: Submit"), _time(r["Start"], f"{where}: Start"), \
                _time(r["End"], f"{where}: End")
            t0 = sub if t0 is None else min(t0, sub)
            dur = max(end - start, 1.0)
            # `#ELASTIC` lines joined by `;` or newlines; the hook's own ` elastic:decision=d-N` mark is not a line
            comment = re.sub(r"\s*elastic:decision=\S+", "", r.get("Comment") or "")
            comment = comment.replace("\\n", "\n").replace(";", "\n")
            lines = tuple(ln.strip() for ln in comment.splitlines() if ln.strip().startswith(PREFIX))
            model = next((ln.split("model=", 1)[1].split()[0] for ln in lines if "model=" in ln), None)
            per_gpu = next((int(ln.split("per_gpu_batch=", 1)[1].split()[0]) for ln in lines if "per_gpu_batch=" in ln),
                           None)
            job = ReplayJob(r["JobID"], sub, gpus, nodes, None, None, None, dur, _limit(r.get("Timelimit", "")) or dur,
                            lines, start)
            if model in truth.apps and per_gpu:
                batch = per_gpu * gpus
                layout = tuple([gpus // nodes] * nodes) if gpus % nodes == 0 else packed_layout(gpus)
                job.model, job.global_batch = model, batch
                job.steps = dur / truth.step(model, layout, batch)[0]
            jobs.append(job)
    for j in jobs:
        j.submit_s -= t0 or 0.0
        j.start_s -= t0 or 0.0
    jobs.sort(key=lambda j: j.submit_s)
    return jobs
