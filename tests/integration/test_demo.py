"""`elastic-slurm demo` end to end, from a cold lab of its own (not the shared testbed): it must print the
hook's rewrite reason, take its job through a grow (helper job) and a shrink, print the summary, and leave
nothing running (no process of its lab: daemons, job steps, workers, the predictor).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.testbed_conf import PORT_SPAN, TestbedConfig

pytestmark = pytest.mark.timeout(560)   # a cold cluster, a calibration and a job of a few minutes
LAB = Path("/var/tmp/elastic-slurm-demo-test")


def _free_block(start: int) -> int:
    """The first block of PORT_SPAN ports from `start` on which nothing listens."""
    for base in range(start, 60000, PORT_SPAN):
        with socket.socket() as probe:
            probe.settimeout(0.2)
            if all(probe.connect_ex(("127.0.0.1", port)) != 0 for port in range(base, base + PORT_SPAN)):
                return base
    raise AssertionError("no free block of ports for the demo's lab")


def _lab_processes(lab: Path) -> list[str]:
    """Processes whose command line or environment names the lab (daemons, slurmstepd, workers, gunicorn)."""
    mark = str(lab).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if mark in cmd or mark in env:
            args = cmd.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {args[:120]}")
    return found


def test_demo_from_a_cold_lab_grows_shrinks_summarises_and_stops_everything():
    Testbed(TestbedConfig(lab=LAB, stop_timeout=timedelta(seconds=2))).down(wipe=True)   # cold: no state, spool,
    port_base = _free_block(17100)                                                        # database or logs
    bed = Testbed(TestbedConfig(lab=LAB, port_base=port_base))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "slurm_plugin.cli", "demo", "--lab", str(LAB), "--port-base",
                           str(port_base), "--steps", "2500", "--calibration-steps", "20"],
                          capture_output=True, text=True, timeout=540)
    wall = time.monotonic() - started
    out = proc.stdout
    (LAB / "demo-output.txt").write_text(out + proc.stderr)   # what a user would have seen, for later reading
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-3000:]
    print(f"demo wall time from a cold lab: {wall:.1f} s")

    # the hook's line as sbatch printed it, with a prediction in it
    reason = next((ln for ln in out.splitlines() if ln.strip().startswith("sbatch: elastic:")), None)
    assert reason is not None and "predicted" in reason and "samples/s" in reason, out[-4000:]

    # a grow through a helper job and a shrink, in the launcher's own records
    records = [json.loads(ln) for ln in (LAB / "demo" / "run" / "records.jsonl").read_text().splitlines()]
    moves = [r for r in records if r["kind"] == "transition"]
    grow = next(r for r in moves if r["action"] == "grow")
    assert grow["helper"] and grow["to_nodes"] > grow["from_nodes"], grow
    shrink = next(r for r in moves if r["action"] in ("shrink", "revert"))   # before or after the grow:
    assert shrink["to_nodes"] < shrink["from_nodes"], shrink              # a job sized to 4 shrinks first
    assert all(isinstance(r.get("idle_s"), (int, float)) for r in (grow, shrink))
    assert any(r["kind"] == "end" for r in records)

    # every record of the demo's model went in with the links it really crossed: gloo over TCP, every pretend
    # node on this machine, so loopback, labelled by detection (a record under nvlink, ib, shm or socket
    # would be a defect: the job used none of them)
    from predictor.store import Store
    from slurm_plugin.lab.demo_calibrate import GPU, PROFILE
    ours = [r for r in Store(str(LAB / "predictor" / "predictor.db")).observations()
            if r["kind"] in ("step", "collective") and r.get("gpu") == GPU and r.get("profile", PROFILE) == PROFILE]
    steps = [r for r in ours if r["kind"] == "step"]
    assert len(steps) >= 2 and any(len(r["layout"]) > 1 for r in steps), ours[-5:]
    labels = {r.get("link") for r in ours if r["kind"] == "collective"} | {r["intra_link"] for r in steps} | \
        {r["inter_link"] for r in steps if len(r["layout"]) > 1}
    assert labels == {"loopback"}, labels
    assert all(r.get("link_source", "").startswith("detected") for r in ours), {r.get("link_source") for r in ours}

    # the calibration job of phase 3 posted its probes at 1 and 2 ranks and its sweep, signed for itself (a uid)
    from elastic_launcher.calibrate import PROBES
    cal_job = re.search(r"signed for job (\d+)", out)
    assert cal_job is not None, out[-4000:]
    cal_rows = [r for r in Store(str(LAB / "predictor" / "predictor.db")).observations()
                if r.get("job_id") == int(cal_job.group(1))]
    assert sorted((r["probe"], r["world"]) for r in cal_rows if r["kind"] == "ddp_overhead") == \
        sorted((p.name, w) for p in PROBES for w in (1, 2))
    assert any(r["kind"] == "collective" for r in cal_rows) and all("uid" in r for r in cal_rows)

    # after the job, the model answers the job's measured layouts with what it measured: fitted offline on the
    # stored history, as the service fits it, each layout the job ran is predicted (for that job, as its
    # launcher's /v1/plan asks) within 5% of the job's median there (or within the spread of its windows)
    import statistics
    from predictor.engine import Predictor
    from predictor.profiles import Profile
    store = Store(str(LAB / "predictor" / "predictor.db"))
    profiles = {p["name"]: Profile.from_dict(p["body"]) for p in store.list_profiles()}
    model = Predictor().fit(profiles, store.observations())
    batch = int(next(r for r in steps)["per_gpu_batch"])
    job = next(r["job_id"] for r in steps if r.get("job_id") is not None)   # the demo job's rows name it
    windows: dict[int, list[float]] = {}
    for r in records:   # a window's step time is what the launcher posts for it (its samples/s count the commits)
        if r["kind"] == "measurement":
            windows.setdefault(r["nodes"], []).append(r["workers"] * batch / r["step_s"])
    assert len(windows) >= 2, windows
    links = {"intra_link": "loopback", "inter_link": "loopback"}
    for nodes, xs in sorted(windows.items()):
        cand = {"layout": [1] * nodes, **(links if nodes > 1 else {"intra_link": "loopback"})}
        (pred,) = model.predict(profiles[PROFILE], GPU, batch, [cand], job_id=job)   # as its launcher asks
        measured = statistics.median(xs)
        noise = (max(xs) - min(xs)) / measured if len(xs) > 1 else 0.0
        assert pred["basis"].startswith("measured"), (nodes, pred)
        assert abs(pred["samples_per_s"] / measured - 1) <= max(0.05, noise), (nodes, pred, xs)

    # the summary
    summary = out[out.index("== 6/6 summary"):]
    assert "chosen layout:" in summary and "calibrated" in summary and "predicted" in summary
    # #26.6: the model after the job (it holds the job's own rows) beside the submit-time one, named by version
    assert "after job" in summary and "none fitted within 30 s" not in summary, summary
    submit_v = re.search(r"at submit time \(model (g\d+)\)", summary).group(1)
    after_v = re.search(r"this job's own rows \((g\d+)\)", summary).group(1)
    assert int(after_v[1:]) > int(submit_v[1:]), summary
    # #26.4: the plan sbatch printed comes from a model at least as new as the curve printed before it
    curve_v = re.search(r"fitted \(model version (g\d+)\); predicted samples/s", out).group(1)
    assert int(submit_v[1:]) >= int(curve_v[1:]), (curve_v, submit_v, summary)
    assert "grow" in summary and ("revert" in summary or "shrink" in summary) and "idle_s" in summary
    # #45.7: the demo stops following once the grow and the shrink are shown (it ends the job: 436-455 s of a
    # 495-504 s demo came after the last event), and repeats no progress line
    assert "COMPLETED, launcher outcome completed" in summary or \
        ("CANCELLED, launcher outcome ended by the demo" in summary and "the demo ends it (scancel" in out), summary
    progress = re.findall(r"\] (step \d+/\d+  workers \d+)", out)
    assert len(progress) == len(set(progress)), progress
    assert "WARNING" not in out and "cannot sign observations with munge" not in out + proc.stderr
    assert "stopped: jobs cancelled, predictor stopped, testbed down" in out
    assert wall < 600, f"the demo took {wall:.0f} s (limit 10 minutes)"

    # nothing left running: no daemon, job step, worker or predictor of the lab
    assert not any(st.running for st in bed.status())
    assert not (LAB / "predictor" / "serve.pid").exists()
    assert _lab_processes(LAB) == []
