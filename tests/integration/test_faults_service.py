"""Fault injection (issue 8, part 4, service half): the predictor SIGKILLed and restarted during a storm of
`#ELASTIC` submissions through the real job_submit hook on the testbed.

`elastic-predictor serve` (2 gunicorn workers, its own process group) runs on a history with the resnet50
profile and step records; submitter threads run `sbatch -H` (held: nothing runs) with `#ELASTIC` lines
while a killer SIGKILLs the whole service and starts it again on the same database and port, several
times. Every submission must succeed (the hook fails open) and none may take longer than the hook's
budget plus slack (slurmctld runs the hook one call at a time, so a submission queued behind others can
wait up to SUBMITTERS budgets: 0.9 s here, still under the 1.3 s limit).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.integration.test_hook import REAL, STEPS, bed, hook, script  # noqa: F401 - fixtures

BUDGET_MS = 300
SUBMITTERS = 3
SLACK_S = 1.0            # sbatch start-up and a loaded 2-core host
KILLS = 4
STORM_S = 24.0
PAUSE_S = 0.05


class Service:
    """`elastic-predictor serve` in its own session, so SIGKILL reaches the master and every worker."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.db = workdir / "predictor.db"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.exe = str(Path(sys.executable).parent / "elastic-predictor")
        run = dict(capture_output=True, text=True, timeout=120, check=True)
        subprocess.run([self.exe, "profile", "torchvision:resnet50", "--db", str(self.db)], **run)
        steps = workdir / "steps.jsonl"
        steps.write_text("".join(
            json.dumps({"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": layout, "intra_link": "nvlink",
                        "inter_link": "ib", "per_gpu_batch": 64, "iter_s": iter_s * (1 + 0.01 * rep)}) + "\n"
            for layout, iter_s in STEPS for rep in range(2)))
        subprocess.run([self.exe, "import", "--db", str(self.db), str(steps)], **run)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, wait: bool = True) -> float:
        t0 = time.monotonic()
        with open(self.workdir / "predictor.log", "ab") as log:
            self.proc = subprocess.Popen(
                [self.exe, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--db", str(self.db),
                 "--workers", "2"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                # TTL 0: the hook's decision cache would answer the storm's identical submissions without
                # asking the service, and this test is about every submission meeting a dying service
                env={**os.environ, "ELASTIC_PREDICTOR_TOKEN": "t", "ELASTIC_PREDICTOR_REFIT_DEBOUNCE_S": "0.2",
                     "ELASTIC_PREDICTOR_PLAN_CACHE_TTL_S": "0"})
        self.starts += 1
        deadline = time.monotonic() + 60
        while wait:
            try:
                if requests.get(self.url + "/healthz", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"serve did not come up: {(self.workdir / 'predictor.log').read_text()[-2000:]}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def wait_for_rewrite(self, seconds: float = 60) -> None:
        probe = {"source": "cli", "directives": REAL.splitlines(), "job": {"min_nodes": 1, "max_nodes": 1}}
        deadline = time.monotonic() + seconds
        while requests.post(self.url + "/v1/plan", json=probe, timeout=5).json().get("action") != "rewrite":
            if time.monotonic() > deadline:
                pytest.fail("the predictor never planned a rewrite for resnet50")
            time.sleep(0.3)


@pytest.fixture
def service(tmp_path):
    svc = Service(tmp_path)
    svc.start()
    svc.wait_for_rewrite()
    yield svc
    svc.kill()


def test_service_sigkilled_and_restarted_during_submission_storm(hook, service, bed, tmp_path):
    hook(service.url, budget_ms=BUDGET_MS, failures=1000)
    env = bed.env(path="/usr/bin:/bin:/usr/sbin:/sbin")
    path = tmp_path / "storm.sh"
    path.write_text(script(directives=REAL))
    results: list[tuple[int, float, str, str]] = []     # rc, seconds, stdout, stderr
    lock = threading.Lock()
    stop = threading.Event()

    def submitter() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                proc = subprocess.run(["sbatch", "--parsable", "-H", "--output=/dev/null", str(path)],
                                      capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
                item = (proc.returncode, time.monotonic() - t0, proc.stdout, proc.stderr)
            except subprocess.TimeoutExpired:
                item = (-1, time.monotonic() - t0, "", "sbatch timed out after 60 s")
            with lock:
                results.append(item)
            time.sleep(PAUSE_S)                         # keep the job count well under MaxJobCount

    threads = [threading.Thread(target=submitter, daemon=True) for _ in range(SUBMITTERS)]
    restarts = []
    try:
        for t in threads:
            t.start()
        t_end = time.monotonic() + STORM_S
        for _ in range(KILLS):
            time.sleep(STORM_S / (KILLS + 1))
            service.kill()                               # SIGKILL master + workers mid-storm
            time.sleep(0.3)                              # a moment with the port closed
            restarts.append(service.start())
        time.sleep(max(0.0, t_end - time.monotonic()))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=90)
        job_ids = [r[2].strip().split(";")[0] for r in results if r[0] == 0 and r[2].strip()]
        if job_ids:
            subprocess.run(["scancel", *job_ids], env=env, capture_output=True, timeout=60)

    failed = [r for r in results if r[0] != 0 or not r[2].strip().split(";")[0].isdigit()]
    limit = BUDGET_MS / 1000 + SLACK_S
    slow = [r for r in results if r[1] > limit]
    rewritten = sum("elastic: " in r[3] and "skipped" not in r[3] for r in results)
    skipped = sum("prediction skipped" in r[3] for r in results)
    seconds = sorted(r[1] for r in results)
    print(f"\nstorm: submissions={len(results)} failed={len(failed)} over_limit({limit:.1f}s)={len(slow)} "
          f"rewritten={rewritten} failed_open={skipped} kills={KILLS} restart_s={[round(x, 2) for x in restarts]} "
          f"sbatch_s median={seconds[len(seconds) // 2]:.3f} max={seconds[-1]:.3f}")
    assert len(results) >= 50, "the storm was too small to mean anything"
    assert not failed, f"{len(failed)} submissions failed, e.g. {failed[:2]}"
    assert not slow, f"{len(slow)} submissions took over {limit:.1f} s, e.g. {slow[:2]}"
    assert rewritten > 0 and skipped > 0, "the storm should see both a live service and a dead one"
