"""The what-if replay against the lab's real slurmctld (issue #40, fidelity; marker slurm).

A slice of SLICE_JOBS jobs (Pollux workload models and batches, time scaled down to sleep jobs of a few seconds)
is submitted to the lab at its arrival times, once as submitted (no hook) and once right-sized (job_submit hook on,
`elastic-predictor serve` fitted on the Pollux T4 tables). Each job sleeps for its steps at the step time of the
allocation Slurm gave it (a table in the script, keyed by nodes x GPUs per node). sacct's submit times then feed
the simulator (predictor/replay.py, right-sized planning from the same service over HTTP), and a job agrees
with Slurm when its start and end both do: |slurm - simulated| <= max(10% of the simulated time since the slice's first
submit, TOLERANCE_FLOOR_S). The floor is sacct's 1-s resolution plus slurmctld's launch latency.

The simulator is given one number fitted on the lab: `release_s`, how long a finished job's GPUs stay held before
the next job starts on them (COMPLETING, and slurmctld's one-second scheduling loop, which the simulator does not
model). predictor.replay.calibrate_release fits it on each run (its average JCT, the jobs at the sizes they ran), as
an admin's replay fits it on the site's history; what is judged is what it does not fit: every job's start and end,
and the makespan. Fitted on the as-submitted run and frozen, it did not carry to the right-sized run minutes later on
the same host: in session 25's CI run it read 1.02 s as submitted while the right-sized rows replayed best near 0.7 s
(147 of 200 jobs agreeing there, 115 at 1.02 s: below the bar; runs 10-11 of session 24 held 136 and 142). Measured
instead with jobs queued back to back, it read 0.73-1.09 s by the host's load (their 2-s sleeps lock onto the
one-second loop) and 0.33-0.47 s with sleeps drawn within a second; fitted on the slice it read 0.68-1.01 s (three
runs, by the host's load), and on two runs' rows the right-sized average JCT read -4.5% and -1.9% of Slurm's with the
fitted value where the back-to-back 1.0 s read +7.4% and +11.8% (bench/results/replay/README.md, "Fidelity").

Two bars. The slice's average JCT and makespan must agree with Slurm's within AGGREGATE (what a replay report
tells an admin; the average JCT is what release_s is fitted to, the makespan is not), and MIN_AGREEING of its jobs
must agree one by one. A queue at 85% load is chaotic: a job that
Slurm backfills a second earlier than the simulator shifts every job behind it, so the per-job share moves by
tens of jobs between runs of the same code (bench/results/replay/README.md, "Fidelity").

The simulator's inputs are known to a second only: sacct truncates each submit time to whole seconds. The replay
with sacct's times is one answer; ENSEMBLE more replays, each submit time moved by a seeded uniform draw in
[0, 1) s (where the true time lies), give the spread those inputs leave, and the averages agree when Slurm's is
within AGGREGATE of one of those answers. On one lab run's rows (session 23, a loaded host), the slice's average JCT
read +8.3% of Slurm's at sacct's times and +6.8% to +20.4% between such draws; a CI run at sacct's times alone read
+11.4% right-sized, where earlier runs read within 3%; those runs took release_s from jobs queued back to back, which
read long on a loaded host (1.00-1.09 s): the next CI run had only 95 of 200 jobs agree as submitted, and its rows
replayed with 0.7 s had 169 (bench/results/replay/README.md, "Fidelity").
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from predictor.cluster import Cluster
from predictor.datasets import POLLUX_MODELS, _profiles, load_pollux
from predictor.replay import Params, Replay, calibrate_release
from predictor.replay_inputs import PolluxTruth, ReplayJob, elastic_lines, load_pollux_workload
from slurm_plugin.installer import PluginConfig, install
from tests.integration.test_hook import lab_bed

SLICE_JOBS = 200
MEAN_GPU_S = 10.0          # GPU-seconds a job asks for on average (the slice's load on 16 GPUs)
LOAD = 0.85                # arrival rate: this share of the lab's GPUs, on average
TOLERANCE = 0.10
TOLERANCE_FLOOR_S = 2.0
# share of the slice's jobs whose start and end must both agree (per-node backfill, replayed on one lab run's rows:
# 0.83 as submitted, 0.695 right-sized)
MIN_AGREEING = 0.60
# average JCT and makespan, simulated against Slurm's: the spread of the simulator's own answer over submit times
# within sacct's second (13.6 points on one run's rows); a GPU-count backfill profile was 13% long right-sized
AGGREGATE = 0.15
ENSEMBLE = 4               # replays with submit times drawn within sacct's second, beside the one at sacct's times
LIMIT_S = 60               # every job's --time=1: what backfill plans with, in Slurm and in the simulator
UNIFORM = {1: (1, 1), 2: (1, 2), 3: (1, 3), 4: (1, 4), 6: (2, 3), 8: (2, 4)}  # GPUs -> (nodes, per node)


def lab_cluster(nodes: int, per_node: int) -> Cluster:
    return Cluster.from_dict({"default_partition": "debug", "partitions": [
        {"name": "debug", "nodes": f"node[1-{nodes}]", "gpus_per_node": per_node, "gpu": "T4",
         "intra_link": "pcie", "inter_link": "ethernet"}]})


def make_slice(truth: PolluxTruth, n: int, total_gpus: int, seed: int = 40) -> list[ReplayJob]:
    """`n` jobs drawn from Pollux workloads 1-8 (model, global batch, GPUs asked capped at 8 and made uniform),
    each sleeping 3-15 s at its asked size, arriving as a Poisson process loading LOAD of the GPUs."""
    rng = np.random.default_rng(seed)
    pool = [j for w in range(1, 9) for j in load_pollux_workload(w, truth)]
    jobs, t = [], 0.0
    rate = LOAD * total_gpus / MEAN_GPU_S
    for i in range(n):
        src = pool[int(rng.integers(len(pool)))]
        gpus = max(g for g in UNIFORM if g <= min(src.gpus, 8))
        nodes, per = UNIFORM[gpus]
        dur = float(np.clip(rng.exponential(MEAN_GPU_S / gpus), 3.0, 15.0))
        step = truth.step(src.model, (per,) * nodes, src.global_batch)[0]
        t += float(rng.exponential(1.0 / rate))
        lines = elastic_lines(src.model, src.global_batch, gpus, truth, 1.0, total_gpus, 0.5)
        jobs.append(ReplayJob(f"s{i:03d}-{src.model}", t, gpus, nodes, src.model, src.global_batch, dur / step, dur,
                              LIMIT_S, lines))
    return jobs


def sleep_table(job: ReplayJob, truth: PolluxTruth, per_node_max: int, nodes_max: int) -> dict[str, float]:
    """Seconds the job sleeps on each uniform allocation `NxK` it could get (its steps at that layout's step)."""
    out = {}
    for k in range(1, per_node_max + 1):
        for n in range(1, nodes_max + 1):
            if truth.feasible(job.model, n * k, job.global_batch):
                out[f"{n}x{k}"] = job.steps * truth.step(job.model, (k,) * n, job.global_batch)[0]
    return out


def script(job: ReplayJob, table: dict[str, float], elastic: bool) -> str:
    cases = "".join(f"  {key}) sleep {sec:.2f};;\n" for key, sec in table.items())
    lines = "".join(ln + "\n" for ln in job.directives) if elastic else ""
    return (f"#!/bin/bash\n#SBATCH -N {job.nodes} --gpus-per-node={job.gpus // job.nodes} --time=1\n{lines}"
            f"case \"${{SLURM_JOB_NUM_NODES}}x${{SLURM_GPUS_ON_NODE}}\" in\n{cases}"
            f"  *) echo \"no sleep for ${{SLURM_JOB_NUM_NODES}}x${{SLURM_GPUS_ON_NODE}}\" >&2; exit 3;;\nesac\n")


class Service:
    """`elastic-predictor serve` on the lab's shape, fitted on the Pollux T4 step tables of the slice's models."""

    def __init__(self, workdir: Path, cluster: Cluster):
        self.db, cfg = workdir / "predictor.db", workdir / "cluster.json"
        cfg.write_text(json.dumps(cluster.to_dict()))
        ds = load_pollux()
        lines = [json.dumps({"kind": "profile", **dataclasses.replace(p, name=n).to_dict()})
                 for n, p in _profiles(POLLUX_MODELS).items()]
        lines += [json.dumps({k: v for k, v in r.items() if k not in ("source", "uid")})   # an import signs nothing
                  for r in ds.steps]
        (workdir / "history.jsonl").write_text("\n".join(lines) + "\n")
        exe = str(Path(sys.executable).parent / "elastic-predictor")
        run = dict(capture_output=True, text=True, timeout=300, check=True)
        subprocess.run([exe, "import", "--db", str(self.db), str(workdir / "history.jsonl")], **run)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "predictor.log", "w")
        self.proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--db",
                                      str(self.db), "--workers", "1", "--cluster", str(cfg)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))

    def wait_fitted(self, lines: tuple[str, ...], seconds: float = 900.0) -> None:
        """Until /v1/plan answers with a fitted model (an outer deadline against a hang: beside four busy loops the
        fit took over 240 s, #46)."""
        import requests

        deadline = time.monotonic() + seconds
        body = {"source": "cli", "directives": list(lines), "job": {"min_nodes": 1, "tres_per_node": "gres:gpu:4"}}
        while True:
            try:
                reply = requests.post(self.url + "/v1/plan", json=body, timeout=5).json()
                if reply.get("predicted"):
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the predictor never planned with a fitted model; its log: "
                            f"{Path(self.log.name).read_text()[-2000:]}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.log.close()


