"""`elastic-predictor serve`: gunicorn behind nginx, the service's one front end (issue #24, items 3, 8 and 17;
#46: the asyncio front end it replaced, predictor/server.py, is gone).

nginx reads each request whole before gunicorn sees it (bodies above 16 KiB go to a temp file, not memory), caps
connections per client address and in total, caps requests in progress per client address and per bearer token
(#24.3: one token sent from many addresses shares one cap), and replaces X-Forwarded-For; the rendered
configuration is predictor/deploy/nginx.conf.in (its comments say which directive does what). This module renders it into a
private runtime folder, starts gunicorn on a unix socket there, then nginx in the foreground, and supervises
them as one unit (#41.6): each runs in a process group of its own, so when one exits or is killed (SIGKILL of the
nginx master or of a gunicorn arbiter) its whole group is killed (no worker left holding the port) and it is
started again, at most `RESTARTS` times in `RESTART_WINDOW_S`, after which everything stops and `serve` exits with
its status. SIGTERM/SIGINT stop nginx gracefully (requests in flight finish), then gunicorn; SIGHUP, SIGTTIN,
SIGTTOU, SIGUSR1 and SIGUSR2 go to gunicorn. All die with `serve` (PR_SET_PDEATHSIG). The runtime folder belongs
to root when `serve` runs as root: nginx's workers (www-data) may reach its sockets and write only their temp
folders in it (#41.9: the folder was www-data's, holding root's gunicorn sockets).

Two gunicorns (#24.4, 11, 13): with `side_workers` > 0, the one on `gunicorn.sock` (the plan pool, `workers`)
answers only what the job_submit hook sends, POST /v1/plan without `X-Elastic-Munge` and under 10,000 bytes
(#24.9: the hook's are a few hundred bytes; the largest valid plans, 166 KB, cost a plan worker 25 ms each), and
GET /healthz; a second one on `SIDE_SOCKET` (the side pool: gthread, `SIDE_THREADS` threads a worker, its processes at nice `SIDE_NICE`
but for each worker's SQLite lock holder thread, predictor.lockholder, so the write lock the hook's plans wait for
is never held at nice `SIDE_NICE`, #24.11)
answers everything else: writes, requests carrying a munge credential (unmunge and the Slurm lookups it costs),
`/v1/predict`, profiles, decisions, `/admin`, `/metrics`. nginx routes by method, path and that header. So no
credential check, write flood or admin page holds a worker the hook's plan needs, and on a busy host the side
pool (and the unmunge, squeue and sacct it runs) yields the CPU to it. A hook's request whose plan worker dies
under it before answering (a SIGKILL, the OOM killer) is sent once more to the plan pool's socket, where a live
worker takes it; nothing else is ever sent twice.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import grp
import ipaddress
import os
import pwd
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from predictor import lockholder

TEMPLATE = Path(__file__).resolve().parent / "deploy" / "nginx.conf.in"
FOLDER_PREFIX = "elastic-predictor-nginx-"
PACKAGES = "nginx-light libnginx-mod-stream"        # Debian 12; nginx-full has the stream module built in
NGINX_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
SEND_TIMEOUT_S = 30
# What one client connection can hold in nginx's memory at most, from the template's buffer sizes: the stream
# layer's two 4 KiB proxy buffers; the outer http server's 1 KiB head buffer, 4 x 8 KiB large header buffers, 16 KiB
# body buffer, 8 KiB + 4 x 8 KiB answer buffers; the inner one's (#41.5) 1 KiB head buffer, 4 x 8 KiB large header
# buffers (the head comes whole from the outer server), 16 KiB body buffer, 8 KiB answer buffer; about 8 KiB of
# pools each.
CONNECTION_BYTES = (2 * 4 + 1 + 4 * 8 + 16 + 8 + 4 * 8 + 8 + 1 + 4 * 8 + 16 + 8 + 8) * 1024
WORKER_BASE_BYTES = 8 * 1024 * 1024                # a worker's own memory, measured 3-6 MB, and its connection array
SIDE_SOCKET = "gunicorn-side.sock"
SIDE_THREADS = 4            # a side pool worker's threads: its unmunge and Slurm runs wait side by side
SIDE_NICE = 10              # the side pool's processes (and the unmunge, squeue, sacct they run) yield the CPU
RESTARTS, RESTART_WINDOW_S = 5, 60.0   # a part that exits more often than this is not restarted: serve stops
TEMP_FOLDERS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")   # nginx.conf.in's temp paths: the workers'


class NginxMissing(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class NginxLimits:
    max_body: int = 4 * 1024 * 1024    # ELASTIC_PREDICTOR_MAX_BODY
    read_timeout: float = 10.0         # the whole head; between two reads of the body; an idle keep-alive
    upstream_timeout: float = 35.0     # gunicorn's answer
    max_connections: int = 2048        # client connections at once, all addresses
    per_address: int = 256             # client connections at once from one address (idle ones too)
    per_address_requests: int = 64     # requests in progress from one address; more: 429
    per_credential_requests: int = 16  # requests in progress with one bearer token, all addresses; more: 429
    worker_processes: int = 2
    hook_from: tuple[str, ...] = ()    # the job_submit hook's hosts (addresses or networks): a path of their own
    hook_connections: int = 64         # connections from them at once, apart from `max_connections`

    def __post_init__(self):
        for net in self.hook_from:
            ipaddress.ip_network(net, strict=False)    # ValueError naming it

    @property
    def worker_connections(self) -> int:
        # a client connection takes up to 6 of a worker's connections (client, stream -> outer http and outer ->
        # inner http over unix sockets, twice each, inner -> gunicorn), and one worker may get all of them
        return 6 * (self.max_connections + (self.hook_connections if self.hook_from else 0)) + 64

    def memory_bound(self) -> int:
        """nginx's memory at most: every connection holding all its buffers, plus each worker's own."""
        return self.max_connections * CONNECTION_BYTES + (self.worker_processes + 1) * WORKER_BASE_BYTES

    def disk_bound(self) -> int:
        """Temp files of request bodies at most: a body above 16 KiB is written by the outer server and, once whole,
        by the inner one (answers larger than their buffers spill there too)."""
        return 2 * self.max_connections * self.max_body


def find_nginx() -> tuple[str, str]:
    """(nginx executable, `load_module` line for the stream module or "" when built in); raises NginxMissing."""
    exe = shutil.which("nginx", path=NGINX_SEARCH_PATH)
    if exe is None:
        raise NginxMissing(f"nginx is not installed: apt-get install -y {PACKAGES}")
    info = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=10).stderr
    if re.search(r"--with-stream(\s|$)", info):
        return exe, ""
    modules = re.search(r"--modules-path=(\S+)", info)
    module = Path(modules.group(1) if modules else "modules") / "ngx_stream_module.so"
    if "--with-stream=dynamic" not in info or not module.is_file():
        raise NginxMissing(f"nginx has no stream module: apt-get install -y {PACKAGES}")
    return exe, f"load_module {module};"


def nginx_missing() -> str | None:
    """Why this host cannot run the nginx front end (no nginx, no stream module), or None when it can."""
    try:
        find_nginx()
    except (NginxMissing, OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None


def render(limits: NginxLimits, *, host: str, port: int, runtime: str, load_module: str, user: str | None,
           side_pool: bool = False) -> str:
    """The nginx configuration; `side_pool`: all but the hook's requests go to `SIDE_SOCKET` (module docstring)."""
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    hook_geo = "\n".join(f"        {ipaddress.ip_network(net, strict=False)} 1;" for net in limits.hook_from)
    values = {"HOOK_GEO": hook_geo, "HOOK_CLASS": "1" if limits.hook_from else "[01]",
              "HOOK_CONNECTIONS": limits.hook_connections if limits.hook_from else 1,
              "LOAD_MODULE": load_module, "USER": f"user {user};" if user else "",
              "SIDE_UPSTREAM": "gunicorn_side" if side_pool else "gunicorn",
              "PLAN_RETRY": f"server unix:{runtime}/gunicorn.sock max_fails=0 backup;" if side_pool else "",
              "WORKER_PROCESSES": limits.worker_processes, "NOFILE": limits.worker_connections + 256,
              "SHUTDOWN_TIMEOUT": int(limits.upstream_timeout) + 10,
              "OUTER_TIMEOUT": int(limits.upstream_timeout) + 5,
              "WORKER_CONNECTIONS": limits.worker_connections, "LISTEN": listen, "PER_ADDRESS": limits.per_address,
              "MAX_CONNECTIONS": limits.max_connections, "STREAM_TIMEOUT": int(limits.upstream_timeout) + 30,
              "RUNTIME": runtime, "PER_ADDRESS_REQUESTS": limits.per_address_requests, "MAX_BODY": limits.max_body,
              "PER_CREDENTIAL_REQUESTS": limits.per_credential_requests,
              "READ_TIMEOUT": f"{round(limits.read_timeout * 1000)}ms", "SEND_TIMEOUT": SEND_TIMEOUT_S,
              "UPSTREAM_TIMEOUT": int(limits.upstream_timeout)}
    return re.sub(r"@([A-Z_]+)@", lambda m: str(values[m.group(1)]), TEMPLATE.read_text())


