"""Restart mode on the testbed (#43): an unchanged torchrun script with DCP checkpoints, under torchrun's elastic
agent, real sbatch, CPU gloo: grown 1 -> 2 -> 4 nodes by helper jobs and shrunk back to 2 with `elastic-launch ctl`;
and grown 1 -> 2 -> 4 by the lab's real `elastic-predictor serve` as nodes free, shrunk for a waiting job.

The job imports this checkout (PYTHONPATH set in its script), so the launcher code under test is what runs.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from slurm_plugin.lab.demo_services import PredictorService

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step (\d+)/\d+\s+world (\d+)\s+loss ([0-9.]+)$", re.M)


def _job(work: Path, steps: int, *script_options: str, every: int = 50, autoscale: bool = False,
         predictor: str = "", directives: str = "gpus=1-4 mode=restart", env: dict | None = None) -> Path:
    script = work / "job.sbatch"
    train = [sys.executable, "-m", "elastic_launcher.examples.plain_train", "--steps", str(steps), "--checkpoint-dir",
             "ck", "--checkpoint-every", str(every), "--resume", "--log-every", "1", "--step-s", "0.1", *script_options]
    launch = [sys.executable, "-m", "elastic_launcher.cli", "--script", "$0", "--workers-per-node", "1", "--run-dir",
              "run", "--registry", "reg", "--checkpoint-dir", "ck", "--checkpoint-timeout", "8",
              *([] if autoscale else ["--no-autoscale"]), *(["--predictor", predictor] if predictor else [])]
    script.write_text("\n".join([
        "#!/bin/bash", "#SBATCH --job-name=restart-test", "#SBATCH --nodes=1", "#SBATCH --time=00:10:00",
        "#SBATCH --output=%x-%j.out", "#SBATCH --no-kill", f"#ELASTIC {directives}",
        f"export PYTHONPATH={shlex.quote(str(ROOT))}",
        *(f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()),
        " ".join(shlex.quote(a) if a != "$0" else '"$0"' for a in launch) + " -- " + shlex.join(train)]) + "\n")
    return script


def _records(work: Path) -> list[dict]:
    path = work / "run" / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _transitions(work: Path) -> list[dict]:
    return [r for r in _records(work) if r["kind"] == "transition"]


def _logs(work: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((work / "run").glob("worker-*.log")))


def _resumed(logs: str) -> list[tuple[int, int]]:
    """`(step, world)` of each restart, in the order they happened: the logs are concatenated by file (rank 0's node
    changes with the restarts), and each restart resumes from a later checkpoint than the one before."""
    return sorted((int(s), int(w)) for s, w in re.findall(r"^resumed from step (\d+) on (\d+) ranks$", logs, re.M))


def _resize(work: Path, job: int, nodes: int, wait_until, done: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "elastic_launcher.cli", "ctl", str(job), "--nodes", str(nodes),
                          "--registry", str(work / "reg")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"], out.stdout + out.stderr
    wait_until(lambda: len(_transitions(work)) > done or any(r["kind"] == "resize_failed" for r in _records(work)),
               180, f"the restart to {nodes} nodes")
    moved = _transitions(work)[done]
    assert moved["to_nodes"] == nodes and moved["world"] == nodes, (moved, _logs(work)[-3000:])
    return moved


def _moved(work: Path, wait_until, count: int, seconds: float, what: str) -> None:
    """Waits until `count` resizes ended (or one failed); failing, shows the job's records since its start."""
    try:
        wait_until(lambda: len(_transitions(work)) >= count or any(r["kind"] == "resize_failed"
                                                                    for r in _records(work)), seconds, what)
    except pytest.fail.Exception:
        pytest.fail(f"timed out after {seconds:g} s waiting for {what}; the job's records:\n" +
                    "\n".join(json.dumps(r)[:400] for r in _records(work) if r["kind"] != "start"))


def _started(work: Path, wait_until, at_least: int = 20) -> None:
    wait_until(lambda: any(int(s) >= at_least for s, _, _ in STEP.findall(_logs(work))) if (work / "run").exists()
               else False, 120, f"step {at_least}")


