"""Configuration of the local test cluster: the frozen config object, its paths and ports, and the
text of the config files the daemons read.

Everything a lab owns lives under one directory (`TestbedConfig.lab`) and one block of TCP ports
starting at `TestbedConfig.port_base`, so several labs can run side by side on one host:

    port_base + 0         slurmctld                (SlurmctldPort)
    port_base + 1         slurmd default port      (SlurmdPort, unused: every node has its own)
    port_base + 2         slurmdbd                 (DbdPort / AccountingStoragePort)
    port_base + 3         MariaDB                  (StoragePort, bound to 127.0.0.1)
    port_base + 10 + i    slurmd of node<i>        (NodeName=node<i> Port=...)

Two labs need port bases at least `PORT_SPAN` apart. The recipe was verified on Slurm 22.05.8 / Debian 12.

GPU types: each leaf's nodes carry typed GRES (`Gres=gpu:h100:4` on node[1-2], `gpu:a100:4` on node[3-4],
`GPU_TYPES`) and the node feature of that type (`Features=h100`: a mixed-type job asks for counts of each
type's nodes with `--constraint=[h100*1&a100*1]`), and each type has its own partition (`h100`, `a100`) beside
the default partition `debug`, which still holds every node: an untyped request (`--gres=gpu:4`, `--gpus=8`) matches any type, so jobs that name no
type run as before. `TestbedConfig(gpu_types=())` writes the untyped lab (one `Name=gpu File=...` line per device
and no NodeName, the last one /dev/tty0: the spelling Slurm's own testsuite expects).
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

from slurm_plugin.lab.root import HOST_VERSION

DEFAULT_LAB = Path("/var/tmp/elastic-slurm-lab")
DEFAULT_PORT_BASE = 16800
PORT_SPAN = 20
CLUSTER_NAME = "lab"
PARTITION = "debug"
# (switch name, node indices under it); a spine switch joins the leaves.
LEAVES = (("leaf1", (1, 2)), ("leaf2", (3, 4)))
# Slurm's own GPU test expects the last `Name=gpu` line to be exactly this real char device.
TTY_GPU = Path("/dev/tty0")
DB_NAME = "slurm_acct_db"
DB_USER = "slurm"
DB_PASSWORD = "lab"


@dataclasses.dataclass(frozen=True)
class GpuType:
    """One GPU type of the lab: its partition, its nodes' GRES type and what the predictor calls it.

    Attributes:
        partition: the Slurm partition of exactly these nodes (also its name in the predictor's cluster model).
        gres_type: the GRES type Slurm knows (`Gres=gpu:<gres_type>:N`, `--gres=gpu:<gres_type>:N`).
        gpu: the GPU type of observations and the cluster model (`H100`).
        nodes: 1-based node indices (a leaf switch's nodes).
        gpu_hour_cost: the cluster model's cost weight of one GPU hour there (the `cost` objective).
    """

    partition: str
    gres_type: str
    gpu: str
    nodes: tuple[int, ...]
    gpu_hour_cost: float


# One type per leaf switch; H100 costs more per GPU hour than A100 (as at cloud prices, about 2x).
GPU_TYPES = (GpuType("h100", "h100", "H100", (1, 2), 2.0), GpuType("a100", "a100", "A100", (3, 4), 1.0))


@dataclasses.dataclass(frozen=True)
class TestbedConfig:
    """Where a lab lives and how it is reached.

    Attributes:
        lab: the lab directory; state, spool, database, logs, pid files and configs go under it.
        port_base: first TCP port of the lab's block (see the module docstring).
        nodes: number of slurmd nodes (`node1`..`nodeN`); the topology assumes 4.
        gpus_per_node: fake GPUs per node.
        cpus_per_node: CPUs declared per node (config_overrides lets it exceed the real cores).
        gpu_types: typed GRES and one partition per type (module docstring); () for an untyped lab.
        slurm: the Slurm release: the host's own (22.05), or one run from a Debian root (24.11,
            slurm_plugin/lab/root.py); every daemon and client command of the lab is that release's.
        start_timeout: how long `up` waits for each daemon and then for all nodes to be idle.
        stop_timeout: how long `down` waits after SIGTERM before SIGKILL.
        command_timeout: limit for each Slurm or MariaDB client command the testbed runs.
    """

    __test__ = False  # not a pytest test class despite the name

    lab: Path = DEFAULT_LAB
    port_base: int = DEFAULT_PORT_BASE
    nodes: int = 4
    gpus_per_node: int = 4
    cpus_per_node: int = 8
    gpu_types: tuple[GpuType, ...] = GPU_TYPES
    slurm: str = HOST_VERSION
    start_timeout: timedelta = timedelta(seconds=60)
    stop_timeout: timedelta = timedelta(seconds=5)
    command_timeout: timedelta = timedelta(seconds=10)

    @property
    def etc(self) -> Path:
        return self.lab / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def extra_lines_file(self) -> Path:
        """Lines added by `Testbed.set_slurm_conf_lines`, kept across `up`/`down`."""
        return self.etc / "slurm.conf.extra"

    @property
    def gres_prefix(self) -> str:
        """How this release spells a GPU in a job's TRES (`gres:gpu:2` on 22.05, `gres/gpu:2` on 24.11)."""
        return "gres:" if self.slurm == HOST_VERSION else "gres/"

    @property
    def bin_dir(self) -> Path:
        """Wrappers that run the root's Slurm client commands (labs of a release from a root only)."""
        return self.lab / "bin"

    @property
    def munge_dir(self) -> Path:
        return self.lab / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def db_dir(self) -> Path:
        return self.lab / "mysql"

    @property
    def db_socket(self) -> Path:
        return self.db_dir / "mysqld.sock"

    @property
    def ctld_port(self) -> int:
        return self.port_base

    @property
    def slurmd_port(self) -> int:
        return self.port_base + 1

    @property
    def dbd_port(self) -> int:
        return self.port_base + 2

    @property
    def db_port(self) -> int:
        return self.port_base + 3

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def node_port(self, index: int) -> int:
        """Port of `node<index>` (1-based)."""
        return self.port_base + 10 + index

    def gpu_type_of(self, index: int) -> GpuType | None:
        """The GPU type of `node<index>` (1-based), None when untyped."""
        return next((t for t in self.gpu_types if index in t.nodes), None)

    def gpu_files(self) -> list[Path]:
        """The device files behind each node's GPUs: mknod'ed char devices, the last one /dev/tty0."""
        files = [self.lab / "dev" / f"nvidia{i}" for i in range(self.gpus_per_node)]
        if TTY_GPU.is_char_device():
            files[-1] = TTY_GPU
        return files


def recorded_gpus(lab: Path) -> str | None:
    """`typed` or `untyped`: the GPUs `up` last gave `lab` (None for a lab never started, or started before this
    was recorded: typed)."""
    try:
        value = (lab / "etc" / "gpus").read_text().strip()
    except OSError:
        return None
    return value if value in ("typed", "untyped") else None


def recorded_slurm(lab: Path) -> str | None:
    """The Slurm release `up` last ran `lab` with (None for a lab never started, or started before this was
    recorded: the host's)."""
    try:
        return (lab / "etc" / "slurm_version").read_text().strip() or None
    except OSError:
        return None


def recorded_port_base(lab: Path) -> int | None:
    """The port base `up` last used for `lab` (None for a lab never started).

    Labs written before `etc/port_base` existed are read from slurm.conf's SlurmctldPort (= port base).
    """
    try:
        return int((lab / "etc" / "port_base").read_text())
    except (OSError, ValueError):
        pass
    try:
        text = (lab / "etc" / "slurm.conf").read_text()
    except OSError:
        return None
    ports = [ln.split("=", 1)[1].strip() for ln in text.splitlines() if ln.startswith("SlurmctldPort=")]
    return int(ports[0]) if ports and ports[0].isdigit() else None


def slurm_conf(cfg: TestbedConfig, extra_lines: list[str]) -> str:
    """The text of slurm.conf: the verified base plus `extra_lines` (e.g. JobSubmitPlugins=lua)."""
    lab = cfg.lab
    nodes = "".join(
        f"NodeName={name} NodeHostname=localhost Port={cfg.node_port(i)} CPUs={cfg.cpus_per_node}"
        f" RealMemory=4000 Gres={_gres(cfg, i)}{_features(cfg, i)} State=UNKNOWN\n"
        for i, name in enumerate(cfg.node_names(), start=1)
    )
    typed = "".join(f"PartitionName={t.partition} Nodes={_hostlist(t.nodes)} MaxTime=INFINITE State=UP "
                    f"OverSubscribe=NO\n" for t in cfg.gpu_types)
    extra = "".join(f"{line}\n" for line in extra_lines)
    return f"""\
# Generated by `elastic-slurm testbed up`; extra lines come from {cfg.extra_lines_file.name}.
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost
SlurmctldPort={cfg.ctld_port}
SlurmdPort={cfg.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={cfg.munge_socket}
StateSaveLocation={lab}/state
SlurmdSpoolDir={lab}/spool/%n
SlurmctldPidFile={lab}/run/slurmctld.pid
SlurmdPidFile={lab}/run/slurmd-%n.pid
SlurmctldLogFile={lab}/log/slurmctld.log
SlurmdLogFile={lab}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={cfg.dbd_port}
AccountingStoragePass={cfg.munge_socket}
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=permit_job_expansion
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
TopologyPlugin=topology/tree
SlurmdParameters=config_overrides
ReturnToService=2
MessageTimeout=10
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
OverTimeLimit=0
KillWait=5
MinJobAge=300
MailProg=/bin/true
{nodes}PartitionName={PARTITION} Nodes=node[1-{cfg.nodes}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
{typed}{extra}"""


def _gres(cfg: TestbedConfig, index: int) -> str:
    gpu_type = cfg.gpu_type_of(index)
    return f"gpu:{gpu_type.gres_type}:{cfg.gpus_per_node}" if gpu_type else f"gpu:{cfg.gpus_per_node}"


def _features(cfg: TestbedConfig, index: int) -> str:
    """A typed node's node feature (its GRES type, `Features=h100`): what a mixed-type job's count constraint
    (`--constraint=[h100*1&a100*1]`) selects nodes by; none for an untyped node."""
    gpu_type = cfg.gpu_type_of(index)
    return f" Features={gpu_type.gres_type}" if gpu_type else ""


def _hostlist(indices: tuple[int, ...]) -> str:
    return ",".join(f"node{i}" for i in indices)


def gres_conf(cfg: TestbedConfig) -> str:
    """Per-line form, one device per line: for every node when untyped, else per type for its nodes (untyped
    nodes of a typed lab get untyped lines of their own)."""
    if not cfg.gpu_types:
        return "".join(f"Name=gpu File={path}\n" for path in cfg.gpu_files())
    groups = [(t.nodes, f" Type={t.gres_type}") for t in cfg.gpu_types]
    untyped = tuple(i for i in range(1, cfg.nodes + 1) if cfg.gpu_type_of(i) is None)
    if untyped:
        groups.append((untyped, ""))
    return "".join(f"NodeName={_hostlist(nodes)} Name=gpu{typ} File={path}\n"
                   for nodes, typ in groups for path in cfg.gpu_files())


def topology_conf(cfg: TestbedConfig) -> str:
    lines = [f"SwitchName={name} Nodes=node[{a}-{b}]" for name, (a, b) in LEAVES]
    lines.append(f"SwitchName=spine Switches=leaf[1-{len(LEAVES)}]")
    return "\n".join(lines) + "\n"


def slurmdbd_conf(cfg: TestbedConfig) -> str:
    lab = cfg.lab
    return f"""\
AuthType=auth/munge
AuthInfo=socket={cfg.munge_socket}
DbdHost=localhost
DbdPort={cfg.dbd_port}
SlurmUser=root
LogFile={lab}/log/slurmdbd.log
PidFile={lab}/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={cfg.db_port}
StorageLoc={DB_NAME}
StorageUser={DB_USER}
StoragePass={DB_PASSWORD}
"""


def db_setup_sql() -> str:
    """Idempotent: creates the accounting database and the user slurmdbd logs in as."""
    return (
        f"CREATE DATABASE IF NOT EXISTS {DB_NAME};"
        f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASSWORD}';"
        f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1';"
    )
