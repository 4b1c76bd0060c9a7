"""The policy's last step (predictor.planner.last_step) against tests/vectors/policy.json, and the decision
bands the service precomputes from it for the job_submit hook's cache (planner.min_efficiency_bands: the hook
looks them up, it runs no policy; issue 26.3).

Each vector: a prediction table (`table`: the partition and the predictions of its every uniform layout), the
`#ELASTIC` lines and the job fields of a request, and what the step decides (`expect`: action, nodes,
gpus_per_node, tasks_per_node, switches, layout, reason; `judged` false for a keep made without predictions).
Regenerate after a deliberate policy change with `python -m tests.unit.test_policy_vectors` and review the diff.
"""
from __future__ import annotations

import itertools
import json
import pathlib

import pytest

from predictor import planner
from predictor.cluster import Cluster
from slurm_plugin.contracts.directives import parse_lines

PATH = pathlib.Path(__file__).parents[1] / "vectors" / "policy.json"
FIELDS = ("action", "nodes", "gpus_per_node", "tasks_per_node", "switches", "layout", "reason")


def decide(vector: dict, table: dict) -> dict:
    d = parse_lines(list(enumerate(vector["directives"], start=1)))
    out = planner.last_step(table, d, planner.requested(planner._job(vector["job"])))
    got = {key: out[key] for key in FIELDS if out.get(key) is not None}
    got["judged"] = out["predicted"] is not None
    return got


def _tables() -> list[dict]:
    """Tables from the planner itself (the fake predictor of the unit tests, several curve shapes)."""
    from tests.unit.test_planner import Models

    tables, part = [], Cluster.default().partition()
    cands = [part.candidate(layout) for gpus in range(1, part.total_gpus + 1) for layout in part.layouts(gpus)]
    for batch, fake in itertools.product((16, 64, 512), ({}, {"inter_node_s": 0.0005}, {"comm_per_doubling_s": 0.05},
                                                          {"compute_per_sample_s": 0.02, "inter_node_s": 0.2})):
        preds = Models(**fake).predict(None, part.gpu, batch, cands)
        tables.append({**planner._table_of(part, 0.5), "model": "resnet50", "per_gpu_batch": batch,
                       "entries": [{"layout": c["layout"], "samples_per_s": planner._entry(c["layout"], p, batch)
                                    ["samples_per_s"]} for c, p in zip(cands, preds)]})
    flat = {**tables[1], "one_leaf_nodes": 0, "node_hour_cost": 3.0, "min_efficiency": 0.3}
    ties = {**tables[0], "entries": [{**e, "samples_per_s": 1000.0 * (1 + (sum(e["layout"]) > 2))}
                                     for e in tables[0]["entries"]]}
    zero = {**tables[0], "entries": [{**e, "samples_per_s": 0.0} for e in tables[0]["entries"]]}
    return tables + [flat, ties, zero]


DIRECTIVES = [
    ["#ELASTIC model=resnet50 gpus=2-8"], ["#ELASTIC model=resnet50 gpus=1-16 min_efficiency=0.9"],
    ["#ELASTIC model=resnet50 gpus=1-16 min_efficiency=0.2"], ["#ELASTIC model=resnet50 gpus=4"],
    ["#ELASTIC model=resnet50 gpus=3-7 objective=efficiency"], ["#ELASTIC model=resnet50 objective=cost"],
    ["#ELASTIC model=resnet50 gpus=1-16 max_global_batch=4096"], ["#ELASTIC model=resnet50 gpus=5-5"],
    ["#ELASTIC model=resnet50 max_global_batch=100"], ["#ELASTIC model=resnet50 gpus=2-64 min_efficiency=0"],
    ["#ELASTIC model=resnet50"], ["#ELASTIC model=resnet50 gpus=1-12 min_efficiency=0.512345 objective=cost"],
]
JOBS = [{}, {"min_nodes": 1, "max_nodes": 1, "tres_per_job": "gres:gpu:4"},
        {"min_nodes": 2, "max_nodes": 2, "tres_per_node": "gres:gpu:h100:4", "req_switch": 1},
        {"min_nodes": 1, "tres_per_node": "gres:nic:1,gres:gpu:2"}, {"min_nodes": 4, "tres_per_node": "gpu:1"},
        {"min_nodes": 3, "max_nodes": 3, "tres_per_node": "gres:gpu:4"}]


def generate() -> dict:
    vectors, tables = [], _tables()
    for t, table in enumerate(tables):
        for i, lines in enumerate(DIRECTIVES):
            for j, job in enumerate(JOBS):
                if (t + i + j) % 3:        # a spread of the combinations, not all of them
                    continue
                lines_ = [lines[0] + f" per_gpu_batch={table['per_gpu_batch']}"]
                vector = {"name": f"table {t}, directives {i}, job {j}", "table": t, "directives": lines_,
                          "job": job}
                vector["expect"] = decide(vector, table)
                vectors.append(vector)
    return {"tables": tables, "vectors": vectors}


