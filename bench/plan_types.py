"""Cost of one POST /v1/plan when the planner compares GPU types (issue #16) against a one-partition plan, beside
the hook's budget (job_submit.lua's default `budget_ms`, 100 ms).

The lab's cluster model (slurm_plugin/lab/demo_services.py `PredictorService.cluster`: `debug` with all four
nodes, `h100` = node[1-2], `a100` = node[3-4]) and resnet50's seeded history on both types
(slurm_plugin/lab/gpu_types.py), in a fresh database; the service in process (Flask test client, the real
engine), as `elastic-predictor serve` runs it minus HTTP. Bodies, each distinct (`min_efficiency=0.5NNNNN`, so no
cache of the hook or the service holds the decision), run round-robin:

    one        `--partition=h100`: the partition's layouts only
    two        `--partition=a100,h100`: both partitions compared (compare_partitions)
    any        `#ELASTIC gpu_type=any`: every typed partition compared, and the mixed layouts (predictor/mixed.py)
    any-cold   the same, each request with a per-GPU batch no request asked before (the service's prediction
               cache misses: every type's predictions are computed)

Usage: python bench/plan_types.py [--requests 300] [--out bench/results/plan_types.md]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import types
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LINES = ["#ELASTIC model=resnet50 gpus=2-8", "#ELASTIC per_gpu_batch=64"]
KINDS = {"one": ([], "h100"), "two": ([], "a100,h100"), "any": (["#ELASTIC gpu_type=any"], None),
         "any-cold": (["#ELASTIC gpu_type=any"], None)}
BUDGET_MS = 100


def body(kind: str, n: int) -> bytes:
    extra, partition = KINDS[kind]
    job = {"partition": partition} if partition else {}
    lines = LINES if kind != "any-cold" else [LINES[0], f"#ELASTIC per_gpu_batch={65 + n}"]
    return json.dumps({"source": "cli", "directives": lines + extra + [f"#ELASTIC min_efficiency=0.5{n:05d}"],
                       "job": job}).encode()


def _app(tmp: Path):
    from predictor.app import create_app
    from predictor.config import Config
    from predictor.profiles import profile_from_spec
    from slurm_plugin.lab import gpu_types
    from slurm_plugin.lab.demo_services import PredictorService
    from slurm_plugin.lab.testbed_conf import TestbedConfig

    cfg = TestbedConfig(lab=tmp / "lab")
    cluster = PredictorService(types.SimpleNamespace(config=cfg)).cluster()
    (tmp / "cluster.json").write_text(json.dumps(cluster))
    env = {"ELASTIC_PREDICTOR_DB": str(tmp / "p.db"), "ELASTIC_PREDICTOR_CLUSTER": str(tmp / "cluster.json")}
    app = create_app(Config.from_env(env))
    client = app.test_client()
    profile = profile_from_spec("resnet50").to_dict()
    assert client.post("/v1/profiles", json=profile).status_code == 201
    r = client.post("/v1/observations", json=gpu_types.seed_records(cfg, profile["name"]))
    assert r.status_code in (200, 201), r.data[:300]
    assert app.extensions["elastic_predictor"].models.wait_fresh(timedelta(seconds=120)), "no fit"
    return app, client


def run(requests: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        app, client = _app(Path(d))
        wall: dict[str, list[float]] = {k: [] for k in KINDS}
        cpu: dict[str, list[float]] = {k: [] for k in KINDS}
        picked: dict[str, set] = {k: set() for k in KINDS}
        for n in range(50 + requests):
            for k in KINDS:
                data = body(k, n)
                c0, t0 = time.thread_time(), time.perf_counter()
                r = client.post("/v1/plan", data=data, content_type="application/json")
                t, c = time.perf_counter() - t0, time.thread_time() - c0
                assert r.status_code == 200, (k, r.data[:300])
                if n >= 50:  # the first 50 warm the prediction cache and the code paths
                    wall[k].append(t)
                    cpu[k].append(c)
                    plan = r.get_json()
                    picked[k].add((plan.get("partition"), plan.get("constraint"), plan.get("reason", "")[:60]))
        app.extensions["elastic_predictor"].models.stop()
    out = {}
    for k in KINDS:
        q = statistics.quantiles(wall[k], n=100, method="inclusive")
        out[k] = {"p50_ms": 1e3 * statistics.median(wall[k]), "p99_ms": 1e3 * q[98], "max_ms": 1e3 * max(wall[k]),
                  "cpu_ms": 1e3 * statistics.mean(cpu[k]), "n": len(wall[k]), "answers": sorted(map(str, picked[k]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = run(args.requests)
    print(json.dumps(res))
    lines = ["# plan_types: /v1/plan cost when the planner compares GPU types", "",
             f"`python bench/plan_types.py --requests {args.requests}`; in process (Flask test client, the real engine), "
             f"distinct bodies round-robin; hook budget {BUDGET_MS} ms.", "",
             "| body | requests | p50 ms | p99 ms | max ms | CPU ms (mean) | p99 / hook budget |", "|---|---|---|---|---|---|---|"]
    for k, r in res.items():
        lines.append(f"| {k} | {r['n']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | {r['cpu_ms']:.1f} | "
                     f"{r['p99_ms'] / BUDGET_MS:.2f} |")
    lines += ["", "Answers (partition, constraint, reason's start):"] + \
        [f"- {k}: {'; '.join(r['answers'])}" for k, r in res.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
