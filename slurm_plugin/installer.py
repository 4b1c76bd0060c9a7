"""Install the elastic-slurm Lua hooks next to slurm.conf (`elastic-slurm install-plugin`).

Writes `elastic_common.lua`, `elastic.conf`, `job_submit.lua` and, on request, `cli_filter.lua` into the
configuration directory (the directory of slurm.conf, where slurmctld looks for job_submit.lua), after
checking that lua-socket and lua-cjson load in Slurm's Lua (lua5.1). Each file is replaced atomically
(write to a temporary name, then rename), `job_submit.lua` last.

slurmctld reloads job_submit.lua when its mtime is newer than the time it last loaded it, with
one-second granularity, and reads elastic_common.lua and elastic.conf only while loading it. So after
writing, `install` waits for the next full second and stamps job_submit.lua with it: the next submission
is then guaranteed to load the new files, even if slurmctld loaded the old script in this same second.

The slurm.conf lines are returned (and printed by the CLI); `add_to_slurm_conf` merges them into an
existing slurm.conf, after which the caller runs `scontrol reconfigure` (the CLI does, through
`slurm_plugin.client`).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Optional
from urllib.parse import urlsplit

import click

from slurm_plugin.client import DEFAULT_PATH, CommandBackend, most_gpus_per_node
from slurm_plugin.errors import SlurmError

LUA_DIR = Path(__file__).parent / "lua"


class InstallError(RuntimeError):
    """The hooks cannot be installed: names the bad option, directory or missing Lua package."""


LUA_CHECK = 'local s = require("socket"); local c = require("cjson.safe"); io.write(s._VERSION, " ", c._VERSION)'


@dataclasses.dataclass(frozen=True)
class PluginConfig:
    """What the hooks read from elastic.conf.

    Attributes:
        conf_dir: directory of slurm.conf; the Lua files and elastic.conf go here.
        predictor_url: base URL of the predictor (`http://HOST:PORT`); the hooks POST `<url>/v1/plan`.
            Use an IP address or a name in /etc/hosts: name resolution is outside the time budget.
        budget: hard limit on one /v1/plan call (connect + send + receive), default 100 ms.
        breaker_failures: failures in a row (timeouts included) that open the circuit breaker.
        breaker_open: how long an open breaker skips the call.
        cli_filter: also install cli_filter.lua (the same request from sbatch's side).
        cache_entries: size of job_submit.lua's decision cache (reuse of a /v1/plan decision for identical
            requests within the `cache_ttl_s` the service sends); 0 turns it off on this side.
        max_gpus_per_node: partition -> the most GPUs one of its nodes has. job_submit.lua drops any decision
            above it (and any above the partition's node count, which Slurm hands the hook), so a hostile service
            cannot make Slurm refuse a job (#24.5). None: `install` reads it from Slurm
            (`slurm_plugin.client.most_gpus_per_node`); give it where Slurm is not running yet.
        gres_prefix: how this Slurm spells a GPU in a job's TRES fields, `gres:` (22.05) or `gres/` (24.11; each
            refuses the other). job_submit.lua uses the job's own spelling and this for a job that has none.
            None: `install` asks Slurm's version (`slurm_gres_prefix`: `gres/` from 23.02 on, verified on 22.05 and
            24.11 only).
    """

    conf_dir: Path
    predictor_url: str
    budget: timedelta = timedelta(milliseconds=100)
    breaker_failures: int = 3
    breaker_open: timedelta = timedelta(seconds=30)
    cli_filter: bool = False
    cache_entries: int = 1024
    max_gpus_per_node: Optional[Mapping[str, int]] = None
    gres_prefix: Optional[str] = None

    def __post_init__(self):
        parts = urlsplit(self.predictor_url)
        if parts.scheme != "http" or not parts.hostname:
            raise InstallError(f"--predictor-url must be http://HOST[:PORT], got {self.predictor_url!r}")
        if not timedelta(milliseconds=1) <= self.budget <= timedelta(seconds=10):
            raise InstallError(f"budget must be 1 ms..10 s, got {self.budget.total_seconds() * 1000:g} ms")
        if self.breaker_failures < 1:
            raise InstallError(f"breaker_failures must be >= 1, got {self.breaker_failures}")
        if self.breaker_open.total_seconds() < 0:
            raise InstallError("breaker_open must not be negative")
        if not 0 <= self.cache_entries <= 1_000_000:
            raise InstallError(f"cache_entries must be 0..1000000, got {self.cache_entries}")
        if self.gres_prefix not in (None, "gres:", "gres/"):
            raise InstallError(f"gres_prefix must be gres: or gres/, got {self.gres_prefix!r}")
        for name, count in (self.max_gpus_per_node or {}).items():
            if not re.fullmatch(r"[^\s,=]+", str(name)) or not isinstance(count, int) or count < 0:
                raise InstallError(f"max_gpus_per_node: expected PARTITION=COUNT (COUNT >= 0), got {name}={count}")

    def conf_text(self) -> str:
        budget_ms = self.budget.total_seconds() * 1000
        return (
            "# elastic-slurm hook configuration, written by `elastic-slurm install-plugin`\n"
            f"predictor_url = {self.predictor_url.rstrip('/')}\n"
            f"budget_ms = {budget_ms:g}\n"
            f"breaker_failures = {self.breaker_failures}\n"
            f"breaker_open_s = {self.breaker_open.total_seconds():g}\n"
            f"cache_entries = {self.cache_entries}\n"
        ) + ("" if self.max_gpus_per_node is None else "max_gpus_per_node = " + ",".join(
            f"{name}={count}" for name, count in sorted(self.max_gpus_per_node.items())) + "\n") + (
            "" if self.gres_prefix is None else f"gres_prefix = {self.gres_prefix}\n")

    def slurm_conf_lines(self) -> list[str]:
        lines = ["JobSubmitPlugins=lua"]
        if self.cli_filter:
            lines.append("CliFilterPlugins=lua")
        return lines


def site_predictor_url(environ: Mapping[str, str]) -> Optional[str]:
    """The predictor URL the site's hook uses: `predictor_url` of the `elastic.conf` beside slurm.conf
    (`$SLURM_CONF`, else /etc/slurm/slurm.conf); None when there is no such file or line.

    For elastic-launch, so a job's launcher asks the same service as the hook that sized it."""
    conf = Path(environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf").parent / "elastic.conf"
    try:
        lines = conf.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == "predictor_url" and value.strip():
            return value.strip()
    return None


def check_lua(lua: str = "lua5.1", timeout: timedelta = timedelta(seconds=10)) -> str:
    """Check that lua-socket and lua-cjson load in `lua`; return their versions.

    :raises InstallError: naming the missing package.
    """
    try:
        proc = subprocess.run([lua, "-e", LUA_CHECK], capture_output=True, text=True,
                              timeout=timeout.total_seconds(), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"cannot run {lua}: {exc} (apt-get install lua5.1)") from exc
    if proc.returncode != 0:
        raise InstallError(f"lua-socket or lua-cjson does not load in {lua} "
                           f"(apt-get install lua-socket lua-cjson): {proc.stderr.strip()}")
    return proc.stdout.strip()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def _stamp_next_second(path: Path, sleep: Callable[[float], None]) -> None:
    """Give `path` an mtime strictly after any load slurmctld did before this call, once that second has come."""
    now = time.time()
    target = int(now) + 1
    sleep(target - now)
    os.utime(path, (target, target))


def _path_env() -> dict[str, str]:
    """The admin's PATH for Slurm's commands: a site's Slurm may live outside the system's bin directories (and a
    24.11 testbed's wrappers stand first on PATH after `eval "$(elastic-slurm testbed env)"`)."""
    return {"PATH": os.environ.get("PATH") or DEFAULT_PATH}


def slurm_gres_prefix(slurm_conf: Path) -> Optional[str]:
    """`gres_prefix` for the Slurm on PATH from its version (`CommandBackend.version`, `scontrol --version`):
    `gres/` from 23.02 on, else `gres:`. No `slurm_conf`: None, without asking (22.05's scontrol without a config
    waits for DNS until the timeout): the hook then keeps each job's own spelling and writes `gres:` for a job that
    has none.

    :raises InstallError: there is a slurm.conf but scontrol does not answer with a version; names what it said and
        the option that gives the prefix instead.
    """
    if not slurm_conf.is_file():
        return None
    try:
        version = CommandBackend(slurm_conf=slurm_conf, env=_path_env()).version()
    except SlurmError as exc:
        raise InstallError(f"cannot read the Slurm version for gres_prefix ({exc}); pass --gres-prefix "
                           f"gres: (Slurm before 23.02) or gres/") from exc
    return "gres/" if version >= (23, 2) else "gres:"


def slurm_gpus_per_node(slurm_conf: Path) -> dict[str, int]:
    """`max_gpus_per_node` as the Slurm of `slurm_conf` reports it (`sinfo --json`, `scontrol show partition`).

    :raises InstallError: Slurm does not answer; names the option that gives the value instead.
    """
    how = "start slurmctld or pass --max-gpus-per-node PARTITION=COUNT,..."
    if not slurm_conf.is_file():   # sinfo without a config waits on DNS for a minute
        raise InstallError(f"cannot read each partition's GPUs per node: no {slurm_conf}; {how}")
    backend = CommandBackend(slurm_conf=slurm_conf, env=_path_env())
    try:
        return most_gpus_per_node(backend.nodes(), backend.partitions())
    except (SlurmError, OSError) as exc:
        raise InstallError(f"cannot read each partition's GPUs per node from Slurm ({exc}); {how}") from exc


def install(config: PluginConfig, lua: str = "lua5.1", sleep: Callable[[float], None] = time.sleep) -> list[Path]:
    """Write the hook files into `config.conf_dir`; return the paths written, job_submit.lua last.

    `sleep` waits (up to 1 s) for the second job_submit.lua's mtime names (tests pass their own).

    :raises InstallError: the directory does not exist, Lua lacks lua-socket/lua-cjson, or Slurm cannot be asked
        what `max_gpus_per_node` or `gres_prefix` leave to it.
    """
    if not config.conf_dir.is_dir():
        raise InstallError(f"--conf-dir {config.conf_dir} is not a directory")
    check_lua(lua)
    if config.max_gpus_per_node is None:
        config = dataclasses.replace(config, max_gpus_per_node=slurm_gpus_per_node(config.conf_dir / "slurm.conf"))
    if config.gres_prefix is None:
        config = dataclasses.replace(config, gres_prefix=slurm_gres_prefix(config.conf_dir / "slurm.conf"))
    written = []
    files = [("elastic_common.lua", (LUA_DIR / "elastic_common.lua").read_text()),
             ("elastic.conf", config.conf_text())]
    if config.cli_filter:
        files.append(("cli_filter.lua", (LUA_DIR / "cli_filter.lua").read_text()))
    files.append(("job_submit.lua", (LUA_DIR / "job_submit.lua").read_text()))
    for name, text in files:
        _write_atomic(config.conf_dir / name, text)
        written.append(config.conf_dir / name)
    _stamp_next_second(written[-1], sleep)
    return written


def add_to_slurm_conf(slurm_conf: Path, lines: list[str]) -> bool:
    """Merge `Key=lua` lines into slurm.conf (adding `lua` to an existing plugin list); True if changed.

    :raises InstallError: slurm.conf does not exist.
    """
    if not slurm_conf.is_file():
        raise InstallError(f"{slurm_conf} does not exist")
    text = slurm_conf.read_text()
    original = text
    for line in lines:
        key, value = line.split("=", 1)
        pattern = re.compile(rf"^[ \t]*{key}[ \t]*=[ \t]*(\S*)[ \t]*$", re.IGNORECASE | re.MULTILINE)
        match = pattern.search(text)
        if match is None:
            text = text.rstrip("\n") + f"\n{line}\n"
        elif value not in match.group(1).split(","):
            merged = ",".join(p for p in [*match.group(1).split(","), value] if p)
            text = text[:match.start()] + f"{key}={merged}" + text[match.end():]
    if text != original:
        _write_atomic(slurm_conf, text)
    return text != original


@click.command("install-plugin")
@click.option("--conf-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory of slurm.conf (job_submit.lua must sit beside it).")
@click.option("--predictor-url", required=True, help="Base URL of the predictor, e.g. http://10.0.0.5:8470.")
@click.option("--budget-ms", type=click.IntRange(1, 10000), default=100, show_default=True,
              help="Hard limit on one /v1/plan call, connect to last byte.")
@click.option("--breaker-failures", type=click.IntRange(1, 1000), default=3, show_default=True,
              help="Failures in a row that open the circuit breaker.")
@click.option("--breaker-open-s", type=click.FloatRange(0, 86400), default=30.0, show_default=True,
              help="Seconds an open breaker skips the call.")
@click.option("--cli-filter", is_flag=True, help="Also install cli_filter.lua (CliFilterPlugins=lua).")
@click.option("--cache-entries", type=click.IntRange(0, 1_000_000), default=1024, show_default=True,
              help="Decisions job_submit.lua keeps for identical requests (the service sets how long); 0: none.")
@click.option("--max-gpus-per-node", default=None, metavar="PARTITION=COUNT,...",
              help="The most GPUs one node of each partition has; the hook drops decisions above it. "
                   "Default: read from Slurm (sinfo) now; re-run install-plugin after changing nodes' GRES.")
@click.option("--gres-prefix", type=click.Choice(["gres:", "gres/"]), default=None,
              help="How this Slurm spells GPUs in a job's TRES: gres: (22.05) or gres/ (24.11). Default: from "
                   "`scontrol --version` (gres/ from 23.02 on).")
@click.option("--apply", is_flag=True, help="Add the lines to DIR/slurm.conf and run `scontrol reconfigure`.")
def install_plugin(conf_dir: Path, predictor_url: str, budget_ms: int, breaker_failures: int,
                   breaker_open_s: float, cli_filter: bool, cache_entries: int, max_gpus_per_node: Optional[str],
                   gres_prefix: Optional[str], apply: bool) -> None:
    """Install the job_submit (and cli_filter) Lua hooks and print the slurm.conf lines.

    Example: elastic-slurm install-plugin --conf-dir /etc/slurm --predictor-url http://10.0.0.5:8470 --apply
    """
    try:
        given = None if max_gpus_per_node is None else dict(
            (name, int(count) if count.isdigit() else -1) for name, _, count in
            (item.strip().partition("=") for item in max_gpus_per_node.split(",") if item.strip()))
        config = PluginConfig(conf_dir.absolute(), predictor_url, timedelta(milliseconds=budget_ms),
                              breaker_failures, timedelta(seconds=breaker_open_s), cli_filter, cache_entries, given,
                              gres_prefix)
        versions = check_lua()
        written = install(config)
    except InstallError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"lua5.1 modules: {versions}")
    for path in written:
        click.echo(f"wrote {path}")
    click.echo("slurm.conf lines:")
    for line in config.slurm_conf_lines():
        click.echo(f"  {line}")
    if apply:
        slurm_conf = config.conf_dir / "slurm.conf"
        try:
            changed = add_to_slurm_conf(slurm_conf, config.slurm_conf_lines())
            CommandBackend(slurm_conf=slurm_conf, env=_path_env()).reconfigure()
        except (InstallError, SlurmError) as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(f"{'updated' if changed else 'unchanged'} {slurm_conf}; scontrol reconfigure done")