SHARED = json.loads(PATH.read_text()) if PATH.exists() else {"tables": [], "vectors": []}
VECTORS = SHARED["vectors"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_last_step_matches_the_shared_vectors(vector):
    assert decide(vector, SHARED["tables"][vector["table"]]) == vector["expect"]


def test_vectors_cover_every_outcome():
    outcomes = {(v["expect"]["action"], v["expect"]["judged"]) for v in VECTORS}
    assert outcomes == {("rewrite", True), ("keep", True), ("keep", False)}
    reasons = " | ".join(v["expect"]["reason"] for v in VECTORS)
    for part in ("efficiency", "objective cost", "objective efficiency", "one leaf switch", "caps at",
                 "already matches", "gpus max", "has 16 GPUs", "nan"):
        assert part in reasons, part


EFFICIENCIES = (0.0, 0.05, 0.2, 0.3, 0.4999, 0.5, 0.5000017, 0.512345, 0.6, 0.7, 0.71, 0.75, 0.8, 0.85, 0.9, 0.95,
                0.99, 0.9999, 1.0)


@pytest.mark.parametrize("vector", [v for v in VECTORS if v["expect"]["judged"]], ids=lambda v: v["name"])
def test_bands_give_what_last_step_decides_for_every_min_efficiency(vector):
    """What replaced job_submit.lua's copy of the policy (issue 26.3): the hook applies the band holding a
    request's min_efficiency, with BOUND replaced by its value; that is the service's own decision."""
    table = SHARED["tables"][vector["table"]]
    d = parse_lines(list(enumerate(vector["directives"], start=1)))
    requested = planner.requested(planner._job(vector["job"]))
    bands = planner.min_efficiency_bands(table, d, requested)
    assert bands and bands[0]["above"] < 0 and bands[-1]["upto"] == 1.0
    assert all(a["upto"] == b["above"] for a, b in zip(bands, bands[1:]))
    for v in EFFICIENCIES:
        [band] = [b for b in bands if b["above"] < v <= b["upto"]]
        out = planner.last_step(table, {**d, "min_efficiency": v}, requested)
        assert {k: band[k] for k in FIELDS if k not in ("layout", "reason")} == \
               {k: out[k] for k in FIELDS if k not in ("layout", "reason")}
        assert band["reason"].replace(planner.BOUND, planner.shown_bound(v)) == out["reason"], v


def test_the_service_sends_bands_only_to_the_hook_and_only_for_a_min_efficiency():
    from tests.unit.test_planner import Models

    job = {"min_nodes": 1, "tres_per_job": "gres:gpu:4"}
    lines = ["#ELASTIC model=resnet50 gpus=2-8 per_gpu_batch=64 min_efficiency=0.6"]

    def reply(source, directives):
        body = {"source": source, "directives": directives, "job": job}
        return planner.plan(planner.parse_request(body), Cluster.default(), Models(), 0.5)

    out = reply("job_submit", lines)
    [band] = [b for b in out["bands"] if b["above"] < 0.6 <= b["upto"]]
    assert (band["action"], band["nodes"], band["gpus_per_node"], band["switches"]) == \
           (out["action"], out["nodes"], out["gpus_per_node"], out["switches"])
    assert band["reason"].replace(planner.BOUND, "0.6") == out["reason"]
    assert "bands" not in reply("cli_filter", lines) and "bands" not in reply("launcher", lines)
    assert "bands" not in reply("job_submit", [lines[0].replace(" min_efficiency=0.6", "")])
    assert "bands" not in reply("job_submit", [lines[0] + " batch_policy=keep_global"])
    assert "table" not in out


if __name__ == "__main__":
    shared = generate()
    PATH.write_text('{"tables": [\n' + ",\n".join(json.dumps(t) for t in shared["tables"]) + '\n],\n"vectors": [\n'
                    + ",\n".join(json.dumps(v) for v in shared["vectors"]) + "\n]}\n")
    print(f"wrote {PATH}")


def test_a_sweep_that_needs_more_than_max_band_steps_decisions_sends_no_bands(monkeypatch):
    """Review: the sweep's cost was bounded by the bands kept, not by the decisions it ran (229 ms on a 1-512
    GPU range); past MAX_BAND_STEPS `last_step` runs it gives up (the hook then asks the service each time)."""
    vector = next(v for v in VECTORS if v["expect"]["judged"])
    table = SHARED["tables"][vector["table"]]
    d = parse_lines(list(enumerate(vector["directives"], start=1)))
    requested = planner.requested(planner._job(vector["job"]))
    calls = []
    real = planner.last_step
    monkeypatch.setattr(planner, "last_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert planner.min_efficiency_bands(table, d, requested)
    needed = len(calls)
    assert needed >= 2
    calls.clear()
    monkeypatch.setattr(planner, "MAX_BAND_STEPS", needed - 1)
    assert planner.min_efficiency_bands(table, d, requested) == [] and len(calls) == needed - 1
