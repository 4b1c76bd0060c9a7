"""Restart mode's decisions (#43), pure: what a restart resize does next, and the command each node runs.

Under `#ELASTIC mode=restart` (`elastic-launch --restart`) the script is not changed: every node runs torchrun's
elastic agent (`--nnodes=MIN:MAX --rdzv-backend=c10d`, the rendezvous on the launcher's store), and a resize is
torchrun restarting every worker at the new size, the script resuming from its last checkpoint. restart.py executes
what :func:`advance` decides, one state a tick:

    CHECKPOINT --(a checkpoint newer than the signal, or checkpoint_timeout)--> CHANGING   [CHANGE]
    CHANGING   --(a step line at the target world size)-------------------> DONE       [RECORD]
    CHANGING   --(change_timeout, or the grow's helper ended)-------------> FAILED     [FAIL]

CHECKPOINT begins with SIGUSR1 to every worker (sent when the op is made): the script's handler saves a checkpoint
and trains on (Lightning's pattern); a script that ignores the signal resumes from its own last checkpoint. CHANGE
submits a helper job (grow) or ends helper jobs (shrink): torchrun's agents see the new node waiting, or their
workers fail with the leavers gone, and restart at the new size. The restart's cost is the op's first step at the
new size less its signal (`cost_s`), what the planner prices the next resize with (predictor/restart_price.py).
"""
from __future__ import annotations

import dataclasses
import enum
import re
from datetime import timedelta
from typing import Optional, Sequence

STEP_LINE = re.compile(rb"\bstep (\d+)\b.*\bworld (\d+)\b")   # the script's progress line, e.g. the template's
# `step 120/300  world 2  loss 0.0004`: the first step at the new size is read from it


class RestartState(enum.Enum):
    CHECKPOINT = "checkpoint"   # SIGUSR1 sent; waiting for the script's checkpoint
    CHANGING = "changing"       # the membership changed; waiting for a step at the new size
    DONE = "done"
    FAILED = "failed"


class RestartAction(enum.Enum):
    CHANGE = "change"   # grow: submit the helper job; shrink: end the leaving helper jobs
    RECORD = "record"   # the resize finished: record its cost
    FAIL = "fail"       # give up: record why (a grow's helper is ended)


@dataclasses.dataclass(frozen=True)
class RestartLimits:
    """How long each wait of a restart resize lasts.

    Attributes:
        checkpoint_timeout: after SIGUSR1, the wait for the script's checkpoint (the grace period).
        change_timeout: after the change, the wait for the first step at the new size (a helper's start,
            torchrun's rendezvous and restart, the script's load).
    """

    checkpoint_timeout: timedelta = timedelta(seconds=60)
    change_timeout: timedelta = timedelta(seconds=180)

    def __post_init__(self) -> None:
        for name in ("checkpoint_timeout", "change_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"RestartLimits.{name}: must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class RestartOp:
    """One restart resize.

    Attributes:
        grow: True: add nodes; False: release them.
        target: the node count asked for; `world`: the worker count it means (the step line says it).
        from_nodes: nodes before.
        action / reason: who asked and why (records).
        signalled: when SIGUSR1 went to the workers (the clock of the executor).
        state: where it is; `changed`: when CHANGE ran; `checkpointed`: whether the script's checkpoint came in time.
        helper: the grow's helper job, once submitted.
        cost_s: signal to first step at the new size, once DONE; `error`: why it FAILED.
    """

    grow: bool
    target: int
    world: int
    from_nodes: int
    action: str
    reason: str
    signalled: float
    state: RestartState = RestartState.CHECKPOINT
    changed: Optional[float] = None
    checkpointed: Optional[bool] = None
    helper: Optional[str] = None
    cost_s: Optional[float] = None
    error: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.state in (RestartState.DONE, RestartState.FAILED)


@dataclasses.dataclass(frozen=True)
class RestartObservation:
    """What the executor saw this tick.

    Attributes:
        checkpoint_at: the newest modification time under the checkpoint directory (None: none given or empty),
            on the executor's clock.
        world: the world size of the newest step line since the change (None: none yet).
        helper_ended: the grow's helper job is gone (it failed to start, or was cancelled).
    """

    checkpoint_at: Optional[float] = None
    world: Optional[int] = None
    helper_ended: bool = False


def advance(op: RestartOp, obs: RestartObservation, now: float,
            limits: RestartLimits) -> tuple[RestartOp, list[RestartAction]]:
    """The op's next state and what to do (the module docstring's diagram)."""
    if op.state is RestartState.CHECKPOINT:
        saved = obs.checkpoint_at is not None and obs.checkpoint_at >= op.signalled
        if saved or now - op.signalled >= limits.checkpoint_timeout.total_seconds():
            return dataclasses.replace(op, state=RestartState.CHANGING, changed=now, checkpointed=saved), \
                [RestartAction.CHANGE]
        return op, []
    if op.state is RestartState.CHANGING:
        if obs.world == op.world:
            return dataclasses.replace(op, state=RestartState.DONE, cost_s=round(now - op.signalled, 3)), \
                [RestartAction.RECORD]
        if op.grow and obs.helper_ended:
            return dataclasses.replace(op, state=RestartState.FAILED, error=f"helper job {op.helper} ended before "
                                       f"its node trained"), [RestartAction.FAIL]
        if now - op.changed >= limits.change_timeout.total_seconds():
            return dataclasses.replace(op, state=RestartState.FAILED, error=f"no step at world size {op.world} within "
                                       f"{limits.change_timeout.total_seconds():g} s"), [RestartAction.FAIL]
    return op, []


def node_range(gpus_min: int, gpus_max: int, slots: int) -> tuple[int, int]:
    """torchrun's `--nnodes=MIN:MAX` from the directives' GPU bounds, in whole nodes of `slots` workers."""
    low = max(1, -(-gpus_min // slots))
    return low, max(low, gpus_max // slots)


def torchrun_argv(python: str, command: Sequence[str], store_addr: str, run_id: str, nodes: tuple[int, int],
                  slots: int, last_call: timedelta, max_restarts: int) -> list[str]:
    """The srun step of one node: `restart_node` (relays SIGUSR1 to the workers) around torchrun's agent, whose
    rendezvous is the launcher's store (`is_host=false`: no agent hosts one), `command` as the workers. A node that
    left is dropped from the rendezvous after three missed one-second heartbeats."""
    conf = f"is_host=false,last_call_timeout={last_call.total_seconds():g},keep_alive_interval=1," \
           "keep_alive_max_attempt=3"
    return [python, "-m", "elastic_launcher.restart_node", "--", python, "-m", "torch.distributed.run",
            f"--nnodes={nodes[0]}:{nodes[1]}", f"--nproc-per-node={slots}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={store_addr}", f"--rdzv-id={run_id}", f"--rdzv-conf={conf}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "--no-python", *command]


def step_lines(text: bytes) -> list[tuple[int, int]]:
    """`(step, world)` of each step line in `text`, in order."""
    return [(int(m.group(1)), int(m.group(2))) for m in STEP_LINE.finditer(text)]
