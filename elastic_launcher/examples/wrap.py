"""Run an existing torch.distributed script unchanged under elastic-launch (template `wrap-train-py`).

For a `train.py` written for `torchrun` (it calls `init_process_group()` with the default `env://` and
reads RANK / WORLD_SIZE / LOCAL_RANK): each worker joins the launcher's membership, waits for the first
plan, agrees on a master address with the others through the job's store, then runs the command with
the torchrun variables set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
exits with its status. The job is right-sized at submission (the hook) but keeps its size while it runs:
use `#ELASTIC elastic=off` with this wrapper. Resizing at run time needs the script to adopt ElasticTrainer
(see elastic_launcher/examples/resnet50.py).

Example (the command of an sbatch script):
    elastic-launch --script "$0" -- python -m elastic_launcher.examples.wrap -- python train.py --epochs 10
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta

from elastic_launcher import store_keys as keys
from elastic_launcher.examples.common import WorkerEnv
from elastic_launcher.membership import Membership
from elastic_launcher.process_group import StoreAddr, connect_store
from elastic_launcher.workers import ProgressReporter


def free_port() -> int:
    """A TCP port free on this host now (the script's rank 0 binds it moments later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world: int, local_rank: int, local_world: int, master: str) -> dict[str, str]:
    """The variables a torchrun-style script reads."""
    host, _, port = master.rpartition(":")
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": host, "MASTER_PORT": port}


def build_parser() -> argparse.ArgumentParser:
    """The script's options (the templates' commands are checked against it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the plan and the master")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python train.py")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- python train.py")
    environ = os.environ
    env = WorkerEnv.from_environ(environ)
    timeout = timedelta(seconds=args.timeout)
    addr = StoreAddr.parse(env.store)
    membership = Membership(lambda: connect_store(addr, timeout), env.wid, timeout)
    membership.start()
    try:
        plan = membership.wait_for_plan()
        rank = plan.rank_of(env.wid)
        store = connect_store(addr.with_prefix(keys.wrap_channel(plan.id)), timeout)
        if rank == 0:
            store.set(keys.WRAP_MASTER, f"{socket.gethostname()}:{free_port()}")
        store.wait([keys.WRAP_MASTER], timeout)
        master = store.get(keys.WRAP_MASTER).decode()
        child_env = {**environ, **torchrun_env(rank, plan.world_size, env.local_id,
                                               int(environ.get("ELASTIC_SLOTS", "1")), master)}
        child = subprocess.Popen(command, env=child_env)
        signal.signal(signal.SIGTERM, lambda signum, _frame: child.send_signal(signum))
        if rank == 0:   # the controller waits for rank 0's first report of the plan and its switch record
            ProgressReporter(connect_store(addr, timeout), env.wid, env.node).report(plan.id, 0, 0, 0.0)
            membership.report_switched(plan, {"wrapped": True})
        return child.wait()
    finally:
        membership.stop()


if __name__ == "__main__":
    sys.exit(main())
