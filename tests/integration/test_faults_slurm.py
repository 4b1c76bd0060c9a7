"""Fault injection (issue 8, part 4, Slurm half): Slurm's own daemons die under a running elastic job.

The suite's faults and where each is tested:
- slurmctld crashes (SIGKILL) while the launcher is about to shrink the job with `scontrol` and restarts:
  `test_slurmctld_crash_during_a_shrink` here. The launcher's Slurm calls fail (squeue/scontrol cannot
  reach the controller), are retried with backoff (each bounded by its command timeout), and succeed once
  the controller is back; the job finishes its steps with exact accounting.
- slurmctld crashes while the job is grown with a helper job: `test_slurmctld_crash_keeps_the_helper`.
  The helper's agent cannot see the main job in Slurm during the outage, but the controller's heartbeat
  moves, so it carries on; the job keeps its 4 nodes and finishes.
- one node dies (its slurmd, slurmstepd and workers SIGKILLed): `test_node_death_shrinks_the_job` here.
  The survivors evict the dead ranks, the launcher releases the node with `client.shrink` and finishes on
  the rest; afterwards the node is revived (slurmd restarted, resumed) so later tests find 4 idle nodes.
- worker processes SIGKILLed (slurmd alive): step 3 of
  `test_launcher_e2e.py::test_grow_operator_shrink_node_failure_and_exact_accounting` (not repeated here).
- the prediction service killed during a submission storm: `test_faults_service.py`.

Both tests submit with `--no-kill`: without it slurmctld cancels the whole job when it marks a dead node
DOWN (SlurmdTimeout), which an elastic job must survive. Each test leaves slurmctld running and the four
nodes idle, also when it fails (the fault is undone in `finally`).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from slurm_plugin.errors import SlurmError
from tests.integration.test_launcher_e2e import (_batch_script, _check_accounting, _ctl, _job_processes, _records,
                                                 _transition)

STEPS = 300


def _answers(slurm) -> bool:
    try:
        slurm.jobs()
        return True
    except SlurmError:
        return False


def _all_idle(slurm):
    try:
        nodes = slurm.nodes()
    except SlurmError:
        return None
    return nodes if all(n.state == "idle" for n in nodes) else None


def _tasks_on(job_id: int, node: str) -> list[int]:
    """The job's worker tasks that Slurm runs on `node` (not the sruns on the batch host that started them)."""
    return [pid for pid in _job_processes(job_id, node)
            if f"SLURMD_NODENAME={node}".encode() in _environ(pid)]


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _out(work: Path) -> str:
    path = work / "job.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _settled(testbed, slurm, wait_until, job_id: int) -> None:
    """Leave the cluster as found: no stepd of the job left (one whose step ended during the outage retries
    its completion message every 60 s; killing slurmctld again before that drains its node with "Kill task
    failed"), slurmctld running, every node idle."""
    wait_until(lambda: not testbed.stepds(job_id=job_id), 120, f"no slurmstepd of job {job_id} left")
    assert next(s for s in testbed.status() if s.name == "slurmctld").running
    wait_until(lambda: _all_idle(slurm), 90, "all nodes idle")
    reasons = subprocess.run(["sinfo", "-h", "-N", "-R", "-o", "%N|%E"], env={**os.environ, **testbed.env()},
                             capture_output=True, text=True, timeout=20, check=True).stdout
    assert not reasons.strip(), f"nodes drained or down: {reasons}"


def _finish(slurm, wait_until, work: Path, job_id: int) -> dict:
    """Wait for the job to end; it must have completed; return the launcher's summary."""
    wait_until(lambda: _answers(slurm) and slurm.job(job_id).state not in ("RUNNING", "COMPLETING"), 150,
               "the job to finish")
    assert slurm.job(job_id).state == "COMPLETED", _out(work)[-3000:]
    summary = json.loads(_out(work).strip().splitlines()[-1])
    assert summary["outcome"] == "completed"
    return summary


def test_slurmctld_crash_during_a_shrink(slurm, testbed, idle_nodes, wait_until, submit, tmp_path):
    work = Path(tmp_path)
    registry, run = work / "registry", work / "run"
    job_id = submit(_batch_script(work, registry, STEPS, extra_launch="--no-autoscale", sbatch="--no-kill"))
    wait_until(lambda: _transition(run, "start"), 120, "the job's first step on 2 nodes")
    wait_until(lambda: any(r["kind"] == "measurement" for r in _records(run)), 60, "a first measurement")
    testbed.save_job_state(job_id)

    testbed.stop_controller(kill=True)
    killed_at = time.monotonic()
    try:
        # the operator's request goes through the job's store, not Slurm: answered while slurmctld is down
        reply = _ctl(registry, job_id, "--nodes", "1")
        assert reply["ok"] and reply["target_nodes"] == 1
        # node2's workers leave at a commit point, then the launcher's shrink fails against the dead
        # controller and is retried with backoff (twice at least before it comes back)
        wait_until(lambda: "shrink job" in _out(work) and "attempt 2 failed" in _out(work), 90,
                   "the launcher's shrink to fail twice while slurmctld is down")
        assert not any(r["kind"] == "slurm_shrink" for r in _records(run))
        down_s = time.monotonic() - killed_at
    finally:
        testbed.start_controller()

    shrink = wait_until(lambda: _transition(run, "shrink"), 120, "the shrink to complete after the restart")
    assert (shrink["from_nodes"], shrink["to_nodes"], shrink["left_cleanly"]) == (2, 1, True)
    released = next(r for r in _records(run) if r["kind"] == "slurm_shrink")
    assert released["job"] == str(job_id) and released["nodelist"] == "node1"
    assert "shrink job" in _out(work) and "succeeded at attempt" in _out(work)
    assert not any(r["kind"] in ("slurm_shrink_failed", "transition_failed", "failure") for r in _records(run))
    assert slurm.job(job_id).nodes == ("node1",)

    _finish(slurm, wait_until, work, job_id)
    committed = _check_accounting(work / "samples", STEPS)
    assert committed > STEPS * 4  # some steps ran on 2 workers before the shrink
    wait_until(lambda: not _job_processes(job_id), 30, "no worker process of the job")
    _settled(testbed, slurm, wait_until, job_id)
    print(f"slurmctld down {down_s:.1f} s; shrink wall {shrink['wall_s']} s, release {shrink['release_s']} s")


