"""Mixed GPU types inside one job on the real testbed (issue #16, docs/mixed-types.md).

1. The hook places a job that allows any type and wants more GPUs than one type's partition holds as a mixed
   job: partition debug (every node) with a node-feature count constraint, the reason printed by sbatch.
2. A mixed job (1 H100 node + 1 A100 node, by that constraint) runs under elastic-launch: each node's GPU type
   comes from Slurm's GRES, each type's speed from the lab's predictor, and the ranks' batches follow the
   speeds with the runtime's split rule; the records and the workers' logs carry each node's type. The types
   are emulated (train_tiny.py --emulate-gpu-types): the testbed has no GPUs. No timings are asserted
   (bench/mixed_types.py measures them).
"""
from __future__ import annotations

import json
import re
import sqlite3
import sys
from pathlib import Path

from elastic_launcher.batch_policy import split_batch
from tests.integration.test_gpu_types import service  # noqa: F401 (fixture: the lab's seeded predictor)
from tests.integration.test_hook import bed, hook, sbatch, script, show_job, tres  # noqa: F401 (fixtures)

HERE = Path(__file__).parent
BATCH = 8


def test_the_hook_places_a_job_wider_than_one_type_as_a_mixed_job(hook, service, sbatch, bed):  # noqa: F811
    hook(service.url, budget_ms=3000)
    lines = "#ELASTIC model=resnet50 gpus=8-16 per_gpu_batch=64 gpu_type=any\n"
    result = sbatch(script(directives=lines), "-H")
    assert result.rc == 0, result.stderr
    assert re.match(r"sbatch: elastic: mixed 2x4 H100 \+ 2x4 A100 on partition debug predicted \d+ samples/s with "
                    r"per-GPU batches H100 \d+, A100 \d+ ", result.stderr), result.stderr
    job = show_job(bed, result.job_id)
    assert job["Partition"] == "debug" and job["Features"] == "[h100*2&a100*2]"
    assert job["NumNodes"] in ("4", "4-4") and job["TresPerNode"] == tres(bed, 4)
    decision = re.search(r"elastic:decision=(\S+)", job["Comment"]).group(1)
    stored = service.get(f"/v1/decisions/{decision}")["response"]
    assert stored["constraint"] == "[h100*2&a100*2]" and stored["mixed"]["types"] == ["H100", "H100", "A100", "A100"]
    assert any(a.get("mixed") and a["reason"].endswith("; chosen") for a in stored["alternatives"])


def _launch(work: Path, url: str, token: str) -> str:
    train = [sys.executable, str(HERE / "train_tiny.py"), "--steps", "40", "--per-gpu-batch", str(BATCH),
             "--dataset-size", "10000", "--compute-ms", "20", "--emulate-gpu-types", "--out", str(work / "samples")]
    return f"""#!/bin/bash
#ELASTIC model=resnet50 gpus=2 per_gpu_batch={BATCH}
export ELASTIC_PREDICTOR_TOKEN={token} PYTHONPATH={HERE.parents[1]}
exec {sys.executable} -m elastic_launcher.cli --script "$0" --workers-per-node 1 --run-dir {work}/run \\
    --predictor {url} --intra-link shm --inter-link socket --no-autoscale --straggler-ratio 1000 \\
    --measure-steps 8 --warmup-steps 2 -- {' '.join(train)}
"""


def test_a_mixed_job_splits_its_batch_by_each_types_speed(service, sbatch, bed, tmp_path, wait_until):  # noqa: F811
    result = sbatch(_launch(tmp_path, service.url, service.token), "-N2", "--gres=gpu:1", "-p", "debug",
                    "--constraint=[h100*1&a100*1]", f"--chdir={tmp_path}")
    assert result.rc == 0, result.stderr
    wait_until(lambda: show_job(bed, result.job_id)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), 180,
               "the mixed job to end")
    out = (tmp_path / f"{result.job_id}.out").read_text()
    assert show_job(bed, result.job_id)["JobState"] == "COMPLETED", out
    records = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    types = next(r for r in records if r["kind"] == "gpu_types")
    nodes = types["nodes"]
    # the labels are the nodes' GRES types as Slurm has them (testbed: node[1-2] gpu:h100, node[3-4] gpu:a100)
    assert {n: (t["gres_type"], t["gpu"]) for n, t in nodes.items()} == {"node1": ("h100", "H100"),
                                                                         "node3": ("a100", "A100")}
    assert types["mixed"] and types["speeds"].startswith("predictor: ")
    assert nodes["node1"]["speed"] == 1.0 and 0.3 < nodes["node3"]["speed"] < 0.9   # the A100 is the slower type
    measured = [r for r in records if r["kind"] == "measurement"]
    assert measured and all(r["gpu_type_by_node"] == {"node1": "H100", "node3": "A100"} for r in measured)
    # every step: the H100 rank took the larger share, by the runtime's rule on the launcher's speeds
    want = split_batch(2 * BATCH, [nodes["node1"]["speed"], nodes["node3"]["speed"]])
    by_node: dict[str, set] = {}
    for path in (tmp_path / "samples").glob("samples-*.jsonl"):
        for row in map(json.loads, path.read_text().splitlines()):
            by_node.setdefault((row["node"], row["gpu"]), set()).add(len(row["idx"]))
    assert by_node == {("node1", "H100"): {want[0]}, ("node3", "A100"): {want[1]}}
    assert want[0] > want[1]
    # #42.7: the job's step rows say what ran (before: a mixed job posted none): each node's type, each rank's batch
    with sqlite3.connect(f"file:{service.db}?mode=ro", uri=True) as db:
        steps = [json.loads(b) for (b,) in db.execute("SELECT body FROM observations WHERE kind = 'step'")]
    mine = [r for r in steps if r.get("gpu_by_node")]
    assert mine and all((r["gpu"], r["gpu_by_node"], r["rank_batches"]) == ("A100+H100", ["H100", "A100"], want)
                        for r in mine), mine
