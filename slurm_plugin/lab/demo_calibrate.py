"""The demo's history seed: a short calibration of the demo model through the real elastic runtime.

`calibrate()` runs the demo's training script (`elastic_launcher.examples.resnet50 --arch resnet-tiny`) at
1 and 2 workers on this machine, outside Slurm, the way elastic-launch runs it: a `TCPStore`, one process per
worker with the ELASTIC_* environment, a first plan posted by a `Coordinator`. Rank 0 writes the runtime's
own observation records (per-bucket all-reduce timings, median step time). They are relabelled to what the
testbed's layouts are: one worker per node, every node this machine, so gloo's TCP runs over `loopback`, GPU type
`cpu`, by the launcher's own rules (`elastic_launcher.links`), so the predictor's history, the planner's
candidates and the running job's own measurements all speak about the same links.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

GPU = "cpu"
PROFILE = "resnet-tiny"
# The training script's options, shared by the calibration and the demo job (template resnet50 --cpu-test).
SCRIPT_OPTIONS = {"--arch": "resnet-tiny", "--image-size": "32", "--classes": "10", "--dataset-size": "512",
                  "--per-gpu-batch": "8", "--device": "cpu", "--profile": PROFILE}
MODULE = "elastic_launcher.examples.resnet50"


class CalibrationError(RuntimeError):
    """A calibration run failed; the message holds the workers' output tail."""


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """One calibration run: `workers` processes for `steps` steps.

    Attributes:
        workers: world size (one worker per pretend node).
        iter_s: the runtime's median step time.
        records: observation records, relabelled (see the module docstring).
        wall_s: the run's wall time, start to exit.
    """

    workers: int
    iter_s: float
    records: list
    wall_s: float

    @property
    def samples_per_s(self) -> float:
        return self.workers * int(SCRIPT_OPTIONS["--per-gpu-batch"]) / self.iter_s


def profile_body() -> dict:
    """The `POST /v1/profiles` body of the demo model (its real parameters, no weights)."""
    from elastic_launcher.examples import models  # noqa: PLC0415 - torch: off elastic-slurm's start
    from elastic_launcher.telemetry import tensor_profile  # noqa: PLC0415 - torch: off elastic-slurm's start

    return tensor_profile(models.build_resnet("resnet-tiny", int(SCRIPT_OPTIONS["--classes"])), PROFILE)


def testbed_links(workers: int):
    """The links of the testbed's layout `[1] * workers`: every pretend node is this machine, gloo over TCP, so
    `loopback` (`links.links_for` on this host's facts: the rule the launcher applies to the demo job)."""
    from elastic_launcher.links import HostFacts, links_for  # noqa: PLC0415 - off elastic-slurm's start

    return links_for([1] * workers, [HostFacts.probe("gloo")] * workers)


def relabel(records: list[dict], workers: int) -> list[dict]:
    """Observation records as the launcher labels the demo job's on the testbed (observations.relabel)."""
    from elastic_launcher.observations import relabel as launcher_relabel  # noqa: PLC0415 - off elastic-slurm's start

    return launcher_relabel(records, {workers: [1] * workers}, {workers: testbed_links(workers)}, PROFILE, GPU)


def run_once(workers: int, steps: int, work: Path, python: str = sys.executable,
             timeout: timedelta = timedelta(seconds=120)) -> CalibrationRun:
    """Train the demo model with `workers` local processes for `steps` steps.

    :raises CalibrationError: a worker failed or the run took longer than `timeout`.
    """
    import torch.distributed as dist  # noqa: PLC0415 - torch: off elastic-slurm's start

    from elastic_launcher import store_keys  # noqa: PLC0415 - off elastic-slurm's start
    from elastic_launcher.membership import Coordinator  # noqa: PLC0415 - torch: off elastic-slurm's start

    work.mkdir(parents=True, exist_ok=True)
    obs = work / f"calibration-{workers}.jsonl"
    obs.unlink(missing_ok=True)
    started = time.monotonic()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    argv = [python, "-m", MODULE, *[t for kv in SCRIPT_OPTIONS.items() for t in kv], "--steps", str(steps),
            "--log-every", str(steps), "--observations", str(obs)]
    procs, logs = [], []
    try:
        for i in range(workers):
            env = {"PATH": "/usr/bin:/bin", "ELASTIC_STORE_ADDR": f"127.0.0.1:{server.port}",
                   "ELASTIC_GROUP": f"jcal-n{i}-g1", "SLURM_LOCALID": "0", "ELASTIC_NODE": f"n{i}",
                   "ELASTIC_SLOTS": "1", "ELASTIC_JOB_ID": "cal", "OMP_NUM_THREADS": "1"}
            log = open(work / f"calibration-{workers}-w{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = started + timeout.total_seconds()
        joined = f"{store_keys.RUNTIME}/{store_keys.joined('')}"   # "elastic/joined/": a worker's first key
        while len([k for k in server.list_keys() if k.startswith(joined)]) < workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise CalibrationError(f"{workers} calibration worker(s) did not join:\n{_tail(work, workers)}")
            time.sleep(0.1)
        Coordinator(server, timeout=timeout).start([f"jcal-n{i}-g1-0" for i in range(workers)])
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise CalibrationError(f"calibration at {workers} worker(s) took more than "
                               f"{timeout.total_seconds():g} s:\n{_tail(work, workers)}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(p.returncode != 0 for p in procs) or not obs.exists():
        raise CalibrationError(f"calibration at {workers} worker(s) failed:\n{_tail(work, workers)}")
    records = relabel([json.loads(line) for line in obs.read_text().splitlines() if line.strip()], workers)
    steps_recs = [r for r in records if r["kind"] == "step"]
    if not steps_recs:
        raise CalibrationError(f"calibration at {workers} worker(s) wrote no step record:\n{_tail(work, workers)}")
    return CalibrationRun(workers, steps_recs[0]["iter_s"], records, time.monotonic() - started)


def _tail(work: Path, workers: int, lines: int = 15) -> str:
    out = []
    for path in sorted(work.glob(f"calibration-{workers}-w*.log")):
        text = path.read_text(errors="replace").splitlines()
        out.append(f"[{path}]\n" + "\n".join(text[-lines:]))
    return "\n".join(out)


if __name__ == "__main__":   # manual check: python -m slurm_plugin.lab.demo_calibrate DIR
    for n in (1, 2):
        run = run_once(n, 30, Path(sys.argv[1]))
        print(n, f"{run.iter_s:.4f}", f"{run.samples_per_s:.1f}", f"{run.wall_s:.1f}", len(run.records))
