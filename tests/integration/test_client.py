"""slurm_plugin.client against the real testbed: GPU jobs, --switches, shrink (twice), sacct, bad input, a drained node."""
import os
import re
import subprocess
import time

import pytest

from slurm_plugin.errors import JobNotFoundError, ResizeError

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _running(slurm, job_id):
    job = slurm.job(job_id)
    assert job.state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job_id} ended early: {job}"
    return job if job.state == "RUNNING" else None


def _env_lines(path, wait_until):
    text = wait_until(lambda: path.exists() and "SLURM_JOB_NUM_NODES=" in path.read_text() and path.read_text(),
                      30, f"the job's output in {path}")
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("step "))


def test_two_node_gpu_job_sees_its_gpus(slurm, submit, idle_nodes, wait_until, tmp_path):
    out = tmp_path / "gpu.out"
    script = (
        "#!/bin/bash\n"
        f"#SBATCH -N2 --gres=gpu:4 -o {out}\n"
        "srun bash -c 'echo step $SLURMD_NODENAME JOB_GPUS=$SLURM_JOB_GPUS CVD=$CUDA_VISIBLE_DEVICES'\n"
    )
    job_id = submit(script)
    job = wait_until(lambda: slurm.job(job_id).state in TERMINAL and slurm.job(job_id), 60, f"job {job_id} to end")
    assert job.state == "COMPLETED", job
    steps = sorted(line.split() for line in out.read_text().splitlines() if line.startswith("step "))
    assert len(steps) == 2, out.read_text()
    assert {s[1] for s in steps} == set(job.nodes) and len(job.nodes) == 2
    for _, _, gpus, cvd in steps:
        assert gpus == "JOB_GPUS=0,1,2,3" and cvd == "CVD=0,1,2,3"
    # slurmdbd learns of the start and the end after the fact: its first record can still say PENDING, 0 GPUs
    # (CI saw it under load), so wait for the completed one
    records = wait_until(lambda: _sacct_completed(slurm, job_id), 60, f"sacct to record job {job_id} completed")
    assert records[-1].gpus == 8


def _sacct_or_none(slurm, job_id):
    try:
        return slurm.sacct(job_id)
    except JobNotFoundError:
        return None


def _sacct_completed(slurm, job_id):
    records = _sacct_or_none(slurm, job_id)
    return records if records and records[-1].state == "COMPLETED" else None


def test_switches_one_places_job_under_one_leaf(slurm, submit, idle_nodes, wait_until):
    switch_of = {n.name: n.switch for n in idle_nodes}
    blocker = submit("#!/bin/bash\nsleep 300\n", ["--exclusive", "-w", "node2", "-o", "/dev/null"])
    wait_until(lambda: _running(slurm, blocker), 30, f"blocker job {blocker} on node2")
    # A plain -N2 would fit on node1 + node3 (across leaves); --switches=1 must take node[3-4].
    job_id = submit("#!/bin/bash\nsleep 300\n", ["--exclusive", "-N2", "--switches=1", "-o", "/dev/null"])
    job = wait_until(lambda: _running(slurm, job_id), 60, f"job {job_id} with --switches=1 to start")
    assert job.nodes == ("node3", "node4")
    assert len({switch_of[n] for n in job.nodes}) == 1


def test_shrink_twice_releases_nodes_and_refreshes_env(slurm, submit, idle_nodes, wait_until, tmp_path):
    out = tmp_path / "resize.out"
    script = (
        "#!/bin/bash\n"
        f"#SBATCH -N3 --gres=gpu:4 -o {out}\n"
        "env | grep -E '^SLURM_(JOB_NODELIST|NNODES|JOB_NUM_NODES|JOB_CPUS_PER_NODE|NODELIST)='\n"
        # one step per node, as the launcher runs its workers (slurm_plugin.client.srun_step_argv): one srun over
        # all nodes, shrunk twice, makes 24.11.5's slurmctld segfault (docs/slurm-versions.md)
        "for n in $(scontrol show hostnames \"$SLURM_JOB_NODELIST\"); do srun --overlap -N1 -n1 -w $n sleep 300 & done\n"
        "wait\n"
    )
    job_id = submit(script)
    job = wait_until(lambda: _running(slurm, job_id), 60, f"job {job_id} to start")
    assert len(job.nodes) == 3 and job.gpus_per_node == (4, 4, 4)
    # Our environment for the unchanged allocation equals what Slurm gave the batch script.
    assert job.resize_env() == _env_lines(out, wait_until)

    time.sleep(1.1)  # slurmdbd keys records by the second: give each size its own record
    first = slurm.shrink(job_id, 2)
    assert first.job.nodes == (job.batch_host, *[n for n in job.nodes if n != job.batch_host][:1])
    assert first.env["SLURM_NNODES"] == "2" and first.env["SLURM_JOB_NUM_NODES"] == "2"
    assert first.env["SLURM_JOB_NODELIST"] == first.job.nodelist == first.env["SLURM_NODELIST"]
    assert first.env["SLURM_JOB_CPUS_PER_NODE"] == "1(x2)"
    released = set(job.nodes) - set(first.job.nodes)
    wait_until(lambda: all(n.state == "idle" and n.gpus_alloc == 0 for n in slurm.nodes() if n.name in released),
               30, f"released node {released} idle")

    time.sleep(1.1)
    second = slurm.shrink(job_id, [job.batch_host])
    assert second.job.nodes == (job.batch_host,) and second.job.state == "RUNNING"
    assert second.env["SLURM_NNODES"] == "1" and second.env["SLURM_JOB_CPUS_PER_NODE"] == "1"
    env = second.apply({"SLURM_NTASKS": "3", "SLURM_NNODES": "3", "HOME": "/root"})
    assert env["SLURM_NNODES"] == "1" and "SLURM_NTASKS" not in env and env["HOME"] == "/root"
    nodes = {n.name: n for n in slurm.nodes()}
    assert nodes[job.batch_host].gpus_alloc == 4

    records = wait_until(lambda: (lambda r: r if r and len(r) >= 3 else None)(_sacct_or_none(slurm, job_id)),
                         30, f"three sacct records (one per size) of job {job_id}")
    assert [(r.state, r.gpus) for r in records] == [("RESIZING", 12), ("RESIZING", 8), ("RUNNING", 4)]
    assert [r.nodelist for r in records] == [job.nodelist, first.job.nodelist, job.batch_host]