def run_slice(bed, jobs: list[ReplayJob], truth: PolluxTruth, tmp: Path, elastic: bool) -> dict[str, dict]:
    """Submit the slice at its arrival times, wait for every job, read sacct."""
    env = {**os.environ, **bed.env()}
    cfg = bed.config
    tables = {j.name: sleep_table(j, truth, cfg.gpus_per_node, cfg.nodes) for j in jobs}
    ids: dict[str, int] = {}
    errors: list[str] = []
    t0 = time.monotonic()
    for j in jobs:
        path = tmp / f"{j.name}.sh"
        path.write_text(script(j, tables[j.name], elastic))
    for j in jobs:
        delay = j.submit_s - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        # the directives also go to the job's comment, as a site's sacct export would carry them (replay --sacct)
        proc = subprocess.run(["sbatch", "--parsable", "-J", j.name, f"--output={tmp}/%j.out",
                               f"--comment={';'.join(j.directives)}", str(tmp / f"{j.name}.sh")],
                              capture_output=True, text=True, env=env, timeout=60)
        if proc.returncode != 0:
            errors.append(f"{j.name}: {proc.stderr.strip()}")
            continue
        ids[j.name] = int(proc.stdout.strip().split(";")[0])
    assert not errors, errors[:5]
    return wait_and_read(env, list(ids.values()))


