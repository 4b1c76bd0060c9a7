"""Predictor observation records (design.md, `POST /v1/observations`) as the controller sends them.

The workers' telemetry (`ElasticTrainer.observations()`) knows the world size of the group it timed, not how
the workers are spread over nodes, nor which links its collectives crossed. The controller knows both: which
node each worker of an epoch runs on (so the layout, e.g. `[2, 2]`) and the links of that layout
(`links.links_for`, from the facts each worker published about its host, or `--intra-link/--inter-link`). So the
workers hand their records over through the store (`ProgressReporter.publish`, one JSON list per line under
`launcher/observations/<wid>`), and the controller relabels them here before it posts them:

* a step record gets the layout of its world size, `intra_link`, and `inter_link` whenever the layout spans
  several nodes (the predictor rejects a multi-node step record without it);
* a collective record gets `link` (the inter-node link when its group spans several nodes: the bottleneck;
  else the intra-node link) and `nodes`;
* both get `link_source` (how the labels were found) and the job's profile (`#ELASTIC model=`) and GPU type.
  A record whose world size matches no layout the controller has seen (or labelled) is dropped.

The record's schema has one owner, `slurm_plugin.contracts.records`, which the service validates every post with;
`postable` applies it here first, so one bad record costs itself, not the whole all-or-nothing POST it rides in.
"""
from __future__ import annotations

import json
import logging
from typing import Iterable, Mapping, Optional, Sequence

from elastic_launcher import store_keys as keys
from elastic_launcher.links import Links
from slurm_plugin.contracts.records import mixed_gpu, validate_record
from slurm_plugin.errors import ValidationError

log = logging.getLogger("elastic_launcher.observations")


def step_record(profile: str, gpu: str, layout: Sequence[int], links: Links, per_gpu_batch: int,
                iter_s: float, gpu_by_node: Optional[Sequence[str]] = None,
                rank_batches: Optional[Sequence[int]] = None) -> dict:
    """A `kind: step` record for one layout; with each node's GPU type (several: the row's `gpu` is theirs joined,
    `contracts.records.mixed_gpu`) and each rank's local batch when known (#42.7: what ran)."""
    if gpu_by_node is not None and len(set(gpu_by_node)) > 1:
        gpu = mixed_gpu(gpu_by_node)
    return {"kind": "step", "profile": profile, "gpu": gpu, "layout": list(layout), **links.for_layout(layout),
            "per_gpu_batch": int(per_gpu_batch), "iter_s": float(iter_s),
            **({"gpu_by_node": list(gpu_by_node)} if gpu_by_node is not None else {}),
            **({"rank_batches": [int(b) for b in rank_batches]} if rank_batches is not None else {})}


def relabel(records: Iterable[dict], layouts: Mapping[int, Sequence[int]], links: Mapping[int, Links],
            profile: str, gpu: str, steps: bool = True) -> list[dict]:
    """Worker records with the layout, links, profile and GPU the controller knows (see the module docstring).

    Args:
        records: records from `ElasticTrainer.observations()` (any number of workers).
        layouts: world size -> layout (GPUs per node) of the epochs the job ran.
        links: world size -> the links of that layout.
        steps: keep the workers' step records. The controller passes False: its own step record per
            measurement window (commit points and all) is the job's step time, and a second kind of step row
            for the same layout (the workers' median step) would pull the measured figure two ways.
    """
    out = []
    for rec in records:
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "collective":
            world = int(rec.get("world", 0))
            layout, lk = layouts.get(world), links.get(world)
            if layout is None or lk is None or world < 2:  # one process used no link (an older worker's record)
                continue
            out.append({**rec, "link": lk.bottleneck(layout), "link_source": lk.source, "nodes": len(layout),
                        "gpu": gpu})
        elif kind == "step" and steps:
            world = sum(rec.get("layout") or [0])
            layout, lk = layouts.get(world), links.get(world)
            if layout is None or lk is None:
                continue
            fixed = {k: v for k, v in rec.items() if k not in ("intra_link", "inter_link", "link_source")}
            out.append({**fixed, "layout": list(layout), **lk.for_layout(layout), "profile": profile, "gpu": gpu})
    return out


def postable(records: Iterable[dict]) -> tuple[list[dict], list[str]]:
    """The records the service would accept (as they are, not normalised) and why each other one would be refused
    (`records[i].field: what is wrong`, `i` its place in `records`): the service refuses a whole batch for one bad
    record, so a record the contract refuses is dropped before the post."""
    kept, refused = [], []
    for i, record in enumerate(records):
        try:
            validate_record(record, f"records[{i}]")
        except ValidationError as exc:
            refused.append(str(exc))
            continue
        kept.append(record)
    return kept, refused


class ObservationInbox:
    """Controller side of the workers' observation channel: reads what each worker appended since last time.

    Args:
        store: the job's store (no prefix).
    """

    def __init__(self, store) -> None:
        self.store = store
        self._offsets: dict[str, int] = {}

    def collect(self, wids: Iterable[str]) -> list[dict]:
        """New records of these workers (unreadable lines are skipped and logged)."""
        out: list[dict] = []
        for wid in wids:
            key = keys.observations(wid)
            try:
                if not self.store.check([key]):
                    continue
                data = self.store.get(key)
            except Exception as exc:  # noqa: BLE001 - a store hiccup costs one round of observations
                log.debug("cannot read %s: %s", key, exc)
                continue
            start = self._offsets.get(wid, 0)
            end = data.rfind(b"\n") + 1
            if end <= start:
                continue
            self._offsets[wid] = end
            for line in data[start:end].splitlines():
                try:
                    batch = json.loads(line)
                except ValueError:
                    log.warning("worker %s sent an unreadable observation line", wid)
                    continue
                if isinstance(batch, list):
                    out.extend(r for r in batch if isinstance(r, dict))
        return out


def layout_of(members: Sequence[str], node_of: Mapping[str, str]) -> Optional[list[int]]:
    """GPUs per node of an epoch, nodes in order of first appearance; None if a member's node is unknown."""
    counts: dict[str, int] = {}
    for wid in members:
        node = node_of.get(wid)
        if node is None:
            return None
        counts[node] = counts.get(node, 0) + 1
    return list(counts.values())
