"""The grow helper agent: the batch step of a helper job, which lends its nodes to a main job.

Slurm 22.05 cannot merge nodes into a running GPU job (docs/design.md, section "Slurm": grow), so the
controller grows a job by submitting a *helper job*: a normal sbatch job named `elastic-helper-<main>`
with comment `elastic-helper:<main>` (the job_submit hook skips these). Its batch step runs this agent,
which starts one worker step per node of the helper allocation; the workers join the main job's
rendezvous like any other worker.

Lifecycle contract (no orphan allocations): the agent, and with it the helper job, ends when
- all its workers have ended (they left at a commit point after a shrink, or training finished);
- the controller writes `helper/<id>/stop` (the workers get `stop_timeout` to end, then SIGTERM/SIGKILL);
- the main job is no longer RUNNING in Slurm (completed, cancelled, failed, timed out, or unknown) *and*
  the controller's heartbeat did not move across that check plus `BEAT_GRACE` (a live controller runs
  inside a running main job; while slurmctld restarts, "unreachable" cannot be told from "gone", so
  Slurm's word alone never ends the agent while the controller beats);
- the controller's heartbeat counter has not moved, or the store could not be reached, for
  `orphan_timeout` (the controller died or hangs);
- the agent gets SIGTERM/SIGINT (scancel of the helper, its time limit).
In each case it stops the workers it started, reports, and exits. The controller also scancels helper
jobs it no longer needs and every helper at its own exit, so either side alone prevents orphans.
"""
from __future__ import annotations

import json
import logging
import signal
import threading
import time
from datetime import timedelta
from typing import Callable, Mapping, Optional, Sequence

from elastic_launcher import store_keys as keys
from elastic_launcher.workers import WorkerPool

log = logging.getLogger("elastic_launcher.helper_agent")

# After Slurm says the main job is not running, the agent waits this long for the heartbeat (bumped every
# 0.5 s by a live controller) to move before it believes it.
BEAT_GRACE = timedelta(seconds=1.5)


def read_key(store, key: str) -> Optional[str]:
    """The key's value, or None when it does not exist (never blocks on a missing key)."""
    if not store.check([key]):
        return None
    return store.get(key).decode()


class HelperAgent:
    """Runs the workers of one helper job and ends them (and itself) per the lifecycle contract.

    Args:
        helper_job: this helper job's id.
        main_job: the main job's id.
        nodes: the helper allocation's nodes.
        slots: workers per node.
        alloc_env: the helper allocation's Slurm environment (for srun).
        pool: the worker pool that starts the steps (its store address is the main job's store).
        connect: returns a store client (launcher namespace) or raises; called again after errors.
        main_job_running: returns False once the main job is not RUNNING (or unknown) in Slurm.
        orphan_timeout: give up after the controller's heartbeat stood still or the store failed this long.
        poll_interval: period of the agent loop.
        main_check_interval: period of the Slurm check of the main job.
        stop_timeout: after a stop request, time the workers get to exit before they are signalled (the
            controller sends it once they left the group or failed to within its own leave timeout).
        beat_grace: after Slurm says the main job is not running, how long the heartbeat gets to move
            (proving the controller, and so the main job, alive) before the agent believes Slurm.
    """

    def __init__(self, helper_job: str, main_job: str, nodes: Sequence[str], slots: int,
                 alloc_env: Mapping[str, str], pool: WorkerPool, connect: Callable[[], object],
                 main_job_running: Callable[[], bool], orphan_timeout: timedelta = timedelta(seconds=30),
                 poll_interval: timedelta = timedelta(seconds=0.5),
                 main_check_interval: timedelta = timedelta(seconds=5),
                 stop_timeout: timedelta = timedelta(seconds=5), beat_grace: timedelta = BEAT_GRACE):
        self.helper_job = str(helper_job)
        self.main_job = str(main_job)
        self.nodes = tuple(nodes)
        self.slots = slots
        self.alloc_env = dict(alloc_env)
        self.pool = pool
        self.connect = connect
        self.main_job_running = main_job_running
        self.orphan_timeout = orphan_timeout
        self.poll_interval = poll_interval
        self.main_check_interval = main_check_interval
        self.stop_timeout = stop_timeout
        self.beat_grace = beat_grace
        self._signalled = threading.Event()
        self.exit_reason_: Optional[str] = None

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT (scancel, time limit) end the agent's loop; call from the main thread."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._signalled.set())

    def run(self) -> str:
        """Start the workers, watch, stop them; return why the agent ended."""
        store = self._try_connect()
        for node in self.nodes:
            self.pool.start(node, self.slots, self.alloc_env, owner_job=self.helper_job)
        self._report(store, "running")
        last_beat, beat_seen_at = None, time.monotonic()
        next_main_check = time.monotonic()
        reason = None
        while reason is None:
            time.sleep(self.poll_interval.total_seconds())
            now = time.monotonic()
            if self._signalled.is_set():
                reason = "signalled (scancel or time limit)"
                break
            if not self.pool.running():
                reason = "all workers ended"
                break
            if now >= next_main_check:
                next_main_check = now + self.main_check_interval.total_seconds()
                if not self.main_job_running():
                    time.sleep(self.beat_grace.total_seconds())
                    beat = self._read_beat(store)
                    if beat is None or beat == last_beat:
                        reason = f"main job {self.main_job} is no longer running"
                        break
                    log.warning("helper %s: Slurm does not show main job %s running, but its controller beats: "
                                "Slurm unreachable? carrying on", self.helper_job, self.main_job)
                    last_beat, beat_seen_at = beat, time.monotonic()
            try:
                store = store or self.connect()
                beat = read_key(store, keys.CONTROLLER_BEAT)
                stop = read_key(store, keys.helper_stop(self.helper_job))
                self._report(store, "running")
            except Exception as exc:  # a store failure: the heartbeat is not seen, the orphan clock runs
                log.warning("helper %s: controller store unreachable: %s", self.helper_job, exc)
                store, beat, stop = None, last_beat, None
            if stop is not None:
                reason = f"controller asked to stop ({stop})"
                self.pool.wait_ended(list(self.nodes), self.stop_timeout)
                break
            if beat != last_beat:
                last_beat, beat_seen_at = beat, now
            if now - beat_seen_at > self.orphan_timeout.total_seconds():
                reason = f"controller unreachable or silent for more than {self.orphan_timeout.total_seconds():g} s"
        self.exit_reason_ = reason
        log.info("helper %s of job %s ends: %s", self.helper_job, self.main_job, reason)
        self.pool.stop_all()
        try:
            self._report(store or self.connect(), "exited")
        except Exception:  # the controller may be gone; exiting is what matters
            pass
        return reason

    def _read_beat(self, store) -> Optional[str]:
        """The heartbeat counter now; None when the store cannot be read."""
        try:
            return read_key(store or self.connect(), keys.CONTROLLER_BEAT)
        except Exception as exc:
            log.warning("helper %s: controller store unreachable: %s", self.helper_job, exc)
            return None

    def _try_connect(self):
        try:
            return self.connect()
        except Exception as exc:
            log.warning("helper %s: cannot reach the controller store yet: %s", self.helper_job, exc)
            return None

    def _report(self, store, state: str) -> None:
        if store is None:
            return
        steps = {node: (None if s.alive() else s.returncode()) for node, s in self.pool.steps.items()}
        store.set(keys.helper_status(self.helper_job),
                  json.dumps({"state": state, "nodes": list(self.nodes), "steps": steps,
                              "reason": self.exit_reason_}))