def worker_user() -> pwd.struct_passwd | None:
    """The unprivileged user nginx's workers run as when `serve` runs as root (None: not root)."""
    if os.geteuid() != 0:
        return None
    for name in ("www-data", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


def _prune_stale(parent: str, owners: set[int], older_than_s: float = 60.0) -> None:
    """Runtime folders of earlier `serve`s killed with SIGKILL: no nginx.pid process alive any more."""
    for folder in glob.glob(os.path.join(parent, FOLDER_PREFIX + "*")):
        try:
            info = os.lstat(folder)
            if info.st_uid not in owners or time.time() - info.st_mtime < older_than_s:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(os.path.join(folder, "gunicorn.sock"))
            continue                                  # alive
        except (FileNotFoundError, ConnectionRefusedError):
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            continue


def _port_free(host: str, port: int) -> None:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)                            # OSError: in use, or not an address of this host


def run_nginx(load: Callable, *, host: str, port: int, workers: int, threads: int, timeout: int,
              limits: NginxLimits, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
              side_workers: int = 0, side_load: Callable | None = None) -> int:
    """Serve `load()` (built in each gunicorn worker) behind nginx; returns the exit status. With `side_workers`
    > 0, all but the hook's requests go to a second gunicorn of that many workers running `side_load()` (default
    `load`; the module docstring). Raises NginxMissing, or OSError when host:port cannot be bound."""
    exe, load_module = find_nginx()
    _port_free(host, port)
    user = worker_user()
    limits = _fit_open_files(limits, user is not None, log)
    runtime = tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir="/tmp" if len(tempfile.gettempdir()) > 60 else None)
    _prune_stale(os.path.dirname(runtime), {os.getuid()} | ({user.pw_uid} if user else set()))
    if user:   # the workers reach the sockets (group: search), write only their temp folders, replace nothing
        os.chown(runtime, 0, user.pw_gid)
        os.chmod(runtime, 0o750)
        for name in TEMP_FOLDERS:
            os.mkdir(os.path.join(runtime, name), 0o700)
            os.chown(os.path.join(runtime, name), user.pw_uid, user.pw_gid)
    conf = os.path.join(runtime, "nginx.conf")
    Path(conf).write_text(render(limits, host=host, port=port, runtime=runtime, load_module=load_module,
                                 user=f"{user.pw_name} {_group(user)}" if user else None,
                                 side_pool=side_workers > 0))
    children: dict[str, int] = {}
    starters: dict[str, Callable[[], int]] = {}
    try:
        pools = [("gunicorn", "gunicorn.sock", load, workers, threads, 0)]
        if side_workers > 0:
            pools.append(("gunicorn-side", SIDE_SOCKET, side_load or load, side_workers, SIDE_THREADS, SIDE_NICE))
        for name, sock, app, count, per_worker, nice in pools:
            starters[name] = functools.partial(_fork_gunicorn, app, f"unix:{runtime}/{sock}", count, per_worker,
                                               timeout, nice)
            children[name] = starters[name]()
        for name, sock, *_ in pools:
            if not _wait_socket(os.path.join(runtime, sock), children[name], 120.0):
                log(f"serve: {name} did not start (see above)")
                return 1

        def start_nginx() -> int:
            _wait_port_free(host, port, 5.0)       # a killed master's workers are gone (their group was killed)
            for stale in ("http.sock", "inner.sock", "nginx.pid"):   # left by a SIGKILLed master: not bound again
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(runtime, stale))
            return subprocess.Popen([exe, "-e", "stderr", "-p", runtime, "-c", conf, "-g",
                                     f"daemon off; pid {runtime}/nginx.pid; error_log stderr warn;"],
                                    preexec_fn=_own_group_dying_with_parent).pid   # noqa: PLW1509 - no threads yet
        starters["nginx"] = start_nginx
        children["nginx"] = start_nginx()
        log(f"front end: nginx on {host}:{port} ({conf}): requests read whole (body <= {limits.max_body} bytes; "
            f"head within {limits.read_timeout:g} s), at most {limits.per_address} connections per address and "
            f"{limits.max_connections} in all, {limits.per_address_requests} requests in progress per address and "
            f"{limits.per_credential_requests} per bearer token (all addresses together); "
            f"nginx memory <= {limits.memory_bound() / 2**20:.0f} MiB, body temp files <= "
            f"{limits.disk_bound() / 2**30:.1f} GiB in {runtime}; gunicorn on unix:{runtime}/gunicorn.sock")
        if limits.hook_from:
            log(f"front end: the hook's hosts ({', '.join(limits.hook_from)}; --hook-from) have "
                f"{limits.hook_connections} connections of their own, not counted in the {limits.max_connections}, "
                "and only their plans reach the plan pool")
        else:
            log("front end: no --hook-from: the hook's connections share the caps above with every client")
        if side_workers > 0:
            log(f"front end: the plan pool ({workers} worker(s)) answers POST /v1/plan without a munge credential "
                f"(under 10,000 bytes) "
                f"and /healthz; every other request goes to the side pool ({side_workers} worker(s) x "
                f"{SIDE_THREADS} threads, nice {SIDE_NICE}) on unix:{runtime}/{SIDE_SOCKET}")
        return _supervise(children, starters, log)
    finally:
        for pid in children.values():
            _kill_group(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        shutil.rmtree(runtime, ignore_errors=True)


def gunicorn_application(load: Callable, *, bind: str, workers: int, threads: int, timeout: int,
                         worker_class: str | None = None, post_fork: Callable[[], None] | None = None):
    """A gunicorn application running `load()` (the WSGI app, built in each worker) on `bind`; `post_fork()` runs
    in each worker as it starts, before `load()`."""
    from gunicorn.app.base import BaseApplication  # noqa: PLC0415 - gunicorn: only where serve starts it

    class Application(BaseApplication):
        def load_config(self):
            self.cfg.set("bind", bind)
            self.cfg.set("workers", workers)
            self.cfg.set("threads", threads)
            self.cfg.set("timeout", timeout)
            if worker_class:
                self.cfg.set("worker_class", worker_class)
            self.cfg.set("accesslog", None)
            self.cfg.set("proc_name", "elastic-predictor")
            if "control_socket_disable" in self.cfg.settings:   # gunicorn >= 24: one socket path per user
                self.cfg.set("control_socket_disable", True)
            if post_fork is not None:
                self.cfg.set("post_fork", lambda server, worker: post_fork())

        def load(self):
            return load()     # per worker: its own connections and refit thread

    return Application()


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux PR_SET_PDEATHSIG); nothing elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _own_group_dying_with_parent() -> None:
    """In a child before it runs: a process group of its own (so its workers can be killed with it), and SIGTERM
    when `serve` dies."""
    os.setpgid(0, 0)
    _die_with_parent()


