"""Reconfigurable process groups (torchft-style).

A :class:`ProcessGroupWrapper` is built once with its timeouts and then reconfigured any number of times with
:meth:`ProcessGroupWrapper.configure`, which aborts the group it holds and blocks until a new one, on a fresh
store prefix, works or raises. Collectives never re-initialise anything implicitly. Callers must not assume a
static rank or world size: both change on every ``configure``.

Groups are built directly from the backend classes (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) wrapped in a
``ProcessGroup``, not through ``init_process_group``, so that two groups (the one that trains and the next one
being built) coexist in one process. The wrapped ``ProcessGroup`` can be handed to
``DistributedDataParallel(process_group=...)``.

Timeouts:
    ``timeout`` bounds each collective (the backend's own timeout).
    ``connect_timeout`` bounds the store connection and the rendezvous inside ``configure``.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from elastic_launcher.errors import NotConfiguredError, ProcessGroupError, StoreAddressError
from elastic_launcher.teardown import (abandon_retired, abort_nccl, drain_given_up_builds, drain_reaper,
                                       give_up_build, release_retired, retire, retired_groups)

logger = logging.getLogger("elastic_launcher.process_group")

__all__ = ["StoreAddr", "ProcessGroupWrapper", "connect_store", "drain_reaper", "release_retired",
           "abandon_retired", "retired_groups", "give_up_build", "drain_given_up_builds"]


@dataclass(frozen=True)
class StoreAddr:
    """Where a group's rendezvous keys live: a TCPStore host/port plus a key prefix."""

    host: str
    port: int
    prefix: str = ""

    @classmethod
    def parse(cls, text: str) -> "StoreAddr":
        """Parses ``host:port/prefix`` (prefix optional).

        Raises:
            StoreAddressError: the text is not of that form.
        """
        hostport, _, prefix = text.partition("/")
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise StoreAddressError(f"store address {text!r} is not host:port/prefix")
        return cls(host, int(port), prefix)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}/{self.prefix}"

    def with_prefix(self, prefix: str) -> "StoreAddr":
        return StoreAddr(self.host, self.port, prefix)


