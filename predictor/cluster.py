"""The cluster model: partitions, their node shapes, GPU type, link names and leaf switches.

It answers the planner's questions: which layouts (GPUs per node, one entry a node) can a GPU count
take in a partition, which links does each layout cross, and does a node count fit under one leaf
switch. It comes from a JSON file (`Cluster.from_file`), from Slurm's own view (`Cluster.from_slurm`, link
names given by the operator) or, by default, matches the local Slurm testbed (4 nodes x 4 GPUs, leaf switches node[1-2] and node[3-4]).

File format::

    {"default_partition": "debug",
     "partitions": [{"name": "debug", "nodes": "node[1-4]", "gpus_per_node": 4, "gpu": "H200",
                     "intra_link": "nvlink", "inter_link": "ib",
                     "switches": {"leaf1": "node[1-2]", "leaf2": "node[3-4]"},
                     "gpu_hour_cost": 1.0, "node_hour_cost": 0.0}]}
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from predictor.errors import NotFoundError, ValidationError
from slurm_plugin import hostlist

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:+-]{1,64}\Z")
_FEATURE_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")


def expand_hostlist(spec: str, field: str = "nodes") -> tuple[str, ...]:
    """Expand a Slurm-style host list (`node[1-3,5],gpu7`) into names (`slurm_plugin.hostlist`, the one parser).

    Raises:
        ValidationError: the list is malformed or names a node twice, naming `field`.
    """
    try:
        return tuple(hostlist.expand(spec))
    except hostlist.HostlistError as exc:
        raise ValidationError(field, str(exc)) from None


@dataclasses.dataclass(frozen=True)
class Partition:
    """One Slurm partition of identical nodes.

    Attributes:
        name: partition name as Slurm knows it.
        nodes: node names.
        gpus_per_node: GPUs on each node.
        gpu: GPU type string (as used in observations, e.g. `H200`).
        intra_link: link class between GPUs of one node (e.g. `nvlink`).
        inter_link: link class between nodes (e.g. `ib`).
        switches: leaf switch name -> node names under it.
        gpu_hour_cost, node_hour_cost: weights for the `cost` objective.
        feature: the Slurm node feature that selects exactly this partition's nodes (`Features=h100` in
            slurm.conf), or None; a mixed-type plan asks for counts of each type's nodes by it
            (`--constraint=[h100*2&a100*2]`), so only partitions with a feature are mixed (predictor/mixed.py).
    """

    name: str
    nodes: tuple[str, ...]
    gpus_per_node: int
    gpu: str
    intra_link: str
    inter_link: str
    switches: tuple[tuple[str, tuple[str, ...]], ...] = ()
    gpu_hour_cost: float = 1.0
    node_hour_cost: float = 0.0
    feature: str | None = None

    @property
    def total_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    @property
    def largest_leaf(self) -> int:
        """Most nodes under one leaf switch (all nodes when no switches are configured)."""
        return max((len(members) for _, members in self.switches), default=len(self.nodes))

    def layouts(self, gpus: int) -> list[tuple[int, ...]]:
        """Uniform layouts of `gpus` GPUs on this partition, fewest nodes first (8 -> 2x4, 4x2, 8x1)."""
        found = []
        for per_node in range(min(gpus, self.gpus_per_node), 0, -1):
            if gpus % per_node == 0 and gpus // per_node <= len(self.nodes):
                found.append((per_node,) * (gpus // per_node))
        return found

    def candidate(self, layout: tuple[int, ...] | list[int]) -> dict:
        """The /v1/predict candidate for a layout on this partition's links."""
        cand: dict[str, Any] = {"layout": list(layout), "intra_link": self.intra_link}
        if len(layout) > 1:
            cand["inter_link"] = self.inter_link
        return cand

    def fits_one_leaf(self, node_count: int) -> bool:
        return bool(self.switches) and node_count <= self.largest_leaf

    def to_dict(self) -> dict:
        return {"name": self.name, "nodes": list(self.nodes), "gpus_per_node": self.gpus_per_node,
                "gpu": self.gpu, "intra_link": self.intra_link, "inter_link": self.inter_link,
                "switches": {name: list(members) for name, members in self.switches},
                "gpu_hour_cost": self.gpu_hour_cost, "node_hour_cost": self.node_hour_cost,
                **({"feature": self.feature} if self.feature else {})}

    @classmethod
    def from_dict(cls, data: Any, field: str) -> "Partition":
        if not isinstance(data, dict):
            raise ValidationError(field, "expected an object")
        known = {"name", "nodes", "gpus_per_node", "gpu", "intra_link", "inter_link", "switches",
                 "gpu_hour_cost", "node_hour_cost", "feature"}
        for key in data:
            if key not in known:
                raise ValidationError(f"{field}.{key}", f"unknown field (known: {', '.join(sorted(known))})")
        name = _name(data, "name", field)
        nodes_raw = data.get("nodes")
        if isinstance(nodes_raw, str):
            nodes = expand_hostlist(nodes_raw, f"{field}.nodes")
        elif isinstance(nodes_raw, list) and nodes_raw and all(isinstance(n, str) for n in nodes_raw):
            nodes = tuple(nodes_raw)
        else:
            raise ValidationError(f"{field}.nodes", "expected a host list string or a list of node names")
        gpn = data.get("gpus_per_node")
        if not isinstance(gpn, int) or isinstance(gpn, bool) or not 1 <= gpn <= 64:
            raise ValidationError(f"{field}.gpus_per_node", "expected an integer in 1..64")
        switches = []
        raw_switches = data.get("switches", {})
        if not isinstance(raw_switches, dict):
            raise ValidationError(f"{field}.switches", "expected an object leaf name -> host list")
        for leaf, members in raw_switches.items():
            where = f"{field}.switches.{leaf}"
            expanded = expand_hostlist(members, where) if isinstance(members, str) else tuple(members)
            unknown = set(expanded) - set(nodes)
            if unknown:
                raise ValidationError(where, f"nodes not in the partition: {', '.join(sorted(unknown))}")
            switches.append((leaf, expanded))
        costs = {}
        for key in ("gpu_hour_cost", "node_hour_cost"):
            value = data.get(key, 1.0 if key == "gpu_hour_cost" else 0.0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e6:
                raise ValidationError(f"{field}.{key}", "expected a number in [0, 1e6)")
            costs[key] = float(value)
        feature = data.get("feature")
        if feature is not None and (not isinstance(feature, str) or not _FEATURE_RE.match(feature)):
            raise ValidationError(f"{field}.feature", f"expected a node feature matching {_FEATURE_RE.pattern} "
                                                      f"(it goes into a --constraint expression)")
        return cls(name=name, nodes=nodes, gpus_per_node=gpn, gpu=_name(data, "gpu", field),
                   intra_link=_name(data, "intra_link", field), inter_link=_name(data, "inter_link", field),
                   switches=tuple(switches), feature=feature, **costs)


def _name(data: dict, key: str, field: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValidationError(f"{field}.{key}", f"expected a name matching {_NAME_RE.pattern}")
    return value


@dataclasses.dataclass(frozen=True)
class Cluster:
    """All partitions the planner may place jobs on."""

    partitions: tuple[Partition, ...]
    default_partition: str

    def __post_init__(self):
        names = [p.name for p in self.partitions]
        if not names:
            raise ValidationError("partitions", "the cluster model needs at least one partition")
        if len(set(names)) != len(names):
            raise ValidationError("partitions", "partition names must be unique")
        if self.default_partition not in names:
            raise ValidationError("default_partition", f"{self.default_partition!r} is not a partition")

    def partition(self, name: str | None = None) -> Partition:
        """The named partition, or the default one for None.

        Raises:
            NotFoundError: no such partition in the cluster model.
        """
        wanted = name or self.default_partition
        for part in self.partitions:
            if part.name == wanted:
                return part
        raise NotFoundError("partition", wanted, f"known: {', '.join(p.name for p in self.partitions)}")

    def partitions_with_gpu(self, gpu: str) -> list[Partition]:
        return [p for p in self.partitions if p.gpu.lower() == gpu.lower()]

    def to_dict(self) -> dict:
        return {"default_partition": self.default_partition,
                "partitions": [p.to_dict() for p in self.partitions]}

    @classmethod
    def from_dict(cls, data: Any) -> "Cluster":
        """Build from the JSON file format (module docstring).

        Raises:
            ValidationError: naming the bad field, e.g. `partitions[0].gpus_per_node`.
        """
        if not isinstance(data, dict) or not isinstance(data.get("partitions"), list):
            raise ValidationError("partitions", "expected an object with a list of partitions")
        parts = tuple(Partition.from_dict(p, f"partitions[{i}]") for i, p in enumerate(data["partitions"]))
        default = data.get("default_partition", parts[0].name if parts else "")
        return cls(partitions=parts, default_partition=default)

    @classmethod
    def from_file(cls, path: str) -> "Cluster":
        """Read a cluster model JSON file.

        Raises:
            ValidationError: unreadable file or malformed content (field `cluster` or the bad path).
        """
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError) as exc:
            raise ValidationError("cluster", f"cannot read cluster model {path}: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_slurm(cls, nodes, partitions, gpu: str, intra_link: str, inter_link: str) -> "Cluster":
        """Build from what Slurm reports (slurm_plugin.client `nodes()` and `partitions()`).

        Slurm knows node names, GPU counts, leaf switches and partitions, not link classes or the GPU model
        name used in observations: those come from the caller. A partition's GPUs per node is the smallest
        GPU count among its nodes (uniform layouts); partitions without GPU nodes are left out.

        Raises:
            ValidationError: no partition has GPU nodes.
        """
        by_name = {n.name: n for n in nodes}
        parts = []
        defaults = [p.name for p in partitions if p.default]
        for part in partitions:
            members = [by_name[n] for n in part.nodes if n in by_name and by_name[n].gpus > 0]
            if not members:
                continue
            leaves: dict[str, list[str]] = {}
            for node in members:
                if node.switch:
                    leaves.setdefault(node.switch, []).append(node.name)
            parts.append(Partition(name=part.name, nodes=tuple(n.name for n in members),
                                   gpus_per_node=min(n.gpus for n in members), gpu=gpu, intra_link=intra_link,
                                   inter_link=inter_link,
                                   switches=tuple((leaf, tuple(names)) for leaf, names in sorted(leaves.items()))))
        if not parts:
            raise ValidationError("partitions", "Slurm reports no partition with GPU nodes")
        names = [p.name for p in parts]
        return cls(partitions=tuple(parts), default_partition=next((d for d in defaults if d in names), names[0]))

    @classmethod
    def default(cls) -> "Cluster":
        """The local testbed: partition debug, node[1-4] x 4 GPUs, leaf switches node[1-2], node[3-4]."""
        return cls.from_dict({
            "default_partition": "debug",
            "partitions": [{"name": "debug", "nodes": "node[1-4]", "gpus_per_node": 4, "gpu": "H200",
                            "intra_link": "nvlink", "inter_link": "ib",
                            "switches": {"leaf1": "node[1-2]", "leaf2": "node[3-4]"}}],
        })
