"""The /v1/plan policy (docs/plan-contract.md): directives + job context in, keep/rewrite decision out.

Steps: parse the `#ELASTIC` lines with `slurm_plugin.contracts.directives`; find the partition and GPU type; list
the GPU counts within the user's `gpus` bounds, the partition size and `max_global_batch`
(global batch = per_gpu_batch * gpus), and the uniform layouts each count can take on the partition's
nodes (8 GPUs on 4-GPU nodes: 2x4, 4x2, 8x1 when nodes allow); ask the Predictor; walk the curve of the
best layout per count computing the throughput scaling efficiency of each step (Or et al.,
`s = (T_{k+d} - T_k) / (d * T_k / k)`), and stop growing at the first step below `min_efficiency`.
Among the layouts left, the objective picks:
    throughput  most samples/s (ties within 0.5%: fewer GPUs, then fewer nodes)
    efficiency  most samples/s per GPU (ties within 1%: more samples/s)
    cost        least (gpus * gpu_hour_cost + nodes * node_hour_cost) per sample (ties: more samples/s)
Several partitions (`--partition=a,b`, or `gpu_type=any`): each is planned so and `compare_partitions` picks
one under the same objective (cost from each partition's costs). A multi-node choice that fits under one leaf
switch asks for `switches=1`. Anything the service cannot
judge (no model directive, unknown profile or GPU type, no fitted model, no history for that model and
GPU) answers `keep` with the reason.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Sequence

from predictor.cluster import Cluster, Partition
from predictor.config import MAX_CANDIDATES
from predictor.errors import NotFoundError, TooLarge, ValidationError
from predictor.mixed import consider_mixed
from predictor.restart_price import priced
from slurm_plugin.contracts.records import counted, layout_name, validate_layout
from predictor.service import ModelUnavailable
from predictor.store import register_hint
from slurm_plugin.contracts.tres import TresError, gpu_types, job_desc_number, requested_shape
from slurm_plugin.contracts.directives import PREFIX, line_of, parse_lines
from slurm_plugin.errors import DirectiveError

SOURCES = ("job_submit", "cli_filter", "launcher", "cli")
MAX_REUSED_IDS = 4096
MAX_DIRECTIVE_LINES = 64         # `#ELASTIC` lines in one request
MAX_DIRECTIVE_LINE = 4096        # characters in one line
MAX_DIRECTIVES_CHARS = 16384     # characters of all lines together (a real job has a few short lines)
DECISION_ID_RE = re.compile(r"^d-[0-9]{1,18}$")   # what `reused` may name: ids the service answered
_JOB_FIELDS: dict[str, tuple[type, int]] = {      # field -> (type, upper bound for ints / length for str)
    "user": (str, 256), "uid": (int, 2**32), "partition": (str, 1024), "job_id": (int, 2**32),
    "name": (str, 1024), "min_nodes": (int, 2**32), "max_nodes": (int, 2**32),
    "ntasks_per_node": (int, 2**32), "tres_per_node": (str, 1024), "tres_per_job": (str, 1024),
    "time_limit_min": (int, 2**32), "req_switch": (int, 2**32), "account": (str, 256), "qos": (str, 256),
}


class DirectiveProblem(ValueError):
    """A malformed directive: answered 422 with `field` (directives[i]) and the verbatim `line`."""

    def __init__(self, field: str, line: str, message: str):
        self.field, self.line, self.message = field, line, message
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """A validated /v1/plan body. The raw body is not kept: `record()` is what a decision stores of it."""

    source: str
    directives: dict | None            # parsed directives; None when no line was given
    job: dict
    current: dict | None
    lines: tuple[str, ...] = ()        # the `#ELASTIC` lines as parsed (validated, bounded)
    reused: dict = dataclasses.field(default_factory=dict)   # decision id -> submissions that reused it
    # the job whose own step measurements may answer for the layouts it ran: set by the API only when the caller
    # proved it is that job (its munge credential) or holds the admin token (#24.12); None: the fit alone answers
    own_job: int | None = None
    # the user whose own step measurements answer for the layouts that user's jobs ran (#41.1): set by the API only
    # for a uid the request proves (its munge credential's, a token holder's, the hook's from a --hook-from host)
    own_user: int | None = None
    test_only: bool = False            # `sbatch --test-only` (#42.6): answered like any request, stored nowhere

    def record(self) -> dict:
        """The request as a decision stores it: source, the directive lines, the validated job fields, current
        and reused, each bounded by the parser's limits; never the body's own text (whitespace, duplicate keys
        and unknown encodings do not reach the database)."""
        out: dict[str, Any] = {"source": self.source, "directives": list(self.lines)}
        if self.job:
            out["job"] = dict(self.job)
        if self.current is not None:
            out["current"] = dict(self.current)
        if self.reused:
            out["reused"] = dict(self.reused)
        return out


def _job(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValidationError("job", "expected an object")
    job: dict[str, Any] = {}
    for key, item in value.items():
        if key not in _JOB_FIELDS:
            raise ValidationError(f"job.{key}", f"unknown field (known: {', '.join(sorted(_JOB_FIELDS))})")
        if item is None:
            job[key] = None
            continue
        kind, bound = _JOB_FIELDS[key]
        if kind is int:
            if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < bound:
                raise ValidationError(f"job.{key}", f"expected an integer in 0..{bound - 1} or null, got {item!r}")
            job[key] = job_desc_number(key, item)
        else:
            if not isinstance(item, str) or len(item) > bound:
                raise ValidationError(f"job.{key}", f"expected a string of at most {bound} characters or null")
            if key.startswith("tres_per_"):
                try:
                    gpu_types(item)  # Slurm's GRES grammar (slurm_plugin.contracts.tres): garbage is a 400
                except TresError as e:
                    raise ValidationError(f"job.{key}", str(e)) from None
            job[key] = item
    if job.get("min_nodes") and job.get("max_nodes") and job["max_nodes"] < job["min_nodes"]:
        raise ValidationError("job.max_nodes", f"{job['max_nodes']} is below min_nodes {job['min_nodes']}")
    return job


_CURRENT_FIELDS = ("layout", "per_gpu_batch", "remaining_s", "restart_cost_s", "samples_per_s")


def _current(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValidationError("current", "expected an object")
    for key in value:
        if key not in _CURRENT_FIELDS:
            raise ValidationError(f"current.{key}", f"unknown field (known: {', '.join(_CURRENT_FIELDS)})")
    current = {"layout": validate_layout(value.get("layout"), "current.layout")}
    sps = value.get("samples_per_s")
    if sps is not None:
        if isinstance(sps, bool) or not isinstance(sps, (int, float)) or not math.isfinite(sps) or not 0 <= sps <= 1e9:
            raise ValidationError("current.samples_per_s", f"expected a finite number in [0, 1e9], got {sps!r}")
        current["samples_per_s"] = float(sps)
    batch = value.get("per_gpu_batch")
    if batch is not None:
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 65536:
            raise ValidationError("current.per_gpu_batch", f"expected an integer in 1..65536, got {batch!r}")
        current["per_gpu_batch"] = batch
    for key in ("restart_cost_s", "remaining_s"):   # a restart job's (#43: predictor/restart_price.py)
        seconds = value.get(key)
        if seconds is None:
            continue
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 1e8:
            raise ValidationError(f"current.{key}", f"expected a number of seconds in [0, 1e8], got {seconds!r}")
        current[key] = float(seconds)
    return current


def parse_request(body: Any) -> PlanRequest:
    """Validate a /v1/plan body and parse its directives.

    Raises:
        ValidationError: a malformed request field (400), e.g. `job.min_nodes`, or `reused` naming something
            other than decision ids.
        TooLarge: more directive text than MAX_DIRECTIVES_CHARS (413, field `directives`).
        DirectiveProblem: a malformed `#ELASTIC` line (422).
    """
    if not isinstance(body, dict):
        raise ValidationError("body", "expected a JSON object")
    for key in body:
        if key not in ("source", "directives", "job", "current", "reused", "test_only"):
            raise ValidationError(key, "unknown field (known: current, directives, job, reused, source, test_only)")
    test_only = body.get("test_only", False)
    if not isinstance(test_only, bool):
        raise ValidationError("test_only", f"expected true or false, got {test_only!r}")
    if test_only and body.get("reused"):  # the hook keeps its counts for a request that stores them
        raise ValidationError("reused", "not with test_only: a test-only request stores nothing")
    source = body.get("source", "cli")
    if source not in SOURCES:
        raise ValidationError("source", f"expected one of {'|'.join(SOURCES)}, got {source!r}")
    lines = body.get("directives")
    if not isinstance(lines, list) or len(lines) > MAX_DIRECTIVE_LINES:
        raise ValidationError("directives", f"expected a list of at most {MAX_DIRECTIVE_LINES} `#ELASTIC` lines")
    numbered, chars = [], 0
    for index, line in enumerate(lines):
        if not isinstance(line, str) or len(line) > MAX_DIRECTIVE_LINE:
            raise ValidationError(f"directives[{index}]", f"expected a string of at most {MAX_DIRECTIVE_LINE} "
                                                          "characters")
        chars += len(line)
        if chars > MAX_DIRECTIVES_CHARS:
            raise TooLarge("directives", f"more than {MAX_DIRECTIVES_CHARS} characters of `#ELASTIC` lines in all")
        line = line.rstrip("\r\n")
        if not (line == PREFIX or line.startswith(PREFIX + " ") or line.startswith(PREFIX + "\t")):
            raise DirectiveProblem(f"directives[{index}]", line,
                                   f"line {index + 1}: not an #ELASTIC directive line: {line!r}")
        numbered.append((index + 1, line))
    try:
        directives = parse_lines(numbered) if numbered else None
    except DirectiveError as exc:
        raise DirectiveProblem(f"directives[{exc.line_no - 1}]", exc.line, str(exc)) from None
    return PlanRequest(source=source, directives=directives, job=_job(body.get("job")),
                       current=_current(body.get("current")), lines=tuple(line for _, line in numbered),
                       reused=_reused(body.get("reused")), test_only=test_only)


def _reused(value: Any) -> dict:
    """`{"d-42": 3}`: how many submissions reused each cached decision since the hook's last request.

    Keys must be decision ids (`d-<digits>`, as the service answers them), at most MAX_REUSED_IDS of them, so
    what a decision stores of them is bounded (about 35 bytes an id).
    """
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_REUSED_IDS:
        raise ValidationError("reused", f"expected an object of at most {MAX_REUSED_IDS} decision ids")
    for key, count in value.items():
        if not DECISION_ID_RE.match(key):
            raise ValidationError("reused", f"expected decision ids such as 'd-42' as keys, got {key[:64]!r}"
                                            + ("..." if len(key) > 64 else ""))
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 2**31:
            raise ValidationError(f"reused.{key}", f"expected a count in 1..2**31, got {count!r}")
    return dict(value)


def requested(job: dict) -> dict:
    """What a job asked, as `last_step` reads it: `nodes`, `per_node`, `total` (None when not derivable),
    `switch` (its req_switch) and `time_limit` (minutes; None: none asked)."""
    nodes, per_node, total = requested_shape(job)
    return {"nodes": nodes, "per_node": per_node, "total": total, "switch": job.get("req_switch"),
            "time_limit": job.get("time_limit_min")}


def _requested_now(request: PlanRequest) -> dict:
    if request.current is None:
        return requested(request.job)
    layout = request.current["layout"]       # the launcher: compare with where the job runs now
    return {"nodes": len(layout), "per_node": layout[0], "total": sum(layout), "switch": "placed"}


def _keep(reason: str, **extra) -> dict:
    return {"action": "keep", "reason": reason, "nodes": None, "gpus_per_node": None, "tasks_per_node": None,
            "switches": None, "layout": None, "predicted": None, "curve": [], **extra}


def _pick_partitions(cluster: Cluster, job: dict, gpu_type: str | None) -> list[Partition] | str:
    """The partitions to compare: those the job names (`--partition=a,b`) that exist and have `gpu_type`; with no
    names, every partition with `gpu_type`, every partition for `gpu_type=any`, else the default one. A string
    says why there is none."""
    any_type = gpu_type is not None and gpu_type.lower() == "any"
    wanted = None if any_type else gpu_type
    names = [n for n in (job.get("partition") or "").split(",") if n]
    if names:
        parts = []
        for name in names:
            try:
                part = cluster.partition(name)
            except NotFoundError:
                continue
            if (wanted is None or part.gpu.lower() == wanted.lower()) and part not in parts:
                parts.append(part)
        return parts or f"partition {job['partition']!r} has no {wanted or 'GPU'} nodes in the predictor's cluster " \
                        f"model"
    if any_type:
        return list(cluster.partitions)
    if gpu_type is None:
        return [cluster.partition()]
    matching = cluster.partitions_with_gpu(gpu_type)
    return matching or f"unknown GPU type {gpu_type!r} (the cluster model has " \
        f"{', '.join(sorted({p.gpu for p in cluster.partitions}))})"


def plan(request: PlanRequest, cluster: Cluster, models, default_min_efficiency: float = 0.5,
         max_candidates: int = MAX_CANDIDATES, db_path: str = "DB",
         restart_history: Callable[[], Sequence[dict]] = tuple) -> dict:
    """Decide keep or rewrite (the response body without `decision_id`).

    Args:
        models: a ModelCache-like object: `predictor()`, `profile(name)`, `known(name, gpu)`, `predict(...)`,
            `version`.
        db_path: the service's database, named in the hint for registering an unknown model.
        restart_history: the cluster's `restart` records (oldest first), read only for a restart job's plan: its
            restart is priced with them until it measured its own (predictor/restart_price.py).
    """
    d = request.directives
    if d is None:
        return _keep("no #ELASTIC directives: not an elastic job")
    if request.source == "launcher" and d.get("elastic") == "off":
        return _keep("elastic=off: the job is planned at submit time only")
    model = d.get("model")
    if model is None:
        return _keep("no model= directive: add `#ELASTIC model=<profile>` to let the predictor size the job")
    types = sorted({t for key in ("tres_per_node", "tres_per_job") for t in gpu_types(request.job.get(key))})
    if len(types) > 1:  # one count per node would lose the types (#42): the request stays as written
        return _keep(f"the job asks for several GPU types ({', '.join(types)}): left as written, by type",
                     model=model)
    parts = _pick_partitions(cluster, request.job, d.get("gpu_type"))
    if isinstance(parts, str):
        return _keep(parts, model=model)
    low = (d.get("gpus") or {}).get("min")
    if low and all(low > p.total_gpus for p in parts):
        part = max(parts, key=lambda p: p.total_gpus)
        message = f"gpus min {low} exceeds partition {part.name}'s {counted(part.total_gpus, 'GPU')}"
        if request.source == "launcher":       # already running: nothing to reject
            return _keep(message, model=model)
        # At submit, the job would run below the user's own minimum: reject it, naming the line.
        number, line = line_of(list(enumerate(request.lines, start=1)), "gpus")
        raise DirectiveProblem(f"directives[{number - 1}]", line, f"line {number}: gpus: minimum {low} "
                               f"exceeds the {counted(part.total_gpus, 'GPU')} of partition {part.name}: {line!r}")
    parts = [p for p in parts if not low or low <= p.total_gpus]
    try:
        models.predictor()
    except ModelUnavailable as exc:
        return _keep(f"predictor not ready: {exc}", model=model)
    profile = models.profile(model)
    if profile is None:
        return _keep(f"unknown model {model!r}: {register_hint(model, db_path)}", model=model)
    if len(parts) == 1:
        out = _plan_on(parts[0], request, models, profile, default_min_efficiency, max_candidates, bands=True)
        restart = request.source == "launcher" and d.get("mode") == "restart" and request.current is not None
        return priced(out, request.current, model, restart_history()) if restart else out
    known = [p for p in parts if models.known(model, p.gpu)]
    if not known:
        return _keep(f"no step history for {model} on {', '.join(sorted({p.gpu for p in parts}))}: predictions "
                     f"would be guesses", model=model)
    results = [(p, _plan_on(p, request, models, profile, default_min_efficiency, max_candidates,
                            cross_type=p not in known)) for p in parts]
    out = compare_partitions(results, request, cluster.default_partition)
    return _with_mixed(out, [p for p in parts if p in known], cluster, request, models, profile,
                       default_min_efficiency)


def _with_mixed(out: dict, known: list[Partition], cluster: Cluster, request: PlanRequest, models, profile,
                default_min_efficiency: float) -> dict:
    """`out` with mixed GPU types considered (predictor/mixed.py): at submit time only, for a job that allows
    several types (it named several partitions or `gpu_type=any`, as `plan` compares partitions only then), over
    pairs of partitions of two GPU types with step history and a node feature, within the job's GPU bounds."""
    d = request.directives
    pairs = [(a, b) for i, a in enumerate(known) for b in known[i + 1:]
             if a.feature and b.feature and a.gpu.lower() != b.gpu.lower()]
    if not pairs or request.current is not None or d.get("batch_policy") == "keep_global" or not out.get("predicted"):
        return out
    low, high = _bounds(d, requested(request.job), sum(p.total_gpus for p in known))
    if d.get("max_global_batch") is not None:
        high = min(high, d["max_global_batch"] // out["per_gpu_batch"])
    named = [n for n in (request.job.get("partition") or "").split(",") if n]
    try:
        return consider_mixed(out, pairs, cluster, named, d, (low, high), models, profile, default_min_efficiency)
    except ModelUnavailable:
        return out


def _plan_on(part: Partition, request: PlanRequest, models, profile, default_min_efficiency: float,
             max_candidates: int, cross_type: bool = False, bands: bool = False) -> dict:
    """The plan on one partition. `cross_type`: the model has no history on this partition's GPU type; its
    predictions there count only where the predictor answers them cross-type (from the model's measurements on
    another type), never from the profile alone."""
    d, model = request.directives, request.directives["model"]
    if not cross_type and not models.known(model, part.gpu):
        return _keep(f"no step history for {model} on {part.gpu}: predictions would be guesses", model=model)
    batch = d.get("per_gpu_batch") or (request.current or {}).get("per_gpu_batch")
    if batch is None:
        return _keep("no per_gpu_batch directive: cannot predict throughput", model=model)
    requested = _requested_now(request)
    # a running job (the launcher) asking about itself: its own measurements answer for the layouts it ran
    asking = request.own_job if request.current is not None else None
    if d.get("batch_policy") != "keep_global":
        # The predictions for every layout of the partition at this (model, GPU, per-GPU batch): the request's
        # bounds are applied by `last_step` (tests/vectors/policy.json)
        cands = [part.candidate(layout) for gpus in range(1, part.total_gpus + 1) for layout in part.layouts(gpus)]
        full = len(cands) <= max_candidates
        if not full:                          # a large partition: only the request's bounds (no table sent)
            low, high = _bounds(d, requested, part.total_gpus)
            cands = [c for c in cands if low <= sum(c["layout"]) <= high]
        if len(cands) <= max_candidates:
            try:
                preds = models.predict(profile, part.gpu, batch, cands, job_id=asking, uid=request.own_user)
            except ModelUnavailable as exc:
                return _keep(f"predictor not ready: {exc}", model=model)
            table = {**_table_of(part, default_min_efficiency), "model": model, "per_gpu_batch": batch,
                     "entries": [_entry(c["layout"], p, batch) for c, p in zip(cands, preds)]}
            if cross_type and not _all_cross_type(table["entries"]):
                return _not_cross_type(model, part)
            out = last_step(table, d, requested)
            out.setdefault("model", model)
            # bands only for a plan on one partition (the hook's cache must not answer a comparison from them)
            if bands and request.source == "job_submit" and "min_efficiency" in d and out["predicted"] is not None:
                out["bands"] = min_efficiency_bands(table, d, requested)
            out["model_version"] = models.version
            return out
        else:
            return _keep(f"more than {max_candidates} candidate layouts; narrow gpus=MIN-MAX", model=model)
    low, high = _bounds(d, requested, part.total_gpus)
    if low > part.total_gpus:            # no gpus= directive: the job's own #SBATCH request is larger
        return _keep(f"the request's {counted(low, 'GPU')} exceed partition {part.name}'s {counted(part.total_gpus, 'GPU')}", model=model)
    global_fixed = batch * (requested["total"] or low)
    by_batch: dict[int, list[dict]] = {}
    for gpus in range(low, high + 1):
        if global_fixed % gpus:
            continue
        for layout in part.layouts(gpus):
            by_batch.setdefault(global_fixed // gpus, []).append(part.candidate(layout))
    if not by_batch:
        return _keep(f"no layout of {low}-{high} GPUs fits partition {part.name} "
                     f"({counted(len(part.nodes), 'node')} x {counted(part.gpus_per_node, 'GPU')})", model=model)
    if sum(map(len, by_batch.values())) > max_candidates:
        return _keep(f"more than {max_candidates} candidate layouts; narrow gpus=MIN-MAX", model=model)
    entries = []
    try:
        for per_gpu, cands in by_batch.items():
            for cand, pred in zip(cands, models.predict(profile, part.gpu, per_gpu, cands, job_id=asking,
                                                         uid=request.own_user)):
                entries.append(_entry(cand["layout"], pred, per_gpu))
    except ModelUnavailable as exc:
        return _keep(f"predictor not ready: {exc}", model=model)
    if cross_type and not _all_cross_type(entries):
        return _not_cross_type(model, part)
    limit_note = _limit_note(d, requested, high, part.total_gpus, part.name)
    return {**_choose(entries, d, _table_of(part, default_min_efficiency), requested, limit_note), "model": model,
            "model_version": models.version}


def _all_cross_type(entries: list[dict]) -> bool:
    return all(e.get("basis", "").startswith("cross-type") for e in entries)


def _not_cross_type(model: str, part: Partition) -> dict:
    return _keep(f"no step history for {model} on {part.gpu} and too little on other types to predict it "
                 f"cross-type: predictions would be guesses", model=model)


def _bounds(d: dict, requested: dict, total: int) -> tuple[int, int]:
    """(low, high) GPU counts: the `gpus` directive, else the job's own request, else the whole partition."""
    bounds = d.get("gpus") or ({"min": requested["total"], "max": requested["total"]} if requested["total"]
                               else {"min": 1, "max": total})
    return bounds["min"], min(bounds["max"], total)


def _limit_note(d: dict, requested: dict, high: int, total: int, partition: str) -> str:
    wanted = (d.get("gpus") or {}).get("max") or requested["total"] or total
    return f"gpus max {wanted}" if high == wanted else f"partition {partition} has {counted(total, 'GPU')}"


def _table_of(part: Partition, default_min_efficiency: float) -> dict:
    return {"gpu": part.gpu, "partition": part.name, "total_gpus": part.total_gpus, "nodes": len(part.nodes),
            "gpus_per_node": part.gpus_per_node,
            "one_leaf_nodes": part.largest_leaf if part.switches else 0, "gpu_hour_cost": part.gpu_hour_cost,
            "node_hour_cost": part.node_hour_cost, "min_efficiency": default_min_efficiency}


BOUND = "{min_efficiency}"   # where a band's reason shows the request's own min_efficiency (docs/plan-contract.md)
MAX_BANDS = 64
MAX_BAND_STEPS = 48  # `last_step` runs a sweep may take (0.5-1.5 ms each): past it the request gets no bands


def min_efficiency_bands(table: dict, d: dict, requested: dict) -> list[dict]:
    """This request's decision for every other `min_efficiency` in [0, 1], precomputed for the job_submit hook's
    cache (docs/plan-contract.md, "Decision bands"): `last_step` is constant on intervals `above < v <= upto`
    (its comparisons and the digits its reason prints change only at the efficiencies it compares), so a sweep
    from 0 finds each interval from the comparisons of one decision. Adjacent equal decisions are merged; the
    reason shows the bound as BOUND, which the hook replaces by the request's value. Empty when more than
    MAX_BANDS would be needed, or more than MAX_BAND_STEPS decisions to find them (bands save the hook later
    calls; they must not cost this one its budget)."""
    bands: list[dict] = []
    v, steps = 0.0, 0
    while v <= 1.0:
        steps += 1
        if steps > MAX_BAND_STEPS:
            return []
        span = [-1.0, 1.0]
        out = last_step(table, {**d, "min_efficiency": v}, requested, span=span, shown=BOUND)
        if out["predicted"] is None:
            return []
        band = {"above": span[0], "upto": span[1],
                **{k: out[k] for k in ("action", "nodes", "gpus_per_node", "tasks_per_node", "switches", "reason",
                                       "time_limit_min") if k in out}}
        if bands and {**bands[-1], "above": 0, "upto": 0} == {**band, "above": 0, "upto": 0}:
            bands[-1]["upto"] = span[1]
        elif len(bands) == MAX_BANDS:
            return []
        else:
            bands.append(band)
        v = math.nextafter(span[1], 2.0)
    return bands


def last_step(table: dict, d: dict, requested: dict, span: list | None = None, shown: str | None = None) -> dict:
    """The policy's last step: the request's bounds applied to a prediction table, then `_choose`.

    It reads nothing but its arguments (checked against tests/vectors/policy.json); `min_efficiency_bands`
    runs it for every other `min_efficiency` of a request.

    Args:
        table: the partition (`partition`, `total_gpus`, `one_leaf_nodes`, `gpu_hour_cost`, `node_hour_cost`),
            the service's default `min_efficiency`, `per_gpu_batch`, and `entries`: every uniform layout of the
            partition in order of GPU count then fewest nodes, each `{"layout", "samples_per_s", ...}`.
        d: the parsed directives (`gpus`, `max_global_batch`, `min_efficiency`, `objective` are read).
        requested: what the job asked: `nodes`, `per_node`, `total` (each None when unknown) and `switch`
            (the job's req_switch, or "placed" for a running job).
        span: when given, `[lo, hi]` narrowed to the `min_efficiency` values `lo < v <= hi` that give this
            same decision and reason; shown: the text of the bound in the reason (default: its value).

    Returns the response without `decision_id`; a keep whose `predicted` is None when no size can be judged.
    """
    model, batch, total = table.get("model"), table["per_gpu_batch"], table["total_gpus"]
    low, high = _bounds(d, requested, total)
    if low > total:
        return _keep(f"the request's {counted(low, 'GPU')} exceed partition {table['partition']}'s {counted(total, 'GPU')}", model=model)
    cap = d.get("max_global_batch")
    limit_note = _limit_note(d, requested, high, total, table["partition"])
    if cap is not None and cap // batch < high:
        high = cap // batch
        limit_note = f"max_global_batch {cap} caps at {counted(high, 'GPU')}"
        if high < low:
            return _keep(f"max_global_batch {cap} allows {counted(high, 'GPU')} at per_gpu_batch {batch}, below gpus min {low}",
                         model=model)
    entries = [dict(e) for e in table["entries"] if low <= sum(e["layout"]) <= high]
    if not entries:
        return _keep(f"no layout of {low}-{high} GPUs fits partition {table['partition']} "
                     f"({counted(table['nodes'], 'node')} x {counted(table['gpus_per_node'], 'GPU')})", model=model)
    for e in entries:
        e.setdefault("gpus", sum(e["layout"]))
        e.setdefault("nodes", len(e["layout"]))
        e.setdefault("per_gpu_batch", batch)
        e.setdefault("global_batch", batch * e["gpus"])
    return _choose(entries, d, table, requested, limit_note, span, shown)


def _finite(value: Any) -> float | None:
    if type(value) is float:                    # the common case, without the conversion
        return value if math.isfinite(value) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _entry(layout: list[int], pred: dict, per_gpu: int) -> dict:
    gpus = sum(layout)
    return {"layout": list(layout), "gpus": gpus, "nodes": len(layout), "per_gpu_batch": per_gpu,
            "global_batch": per_gpu * gpus, "samples_per_s": _finite(pred.get("samples_per_s")) or 0.0,
            "iter_s": _finite(pred.get("iter_s")), "compute_s": _finite(pred.get("compute_s")),
            "comm_s": _finite(pred.get("comm_s")), "uncertainty": _finite(pred.get("uncertainty")),
            **_low(pred),
            "basis": str(pred.get("basis", ""))}


def _low(pred: dict) -> dict:
    """`samples_low`: the lower end of the prediction's 80% interval, where it carries one."""
    interval = pred.get("interval")
    low = _finite(interval[0]) if isinstance(interval, (list, tuple)) and len(interval) == 2 else None
    return {} if low is None else {"samples_low": low}


def _sure(chosen: dict, base: dict, min_eff: float, span: list) -> float | None:
    """The efficiency of growing from `base` to `chosen` with `chosen` at its interval's lower end, where it is
    below `min_eff` (None: the grow holds at the lower end too, or no interval was given). `span` is narrowed to
    the min_efficiency values that answer the same (the hook's cached bands)."""
    low = chosen.get("samples_low")
    if low is None or chosen["gpus"] <= base["gpus"]:
        return None
    eff = _efficiency(base["samples_per_s"], low, base["gpus"], chosen["gpus"])
    if eff < min_eff:
        span[0] = max(span[0], eff)
        return eff
    span[1] = min(span[1], eff)
    return None


def shown_bound(bound: float) -> str:
    """A bound as reasons print it: `%g`, all 17 digits where that rounds (elastic_common.lua prints the same)."""
    return f"{bound:g}" if float(f"{bound:g}") == bound else f"{bound:.17g}"


def _below(value: float, bound: float, span: list | None = None, shown: str | None = None) -> str:
    """`value < bound` as a reason prints it, never contradicting itself: the value with 2 decimals or as many
    more as it takes to read below the printed bound (`0.6996 < 0.7`, never `0.70 < 0.7`). `span` is narrowed to
    the bounds that print the same digits."""
    text, span = f"{value:.17g}", span if span is not None else [-math.inf, math.inf]
    for n in range(2, 18):
        t = f"{value:.{n}f}"
        if float(t) < bound:
            text, span[0] = t, max(span[0], float(t))
            break
        span[1] = min(span[1], float(t))
    return f"{text} < {shown or shown_bound(bound)}"


def _choose(entries: list[dict], d: dict, table: dict, requested: dict, limit_note: str,
            span: list | None = None, shown: str | None = None) -> dict:
    min_eff = d.get("min_efficiency", table["min_efficiency"])
    span = span if span is not None else [-math.inf, math.inf]
    by_gpus: dict[int, list[dict]] = {}
    for e in entries:
        by_gpus.setdefault(e["gpus"], []).append(e)
    best = {gpus: max(group, key=_throughput) for gpus, group in by_gpus.items()}   # first of equals
    counts = sorted(best)
    # Walk up the counts from an anchor (the last accepted count); a count is accepted when growing from
    # the anchor to it has efficiency >= min_eff. Rejected counts are skipped, not a stop: 4 -> 6 GPUs may
    # be poor (6 = 3x3 crosses nodes) while 4 -> 8 (2x4) is worth it.
    anchor, feasible, rejected = counts[0], {counts[0]}, []
    for e in by_gpus[anchor]:
        e["efficiency"] = 1.0
    for gpus in counts[1:]:
        t_anchor = best[anchor]["samples_per_s"]
        for e in by_gpus[gpus]:
            e["efficiency"] = _efficiency(t_anchor, e["samples_per_s"], anchor, gpus)
        if best[gpus]["efficiency"] >= min_eff:
            feasible.add(gpus)
            anchor, rejected = gpus, []
            span[1] = min(span[1], best[gpus]["efficiency"])
        else:
            rejected.append(best[gpus])
            span[0] = max(span[0], best[gpus]["efficiency"])
    stop_note = limit_note
    if rejected:
        worst = max(rejected, key=lambda e: e["efficiency"])
        stop_note = f"{layout_name(worst['layout'])} efficiency {_below(worst['efficiency'], min_eff, span, shown)}"
    pool = [e for e in entries if e["gpus"] in feasible and e["samples_per_s"] > 0] or [best[counts[0]]]
    objective = d.get("objective", "throughput")
    gpu_cost, node_cost = table["gpu_hour_cost"], table["node_hour_cost"]
    if len(pool) == 1:       # also: no layout predicted above 0 samples/s (a cost per sample would divide by 0)
        chosen = pool[0]
    elif objective == "efficiency" or (objective == "cost" and gpu_cost + node_cost == 0):
        chosen = _argbest(pool, lambda e: e["samples_per_s"] / e["gpus"], 0.01)
    elif objective == "cost":
        chosen = _argbest(pool, lambda e: -(e["gpus"] * gpu_cost + e["nodes"] * node_cost) / e["samples_per_s"], 0.01)
    else:
        top = max(e["samples_per_s"] for e in pool)
        chosen = min((e for e in pool if e["samples_per_s"] >= top * 0.995), key=lambda e: (e["gpus"], e["nodes"]))
    base = next((e for e in entries if e["nodes"] == requested["nodes"] and e["layout"][0] == requested["per_node"]),
                None)
    placed = requested["switch"] == "placed"
    if base is None:
        # a running job on a layout the table lacks (Slurm placed `--gpus=6` as 4+2) is compared at its GPU count,
        # not at the smallest: from the smallest, the interval's test below read its own size as an uncertain grow
        # and planned it down to the minimum (Pollux 1-8 replay: 166 runtime plans of 4+2 jobs said 3 GPUs)
        base = best.get(requested["total"]) if placed else None
        base = base or best[counts[0]]
    # the interval (#38.5): a running job grows only where the grow passes min_efficiency at the interval's lower
    # end; at submit time the plan stands and its reason says the choice is uncertain
    unsure = _sure(chosen, base, min_eff, span)
    if unsure is not None and placed:
        chosen, stop_note = base, (f"grow to {layout_name(chosen['layout'])} uncertain: efficiency at the 80% "
                                   f"interval's lower end {unsure:.2f} < {shown or shown_bound(min_eff)}")
    nodes, per_node = chosen["nodes"], chosen["layout"][0]
    switches = 1 if 1 < nodes <= table["one_leaf_nodes"] else None
    ratio = chosen["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] > 0 else float("nan")
    reason = (f"elastic: {counted(nodes, 'node')} x {counted(per_node, 'GPU')} ({layout_name(chosen['layout'])}) "
              f"predicted {chosen['samples_per_s']:.0f} samples/s, {ratio:.1f}x of {layout_name(base['layout'])}")
    if objective != "throughput":
        reason += f" (objective {objective})"
    if chosen["gpus"] == max(feasible) or objective == "throughput" or chosen is base and unsure is not None:
        reason += f"; {stop_note}"
    if unsure is not None and chosen is not base:
        reason += f"; uncertain: efficiency at the 80% interval's lower end {unsure:.2f}"
    if switches:
        reason += "; one leaf switch"
    same_switch = requested["switch"] == "placed" or requested["switch"] == switches   # running: placed
    same = (requested["nodes"] or 1) == nodes and requested["per_node"] == per_node and same_switch
    matched = "request already matches the plan; " if same else ""
    # A job that asked a GPU count and no node shape, planned at that count, keeps its request: Slurm places the
    # GPUs wherever they are free, and a pinned layout waits for nodes that fit it (replay of Pollux workloads
    # 1-8: right-sized average JCT +9.7% against as submitted with the layout pinned, +6.6% without;
    # bench/results/replay/README.md)
    free_placement = (requested["nodes"] is None and requested["per_node"] is None and requested["switch"] is None
                      and requested["total"] == chosen["gpus"])
    if free_placement and not same:
        same, reason = True, reason.replace("elastic: ", f"elastic: the request's {counted(chosen['gpus'], 'GPU')} "
                                            "are the plan's count, placed by Slurm; ", 1)
    # A running job planned at the GPU count it runs keeps it: it can change its node count, not its layout (a
    # 4+2 job told 2x3 would be shrunk to the whole nodes of the plan's count: 1x4)
    if placed and requested["total"] == chosen["gpus"] and not same:
        same, reason = True, reason.replace("elastic: ", f"elastic: the job's {counted(chosen['gpus'], 'GPU')} "
                                            "are the plan's count, its layout stays; ", 1)
    action = "keep" if same else "rewrite"
    # a slower layout than the one asked gets the time to do the asked work (issue #40): never a shorter limit
    limit = _longer_limit(requested.get("time_limit"), _asked(entries, best, requested), chosen) \
        if action == "rewrite" else None
    if limit is not None:
        reason += f"; time limit {requested['time_limit']} -> {limit} min"
    curve = [{**{k: e.get(k) for k in ("layout", "gpus", "nodes", "per_gpu_batch", "global_batch", "samples_per_s",
                                       "iter_s", "efficiency", "uncertainty")},
              **({"samples_low": e["samples_low"]} if "samples_low" in e else {})} for e in sorted(entries, key=_order)]
    predicted = {k: chosen.get(k) for k in ("samples_per_s", "iter_s", "compute_s", "comm_s", "uncertainty")}
    if chosen.get("basis", "").startswith("cross-type"):   # what a single partition answers is unchanged otherwise
        predicted["basis"] = chosen["basis"]
    return {"action": action, "reason": matched + reason, "nodes": nodes, "gpus_per_node": per_node,
            "tasks_per_node": per_node, "switches": switches, "layout": chosen["layout"], "predicted": predicted,
            "curve": curve, "gpu": table["gpu"], "partition": table["partition"], "objective": objective,
            "min_efficiency": min_eff, "per_gpu_batch": chosen["per_gpu_batch"],
            "global_batch": chosen["global_batch"], **({} if limit is None else {"time_limit_min": limit})}


def _asked(entries: list[dict], best: dict[int, dict], requested: dict) -> dict | None:
    """The entry of the layout the job asked (what its time limit was set for): its nodes x GPUs per node (one
    node when it named none; per node its GPU count over its nodes), or with a GPU count only, which Slurm places,
    that count's best layout. None when the request names no layout within the entries."""
    nodes, per_node, total = requested["nodes"], requested["per_node"], requested["total"]
    nodes = nodes or (1 if per_node else None)
    if nodes and per_node is None and total and total % nodes == 0:
        per_node = total // nodes
    if nodes and per_node:
        return next((e for e in entries if e["nodes"] == nodes and e["layout"][0] == per_node), None)
    return best.get(total) if total else None


def _longer_limit(minutes: int | None, asked: dict | None, chosen: dict) -> int | None:
    """The time limit (minutes) for `chosen` when it is predicted slower than the `asked` layout:
    ceil(minutes * asked samples/s / chosen samples/s); None when no limit was asked, the asked layout has no
    prediction (not within the bounds, infeasible), or the limit would not grow (a limit is never shortened)."""
    if not minutes or asked is None or not asked["samples_per_s"] > 0 or not chosen["samples_per_s"] > 0:
        return None
    longer = math.ceil(minutes * asked["samples_per_s"] / chosen["samples_per_s"])
    return longer if longer > minutes else None


def _cost_per_sample(part: Partition, plan: dict) -> float:
    """Cost weight per sample of a plan on a partition (its `gpu_hour_cost`, `node_hour_cost`): 0 when free."""
    gpus = plan["nodes"] * plan["gpus_per_node"]
    return (gpus * part.gpu_hour_cost + plan["nodes"] * part.node_hour_cost) / plan["predicted"]["samples_per_s"]


def compare_partitions(results: list[tuple[Partition, dict]], request: PlanRequest,
                       default_partition: str | None = None) -> dict:
    """Pick among the plans of several partitions (each `_plan_on`'s answer) under the objective:
        throughput  most samples/s
        efficiency  most samples/s per GPU
        cost        least cost per sample (partition costs; all free: efficiency)
    The answer is the chosen partition's plan with `partition` set, the reason led by the comparison with the
    runner-up (`elastic: partition a100: 2x4 A100 predicted 1.9x of v100 2x4 at 0.6x its cost per sample`), and
    `alternatives`: every partition's layout, samples/s, cost per sample and reason. A plan on another partition
    than the job's (`default_partition` when it names none) is a rewrite."""
    planned = [(p, r) for p, r in results if r.get("predicted") and r["predicted"].get("samples_per_s")]
    alternatives = [{"partition": p.name, "gpu": p.gpu, "layout": r.get("layout"),
                     "samples_per_s": (r.get("predicted") or {}).get("samples_per_s"),
                     "cost_per_sample": _cost_per_sample(p, r) if (p, r) in planned else None,
                     "reason": r["reason"]} for p, r in results]
    if not planned:
        first = results[0][1]
        return {**first, "reason": "no partition could be planned: "
                + "; ".join(f"{p.name}: {r['reason']}" for p, r in results), "alternatives": alternatives}
    objective = planned[0][1]["objective"]
    free = all(_cost_per_sample(p, r) == 0 for p, r in planned)

    def score(item):
        p, r = item
        sps = r["predicted"]["samples_per_s"]
        if objective == "cost" and not free:
            return -_cost_per_sample(p, r)
        if objective in ("efficiency", "cost"):
            return sps / (r["nodes"] * r["gpus_per_node"])
        return sps

    ranked = sorted(planned, key=score, reverse=True)   # stable: the job's order among equals
    (part, chosen), rest = ranked[0], ranked[1:]
    lead = f"elastic: partition {part.name}: {layout_name(chosen['layout'])} {part.gpu}"
    if rest:
        other, alt = rest[0]
        ratio = chosen["predicted"]["samples_per_s"] / alt["predicted"]["samples_per_s"]
        lead += f" predicted {ratio:.1f}x of {other.name} {layout_name(alt['layout'])}"
        c_alt = _cost_per_sample(other, alt)
        if not free and c_alt > 0:
            lead += f" at {_cost_per_sample(part, chosen) / c_alt:.1f}x its cost per sample"
    basis = chosen["predicted"].get("basis", "")
    if basis.startswith("cross-type"):
        lead += f" ({basis})"
    moved = part.name != (request.job.get("partition") or default_partition or part.name)
    return {**chosen, "action": "rewrite" if moved else chosen["action"],
            "reason": lead + "; " + chosen["reason"].removeprefix("elastic: "), "partition": part.name,
            "alternatives": alternatives}


def _order(e: dict):
    return (e["gpus"], e["nodes"])


def _throughput(e: dict) -> float:
    return e["samples_per_s"]


def _efficiency(t_k: float, t_next: float, k: int, k_next: int) -> float:
    """Or et al.'s throughput scaling efficiency of going from k to k_next GPUs."""
    if t_k <= 0:
        return 0.0
    return round((t_next - t_k) / ((k_next - k) * t_k / k), 4)


def _argbest(pool: list[dict], score, tolerance: float) -> dict:
    top = max(score(e) for e in pool)
    margin = abs(top) * tolerance
    return max((e for e in pool if score(e) >= top - margin), key=lambda e: (e["samples_per_s"], -e["gpus"]))
