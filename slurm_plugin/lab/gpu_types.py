"""The lab's GPU types as the predictor sees them: the cluster model's partitions and a seeded step history.

The testbed's typed partitions (`testbed_conf.GPU_TYPES`: `h100` = node[1-2] with `gpu:h100`, `a100` =
node[3-4] with `gpu:a100`) become cluster-model partitions naming their GPU type (`H100`, `A100`), links and
`gpu_hour_cost`, so `/v1/plan` can compare them (`--partition=h100,a100`, `#ELASTIC gpu_type=any`).

The testbed has no GPUs, so its history on these types is synthetic and says so: step records of a model
measured on both types (`seed_records`), the same step-time curve (`STEPS`, seconds per step at per-GPU batch
64, as the hook's integration tests use for H200) scaled by each type's `STEP_FACTOR`. With them the planner
predicts the model on both types from measurements, not cross-type.
"""
from __future__ import annotations

from slurm_plugin.lab.testbed_conf import LEAVES, TestbedConfig

INTRA_LINK, INTER_LINK = "nvlink", "ib"
# (layout, seconds per step): compute plus the all-reduce of each layout, at per-GPU batch `PER_GPU_BATCH`
STEPS = (([1], 0.030), ([2], 0.031), ([3], 0.0315), ([4], 0.032), ([1, 1], 0.034), ([2, 2], 0.035), ([4, 4], 0.037))
PER_GPU_BATCH = 64
# step time of each type relative to STEPS (H100 1.8x the A100's throughput on this model)
STEP_FACTOR = {"H100": 1.0, "A100": 1.8}


def partitions(cfg: TestbedConfig) -> list[dict]:
    """The cluster-model partitions (predictor/cluster.py file format) of the lab's typed partitions."""
    out = []
    for t in cfg.gpu_types:
        nodes = [f"node{i}" for i in t.nodes]
        switches = {leaf: [f"node{i}" for i in members if i in t.nodes] for leaf, members in LEAVES}
        out.append({"name": t.partition, "nodes": nodes, "gpus_per_node": cfg.gpus_per_node, "gpu": t.gpu,
                    "intra_link": INTRA_LINK, "inter_link": INTER_LINK,
                    "switches": {leaf: members for leaf, members in switches.items() if members},
                    "gpu_hour_cost": t.gpu_hour_cost, "node_hour_cost": 0.0, "feature": t.gres_type})
    return out


def seed_records(cfg: TestbedConfig, profile: str, repeats: int = 2) -> list[dict]:
    """Synthetic step records (the /v1/observations format) of `profile` on every GPU type of the lab that has
    a `STEP_FACTOR`, for the layouts its partition can hold; each repeat 1% slower than the one before.

    :raises ValueError: a GPU type of the lab has no `STEP_FACTOR` (nothing would be seeded for it).
    """
    records = []
    for t in cfg.gpu_types:
        if t.gpu not in STEP_FACTOR:
            raise ValueError(f"GPU type {t.gpu!r} of partition {t.partition} has no step factor in "
                             f"slurm_plugin/lab/gpu_types.py STEP_FACTOR (known: {', '.join(STEP_FACTOR)})")
        for layout, iter_s in STEPS:
            if len(layout) > len(t.nodes) or layout[0] > cfg.gpus_per_node:
                continue
            for rep in range(repeats):
                records.append({"kind": "step", "profile": profile, "gpu": t.gpu, "layout": layout,
                                "intra_link": INTRA_LINK, "inter_link": INTER_LINK, "per_gpu_batch": PER_GPU_BATCH,
                                "iter_s": iter_s * STEP_FACTOR[t.gpu] * (1 + 0.01 * rep)})
    return records
