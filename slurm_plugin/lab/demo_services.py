"""The demo's predictor service and hook, all of it inside the demo's lab directory.

`PredictorService` runs `elastic-predictor serve` (gunicorn) detached, with its own pid file, log, token,
database, munge-signed job writes checked against the lab's Slurm, and a cluster file that describes the testbed as it is: every node holds one training worker, and
the workers are CPU processes talking gloo (GPU type `cpu`, `shm` within a node, `socket` between nodes).
It listens on the last port of the lab's block (`port_base + PORT_SPAN - 1`), so two labs never collide.

`install_hook` puts job_submit.lua next to the lab's slurm.conf with the project's installer, adds
`JobSubmitPlugins=lua` through the testbed and reconfigures slurmctld.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

from slurm_plugin.errors import SlurmError
from slurm_plugin.installer import InstallError, PluginConfig, install
from slurm_plugin.lab import gpu_types
from slurm_plugin.lab.demo_calibrate import testbed_links
from slurm_plugin.lab.testbed import Testbed, port_open, process_alive
from slurm_plugin.lab.testbed_conf import LEAVES, PARTITION, PORT_SPAN


# The service runs this checkout's code (its cwd is the lab, where `-m predictor.cli` would find an installed copy).
CHECKOUT = Path(__file__).resolve().parents[2]


class DemoError(RuntimeError):
    """A part of the demo could not start or did not behave; the message says which and shows its log.
    `http_status`: the predictor's HTTP status when that is what failed, else None."""

    def __init__(self, message: str, http_status: int | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status


def tail(path: Path, lines: int = 25) -> str:
    try:
        return f"[{path}]\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"[{path}: not readable]"


class PredictorService:
    """One detached `elastic-predictor serve` for a lab.

    Args:
        testbed: the lab it describes (nodes, partition, switches come from its config).
        python: interpreter that runs `predictor.cli` (the one running the demo).
        timeout: how long `start` waits for /healthz and `stop` for the exit after SIGTERM.
    """

    def __init__(self, testbed: Testbed, python: str = sys.executable, timeout: timedelta = timedelta(seconds=30)):
        self.testbed = testbed
        self.python = python
        self.timeout = timeout
        self.dir = testbed.config.lab / "predictor"
        self.port = testbed.config.port_base + PORT_SPAN - 1
        # the gunicorn master this object started (waited for by `stop`), None when it started none
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.dir / "serve.pid"

    @property
    def log_file(self) -> Path:
        return self.dir / "serve.log"

    @property
    def db(self) -> Path:
        return self.dir / "predictor.db"

    @property
    def token(self) -> str:
        return (self.dir / "token").read_text().strip()

    def cluster(self) -> dict:
        """The cluster file: the testbed's nodes and switches, one CPU worker per node in the default partition,
        and the typed partitions with their GPU types and costs (slurm_plugin/lab/gpu_types.py)."""
        cfg = self.testbed.config

        links = testbed_links(2)  # the links the launcher will label the demo job's multi-node records with

        return {"default_partition": PARTITION, "partitions": [{
            "name": PARTITION, "nodes": cfg.node_names(), "gpus_per_node": 1, "gpu": "cpu",
            "intra_link": links.intra, "inter_link": links.inter,
            "switches": {leaf: [f"node{i}" for i in members] for leaf, members in LEAVES}},
            *gpu_types.partitions(cfg)]}

    def seed_gpu_types(self, profile_body: dict) -> dict:
        """Register a model (`POST /v1/profiles` body) and post its synthetic step history on every GPU type of
        the lab (`gpu_types.seed_records`), so `/v1/plan` can compare the typed partitions for it; return the
        service's answer to the records.

        :raises DemoError: the service refused the profile or the records.
        """
        self.post("/v1/profiles", profile_body)
        return self.post("/v1/observations", gpu_types.seed_records(self.testbed.config, profile_body["name"]))

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            mine = f"--port\0{self.port}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if mine and process_alive(pid) else None

    def start(self, fresh: bool = True) -> None:
        """Start the service (a fresh database unless `fresh` is False) and wait for /healthz.

        :raises DemoError: it exited or did not answer in time (with its log tail).
        """
        if self.pid() is not None:
            self.stop()
        if port_open(self.port):
            raise DemoError(f"port {self.port} (port base + {PORT_SPAN - 1}, the predictor's) is in use by another "
                            f"process: choose another --port-base")
        if fresh:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        token_file = self.dir / "token"
        if not token_file.exists():
            token_file.write_text(secrets.token_hex(16) + "\n")
            token_file.chmod(0o600)
        (self.dir / "cluster.json").write_text(json.dumps(self.cluster(), indent=1) + "\n")
        env = self.service_env()
        argv = [self.python, "-m", "predictor.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--db", str(self.db), "--cluster", str(self.dir / "cluster.json"), "--workers", "2"]
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=self.dir, start_new_session=True)
        self._proc = proc
        self.pid_file.write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + self.timeout.total_seconds()
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DemoError(f"elastic-predictor serve exited {proc.returncode}\n{tail(self.log_file)}")
            try:
                self.get("/healthz")
                return
            except (OSError, DemoError):
                time.sleep(0.2)
        self.stop()
        raise DemoError(f"elastic-predictor serve did not answer on {self.url} within "
                        f"{self.timeout.total_seconds():g} s\n{tail(self.log_file)}")

    def service_env(self) -> dict[str, str]:
        """The service's environment: the tool token (the demo's own calibration imports use it) and munge for
        jobs, checked against the lab's Slurm, so a job writes its rows with its own credential, never the tool
        token (#45.3: the lab's service took no munge credentials, and the demo gave its job the token)."""
        bed = self.testbed.config
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
                "ELASTIC_PREDICTOR_TOKEN": self.token, "PYTHONPATH": str(CHECKOUT),
                "ELASTIC_PREDICTOR_MUNGE": "1", "ELASTIC_PREDICTOR_MUNGE_SOCKET": str(bed.munge_socket),
                "ELASTIC_PREDICTOR_SLURM_CONF": str(bed.slurm_conf)}

    def stop(self) -> bool:
        """SIGTERM the gunicorn master (it stops its workers), SIGKILL its group after the timeout.
        Returns whether it was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while time.monotonic() < deadline and process_alive(pid):
            time.sleep(0.1)
        if process_alive(pid):
            os.killpg(pid, signal.SIGKILL)
        if self._proc is not None and self._proc.pid == pid:
            self._proc.wait(timeout=self.timeout.total_seconds())   # reap it: no zombie, no ResourceWarning
            self._proc = None
        self.pid_file.unlink(missing_ok=True)
        return True

    # -- HTTP -----------------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body=None, timeout: float = 10.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise DemoError(f"{method} {path}: HTTP {exc.code}: {exc.read()[:500]!r}", exc.code) from None

    def get(self, path: str):
        return self._call("GET", path)

    def post(self, path: str, body):
        return self._call("POST", path, body)


def install_hook(testbed: Testbed, predictor_url: str, budget: timedelta) -> list[Path]:
    """Install job_submit.lua for `predictor_url` into the lab, enable it and reconfigure slurmctld.

    :raises DemoError: the installer or `scontrol reconfigure` failed.
    """
    config = PluginConfig(conf_dir=testbed.config.etc, predictor_url=predictor_url, budget=budget)
    try:
        written = install(config)
        testbed.set_slurm_conf_lines(config.slurm_conf_lines())
        testbed.reconfigure()
    except (InstallError, SlurmError) as exc:
        raise DemoError(f"cannot install the job_submit hook: {exc}\n"
                        f"{tail(testbed.config.lab / 'log' / 'slurmctld.log')}") from None
    return written
