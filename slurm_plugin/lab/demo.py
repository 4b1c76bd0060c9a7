"""`elastic-slurm demo`: the whole product on one machine, in a few minutes.

    elastic-slurm demo [--lab /var/tmp/elastic-slurm-demo] [--port-base 17000] [--steps 3000] [--keep]

1. brings up the local 4-node Slurm testbed in its own lab (`Testbed.up`);
2. starts `elastic-predictor serve` (gunicorn, detached, pid file, token and database in the lab) with a
   cluster file that says what the testbed is: one CPU worker per node, gloo over `shm`/`socket`; installs
   the job_submit hook pointing at it and reconfigures slurmctld;
3. seeds the history: runs the site's calibration job (`elastic-predictor calibrate`, sbatch on 2 nodes: the
   link's all-reduce sweep and DDP's host overhead, posted signed with the job's munge credential), then
   calibrates the demo model (resnet-tiny) at 1 and 2 workers through the real runtime and posts the
   runtime's step and all-reduce observations (slurm_plugin/lab/demo_calibrate.py);
4. renders the `resnet50` template's CPU variant and submits it with the real sbatch, whose hook line
   (`sbatch: elastic: ...`) says how the job was sized and why;
5. follows the job (records.jsonl, rank 0's log) through at least one grow (helper job) and one shrink: the
   autoscaler's own, or the demo asks like an operator (`elastic-launch ctl JOB --nodes N`);
6. prints a summary (layout and reason, predicted vs measured throughput, transitions with idle time,
   outcome) and stops everything it started, unless `--keep`.

One demo at a time per lab: `LabLock` holds an `flock` on `<lab>/demo.lock` for the demo's lifetime (the
file says which pid holds it and since when), and a second demo on the same lab is refused with that. A lab
left running by `--keep` is stopped by `elastic-slurm testbed down --lab LAB` (`stop_lab_services`: its jobs
cancelled, its predictor stopped, then the daemons).
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import click

from slurm_plugin import templates
from slurm_plugin.client import DEFAULT_PATH, Backend, CommandBackend
from slurm_plugin.errors import SlurmError, TestbedError
from slurm_plugin.lab import demo_calibrate as cal
from slurm_plugin.lab.demo_follow import ENDED, GROWS, SHRINKS, JobWatcher
from slurm_plugin.lab.demo_services import CHECKOUT, DemoError, PredictorService, install_hook, tail
from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.testbed_conf import PORT_SPAN, TestbedConfig, recorded_port_base

DEFAULT_DEMO_LAB = Path("/var/tmp/elastic-slurm-demo")
DEFAULT_DEMO_PORT_BASE = 17000   # the CI lab uses 16800; PORT_SPAN ports each
MAX_NODES = 4
LOCK_FILE = "demo.lock"


class DemoBusy(DemoError):
    """Another demo holds the lab's lock; the message says which (pid, lab, since when)."""


