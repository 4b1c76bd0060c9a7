"""The trainer's commit protocol: what happens at the end of every batch, and at commit points.

Between commit points a step queues its device work and returns: no host synchronisation, no store access. At a
commit point (a step every rank agreed on: :mod:`elastic_launcher.commit_schedule`) the ranks run one tiny
allreduce vote on the current group carrying (ready-for-next-epoch, collective ok, local ok, count, proposed
interval, loader lead), broadcast the floating-point buffers and take the in-memory snapshot that is the rollback
point. The vote's outcome is decided by :func:`~elastic_launcher.epoch_decisions.decide_commit` (pure) and applied
here: a failed collective -> recovery (the executor agrees on survivors through the store, builds a fresh group,
rolls back to the last in-memory commit and re-syncs from rank 0); a local error -> roll back and retry (at most
``max_retries`` in a row); everyone ready for the posted next plan -> arm the switch, then switch (or leave).

:class:`Current` is the epoch the worker trains in, the one state the protocol, the rendezvous client, the data
feed and the trainer's front all read; only the protocol (and ``join()``) changes it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_launcher.commit_schedule import CommitSchedule
from elastic_launcher.epoch_decisions import CommitAction, CommitOutcome, Phase, VoteTally, decide_commit
from elastic_launcher.epochs import Epoch, EpochExecutor, SwitchLog
from elastic_launcher.errors import LeftGroup, ProcessGroupError, StateMismatch, TooManyFailures, TrainerPhaseError
from elastic_launcher.feed import DataFeed
from elastic_launcher.loading import Basis, Pipeline
from elastic_launcher.membership import Plan
from elastic_launcher.process_group import ProcessGroupWrapper
from elastic_launcher.rendezvous_client import RendezvousClient
from elastic_launcher.state import TrainingState
from elastic_launcher.telemetry import HookState, Telemetry
from elastic_launcher.trainer_config import TrainerConfig

logger = logging.getLogger("elastic_launcher.trainer")
__all__ = ["Current", "CommitProtocol"]

_COMMITTING = (CommitOutcome.COMMIT, CommitOutcome.ARM, CommitOutcome.SWITCH, CommitOutcome.LEAVE)


@dataclass
class Current:
    """The epoch a worker trains in (what :class:`~elastic_launcher.epochs.EpochExecutor` handed back, flat: every
    step reads these), and where it stands in it."""

    phase: Phase = Phase.CREATED
    plan: Optional[Plan] = None  # the membership epoch; None until join() returned
    group: Optional[ProcessGroupWrapper] = None  # its process group; None until join() returned
    ddp: Optional[DDP] = None  # the DDP wrapper on the group; None between epochs (and before the state arrived)
    hook: Optional[HookState] = None  # the wrapper's communication hook state
    batches: list[int] = field(default_factory=list)  # every rank's local batch size
    committed_step: int = 0  # the step of the last commit point (the rollback point)
    epoch_start_step: int = 0  # the step the epoch began at (the same on every rank of its plan)
    switch_at: Optional[int] = None  # the commit point an ARM set for the switch (the loader loads ahead for it)


class CommitProtocol:
    """The end of each batch and the commit points of one worker: changes ``current`` and the training ``state``,
    asks ``rdzv`` for the next plan and tells ``feed`` what to load for. The other arguments are the trainer's;
    ``executor`` (the executor of epoch changes) is set once ``join()`` built it."""

    def __init__(self, config: TrainerConfig, state: TrainingState, current: Current, rdzv: RendezvousClient,
                 feed: DataFeed, device: torch.device, wid: str, telemetry: Optional[Telemetry] = None,
                 progress=None, fault=None) -> None:
        self.config = config
        self.state = state
        self.current = current
        self.rdzv = rdzv
        self.feed = feed
        self.device = device
        self.wid = wid
        self.telemetry = telemetry
        self.progress = progress
        self.fault = fault
        self.executor: Optional[EpochExecutor] = None
        self.schedule = CommitSchedule(config.commit_every, config.commit_period.total_seconds(),
                                       config.commit_overhead, config.max_commit_every)
        self.switch_log = SwitchLog(wid, device)
        self.failures = 0
        self._local_error: Optional[BaseException] = None
        self._nonfinite: Optional[torch.Tensor] = None  # device flag of watch_loss, read by the next vote
        self._last_commit_t = time.perf_counter()
        self._uncommitted = (0, 0.0)  # (steps, compute seconds) since the last commit point, for the progress hook
        self.stop_requested = False   # this rank was asked to stop (request_stop: a signal handler may set it)
        self.stop_agreed = False      # a commit point's vote said stop: every rank stops at that step

    def step(self) -> int:
        return int(self.state.counters["step"])

    # ---- what the training loop calls -----------------------------------------------------------------------
    def report_error(self, e: BaseException) -> None:
        self._local_error = self._local_error or e

    def watch_loss(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad

    def batch_waited(self, wait_s: float) -> None:
        pending = self.switch_log.pending
        if pending is not None and "batch_wait_s" not in pending:
            pending["batch_wait_s"] = wait_s  # the new epoch's first batch

    def commit(self, now: float, compute_s: Optional[float], batch_t: float) -> bool:
        """``ElasticTrainer.commit`` (``batch_t``: when the batch was handed out). False once this worker left."""
        if compute_s is None:
            hook = self.current.hook
            first = hook.first_sync_t if hook is not None else None
            compute_s = (first if first is not None and first >= batch_t else now) - batch_t
        before, committed = self.step(), self.current.committed_step
        went_on = self._commit(now)
        self._settle(committed, compute_s if self.step() == before + 1 else None)
        return went_on

    def end_commit_point(self) -> None:
        """The end of training (``max_steps`` or ``epochs``, the same step on every rank) is a commit point: errors
        since the last one are voted on, buffers synchronised, progress reported."""
        committed = self.current.committed_step
        self._vote()
        self._settle(committed, None)

    def enter_joined(self, pipe: Pipeline, join_times: dict) -> None:
        """The loader's first call after ``join()`` (``join_times``: its phases): starts loading where the epoch is
        expected to start, then receives the state and enters the plan joined."""
        cur, times = self.current, dict(join_times)
        t_joined = times.pop("t_joined", None)
        t0 = time.perf_counter()
        times["to_loader_s"] = t0 - t_joined if t_joined is not None else None
        def basis() -> Basis:
            return Basis(cur.group.rank(), tuple(self.executor.batches_for(cur.plan, cur.group.size())))
        watch = self.executor.entry_watch(cur.plan)  # a newcomer's wait ends as a recovery of its plan begins
        times.update(self.feed.load_ahead(pipe, cur.plan, basis, lambda pid: self.rdzv.loader_start(pid, watch)))
        times["load_ahead_s"] = time.perf_counter() - t0
        epoch, rec = self.executor.join(cur.plan, cur.group, self.step)
        rec["join_s"] = times
        self._adopt(epoch, rec)

    def publish_observations(self) -> None:
        """Hands the telemetry's observation records to the progress hook's ``publish``, when both are given."""
        publish = getattr(self.progress, "publish", None)
        if publish is not None and self.telemetry is not None:
            records = self.telemetry.drain()
            if records:
                publish(records)

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def _settle(self, committed_before: int, step_compute_s: Optional[float]) -> None:
        """Progress bookkeeping after ``commit()`` (``step_compute_s``: the step it ended) or the end's commit point:
        steps since the last commit point accumulate; a new commit point reports them; a rollback drops them."""
        steps, spent = self._uncommitted
        if step_compute_s is not None:
            steps, spent = steps + 1, spent + step_compute_s
        if self.step() <= self.current.committed_step:  # nothing tentative left: committed just now, or rolled back
            if self.current.committed_step > committed_before and self.progress is not None:
                self._report_progress(steps, spent)
            steps, spent = 0, 0.0
        self._uncommitted = (steps, spent)

    def _report_progress(self, steps: int, compute_s: float) -> None:
        s, step = self.feed.sampler, self.step()
        self.progress.report(self.current.plan.id, step, s.epoch * s.size + s.pos, compute_s, steps=steps)
        every = self.config.observations_every
        if step // every > (step - steps) // every:
            self.publish_observations()

    def _end_cleanly(self) -> bool:
        """Leaves after the heartbeat gave up (``end_reason``): no recovery (the store is unreachable)."""
        cur = self.current
        logger.error("worker %s ends at step %d: %s", self.wid, self.step(), self.rdzv.end_reason)
        cur.phase = Phase.LEFT
        cur.ddp = None
        self.rdzv.next_epoch.drop()
        cur.group.abort()
        return False

    def _commit(self, now: float) -> bool:
        if self.rdzv.end_reason is not None:
            return self._end_cleanly()
        self.feed.sampler.advance(self.current.batches)
        self.state.counters["step"] += 1
        self.rdzv.next_epoch.poll()
        self._record_step(now)
        # A failed collective goes to recovery at once: that needs no collective (survivors agree through the
        # store). Everything else waits for the agreed commit point: a vote some ranks take and others do not
        # would pair the vote's allreduce with a gradient bucket's.
        if self.current.group.errored() is None and not self.schedule.due(self.step()):
            self.schedule.tick(time.perf_counter())
            return True
        return self._vote()

    def _record_step(self, now: float) -> None:
        if self.telemetry is not None:
            cur = self.current
            self.telemetry.record_step([cur.group.size()], cur.batches[cur.group.rank()], now - self._last_commit_t)
            cur.hook.timed = self.step() % self.telemetry.time_every == 0
        self._last_commit_t = now

    # ---- commit points: vote, decide, execute ---------------------------------------------------------------
    def _tally(self, ready: int) -> Optional[VoteTally]:
        """Runs the vote on the current group; None when it failed (the group's error is recorded)."""
        group, step = self.current.group, self.step()
        ok_coll = 0 if group.errored() is not None else 1
        ok_local = 0 if self._local_error is not None else 1
        n = group.size()
        # SUM of [ready, ok_coll, ok_local, 1, proposal, lead, leading]: the 4th entry counts the ranks that took
        # part (a dead rank cannot be counted, so a vote an aborted communicator hands back, untouched or half
        # reduced, reads as failed); the 5th gives every rank the same next commit interval; the last two say
        # whether a switch must be armed first, and how far ahead (VoteTally.lead)
        lead = self.feed.lead(self.rdzv.next_epoch.leaving()) if ready else 0
        leading = 1 if lead and self.current.switch_at != step else 0  # not armed for this commit point yet
        # a resize is being prepared (newcomers wait on us), or a stop asked for: the next interval short
        hurry = self.rdzv.membership.next_plan() is not None or self.stop_requested
        v = torch.tensor([ready, ok_coll, ok_local, 1, self.schedule.proposal(hurry), lead * leading, leading,
                          int(self.stop_requested)], dtype=torch.int64, device=self.device)
        nonfinite, self._nonfinite = self._nonfinite, None
        if nonfinite is not None:  # watch_loss: a non-finite loss since the last commit point is a local error
            v[2] -= nonfinite.to(device=self.device, dtype=torch.int64)
        try:
            if ok_coll:
                group.allreduce([v], dist.ReduceOp.SUM).wait()
                v = v.cpu()
        except Exception as e:  # noqa: BLE001
            group.report_error(e)
            ok_coll = 0
        tally = VoteTally.read(v, n, ready) if ok_coll else None
        if tally is not None and not tally.counted:
            group.report_error(ProcessGroupError(f"commit vote counted {int(v[3])} of {n} ranks"))
        return tally

    def _vote(self) -> bool:
        """A commit point: vote, ``decide_commit``, apply. Returns False once this worker left."""
        group, retries = self.current.group, self.config.max_retries
        tally = self._tally(self.rdzv.next_epoch.ready_id())
        action = decide_commit(tally, group.errored(), self._local_error, self.rdzv.next_epoch.leaving(),
                               self.failures, retries)
        on_switch = getattr(self.fault, "on_switch", None)
        if action.outcome is CommitOutcome.SWITCH and on_switch is not None and on_switch("vote"):
            e = ProcessGroupError(f"switch vote at step {self.step()} read as failed (FaultPlan.fail_in_switch)")
            group.report_error(e)  # test seam: this rank missed the vote its peers read, and recovers
            action = decide_commit(None, e, self._local_error, False, self.failures, retries)
        if action.outcome in _COMMITTING:
            try:
                self.state.broadcast_buffers(group, 0)
            except Exception as e:  # noqa: BLE001
                group.report_error(e)
                # A switch or a leave the counted vote decided stands: a peer died after the vote, and every rank
                # that read the vote switches (or leaves) too. Recovering from the old epoch instead would split
                # the survivors between the two plans (the record joins such a split into one recovery anyway:
                # rendezvous_state.resolve_failed); the new plan's first collective fails if the dead peer is in it.
                if action.outcome not in (CommitOutcome.SWITCH, CommitOutcome.LEAVE):
                    action = decide_commit(None, e, self._local_error, False, self.failures, retries)
                else:
                    logger.warning("buffer broadcast after the %s vote failed (%s): %s anyway",
                                   action.outcome.value, e, action.outcome.value)
        return self._apply(action, tally)

    def _apply(self, action: CommitAction, tally: Optional[VoteTally]) -> bool:
        """Executes a commit point's decision (``tally``: the vote it came from). Returns False once this worker left.

        Raises:
            TooManyFailures: GIVE_UP.
            LeftGroup: the recovery declared this worker dead.
        """
        cur, step = self.current, self.step()
        self.failures = action.failures
        outcome = action.outcome
        if outcome is CommitOutcome.GIVE_UP:
            raise TooManyFailures(f"{action.failures} failed commits in a row at step {step}; "
                                  f"last: {action.error}")
        if outcome is CommitOutcome.RECOVER:
            if self.rdzv.end_reason is not None:
                return self._end_cleanly()
            self._recover(action.error)
            return True
        switch_at, cur.switch_at = cur.switch_at, None  # an armed switch holds for one commit point only
        if switch_at is not None and outcome is not CommitOutcome.SWITCH:
            self.feed.drop_forecast()
        if outcome is CommitOutcome.ROLLBACK:
            self.state.restore()
            self._local_error = self._nonfinite = None
            self.schedule.enter(self.step(), time.perf_counter())
            logger.warning("rolled back to step %d after %s", self.step(), action.error)
            return True
        t = time.perf_counter()
        rec = self.switch_log.finish(t, step)
        if rec is not None and cur.group.rank() == 0 and rec["kind"] != "join":
            self.rdzv.membership.report_switched(cur.plan, rec)
        self.state.snapshot()
        cur.committed_step = step
        self.schedule.committed(step, tally.proposals, cur.group.size(), time.perf_counter(),
                                tally.lead if outcome is CommitOutcome.ARM else 1)
        if outcome in (CommitOutcome.COMMIT, CommitOutcome.ARM) and tally.stop:
            self.stop_agreed = True   # committed here on every rank; a prepared switch is not started
            return True
        if outcome is CommitOutcome.ARM:
            self._arm()
            return True
        if outcome is CommitOutcome.COMMIT:
            return True
        if outcome is CommitOutcome.SWITCH and switch_at is None:
            self._publish_start(step)  # no loader needed a lead: newcomers learn the start now
        pid, new_group = self.rdzv.next_epoch.take()
        old_plan, old_group = cur.plan, cur.group
        cur.ddp = None  # the old reducer (freed later by the cyclic GC; the old group stays retired)
        if outcome is CommitOutcome.LEAVE:
            cur.phase = Phase.LEFT
            self.executor.leave(old_plan, old_group, pid, step)
            return False
        nxt = self.rdzv.membership.next_plan()
        try:
            adopted = self.executor.switch(old_plan, old_group, new_group, t, self.step)
        except RuntimeError as e:  # a gloo/NCCL error, ProcessGroupError or RendezvousTimeout (not a bug's)
            if nxt is None or isinstance(e, (StateMismatch, TrainerPhaseError)):
                raise
            # a peer of the new plan failed during the switch's state broadcast: this worker is in the new plan
            # (the old group is aborted), whose state is the commit just made; recover from it
            logger.warning("switch to epoch %d failed: %s; recovering from it", nxt.id, e)
            cur.plan, cur.group = nxt, new_group
            self._recover(e, split=True)
            return True
        self._adopt(*adopted)
        return True

    def _arm(self) -> None:
        """ARM: every rank is ready and the switch is at the next commit point (``schedule.next_at``): the loader
        reads the next epoch's batches from there on, and rank 0 says where that epoch starts (newcomers' loaders
        read ahead from there while they wait for the state)."""
        at = self.current.switch_at = self.schedule.next_at
        prepared, plan = self.rdzv.next_epoch.prepared(), self.rdzv.membership.next_plan()
        if prepared is not None and plan is not None and plan.id == prepared[0]:
            group = prepared[1]
            self.feed.expect(Basis(group.rank(), tuple(self.executor.batches_for(plan, group.size()))),
                             self.step(), at)
        self._publish_start(at)

    def _publish_start(self, at: int) -> None:
        """Rank 0 writes where the next epoch starts when it brings newcomers (``keys.loader_start``)."""
        cur, plan = self.current, self.rdzv.membership.next_plan()
        if cur.group.rank() != 0 or plan is None or all(m in cur.plan.members for m in plan.members):
            return
        self.rdzv.publish_loader_start(plan.id, at, *self.feed.position_at(self.step(), at))

    def _recover(self, err: Optional[BaseException], split: bool = False) -> None:
        """A collective failed: the executor agrees on survivors, rebuilds, rolls back and resyncs.

        ``split``: a switch may have split the survivors between the old plan and the new one (this worker was
        ready to switch, or it switched and has not committed in the new plan yet, or its switch failed): they
        hold different groups, so none tries a communicator shrink; the record joins them into one recovery.
        """
        cur = self.current
        lost, interval = self.step() - cur.committed_step, self.schedule.interval
        split = split or self.rdzv.next_epoch.ready_id() != 0 or \
            (cur.plan.kind == "resize" and cur.committed_step == cur.epoch_start_step)
        self.rdzv.next_epoch.drop()
        cur.ddp = None
        try:
            adopted = self.executor.recover(cur.plan, cur.group, err, self.config.try_shrink and not split, lost,
                                            interval, self.step)
        except LeftGroup:
            cur.phase = Phase.LEFT
            raise
        self._adopt(*adopted)

    def _adopt(self, epoch: Epoch, record: dict) -> None:
        """The executor entered ``epoch``: train in it from the current step, which is the rollback point."""
        cur = self.current
        cur.plan, cur.group, cur.ddp, cur.hook, cur.batches = (epoch.plan, epoch.group, epoch.ddp, epoch.hook,
                                                               epoch.batches)
        cur.phase = Phase.TRAINING
        self.feed.drop_forecast()  # the loader now loads for this epoch
        cur.switch_at = None
        cur.epoch_start_step = self.step()
        self._local_error = self._nonfinite = None
        self.state.snapshot()
        cur.committed_step = self.step()
        self.schedule.enter(self.step(), time.perf_counter())  # next commit point: the first step of the epoch
        self.switch_log.begin(record)
