"""Resize mechanics: the launcher's store channel, operator control, helper jobs, shrink and grow.

Keys of the launcher channel (prefix `launcher/` of the job's TCPStore; the runtime uses `elastic/`):

    heartbeat            counter the controller bumps every loop (helper agents watch it move)
    status               JSON: the controller's state (`elastic-launch ctl JOB --status`)
    ctl/seq              counter; an operator request takes the next number n
    ctl/req/<n>          JSON {"nodes": N}
    ctl/reply/<n>        JSON {"ok": bool, "message": ..., "target_nodes": N}
    helper/<job>/status  JSON written by the helper agent (state, nodes, steps)
    helper/<job>/stop    set by the controller: the helper's workers have left, end the helper

Shrink order (Slurm SIGKILLs tasks on released nodes): the leaving ranks leave at a commit point first
(runtime resize plan without them), their srun steps end, and only then are the nodes released: helper
nodes by ending the helper job (stop key + scancel), main-job nodes with `client.shrink`, whose refreshed
Slurm environment replaces the one the controller launches with. Grow: a helper job is submitted; once
it runs, its agent starts workers that join the rendezvous, and the controller posts the plan with them.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch.distributed as dist

from elastic_launcher.launch_config import helper_comment, helper_name

LAUNCHER_PREFIX = "launcher"


def launcher_store(host: str, port: int, timeout: timedelta) -> dist.Store:
    """A client of the job's TCPStore, restricted to the launcher channel.

    Raises:
        RuntimeError (from torch): the store cannot be reached within `timeout`.
    """
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(LAUNCHER_PREFIX, store)


class ControlClient:
    """What `elastic-launch ctl` uses to talk to a running controller.

    Args:
        host / port: the job's store (from the registry file the controller writes).
        timeout: bounds the connection and the wait for the controller's reply.
    """

    def __init__(self, host: str, port: int, timeout: timedelta = timedelta(seconds=30)):
        self.host, self.port, self.timeout = host, port, timeout

    def request_nodes(self, nodes: int) -> dict:
        """Ask for a resize to `nodes`; return the controller's reply (it answers before resizing).

        Raises:
            TimeoutError: no reply within the timeout (the controller is busy in a transition or gone).
        """
        store = launcher_store(self.host, self.port, self.timeout)
        seq = store.add("ctl/seq", 1)
        store.set(f"ctl/req/{seq}", json.dumps({"nodes": nodes}))
        try:
            store.wait([f"ctl/reply/{seq}"], self.timeout)
        except Exception as exc:
            raise TimeoutError(f"no reply to request {seq} within {self.timeout.total_seconds():g} s") from exc
        return json.loads(store.get(f"ctl/reply/{seq}"))

    def status(self) -> dict:
        store = launcher_store(self.host, self.port, self.timeout)
        store.wait(["status"], self.timeout)
        return json.loads(store.get("status"))


class ControlInbox:
    """Controller side of the operator channel: new requests since the last poll, and replies."""

    def __init__(self, store: dist.Store):
        self.store = store
        self.seen = 0

    def poll(self) -> list[tuple[int, dict]]:
        last = self.store.add("ctl/seq", 0)
        out = []
        while self.seen < last:
            self.seen += 1
            key = f"ctl/req/{self.seen}"
            if self.store.check([key]):
                try:
                    out.append((self.seen, json.loads(self.store.get(key))))
                except ValueError:
                    self.reply(self.seen, False, "request is not JSON")
        return out

    def reply(self, seq: int, ok: bool, message: str, **extra) -> None:
        self.store.set(f"ctl/reply/{seq}", json.dumps({"ok": ok, "message": message, **extra}))


def helper_script(main_job: str, nodes: int, gpus_per_node: int, partition: Optional[str], exclude: Sequence[str],
                  store_addr: str, workers_per_node: int, orphan_timeout: timedelta, log_dir: Path,
                  command: Sequence[str], workdir: Path) -> str:
    """The batch script of a grow helper job (a normal job the job_submit hook skips by its comment)."""
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={helper_name(main_job)}",
             f"#SBATCH --comment={helper_comment(main_job)}",
             f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node=1",
             f"#SBATCH --output={log_dir}/helper-%j.out",
             f"#SBATCH --chdir={workdir}"]
    if gpus_per_node > 0:
        lines.append(f"#SBATCH --gres=gpu:{gpus_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if exclude:
        lines.append(f"#SBATCH --exclude={','.join(sorted(exclude))}")
    agent = [sys.executable, "-m", "elastic_launcher.cli", "agent", "--main-job", str(main_job),
             "--store", store_addr, "--workers-per-node", str(workers_per_node),
             "--orphan-timeout", f"{orphan_timeout.total_seconds():g}", "--log-dir", str(log_dir), "--", *command]
    lines.append("exec " + " ".join(shlex.quote(a) for a in agent))
    return "\n".join(lines) + "\n"


def choose_leavers(nodes_in_order: Sequence[str], owner: dict[str, str], main_job: str, batch_host: str,
                   count: int, prefer: Sequence[str] = ()) -> list[str]:
    """Which `count` nodes leave a shrink: `prefer` first (stragglers, failed), then helper nodes (newest
    first), then main-job nodes from the highest, never the batch host.

    Raises:
        ValueError: fewer removable nodes than `count`.
    """
    order = [n for n in prefer if n in nodes_in_order and n != batch_host]
    helpers = [n for n in reversed(nodes_in_order) if owner.get(n) != str(main_job)]
    mains = [n for n in reversed(nodes_in_order) if owner.get(n) == str(main_job) and n != batch_host]
    for n in helpers + mains:
        if n not in order:
            order.append(n)
    if len(order) < count:
        raise ValueError(f"cannot remove {count} nodes of {list(nodes_in_order)}: only {order} are removable")
    return order[:count]


def wait_until(predicate, timeout: timedelta, interval: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout` passes; return its last value."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