def test_version_is_the_labs_slurm_release(slurm, testbed):
    # the installer's gres: / gres/ choice rests on it: 22.05's lab gives (22, 5, x), 24.11's (24, 11, x), on
    # each backend
    major, minor, micro = slurm.version()
    assert (major, minor) == tuple(int(part) for part in testbed.config.slurm.split("."))
    assert isinstance(micro, int) and micro >= 0


def test_update_comment_with_spaces(slurm, submit):
    job_id = submit("#!/bin/bash\nsleep 300\n", ["--hold", "--comment=orig", "-o", "/dev/null"])
    assert slurm.job(job_id).comment == "orig"
    slurm.update_comment(job_id, "orig [predict choice=2x2 sps=180.5]")
    assert slurm.job(job_id).comment == "orig [predict choice=2x2 sps=180.5]"


def test_bad_input_names_the_job(slurm, submit, wait_until):
    unknown = max([j.job_id for j in slurm.jobs()] + [0]) + 100000
    for call in (lambda: slurm.job(unknown), lambda: slurm.cancel(unknown),
                 lambda: slurm.update_comment(unknown, "x"), lambda: slurm.shrink(unknown, 1)):
        with pytest.raises(JobNotFoundError, match=f"job {unknown}"):
            call()
    job_id = submit("#!/bin/bash\nsleep 300\n", ["-N1", "-o", "/dev/null"])
    job = wait_until(lambda: _running(slurm, job_id), 60, f"job {job_id} to start")
    with pytest.raises(ResizeError, match=f"job {job_id}: .*asked for 2 nodes but it has 1"):
        slurm.shrink(job_id, 2)
    other = next(n for n in ("node1", "node2", "node3", "node4") if n != job.batch_host)
    with pytest.raises(ResizeError, match=f"job {job_id}: .*{other} not in its allocation"):
        slurm.shrink(job_id, [other])
    pending = submit("#!/bin/bash\ntrue\n", ["--hold", "-o", "/dev/null"])
    with pytest.raises(ResizeError, match=re.escape(f"job {pending}: cannot resize: it is PENDING")):
        slurm.shrink(pending, 1)


def test_a_drained_node_reads_idle_drain_until_resumed(slurm, testbed, idle_nodes, wait_until):
    # The launcher grows onto nodes that read `idle`: a drained one must not, on any release or backend (22.05's
    # JSON calls it idle and keeps DRAIN in state_flags; 24.11's lists ["IDLE", "DRAIN"]; pyslurm says IDLE+DRAIN).
    env = {**os.environ, **testbed.env()}

    def scontrol(*args):
        subprocess.run(["scontrol", "update", "NodeName=node4", *args], env=env, check=True, capture_output=True,
                       timeout=20)

    scontrol("State=DRAIN", "Reason=test_client")
    try:
        drained = {n.name: n.state for n in slurm.nodes()}
    finally:
        scontrol("State=RESUME")
    assert drained == {"node1": "idle", "node2": "idle", "node3": "idle", "node4": "idle+drain"}
    # 24.11 may show the resumed node `idle+not_responding` until slurmd next answers (seen once with pyslurm)
    wait_until(lambda: {n.name: n.state for n in slurm.nodes()}["node4"] == "idle", 30, "node4 idle once resumed")
