"""Mixed GPU types inside one job: the balanced prediction of a layout whose nodes have different GPU types.

A node of type t holds k GPUs; the job's per-GPU batch is b and its global batch B = G * b over G ranks. The
predictor gives each type's compute seconds per step at batch b, T_c,t(b); near b compute is taken as
proportional to the local batch (p_t = T_c,t(b) / b seconds per sample), so a rank of type t is as fast as

    v_t = 1 / p_t                     samples/s; relative speed s_t = v_t / max_u v_u (the fastest type 1.0)

The runtime splits B over the ranks in proportion to their speeds with `split_batch` (slurm_plugin.contracts.batch,
below both: the runtime's elastic_launcher.batch_policy trains with the same rule, rounding included), so with b_i
samples on rank i of type t(i) the balanced step and throughput are

    T_bal = max_i b_i * p_t(i) + T_s          X_bal = B / T_bal
    T_eq  = b * max_t p_t + T_s               X_eq  = B / T_eq      (equal batches: the slowest type sets the pace)

where T_s is the sync cost of the layout: the exposed sync (step - compute) the predictor gives for this layout
on each type's links, the largest of them (the slowest link; no overlap of compute and sync is assumed beyond what
that exposed time already holds). Mixing pays only where X_bal beats the best single-type plan under the job's
objective (predictor/planner.py `mixed_candidates`); Hare (Jia et al.) found mixing is often not helpful.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from slurm_plugin.contracts.batch import split_batch, type_speeds


@dataclasses.dataclass(frozen=True)
class MixedPrediction:
    """The balanced prediction of one mixed layout.

    Attributes:
        layout: GPUs per node.
        types: GPU type per node (lines up with `layout`).
        speeds: relative speed per rank (fastest type 1.0), in rank order (node by node).
        batches: per-rank batch of the balanced split (sum = global batch).
        compute_s: the slowest rank's compute seconds at its batch.
        sync_s: the layout's sync seconds over its slowest link.
        iter_s: balanced step seconds (compute_s + sync_s).
        samples_per_s: balanced throughput.
        equal_samples_per_s: throughput with equal per-rank batches (the unbalanced job).
    """

    layout: tuple[int, ...]
    types: tuple[str, ...]
    speeds: tuple[float, ...]
    batches: tuple[int, ...]
    compute_s: float
    sync_s: float
    iter_s: float
    samples_per_s: float
    equal_samples_per_s: float

    def to_dict(self) -> dict:
        return {"layout": list(self.layout), "types": list(self.types), "speeds": [round(s, 4) for s in self.speeds],
                "batches": list(self.batches), "compute_s": self.compute_s, "sync_s": self.sync_s,
                "iter_s": self.iter_s, "samples_per_s": self.samples_per_s,
                "equal_samples_per_s": self.equal_samples_per_s}


def balanced(layout: Sequence[int], types: Sequence[str], compute_s: Mapping[str, float], per_gpu_batch: int,
             sync_s: float) -> MixedPrediction:
    """The balanced prediction of a mixed layout (module docstring).

    Args:
        layout: GPUs per node, e.g. (4, 4).
        types: GPU type of each node, e.g. ("H100", "A100").
        compute_s: compute seconds per step at `per_gpu_batch` of every type in `types`.
        per_gpu_batch: b; the global batch is b times the GPU count.
        sync_s: the layout's sync seconds over its slowest link (0 on one GPU).

    Raises:
        ValueError: `types` and `layout` differ in length, a type without a compute time, or a bad number.
    """
    if len(types) != len(layout) or not layout:
        raise ValueError(f"a mixed layout needs one GPU type per node: layout {list(layout)}, types {list(types)}")
    missing = sorted(set(types) - set(compute_s))
    if missing:
        raise ValueError(f"no compute time for GPU type(s) {', '.join(missing)} (given: {', '.join(compute_s)})")
    if per_gpu_batch < 1 or not np.isfinite(sync_s) or sync_s < 0:
        raise ValueError(f"per_gpu_batch {per_gpu_batch} must be >= 1 and sync_s {sync_s!r} a number >= 0")
    speed = type_speeds({t: compute_s[t] for t in types})
    rank_types = [t for t, k in zip(types, layout) for _ in range(k)]
    speeds = np.array([speed[t] for t in rank_types])
    per_sample = np.array([compute_s[t] / per_gpu_batch for t in rank_types])
    total = per_gpu_batch * len(rank_types)
    batches = split_batch(total, list(speeds))
    compute = float(np.max(np.asarray(batches) * per_sample))
    equal = float(per_gpu_batch * np.max(per_sample))
    return MixedPrediction(layout=tuple(int(k) for k in layout), types=tuple(types), speeds=tuple(map(float, speeds)),
                           batches=tuple(batches), compute_s=compute, sync_s=float(sync_s),
                           iter_s=compute + sync_s, samples_per_s=total / (compute + sync_s),
                           equal_samples_per_s=total / (equal + sync_s))


# ---------------------------------------------------------------- the planner's mixed candidates
def mixed_shapes(a, b, low: int, high: int) -> list[tuple[int, int, int]]:
    """(k, n_a, n_b): k GPUs on each of n_a nodes of partition `a` and n_b nodes of `b` (both >= 1), with
    low <= k * (n_a + n_b) <= high. One GPU count per node, so the job asks Slurm for one `gres:gpu:k`."""
    return [(k, n_a, n_b) for k in range(1, min(a.gpus_per_node, b.gpus_per_node) + 1)
            for n_a in range(1, len(a.nodes) + 1) for n_b in range(1, len(b.nodes) + 1)
            if low <= k * (n_a + n_b) <= high]


def placement(cluster, a, b, named: Sequence[str]):
    """The partition a mixed job of `a`'s and `b`'s nodes is submitted to: one that holds every node of both
    (a job runs in one partition), among `named` when the job named partitions; None when there is none."""
    need = set(a.nodes) | set(b.nodes)
    for part in cluster.partitions:
        if need <= set(part.nodes) and (not named or part.name in named):
            return part
    return None


def predict_pair(models, profile, a, b, shapes: list[tuple[int, int, int]], batch: int) -> list[MixedPrediction]:
    """The balanced prediction of every shape of partitions `a` and `b` (nodes of `a` first): each type's
    compute seconds at `batch` (its one-GPU prediction) and the layout's sync over the slower of both types'
    links (the exposed sync, step - compute, each type predicts for the uniform layout). One `predict` call per
    type, over all layouts."""
    layouts = sorted({(k,) * (n_a + n_b) for k, n_a, n_b in shapes})
    compute, sync = {}, {}
    for part in (a, b):
        preds = models.predict(profile, part.gpu, batch, [part.candidate((1,))] + [part.candidate(l) for l in layouts])
        compute[part.gpu] = float(preds[0]["compute_s"])
        for layout, pred in zip(layouts, preds[1:]):
            exposed = max(float(pred["iter_s"]) - float(pred["compute_s"]), 0.0)
            sync[layout] = max(sync.get(layout, 0.0), exposed)
    return [balanced((k,) * (n_a + n_b), (a.gpu,) * n_a + (b.gpu,) * n_b, compute, batch, sync[(k,) * (n_a + n_b)])
            for k, n_a, n_b in shapes]


def constraint(features: Sequence[tuple[str, int]]) -> str:
    """Slurm's count constraint for nodes of several features: [("h100", 2), ("a100", 1)] -> `[h100*2&a100*1]`."""
    return "[" + "&".join(f"{feature}*{count}" for feature, count in features) + "]"


