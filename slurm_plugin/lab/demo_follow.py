"""Following the demo job: progress lines from the run directory, operator resizes, the summary table.

`JobWatcher` reads the launcher's `records.jsonl` incrementally (measurement, decision, plan, transition ...
see docs/launcher.md) and rank 0's progress lines in the worker logs (`step 340/1200  workers 3 ...`),
prints what happens as it happens, and makes sure the job goes through at least one grow and one shrink:
when the autoscaler has not grown the job after it settled at a size, it asks as an operator would
(`elastic-launch ctl JOB --nodes N`); for the shrink it submits another user's job that needs a node the demo
job holds, which the launcher hands back (an operator request only if that has not happened within 60 s).
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Callable

from slurm_plugin.lab.demo_services import DemoError, tail

GROWS = ("grow", "replace")
SHRINKS = ("shrink", "revert", "straggler")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")
_STEP = re.compile(r"^step (\d+)/(\d+)\s+workers (\d+).*?([\d.]+) samples/s")


class JobWatcher:
    """Watches one elastic-launch job and steers it through a grow and a shrink.

    Args:
        job_id: the main job.
        run_dir: its `--run-dir`.
        registry: its `--registry` (for `ctl`).
        ctl: argv prefix of `elastic-launch` (`ctl JOB ...` is appended).
        slurm: a `CommandBackend` on the lab.
        max_nodes: largest node count the job may have (directive gpus max, one worker per node).
        echo: where lines go.
        settle_s: seconds at one size, after a measurement there, before the demo resizes as an operator.
    """

    def __init__(self, job_id: int, run_dir: Path, registry: Path, ctl: list[str], slurm, max_nodes: int,
                 echo: Callable[[str], None], settle_s: float = 5.0):
        self.job_id = job_id
        self.run_dir = run_dir
        self.registry = registry
        self.ctl = ctl
        self.slurm = slurm
        self.max_nodes = max_nodes
        self.echo = echo
        self.settle_s = settle_s
        self.records: list[dict] = []
        self._offset = 0
        self._last_step = (0.0, None, None)  # (when, workers, step) of the last progress line printed
        self._last_measure = (0.0, None)     # (when, nodes) of the last measurement printed
        self.requests: list[dict] = []
        self.waiting_job: tuple[int, float] | None = None   # (id, when) of the other user's job the demo submits
        self.state = "PENDING"
        self.ended_by_demo = False   # the demo cancelled the job once its events were shown
        self.t0 = time.monotonic()

    # -- reading --------------------------------------------------------------------------------------------
    def _new_records(self) -> list[dict]:
        path = self.run_dir / "records.jsonl"
        try:
            with open(path, encoding="utf-8") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        complete = chunk[:chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.records += new
        return new

    def progress(self) -> tuple[int, int, int, float] | None:
        """(step, steps, workers, samples/s) of rank 0's latest progress line."""
        best = None
        for path in self.run_dir.glob("worker-*.log"):
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in reversed(lines):
                m = _STEP.match(line.strip())
                if m:
                    item = (int(m[1]), int(m[2]), int(m[3]), float(m[4]))
                    best = item if best is None or item[0] > best[0] else best
                    break
        return best

    def transitions(self, actions=None) -> list[dict]:
        return [r for r in self.records if r["kind"] == "transition" and (actions is None or r["action"] in actions)]

    # -- printing -------------------------------------------------------------------------------------------
    def _stamp(self) -> str:
        return f"[{time.monotonic() - self.t0:5.0f}s]"

    def _show(self, rec: dict) -> None:
        kind = rec["kind"]
        if kind == "transition":
            extra = f" idle {rec['idle_s']:.2f} s" if isinstance(rec.get("idle_s"), (int, float)) else ""
            helper = f" (helper job {rec['helper']})" if rec.get("helper") else ""
            self.echo(f"{self._stamp()} TRANSITION {rec['action']}: {rec.get('from_nodes')} -> {rec.get('to_nodes')}"
                      f" nodes, world {rec.get('world')}{helper}{extra}")
        elif kind == "measurement":
            if self._last_measure[1] == rec["nodes"] and time.monotonic() - self._last_measure[0] < 10:
                return   # one line per size change, else every 10 s: a window is only a few steps
            self._last_measure = (time.monotonic(), rec["nodes"])
            self.echo(f"{self._stamp()}   measured {rec['samples_per_s']:.1f} samples/s on {rec['nodes']} node(s), "
                      f"{rec['workers']} worker(s), step {rec['step_s'] * 1000:.0f} ms")
        elif kind == "decision":
            nodes = rec.get('target_nodes', rec.get('nodes'))
            self.echo(f"{self._stamp()}   decision ({rec.get('source')}): {rec.get('action')} -> "
                      f"{nodes} node{'' if nodes == 1 else 's'}: {rec.get('reason')}")
        elif kind == "plan":
            self.echo(f"{self._stamp()}   predictor plan: {rec.get('action')} {rec.get('nodes')}: {rec.get('reason')}")
        elif kind in ("helper_submitted", "slurm_shrink", "failure", "transition_failed"):
            fields = {k: v for k, v in rec.items() if k not in ("kind", "t")}
            self.echo(f"{self._stamp()}   {kind}: {json.dumps(fields)}")   # whole: a cut object reads as broken

    # -- steering -------------------------------------------------------------------------------------------
    def _nodes_now(self) -> int | None:
        moves = self.transitions()
        return moves[-1].get("to_nodes") if moves else None

    def _settled(self) -> bool:
        """A measurement at the current size, after the last transition, at least settle_s ago."""
        moves = self.transitions()
        if not moves:
            return False
        last_t = max(moves[-1]["t"], *(r["t"] for r in self.requests)) if self.requests else moves[-1]["t"]
        after = [r for r in self.records if r["kind"] == "measurement" and r["t"] > last_t]
        return bool(after) and time.time() - after[0]["t"] >= self.settle_s

    def _request(self, nodes: int, why: str) -> None:
        argv = [*self.ctl, "ctl", str(self.job_id), "--registry", str(self.registry), "--nodes", str(nodes)]
        self.echo(f"{self._stamp()} operator: elastic-launch ctl {self.job_id} --nodes {nodes}   ({why})")
        # when it was sent: the controller may carry it out before `ctl` (a Python start, then the reply) returns
        sent = time.time()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        reply = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if proc.returncode != 0:
            raise DemoError(f"elastic-launch ctl failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        self.requests.append({"t": sent, "nodes": nodes, "why": why, "reply": reply})

    def _submit_waiting_job(self) -> None:
        """Another user's job that needs one whole node more than is idle: it pends until the elastic job
        hands a node back (elastic-launch does that for a pending job of its partition, docs/launcher.md)."""
        idle = sum(1 for n in self.slurm.nodes() if n.state == "idle")
        want = idle + 1
        out = self.run_dir.parent / "other-user-%j.out"
        job = self.slurm.submit(f"#!/bin/bash\n#SBATCH --job-name=other-user --nodes={want} --exclusive "
                                f"--output={out}\nsleep 15\n")
        self.waiting_job = (job, time.time())
        self.echo(f"{self._stamp()} another user submits job {job}: {want} whole node{'s' if want > 1 else ''}, "
                  f"{idle} idle: it waits for one the demo job holds")

    def _steer(self) -> None:
        grew, shrank = bool(self.transitions(GROWS)), bool(self.transitions(SHRINKS))
        nodes = self._nodes_now()
        if nodes is not None and nodes > 1 and grew and self.waiting_job is None and not self.transitions(("shrink",)):
            self._submit_waiting_job()   # at once: before the autoscaler's next measurement may revert the grow
            return
        if nodes is None or (grew and shrank) or not self._settled():
            return
        pending = [r for r in self.records if r["kind"] in ("transition", "helper_submitted")]
        if pending and pending[-1]["kind"] == "helper_submitted" and time.time() - pending[-1]["t"] < 90:
            return   # the autoscaler's helper job is starting: its grow is on the way
        if self.requests and time.time() - self.requests[-1]["t"] < 90 and \
                not any(t["t"] > self.requests[-1]["t"] for t in self.transitions()):
            return   # the last request is still being carried out (a helper job takes a while to start)
        if not grew and nodes < self.max_nodes:
            self._request(min(nodes + 2, self.max_nodes), "no grow by the autoscaler yet: the demo asks for one")
        elif not shrank and nodes > 1 and self.waiting_job is not None and time.time() - self.waiting_job[1] > 60:
            self._request(max(1, nodes - 2), "no node handed back in 60 s: the demo shrinks the job")
        elif not grew:   # at the maximum and never grew: shrink first, the grow follows
            self._request(max(1, nodes - 2), "at the maximum: shrink first, then grow")

    # -- the loop -------------------------------------------------------------------------------------------
    def shown(self) -> bool:
        """The demo's events have happened: a grow, a shrink, and a measurement after the last of them (so the
        summary has a measured figure at every size the job ran)."""
        moves = self.transitions(GROWS + SHRINKS)
        if not (self.transitions(GROWS) and self.transitions(SHRINKS)):
            return False
        return any(r["kind"] == "measurement" and r["t"] > moves[-1]["t"] for r in self.records)

    def follow(self, timeout_s: float, poll_s: float = 0.3, until_shown: bool = False) -> str:
        """Print progress until the job ends (or, ``until_shown``, until :meth:`shown`); return its Slurm state.

        :raises DemoError: neither happened within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rec in self._new_records():
                self._show(rec)
            prog = self.progress()
            if prog is not None and prog[0] != self._last_step[2] and \
                    (prog[2] != self._last_step[1] or time.monotonic() - self._last_step[0] >= 4):
                self._last_step = (time.monotonic(), prog[2], prog[0])   # a new step only: no stale repeats
                self.echo(f"{self._stamp()} step {prog[0]}/{prog[1]}  workers {prog[2]}  {prog[3]:.1f} samples/s")
            if until_shown and self.shown():
                return self.state
            try:
                self.state = self.slurm.job(self.job_id).state
            except Exception:   # noqa: BLE001  squeue busy: try again next round
                pass
            if self.state in ENDED:
                for rec in self._new_records():
                    self._show(rec)
                return self.state
            if self.state == "RUNNING":
                self._steer()
            time.sleep(poll_s)
        raise DemoError(f"job {self.job_id} still {self.state} after {timeout_s:g} s\n"
                        f"{tail(self.run_dir / 'records.jsonl', 10)}")
