"""Partitions of different GPU types on the real testbed (issue #16): real sbatch, real slurmctld, the lab's own
`elastic-predictor serve` (slurm_plugin/lab/demo_services.py) with the lab's cluster model (partitions h100 and
a100 beside debug, slurm_plugin/lab/gpu_types.py) and resnet50's seeded step history on both types (H100 1.8x
the A100's throughput at 2x its GPU-hour cost).

A job naming both partitions (or `#ELASTIC gpu_type=any`) is moved by the hook to the partition the service
picks, sbatch prints the service's one-line reason, and `scontrol show job` shows the partition.
"""
from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest

from predictor.profiles import profile_from_spec
from slurm_plugin.lab.demo_services import PredictorService
from tests.integration.test_hook import bed, hook, sbatch, script, show_job, tres  # noqa: F401 (fixtures)

# behaviour, not latency: the service's second gunicorn worker loads its models at its first plan
BUDGET_MS = 3000
LINES = "#ELASTIC model=resnet50 gpus=2-8\n#ELASTIC per_gpu_batch=64\n"
BODY = "srun -l bash -c 'echo $SLURMD_NODENAME CVD=$CUDA_VISIBLE_DEVICES'\n"
# the service's reason, as the planner words it (predictor/planner.py compare_partitions)
REASON = re.compile(r"sbatch: elastic: partition h100: 2x4 H100 predicted 1\.[6-9]x of a100 2x4 at 1\.[0-2]x its cost "
                    r"per sample; 2 nodes x 4 GPUs \(2x4\) predicted \d+ samples/s")


@pytest.fixture(scope="module")
def service(bed):  # noqa: F811
    """The lab's predictor service, fresh, with resnet50 seeded on both GPU types; stopped at the end."""
    server = PredictorService(bed, timeout=timedelta(seconds=60))
    server.start(fresh=True)
    try:
        server.seed_gpu_types(profile_from_spec("resnet50").to_dict())
        probe = {"source": "cli", "directives": LINES.splitlines(), "job": {"partition": "a100,h100"}}
        deadline = time.monotonic() + 60
        while "alternatives" not in server.post("/v1/plan", probe) or \
                server.post("/v1/plan", probe).get("partition") != "h100":
            if time.monotonic() > deadline:
                pytest.fail(f"the lab's service never compared h100 and a100: {server.post('/v1/plan', probe)}")
            time.sleep(0.5)
        yield server
    finally:
        server.stop()


def test_a_two_partition_job_is_moved_to_the_faster_type_and_runs_there(hook, service, sbatch, bed, tmp_path,  # noqa: F811
                                                                        wait_until):
    hook(service.url, budget_ms=BUDGET_MS)
    result = sbatch(script(directives=LINES, body=BODY), "--partition=a100,h100")
    assert result.rc == 0, result.stderr
    assert REASON.match(result.stderr.strip()), result.stderr
    job = show_job(bed, result.job_id)
    assert job["Partition"] == "h100"
    assert job["NumNodes"] in ("2", "2-2") and job["TresPerNode"] == tres(bed, 4) and "TresPerJob" not in job
    decision = re.fullmatch(r"orig elastic:decision=(\S+)", job["Comment"]).group(1)
    stored = service.get(f"/v1/decisions/{decision}")
    assert {a["partition"] for a in stored["response"]["alternatives"]} == {"a100", "h100"}
    wait_until(lambda: show_job(bed, result.job_id)["JobState"] in ("COMPLETED", "FAILED"), 90, "the job to end")
    out = (tmp_path / f"{result.job_id}.out").read_text()
    assert show_job(bed, result.job_id)["JobState"] == "COMPLETED", out
    assert sorted({line.split()[1] for line in out.splitlines() if "CVD=" in line}) == ["node1", "node2"]


def test_a_typed_request_for_the_other_type_is_moved_untyped(hook, service, sbatch, bed):  # noqa: F811
    hook(service.url, budget_ms=BUDGET_MS)
    lines = "#SBATCH -N1 --gres=gpu:a100:2 --comment=orig\n"
    result = sbatch(script(directives=LINES, sbatch_lines=lines), "-H", "--partition=a100,h100")
    assert result.rc == 0 and REASON.match(result.stderr.strip()), result.stderr
    job = show_job(bed, result.job_id)
    assert job["Partition"] == "h100" and job["TresPerNode"] == tres(bed, 4)


def test_gpu_type_any_moves_a_job_off_the_default_partition(hook, service, sbatch, bed):  # noqa: F811
    hook(service.url, budget_ms=BUDGET_MS)
    result = sbatch(script(directives=LINES + "#ELASTIC gpu_type=any\n"), "-H")
    assert result.rc == 0, result.stderr
    # debug (the default) is compared too: it has no resnet50 history on its type, so h100 wins
    assert result.stderr.startswith("sbatch: elastic: partition h100: 2x4 H100 predicted"), result.stderr
    assert show_job(bed, result.job_id)["Partition"] == "h100"
