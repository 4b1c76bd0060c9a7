"""#45.2 on the lab: `template new` + sbatch of a model that is not built in gets planned on its second run, with
no manual step. The lab's own service (munge on, slurm_plugin/lab/demo_services.py) and the job_submit hook:
the first submission is kept as written (`unknown model`); the job registers the model its workers built and
posts its step times, signed with its own munge credential (no token in its environment); the second
submission of the same script is planned."""
from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from slurm_plugin import templates
from slurm_plugin.lab.demo_services import PredictorService
from tests.integration.test_hook import bed, hook, sbatch, show_job  # noqa: F401 (fixtures)

LAUNCHER = Path(sys.executable).parent / "elastic-launch"
LAUNCH = [str(LAUNCHER)] if LAUNCHER.exists() else [sys.executable, "-m", "elastic_launcher.cli"]
MODEL = "my-gpt"


@pytest.fixture(scope="module")
def service(bed):  # noqa: F811
    server = PredictorService(bed, timeout=timedelta(seconds=60))
    server.start(fresh=True)
    try:
        yield server
    finally:
        server.stop()


def _job(tmp_path: Path, run: str) -> str:
    params = templates.Params(cpu_test=True, python=sys.executable, launcher=LAUNCH, directives={"model": MODEL},
                              launcher_options={"--run-dir": str(tmp_path / run)},
                              script_options={"--steps": "400", "--log-every": "100"})
    return templates.render(templates.get("gpt-lm"), params)


def test_a_new_model_is_planned_on_its_second_run_without_a_manual_step(hook, service, sbatch, bed,  # noqa: F811
                                                                        tmp_path, wait_until):
    hook(service.url, budget_ms=3000)
    first = sbatch(_job(tmp_path, "run1"))
    assert first.rc == 0 and f"unknown model '{MODEL}'" in first.stderr, first.stderr
    wait_until(lambda: show_job(bed, first.job_id)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"), 240,
               "the first job to end")
    records = [json.loads(line) for line in (tmp_path / "run1" / "records.jsonl").read_text().splitlines()]
    assert show_job(bed, first.job_id)["JobState"] == "COMPLETED", records[-3:]
    (registered,) = [r for r in records if r["kind"] == "model_profile"]
    assert registered["outcome"] == "registered" and registered["tensors"] > 0, registered
    decisions = [r for r in records if r["kind"] == "decision" and r.get("source") == "autoscale"]
    assert decisions and all(d["writes"] == "posted" for d in decisions), decisions
    assert service.get(f"/v1/profiles/{MODEL}")["tensors"]
    # the job's rows: labelled with its devices (cpu), stored under its own credential
    probe = {"source": "cli", "directives": [ln for ln in _job(tmp_path, "x").splitlines()
                                             if ln.startswith("#ELASTIC")], "job": {"partition": "debug"}}
    deadline = time.monotonic() + 90
    while "unknown model" in (reason := str(service.post("/v1/plan", probe).get("reason"))) or \
            "no step history" in reason:
        assert time.monotonic() < deadline, reason   # the service refits after the job's rows arrive
        time.sleep(1)
    second = sbatch(_job(tmp_path, "run2"))
    print(f"first sbatch: {first.stderr.strip()}\nsecond sbatch: {second.stderr.strip()}")
    assert second.rc == 0, second.stderr
    assert "sbatch: elastic:" in second.stderr and "unknown model" not in second.stderr, second.stderr
    assert "predicted" in second.stderr or "already matches" in second.stderr, second.stderr
