"""GPU types and relative speeds of a job's nodes: mixed GPU types inside one job (issue #16, docs/mixed-types.md).

Labels: each node's GRES type as Slurm reports it (`sinfo --json`'s `gres`, `gpu:h100:4` -> `h100`, through
slurm_plugin.client's `nodes()`), named as the predictor names GPU types by upper-casing it (`H100`). A node
whose GPUs are untyped has no label.

A job that names one type (`#ELASTIC gpu_type=H100`, anything but `any`) is taken at its word: every node carries
that type and speed 1.0, and `source` says so, naming Slurm's GRES types where they differ. The hook sends such a
job to that type's nodes; where a lab's GRES labels are fiction (the testbed's CPU workers on `gpu:h100` and
`gpu:a100` nodes, the demo's `gpu_type=cpu`), the declared type is what ran.

Speeds: when the job's nodes have more than one type, the predictor's compute seconds of the job's model on each
type at its per-GPU batch (POST /v1/predict, the one-GPU layout) give each type's relative speed, by the rule the
planner's balanced prediction uses (slurm_plugin.contracts.batch.type_speeds: the fastest type 1.0). With one type, an
unlabelled node, or no answer from the predictor, every node gets 1.0 (equal batches) and `source` says why.

Workers learn their node's values from `worker_env` (`ELASTIC_GPU_TYPE`, `ELASTIC_SPEED`); a training entry point
passes `worker_speed(os.environ)` to `ElasticTrainer(speed=...)`, which splits the global batch by speed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence

from elastic_launcher.launch_config import UNKNOWN_GPU
from slurm_plugin.contracts.batch import type_speeds

SPEED_ENV, GPU_TYPE_ENV = "ELASTIC_SPEED", "ELASTIC_GPU_TYPE"


@dataclasses.dataclass(frozen=True)
class NodeType:
    """One node's GPU type and relative speed.

    Attributes:
        gres_type: the GRES type Slurm reports (`h100`), None for untyped GPUs.
        gpu: the predictor's name of that type (`H100`), None when unlabelled.
        speed: relative samples/s of each of its GPUs (the fastest type of the job 1.0).
    """

    gres_type: Optional[str]
    gpu: Optional[str]
    speed: float = 1.0


@dataclasses.dataclass(frozen=True)
class JobTypes:
    """The GPU type and speed of every node of a job, and where the speeds came from."""

    nodes: Mapping[str, NodeType]
    source: str

    @property
    def mixed(self) -> bool:
        return len({t.gpu for t in self.nodes.values()}) > 1

    def env(self, node: str) -> dict[str, str]:
        """The variables the workers on `node` get (none for a node not known here: speed 1.0)."""
        t = self.nodes.get(node)
        if t is None:
            return {}
        return {SPEED_ENV: repr(float(t.speed)), **({GPU_TYPE_ENV: t.gpu} if t.gpu else {})}

    def to_record(self) -> dict:
        return {"nodes": {n: dataclasses.asdict(t) for n, t in self.nodes.items()}, "mixed": self.mixed,
                "labels": "Slurm GRES type (sinfo --json), upper-cased", "speeds": self.source}


def gpu_name(gres_type: Optional[str]) -> Optional[str]:
    """The predictor's name of a GRES type (`h100` -> `H100`)."""
    return gres_type.upper() if gres_type else None


def decide_speeds(gres_types: Mapping[str, Optional[str]],
                  compute_s: Callable[[str], tuple[Optional[float], str]],
                  declared: Optional[str] = None) -> JobTypes:
    """Each node's type and speed (module docstring). Pure apart from `compute_s`, asked once per type and only
    for a job of several types.

    Args:
        gres_types: node -> its GRES type (None: untyped).
        compute_s: GPU type -> (compute seconds per step at the job's per-GPU batch, or None; why not).
        declared: the job's `#ELASTIC gpu_type` (None, `any` or launch_config's `unknown`: the job named none).
    """
    if declared and declared.lower() not in ("any", UNKNOWN_GPU):
        gres = sorted({gpu_name(t) for t in gres_types.values() if t})
        differ = f" (Slurm's GRES types: {', '.join(gres)})" if gres and gres != [declared] else ""
        return JobTypes({n: NodeType(t, declared) for n, t in gres_types.items()},
                        f"the job's #ELASTIC gpu_type={declared}: one type, equal batches{differ}")
    names = {node: gpu_name(t) for node, t in gres_types.items()}
    types = sorted({g for g in names.values() if g})

    def equal(source: str) -> JobTypes:
        return JobTypes({n: NodeType(gres_types[n], names[n]) for n in gres_types}, source)

    if not types:
        return equal("no GPU type from Slurm: equal batches")
    if any(g is None for g in names.values()):
        return equal("some nodes have untyped GPUs: equal batches")
    if len(types) < 2:
        return equal("one GPU type: equal batches")
    answers = {g: compute_s(g) for g in types}
    missing = [f"{g}: {why}" for g, (seconds, why) in answers.items() if seconds is None]
    if missing:
        return equal("equal batches, the predictor gave no compute time (" + "; ".join(missing) + ")")
    speed = type_speeds({g: seconds for g, (seconds, _) in answers.items()})
    return JobTypes({n: NodeType(gres_types[n], names[n], speed[names[n]]) for n in gres_types},
                    "predictor: " + ", ".join(f"{g} {answers[g][0] * 1000:.1f} ms/step" for g in types))


def worker_speed(environ: Mapping[str, str]) -> float:
    """This worker's relative speed as elastic-launch passed it (`ELASTIC_SPEED`), 1.0 when it passed none.

    For the training process's entry point, which alone reads its environment.

    Raises:
        ValueError: ELASTIC_SPEED is not a positive number.
    """
    text = environ.get(SPEED_ENV)
    if text is None:
        return 1.0
    try:
        speed = float(text)
    except ValueError:
        raise ValueError(f"{SPEED_ENV}={text!r} is not a number") from None
    if not speed > 0 or speed == float("inf"):
        raise ValueError(f"{SPEED_ENV}={text!r} must be a positive finite number")
    return speed


def node_gres_types(nodes: Sequence, names: Sequence[str]) -> dict[str, Optional[str]]:
    """node -> GRES type of the job's `names`, from slurm_plugin.client `Node`s (None for a node Slurm did not
    list)."""
    by_name = {n.name: n.gpu_type for n in nodes}
    return {name: by_name.get(name) for name in names}