def connect_store(addr: StoreAddr, timeout: timedelta) -> dist.Store:
    """Opens a client connection to the TCPStore at ``addr`` (the prefix applied).

    Raises:
        ProcessGroupError: the store cannot be reached within ``timeout``.
    """
    try:
        store = dist.TCPStore(addr.host, addr.port, is_master=False, timeout=timeout, wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - re-raised with the address
        raise ProcessGroupError(f"cannot reach store {addr}: {e}", addr.prefix) from e
    return dist.PrefixStore(addr.prefix, store) if addr.prefix else store


class ProcessGroupWrapper:
    """Owns one process group at a time and rebuilds it on demand.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        device: the device collectives run on (``cuda:N`` for NCCL); defaults to cpu / the current cuda device.
        timeout: per-collective timeout.
        connect_timeout: bound on the store connection and the group rendezvous in ``configure``.
    """

    def __init__(
        self,
        backend: str = "gloo",
        device: Optional[torch.device] = None,
        timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ProcessGroupError(f"backend {backend!r} is not gloo or nccl")
        self.backend = backend
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = device
        if backend == "nccl":  # see _warm_up: peers connected when a communicator is built, not at first use
            os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._pg: Optional[dist.ProcessGroup] = None
        self._backend_impl = None
        self._store: Optional[dist.Store] = None
        self._prefix = ""
        self._rank = -1
        self._world = 0
        self._error: Optional[Exception] = None
        self._aborted = False  # `fail` aborted the communicator in place
        self._lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def configure(self, store_addr: "StoreAddr | str", rank: int, world_size: int,
                  timeout: Optional[timedelta] = None) -> None:
        """Aborts the current group (if any) and builds a new one; blocks until it works.

        Preconditions: every rank of the new group calls this with the same ``store_addr`` (whose prefix must be
        unique to this configuration, e.g. one per membership epoch) and distinct ranks.

        Args:
            store_addr: ``StoreAddr`` or ``host:port/prefix``.
            rank: this process's rank in the new group.
            world_size: size of the new group.
            timeout: overrides ``connect_timeout`` for this call.

        Raises:
            ProcessGroupError: the group could not be built (peer missing, timeout, backend error).
        """
        addr = StoreAddr.parse(store_addr) if isinstance(store_addr, str) else store_addr
        self.abort()
        t = timeout or self.connect_timeout
        store = connect_store(addr, t)
        try:
            if self.device.type == "cuda":  # also right in a background thread, whose current device is 0
                # A side stream: the warm-up must never make the default stream (where the current group's
                # training kernels and DDP waits live) wait on the new communicator, or the two groups'
                # kernels can wait on each other across GPUs (deadlock when the old group spans GPUs).
                with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.Stream(self.device)):
                    backend_impl, pg = self._create_pg(store, rank, world_size, addr.prefix, t)
                    self._warm_up(pg, backend_impl)
            else:
                backend_impl, pg = self._create_pg(store, rank, world_size, addr.prefix, t)
                self._warm_up(pg, backend_impl)
            if self.backend == "gloo":   # built under the build's bound; from here on each collective has its own
                backend_impl.set_timeout(self.timeout)
        except Exception as e:  # noqa: BLE001
            raise ProcessGroupError(f"building group {addr} rank {rank}/{world_size} failed: {e}",
                                    addr.prefix) from e
        with self._lock:
            self._pg, self._backend_impl, self._store = pg, backend_impl, store
            self._prefix, self._rank, self._world, self._error = addr.prefix, rank, world_size, None
            self._aborted = False
        logger.info("configured group %s rank %d/%d", addr, rank, world_size,
                    extra={"rank": rank, "world": world_size, "prefix": addr.prefix})

    def _create_pg(self, store: dist.Store, rank: int, world_size: int, name: str, build_timeout: timedelta):
        pg = dist.ProcessGroup(store, rank, world_size)
        if self.backend == "gloo":
            # gloo's constructor connects the full mesh, waiting on the store for every peer's address under the
            # timeout it is given: the build's (peers still starting on a busy host), not a collective's
            impl = dist.ProcessGroupGloo(store, rank, world_size, max(self.timeout, build_timeout))
            btype = dist.ProcessGroup.BackendType.GLOO
            dev = torch.device("cpu")
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = self.timeout
            opts.global_ranks_in_group = list(range(world_size))
            opts.group_name = name
            impl = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            btype = dist.ProcessGroup.BackendType.NCCL
            dev = torch.device("cuda")
        pg._set_default_backend(btype)
        impl._set_sequence_number_for_group()
        pg._register_backend(dev, btype, impl)
        if name and hasattr(pg, "_set_group_name"):
            pg._set_group_name(name)
        if self.backend == "gloo" and self.device.type == "cuda":
            pg._register_backend(torch.device("cuda"), btype, impl)
        return impl, pg

    def _warm_up(self, pg: dist.ProcessGroup, impl) -> None:
        """Forces communicator creation and connection setup off the critical path.

        NCCL: the communicator is created eagerly (``eager_connect_single_device``) and, with
        ``NCCL_RUNTIME_CONNECT=0`` (set by the constructor unless the environment sets it), connects its peers at
        creation; no collective runs on it. A group is built in the background while training goes on over the
        current one, and a collective on the new communicator could then wait on one of the current communicator
        across GPUs: on 4x H200 the survivors' warm-up allreduce and the newcomers' gradient allreduce of the old
        epoch waited on each other for the whole collective timeout (bench/results/gpu_runs/2026-11-27_session5).
        Elsewhere (gloo, a torch without eager connect) a tiny allreduce creates the communicator; on CUDA a
        bucket-sized allreduce and broadcast also set up the connections.
        """
        if self.backend == "nccl" and hasattr(impl, "eager_connect_single_device"):
            impl.eager_connect_single_device(self.device)
            return
        t = torch.ones(1, device=self.device)
        pg.allreduce([t]).wait()
        if self.device.type == "cuda":
            small = torch.zeros(1 << 18, device=self.device)  # 1 MiB: DDP's first bucket
            pg.allreduce([small]).wait()
            big = torch.zeros(8 << 20, device=self.device)
            pg.allreduce([big]).wait()
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([big], opts).wait()
            torch.cuda.current_stream(self.device).synchronize()
            del big

    def shrink(self, exclude: list[int], abort: bool = True) -> "ProcessGroupWrapper":
        """Builds a smaller group from this one with the backend's shrink (ncclCommShrink), if supported.

        The new group keeps the ranks not in ``exclude`` in their order. This wrapper's group is left as is
        (the caller aborts it). Called by every surviving rank, never by an excluded one.

        Returns:
            A new configured wrapper (same timeouts) holding the smaller group.

        Raises:
            ProcessGroupError: not configured, or the backend cannot shrink (``supports_shrinking`` false), or the
                shrink itself failed. Callers fall back to ``configure`` on a fresh prefix.
        """
        impl, pg = self._backend_impl, self._pg
        if impl is None or pg is None:
            raise NotConfiguredError("shrink on an unconfigured group")
        if self._aborted:
            raise ProcessGroupError(f"group {self._prefix} was aborted (a peer failed): nothing to shrink",
                                    self._prefix)
        if not getattr(impl, "supports_shrinking", False):
            raise ProcessGroupError(f"backend {self.backend} of group {self._prefix} cannot shrink", self._prefix)
        flags = 1 if abort else 0  # torch.distributed.distributed_c10d.SHRINK_ABORT / SHRINK_DEFAULT
        try:
            new_impl = impl.shrink(sorted(exclude), flags, None)
        except Exception as e:  # noqa: BLE001
            raise ProcessGroupError(f"shrink of {self._prefix} excluding {exclude} failed: {e}", self._prefix) from e
        keep = [r for r in range(self._world) if r not in set(exclude)]
        new_rank, new_world = keep.index(self._rank), len(keep)
        out = ProcessGroupWrapper(self.backend, self.device, self.timeout, self.connect_timeout)
        new_pg = dist.ProcessGroup(self._store, new_rank, new_world)
        btype = dist.ProcessGroup.BackendType.NCCL if self.backend == "nccl" else dist.ProcessGroup.BackendType.GLOO
        new_pg._set_default_backend(btype)
        new_pg._register_backend(torch.device("cuda" if self.backend == "nccl" else "cpu"), btype, new_impl)
        out._pg, out._backend_impl, out._store = new_pg, new_impl, self._store
        out._prefix, out._rank, out._world = self._prefix + "/shrunk", new_rank, new_world
        return out

    def abort(self) -> None:
        """Aborts the held group and forgets it; safe to call twice. Never blocks.

        The group is retired, not destroyed (see ``teardown.py``): an NCCL communicator is aborted on a background
        thread; a gloo group stays alive, idle, until :func:`release_retired` or the process exit, because its
        teardown can block until the collective timeout.
        """
        with self._lock:
            pg, impl, aborted = self._pg, self._backend_impl, self._aborted
            self._pg = self._backend_impl = None
            self._store = None
            self._rank, self._world = -1, 0
        if impl is not None:
            retire(self.backend, pg, impl, aborted)

    def fail(self, e: Exception) -> None:
        """Marks the group broken from another thread (a peer stopped beating): records ``e`` and, on NCCL,
        aborts the communicator in place. Never blocks.

        Why: an NCCL collective with a dead peer does not fail, it waits on the GPU until the collective
        timeout, and the training thread waits with it (in the next device synchronisation). The abort ends
        those kernels with an error, so the training thread reaches its commit vote, which turns into a
        recovery. A gloo collective fails by itself when a peer's connection drops; gloo's abort does not
        wake a waiting collective, so on gloo this only records the error.
        """
        self.report_error(e)
        with self._lock:
            impl = self._backend_impl if self.backend == "nccl" and not self._aborted else None
            self._aborted = self._aborted or impl is not None
        if impl is not None:
            logger.warning("aborting group %s: %s", self._prefix, e)
            abort_nccl(impl)

    def shutdown(self) -> None:
        """Releases the group for good (same as :meth:`abort`)."""
        self.abort()

    # ---- errors ----------------------------------------------------------------------------------------------
    def report_error(self, e: Exception) -> None:
        """Records a collective failure; :meth:`errored` returns it until the next ``configure``."""
        with self._lock:
            if self._error is None:
                self._error = e

    def errored(self) -> Optional[Exception]:
        """The first recorded error since the last ``configure``, or None."""
        return self._error

    # ---- accessors and collectives ---------------------------------------------------------------------------
    @property
    def pg(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise NotConfiguredError("process group used before configure()")
        return self._pg

    @property
    def configured(self) -> bool:
        return self._pg is not None

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    @property
    def prefix(self) -> str:
        return self._prefix

    def allreduce(self, tensors: list[torch.Tensor], op: dist.ReduceOp = dist.ReduceOp.SUM):
        """Issues an allreduce; returns the ``Work`` (call ``wait()``)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.pg.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], src: int):
        """Issues a broadcast from group rank ``src``; returns the ``Work``."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast(tensors, opts)
