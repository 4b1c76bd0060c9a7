"""Which links a job's collectives really use, and where that answer came from.

Every worker probes its own host once (:meth:`HostFacts.probe`, at ``ElasticTrainer`` start) and hands the facts
to the controller through the job's store (``ProgressReporter.publish_host``). The controller, which knows which
node each worker runs on, labels each layout with :func:`links_for` and puts the labels, with their source, on
every observation record it posts (``observations.relabel``). Flags (``elastic-launch --intra-link/--inter-link``)
override the detection; the record then says ``flag``.

Rules (the link names are those of ``predictor/linkmodel.py``):

* gloo moves every byte over TCP sockets: peers on one host (same kernel boot id, so also the testbed's
  ``slurmd -N nodeX`` on one machine) talk over ``loopback``; peers on different hosts over ``tcp``.
* NCCL between GPUs of one host: ``shm`` when P2P is disabled (``NCCL_P2P_DISABLE=1``), the network transport when
  shared memory is disabled too; otherwise ``nvlink`` when NVML reports an active NVLink on the GPU, else
  ``pcie``. When NCCL's own debug output (``NCCL_DEBUG=INFO``; lines ``... via P2P/...``, ``via SHM``,
  ``via NET/IB``, ``via NET/Socket``) is available, what NCCL chose wins (:func:`nccl_transports`).
* NCCL between hosts: ``tcp`` with ``NCCL_NET=Socket`` or ``NCCL_IB_DISABLE=1`` or no InfiniBand device;
  ``ib`` or ``roce`` from the first active port's link layer under ``/sys/class/infiniband``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from pathlib import Path
from typing import Mapping, Optional, Sequence

__all__ = ["HostFacts", "Links", "links_for", "nccl_transports"]

_NCCL_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NET", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME")
_VIA = re.compile(r"\bvia (P2P|SHM|NET/IB|NET/Socket|NET/[A-Za-z0-9_]+|CollNet|NVLS)")
_VIA_LINK = {"P2P": "p2p", "SHM": "shm", "NET/IB": "ib", "NET/Socket": "tcp", "NVLS": "nvlink"}


@dataclasses.dataclass(frozen=True)
class Links:
    """The link labels of one layout, and where they came from.

    Attributes:
        intra: between the GPUs (workers) of one node.
        inter: between nodes (the bottleneck of a collective over several nodes).
        source: how they were found (``flag``, ``detected: ...``, ``default``).
    """

    intra: str = "unknown"
    inter: str = "unknown"
    source: str = "default"

    def for_layout(self, layout: Sequence[int]) -> dict:
        """The link fields of a step record on ``layout``: ``inter_link`` only when it spans several nodes."""
        fields = {"intra_link": self.intra, "link_source": self.source}
        if len(layout) > 1:
            fields["inter_link"] = self.inter
        return fields

    def bottleneck(self, layout: Sequence[int]) -> str:
        """The link a collective over ``layout`` is limited by."""
        return self.inter if len(layout) > 1 else self.intra


@dataclasses.dataclass(frozen=True)
class HostFacts:
    """What one worker finds on its host.

    Attributes:
        backend: ``gloo`` or ``nccl``.
        boot_id: the kernel's boot id (equal on every process of one machine).
        host: the host name.
        env: the NCCL variables that choose transports (only those set).
        nvlink: NVML says the worker's GPU has an active NVLink (None: unknown, e.g. no NVML or no GPU).
        net: ``ib`` or ``roce`` from the first active InfiniBand port, None when there is none.
        nccl_via: transports NCCL reported using (``p2p``, ``shm``, ``ib``, ``tcp``), from its debug output.
        gpu: the type of the worker's own device as the driver names it (``H100`` from ``NVIDIA H100 80GB HBM3``:
            :func:`gpu_type_of`), ``cpu`` for a worker that trains on the CPU (#45.4: its rows were labelled with
            the lab's fake GRES type), None when not known. The job's rows carry it (#26.2).
    """

    backend: str
    boot_id: str
    host: str
    env: dict = dataclasses.field(default_factory=dict)
    nvlink: Optional[bool] = None
    net: Optional[str] = None
    nccl_via: tuple = ()
    gpu: Optional[str] = None

    @classmethod
    def probe(cls, backend: str, gpu_index: Optional[int] = None, nccl_debug_text: str = "",
              gpu_name: Optional[str] = None) -> "HostFacts":
        """The facts of this process's host (reads /proc, /sys, NVML when present; never raises). ``gpu_name``:
        the driver's name of the worker's device (``torch.cuda.get_device_name``); ``gpu_index`` and ``gpu_name``
        both None: the worker trains on the CPU."""
        return cls(backend=backend, boot_id=_boot_id(), host=socket.gethostname(),
                   env={k: os.environ[k] for k in _NCCL_ENV if k in os.environ},
                   nvlink=_nvlink_active(gpu_index) if backend == "nccl" else None,
                   net=_ib_link_layer(Path("/sys/class/infiniband")) if backend == "nccl" else None,
                   nccl_via=tuple(sorted(nccl_transports(nccl_debug_text))),
                   gpu=gpu_type_of(gpu_name) if gpu_name else (None if gpu_index is not None else "cpu"))

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "nccl_via": list(self.nccl_via)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: "str | bytes") -> "HostFacts":
        """Raises ValueError on a body that is not a facts object."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("backend") not in ("gloo", "nccl") or not isinstance(d.get("boot_id"), str):
            raise ValueError(f"not host facts: {str(text)[:120]!r}")
        return cls(backend=d["backend"], boot_id=d["boot_id"], host=str(d.get("host", "")),
                   env=dict(d.get("env") or {}), nvlink=d.get("nvlink"), net=d.get("net"),
                   nccl_via=tuple(d.get("nccl_via") or ()),
                   gpu=d["gpu"] if isinstance(d.get("gpu"), str) and d["gpu"] else None)


def gpu_type_of(device_name: str) -> str:
    """The short GPU type of a driver's device name, as the predictor names types: ``H100`` from
    ``NVIDIA H100 80GB HBM3``, ``A100`` from ``NVIDIA A100-SXM4-80GB``; else the name with ``_`` for spaces."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", device_name)
    return match.group(1) if match else device_name.replace(" ", "_")


def nccl_transports(text: str) -> set[str]:
    """Transports in NCCL's ``NCCL_DEBUG=INFO`` output (``Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM``)."""
    out = set()
    for m in _VIA.finditer(text):
        via = m.group(1)
        out.add(_VIA_LINK.get(via, via.split("/")[-1].lower()))
    return out


def _flag(env: Mapping[str, str], key: str) -> bool:
    return env.get(key, "0").strip() not in ("", "0")


def _net_label(f: HostFacts) -> tuple[str, str]:
    """NCCL's network transport on this host, and why."""
    if f.env.get("NCCL_NET", "").lower() == "socket":
        return "tcp", "NCCL_NET=Socket"
    if _flag(f.env, "NCCL_IB_DISABLE"):
        return "tcp", "NCCL_IB_DISABLE=1"
    if "ib" in f.nccl_via:
        return (f.net or "ib"), "NCCL debug output: via NET/IB"
    if "tcp" in f.nccl_via:
        return "tcp", "NCCL debug output: via NET/Socket"
    if f.net:
        return f.net, f"/sys/class/infiniband link layer ({f.net})"
    return "tcp", "no InfiniBand device"


def _intra(f: HostFacts) -> tuple[str, str]:
    """The link between two workers of one host, and why."""
    if f.backend == "gloo":
        return "loopback", "gloo: TCP within one host"
    if _flag(f.env, "NCCL_P2P_DISABLE"):
        if _flag(f.env, "NCCL_SHM_DISABLE"):
            net, why = _net_label(f)
            return net, f"NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, {why}"
        return "shm", "NCCL_P2P_DISABLE=1"
    if f.nccl_via and "p2p" not in f.nccl_via and "shm" in f.nccl_via:
        return "shm", "NCCL debug output: via SHM"
    if f.nvlink is True:
        return "nvlink", "NVML: active NVLink"
    if f.nvlink is False:
        return "pcie", "NVML: no active NVLink"
    return "nvlink", "assumed (no NVML answer)"


def links_for(layout: Sequence[int], node_facts: Sequence[HostFacts]) -> Links:
    """The labels of a layout from the facts of one worker per node (in the layout's node order).

    ``node_facts`` may be shorter than the layout (a node not heard from yet): the labels then come from the
    nodes heard from, and the source says how many were.
    """
    if not node_facts:
        return Links(source="default: no worker reported its host")
    intra, why_intra = _intra(node_facts[0])
    if len(layout) <= 1:
        return Links(intra, intra, f"detected: {why_intra}")
    if len({f.boot_id for f in node_facts}) == 1 and len(node_facts) == len(layout):
        # every "node" is one machine (a testbed): the inter-node traffic never leaves the host
        inter, why_inter = (intra, why_intra) if node_facts[0].backend == "nccl" else \
            ("loopback", "gloo: TCP, all nodes on one host (same boot id)")
    elif node_facts[0].backend == "gloo":
        inter, why_inter = "tcp", "gloo: TCP between hosts"
    else:
        inter, why_inter = _net_label(node_facts[0])
    heard = "" if len(node_facts) == len(layout) else f" ({len(node_facts)} of {len(layout)} nodes reported)"
    return Links(intra, inter, f"detected: intra {why_intra}; inter {why_inter}{heard}")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _nvlink_active(gpu_index: Optional[int]) -> Optional[bool]:
    try:
        import pynvml  # noqa: PLC0415 - optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(gpu_index or 0)
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                        return True
                except pynvml.NVMLError:
                    break
            return False
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML missing or refusing: unknown
        return None


def _ib_link_layer(root: Path) -> Optional[str]:
    """``ib`` / ``roce`` of the first active port under ``root`` (/sys/class/infiniband), None if none."""
    try:
        for dev in sorted(root.iterdir()):
            for port in sorted((dev / "ports").iterdir()):
                state = (port / "state").read_text()
                if "ACTIVE" in state:
                    layer = (port / "link_layer").read_text().strip().lower()
                    return "roce" if layer == "ethernet" else "ib"
    except OSError:
        return None
    return None
