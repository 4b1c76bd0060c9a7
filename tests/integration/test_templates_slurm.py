"""The sbatch templates on the Slurm testbed: each one is a valid batch script as written and as rendered,
and the small CPU variant of each runs to completion under elastic-launch (real sbatch, srun steps, gloo).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_plugin import templates

NAMES = sorted(templates.templates())
# The jobs get Slurm's minimal PATH: name this interpreter and its elastic-launch explicitly.
LAUNCHER = Path(sys.executable).parent / "elastic-launch"
LAUNCH = [str(LAUNCHER)] if LAUNCHER.exists() else [sys.executable, "-m", "elastic_launcher.cli"]


def _test_only(testbed, script: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **testbed.env()}
    return subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, env=env,
                          timeout=60, cwd=script.parent)


def test_there_are_at_least_four_templates():
    assert {"resnet50", "transformer-finetune", "gpt-lm", "wrap-train-py"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_template_as_written_passes_sbatch_test_only(testbed, name, tmp_path):
    script = tmp_path / f"{name}.sbatch"
    script.write_text(templates.get(name).text)
    proc = _test_only(testbed, script)
    assert proc.returncode == 0, proc.stderr
    assert "to start at" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("gpus, expect_nodes", [("2-16", "node1"), ("6-12", "node[1-2]")])
def test_rendered_template_passes_sbatch_test_only(testbed, name, gpus, expect_nodes, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(templates.render(templates.get(name), templates.Params(gpus=gpus, gpus_per_node=4)))
    proc = _test_only(testbed, script)
    assert proc.returncode == 0, proc.stderr
    if "elastic:" not in proc.stderr:   # no job_submit hook installed on this lab: the request as written
        assert f"on nodes {expect_nodes} " in proc.stderr, proc.stderr


def test_a_bad_request_is_refused_by_test_only(testbed, tmp_path):
    """The check is real: 5 GPUs on one node of the 4-GPU testbed cannot run."""
    script = tmp_path / "job.sbatch"
    script.write_text(templates.render(templates.get("resnet50"), templates.Params(sbatch={"gpus-per-node": "5"})))
    proc = _test_only(testbed, script)
    assert proc.returncode != 0


@pytest.mark.parametrize("name, done", [
    ("resnet50", "done: 20 steps"),
    ("gpt-lm", "done: 20 steps"),
    ("transformer-finetune", "done: 20 steps"),
    ("wrap-train-py", "done: 20 steps on 2 ranks"),
])
def test_cpu_variant_runs_to_completion_under_elastic_launch(slurm, submit, idle_nodes, wait_until, tmp_path,
                                                             name, done):
    work = Path(tmp_path)
    script = work / "job.sbatch"
    params = templates.Params(cpu_test=True, python=sys.executable, launcher=LAUNCH,
                              launcher_options={"--run-dir": str(work / "run")})
    script.write_text(templates.render(templates.get(name), params))
    job_id = submit(script, ["--chdir", str(work)])

    wait_until(lambda: slurm.job(job_id).state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"), 240,
               f"the {name} CPU job to finish")
    out = (work / f"{name}-cpu-test-{job_id}.out").read_text()
    assert slurm.job(job_id).state == "COMPLETED", out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    logs = "\n".join(p.read_text() for p in (work / "run").glob("worker-*.log"))
    assert summary["outcome"] == "completed" and summary["final_nodes"] in (1, 2), \
        (summary, out[-3000:], logs[-3000:])   # 1: straggler cut
    assert done in logs, logs[-3000:]
    records = [json.loads(line) for line in (work / "run" / "records.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "transition" and r["action"] == "start")
    assert start["world"] == 2 and start["to_nodes"] == 2


@pytest.mark.timeout(900)   # a hang guard above the waits below: a busy CI host took over 300 s
def test_template_job_grows_through_a_helper_and_shrinks_on_request(slurm, submit, idle_nodes, wait_until, tmp_path):
    """The example scripts are elastic: the job grows from 2 to 4 nodes with a helper job (newcomers receive
    the state and train on), an operator shrink takes them out again at a commit point, and the job finishes
    its steps. `--test-throughput linear` injects the launcher's CPU-testbed throughput model
    (elastic_launcher.testing.LinearThroughput: throughput taken as linear in workers)."""
    work = Path(tmp_path)
    registry, run = work / "registry", work / "run"
    params = templates.Params(cpu_test=True, python=sys.executable, launcher=LAUNCH,
                              directives={"gpus": "1-4", "max_global_batch": "64"},
                              launcher_options={"--run-dir": str(run), "--registry": str(registry),
                                                "--test-throughput": "linear",
                                                "--straggler-ratio": "1000"},   # a loaded host: no straggler cut
                              script_options={"--steps": "600", "--log-every": "50"})
    script = work / "job.sbatch"
    script.write_text(templates.render(templates.get("resnet50"), params))
    job_id = submit(script, ["--chdir", str(work)])

    def transition(action):
        path = run / "records.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return next((r for r in records if r["kind"] == "transition" and r["action"] == action), None)

    wait_until(lambda: transition("start"), 120, "the job's first step on 2 nodes")
    grow = wait_until(lambda: transition("grow"), 120, "a grow to 4 nodes")
    assert (grow["from_nodes"], grow["to_nodes"]) == (2, 4), grow
    assert slurm.job(int(grow["helper"])).name == f"elastic-helper-{job_id}"
    # Shrink only once the 4-worker epoch has logged a step (the example logs every 50 steps).
    wait_until(lambda: any("workers 4" in p.read_text() for p in run.glob("worker-*.log")), 180,
               "a logged step with 4 workers")
    ctl = subprocess.run([*LAUNCH, "ctl", str(job_id), "--registry", str(registry), "--nodes", "2"],
                         capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 0 and json.loads(ctl.stdout.splitlines()[-1])["ok"], ctl.stdout + ctl.stderr
    # an outer deadline against a hang: beside four busy loops the shrink took over 120 s (#46)
    shrink = wait_until(lambda: transition("shrink"), 600, "the shrink back to 2 nodes")
    assert shrink["to_nodes"] == 2 and shrink["left_cleanly"], shrink
    wait_until(lambda: slurm.job(job_id).state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"), 300,
               "the job to finish on two nodes")
    assert slurm.job(job_id).state == "COMPLETED"
    logs = {p.name: p.read_text() for p in run.glob("worker-*.log")}
    assert sum("left the job at step" in text for text in logs.values()) == 2, logs
    main = "\n".join(logs.values())
    assert "workers 4" in main and "done: 600 steps" in main, logs


ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


@dataclass
class _TimeLimited:
    """One template's two jobs of the time-limit test, and what the first left behind when it ended."""
    work: Path
    ck_rel: Path
    first: int
    first_state: str = ""             # Slurm's state once the job ended, "" if it had not
    latest: str | None = None         # checkpoints/<name>/latest after the first run, None if absent
    latest_saved: bool = False        # that checkpoint's .metadata was there
    second: int | None = None         # the resubmission (only after a first run that left a checkpoint)
    second_state: str = ""


