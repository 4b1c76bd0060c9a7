"""One node of a restart job (#43): runs torchrun's agent and relays the launcher's checkpoint signal to the workers.

    python -m elastic_launcher.restart_node -- python -m torch.distributed.run --nnodes=1:4 ... train.py ...

The launcher starts this as the node's srun step (restart.py). SIGUSR1 sent to the step reaches this process (srun
forwards it); torchrun's agent would die of it, so the agent ignores it and this process sends it to the agent's
children, the workers: the script's own handler saves a checkpoint (the template's pattern); a script without one
ignores it (the disposition is inherited) and resumes, at the restart, from its own last checkpoint. SIGTERM and SIGINT go to the agent, which stops
its workers. The exit status is the agent's.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The direct children of `pid` (Linux /proc); [] when it has ended."""
    found = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:   # a process that ended while we read
            continue
        fields = text[text.rfind(")") + 2:].split()   # after "(comm)": state, ppid, ...
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(stat.parent.name))
    return found


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m elastic_launcher.restart_node -- TORCHRUN-COMMAND ...", file=sys.stderr)
        return 2
    # torch 2.13's shared rendezvous store does not survive a scale-up (a surviving rank 0 does not publish the
    # workers' store address in the new round, and a newcomer waits for it forever): each round gets its own
    # Slurm may deliver a step's signal to each of its processes: the agent (whose default action on SIGUSR1 is to
    # die) ignores it, and so do workers that set no handler of their own (inherited by the exec)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    agent = subprocess.Popen(argv, env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})

    def to_workers(signum, _frame) -> None:
        for pid in children(agent.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGUSR1, to_workers)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: agent.send_signal(signum))
    while True:
        try:
            return agent.wait()
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
