"""A local 4-node Slurm cluster (22.05 from the host, or 24.11 from a Debian 13 root) for tests and the demo,
all of it under one lab directory.

    elastic-slurm testbed up   [--lab DIR] [--port-base N] [--slurm 24.11]  # start (idempotent), wait for 4 idle nodes
    elastic-slurm testbed down [--lab DIR] [--wipe]          # stop this lab's daemons (and wipe its data)
    elastic-slurm testbed status [--lab DIR]                 # exit 1 unless up
    eval "$(elastic-slurm testbed env [--lab DIR])"          # SLURM_CONF for sinfo/sbatch/...

Defaults: lab /var/tmp/elastic-slurm-lab (env ELASTIC_SLURM_LAB), port base 16800 or the one the lab
last used (env ELASTIC_SLURM_PORT_BASE); ports are listed in slurm_plugin/lab/testbed_conf.py. The lab must
be reachable by the munge and mysql users (not under a 0700 directory such as pytest's tmp_path).

Slurm releases: `TestbedConfig(slurm="22.05")` (the default) runs the host's slurm-wlm. `slurm="24.11"` runs
every daemon and command inside a cached Debian 13 root (slurm_plugin/lab/root.py: built on first use, then
reused; the lab's directory is the same path inside and out). The lab's `bin/` then holds wrappers for the
Slurm client commands, and `env()` puts it first on PATH, so `sbatch` in a shell, a test or a job is 24.11's.
A lab keeps its release (etc/slurm_version) until it is stopped.

`Testbed(TestbedConfig(lab=..., port_base=...)).up()` starts, in order: its own munged (own key and
socket, so labs never share or kill each other's munge), MariaDB on an own datadir, slurmdbd,
slurmctld and one slurmd per node (`node1`..`node4`, 4 fake GPUs each on mknod'ed char devices,
cons_tres, topology/tree with leaf1=node[1-2] and leaf2=node[3-4], partition `debug`). It then
waits until every node is idle. `up` is idempotent: daemons already running (pid file, live
process that is ours) are left alone. A daemon that fails raises `TestbedError` with its log tail.

`down()` stops exactly the daemons whose pid files are in this lab and whose process is verifiably
this lab's (its SLURM_CONF, socket or datadir), with SIGTERM, then SIGKILL after
`stop_timeout` (a slurmd stuck in registration ignores SIGTERM). `down(wipe=True)` also removes the
state, spool, database and logs together (job ids restart at 1, so state and DB go as one).

Fault injection (tests/integration/test_faults_slurm.py): `stop_controller()` / `start_controller()`
crash and restart slurmctld, `kill_node(node)` SIGKILLs a node's slurmd, its slurmstepd processes and their
tasks (a node death on this one-host cluster), `revive_node(node)` brings it back to service; `stepds()`
lists the lab's live slurmstepd processes.

Hook for the installer (slurm_plugin/installer.py): put job_submit.lua / cli_filter.lua into
`testbed.config.etc` (next to slurm.conf), then call

    testbed.set_slurm_conf_lines(["JobSubmitPlugins=lua", "CliFilterPlugins=lua"])
    testbed.reconfigure()

The lines are kept in `etc/slurm.conf.extra` and written at the end of slurm.conf by every later
`up`; `set_slurm_conf_lines([])` removes them. JobSubmitPlugins changes take effect on
`scontrol reconfigure`; cli_filter is read by each client command. slurmctld refuses to start when
JobSubmitPlugins=lua is set and job_submit.lua is missing, and reloads the script by mtime with
one-second granularity.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from datetime import timedelta
from pathlib import Path

from slurm_plugin.lab import testbed_conf
from slurm_plugin.lab.root import SlurmRoot
from slurm_plugin.client import DEFAULT_PATH, Backend, CommandBackend
from slurm_plugin.errors import JobNotFoundError, SlurmError, TestbedError
from slurm_plugin.lab.testbed_conf import TestbedConfig

_PIDFILE_GRACE_S = 3.0  # a forked daemon that has not written a live pid file by then has died
_WIPED = ("state", "spool", "mysql", "log", "run", "munge")
# Slurm's client commands: the lab's bin/ wraps each for a release in a root.
CLIENT_COMMANDS = ("sbatch", "srun", "salloc", "squeue", "sinfo", "scontrol", "scancel", "sacct", "sacctmgr",
                   "sprio", "sshare", "sstat", "sattach", "sbcast", "sdiag", "sreport", "strigger")


@dataclasses.dataclass(frozen=True)
class Daemon:
    """One process of the lab.

    Attributes:
        name: e.g. "slurmctld", "slurmd-node2".
        argv: how to start it.
        pid_file: where it writes its pid.
        log_file: its own log, shown when it fails.
        owner_mark: bytes in /proc/<pid>/cmdline or environ that prove the process is this lab's.
        port: TCP port it must accept connections on once ready (None: pid alive is enough).
    """

    name: str
    argv: tuple[str, ...]
    pid_file: Path
    log_file: Path
    owner_mark: bytes
    port: int | None = None


@dataclasses.dataclass(frozen=True)
class DaemonStatus:
    name: str
    pid: int | None
    running: bool


class Testbed:
    """Start, stop and inspect one lab; see the module docstring."""

    __test__ = False

    def __init__(self, config: TestbedConfig):
        self.config = config
        self.root = SlurmRoot.for_version(config.slurm)
        self.client: Backend = CommandBackend(
            slurm_conf=config.slurm_conf, env=self.command_env(), timeout=config.command_timeout,
            update_timeout=config.command_timeout
        )

    # -- public API ------------------------------------------------------------------------------
    def env(self, path: str | None = None) -> dict[str, str]:
        """What a shell needs to use this lab's cluster (and what a job submitted from it needs to sign its posts
        to the predictor with the lab's munged: sbatch passes the environment on). With `path`, PATH is that
        (behind the lab's bin/ for a release from a root); without, PATH is set only for such a release (the
        caller's PATH behind bin/)."""
        out = {"SLURM_CONF": str(self.config.slurm_conf), "ELASTIC_MUNGE_SOCKET": str(self.config.munge_socket)}
        base = path if path is not None else os.environ.get("PATH", DEFAULT_PATH)
        if self.root is not None:
            out["PATH"] = f"{self.config.bin_dir}:{base}"
        elif path is not None:
            out["PATH"] = path
        return out

    def command_env(self) -> dict[str, str] | None:
        """The environment `CommandBackend` needs for this lab's release (None: its default, the host's Slurm)."""
        return None if self.root is None else {"PATH": f"{self.config.bin_dir}:{DEFAULT_PATH}"}

    def daemons(self) -> list[Daemon]:
        """The lab's daemons in start order."""
        cfg, lab = self.config, self.config.lab
        conf_mark = f"SLURM_CONF={cfg.slurm_conf}\0".encode()
        mdir = cfg.munge_dir
        out = [
            Daemon(
                "munged",
                ("runuser", "-u", "munge", "--", "munged", f"--socket={cfg.munge_socket}",
                 f"--key-file={mdir / 'munge.key'}", f"--pid-file={mdir / 'munged.pid'}",
                 f"--log-file={mdir / 'munged.log'}", f"--seed-file={mdir / 'munged.seed'}"),
                mdir / "munged.pid", mdir / "munged.log", f"--socket={cfg.munge_socket}\0".encode(),
            ),
            Daemon(
                "mariadbd",
                ("setsid", "--fork", "mariadbd", "--no-defaults", "--user=mysql", f"--datadir={cfg.db_dir / 'data'}",
                 f"--socket={cfg.db_socket}", f"--pid-file={cfg.db_dir / 'mysqld.pid'}",
                 f"--log-error={lab / 'log' / 'mariadb.log'}", "--bind-address=127.0.0.1", f"--port={cfg.db_port}",
                 "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=8M", "--performance-schema=OFF",
                 "--skip-log-bin"),
                cfg.db_dir / "mysqld.pid", lab / "log" / "mariadb.log", f"--datadir={cfg.db_dir / 'data'}\0".encode(),
                port=cfg.db_port,
            ),
            Daemon("slurmdbd", ("slurmdbd",), lab / "run" / "slurmdbd.pid", lab / "log" / "slurmdbd.log",
                   conf_mark, port=cfg.dbd_port),
            Daemon("slurmctld", ("slurmctld", "-i"), lab / "run" / "slurmctld.pid", lab / "log" / "slurmctld.log",
                   conf_mark, port=cfg.ctld_port),
        ]
        for i, node in enumerate(cfg.node_names(), start=1):
            out.append(Daemon(f"slurmd-{node}", ("slurmd", "-N", node), lab / "run" / f"slurmd-{node}.pid",
                              lab / "log" / f"slurmd-{node}.log", conf_mark, port=cfg.node_port(i)))
        return out

    def _daemon(self, name: str) -> Daemon:
        return next(d for d in self.daemons() if d.name == name)

    def status(self) -> list[DaemonStatus]:
        out = []
        for d in self.daemons():
            pid = self._pid(d)
            out.append(DaemonStatus(d.name, pid, pid is not None))
        return out

    def is_up(self) -> bool:
        """All daemons running and every node idle or in use (not down/drained)."""
        if not all(s.running for s in self.status()):
            return False
        try:
            nodes = self.client.nodes()
        except SlurmError:
            return False
        return len(nodes) == self.config.nodes and all(n.state in ("idle", "mixed", "allocated") for n in nodes)

    def up(self) -> dict[str, float]:
        """Start what is not running and wait for all nodes idle; return seconds spent per phase.

        :raises TestbedError: a daemon did not start (with its log tail) or nodes did not become idle.
        """
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        was_slurm = testbed_conf.recorded_slurm(self.config.lab) or testbed_conf.HOST_VERSION
        if was_slurm != self.config.slurm and any(s.running for s in self.status()):
            raise TestbedError("testbed", f"lab {self.config.lab} is running Slurm {was_slurm}, not "
                                          f"{self.config.slurm}; pass --slurm {was_slurm} or stop it first")
        if self.root is not None:
            timings.update(self.root.ensure())
            t0 = time.monotonic()
        recorded = testbed_conf.recorded_port_base(self.config.lab)
        if recorded not in (None, self.config.port_base) and any(s.running for s in self.status()):
            raise TestbedError("testbed", f"lab {self.config.lab} is running with port base {recorded}, not "
                                          f"{self.config.port_base}; pass --port-base {recorded} or stop it first")
        gpus = "typed" if self.config.gpu_types else "untyped"
        was = testbed_conf.recorded_gpus(self.config.lab)
        if was not in (None, gpus) and any(s.running for s in self.status()):  # running slurmds keep their GRES
            raise TestbedError("testbed", f"lab {self.config.lab} is running with {was} GPUs, not {gpus}; pass "
                                          f"--gpus {was} or stop it first (testbed down)")
        ctld_running = self._pid(self._daemon("slurmctld")) is not None
        if self._prepare() and ctld_running:
            self.client.reconfigure()   # not `reconfigure()`: slurmd may be down here; all nodes are waited for below
        timings["prepare"] = time.monotonic() - t0
        for d in self.daemons():
            t = time.monotonic()
            if self._pid(d) is None:
                self._start(d)
                if d.name == "mariadbd":
                    self._db_setup()
            timings[d.name] = time.monotonic() - t
        t = time.monotonic()
        self._wait_idle()
        timings["nodes idle"] = time.monotonic() - t
        timings["total"] = time.monotonic() - t0
        return timings

    def down(self, wipe: bool = False) -> dict[str, float]:
        """Stop this lab's daemons in reverse start order; return seconds spent per daemon.

        :param wipe: also delete state, spool, database, logs (config and devices stay).
        :raises TestbedError: a daemon survived SIGKILL.
        """
        timings = {}
        for d in reversed(self.daemons()):
            t = time.monotonic()
            self._stop(d)
            timings[d.name] = time.monotonic() - t
        t = time.monotonic()
        self._end_leftover_steps()
        timings["slurmstepd"] = time.monotonic() - t
        if wipe:
            for sub in _WIPED:
                shutil.rmtree(self.config.lab / sub, ignore_errors=True)
        return timings

    def _end_leftover_steps(self, wait_s: float = 5.0) -> None:
        """SIGKILL the lab's slurmstepd processes that outlive its slurmds (a cancelled job's step still in its
        KillWait when the lab goes down), and wait for them to go, at most `wait_s`."""
        mark = str(self.config.lab).encode()
        left = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (entry / "comm").read_text().strip() != "slurmstepd":
                    continue
                if mark not in (entry / "cmdline").read_bytes() and mark not in (entry / "environ").read_bytes():
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
                left.append(int(entry.name))
            except (OSError, ProcessLookupError):
                continue
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            still = []
            for pid in left:
                try:
                    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                except (OSError, IndexError):
                    continue                       # gone
                if state != "Z":
                    still.append(pid)
            left = still
            time.sleep(0.1)

    def set_slurm_conf_lines(self, lines: list[str]) -> None:
        """Replace the extra slurm.conf lines (e.g. `JobSubmitPlugins=lua`) and rewrite slurm.conf.

        Call `reconfigure()` afterwards when the cluster is running (after job_submit.lua is in place:
        slurmctld cannot load job_submit/lua without it).
        """
        self.config.etc.mkdir(parents=True, exist_ok=True)
        self.config.extra_lines_file.write_text("".join(f"{line}\n" for line in lines))
        self._write(self.config.slurm_conf, testbed_conf.slurm_conf(self.config, lines))

    def slurm_conf_lines(self) -> list[str]:
        path = self.config.extra_lines_file
        return [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []

    def reconfigure(self) -> None:
        """`scontrol reconfigure` (slurmctld re-reads slurm.conf and job_submit plugins), then `_wait_registered`:
        24.11's reconfigure restarts slurmctld, and a job asked for before its nodes register again is refused
        ("Requested node configuration is not available"; seen with `sbatch --test-only` right after a test installed
        the hook). 22.05 keeps its nodes: one query.

        :raises TestbedError: a node still reads unknown after `start_timeout`.
        """
        self.client.reconfigure()
        self._wait_registered("scontrol reconfigure")

    def _wait_registered(self, after: str) -> None:
        """Wait until no node whose slurmd runs reads `unknown`: what a (re)started slurmctld says of a node until
        that node's slurmd registers with it.

        :raises TestbedError: one still does after `start_timeout`.
        """
        running = {d.name.removeprefix("slurmd-") for d in self.daemons()
                   if d.name.startswith("slurmd-") and self._pid(d) is not None}
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        while True:
            try:
                unknown = [n.name for n in self.client.nodes()
                           if n.name in running and n.state.split("+")[0] == "unknown"]
            except SlurmError as exc:   # a restarted slurmctld not answering yet
                unknown = [f"all ({exc})"]
            if not unknown:
                return
            if time.monotonic() > deadline:
                raise TestbedError("slurmctld", f"nodes not registered {self.config.start_timeout.total_seconds():g}"
                                                f" s after {after}: {', '.join(unknown)}")
            time.sleep(0.1)

    # -- fault injection (tests/integration/test_faults_slurm.py) --------------------------------
    def kill_daemon(self, name: str) -> int:
        """SIGKILL one daemon of this lab (`slurmctld`, `slurmd-node2`, ...) as a crash would; return its pid.

        :raises TestbedError: it is not running, or it survives SIGKILL.
        """
        d = self._daemon(name)
        pid = self._pid(d)
        if pid is None:
            raise TestbedError(name, "not running, nothing to kill")
        _kill_and_wait([pid], name)
        return pid

    def start_daemon(self, name: str) -> float:
        """Start one daemon of this lab unless it runs; wait for its port; return the seconds it took.

        :raises TestbedError: it did not start (with its log tail).
        """
        t0 = time.monotonic()
        d = self._daemon(name)
        if self._pid(d) is None:
            self._start(d)
        return time.monotonic() - t0

    def stop_controller(self, kill: bool = True) -> None:
        """Crash slurmctld (SIGKILL), or stop it (`kill=False`: SIGTERM, SIGKILL after `stop_timeout`).
        Jobs, steps and slurmd keep running; every Slurm command fails until `start_controller`.

        :raises TestbedError: it is not running, or it survives SIGKILL.
        """
        if kill:
            self.kill_daemon("slurmctld")
        elif self._pid(self._daemon("slurmctld")) is None:
            raise TestbedError("slurmctld", "not running, nothing to stop")
        else:
            self._stop(self._daemon("slurmctld"))

    def save_job_state(self, job_id: int, timeout: float = 30.0) -> float:
        """Make slurmctld write its job state file now; return the seconds that took.

        slurmctld writes `state/job_state` a second or two after a job changes (measured here: 1.4 s after a
        job starts), so a crash in that window restarts it with the job as it was before (a job started just
        before comes back PENDING, or is unknown and its processes killed). A fault test that means to crash
        slurmctld while a new job runs calls this first: a job update (an admin comment on `job_id`)
        schedules a save, and this waits for the file to be newer than the update.

        :raises TestbedError: the update failed (an unknown job too), or no save came within `timeout`.
        """
        path = self.config.lab / "state" / "job_state"
        t0 = time.time()
        try:
            self.client.update_admin_comment(job_id, f"state-saved-{t0:.0f}")
        except (SlurmError, JobNotFoundError) as exc:
            raise TestbedError("slurmctld", f"cannot update job {job_id} to make it save its state: {exc}") from exc
        while not (path.exists() and path.stat().st_mtime > t0):
            if time.time() - t0 > timeout:
                raise TestbedError("slurmctld", f"{path} not written within {timeout:.0f} s of a job update")
            time.sleep(0.05)
        return time.time() - t0

    def start_controller(self) -> float:
        """Start slurmctld again (it recovers jobs from its state directory), wait until it answers `sinfo` and
        until the nodes whose slurmd runs have registered with it (both releases call them `unknown` until then,
        and `is_up`, which the next test session asks first, is false); return the seconds that took.

        :raises TestbedError: it did not start, answer or hear from its nodes within `start_timeout` (with its log
            tail where it did not start).
        """
        t0 = time.monotonic()
        self.start_daemon("slurmctld")
        self._wait_answering()
        self._wait_registered("slurmctld's start")
        return time.monotonic() - t0

    def kill_node(self, node: str) -> list[int]:
        """The node dies: SIGKILL its slurmd, its slurmstepd processes (those writing its slurmd log) and
        every process they started (the job's tasks there), all found before the first signal; return them.

        :raises TestbedError: the node's slurmd is not running, or a process survives SIGKILL.
        """
        d = self._daemon(f"slurmd-{node}")
        slurmd = self._pid(d)
        if slurmd is None:
            raise TestbedError(d.name, "not running, nothing to kill")
        stepds = self.stepds(node=node)
        victims = [slurmd, *stepds, *_descendants(stepds)]
        _kill_and_wait(victims, f"node {node}")
        return victims

    def stepds(self, node: str | None = None, job_id: int | None = None) -> list[int]:
        """Live slurmstepd processes of this lab (each keeps its node's slurmd log open), only those on
        `node` and/or of `job_id` when given. A step that ended while slurmctld was down keeps its stepd
        until the step-completion message gets through (it retries every 60 s)."""
        logs = [d.log_file for d in self.daemons() if d.name.startswith("slurmd-")
                and (node is None or d.name == f"slurmd-{node}")]
        prefix = b"slurmstepd: [" + (b"" if job_id is None else f"{job_id}.".encode())
        return [pid for pid, cmd in _processes()
                if cmd.startswith(prefix) and process_alive(pid) and any(_writes(pid, log) for log in logs)]

    def revive_node(self, node: str) -> str:
        """Start the node's slurmd again and return the node to service (`State=RESUME` when Slurm has
        marked it down or drained meanwhile); wait until it is idle or in use; return its state then.

        :raises TestbedError: slurmd did not start, or the node did not come back within `start_timeout`.
        """
        self.start_daemon(f"slurmd-{node}")
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        state = "?"
        while time.monotonic() < deadline:
            try:
                state = next(n.state for n in self.client.nodes(timeout=timedelta(seconds=5)) if n.name == node)
            except (SlurmError, StopIteration):
                state = "?"
            if state in ("idle", "mixed", "allocated"):
                return state
            if any(part.startswith(("down", "drain", "fail")) for part in state.split("+")):  # 24.11: idle+drain
                try:
                    self._cmd(["scontrol", "update", f"NodeName={node}", "State=RESUME"], f"slurmd-{node}",
                              timeout=self.config.command_timeout.total_seconds())
                except TestbedError:
                    pass  # not resumable yet (still registering): try again
            time.sleep(0.5)
        raise TestbedError(f"slurmd-{node}", f"node {node} still {state!r} after "
                                             f"{self.config.start_timeout.total_seconds():g} s",
                           self._log_tail(self._daemon(f"slurmd-{node}")))

    def _wait_answering(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        while True:
            try:
                self.client.nodes(timeout=timedelta(seconds=5))
                return
            except SlurmError as exc:
                if time.monotonic() > deadline:
                    raise TestbedError("slurmctld", f"does not answer: {exc}",
                                       self._log_tail(self._daemon("slurmctld")))
            time.sleep(0.2)

    # -- internals -------------------------------------------------------------------------------
    def _prepare(self) -> bool:
        """Create directories, devices, configs, munge key and database; return whether slurm.conf changed."""
        cfg, lab = self.config, self.config.lab
        for parent in lab.parents:
            if parent.exists() and not parent.stat().st_mode & stat.S_IXOTH:
                raise TestbedError("testbed", f"{parent} is not searchable by other users, but munged and mariadbd "
                                              f"run as munge and mysql: put the lab elsewhere (e.g. under /var/tmp)")
        for sub in ("etc", "state", "run", "log", "dev", *(f"spool/{n}" for n in cfg.node_names())):
            (lab / sub).mkdir(parents=True, exist_ok=True)
        lab.chmod(0o755)
        (cfg.etc / "port_base").write_text(f"{cfg.port_base}\n")
        (cfg.etc / "slurm_version").write_text(f"{cfg.slurm}\n")
        if self.root is None:   # a lab that ran 24.11 before: its wrappers go
            shutil.rmtree(cfg.bin_dir, ignore_errors=True)
        else:                   # rewritten only when changed: a command of a running test may be using one
            cfg.bin_dir.mkdir(exist_ok=True)
            for name in CLIENT_COMMANDS:
                self._write(cfg.bin_dir / name, self.root.wrapper(name), mode=0o755)
        (cfg.etc / "gpus").write_text("typed\n" if cfg.gpu_types else "untyped\n")
        for path in cfg.gpu_files():
            if path.parent == lab / "dev" and not path.is_char_device():
                path.unlink(missing_ok=True)
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(195, int(path.name.removeprefix("nvidia"))))
        conf_changed = self._write(cfg.slurm_conf, testbed_conf.slurm_conf(cfg, self.slurm_conf_lines()))
        self._write(cfg.etc / "gres.conf", testbed_conf.gres_conf(cfg))
        self._write(cfg.etc / "topology.conf", testbed_conf.topology_conf(cfg))
        self._write(cfg.etc / "slurmdbd.conf", testbed_conf.slurmdbd_conf(cfg), mode=0o600)
        cfg.munge_dir.mkdir(mode=0o755, exist_ok=True)
        self._chown(cfg.munge_dir, "munge")
        key = cfg.munge_dir / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
            key.chmod(0o600)
            self._chown(key, "munge")
        cfg.db_dir.mkdir(exist_ok=True)
        self._chown(cfg.db_dir, "mysql")
        if not (cfg.db_dir / "data" / "mysql").exists():
            self._cmd(["mariadb-install-db", "--no-defaults", "--user=mysql", f"--datadir={cfg.db_dir / 'data'}",
                       "--auth-root-authentication-method=socket", "--skip-test-db"], "mariadb-install-db",
                      timeout=60)
        return conf_changed

    def _chown(self, path: Path, user: str) -> None:
        """Give `path` to `user` as the daemons see it: the root's account of that name has its own uid."""
        if self.root is None:
            shutil.chown(path, user, user)
            return
        for line in (self.root.path / "etc" / "passwd").read_text().splitlines():
            fields = line.split(":")
            if fields[0] == user:
                os.chown(path, int(fields[2]), int(fields[3]))
                return
        raise TestbedError("testbed", f"no user {user!r} in {self.root.path}/etc/passwd")

    def _argv(self, argv: list[str] | tuple[str, ...]) -> list[str]:
        """`argv` as this lab's release runs it (inside its root, in the lab directory)."""
        return list(argv) if self.root is None else self.root.command(argv, cwd=self.config.lab)

    @staticmethod
    def _write(path: Path, text: str, mode: int = 0o644) -> bool:
        """Write `text` unless `path` already holds it; return whether it changed."""
        if path.exists() and path.read_text() == text:
            return False
        path.write_text(text)
        path.chmod(mode)
        return True

    def _cmd(self, argv: list[str], name: str, timeout: float, stdin: str | None = None) -> None:
        try:
            proc = subprocess.run(self._argv(argv), input=stdin, capture_output=True, text=True, timeout=timeout,
                                  env=self._daemon_env(), check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TestbedError(name, f"{' '.join(argv)}: {exc}") from exc
        if proc.returncode != 0:
            raise TestbedError(name, f"{' '.join(argv)} exited {proc.returncode}", (proc.stdout + proc.stderr)[-3000:])

    def _daemon_env(self) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH, "SLURM_CONF": str(self.config.slurm_conf), "HOME": "/root"}

    def _db_setup(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        while True:
            try:
                self._cmd(["mariadb", "--no-defaults", f"--socket={self.config.db_socket}", "-u", "root",
                           "-e", testbed_conf.db_setup_sql()], "mariadbd", timeout=10)
                return
            except TestbedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _start(self, d: Daemon) -> None:
        if d.port is not None and _port_stays_open(d.port, seconds=5.0):  # a just-killed daemon's port may linger
            raise TestbedError(d.name, f"port {d.port} is already in use by another process "
                                       f"(another lab? choose another --port-base)")
        d.pid_file.unlink(missing_ok=True)
        out = open(self.config.lab / "log" / f"{d.name}.out", "ab")
        try:
            proc = subprocess.Popen(self._argv(d.argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self._daemon_env(), cwd=self.config.lab, start_new_session=True)
        except OSError as exc:
            raise TestbedError(d.name, f"cannot run {d.argv[0]}: {exc}") from exc
        finally:
            out.close()
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        forked_at = None  # when the launcher exited 0, leaving the forked daemon
        while time.monotonic() < deadline:
            rc = proc.poll()
            if rc not in (None, 0):
                raise TestbedError(d.name, f"{' '.join(d.argv)} exited {rc}", self._log_tail(d))
            pid = self._pid(d)
            if pid is not None and (d.port is None or port_open(d.port)):
                _reap(proc)
                return
            if rc == 0 and pid is None:
                forked_at = forked_at or time.monotonic()
                if _pid_file_dead(d.pid_file) or time.monotonic() - forked_at > _PIDFILE_GRACE_S:
                    raise TestbedError(d.name, "started, then died", self._log_tail(d))
            time.sleep(0.02)
        raise TestbedError(d.name, f"not ready after {self.config.start_timeout.total_seconds():g} s",
                           self._log_tail(d))

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for d in self.daemons():
                if self._pid(d) is None:
                    raise TestbedError(d.name, "died while waiting for the nodes", self._log_tail(d))
            try:
                nodes = self.client.nodes(timeout=min(self.config.command_timeout, timedelta(seconds=2)))
                states = {n.name: n.state for n in nodes}
            except SlurmError:
                pass
            if len(states) == self.config.nodes and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.05)
        tails = "\n".join(self._log_tail(d, 5) for d in self.daemons() if d.name.startswith("slurm"))
        raise TestbedError("slurmctld", f"nodes not idle after {self.config.start_timeout.total_seconds():g} s: "
                                        f"{states}", tails)

    def _stop(self, d: Daemon) -> None:
        pid = self._pid(d)
        if pid is None:
            d.pid_file.unlink(missing_ok=True)
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout.total_seconds()
        while time.monotonic() < deadline and process_alive(pid):
            time.sleep(0.02)
        if process_alive(pid):
            _kill_and_wait([pid], d.name)
        d.pid_file.unlink(missing_ok=True)

    def _pid(self, d: Daemon) -> int | None:
        """The daemon's pid if its pid file names a live process that belongs to this lab."""
        try:
            pid = int(d.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        if not process_alive(pid):
            return None
        try:
            proc = Path(f"/proc/{pid}")
            marks = (proc / "cmdline").read_bytes() + b"\0" + (proc / "environ").read_bytes()
        except OSError:
            return None
        return pid if d.owner_mark in marks else None

    def _log_tail(self, d: Daemon, lines: int = 30) -> str:
        chunks = []
        for path in (d.log_file, self.config.lab / "log" / f"{d.name}.out"):
            try:
                text = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            if text:
                chunks.append(f"[{path}]\n" + "\n".join(text[-lines:]))
        return "\n".join(chunks)


def _processes() -> list[tuple[int, bytes]]:
    """(pid, cmdline) of every process."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out.append((int(entry.name), (entry / "cmdline").read_bytes()))
            except OSError:
                continue
    return out


def _writes(pid: int, path: Path) -> bool:
    """True when `pid` has `path` open (a slurmstepd keeps its node's slurmd log open). Compared by inode: a
    process in a root shows the file under the root's mount of the lab."""
    try:
        want = path.stat()
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            st = fd.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return True
    return False


def _descendants(roots: list[int]) -> list[int]:
    """Every live process below `roots` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for pid, _ in _processes():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_and_wait(pids: list[int], what: str) -> None:
    """SIGKILL `pids` in order; wait (5 s) until none is alive."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 5
    while time.monotonic() < end and any(process_alive(p) for p in pids):
        time.sleep(0.02)
    alive = [p for p in pids if process_alive(p)]
    if alive:
        raise TestbedError(what, f"pids {alive} survived SIGKILL")


def _reap(proc: subprocess.Popen) -> None:
    """Collect the exit of a daemon's launcher process (it exits right after forking the daemon)."""
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _pid_file_dead(path: Path) -> bool:
    """True when `path` holds a complete pid of a process that is gone."""
    try:
        text = path.read_text()
    except OSError:
        return False
    return text.endswith("\n") and text.strip().isdigit() and not process_alive(int(text))


def process_alive(pid: int) -> bool:
    """True for a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _port_stays_open(port: int, seconds: float) -> bool:
    """True when something still listens on `port` after `seconds` of polling."""
    deadline = time.monotonic() + seconds
    while port_open(port):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)
    return False


def port_open(port: int) -> bool:
    """True when something listens on 127.0.0.1:`port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