def _await_end(slurm, jobs: dict[str, int], seconds: float) -> dict[str, str]:
    """Polls squeue until every job of `jobs` (template -> job id) has ended or `seconds` pass; returns each
    template's state then, "" for a job not ended (its test fails, naming it)."""
    deadline = time.monotonic() + seconds
    while True:
        listed = {job.job_id: job.state for job in slurm.jobs()}
        states = {name: listed.get(job_id, "") for name, job_id in jobs.items()}
        if all(state and state not in ACTIVE for state in states.values()) or time.monotonic() > deadline:
            return {name: "" if state in ACTIVE else state for name, state in states.items()}
        time.sleep(0.5)


def _logs(run: Path) -> str:
    return "\n".join(p.read_text() for p in run.glob("worker-*.log"))


@pytest.fixture(scope="module")
def time_limited(slurm, module_submit, module_idle_nodes, tmp_path_factory) -> dict[str, _TimeLimited]:
    """#45.1 for every template at once: each CPU variant on 2 nodes x 1 GPU (all of them fit the 4x4-GPU lab
    together) runs into a 1-minute time limit; then each one that left a checkpoint is submitted again on 1 node
    with --steps that checkpoint's step + 10, all of those at once too. Only waits and records; the test judges."""
    runs: dict[str, _TimeLimited] = {}

    def script(name: str, work: Path, ck_rel: Path, nodes: int, steps: int, time_limit: str, tag: str) -> Path:
        command = None
        if name == "wrap-train-py":
            command = [sys.executable, "-m", "elastic_launcher.examples.plain_train", "--steps", str(steps),
                       "--checkpoint-dir", str(ck_rel), "--checkpoint-every", "200", "--resume"]
        params = templates.Params(cpu_test=True, python=sys.executable, launcher=LAUNCH, command=command,
                                  sbatch={"time": time_limit, "nodes": str(nodes)},
                                  launcher_options={"--run-dir": str(work / f"run-{tag}")},
                                  script_options={} if command else {"--steps": str(steps),
                                                                     "--checkpoint-every": "10"})
        path = work / f"{tag}.sbatch"
        path.write_text(templates.render(templates.get(name), params))
        return path

    for name in NAMES:
        work = tmp_path_factory.mktemp(name)
        ck_rel = Path("checkpoints") / f"{name}-cpu-test"   # as the template writes it: in the submit directory
        first = module_submit(script(name, work, ck_rel, 2, 10 ** 7, "00:01:00", "first"), ["--chdir", str(work)])
        runs[name] = _TimeLimited(work, ck_rel, first)
    for name, state in _await_end(slurm, {n: r.first for n, r in runs.items()}, 300).items():
        run = runs[name]
        run.first_state = state
        ck = run.work / run.ck_rel
        run.latest = (ck / "latest").read_text().strip() if (ck / "latest").is_file() else None
        run.latest_saved = run.latest is not None and (ck / run.latest / ".metadata").is_file()
        saved = re.fullmatch(r"step-(\d+)", run.latest or "") if run.latest_saved else None
        if state == "TIMEOUT" and saved:
            step = int(saved[1])
            run.second = module_submit(script(name, run.work, run.ck_rel, 1, step + 10, "00:10:00", "again"),
                                       ["--chdir", str(run.work)])
    again = {n: r.second for n, r in runs.items() if r.second is not None}
    for name, state in _await_end(slurm, again, 240).items():
        runs[name].second_state = state
    return runs