def _kill_group(pgid: int) -> None:
    """SIGKILL to a part's process group (its leader and every worker it forked, orphaned or not)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_port_free(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _port_free(host, port)
            return
        except OSError:
            if time.monotonic() > deadline:
                return                                  # nginx says why it cannot bind, and is restarted again
            time.sleep(0.05)


def _fit_open_files(limits: NginxLimits, root: bool, log: Callable[[str], None]) -> NginxLimits:
    """Fewer connections where nginx, not run as root, cannot raise its open-file limit to fit them."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if root or hard == resource.RLIM_INFINITY or hard >= limits.worker_connections + 256:
        return limits
    fits = max(16, (hard - 256 - 64) // 4)
    log(f"front end: open-file limit {hard}: at most {fits} client connections")
    return dataclasses.replace(limits, max_connections=fits, per_address=min(limits.per_address, fits))


def _group(user: pwd.struct_passwd) -> str:
    try:
        return grp.getgrgid(user.pw_gid).gr_name
    except KeyError:
        return str(user.pw_gid)


def _fork_gunicorn(load: Callable, bind: str, workers: int, threads: int, timeout: int, nice: int = 0) -> int:
    """gunicorn (its arbiter, which forks the workers) in a child process that dies with this one; its pid. With
    `nice`, each worker starts its SQLite lock holder (predictor.lockholder) and then runs at `nice` above ours:
    all it does, and runs, yields the CPU, but the write lock the hook's plans wait for is held at our priority."""
    post_fork = functools.partial(_yield_cpu_but_the_lock, nice) if nice else None
    application = gunicorn_application(load, bind=bind, workers=workers, threads=threads, timeout=timeout,
                                       post_fork=post_fork)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)        # its own group: the arbiter and its workers are killed together (_kill_group)
        os._exit(_gunicorn_child(application, parent))
    return pid


