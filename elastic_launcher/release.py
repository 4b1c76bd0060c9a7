"""Giving nodes back, one controller tick at a time (#27.2): :class:`Releaser` executes the releases
(`resize_ops.ReleaseOp`: a shrink's leavers, a failed node) and is the one way a helper job ends.

Slurm SIGKILLs the tasks of a node it takes back, so a node's worker step ends first: it gets `exit_s` to end by
itself (its ranks left at a commit point, or failed), then SIGTERM, then SIGKILL, each stage a deadline of the
injected clock that a tick checks, never a wait. Then GIVE_BACK: main-job nodes with `client.shrink` (its
refreshed Slurm environment replaces the one later steps start with), helper nodes by ending the whole helper
(:meth:`Releaser.end_helper`) or, when some of its nodes stay, by shrinking the helper.

Ending a helper (:meth:`Releaser.end_helper`, used by a shrink, a failed grow and the controller's exit): its
stop key for the agent at once, then each tick Slurm is asked whether it ended; at its grace's deadline it is
scancelled (a failed grow's helper has no grace: scancel in the same tick).

A Slurm change (shrink, scancel) is a :class:`SlurmChange`: tried at once, and while it fails transiently (a
slurmctld restart, a timeout) tried again on a later tick, with backoff (1, 2, 4 ... 10 s), for `SLURM_RETRY` from
its first attempt; no tick waits between attempts, so a node failure, an operator request or a measurement is
handled while slurmctld is down. A release waits in GIVING_BACK until its changes ended. Only the controller's exit
drains what is still in flight (:meth:`Releaser.drain`), bounded by the same deadline.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
from datetime import timedelta
from typing import Callable, Optional, Sequence

from elastic_launcher import store_keys as keys
from elastic_launcher.reporting import RecordLog
from elastic_launcher.resize_ops import ActionKind, ReleaseOp, ReleaseState, ResizeLimits, advance_release
from slurm_plugin.client import LIVE_STATES, is_transient
from slurm_plugin.errors import JobNotFoundError, ResizeError, SlurmError

log = logging.getLogger("elastic_launcher.release")

# How long a Slurm change (shrink, scancel) is retried through transient failures such as a slurmctld restart;
# each attempt has the client's own per-command timeout (LaunchConfig.slurm_timeout).
SLURM_RETRY = timedelta(seconds=120)
FIRST_DELAY_S, MAX_DELAY_S = 1.0, 10.0  # the backoff between a change's attempts


@dataclasses.dataclass(frozen=True)
class SlurmChange:
    """A Slurm change in flight (see the module docstring).

    Attributes:
        what: how the log names it (`job 42: shrink job 42 to node1`).
        call: runs it once (a Slurm command, bounded by the client's timeout); its result goes to `done`.
        done: called with the result on success.
        failed: called with the error once it is refused, or out of retries.
        owners: the releases waiting for it (none: a helper's scancel); a newer change of the same job takes over
            an older one's owners (a shrink to fewer nodes covers the earlier one's).
        deadline: no attempt starts after it (the first attempt + SLURM_RETRY).
        next_at: when the next attempt is due.
    """

    what: str
    call: Callable[[], object]
    done: Callable[[object], None]
    failed: Callable[[Exception], None]
    owners: tuple[str, ...]
    deadline: float
    next_at: float
    delay: float = FIRST_DELAY_S
    attempt: int = 1


def attempt_change(change: SlurmChange, now: float) -> Optional[SlurmChange]:
    """Try `change` once at `now`: None when it ended (its `done` or `failed` was called), else the change with its
    next attempt scheduled (a transient failure before the deadline)."""
    try:
        result = change.call()
    except (SlurmError, ResizeError, JobNotFoundError) as exc:
        left = change.deadline - now
        if not is_transient(exc) or left <= 0:
            change.failed(exc)
            return None
        wait = min(change.delay, left)
        log.warning("%s: attempt %d failed (%s); retrying in %.1f s (%.0f s left)", change.what, change.attempt, exc,
                    wait, left)
        return dataclasses.replace(change, next_at=now + wait, delay=min(change.delay * 2, MAX_DELAY_S),
                                   attempt=change.attempt + 1)
    if change.attempt > 1:
        log.warning("%s: succeeded at attempt %d", change.what, change.attempt)
    change.done(result)
    return None


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
        self.changes: dict[str, SlurmChange] = {}  # `shrink:<job>` / `cancel:<job>` -> the Slurm change in flight

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
        """Try the Slurm changes that are due, move every release one stage and every helper end on; never waits."""
        now = self.clock()
        for key, change in list(self.changes.items()):
            if now >= change.next_at:
                self._attempt(key, change, now)
        for owner in list(self.releases):
            self._advance(owner, now)
        self.reap(now)

    def drain(self, now: Callable[[], float], sleep: Callable[[float], None]) -> None:
        """Retry what is still in flight until each change ended or passed its deadline (the controller's exit:
        being the end, it may wait)."""
        while self.changes:
            due = min(c.next_at for c in self.changes.values())
            if due > now():
                sleep(due - now())
            for key, change in list(self.changes.items()):
                if now() >= change.next_at:
                    self._attempt(key, change, now())

    def _change(self, key: str, what: str, call: Callable[[], object], done: Callable[[object], None],
                failed: Callable[[Exception], None], owner: Optional[str] = None) -> None:
        """Start a Slurm change and try it at once; a newer change of the same `key` replaces one in flight and
        takes over the releases that waited for it."""
        now = self.clock()
        before = self.changes[key].owners if key in self.changes else ()
        owners = before + ((owner,) if owner is not None and owner not in before else ())
        self._attempt(key, SlurmChange(what, call, done, failed, owners, now + SLURM_RETRY.total_seconds(), now), now)

    def _attempt(self, key: str, change: SlurmChange, now: float) -> None:
        self.changes[key] = change
        again = attempt_change(change, now)
        if again is None:
            if self.changes.get(key) is change:  # its callbacks may have started a newer one of the same key
                del self.changes[key]
        else:
            self.changes[key] = again

    def _advance(self, owner: str, now: float) -> ReleaseOp:
        op = self.releases[owner]
        if op.done:
            return op
        running = tuple(n for n in op.nodes if n in self.pool.steps and self.pool.steps[n].alive())
        given_back = not any(owner in c.owners for c in self.changes.values())
        op, actions = advance_release(op, running, now, self.limits, given_back=given_back)
        self.releases[owner] = op
        for act in actions:
            if act.kind is ActionKind.TERMINATE or act.kind is ActionKind.KILL:
                sig = signal.SIGTERM if act.kind is ActionKind.TERMINATE else signal.SIGKILL
                for node in act.nodes:
                    log.warning("workers on %s did not exit after leaving; %s to their step", node, sig.name)
                    self.pool.signal_step(node, sig)
            elif act.kind is ActionKind.GIVE_BACK:
                self._give_back(owner, op.nodes, op.reason)
                op, _ = advance_release(op, running, now, self.limits,  # changes done in this tick: RELEASED now
                                        given_back=not any(owner in c.owners for c in self.changes.values()))
                self.releases[owner] = op
        if op.done:
            for node in op.nodes:
                self.pool.forget(node)
                self.fleet.nodes.pop(node, None)
                self.forget(node)
            self.seconds[owner] = round(now - op.started, 3)
        return op

    def _give_back(self, owner: str, nodes: Sequence[str], reason: str) -> None:
        mains = [n for n in nodes if n in self.fleet.nodes and self.fleet.nodes[n].owner == self.job_id]
        # nodes of every release still giving back (this one's too) are going: a shrink keeps none of them
        going = {n for op in self.releases.values() if op.state is ReleaseState.GIVING_BACK for n in op.nodes}
        if mains:
            keep = [n for n, s in self.fleet.nodes.items() if s.owner == self.job_id and n not in going]
            self._slurm_shrink(owner, self.job_id, keep, reason, main=True)
        for helper, helper_nodes in list(self.fleet.helpers.items()):
            leaving = [n for n in helper_nodes if n in nodes]
            staying = [n for n in helper_nodes if n not in going]
            if leaving and staying:
                self._slurm_shrink(owner, helper, staying, reason, main=False)
                self.fleet.helpers[helper] = staying
            elif leaving:
                self.end_helper(helper, reason, self.limits.leave_s)

    def _slurm_shrink(self, owner: str, job: str, keep: Sequence[str], reason: str, main: bool) -> None:
        """`client.shrink(job, keep)` as a Slurm change of `owner`'s release; for the main job the refreshed
        environment replaces the one new steps start with. Refused, or unreachable past `SLURM_RETRY`: a
        `slurm_shrink_failed` record, and the node stays allocated, unused, until the job ends."""
        t0 = self.clock()

        def done(result) -> None:
            if main:
                self.fleet.alloc = self.fleet.alloc.with_nodes(tuple(keep), result.apply(self.fleet.alloc.env))
            self.records.write("slurm_shrink", job=job, nodelist=result.job.nodelist, nodes=len(result.job.nodes),
                               reason=reason, wall_s=round(self.clock() - t0, 3))

        def failed(exc: Exception) -> None:
            log.error("job %s: could not give nodes back to Slurm (job %s keeps %s): %s; they stay allocated, "
                      "unused", self.job_id, job, ",".join(keep), exc)
            self.records.write("slurm_shrink_failed", job=job, keep=list(keep), reason=reason, error=str(exc),
                               wall_s=round(self.clock() - t0, 3))

        self._change(f"shrink:{job}", f"job {self.job_id}: shrink job {job} to {','.join(keep)}",
                     lambda: self.slurm.shrink(int(job), list(keep)), done, failed, owner)

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
        """scancel the helper, as a Slurm change (retried on later ticks through transient failures)."""

        def failed(exc: Exception) -> None:
            if isinstance(exc, JobNotFoundError):  # already gone
                log.info("scancel %s: %s", helper, exc)
            else:
                log.error("job %s: could not cancel helper %s: %s (its agent ends on its own after the orphan "
                          "timeout)", self.job_id, helper, exc)

        self._change(f"cancel:{helper}", f"job {self.job_id}: scancel helper {helper}",
                     lambda: self.slurm.cancel(int(helper)), lambda _: None, failed)
