"""The testbed itself: shape of the cluster, idempotent `up`, the CLI, and a second lab that fails,
recovers and stops without touching the first one."""
import os
import shutil
import signal
import socket
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_plugin.cli import main
from slurm_plugin.errors import TestbedError
from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.testbed_conf import PORT_SPAN, TestbedConfig


def test_four_nodes_with_four_gpus_under_two_leaf_switches(testbed, slurm):
    nodes = slurm.nodes()
    assert [n.name for n in nodes] == ["node1", "node2", "node3", "node4"]
    assert all(n.gpus == 4 for n in nodes)
    assert [n.switch for n in nodes] == ["leaf1", "leaf1", "leaf2", "leaf2"]
    parts = {p.name: p for p in slurm.partitions()}
    assert parts["debug"].default and parts["debug"].nodes == tuple(n.name for n in nodes)
    # one partition per GPU type, one leaf each, not default
    assert {name: p.nodes for name, p in parts.items() if not p.default} == {
        "h100": ("node1", "node2"), "a100": ("node3", "node4")}
    # sinfo itself, as a user would run it after `eval "$(elastic-slurm testbed env)"`.
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %G"],
                         env=testbed.env(path="/usr/bin:/bin"),
                         capture_output=True, text=True, timeout=10, check=True).stdout
    assert sorted(out.split("\n")[:-1]) == [f"node{i} gpu:{'h100' if i < 3 else 'a100'}:4" for i in range(1, 5)]


def test_untyped_requests_run_anywhere_and_a_typed_one_only_on_its_type(testbed, slurm, idle_nodes):
    env = testbed.env(path="/usr/bin:/bin")

    def srun(*args):
        return subprocess.run(["srun", *args, "bash", "-c", "echo $SLURMD_NODENAME"], env=env, capture_output=True,
                              text=True, timeout=60)

    every = srun("-N4", "--gres=gpu:4")
    assert every.returncode == 0 and sorted(every.stdout.split()) == ["node1", "node2", "node3", "node4"]
    typed = srun("-p", "a100", "-N2", "--gres=gpu:a100:2")
    assert typed.returncode == 0 and sorted(typed.stdout.split()) == ["node3", "node4"]
    wrong = srun("-p", "h100", "--gres=gpu:a100:1")
    assert wrong.returncode != 0 and "Requested node configuration is not available" in wrong.stderr


def test_untyped_lab_config_is_the_plain_recipe(tmp_path):
    from slurm_plugin.lab import testbed_conf

    cfg = TestbedConfig(lab=tmp_path, gpu_types=())
    assert all(ln.startswith("Name=gpu File=") for ln in testbed_conf.gres_conf(cfg).splitlines())
    conf = testbed_conf.slurm_conf(cfg, [])
    assert "Gres=gpu:4 " in conf and conf.count("PartitionName=") == 1


def test_up_is_idempotent(testbed):
    before = {s.name: s.pid for s in testbed.status()}
    timings = testbed.up()
    assert {s.name: s.pid for s in testbed.status()} == before
    assert set(timings) >= {"slurmctld", "nodes idle", "total"}


def test_cli_status_and_env(testbed):
    lab = str(testbed.config.lab)
    status = CliRunner().invoke(main, ["testbed", "status", "--lab", lab])
    assert status.exit_code == 0, status.output
    assert "slurmctld      running" in status.output and "node4" in status.output
    env = CliRunner().invoke(main, ["testbed", "env"], env={"ELASTIC_SLURM_LAB": lab})
    assert f"export SLURM_CONF={testbed.config.slurm_conf}" in env.output.splitlines()


def _free_port_base(start: int) -> int:
    for base in range(start, 60000, PORT_SPAN):
        with socket.socket() as s:
            if all(s.connect_ex(("127.0.0.1", p)) != 0 for p in range(base, base + PORT_SPAN)):
                return base
    raise AssertionError("no free port block")


@pytest.fixture
def second_lab(testbed):
    lab = Path(f"/var/tmp/elastic-slurm-test-{testbed.config.port_base}-{id(testbed)}")
    bed = Testbed(TestbedConfig(lab=lab, port_base=_free_port_base(testbed.config.port_base + 1000),
                                stop_timeout=timedelta(seconds=1)))
    yield bed
    bed.down(wipe=True)
    shutil.rmtree(lab, ignore_errors=True)


def test_second_lab_fails_loudly_recovers_and_stops_only_its_daemons(testbed, second_lab):
    first = {s.name: s.pid for s in testbed.status()}
    # The installer's hook: job_submit/lua without job_submit.lua makes slurmctld exit at start.
    second_lab._prepare()
    second_lab.set_slurm_conf_lines(["JobSubmitPlugins=lua"])
    assert "JobSubmitPlugins=lua" in second_lab.config.slurm_conf.read_text().splitlines()
    cfg = second_lab.config
    result = CliRunner().invoke(main, ["testbed", "up", "--lab", str(cfg.lab), "--port-base", str(cfg.port_base)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "slurmctld: started, then died" in result.output
    assert "last lines of the slurmctld log" in result.output and "job_submit" in result.output
    second_lab.down()
    assert not any(s.running for s in second_lab.status())

    second_lab.set_slurm_conf_lines([])
    second_lab.up()
    assert second_lab.is_up()
    pids = {s.name: s.pid for s in second_lab.status()}
    assert not set(pids.values()) & set(first.values())
    os.kill(pids["slurmd-node3"], signal.SIGSTOP)  # ignores SIGTERM, like a slurmd stuck in registration
    second_lab.down()
    assert not any(s.running for s in second_lab.status())
    assert {s.name: s.pid for s in testbed.status()} == first and testbed.is_up()


def test_a_job_started_just_before_a_controller_crash_survives_once_its_state_is_saved(
        testbed, slurm, idle_nodes, wait_until, submit):
    job_id = submit("#!/bin/sh\nsleep 120\n", ["-N1", "-o", "/dev/null"])
    wait_until(lambda: slurm.job(job_id).state == "RUNNING", 30, "the job to start")
    took = testbed.save_job_state(job_id)
    assert 0 < took < 30
    testbed.stop_controller(kill=True)
    try:
        assert not next(s for s in testbed.status() if s.name == "slurmctld").running
    finally:
        testbed.start_controller()  # right after the kill: the port is free again within start's wait
    job = slurm.job(job_id)
    assert (job.state, len(job.nodes)) == ("RUNNING", 1)
    with pytest.raises(TestbedError, match="cannot update job 999999"):
        testbed.save_job_state(999999)
    slurm.cancel(job_id)
    wait_until(lambda: slurm.job(job_id).state == "CANCELLED", 30, "the job to be cancelled")