def _live_status(registry: Path, job_id: int) -> dict | None:
    """`ctl --status` of the job's launcher, or None where the launcher has ended (its registry entry gone)."""
    try:
        return _ctl(registry, job_id, "--status")
    except AssertionError:
        if (registry / f"{job_id}.json").exists():
            raise
        return None


def test_slurmctld_crash_keeps_the_helper(slurm, testbed, idle_nodes, wait_until, submit, tmp_path):
    work = Path(tmp_path)
    registry, run = work / "registry", work / "run"
    job_id = submit(_batch_script(work, registry, STEPS, extra_launch="--no-autoscale", sbatch="--no-kill"))
    wait_until(lambda: _transition(run, "start"), 120, "the job's first step on 2 nodes")
    assert _ctl(registry, job_id, "--nodes", "4")["ok"]
    grow = wait_until(lambda: _transition(run, "grow"), 120, "the operator grow to 4 nodes")
    assert (grow["from_nodes"], grow["to_nodes"], grow["world"]) == (2, 4, 4)
    helper_out = run / f"helper-{grow['helper']}.out"
    # the helper started a moment ago: a crash before slurmctld writes its state would lose the helper job
    # itself (CI saw it vanish from squeue after the restart), which is Slurm's loss, not the agent's
    testbed.save_job_state(int(grow["helper"]))

    testbed.stop_controller(kill=True)
    try:  # the agent checks the main job in Slurm every 5 s: let it fail at least twice
        # either its Slurm check failed ("cannot ask Slurm ... Slurm unreachable") or Slurm said "not running"
        # while the controller beat ("Slurm unreachable? carrying on"): both keep the helper
        wait_until(lambda: helper_out.exists() and helper_out.read_text().count("Slurm unreachable") >= 2, 60,
                   "the helper agent to find Slurm unreachable twice")
    finally:
        testbed.start_controller()
    assert slurm.job(int(grow["helper"])).state == "RUNNING"
    status = _live_status(registry, job_id)  # None: on a loaded host the job finished its steps in the outage
    assert status is None or status["world"] == 4

    summary = _finish(slurm, wait_until, work, job_id)
    assert summary["final_nodes"] == 4
    kinds = [r["kind"] for r in _records(run)]
    assert "failure" not in kinds and "transition_failed" not in kinds
    assert [r["action"] for r in _records(run) if r["kind"] == "transition"][-1] == "grow"  # nothing shrank it
    _check_accounting(work / "samples", STEPS)
    wait_until(lambda: slurm.job(int(grow["helper"])).state not in ("RUNNING", "COMPLETING"), 60,
               "the helper to end with the job")
    wait_until(lambda: not _job_processes(job_id), 30, "no worker process of the job")
    _settled(testbed, slurm, wait_until, job_id)


def test_node_death_shrinks_the_job(slurm, testbed, idle_nodes, wait_until, submit, tmp_path):
    work = Path(tmp_path)
    run = work / "run"
    job_id = submit(_batch_script(work, work / "registry", STEPS, extra_launch="--no-autoscale",
                                  sbatch="--no-kill"))
    wait_until(lambda: _transition(run, "start"), 120, "the job's first step on 2 nodes")
    wait_until(lambda: any(r["kind"] == "measurement" for r in _records(run)), 60, "a first measurement")
    assert slurm.job(job_id).nodes == ("node1", "node2")
    workers = _tasks_on(job_id, "node2")
    assert workers, "node2 runs no worker of the job"

    try:
        victims = testbed.kill_node("node2")
        assert set(workers) <= set(victims) and not _tasks_on(job_id, "node2")
        failure = wait_until(lambda: _transition(run, "failure"), 120, "recovery from the death of node2")
        assert failure["recovered"] and (failure["from_nodes"], failure["to_nodes"]) == (2, 1)
        assert any(r["kind"] == "slurm_shrink" and r["nodelist"] == "node1" for r in _records(run))
        assert slurm.job(job_id).nodes == ("node1",)
        _finish(slurm, wait_until, work, job_id)
    finally:
        state = testbed.revive_node("node2")
    assert state in ("idle", "mixed", "allocated")
    committed = _check_accounting(work / "samples", STEPS)
    assert committed > STEPS * 4  # some steps ran on 2 workers before the failure
    wait_until(lambda: not _job_processes(job_id), 30, "no worker process of the job")
    _settled(testbed, slurm, wait_until, job_id)
