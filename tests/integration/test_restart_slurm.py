"""Restart mode on the testbed (#43): an unchanged torchrun script with DCP checkpoints, under torchrun's elastic
agent, grown 1 -> 2 -> 4 nodes by helper jobs and shrunk back to 2 with `elastic-launch ctl`, real sbatch, CPU gloo.

The job imports this checkout (PYTHONPATH set in its script), so the launcher code under test is what runs.
"""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step (\d+)/\d+\s+world (\d+)\s+loss ([0-9.]+)$", re.M)


def _job(work: Path, steps: int, *script_options: str, every: int = 50, autoscale: bool = False,
         predictor: str = "") -> Path:
    script = work / "job.sbatch"
    train = [sys.executable, "-m", "elastic_launcher.examples.plain_train", "--steps", str(steps), "--checkpoint-dir",
             "ck", "--checkpoint-every", str(every), "--resume", "--log-every", "1", "--step-s", "0.1", *script_options]
    launch = [sys.executable, "-m", "elastic_launcher.cli", "--script", "$0", "--workers-per-node", "1", "--run-dir",
              "run", "--registry", "reg", "--checkpoint-dir", "ck", "--checkpoint-timeout", "8",
              *([] if autoscale else ["--no-autoscale"]), *(["--predictor", predictor] if predictor else [])]
    script.write_text("\n".join([
        "#!/bin/bash", "#SBATCH --job-name=restart-test", "#SBATCH --nodes=1", "#SBATCH --time=00:10:00",
        "#SBATCH --output=%x-%j.out", "#SBATCH --no-kill", "#ELASTIC gpus=1-4 mode=restart",
        f"export PYTHONPATH={shlex.quote(str(ROOT))}",
        " ".join(shlex.quote(a) if a != "$0" else '"$0"' for a in launch) + " -- " + shlex.join(train)]) + "\n")
    return script


def _records(work: Path) -> list[dict]:
    path = work / "run" / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _transitions(work: Path) -> list[dict]:
    return [r for r in _records(work) if r["kind"] == "transition"]


def _logs(work: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((work / "run").glob("worker-*.log")))


def _resize(work: Path, job: int, nodes: int, wait_until, done: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "elastic_launcher.cli", "ctl", str(job), "--nodes", str(nodes),
                          "--registry", str(work / "reg")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"], out.stdout + out.stderr
    wait_until(lambda: len(_transitions(work)) > done or any(r["kind"] == "resize_failed" for r in _records(work)),
               180, f"the restart to {nodes} nodes")
    moved = _transitions(work)[done]
    assert moved["to_nodes"] == nodes and moved["world"] == nodes, (moved, _logs(work)[-3000:])
    return moved


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
    resumed = [(int(s), int(w)) for s, w in re.findall(r"^resumed from step (\d+) on (\d+) ranks$", logs, re.M)]
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
    (step, world), = [(int(s), int(w)) for s, w in re.findall(r"^resumed from step (\d+) on (\d+) ranks$", logs, re.M)]
    assert world == 2 and step >= 200 and (work / "ck" / f"step-{step:08d}" / ".metadata").is_file()


def test_helper_nodes_go_back_to_a_job_that_waits_for_them(slurm, submit, idle_nodes, wait_until, tmp_path):
    """Grown to the whole 4-node testbed, the restart job gives its newest helper's nodes back when another job of
    the partition waits for one node, and trains on at 2 nodes."""
    work = Path(tmp_path)
    job = submit(_job(work, 100000, autoscale=True), ["--chdir", str(work)])
    _started(work, wait_until)
    _resize(work, job, 2, wait_until, 0)
    _resize(work, job, 4, wait_until, 1)
    other = work / "other.sbatch"
    other.write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --time=00:02:00\n#SBATCH --output=/dev/null\nsleep 5\n")
    waiting = submit(other, ["--chdir", str(work)])
    wait_until(lambda: len(_transitions(work)) > 2, 180, "the hand-back")
    back = _transitions(work)[2]
    assert back["action"] == "yield" and back["to_nodes"] == 2 and back["world"] == 2, back
    decision = [r for r in _records(work) if r["kind"] == "decision" and r["source"] == "yield"][0]
    assert f"pending job {waiting}" in decision["reason"]
    wait_until(lambda: slurm.job(waiting).state in ("RUNNING", "COMPLETING", "COMPLETED"), 60, "the waiting job to run")
    slurm.cancel(job)


class _Planner(BaseHTTPRequestHandler):
    """A stand-in /v1/plan (the real planner's pricing is tests/unit/test_restart_price.py's): double the job's
    nodes up to 4, then keep; every request body is kept in `bodies`."""
    bodies: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        reply = {}
        if self.path == "/v1/plan":
            type(self).bodies.append(body)
            nodes = len(body["current"]["layout"])
            reply = ({"action": "rewrite", "nodes": 2 * nodes, "reason": f"elastic: {2 * nodes} nodes; restart pays "
                      f"back: test planner", "decision_id": f"d-{len(self.bodies)}"} if nodes < 4 else
                     {"action": "keep", "nodes": None, "reason": "elastic: request already matches the plan",
                      "decision_id": f"d-{len(self.bodies)}"})
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_job_grows_1_2_4_when_the_planner_says_so(slurm, submit, idle_nodes, wait_until, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Planner)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        work = Path(tmp_path)
        job = submit(_job(work, 100000, autoscale=True, predictor=f"http://127.0.0.1:{server.server_port}"),
                     ["--chdir", str(work)])
        wait_until(lambda: len(_transitions(work)) >= 2, 300, "two planned grows")
        slurm.cancel(job)
    finally:
        server.shutdown()
        server.server_close()
    moves = _transitions(work)[:2]
    assert [(m["action"], m["from_nodes"], m["to_nodes"], m["world"]) for m in moves] == [("plan", 1, 2, 2),
                                                                                          ("plan", 2, 4, 4)], moves
    assert all(m["checkpointed"] and "restart pays back" in m["reason"] for m in moves)
    first, later = _Planner.bodies[0]["current"], _Planner.bodies[-1]["current"]
    assert first["layout"] == [1] and first["samples_per_s"] > 0 and "restart_cost_s" not in first
    assert 0 < first["remaining_s"] <= 600   # the job's 10-minute limit, as Slurm plans its end
    assert later["restart_cost_s"] == moves[-1]["cost_s"] or later["restart_cost_s"] == moves[0]["cost_s"]
