"""Giving nodes back, one controller tick at a time (#27.2): :class:`Releaser` executes the releases
(`resize_ops.ReleaseOp`: a shrink's leavers, a failed node) and is the one way a helper job ends.

Slurm SIGKILLs the tasks of a node it takes back, so a node's worker step ends first: it gets `exit_s` to end by
itself (its ranks left at a commit point, or failed), then SIGTERM, then SIGKILL, each stage a deadline of the
injected clock that a tick checks, never a wait. Then GIVE_BACK: main-job nodes with `client.shrink` (its
refreshed Slurm environment replaces the one later steps start with), helper nodes by ending the whole helper
(:meth:`Releaser.end_helper`) or, when some of its nodes stay, by shrinking the helper.

Ending a helper (:meth:`Releaser.end_helper`, used by a shrink, a failed grow and the controller's exit): its
stop key for the agent at once, then each tick Slurm is asked whether it ended; at its grace's deadline it is
scancelled (a failed grow's helper has no grace: scancel in the same tick). Slurm changes (shrink, scancel) go
through `slurm_plugin.client.retry_transient` (up to `SLURM_RETRY` through a slurmctld restart; that is the one
wait left in a tick, bounded by it).
"""
from __future__ import annotations

import dataclasses
import logging
import signal
from datetime import timedelta
from typing import Callable, Optional, Sequence

from elastic_launcher import store_keys as keys
from elastic_launcher.reporting import RecordLog
from elastic_launcher.resize_ops import ActionKind, ReleaseOp, ResizeLimits, advance_release
from slurm_plugin.client import LIVE_STATES, retry_transient
from slurm_plugin.errors import JobNotFoundError, ResizeError, SlurmError

log = logging.getLogger("elastic_launcher.release")

# How long a Slurm change (shrink, scancel) is retried through transient failures such as a slurmctld restart;
# each attempt has the client's own per-command timeout (LaunchConfig.slurm_timeout).
SLURM_RETRY = timedelta(seconds=120)


@dataclasses.dataclass(frozen=True)
class HelperEnd:
    """A helper job asked to end: why, and when it is scancelled if Slurm still lists it running."""

    helper: str
    reason: str
    deadline: float


