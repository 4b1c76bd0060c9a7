"""Shared fixtures for tests against the real Slurm testbed (marker `slurm`, added to every test here).

The testbed is the one in $ELASTIC_SLURM_LAB (default /var/tmp/elastic-slurm-lab), started beforehand
with `elastic-slurm testbed up [--slurm 24.11]`; the tests run against the Slurm release that lab runs. When it
is not up, every test here FAILS with the reason. ELASTIC_SLURM_BACKEND=pyslurm makes the `slurm` fixture a
`PyslurmBackend` (inside the 24.11 root, where pyslurm is built: see `elastic-slurm testbed exec`).

Fixtures for other integration tests:
    testbed     the `Testbed` (config, paths, `set_slurm_conf_lines`, `reconfigure`)
    slurm       a `Backend` on the testbed's slurm.conf (`CommandBackend`, or `PyslurmBackend`)
    submit      like `slurm.submit`, but cancels the job at teardown
    idle_nodes  waits (60 s) until no node is in use, then returns the nodes
    module_submit, module_idle_nodes   the same for a module-scoped fixture (jobs that several tests check)
    wait_until  `wait_until(fn, seconds, what)`: polls `fn` until truthy, fails naming `what`
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from slurm_plugin.client import Backend, CommandBackend, PyslurmBackend
from slurm_plugin.errors import JobNotFoundError, SlurmError
from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.root import HOST_VERSION
from slurm_plugin.lab.testbed_conf import (DEFAULT_LAB, DEFAULT_PORT_BASE, TestbedConfig, recorded_port_base,
                                           recorded_slurm)

# Entry point of the test session: the one place here that reads the environment.
LAB = Path(os.environ.get("ELASTIC_SLURM_LAB", str(DEFAULT_LAB))).absolute()
BACKEND = os.environ.get("ELASTIC_SLURM_BACKEND", "command")
HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)   # before xdist's loadgroup reads the group marks
def pytest_collection_modifyitems(items):
    """Every test here is a `slurm` test, and all of them are one xdist group: under `-n N --dist loadgroup` (.ci/run's default,
    ELASTIC_SLURM_CI_PARALLEL=1) they run on one worker, one at a time and in order, since they share the lab (its nodes,
    its slurm.conf); the unit tests run on the other workers."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slurm)
            item.add_marker(pytest.mark.xdist_group("slurm"))


def _wait_until(fn, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {seconds:g} s waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def wait_until():
    return _wait_until


@pytest.fixture(scope="session")
def testbed() -> Testbed:
    bed = Testbed(TestbedConfig(lab=LAB, port_base=recorded_port_base(LAB) or DEFAULT_PORT_BASE,
                                slurm=recorded_slurm(LAB) or HOST_VERSION))
    if "PATH" in bed.env():   # a release from a root: its commands first, for this process too (the installer
        os.environ["PATH"] = bed.env()["PATH"]   # asks Slurm through PATH), as `eval "$(testbed env)"` does
    if not bed.is_up():
        down = [s.name for s in bed.status() if not s.running]
        pytest.fail(
            f"the Slurm testbed in {LAB} is not up (daemons not running: {down or 'none'}; "
            f"or nodes not idle/allocated). Start it with: elastic-slurm testbed up --lab {LAB}",
            pytrace=False,
        )
    return bed


@pytest.fixture(scope="session")
def slurm(testbed) -> Backend:
    if BACKEND == "pyslurm":
        return PyslurmBackend(slurm_conf=testbed.config.slurm_conf, timeout=timedelta(seconds=10),
                              update_timeout=timedelta(seconds=30))
    if BACKEND != "command":
        pytest.fail(f"ELASTIC_SLURM_BACKEND={BACKEND!r}: expected command or pyslurm", pytrace=False)
    return CommandBackend(slurm_conf=testbed.config.slurm_conf, env=testbed.command_env(),
                          timeout=timedelta(seconds=10), update_timeout=timedelta(seconds=30))


def _submitter(slurm):
    submitted = []

    def _submit(script, args=()):
        job_id = slurm.submit(script, args)
        submitted.append(job_id)
        return job_id

    yield _submit
    for job_id in submitted:
        try:
            if slurm.job(job_id).state in ("PENDING", "RUNNING", "CONFIGURING", "SUSPENDED"):
                slurm.cancel(job_id)
        except (JobNotFoundError, SlurmError):
            pass


@pytest.fixture
def submit(slurm):
    yield from _submitter(slurm)


@pytest.fixture(scope="module")
def module_submit(slurm):
    yield from _submitter(slurm)


def _idle_nodes(slurm, testbed):
    _resume_kill_task_failed(testbed)

    def all_idle():
        nodes = slurm.nodes()
        return nodes if all(n.state == "idle" for n in nodes) else None

    return _wait_until(all_idle, 60, "all testbed nodes idle (jobs of an earlier test still running?)")


@pytest.fixture
def idle_nodes(slurm, testbed):
    return _idle_nodes(slurm, testbed)


@pytest.fixture(scope="module")
def module_idle_nodes(slurm, testbed):
    return _idle_nodes(slurm, testbed)


def _resume_kill_task_failed(testbed) -> None:
    """Return nodes that slurmd drained with "Kill task failed" to service, loudly.

    Seen in CI here (job of the cancelled-main-job test, node1): a killed job's process outlived
    UnkillableStepTimeout (this sandbox's PID 1 does not reap orphans) and slurmd drained the node; an earlier
    test's job must not fail the next test.
    """
    env = {**os.environ, **testbed.env()}
    listing = subprocess.run(["sinfo", "-h", "-N", "-R", "-o", "%N|%E"], env=env, capture_output=True, text=True,
                             timeout=20).stdout
    for line in listing.splitlines():
        node, _, reason = line.partition("|")
        if "Kill task failed" in reason:
            print(f"conftest: resuming {node} (drained by slurmd: {reason})", file=sys.stderr)
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env, check=True,
                           capture_output=True, timeout=20)
