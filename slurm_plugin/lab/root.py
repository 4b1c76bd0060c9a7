"""A Debian root holding a Slurm release the host does not have (24.11 from Debian 13), for the testbed.

    root = SlurmRoot.for_version("24.11")
    root.ensure()            # build it once (mmdebstrap + pyslurm), then reuse the cache; mount what it needs
    root.command(["sinfo"])  # -> ["unshare", "--root=<root>", "--wd=<cwd>", "/usr/bin/sinfo"]

The host's own Slurm (Debian 12's 22.05) needs no root: `SlurmRoot.for_version("22.05")` is None.

Build (`ensure`, first time on a machine: about a minute of mmdebstrap and two to four of pyslurm's compile on 2
cores): mmdebstrap makes a Debian `suite` root from the mirror the host's apt uses, with `PACKAGES`; then the
vendored pyslurm source of the matching release series (slurm_plugin/lab/vendor, see its SOURCE.md) is
compiled inside the root against its libslurm and installed into the root's python3. The result is cached
under `cache_dir()` (env ELASTIC_SLURM_ROOT_CACHE, default /var/cache/elastic-slurm), outside any checkout,
named by a key over the package list and the pyslurm tarball: another key builds a new root beside it.
A lock file makes concurrent builds wait for each other; a build goes to a temporary directory and is renamed
into place only when complete.

Mounts (`ensure`, idempotent, on the host, kept until `unmount`): /proc, /sys, /dev (recursive), the host's
/etc/hosts (slurmctld resolves the submit host's name), and the directories labs, jobs and tests use at the same
path inside and out: /tmp, /var/tmp, /home, the checkout this code runs from, and the prefix of the Python
running it (unless that is the system's /usr: a job that runs a test's `sys.executable` then finds it; the root's
own Python is /usr/bin/python3) and the checkouts its editable installs run from. The root also gets the host's regular accounts (same ids). So a lab under
/var/tmp, a job's output file under /tmp and SLURM_CONF name the same file on both sides, and daemons and client
commands started through `command()` share the host's network and pids (the testbed's pid checks and fault
injection work unchanged). Removing a root uses `rm --one-file-system`, so mounted host directories are never
deleted through it.

Inside the root, /etc/elastic-slurm-root names the release; `command()` run there adds no prefix.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from slurm_plugin.errors import TestbedError

HOST_VERSION = "22.05"   # the host's own slurm-wlm (Debian 12): no root
VENDOR = Path(__file__).parent / "vendor"
MARK = Path("/etc/elastic-slurm-root")   # inside a root: the release it holds
# What every root holds: Slurm's daemons and clients with job_submit/cli_filter lua, MariaDB, munge, Lua 5.1's
# socket and cjson (the hook's), and what pyslurm's build and the in-root contract tests need.
PACKAGES = ("slurmctld", "slurmd", "slurmdbd", "slurm-client", "slurm-wlm-basic-plugins", "slurm-wlm-mysql-plugin",
            "munge", "mariadb-server", "lua-socket", "lua-cjson", "libslurm-dev", "python3", "python3-dev",
            "python3-setuptools", "python3-wheel", "python3-pip", "cython3", "build-essential", "python3-pytest",
            "python3-pytest-timeout", "procps", "util-linux", "ca-certificates")
BIND_DIRS = ("/tmp", "/var/tmp", "/home")
CLEAN_ENV = ("env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8")
BUILD_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class RootSpec:
    """One Slurm release in a Debian root: the suite that ships it and the pyslurm series built for it."""

    version: str
    suite: str
    pyslurm: str    # vendored tarball name in VENDOR


SPECS = {"24.11": RootSpec("24.11", "trixie", "pyslurm-24.11.tar.gz")}
VERSIONS = (HOST_VERSION, *SPECS)


def cache_dir() -> Path:
    return Path(os.environ.get("ELASTIC_SLURM_ROOT_CACHE", "/var/cache/elastic-slurm"))


def inside_root() -> bool:
    """True when this process runs inside a root built here."""
    return MARK.exists()


def checkout() -> Path:
    """The checkout this code runs from (bound into the root: jobs and in-root tests import it)."""
    return Path(__file__).resolve().parents[2]


def bind_dirs() -> list[str]:
    """Host directories seen at the same path inside the root (module docstring)."""
    out = [*BIND_DIRS, str(checkout()), *_editable_sources()]
    for prefix in {sys.prefix, sys.base_prefix}:
        if not prefix.startswith(("/usr", "/bin", "/lib", "/etc")) and prefix != "/":
            out.append(prefix)
    return [d for d in out if Path(d).is_dir()]


def _editable_sources() -> list[str]:
    """Checkouts that installed packages of this Python run from (`pip install -e`): a job's `python -m
    elastic_launcher.cli` imports the installed package, whichever checkout that is."""
    from importlib.metadata import distributions  # noqa: PLC0415 - only the editable-install lookup

    out = []
    for dist in distributions():
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        except (ValueError, OSError):
            continue
        if url.startswith("file:///") and Path(url[7:]).is_dir() and not url[7:].startswith(("/usr", "/etc")):
            out.append(url[7:])
    return sorted(set(out))


def apt_mirror() -> str:
    """The Debian mirror the host's apt uses (its deb822 or one-line sources), so the root comes from the same."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1 and words[1].rstrip("/").endswith("/debian"):
                return words[1]
            if words[:1] == ["deb"] and any(w.rstrip("/").endswith("/debian") for w in words[1:3]):
                return next(w for w in words[1:3] if w.rstrip("/").endswith("/debian"))
    raise TestbedError("root", f"no Debian mirror (a URI ending in /debian) in {', '.join(map(str, files))}")


@dataclasses.dataclass(frozen=True)
class SlurmRoot:
    spec: RootSpec
    cache: Path

    @classmethod
    def for_version(cls, version: str) -> "SlurmRoot | None":
        """The root for `version`; None for the host's own release.

        :raises TestbedError: a version neither the host nor a root provides.
        """
        if version == HOST_VERSION:
            return None
        if version not in SPECS:
            raise TestbedError("testbed", f"Slurm {version!r} is not supported here; "
                                          f"choose one of {', '.join(VERSIONS)}")
        return cls(SPECS[version], cache_dir())

    @property
    def key(self) -> str:
        digest = hashlib.sha256()
        digest.update(f"{self.spec.suite}\n{' '.join(PACKAGES)}\n".encode())
        digest.update((VENDOR / self.spec.pyslurm).read_bytes())
        return digest.hexdigest()[:12]

    @property
    def path(self) -> Path:
        return self.cache / "roots" / f"slurm-{self.spec.version}-{self.key}"

    def built(self) -> bool:
        return (self.path / MARK.relative_to("/")).exists()

    # -- commands --------------------------------------------------------------------------------
    def command(self, argv: list[str] | tuple[str, ...], cwd: Path | None = None) -> list[str]:
        """`argv` run inside the root, in `cwd` (default: the caller's, else /) when that is visible there."""
        if inside_root():
            return list(argv)
        wd = Path(cwd) if cwd is not None else Path.cwd()
        if not (self.path / wd.relative_to("/")).is_dir():
            wd = Path("/")
        return ["unshare", f"--root={self.path}", f"--wd={wd}", *argv]

    def wrapper(self, name: str) -> str:
        """A shell script that runs the root's `name` with its arguments (the lab's bin/ holds one per
        Slurm client command, so `PATH=<lab>/bin:$PATH` makes sbatch, srun... 24.11's, also inside jobs)."""
        return (f"#!/bin/sh\n# Written by elastic-slurm testbed: Slurm {self.spec.version}'s {name} from {self.path}\n"
                f"[ -e {MARK} ] && exec /usr/bin/{name} \"$@\"\n"
                f"wd=$(pwd); [ -d \"{self.path}$wd\" ] || wd=/\n"
                f"[ \"$(id -u)\" = 0 ] && exec unshare --root={self.path} --wd=\"$wd\" /usr/bin/{name} \"$@\"\n"
                # a user other than root may not chroot; in a user namespace that maps the user to itself it may
                f"exec unshare --user --map-user=\"$(id -u)\" --map-group=\"$(id -g)\" --root={self.path} "
                f"--wd=\"$wd\" /usr/bin/{name} \"$@\"\n")

    # -- build and mounts --------------------------------------------------------------------------
    def ensure(self) -> dict[str, float]:
        """Build the root unless cached, then make its mounts; return seconds per phase."""
        timings: dict[str, float] = {}
        if inside_root():
            return timings
        self.cache.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        with open(self.cache / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.built():
                self._build()
                timings["root build"] = time.monotonic() - t
        t = time.monotonic()
        self.mount()
        timings["root mounts"] = time.monotonic() - t
        return timings

    def _build(self) -> None:
        tmp = self.path.with_name(self.path.name + f".build-{os.getpid()}")
        remove_tree(tmp)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        log = self.cache / f"build-{self.spec.version}.log"
        with open(log, "w") as out:
            argv = ["mmdebstrap", "--mode=root", "--variant=apt", "--format=directory",
                    f"--include={','.join(PACKAGES)}", self.spec.suite, str(tmp), apt_mirror()]
            out.write(f"$ {' '.join(argv)}\n")
            out.flush()
            _run(argv, out, log, "mmdebstrap")
            try:
                self._mount_at(tmp, binds=False)
                src = tmp / "opt" / "src"
                src.mkdir(parents=True, exist_ok=True)
                shutil.copy(VENDOR / self.spec.pyslurm, src)
                name = self.spec.pyslurm.removesuffix(".tar.gz")
                script = (f"cd /opt/src && tar xzf {self.spec.pyslurm} && cd {name} && "
                          "export SLURM_LIB_DIR=/usr/lib/x86_64-linux-gnu SLURM_INCLUDE_DIR=/usr/include "
                          "CFLAGS='-O0 -g0' && "   # a test client: compile time (one 100k-line module) over speed
                          "/usr/bin/python3 setup.py build_ext -j 2 >/dev/null && "
                          "/usr/bin/python3 setup.py bdist_wheel >/dev/null && "
                          "/usr/bin/python3 -m pip install --break-system-packages --no-deps --no-index dist/*.whl && "
                          "cd / && /usr/bin/python3 -c "
                          "'from importlib.metadata import version; print(\"pyslurm\", version(\"pyslurm\"))'")
                argv = [*CLEAN_ENV, "chroot", str(tmp), "sh", "-c", script]
                out.write(f"$ {' '.join(argv)}\n")
                out.flush()
                _run(argv, out, log, "pyslurm build")
            finally:
                unmount_tree(tmp)
        (tmp / MARK.relative_to("/")).write_text(f"{self.spec.version}\n")
        tmp.rename(self.path)

    def mount(self) -> None:
        self._mount_at(self.path, binds=True)
        self._sync_users()

    def _sync_users(self) -> None:
        """Give the root the host's regular accounts (uid/gid 1000-65533) it lacks, with the same ids: a job
        submitted as such a user runs inside the root. System accounts keep the root's own ids (its packages'
        munge and mysql; the testbed chowns by those)."""
        for name in ("passwd", "group"):
            host = Path("/etc") / name
            mine = self.path / "etc" / name
            have = {line.split(":", 1)[0] for line in mine.read_text().splitlines()}
            add = [line for line in host.read_text().splitlines()
                   if line.count(":") >= 3 and line.split(":")[0] not in have
                   and line.split(":")[2].isdigit() and 1000 <= int(line.split(":")[2]) < 65534]
            if add:
                with open(mine, "a") as f:
                    f.write("".join(f"{line}\n" for line in add))

    def _mount_at(self, root: Path, binds: bool) -> None:
        mounted = _mountpoints()
        plan = [("proc", "/proc", ["-t", "proc", "proc"]), ("sys", "/sys", ["--rbind", "/sys"]),
                ("dev", "/dev", ["--rbind", "/dev"])]
        if binds:
            plan += [(d, d, ["--bind", d]) for d in bind_dirs()] + [("hosts", "/etc/hosts", ["--bind", "/etc/hosts"])]
        for _, target, how in plan:
            where = root / target.lstrip("/")
            if str(where) in mounted:
                continue
            if Path(target).is_dir():
                where.mkdir(parents=True, exist_ok=True)
            else:
                where.touch(exist_ok=True)
            proc = subprocess.run(["mount", *how, str(where)], capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise TestbedError("root", f"mount {' '.join(how)} {where} exited {proc.returncode}: "
                                           f"{proc.stderr.strip()}")

    def unmount(self) -> None:
        unmount_tree(self.path)


def _run(argv: list[str], out, log: Path, what: str) -> None:
    try:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError("root", f"{what}: {exc} (log: {log})") from exc
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise TestbedError("root", f"{what} exited {proc.returncode} (log: {log})", "\n".join(tail))


def _mountpoints() -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        out.append(line.split()[4].replace("\\040", " "))
    return out


def unmount_tree(root: Path) -> None:
    """Unmount everything mounted under `root`, deepest first."""
    prefix = str(root).rstrip("/") + "/"
    for where in sorted((m for m in _mountpoints() if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", where], capture_output=True, check=False)


def remove_tree(path: Path) -> None:
    """Remove a (partial) root without crossing into anything still mounted inside it."""
    if path.exists():
        unmount_tree(path)
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)
