"""#45: what a user reads of an ended elastic job that was resized (marker slurm): sacct on the lab lists it as
RESIZING first, one record per size it left; `elastic-launch ctl N` says its end state and sizes instead."""
from __future__ import annotations

import os
import subprocess
import sys
import time


def test_ctl_says_how_a_shrunk_job_ended_where_sacct_shows_resizing(slurm, testbed, idle_nodes, wait_until, submit,
                                                                     tmp_path):
    job_id = submit("#!/bin/bash\nsleep 6\n", ["-N2", f"--output={tmp_path}/%j.out"])
    wait_until(lambda: slurm.job(job_id).state == "RUNNING", 60, "the job running")
    time.sleep(2)  # slurmdbd keeps one record for events within a second: the first size gets its own
    slurm.shrink(job_id, 1)  # what the launcher's shrink does (NodeList= of the nodes kept)
    wait_until(lambda: slurm.sacct(job_id)[-1].state == "COMPLETED", 90, "the job's end in sacct")
    shown = subprocess.run(["sacct", "-X", "-n", "-j", str(job_id), "-o", "State"], capture_output=True, text=True,
                           env=testbed.env(path="/usr/bin:/bin"), timeout=30, check=True).stdout.split()
    assert shown[-2:] == ["RESIZING", "COMPLETED"], shown  # Slurm's reading, which the user guide explains
    out = subprocess.run([sys.executable, "-m", "elastic_launcher.cli", "ctl", str(job_id), "--status", "--registry",
                          str(tmp_path)], capture_output=True, text=True, env={**os.environ, **testbed.env()},
                         timeout=60)
    assert out.returncode == 1 and f"job {job_id} ended COMPLETED on 1 node(s); it ran at 2 -> 1 nodes" in out.stderr, \
        out.stderr
