"""Restart mode's pure decisions and helpers (#43): restart_ops.advance, the torchrun command, the step watch and
the SIGUSR1 relay's process lookup."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from elastic_launcher.restart import StepWatch, newest_mtime
from elastic_launcher.restart_node import children
from elastic_launcher.restart_ops import (RestartAction, RestartLimits, RestartObservation, RestartOp, RestartState,
                                          advance, node_range, step_lines, torchrun_argv)

LIMITS = RestartLimits(checkpoint_timeout=timedelta(seconds=30), change_timeout=timedelta(seconds=100))


def grow(**changes) -> RestartOp:
    return RestartOp(grow=True, target=2, world=2, from_nodes=1, action="operator", reason="r", signalled=10.0,
                     **changes)


def test_the_change_waits_for_a_checkpoint_newer_than_the_signal():
    op, actions = advance(grow(), RestartObservation(checkpoint_at=9.0), now=12.0, limits=LIMITS)
    assert op.state is RestartState.CHECKPOINT and actions == []   # an older checkpoint is not the one asked for
    op, actions = advance(op, RestartObservation(checkpoint_at=11.5), now=12.0, limits=LIMITS)
    assert op.state is RestartState.CHANGING and op.checkpointed is True and op.changed == 12.0
    assert actions == [RestartAction.CHANGE]


def test_a_script_that_ignores_the_signal_is_changed_after_the_grace_period():
    op, actions = advance(grow(), RestartObservation(), now=39.9, limits=LIMITS)
    assert actions == []
    op, actions = advance(op, RestartObservation(checkpoint_at=5.0), now=40.0, limits=LIMITS)
    assert op.state is RestartState.CHANGING and op.checkpointed is False and actions == [RestartAction.CHANGE]


def test_done_at_the_first_step_of_the_target_world_and_the_cost_runs_from_the_signal():
    changing = grow(state=RestartState.CHANGING, changed=20.0, helper="7")
    op, actions = advance(changing, RestartObservation(world=1), now=25.0, limits=LIMITS)
    assert op.state is RestartState.CHANGING and actions == []   # still the old size
    op, actions = advance(op, RestartObservation(world=2), now=31.25, limits=LIMITS)
    assert op.state is RestartState.DONE and op.cost_s == pytest.approx(21.25) and actions == [RestartAction.RECORD]


@pytest.mark.parametrize("obs, now, error", [
    (RestartObservation(world=1, helper_ended=True), 25.0, "helper job 7 ended"),
    (RestartObservation(world=1), 120.0, "no step at world size 2 within 100 s"),
])
def test_a_grow_fails_when_its_helper_ends_or_no_step_comes(obs, now, error):
    op, actions = advance(grow(state=RestartState.CHANGING, changed=20.0, helper="7"), obs, now=now, limits=LIMITS)
    assert op.state is RestartState.FAILED and error in op.error and actions == [RestartAction.FAIL]


def test_limits_refuse_a_non_positive_wait():
    with pytest.raises(ValueError, match="checkpoint_timeout"):
        RestartLimits(checkpoint_timeout=timedelta(0))


@pytest.mark.parametrize("low, high, slots, expect", [(1, 4, 1, (1, 4)), (4, 16, 4, (1, 4)), (6, 16, 4, (2, 4)),
                                                      (4, 5, 4, (1, 1))])
def test_node_range_is_whole_nodes_within_the_gpu_bounds(low, high, slots, expect):
    assert node_range(low, high, slots) == expect


def test_torchrun_command_puts_the_rendezvous_on_the_launcher_store():
    argv = torchrun_argv("py", ["python", "train.py", "--resume"], "host:29", "elastic-5", (1, 4), 2,
                         timedelta(seconds=3), 100)
    assert argv[:4] == ["py", "-m", "elastic_launcher.restart_node", "--"]
    assert {"--nnodes=1:4", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=host:29",
            "--rdzv-id=elastic-5", "--max-restarts=100", "--no-python"} <= set(argv)
    conf = next(a for a in argv if a.startswith("--rdzv-conf="))
    assert "is_host=false" in conf and "last_call_timeout=3" in conf
    assert argv[-3:] == ["python", "train.py", "--resume"]


def test_step_lines_are_read_in_order():
    text = b"resumed\nstep 9/50  world 1  loss 0.3\nnoise\nstep 10/50  world 2  loss 0.2\n"
    assert step_lines(text) == [(9, 1), (10, 2)] and step_lines(b"no steps here\n") == []


def test_step_watch_reads_whole_lines_across_polls_and_measures_steps_per_second(tmp_path):
    now = [0.0]
    watch = StepWatch(tmp_path, clock=lambda: now[0])
    log = tmp_path / "worker-a.log"
    log.write_bytes(b"step 1/9 world 1 loss 1\nstep 2/9 wor")   # a line still being written is not read
    assert watch.poll() == (1, 1)
    for step in range(2, 12):
        now[0] += 0.5
        with open(log, "ab") as f:
            f.write(b"ld 1 loss 1\n" if step == 2 else f"step {step}/99 world 1 loss 1\n".encode())
        watch.poll()
    assert watch.last == (11, 1) and watch.steps_per_s() == pytest.approx(2.0)
    (tmp_path / "worker-b.log").write_bytes(b"step 8/99 world 2 loss 1\nstep 9/99 world 2 loss 1\n")
    assert watch.poll() == (9, 2) and watch.steps_per_s() is None   # a new size starts a new reading
    assert watch.before == (11, 1) and watch.seen[0][1] == 8   # the old size's last step, the new one's first


def test_newest_mtime_of_a_directory(tmp_path):
    assert newest_mtime(tmp_path / "absent") is None and newest_mtime(tmp_path) is None
    (tmp_path / "latest").write_text("step-1\n")
    assert newest_mtime(tmp_path) == pytest.approx((tmp_path / "latest").stat().st_mtime)


@pytest.mark.slow   # processes
def test_the_relay_finds_the_agents_children():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                               "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while not children(parent.pid) and time.monotonic() < deadline:   # a hang turns into a failure
            time.sleep(0.05)
        kids = children(parent.pid)
        assert len(kids) == 1 and kids[0] != parent.pid
        os.kill(kids[0], signal.SIGTERM)
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.slow   # processes
def test_the_node_step_relays_sigusr1_to_the_workers_and_the_agent_survives_it(tmp_path):
    """restart_node: SIGUSR1 (what Slurm may deliver to every process of the step) reaches the worker's handler
    once relayed, the agent ignores it, and the step's exit status is the agent's."""
    worker = ("import signal, sys, time; from pathlib import Path; "
              f"signal.signal(signal.SIGUSR1, lambda *_: Path({str(tmp_path / 'got')!r}).write_text('usr1')); "
              f"Path({str(tmp_path / 'ready')!r}).write_text(''); time.sleep(30)")
    agent = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
             "p.wait(); sys.exit(7)")
    node = subprocess.Popen([sys.executable, "-m", "elastic_launcher.restart_node", "--", sys.executable, "-c", agent])
    try:
        deadline = time.monotonic() + 30   # a hang turns into a failure
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (agent_pid,) = children(node.pid)
        os.kill(agent_pid, signal.SIGUSR1)   # as Slurm may: to the agent itself, which must not die of it
        node.send_signal(signal.SIGUSR1)
        while not (tmp_path / "got").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "got").read_text() == "usr1" and node.poll() is None
        (worker_pid,) = children(agent_pid)
        os.kill(worker_pid, signal.SIGTERM)
        assert node.wait(timeout=30) == 7
    finally:
        node.kill()
        node.wait()
