"""What the launcher's Slurm side does when slurmctld is away; no Slurm runs.

Fixtures (tests/unit/fixtures/slurm/): squeue_controller_down.json and sinfo_controller_down.json are what
22.05.8's `squeue --json` / `sinfo --json` print, with exit status 0, while the testbed's slurmctld is
killed: an `errors` list and no jobs or nodes. `scontrol show topology` also exits 0 then, with
`slurm_load_topo error: Unable to contact slurm controller (connect failure)` on stderr.
"""
import json
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from elastic_launcher import store_keys as keys
from elastic_launcher.helper_agent import HelperAgent
from elastic_launcher.release import SlurmChange, attempt_change
from slurm_plugin.client import CommandBackend, is_transient
from slurm_plugin.errors import JobNotFoundError, ResizeError, SlurmError

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
DOWN_STDERR = "slurm_load_topo error: Unable to contact slurm controller (connect failure)\n"


class ScriptedBackend(CommandBackend):
    """The real backend with `_run` answering from a script: {command prefix: [answers]}, each answer a
    (stdout, stderr) pair or a SlurmError to raise; the last answer repeats."""

    def __init__(self, answers):
        super().__init__(slurm_conf=Path("/nonexistent/slurm.conf"))
        self.answers = answers
        self.calls = []

    def _run(self, argv, timeout, stdin=None):
        self.calls.append(list(argv))
        key = next(k for k in self.answers if list(argv[:len(k)]) == list(k))
        queue = self.answers[key]
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, SlurmError):
            raise answer
        return subprocess.CompletedProcess(argv, 0, answer[0], answer[1])


def _fixture(name):
    return (FIXTURES / name).read_text()


def test_squeue_without_controller_is_an_error_not_an_empty_queue():
    backend = ScriptedBackend({("squeue",): [(_fixture("squeue_controller_down.json"), "")]})
    with pytest.raises(SlurmError, match="Failed while looking for jobs") as info:
        backend.job(1)  # before: JobNotFoundError, i.e. "the job is gone"
    assert is_transient(info.value)
    with pytest.raises(SlurmError):
        backend.jobs()


def test_sinfo_without_controller_is_an_error_not_an_empty_cluster():
    backend = ScriptedBackend({("sinfo",): [(_fixture("sinfo_controller_down.json"), "")],
                               ("scontrol", "show", "topology"): [("", DOWN_STDERR)]})
    with pytest.raises(SlurmError) as info:
        backend.nodes()
    assert is_transient(info.value)


def test_run_exit_zero_with_unreachable_controller_on_stderr_raises():
    argv = ["sh", "-c", f"printf '{DOWN_STDERR.strip()}' >&2; exit 0"]
    with pytest.raises(SlurmError, match="Unable to contact slurm controller") as info:
        CommandBackend()._run(argv, timedelta(seconds=5))
    assert info.value.rc == 0 and is_transient(info.value)


def test_transient_or_not():
    assert is_transient(SlurmError(["squeue"], None, "", "timed out after 20 s"))
    assert is_transient(SlurmError(["scontrol"], 1, "slurm_update error: Socket timed out on send/recv operation"))
    assert not is_transient(SlurmError(["srun"], None, "", "cannot run: No such file"))
    assert not is_transient(SlurmError(["scontrol"], 1, "slurm_update error: Invalid job id specified"))
    assert not is_transient(ResizeError(1, "it is COMPLETED"))
    assert not is_transient(JobNotFoundError(1))


def test_shrink_while_controller_restarts_raises_slurm_error_then_succeeds_on_retry():
    running = _fixture("squeue_3node.json")
    shrunk = json.loads(running)
    job = next(j for j in shrunk["jobs"] if j["job_id"] == 2)
    job["nodes"] = "node[1-2]"
    down = SlurmError(["scontrol", "update"], 1, "slurm_update error: Unable to contact slurm controller "
                                                 "(connect failure)")
    backend = ScriptedBackend({("squeue",): [(running, ""), (running, ""), (json.dumps(shrunk), "")],
                               ("scontrol", "update"): [down, ("", "")]})
    with pytest.raises(SlurmError) as info:  # not ResizeError: Slurm did not refuse, it was not there
        backend.shrink(2, ["node1", "node2"])
    assert not isinstance(info.value, ResizeError) and is_transient(info.value)
    done, failed = [], []
    change = SlurmChange("shrink", lambda: backend.shrink(2, ["node1", "node2"]), done.append, failed.append, (),
                         deadline=120.0, next_at=0.0)
    again = attempt_change(change, 0.0)          # the second scontrol update answers: one attempt, done
    assert again is None and not failed
    (result,) = done
    assert result.job.nodes == ("node1", "node2") and result.env["SLURM_NNODES"] == "2"
    assert [c for c in backend.calls if c[0] == "scontrol"] == [["scontrol", "update", "JobId=2",
                                                                  "NodeList=node[1-2]"]] * 2