def test_an_unchanged_torchrun_script_grows_1_2_4_and_shrinks_by_restarting(slurm, submit, idle_nodes, wait_until,
                                                                            tmp_path):
    work = Path(tmp_path)
    job = submit(_job(work, 100000), ["--chdir", str(work)])
    _started(work, wait_until)
    moves = [_resize(work, job, n, wait_until, i) for i, n in enumerate((2, 4, 2))]
    assert all(m["checkpointed"] and m["cost_s"] > 0 for m in moves), moves
    slurm.cancel(job)
    logs = _logs(work)
    # every resize: SIGUSR1's checkpoint, then a restart from a checkpoint no older than it: nothing trained before
    # the signal's checkpoint is trained again
    signalled = [int(s) for s in re.findall(r"^checkpoint at step (\d+) \(SIGUSR1\)$", logs, re.M)]
    resumed = _resumed(logs)
    assert len(signalled) >= 3 and [w for _, w in resumed] == [2, 4, 2], (signalled, resumed)
    for (step, _), before in zip(resumed, sorted(signalled)):
        assert step >= before and (work / "ck" / f"step-{step:08d}" / ".metadata").is_file(), (step, before)
    # the loss goes on from where it was: no restart begins from the initial weights (loss ~9 at step 1)
    steps = [(int(s), int(w), float(l)) for s, w, l in STEP.findall(logs)]
    assert {w for _, w, _ in steps} == {1, 2, 4}
    assert max(l for s, _, l in steps if s > resumed[0][0]) < 0.5, "the loss jumped back after a restart"
    records = _records(work)
    assert [r["nodes"] for r in records if r["kind"] == "helper_submitted"] == [1, 2]
    assert sum(r["kind"] == "helper_ended" for r in records) >= 1


def test_a_script_that_ignores_sigusr1_resumes_from_its_last_checkpoint(slurm, submit, idle_nodes, wait_until,
                                                                        tmp_path):
    work = Path(tmp_path)
    job = submit(_job(work, 100000, "--ignore-sigusr1", every=200), ["--chdir", str(work)])
    # signalled just past step 200's checkpoint: the 8 s grace (80 steps at most) ends before step 400's
    _started(work, wait_until, at_least=201)
    moved = _resize(work, job, 2, wait_until, 0)
    slurm.cancel(job)
    assert moved["checkpointed"] is False and moved["cost_s"] >= 8, moved   # the whole grace period, then the change
    logs = _logs(work)
    assert "(SIGUSR1)" not in logs
    (step, world), = _resumed(logs)
    assert world == 2 and step >= 200 and (work / "ck" / f"step-{step:08d}" / ".metadata").is_file()


PROFILE = {"name": "plain-linear", "tensors": [{"name": "module.weight", "numel": 8, "dtype": "float32"},
                                               {"name": "module.bias", "numel": 1, "dtype": "float32"}]}
PLANNED = "model=plain-linear gpus=1-4 per_gpu_batch=16 min_efficiency=0.3 mode=restart"


@pytest.fixture
def service(testbed):
    """The lab's `elastic-predictor serve` (slurm_plugin/lab/demo_services.py: munge-signed job writes, the lab's
    cluster of one CPU worker per node), fresh, with plain_train's model and its step history: 0.1 s a step at 1-4
    nodes (as `--step-s 0.1` runs), so the planner plans it on 4 nodes."""
    server = PredictorService(testbed, timeout=timedelta(seconds=60))
    server.start(fresh=True)
    try:
        server.post("/v1/profiles", PROFILE)
        part = server.cluster()["partitions"][0]
        server.post("/v1/observations", [
            {"kind": "step", "profile": PROFILE["name"], "gpu": part["gpu"], "layout": [1] * n, "per_gpu_batch": 16,
             "intra_link": part["intra_link"], **({"inter_link": part["inter_link"]} if n > 1 else {}),
             "iter_s": 0.1 * (1 + 0.02 * (n - 1) + 0.01 * rep)} for n in (1, 2, 3, 4) for rep in range(2)])
        probe = {"source": "cli", "directives": [f"#ELASTIC {PLANNED}"], "job": {"partition": part["name"]}}
        deadline = time.monotonic() + 120
        while server.post("/v1/plan", probe).get("nodes") != 4:   # the first fit runs in the background
            if time.monotonic() > deadline:
                pytest.fail(f"the lab's service never planned 4 nodes: {server.post('/v1/plan', probe)}")
            time.sleep(0.5)
        yield server
    finally:
        server.stop()