def wait_and_read(env: dict, ids: list) -> dict[str, dict]:
    """Wait until none of the jobs is queued or running (15 min at most), then their sacct rows by job name."""
    deadline = time.monotonic() + 900
    while True:
        out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(map(str, ids))],
                             capture_output=True, text=True, env=env, timeout=60).stdout.split()
        if not out:
            break
        assert time.monotonic() < deadline, f"{len(out)} jobs still queued or running after 15 min"
        time.sleep(2.0)
    time.sleep(3.0)  # slurmdbd catches up
    acct = subprocess.run(["sacct", "-P", "-n", "-X", "-j", ",".join(map(str, ids)),
                           "--format=JobID,JobName,Submit,Start,End,NNodes,AllocTRES,State"],
                          capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    rows = {}
    for line in acct.splitlines():
        jid, name, sub, start, end, nnodes, tres, state = line.split("|")
        ts = [datetime.fromisoformat(x).timestamp() for x in (sub, start, end)]
        gpus = int(dict(kv.split("=", 1) for kv in tres.split(",") if "=" in kv).get("gres/gpu", 0))
        rows[name] = {"submit": ts[0], "start": ts[1], "end": ts[2], "nodes": int(nnodes), "gpus": gpus,
                      "state": state}
    return rows


def compare(rows: dict[str, dict], jobs: list[ReplayJob], truth: PolluxTruth, cluster: Cluster, policy: str,
            service_url: str | None, release: float, dump: Path) -> list[str]:
    """Replay the slice with Slurm's submit times; the jobs whose start or end disagree beyond the tolerance.
    Slurm's rows and the simulator's go to `dump` (JSON) for a look after the run."""
    t0 = min(r["submit"] for r in rows.values())
    rng = np.random.default_rng(0)
    answers = []
    for k in range(ENSEMBLE + 1):     # the first at sacct's times, then within their second
        shift = rng.uniform(0.0, 1.0, len(jobs)) if k else np.zeros(len(jobs))
        sim_jobs = [dataclasses.replace(j, submit_s=rows[j.name]["submit"] - t0 + d) for j, d in zip(jobs, shift)]
        answers.append(Replay(sim_jobs, cluster, truth, policy, Params(release_s=release),
                              service_url=service_url).run(sample_s=60.0).jobs())
    sim = answers[0]
    dump.write_text(json.dumps({"t0": t0, "slurm": rows, "simulated": sim, "ensemble": answers[1:]}, indent=1,
                               default=str))
    differ = [f"{j.name}: slurm {rows[j.name]['gpus']} GPUs, simulated {sim[j.name]['gpus_start']}" for j in jobs
              if rows[j.name]["gpus"] != sim[j.name]["gpus_start"]]
    assert not differ, f"the simulator sized {len(differ)} jobs otherwise than the hook: {differ[:10]}"
    bad = []
    for j in jobs:
        r, s = rows[j.name], sim[j.name]
        assert r["state"] == "COMPLETED", f"{j.name}: {r['state']}"
        off = [f"{key}: slurm {r[key] - t0:.0f} s, simulated {s[key]:.1f} s" for key in disagreeing(r, s, t0)]
        if off:
            bad.append(f"{j.name} " + "; ".join(off))
    err = np.array([[rows[j.name][k] - t0 - sim[j.name][k] for k in ("start", "end")] for j in jobs])
    print(f"{policy}: {len(jobs)} jobs, release_s {release:.2f}; |start error| median "
          f"{np.median(np.abs(err[:, 0])):.2f} s, p90 {np.percentile(np.abs(err[:, 0]), 90):.1f} s, max "
          f"{np.max(np.abs(err[:, 0])):.1f} s; |end error| median {np.median(np.abs(err[:, 1])):.2f} s; makespan "
          f"slurm {max(r['end'] for r in rows.values()) - t0:.0f} s, simulated "
          f"{max(s['end'] for s in sim.values()):.0f} s; start and end within tolerance: "
          f"{len(jobs) - len(bad)} of {len(jobs)}")
    for line in bad:
        print("  off:", line)
    measured = {"average JCT": np.mean([r["end"] - r["submit"] for r in rows.values()]),
                "makespan": max(r["end"] for r in rows.values()) - t0}
    for key in measured:
        off = np.array([simulated_aggregates(a)[key] / measured[key] - 1 for a in answers])
        print(f"{policy}: {key} slurm {measured[key]:.1f} s, simulated at sacct's times "
              f"{(1 + off[0]) * measured[key]:.1f} s ({off[0]:+.1%}), within the second {off[1:].min():+.1%} to "
              f"{off[1:].max():+.1%}")
        assert np.abs(off).min() <= AGGREGATE, \
            f"{policy}: {key} simulated {off.min():+.1%} to {off.max():+.1%} of Slurm's {measured[key]:.1f} s"
    return bad


def as_run(rows: dict[str, dict], jobs: list[ReplayJob]) -> list[ReplayJob]:
    """The slice's jobs as Slurm ran them: sacct's submit times (from the first) and the sizes they ran at."""
    t0 = min(r["submit"] for r in rows.values())
    return [dataclasses.replace(j, submit_s=rows[j.name]["submit"] - t0, gpus=rows[j.name]["gpus"],
                                nodes=rows[j.name]["nodes"]) for j in jobs]


def fitted_release(rows: dict[str, dict], jobs: list[ReplayJob], truth: PolluxTruth, cluster: Cluster) -> float:
    """release_s fitted on one run (its average JCT, the jobs at the sizes they ran)."""
    return calibrate_release(as_run(rows, jobs), cluster, truth,
                             float(np.mean([r["end"] - r["submit"] for r in rows.values()])))


def disagreeing(row: dict, sim: dict, t0: float) -> list[str]:
    """Of "start" and "end", those where Slurm's `row` (epoch seconds, the slice's first submit at `t0`) and the
    simulator's `sim` differ by more than max(TOLERANCE of the simulated time, TOLERANCE_FLOOR_S)."""
    return [key for key in ("start", "end")
            if abs(row[key] - t0 - sim[key]) > max(TOLERANCE * sim[key], TOLERANCE_FLOOR_S)]


def simulated_aggregates(sim: dict[str, dict]) -> dict[str, float]:
    return {"average JCT": float(np.mean([s["end"] - s["submit"] for s in sim.values()])),
            "makespan": max(s["end"] for s in sim.values())}


@pytest.fixture(scope="module")
def bed(testbed):
    bed = lab_bed(testbed)
    before = bed.slurm_conf_lines()
    lines = [ln for ln in before if not ln.startswith(("JobSubmitPlugins", "CliFilterPlugins", "SchedulerParameters"))]
    # backfill every second (Slurm's default is 30 s), as the simulator backfills on every event
    bed.set_slurm_conf_lines(lines + ["SchedulerParameters=permit_job_expansion,bf_interval=1,bf_resolution=1"])
    bed.reconfigure()
    yield bed
    bed.set_slurm_conf_lines(before)
    bed.reconfigure()


@pytest.mark.timeout(1800)
def test_slice_as_submitted_and_right_sized_match_slurm(bed, tmp_path, idle_nodes):
    truth = PolluxTruth()
    cfg = bed.config
    cluster = lab_cluster(cfg.nodes, cfg.gpus_per_node)
    jobs = make_slice(truth, SLICE_JOBS, cfg.nodes * cfg.gpus_per_node)
    (tmp_path / "plain").mkdir()
    plain = run_slice(bed, jobs, truth, tmp_path / "plain", elastic=False)
    release = fitted_release(plain, jobs, truth, cluster)
    print(f"release_s fitted on the as-submitted run: {release:.2f} s")
    bad = compare(plain, jobs, truth, cluster, "as-submitted", None, release, tmp_path / "plain.json")
    assert len(bad) <= (1 - MIN_AGREEING) * len(jobs), f"{len(bad)} of {len(jobs)} jobs off: {bad[:10]}"

    service = Service(tmp_path, cluster)
    try:
        service.wait_fitted(jobs[0].directives)
        install(PluginConfig(cfg.etc, service.url, timedelta(milliseconds=500), 1000, timedelta(seconds=30)))
        bed.set_slurm_conf_lines(bed.slurm_conf_lines() + ["JobSubmitPlugins=lua"])
        bed.reconfigure()
        (tmp_path / "sized").mkdir()
        sized = run_slice(bed, jobs, truth, tmp_path / "sized", elastic=True)
        rewritten = sum(1 for j in jobs if sized[j.name]["gpus"] != j.gpus or sized[j.name]["nodes"] != j.nodes)
        assert rewritten > 0, "the hook rewrote no job of the slice: the right-sized run checks nothing"
        release = fitted_release(sized, jobs, truth, cluster)
        print(f"release_s fitted on the right-sized run: {release:.2f} s")
        bad = compare(sized, jobs, truth, cluster, "right-sized", service.url, release, tmp_path / "sized.json")
        assert len(bad) <= (1 - MIN_AGREEING) * len(jobs), f"{len(bad)} of {len(jobs)} jobs off: {bad[:10]}"
    finally:
        service.stop()