def _yield_cpu_but_the_lock(nice: int) -> None:
    """In a worker as it starts (one thread): the lock holder's thread keeps our priority; this thread, and every
    thread it starts from here on, runs at `nice` above it (Linux: a per-thread value, inherited)."""
    lockholder.start()
    os.nice(nice)


def _gunicorn_child(application, parent: int) -> int:
    """Run gunicorn in the forked child; its exit status (gunicorn ends by SystemExit)."""
    _die_with_parent()
    if os.getppid() != parent:                    # the parent died before PR_SET_PDEATHSIG took hold
        return 1
    try:
        application.run()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - whatever it is, print it: os._exit follows
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _wait_socket(path: str, pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(path)
            return True
        except OSError:
            time.sleep(0.05)
    return False


def _supervise(children: dict[str, int], starters: dict[str, Callable[[], int]], log: Callable[[str], None],
               clock: Callable[[], float] = time.monotonic) -> int:
    """Wait for signals and children; returns the exit status. Empties `children` of those reaped. A part that
    exits while `serve` is not stopping is started again (`starters`), its process group killed first, unless it
    exited `RESTARTS` times in `RESTART_WINDOW_S`: then everything stops."""
    stopping: list[int] = []
    exits: dict[str, list[float]] = {}

    def stop(signum, _frame) -> None:
        if not stopping:
            stopping.append(signum)
            _signal(children.get("nginx"), signal.SIGQUIT)   # graceful: stop accepting, finish what is in flight

    def forward(signum, _frame) -> None:
        for name in [n for n in children if n.startswith("gunicorn")]:
            _signal(children.get(name), signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, stop)
    for signum in (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    status = 0
    while children:
        pid, raw = os.waitpid(-1, 0)
        name = next((n for n, p in children.items() if p == pid), None)
        if name is None:
            continue
        del children[name]
        _kill_group(pid)                                  # its workers, orphaned by a SIGKILL, go with it
        code = os.waitstatus_to_exitcode(raw)
        code = 128 - code if code < 0 else code
        now = clock()
        recent = exits[name] = [t for t in exits.get(name, []) if now - t < RESTART_WINDOW_S] + [now]
        if not stopping and not status and len(recent) <= RESTARTS:
            log(f"front end: {name} exited with status {code}; started again ({len(recent)} of {RESTARTS} "
                f"restarts in {RESTART_WINDOW_S:g} s)")
            children[name] = starters[name]()
            continue
        if name == "nginx":
            for other in [n for n in children if n.startswith("gunicorn")]:
                _signal(children.get(other), signal.SIGTERM)   # gunicorn finishes what it has, then exits
        else:
            _signal(children.get("nginx"), signal.SIGQUIT if code == 0 else signal.SIGTERM)
        if not stopping and not status:
            log(f"front end: {name} exited with status {code}; stopping")
            status = code or 1
    return status


def _signal(pid: int | None, signum: int) -> None:
    if pid is not None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