def test_the_planner_grows_the_job_1_2_4_as_nodes_free_and_a_waiting_job_gets_them_back(
        slurm, submit, idle_nodes, wait_until, tmp_path, testbed, service):
    """The real service plans plain_train on 4 nodes; the launcher grows to what is free: 2 while another job holds
    two nodes, 4 once it ends, each restart priced by the planner (it pays back over the job's 10 minutes). A job
    of the partition pending for a node gets the newest helper's nodes back. Each restart's measured cost is
    posted to the service, signed by the job."""
    work = Path(tmp_path)
    blocker = work / "blocker.sbatch"
    blocker.write_text("#!/bin/bash\n#SBATCH --nodes=2 --exclusive\n#SBATCH --time=00:10:00\n"
                       "#SBATCH --output=/dev/null\nsleep 600\n")
    held = submit(blocker, ["--chdir", str(work)])
    wait_until(lambda: slurm.job(held).state == "RUNNING", 60, "the blocker to run")
    job = submit(_job(work, 100000, autoscale=True, predictor=service.url, directives=PLANNED,
                      env={"ELASTIC_MUNGE_SOCKET": str(testbed.config.munge_socket)}), ["--chdir", str(work)])
    _moved(work, wait_until, 1, 240, "the first planned grow")
    slurm.cancel(held)
    _moved(work, wait_until, 2, 240, "the grow to 4 nodes")
    other = work / "other.sbatch"
    # a whole node (the lab's nodes are shared by CPU): it waits until the restart job hands one back
    other.write_text("#!/bin/bash\n#SBATCH --nodes=1 --exclusive\n#SBATCH --time=00:02:00\n#SBATCH --output=/dev/null\n"
                     "sleep 5\n")
    waiting = submit(other, ["--chdir", str(work)])
    _moved(work, wait_until, 3, 180, "the hand-back")
    wait_until(lambda: slurm.job(waiting).state in ("RUNNING", "COMPLETING", "COMPLETED"), 60, "the waiting job to run")
    moves = _transitions(work)[:3]
    _started(work, wait_until, at_least=moves[2]["step"] + 5)   # the loss at 2 nodes again
    slurm.cancel(job)
    records = _records(work)
    assert [(m["action"], m["from_nodes"], m["to_nodes"], m["world"]) for m in moves] == [
        ("plan", 1, 2, 2), ("plan", 2, 4, 4), ("yield", 4, 2, 2)], (moves, _logs(work)[-3000:])
    assert all(m["checkpointed"] and m["cost_s"] > 0 and m["posted"] for m in moves), moves
    # each grow is what the planner answered, 4 nodes capped to the nodes free, its restart priced: the first with
    # the default cost, the second with the first's measured cost
    assert all(m["reason"].startswith("elastic: 4 nodes") and "restart pays back" in m["reason"] for m in moves[:2])
    assert "s restart (the default: none measured yet)" in moves[0]["reason"], moves[0]
    assert f"in a {moves[0]['cost_s']:.1f} s restart (this job's last restart)" in moves[1]["reason"], moves
    for move in moves[:2]:
        plan = next(r for r in records if r["kind"] == "plan" and r["reason"] == move["reason"])
        stored = service.get(f"/v1/decisions/{plan['decision_id']}")
        assert stored["source"] == "launcher" and stored["response"]["reason"] == move["reason"]
        assert stored["request"]["current"]["layout"] == [1] * move["from_nodes"]
    decision = [r for r in records if r["kind"] == "decision" and r["source"] == "yield"][0]
    assert f"pending job {waiting}" in decision["reason"]
    # the measured costs reached the service, signed by the job: they price the next restart job's first resize
    assert service.get("/v1/observations")["counts"].get("restart", 0) >= 3
    # no step trained before a resize's checkpoint is trained again; the loss goes on across every restart
    logs = _logs(work)
    signalled = sorted(int(s) for s in re.findall(r"^checkpoint at step (\d+) \(SIGUSR1\)$", logs, re.M))
    resumed = _resumed(logs)
    assert [w for _, w in resumed[:3]] == [2, 4, 2], resumed
    for (step, _), before in zip(resumed[:3], signalled):
        assert step >= before and (work / "ck" / f"step-{step:08d}" / ".metadata").is_file(), (step, before)
    loss = {(int(s), int(w)): float(l) for s, w, l in STEP.findall(logs)}
    worlds = [1] + [w for _, w in resumed[:3]]
    for (step, world), was in zip(resumed[:3], worlds):
        before = [loss[s, was] for s in range(step - 4, step + 1) if (s, was) in loss]
        after = [loss[s, world] for s in range(step + 1, step + 6)]
        # from the initial weights the loss is tens (step 1: 9-90); resumed, it is where it was
        assert sum(after) / 5 <= 3 * sum(before) / len(before) + 0.1, ("the loss jumped back", step, before, after)