class LabLock:
    """An exclusive `flock` on `<lab>/demo.lock`, held while one demo runs in the lab.

    The holder writes its pid, lab, port base and start time into the file; the lock itself is the kernel's,
    so it goes away with the process however that ends (the file stays, and the next holder rewrites it).
    The descriptor is not inherited by the processes the demo starts (the detached predictor outlives it).

    Use as `with LabLock(lab).acquire(port_base): ...`.
    """

    def __init__(self, lab: Path):
        self.lab = Path(lab)
        self.path = self.lab / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, port_base: int | None = None) -> "LabLock":
        """Take the lock without waiting.

        Raises:
            DemoBusy: another process holds it (the message names its pid, lab and start time).
        """
        self.lab.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_info(fd)
            os.close(fd)
            raise DemoBusy(busy_message(self.lab, holder)) from None
        now = time.time()
        info = {"pid": os.getpid(), "lab": str(self.lab), "port_base": port_base, "since_s": now,
                "since": datetime.datetime.fromtimestamp(now).strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "LabLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @staticmethod
    def holder(lab: Path) -> dict | None:
        """Who holds the lab's lock now ({} when the holder has not written itself yet), None when no one."""
        path = Path(lab) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_info(fd)
        finally:
            os.close(fd)       # closing drops a lock this probe took
        return None


def _holder_info(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def busy_message(lab: Path, holder: dict, elsewhere: bool = True) -> str:
    """What a refused demo (or, `elsewhere` False, `testbed down`) says about the demo that holds the lab."""
    since = holder.get("since")
    ago = f" ({time.time() - holder['since_s']:.0f} s ago)" if isinstance(holder.get("since_s"), (int, float)) else ""
    who = (f"pid {holder.get('pid', '?')}, running since {since or '?'}{ago}"
           + (f", port base {holder['port_base']}" if holder.get("port_base") else ""))
    return (f"an elastic-slurm demo is running in lab {lab} ({who}; lock {Path(lab) / LOCK_FILE}): wait for it "
            f"to end (it stops what it started) or interrupt it (kill -INT {holder.get('pid', 'PID')})"
            + ("; or use another --lab and --port-base" if elsewhere else ""))


def lab_slurm(bed: Testbed) -> Backend:
    """A Slurm client for the lab's cluster. What it submits gets the lab's munged socket (jobs sign their writes
    with it) and never the predictor's tool token."""
    env = {"PATH": (bed.command_env() or {}).get("PATH", DEFAULT_PATH), "HOME": "/root",
           "ELASTIC_MUNGE_SOCKET": str(bed.config.munge_socket)}
    return CommandBackend(slurm_conf=bed.config.slurm_conf, env=env, timeout=timedelta(seconds=15),
                          update_timeout=timedelta(seconds=30))


def stop_lab_services(bed: Testbed, predictor: PredictorService | None = None) -> tuple[int, bool]:
    """Cancel the lab's unfinished jobs (when its cluster is up; waits up to 30 s for them to end) and stop the
    lab's predictor service (`LAB/predictor`, the demo's). The daemons are left to `Testbed.down`.

    Returns:
        (jobs cancelled, whether the predictor was running). Each step goes on when the other fails.
    """
    cancelled = 0
    with contextlib.suppress(Exception):
        if bed.is_up():
            slurm = lab_slurm(bed)
            for job in slurm.jobs():
                if job.state not in ENDED:
                    slurm.cancel(job.job_id)
                    cancelled += 1
            deadline = time.monotonic() + 30
            while cancelled and time.monotonic() < deadline and any(j.state not in ENDED for j in slurm.jobs()):
                time.sleep(0.5)
    stopped = (predictor or PredictorService(bed)).stop()
    return cancelled, stopped


def launcher_argv(python: str = sys.executable) -> list[str]:
    """elastic-launch beside the interpreter (job scripts get Slurm's minimal PATH), else the module."""
    exe = Path(python).parent / "elastic-launch"
    return [str(exe)] if exe.exists() else [python, "-m", "elastic_launcher.cli"]


class Demo:
    """One run of the demo; `run()` does the six steps, `stop()` undoes what was started."""

    def __init__(self, lab: Path, port_base: int, steps: int, calibration_steps: int, budget: timedelta,
                 echo=click.echo):
        self.bed = Testbed(TestbedConfig(lab=lab, port_base=port_base))
        self.predictor = PredictorService(self.bed)
        self.steps = steps
        self.calibration_steps = calibration_steps
        self.budget = budget
        self.echo = echo
        self.work = lab / "demo"
        self.t0 = time.monotonic()
        self.phases: dict[str, float] = {}
        self.job_id: int | None = None
        self.calibration: list[cal.CalibrationRun] = []
        self.calibration_job: dict = {}
        self.sbatch_lines: list[str] = []
        self.watcher: JobWatcher | None = None
        self.was_up = False          # the lab's cluster ran before this demo: leave it running at the end

    @contextlib.contextmanager
    def phase(self, name: str):
        self.echo(click.style(f"\n== {name}", bold=True))
        t = time.monotonic()
        yield
        self.phases[name] = time.monotonic() - t
        self.echo(f"   ({self.phases[name]:.1f} s)")

    def slurm(self):
        return lab_slurm(self.bed)

    # -- the steps ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.bed.config
        with self.phase(f"1/6 local Slurm cluster (lab {cfg.lab}, ports {cfg.port_base}..{cfg.port_base + PORT_SPAN - 1})"):
            self.was_up = self.bed.is_up()
            try:
                timings = self.bed.up()
            except TestbedError as exc:
                raise DemoError(f"the testbed did not start: {exc}") from None
            self.echo(f"   4 nodes idle; slurmctld port {cfg.ctld_port}; up in {timings['total']:.1f} s")
        with self.phase("2/6 predictor service and job_submit hook"):
            self.predictor.start()
            self.echo(f"   elastic-predictor serve on {self.predictor.url} (pid {self.predictor.pid()}, "
                      f"db {self.predictor.db}, token in {self.predictor.dir / 'token'})")
            self.echo("   cluster: node[1-4], 1 worker per node, gpu 'cpu', link loopback (gloo's TCP; every node "
                      "is this host)")
            written = install_hook(self.bed, self.predictor.url, self.budget)
            self.echo(f"   hook: {', '.join(p.name for p in written)} in {cfg.etc}; JobSubmitPlugins=lua; "
                      f"scontrol reconfigure done (budget {self.budget.total_seconds() * 1000:g} ms)")
        with self.phase("3/6 history: the calibration job, then resnet-tiny at 1 and 2 workers through the runtime"):
            self.calibrate_cluster()
            self.seed()
        with self.phase("4/6 render the resnet50 template (CPU variant) and sbatch it"):
            self.submit()
        with self.phase(f"5/6 follow job {self.job_id}"):
            self.follow()
        with self.phase("6/6 summary"):
            summary = self.summary()
        return summary

    def calibrate_cluster(self, timeout_s: float = 300.0) -> None:
        """The site's calibration job on 2 of the lab's nodes (`elastic-predictor calibrate`, shortened: a 4 s
        sweep, 3 rounds of 0.1 s windows), waited for; its rows go to the service signed for the job."""
        from slurm_plugin.calibration import job_script  # noqa: PLC0415 - elastic-slurm's start needs it only for a demo

        shutil.rmtree(self.work, ignore_errors=True)     # the demo's own directory: no records of an older run
        self.work.mkdir(parents=True)
        script = self.work / "calibrate.sbatch"
        script.write_text(job_script(self.predictor.url, nodes=2, ranks_per_node=1, gpus_per_node=1,
                                     python=sys.executable, output=str(self.work / "elastic-calibrate-%j.out"),
                                     out=str(self.work / "elastic-calibrate-%j.jsonl"), sweep_budget_s=4, rounds=3,
                                     window_s=0.1))
        self.echo(f"   like: elastic-predictor calibrate --predictor {self.predictor.url} --nodes 2 --gpus-per-node 1 "
                  f"--submit  (script {script})")
        slurm = self.slurm()
        try:   # the job runs this checkout's code, as the service does
            job_id = slurm.sbatch(script, ["--chdir", str(self.work), f"--export=ALL,PYTHONPATH={CHECKOUT}"]).job_id
        except SlurmError as exc:
            raise DemoError(f"sbatch of the calibration job failed: {exc}") from None
        started, state = time.monotonic(), "PENDING"
        while time.monotonic() - started < timeout_s:
            state = slurm.job(job_id).state
            if state in ENDED:
                break
            time.sleep(1.0)
        log_path = self.work / f"elastic-calibrate-{job_id}.out"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        if state != "COMPLETED" or f"signed for job {job_id}" not in log:
            with contextlib.suppress(SlurmError):
                slurm.cancel(job_id)
            raise DemoError(f"calibration job {job_id} ended {state} without posting its rows\n{log[-2000:]}")
        for line in log.splitlines():
            if line.startswith(("calibrate:", "  probe", "  host")):
                self.echo(f"   {line.strip()}")
        self.calibration_job = {"job_id": job_id, "wall_s": time.monotonic() - started}

    def seed(self) -> None:
        self.predictor.post("/v1/profiles", cal.profile_body())
        for workers in (1, 2):
            run = cal.run_once(workers, self.calibration_steps, self.work / "calibration")
            self.calibration.append(run)
            stored = self.predictor.post("/v1/observations", run.records)
            kinds = {k: sum(r["kind"] == k for r in run.records) for k in ("step", "collective")}
            self.echo(f"   {workers} worker(s): {run.iter_s * 1000:.1f} ms/step = {run.samples_per_s:.1f} samples/s "
                      f"({self.calibration_steps} steps, {run.wall_s:.1f} s); posted {kinds['step']} step + "
                      f"{kinds['collective']} collective observation(s): {stored.get('stored')} stored")
        # read your writes: the curve (and the plan sbatch gets next) comes from a model that holds both runs
        reply = self.predicted(stored["model_version_pending"], timeout_s=60)
        curve = "  ".join(f"{len(p['layout'])}x1: {p['samples_per_s']:.0f}" for p in reply["predictions"])
        self.echo(f"   fitted (model version {reply.get('model_version')}); predicted samples/s: {curve}")

    def predicted(self, min_version, timeout_s: float) -> dict:
        """`/v1/predict` for the demo's model from a model version >= ``min_version`` (an integer, or `g<N>`)."""
        body = {"profile": cal.PROFILE, "gpu": cal.GPU, "per_gpu_batch": int(cal.SCRIPT_OPTIONS["--per-gpu-batch"]),
                "min_model_version": min_version, "wait_ms": 8000}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.predictor.post("/v1/predict", body)
            except DemoError as exc:
                if exc.http_status != 503 or time.monotonic() > deadline:  # 503: that version not fitted yet
                    raise DemoError(f"the predictor did not fit the history within {timeout_s:.0f} s: {exc}\n"
                                    f"{tail(self.predictor.log_file)}") from None
                time.sleep(0.5)

    def submit(self) -> None:
        run_dir, registry = self.work / "run", self.work / "registry"
        params = templates.Params(
            cpu_test=True, gpus=f"1-{MAX_NODES}", python=sys.executable, launcher=launcher_argv(),
            directives={"model": cal.PROFILE, "gpu_type": cal.GPU},
            sbatch={"job-name": "demo-resnet50", "ntasks-per-node": "1", "output": str(self.work / "%x-%j.out")},
            script_options={"--steps": str(self.steps), "--log-every": "25", "--profile": cal.PROFILE},
            launcher_options={"--predictor": self.predictor.url, "--run-dir": str(run_dir),
                              "--registry": str(registry), "--straggler-ratio": "1000"})
        script = self.work / "job.sbatch"
        script.write_text(templates.render(templates.get("resnet50"), params))
        self.echo(f"   like: elastic-slurm template new resnet50 --cpu-test --gpus 1-{MAX_NODES} "
                  f"--gpu-type cpu --steps {self.steps} --out {script}"
                  f" (plus --ntasks-per-node=1, paths, --predictor)")
        self.echo("   request as written: " + "  ".join(
            line for line in script.read_text().splitlines() if line.startswith(("#SBATCH --nodes", "#SBATCH --gpus",
                                                                                "#ELASTIC"))))

        try:
            sub = self.slurm().sbatch(script, ["--chdir", str(self.work)])
        except SlurmError as exc:
            raise DemoError(f"sbatch failed: {exc}") from None
        self.job_id = sub.job_id
        self.sbatch_lines = [line for line in sub.stderr.splitlines() if line.strip()]
        self.echo(f"   $ sbatch {script.name}")
        for line in self.sbatch_lines:
            self.echo(click.style(f"   {line}", fg="green"))
        self.echo(f"   Submitted batch job {self.job_id}")
        if not any("elastic:" in line for line in self.sbatch_lines):
            raise DemoError("sbatch printed no line from the elastic hook (is JobSubmitPlugins=lua active?)\n"
                            f"{tail(self.bed.config.lab / 'log' / 'slurmctld.log')}")

    def follow(self) -> None:
        self.watcher = JobWatcher(self.job_id, self.work / "run", self.work / "registry", launcher_argv(),
                                  self.slurm(), MAX_NODES, self.echo)
        state = self.watcher.follow(timeout_s=480, until_shown=True)
        if state not in ENDED:   # the grow and the shrink are shown: the rest of its steps would only add time
            self.echo(f"   job {self.job_id} went through its grow and shrink: the demo ends it (scancel; it "
                      f"saves a checkpoint on SIGTERM, see docs/user-guide.md)")
            self.slurm().cancel(self.job_id)
            state = self.watcher.follow(timeout_s=60)
            self.watcher.ended_by_demo = True
        out = self.job_output()
        if state not in ("COMPLETED", "CANCELLED") or (state == "CANCELLED" and not self.watcher.ended_by_demo):
            raise DemoError(f"job {self.job_id} ended {state}\n{out[-2000:]}")
        missing = [what for what, acts in (("grow", GROWS), ("shrink", SHRINKS)) if not self.watcher.transitions(acts)]
        if missing:
            raise DemoError(f"job {self.job_id} finished without a {' and a '.join(missing)}: raise --steps "
                            f"(now {self.steps})")

    def job_output(self) -> str:
        found = sorted(self.work.glob(f"*-{self.job_id}.out"))
        return found[0].read_text(errors="replace") if found else ""

    # -- the summary ----------------------------------------------------------------------------------------
    def summary(self) -> dict:
        w = self.watcher
        comment = ""
        with contextlib.suppress(Exception):
            comment = self.slurm().job(self.job_id).comment
        decision_id = comment.split("elastic:decision=", 1)[1].split()[0] if "elastic:decision=" in comment else None
        decision = self.predictor.get(f"/v1/decisions/{decision_id}") if decision_id else {}
        response = decision.get("response", decision)
        start = next((r for r in w.transitions(("start",))), {})
        reason = next((ln.split("elastic:", 1)[1].strip() for ln in self.sbatch_lines if "elastic:" in ln), "")
        predicted = {len(c["layout"]): c.get("samples_per_s") for c in response.get("curve", []) if "layout" in c}
        # the model after the job: a version newer than the submit-time one (it holds the job's own rows)
        after, after_version = {}, None
        version = str(response.get("model_version") or "")
        if version[1:].isdigit():
            with contextlib.suppress(DemoError):
                reply = self.predicted(int(version[1:]) + 1, timeout_s=30)
                after_version = reply.get("model_version")
                after = {len(p["layout"]): p.get("samples_per_s") for p in reply["predictions"]}
        by_size: dict[int, list[float]] = {}
        for r in w.records:
            if r["kind"] == "measurement":
                by_size.setdefault(r["nodes"], []).append(r["samples_per_s"])
        measured = {n: statistics.median(xs) for n, xs in by_size.items()}
        calibrated = {run.workers: run.samples_per_s for run in self.calibration}
        out_lines = self.job_output().strip().splitlines()
        final = {}
        with contextlib.suppress(ValueError, IndexError):
            final = json.loads(out_lines[-1])
        e = self.echo
        e(f"   chosen layout: {start.get('to_nodes')} node(s) x 1 worker   (sbatch: elastic: {reason})")
        e(f"   samples/s  {'nodes':>5}  {'calibrated':>10}  {'predicted':>10}  {'after job':>10}  "
          f"{'measured (median, windows)':>27}")
        for n in sorted(set(predicted) | set(measured) | set(calibrated)):
            p, m, c, a = predicted.get(n), measured.get(n), calibrated.get(n), after.get(n)
            windows = f"{m:.1f} ({len(by_size[n])})" if m is not None else "-"
            e(f"   {'':9}  {n:>5}  {_num(c, 1):>10}  {_num(p, 1):>10}  {_num(a, 1):>10}  {windows:>27}")
        e(f"   predicted: at submit time (model {version or '?'}); after job: the model that holds this job's own "
          f"rows ({after_version or 'none fitted within 30 s'})")
        e(f"   {'transition':<12} {'nodes':>8} {'idle_s':>7} {'pause_s':>8} {'wall_s':>7}  how")
        for t in w.transitions():
            how = "" if t["action"] == "start" else \
                "operator (ctl)" if t.get("reason") == "operator request" else f"autoscaler: {t.get('reason', '')}"
            if t.get("helper"):
                how += f"; helper job {t['helper']}"
            e(f"   {t['action']:<12} {str(t.get('from_nodes')) + '->' + str(t.get('to_nodes')):>8} "
              f"{_num(t.get('idle_s'), 2):>7} {_num(t.get('pause_s'), 2):>8} {_num(t.get('wall_s'), 1):>7}  {how}")
        plans = [r for r in w.records if r["kind"] == "plan"]
        if plans:
            e(f"   the launcher's last plan (history now includes this job's own measurements): {plans[-1]['reason']}")
        outcome = final.get("outcome", "ended by the demo" if w.ended_by_demo else w.state.lower())
        e(f"   outcome: job {self.job_id} {w.state}, launcher outcome {outcome}, final nodes "
          f"{final.get('final_nodes', w._nodes_now())}; "
          f"{len(w.requests)} operator request(s)")
        total = time.monotonic() - self.t0
        e("   phases: " + "  ".join(f"{name.split(' ', 1)[0]} {s:.1f}s" for name, s in self.phases.items())
          + f"  total {total:.1f}s")
        return {"job_id": self.job_id, "reason": reason, "predicted": predicted, "predicted_after": after,
                "after_model_version": after_version, "measured": measured,
                "calibrated": calibrated, "calibration_job": self.calibration_job,
                "transitions": w.transitions(), "outcome": outcome, "state": w.state, "wall_s": total}

    # -- cleanup --------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel the lab's jobs, stop the predictor and the testbed (each step tolerant of the others)."""
        _, stopped = stop_lab_services(self.bed, self.predictor)
        if not self.was_up:
            try:
                self.bed.down()
            except TestbedError as exc:
                self.echo(f"could not stop the testbed: {exc}", err=True)
        self.echo(f"stopped: jobs cancelled, predictor {'stopped' if stopped else 'was not running'}, "
                  + (f"testbed down (lab {self.bed.config.lab} kept for its logs)" if not self.was_up else
                     f"testbed left up: it ran before the demo (elastic-slurm testbed down --lab {self.bed.config.lab})"))

    def keep_hint(self) -> None:
        lab, db = self.bed.config.lab, self.predictor.db
        batch = cal.SCRIPT_OPTIONS["--per-gpu-batch"]
        self.echo(f"\nleft running (--keep): look around with\n"
                  f"  eval \"$(elastic-slurm testbed env --lab {lab})\"; squeue; sacct -j {self.job_id}\n"
                  f"  elastic-predictor decisions --db {db}\n"
                  f"  elastic-predictor predict --db {db} --cluster {self.predictor.dir / 'cluster.json'} "
                  f"--profile {cal.PROFILE} --gpu {cal.GPU} --per-gpu-batch {batch}\n"
                  f"  curl {self.predictor.url}/admin   (the /admin page; open it in a browser)\n"
                  f"  less {self.work}/run/records.jsonl\n"
                  f"stop it all (jobs, predictor, cluster): elastic-slurm testbed down --lab {lab}")


def _num(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


@click.command("demo")
@click.option("--lab", type=click.Path(file_okay=False, path_type=Path), envvar="ELASTIC_SLURM_LAB",
              default=DEFAULT_DEMO_LAB, show_default=True,
              help="Lab directory of the demo's own cluster (env ELASTIC_SLURM_LAB, as for `testbed`; under "
                   "/var/tmp: daemons run as munge and mysql).")
@click.option("--port-base", type=click.IntRange(1024, 65535 - PORT_SPAN), envvar="ELASTIC_SLURM_PORT_BASE",
              help=f"First of the {PORT_SPAN} ports of the lab, the predictor takes the last (env "
                   f"ELASTIC_SLURM_PORT_BASE; default: the one the lab last used, else {DEFAULT_DEMO_PORT_BASE}).")
@click.option("--steps", type=click.IntRange(200, 100000), default=3000, show_default=True,
              help="Training steps of the demo job (enough for a grow and a shrink).")
@click.option("--calibration-steps", type=click.IntRange(12, 1000), default=30, show_default=True,
              help="Steps of each calibration run (1 and 2 workers).")
@click.option("--budget-ms", type=click.IntRange(1, 10000), default=1000, show_default=True,
              help="The hook's time budget per /v1/plan call (production default 100 ms; the demo shares 2 "
                   "busy cores with the cluster).")
@click.option("--keep", is_flag=True, help="Leave the cluster, the predictor and the job's files running to look "
                                           "around (prints how), instead of stopping them.")
def demo_command(lab: Path, port_base: int | None, steps: int, calibration_steps: int, budget_ms: int,
                 keep: bool) -> None:
    """Run the whole thing locally: cluster, predictor, hook, a real elastic job that grows and shrinks.

    Run it as root, with the packages `bash .ci/setup` installs. Takes 1-4 minutes on 2 cores (the README has the
    measured times). One demo at a time per lab (a second one is refused, naming the first). With --keep, look around afterwards: eval
    "$(elastic-slurm testbed env --lab LAB)"; squeue; elastic-predictor decisions --db
    LAB/predictor/predictor.db; elastic-predictor predict ... --cluster LAB/predictor/cluster.json; the
    /admin page of the printed URL; then stop it all with elastic-slurm testbed down --lab LAB.

    Example: elastic-slurm demo --lab /var/tmp/elastic-slurm-demo --port-base 17000 --keep
    """
    lab = lab.absolute()
    port_base = port_base or recorded_port_base(lab) or DEFAULT_DEMO_PORT_BASE
    run = Demo(lab, port_base, steps, calibration_steps, timedelta(milliseconds=budget_ms))
    try:
        lock = LabLock(run.bed.config.lab).acquire(port_base)
    except DemoBusy as exc:
        raise click.ClickException(str(exc)) from None
    with lock:
        click.echo(f"elastic-slurm demo: lab {run.bed.config.lab}, port base {port_base}, job steps {steps}")
        ok = False
        try:
            summary = run.run()
            ok = True
        except (DemoError, cal.CalibrationError) as exc:
            raise click.ClickException(f"demo failed: {exc}") from None
        finally:
            if keep and ok:
                run.keep_hint()
            else:
                if not ok:
                    click.echo(f"demo failed after {time.monotonic() - run.t0:.1f} s; stopping what it started "
                               f"(logs stay in {run.bed.config.lab}/log and {run.work})", err=True)
                run.stop()
    click.echo(f"demo done in {summary['wall_s']:.1f} s" + ("" if keep else " (all stopped)"))


if __name__ == "__main__":
    demo_command()