class Releaser:
    """Executes releases and helper endings (see the module docstring); holds only what it is given.

    Args:
        fleet: the job's nodes (`resize.Fleet`; released nodes leave it, a main-job shrink refreshes `alloc`).
        pool: the controller's worker steps (main-job nodes).
        slurm: the Slurm client.
        kv: the launcher channel (helper stop keys).
        records: the records log.
        forget: called with each node that left the fleet (the straggler detector forgets it).
        limits: exit_s / leave_s of the signal stages, leave_s the grace of a released helper.
        clock: the injected monotonic clock.
    """

    def __init__(self, fleet, pool, slurm, kv, records: RecordLog, forget: Callable[[str], None],
                 limits: ResizeLimits, clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.pool = pool
        self.slurm = slurm
        self.kv = kv
        self.records = records
        self.forget = forget
        self.limits = limits
        self.clock = clock
        self.releases: dict[str, ReleaseOp] = {}  # owner (the resize op, a failed node) -> its release
        self.ending: dict[str, HelperEnd] = {}  # helper job id -> its end in progress
        self.seconds: dict[str, float] = {}  # owner -> seconds its release took (the transition's release_s)

    @property
    def job_id(self) -> str:
        return self.fleet.job_id

    # -- releases ------------------------------------------------------------------------------------------
    def release(self, owner: str, nodes: Sequence[str], reason: str, give_back: bool = True) -> ReleaseOp:
        """Start releasing `nodes` for `owner` and move it at once (a node whose step ended goes back now)."""
        self.releases[owner] = ReleaseOp(tuple(nodes), reason, give_back=give_back)
        return self._advance(owner, self.clock())

    def done(self, owner: str) -> bool:
        """`owner`'s release ended (its nodes are out of the fleet); False when it has none."""
        op = self.releases.get(owner)
        return op is not None and op.done

    def close(self, owner: str) -> None:
        """Forget `owner`'s ended release."""
        self.releases.pop(owner, None)
        self.seconds.pop(owner, None)

    def tick(self) -> None:
        """Move every release one stage and every helper end on; never waits (but for a Slurm change's retries)."""
        now = self.clock()
        for owner in list(self.releases):
            self._advance(owner, now)
        self.reap(now)

    def _advance(self, owner: str, now: float) -> ReleaseOp:
        op = self.releases[owner]
        if op.done:
            return op
        running = tuple(n for n in op.nodes if n in self.pool.steps and self.pool.steps[n].alive())
        op, actions = advance_release(op, running, now, self.limits)
        self.releases[owner] = op
        for act in actions:
            if act.kind is ActionKind.TERMINATE or act.kind is ActionKind.KILL:
                sig = signal.SIGTERM if act.kind is ActionKind.TERMINATE else signal.SIGKILL
                for node in act.nodes:
                    log.warning("workers on %s did not exit after leaving; %s to their step", node, sig.name)
                    self.pool.signal_step(node, sig)
            elif act.kind is ActionKind.GIVE_BACK:
                self._give_back(op.nodes, op.reason)
        if op.done:
            for node in op.nodes:
                self.pool.forget(node)
                self.fleet.nodes.pop(node, None)
                self.forget(node)
            self.seconds[owner] = round(now - op.started, 3)
        return op

    def _give_back(self, nodes: Sequence[str], reason: str) -> None:
        mains = [n for n in nodes if n in self.fleet.nodes and self.fleet.nodes[n].owner == self.job_id]
        if mains:
            keep = [n for n, s in self.fleet.nodes.items() if s.owner == self.job_id and n not in mains]
            self._slurm_shrink(self.job_id, keep, reason, main=True)
        for helper, helper_nodes in list(self.fleet.helpers.items()):
            going = [n for n in helper_nodes if n in nodes]
            staying = [n for n in helper_nodes if n not in going]
            if going and staying:
                self._slurm_shrink(helper, staying, reason, main=False)
                self.fleet.helpers[helper] = staying
            elif going:
                self.end_helper(helper, reason, self.limits.leave_s)

    def _slurm_shrink(self, job: str, keep: Sequence[str], reason: str, main: bool) -> bool:
        """`client.shrink(job, keep)`, retried through transient failures for `SLURM_RETRY`; for the main job the
        refreshed environment replaces the one new steps start with. False (and a `slurm_shrink_failed` record)
        when Slurm refused or stayed unreachable: the node stays allocated, unused, until the job ends."""
        t0 = self.clock()
        try:
            result = retry_transient(lambda: self.slurm.shrink(int(job), list(keep)),
                                     f"job {self.job_id}: shrink job {job} to {','.join(keep)}", SLURM_RETRY)
        except (SlurmError, ResizeError, JobNotFoundError) as exc:
            log.error("job %s: could not give nodes back to Slurm (job %s keeps %s): %s; they stay allocated, "
                      "unused", self.job_id, job, ",".join(keep), exc)
            self.records.write("slurm_shrink_failed", job=job, keep=list(keep), reason=reason, error=str(exc),
                               wall_s=round(self.clock() - t0, 3))
            return False
        if main:
            self.fleet.alloc = self.fleet.alloc.with_nodes(tuple(keep), result.apply(self.fleet.alloc.env))
        self.records.write("slurm_shrink", job=job, nodelist=result.job.nodelist, nodes=len(result.job.nodes),
                           reason=reason, wall_s=round(self.clock() - t0, 3))
        return True

    # -- helper jobs: the one way to end one -----------------------------------------------------------------
    def end_helper(self, helper: str, reason: str, grace_s: float = 0.0) -> None:
        """End `helper`: its stop key now, scancel once `grace_s` passed and Slurm still lists it alive (0: now).
        It leaves the fleet at once; `helper_ended` is recorded when it is gone or cancelled. A helper already ending
        keeps its reason and takes the earlier of the two deadlines (the controller's exit shortens a release's)."""
        end = self.ending.get(helper)
        if end is None:
            try:
                self.kv.set(keys.helper_stop(helper), reason)
            except Exception as exc:  # noqa: BLE001 - the store closes at exit; scancel follows anyway
                log.warning("cannot signal helper %s: %s", helper, exc)
        self.fleet.helpers.pop(helper, None)
        deadline = self.clock() + grace_s
        if end is None or deadline < end.deadline:
            self.ending[helper] = HelperEnd(helper, reason if end is None else end.reason, deadline)
        self.reap(self.clock(), only=helper)

    def reap(self, now: float, only: Optional[str] = None) -> int:
        """Finish the helper ends whose helper is gone or whose grace passed (scancel); return how many remain."""
        for helper, end in list(self.ending.items()):
            if only is not None and helper != only:
                continue
            cancelled = now >= end.deadline
            if cancelled:
                self.cancel(helper)
            elif not self.helper_gone(helper):
                continue
            del self.ending[helper]
            self.records.write("helper_ended", helper=helper, reason=end.reason, cancelled=cancelled)
        return len(self.ending)

    def helper_gone(self, helper: str) -> bool:
        """True once Slurm shows the helper ended or no longer lists it; False while it runs or while Slurm cannot
        be asked (an unreachable controller is not a finished job)."""
        try:
            return self.slurm.job(int(helper)).state not in LIVE_STATES
        except JobNotFoundError:
            return True
        except SlurmError as exc:
            log.warning("job %s: state of helper %s unknown: %s", self.job_id, helper, exc)
            return False

    def cancel(self, helper: str) -> None:
        """scancel the helper, retried through transient failures for `SLURM_RETRY`."""
        try:
            retry_transient(lambda: self.slurm.cancel(int(helper)), f"job {self.job_id}: scancel helper {helper}",
                            SLURM_RETRY)
        except JobNotFoundError as exc:  # already gone
            log.info("scancel %s: %s", helper, exc)
        except SlurmError as exc:
            log.error("job %s: could not cancel helper %s: %s (its agent ends on its own after the orphan "
                      "timeout)", self.job_id, helper, exc)