def _hourly(shape: tuple[int, int, int], a, b) -> float:
    k, n_a, n_b = shape
    return k * (n_a * a.gpu_hour_cost + n_b * b.gpu_hour_cost) + n_a * a.node_hour_cost + n_b * b.node_hour_cost


def _added_efficiency(m: MixedPrediction, single_gpu: str, single_sps: float, single_gpus: int) -> float:
    """Or et al.'s scaling efficiency of going from the single-type plan to the mixed one, each added GPU counted
    by its speed relative to the single plan's type: (X_mix - X_s) / (added GPU-equivalents * X_s / G_s)."""
    speed = dict(zip((t for t, k in zip(m.types, m.layout) for _ in range(k)), m.speeds))
    unit = speed.get(single_gpu, max(m.speeds))
    added = sum(m.speeds) / unit - single_gpus
    if added <= 0 or single_sps <= 0:
        return 0.0
    return round((m.samples_per_s - single_sps) / (added * single_sps / single_gpus), 4)


def consider_mixed(single: dict, pairs: list[tuple], cluster, named: Sequence[str], d: dict, bounds: tuple[int, int],
                   models, profile, default_min_efficiency: float) -> dict:
    """The plan with mixed types considered: `single` (compare_partitions' answer) unless a mixed layout beats it
    under the objective, in which case the mixed plan; either way `alternatives` lists the best mixed candidate
    with why it was or was not chosen.

    Args:
        single: the best single-type plan (with `predicted`, `partition`, `nodes`, `gpus_per_node`, `objective`).
        pairs: (a, b) partitions of two GPU types, each with step history and a node `feature`.
        named: the partitions the job named (a mixed job is placed in one of them), () for `gpu_type=any`.
        bounds: (low, high) GPU counts the job allows (gpus, max_global_batch applied).
    Scores (the single plan's own objective):
        throughput  more samples/s than the single plan (by 0.5%), and the GPUs mixing adds reach the job's
                    min_efficiency counted by speed (`_added_efficiency`)
        efficiency  more samples/s per GPU (by 1%)
        cost        less cost per sample (by 1%; all free: efficiency)
    """
    batch = single.get("per_gpu_batch")
    if not single.get("predicted") or not batch:
        return single
    base = cluster.partition(single["partition"])
    x_s, g_s = single["predicted"]["samples_per_s"], single["nodes"] * single["gpus_per_node"]
    cost_s = (g_s * base.gpu_hour_cost + single["nodes"] * base.node_hour_cost) / x_s
    objective, min_eff = single["objective"], d.get("min_efficiency", default_min_efficiency)
    scored = []
    for a, b in pairs:
        where = placement(cluster, a, b, named)
        shapes = mixed_shapes(a, b, *bounds)
        if where is None or not shapes:
            continue
        for shape, m in zip(shapes, predict_pair(models, profile, a, b, shapes, batch)):
            cost = _hourly(shape, a, b) / m.samples_per_s
            eff = _added_efficiency(m, base.gpu, x_s, g_s)
            scored.append((a, b, where, shape, m, cost, eff))
    if not scored:
        return single
    free = cost_s == 0 and all(c == 0 for *_, c, _e in scored)

    def score(item) -> float:
        m, cost = item[4], item[5]
        if objective == "cost" and not free:
            return -cost
        if objective in ("efficiency", "cost"):
            return m.samples_per_s / sum(m.layout)
        return m.samples_per_s

    single_score = -cost_s if objective == "cost" and not free else \
        x_s / g_s if objective in ("efficiency", "cost") else x_s
    gated = [s for s in scored if objective != "throughput" or s[6] >= min_eff]
    best = max(gated or scored, key=score)
    a, b, where, (k, n_a, n_b), m, cost, eff = best
    margin = 0.005 if objective == "throughput" else 0.01
    wins = bool(gated) and score(best) > single_score + abs(single_score) * margin
    per_type = {t: m.batches[sum(m.layout[:i])] for i, t in enumerate(m.types)}
    name = f"{n_a}x{k} {a.gpu} + {n_b}x{k} {b.gpu}"
    said = (f"mixed {name} on partition {where.name} predicted {m.samples_per_s:.0f} samples/s with per-GPU batches "
            + ", ".join(f"{t} {n}" for t, n in per_type.items())
            + f" ({m.samples_per_s / x_s:.2f}x of {single['partition']}; equal batches {m.equal_samples_per_s / x_s:.2f}x)")
    if wins:
        verdict = "chosen"
    elif objective == "throughput" and not gated and m.samples_per_s > x_s:
        verdict = f"not chosen: the added GPUs' efficiency {eff:.2f} < {min_eff:g}"
    else:
        verdict = f"not chosen: no better than {single['partition']} under objective {objective}"
    alternative = {"partition": where.name, "gpu": f"{a.gpu}+{b.gpu}", "layout": list(m.layout),
                   "samples_per_s": m.samples_per_s, "cost_per_sample": cost, "mixed": m.to_dict(),
                   "reason": f"{said}; {verdict}"}
    alternatives = list(single.get("alternatives") or []) + [alternative]
    if not wins:
        return {**single, "alternatives": alternatives}
    speeds = dict(zip(m.types, (m.speeds[sum(m.layout[:i])] for i in range(len(m.types)))))
    single = {k: v for k, v in single.items() if k != "time_limit_min"}   # the single plan's limit (issue #40)
    return {**single, "action": "rewrite", "reason": f"elastic: {said}", "partition": where.name,
            "gpu": f"{a.gpu}+{b.gpu}", "nodes": n_a + n_b, "gpus_per_node": k, "tasks_per_node": k,
            "switches": None, "layout": list(m.layout), "constraint": constraint([(a.feature, n_a), (b.feature, n_b)]),
            "predicted": {"samples_per_s": m.samples_per_s, "iter_s": m.iter_s, "compute_s": m.compute_s,
                          "comm_s": m.sync_s, "uncertainty": None, "basis": "mixed types, balanced batches"},
            "mixed": {**m.to_dict(), "speeds_by_type": speeds, "efficiency": eff},
            "global_batch": batch * sum(m.layout), "alternatives": alternatives}