def test_a_slurm_change_backs_off_until_success_or_its_deadline_and_stops_at_a_refusal():
    calls, done, failed = [], [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise SlurmError(["squeue"], 0, "", "errors in the JSON output: Failed while looking for jobs")
        return "ok"

    change = SlurmChange("flaky", flaky, done.append, failed.append, (), deadline=120.0, next_at=0.0)
    change = attempt_change(change, 0.0)
    assert (change.next_at, change.attempt) == (1.0, 2)           # each attempt one call; the next one scheduled
    change = attempt_change(change, 1.0)
    assert change.next_at == 3.0
    assert attempt_change(change, 3.0) is None and done == ["ok"] and len(calls) == 3

    def down():
        calls.append(1)
        raise SlurmError(["squeue"], None, "", "timed out after 1 s")

    calls.clear()
    change, nows = SlurmChange("down", down, done.append, failed.append, (), deadline=30.0, next_at=0.0), []
    while change is not None:
        nows.append(change.next_at)
        change = attempt_change(change, change.next_at)
    assert nows == [0.0, 1.0, 3.0, 7.0, 15.0, 25.0, 30.0]             # 1, 2, 4, 8, then 10 s, cut at the deadline
    assert len(failed) == 1 and "timed out" in str(failed[0])

    def refused():
        calls.append(1)
        raise SlurmError(["scontrol"], 1, "Invalid job id specified")

    calls.clear()
    assert attempt_change(SlurmChange("refused", refused, done.append, failed.append, (), 120.0, 0.0), 0.0) is None
    assert len(calls) == 1 and "Invalid job id" in str(failed[-1])


class _Step:
    def alive(self):
        return True

    def returncode(self):
        return None


class _Pool:
    def __init__(self):
        self.steps, self.stopped = {}, False

    def start(self, node, slots, env, owner_job):
        self.steps[node] = _Step()

    def running(self):
        return [] if self.stopped else list(self.steps.values())

    def wait_ended(self, nodes, timeout):
        return []

    def stop_all(self):
        self.stopped = True


class _Store:
    """The controller's store as the agent sees it; the heartbeat moves on every read while `beating`."""

    def __init__(self):
        self.data, self.beating, self.lock = {keys.CONTROLLER_BEAT: b"1"}, True, threading.Lock()

    def check(self, names):
        return all(k in self.data for k in names)

    def get(self, key):
        with self.lock:
            if key == keys.CONTROLLER_BEAT and self.beating:
                self.data[key] = str(int(self.data[key]) + 1).encode()
            return self.data[key]

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value


def _agent(store, main_running):
    return HelperAgent("7", "3", ["node3"], 1, {}, _Pool(), connect=lambda: store, main_job_running=main_running,
                       orphan_timeout=timedelta(seconds=30), poll_interval=timedelta(seconds=0.01),
                       main_check_interval=timedelta(seconds=0.05), beat_grace=timedelta(seconds=0.02))


def test_helper_keeps_running_while_slurm_is_unreachable_but_the_controller_beats():
    """A main-job check that says "not running" (Slurm's answer may be wrong while it restarts) loses to a
    beating controller."""
    store, checks = _Store(), []

    def main_running():
        checks.append(1)
        if len(checks) == 6:
            store.set(keys.helper_stop("7"), "test over")
        return False

    assert _agent(store, main_running).run() == "controller asked to stop (test over)"
    assert len(checks) >= 6


def test_helper_ends_when_the_main_job_is_gone_and_the_controller_is_silent():
    store = _Store()
    store.beating = False
    assert _agent(store, lambda: False).run() == "main job 3 is no longer running"