@pytest.mark.timeout(600)   # the first one sets up the fixture: both rounds of every template's jobs
@pytest.mark.parametrize("name", NAMES)
def test_a_job_stopped_by_its_time_limit_continues_when_submitted_again(time_limited, name):
    """#45.1: each template's CPU variant on 2 nodes runs into a 1-minute time limit (state TIMEOUT) with
    checkpoints written; the same script submitted again on 1 node resumes from the latest checkpoint (the
    second run's --steps is that step + 10, so it ends) and saves at its end. The jobs of all templates run at
    once (`time_limited`)."""
    run = time_limited[name]
    work, ck_rel, latest = run.work, run.ck_rel, run.latest
    ck = work / ck_rel
    logs = _logs(work / "run-first")
    assert run.first_state == "TIMEOUT", \
        f"{name}: first job {run.first} ended {run.first_state or 'not'}\n" + logs[-3000:]
    assert latest is not None and latest.startswith("step-"), f"{name}: no checkpoints/latest\n" + logs[-3000:]
    step = int(latest.split("-")[1])
    assert step > 0 and run.latest_saved, f"{name}: {latest}\n" + logs[-3000:]
    # SIGTERM at the time limit: the ranks stop at the next commit point their vote agrees on and rank 0 saves it,
    # unless Slurm's KillWait (5 s on the lab) ends the step first on a busy host; then the latest checkpoint is an
    # earlier one (older than any stop point a rank printed: the stop's own save was cut short)
    plain = name in templates.PLAIN_SCRIPT   # elastic_launcher.examples.plain_train, under elastic-launch or torchrun
    if plain:
        every = 200 if name == "wrap-train-py" else 10
        assert f"stopped by SIGTERM after step {step}" in logs or step % every == 0, f"{name}\n" + logs[-3000:]
    else:
        stops = [int(s) for s in re.findall(r"stopped by SIGTERM after step (\d+)", logs)]
        said = f"checkpoint {ck_rel / latest} (step {step}): submit the job again with --resume"
        assert said in logs or all(step < s for s in stops), f"{name}\n" + logs[-3000:]

    logs = _logs(work / "run-again")
    assert run.second_state == "COMPLETED", \
        f"{name}: resubmitted job {run.second} ended {run.second_state or 'not'}\n" + logs[-3000:]
    if plain:
        assert f"resumed from step {step} on 1 ranks" in logs and f"done: {step + 10} steps on 1 ranks" in logs, \
            f"{name}\n" + logs
    else:
        assert f"resumed from {ck_rel / latest} (step {step})" in logs, f"{name}\n" + logs[-3000:]
        assert f"done: {step + 10} steps" in logs and (work / "models" / f"{name}-cpu-test" / ".metadata").is_file(), \
            f"{name}\n" + logs[-3000:]
        records = [json.loads(line) for line in (work / "run-again" / "records.jsonl").read_text().splitlines()]
        start = next(r for r in records if r["kind"] == "transition" and r["action"] == "start")
        assert start["world"] == 1, (name, start)
    assert (ck / "latest").read_text().strip() == f"step-{step + 10:08d}", name
