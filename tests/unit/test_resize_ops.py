"""resize_ops.advance: every transition of a grow and a shrink, each deadline, failures and cancels (#27.2).
Pure: plain values in, the op and its actions out; time is a number."""
import dataclasses

import pytest

from elastic_launcher.resize_ops import (POST_ATTEMPTS, Action, ActionKind, Observation, RecoveryObservation,
                                         RecoveryOp, RecoveryState, ReleaseOp, ReleaseState, ResizeKind, ResizeLimits,
                                         ResizeOp, ResizeState, advance, advance_recovery, advance_release)

S = ResizeState
LIMITS = ResizeLimits(helper_start_s=60, join_s=120, switch_s=100, leave_s=20)
NONE = Observation()


def kinds(actions):
    return [a.kind for a in actions]


def grow_op(**kw):
    return ResizeOp(ResizeKind.GROW, target=4, action="grow", reason="test", **kw)


def shrink_op(**kw):
    return ResizeOp(ResizeKind.SHRINK, target=1, action="shrink", reason="test", nodes=("node2",), **kw)


def submitted(now=0.0):
    op, acts = advance(grow_op(), NONE, now, LIMITS)
    assert op.state is S.SUBMITTED and kinds(acts) == [ActionKind.SUBMIT_HELPER] and op.deadline == now + 60
    return dataclasses.replace(op, helper="77")  # what the executor fills in


def allocated(now=1.0):
    op, acts = advance(submitted(), Observation(helper_state="RUNNING", helper_nodes=("node3", "node4")), now,
                       LIMITS)
    assert op.state is S.ALLOCATED and op.nodes == ("node3", "node4") and op.deadline == now + 120
    assert acts == [Action(ActionKind.ADOPT_NODES, ("node3", "node4"))] and op.allocated == now
    return op


def joined(now=2.0):
    op, acts = advance(allocated(), Observation(helper_state="RUNNING", joined=True), now, LIMITS)
    assert op.state is S.JOINED and acts == [Action(ActionKind.POST_PLAN, ("node3", "node4"))]
    assert op.deadline == now + 100
    return dataclasses.replace(op, plan_id=5, post_attempts=1)


def test_a_grow_goes_requested_submitted_allocated_joined_switched_one_state_a_tick():
    op, acts = advance(joined(), Observation(switched=True), 3.0, LIMITS)
    assert op.state is S.SWITCHED and op.done and kinds(acts) == [ActionKind.FINISH]
    assert op.started == 0.0 and op.error is None
    assert advance(op, Observation(switched=True), 4.0, LIMITS) == (op, [])  # done: nothing more


def test_waiting_states_stay_put_without_news():
    for op in (submitted(), allocated(), joined()):
        assert advance(op, Observation(helper_state="PENDING" if op.state is S.SUBMITTED else "RUNNING"), 5.0,
                       LIMITS) == (op, [])


def test_a_running_helper_without_nodes_yet_and_an_unreachable_slurm_keep_waiting():
    op = submitted()
    assert advance(op, Observation(helper_state="RUNNING"), 5.0, LIMITS) == (op, [])
    assert advance(op, Observation(helper_state="UNKNOWN"), 5.0, LIMITS) == (op, [])


@pytest.mark.parametrize("make, deadline, words", [(submitted, 60.0, "did not start within 60 s"),
                                                  (allocated, 121.0, "did not join within 120 s"),
                                                  (joined, 102.0, "no first step within 100 s")])
def test_each_deadline_fails_the_grow_and_releases_the_helper(make, deadline, words):
    op = make()
    assert advance(op, Observation(helper_state="RUNNING"), deadline - 0.01, LIMITS)[0].state is op.state
    failed, acts = advance(op, Observation(helper_state="RUNNING"), deadline, LIMITS)
    assert failed.state is S.FAILED and failed.done and words in failed.error
    assert kinds(acts) == [ActionKind.CANCEL_HELPER, ActionKind.ABORT]
    assert failed.counts is (op.state is not S.SUBMITTED) and not failed.cancelled and failed.failed_in is op.state


@pytest.mark.parametrize("state", ["FAILED", "CANCELLED", "GONE", "COMPLETED"])
def test_a_helper_that_ends_while_queued_fails_the_grow_at_once(state):
    failed, acts = advance(submitted(), Observation(helper_state=state), 1.0, LIMITS)
    assert failed.state is S.FAILED and state in failed.error and failed.deadline is None
    assert kinds(acts) == [ActionKind.CANCEL_HELPER, ActionKind.ABORT]


def test_a_failure_while_allocated_fails_the_grow_without_waiting_for_the_deadline():
    failed, acts = advance(allocated(), Observation(helper_state="RUNNING", failed_nodes=("node4",)), 2.0, LIMITS)
    assert failed.state is S.FAILED and "node4" in failed.error and failed.counts
    assert acts == [Action(ActionKind.CANCEL_HELPER), Action(ActionKind.ABORT, ("node3", "node4"))]
    ended, _ = advance(allocated(), Observation(helper_state="TIMEOUT"), 2.0, LIMITS)
    assert ended.state is S.FAILED and "TIMEOUT" in ended.error


def test_a_recovery_that_supersedes_the_posted_plan_fails_the_grow():
    failed, acts = advance(joined(), Observation(superseded=True), 3.0, LIMITS)
    assert failed.state is S.FAILED and "superseded" in failed.error
    assert kinds(acts) == [ActionKind.CANCEL_HELPER, ActionKind.ABORT]


def test_a_recovery_that_carried_the_newcomers_into_its_epoch_finishes_the_grow_instead():
    """Review finding of session 13: a grow switched, then recovered before its first step was reported, was failed
    and its helper cancelled, killing newcomers that train in the recovery's epoch."""
    held, acts = advance(joined(), Observation(superseded=True, carried=True), 3.0, LIMITS)
    assert held.state is S.SWITCHED and held.error is None
    assert kinds(acts) == [ActionKind.FINISH] and ActionKind.CANCEL_HELPER not in kinds(acts)
    shrink, _ = advance(dataclasses.replace(joined(), kind=ResizeKind.SHRINK), Observation(superseded=True,
                                                                                          carried=True), 3.0, LIMITS)
    assert shrink.state is S.FAILED  # a shrink has no newcomers to carry


@pytest.mark.parametrize("make", [lambda: grow_op(), submitted, allocated])
def test_a_cancel_before_the_plan_is_posted_fails_the_grow_in_the_same_tick(make):
    op = make()
    failed, acts = advance(op, Observation(helper_state="PENDING", cancel="operator asked for 1 nodes"), 1.5,
                           LIMITS)
    assert failed.state is S.FAILED and failed.cancelled and not failed.counts
    assert failed.error == "cancelled: operator asked for 1 nodes"
    assert kinds(acts) == ([ActionKind.CANCEL_HELPER] if op.helper else []) + [ActionKind.ABORT]


def test_a_posted_plan_is_not_cancelled_it_runs_to_its_end():
    op = joined()
    assert advance(op, Observation(cancel="operator"), 3.0, LIMITS) == (op, [])
    assert advance(op, Observation(cancel="operator", switched=True), 3.0, LIMITS)[0].state is S.SWITCHED


def test_a_post_that_lost_a_race_is_retried_one_try_a_tick_then_fails():
    op = dataclasses.replace(joined(), plan_id=None, post_attempts=1)
    again, acts = advance(op, NONE, 3.0, LIMITS)
    assert again.state is S.JOINED and kinds(acts) == [ActionKind.POST_PLAN]
    failed, acts = advance(dataclasses.replace(op, post_attempts=POST_ATTEMPTS), NONE, 3.0, LIMITS)
    assert failed.state is S.FAILED and "races" in failed.error and ActionKind.CANCEL_HELPER in kinds(acts)


def test_a_shrink_posts_switches_then_releases_once_the_leavers_left():
    op, acts = advance(shrink_op(), NONE, 0.0, LIMITS)
    assert op.state is S.JOINED and acts == [Action(ActionKind.POST_PLAN, ("node2",))] and op.deadline == 100
    op = dataclasses.replace(op, plan_id=6, post_attempts=1)
    op, acts = advance(op, Observation(switched=True), 1.0, LIMITS)
    assert op.state is S.SWITCHED and not op.done and acts == [] and op.deadline == 21.0
    assert advance(op, NONE, 2.0, LIMITS) == (op, [])
    releasing, acts = advance(op, Observation(left=True), 2.0, LIMITS)
    assert releasing.state is S.RELEASING and not releasing.done and releasing.left
    assert acts == [Action(ActionKind.RELEASE_NODES, ("node2",))]
    assert advance(releasing, NONE, 3.0, LIMITS) == (releasing, [])     # its ReleaseOp runs, tick by tick
    done, acts = advance(releasing, Observation(released=True), 4.0, LIMITS)
    assert done.state is S.RELEASED and done.done and kinds(acts) == [ActionKind.FINISH]


def test_a_shrink_whose_leavers_do_not_leave_is_released_at_the_deadline():
    op = dataclasses.replace(shrink_op(), state=S.SWITCHED, deadline=21.0, plan_id=6, started=0.0)
    done, acts = advance(op, NONE, 21.0, LIMITS)
    assert done.state is S.RELEASING and not done.left and kinds(acts) == [ActionKind.RELEASE_NODES]


def test_a_shrink_without_leavers_is_skipped_and_a_superseded_one_fails():
    skipped, acts = advance(dataclasses.replace(shrink_op(), nodes=()), NONE, 0.0, LIMITS)
    assert skipped.state is S.FAILED and skipped.skipped and kinds(acts) == [ActionKind.ABORT]
    op = dataclasses.replace(shrink_op(), state=S.JOINED, deadline=100.0, plan_id=6, started=0.0)
    failed, acts = advance(op, Observation(superseded=True), 1.0, LIMITS)
    assert failed.state is S.FAILED and failed.counts and kinds(acts) == [ActionKind.ABORT]
    expired, _ = advance(op, NONE, 100.0, LIMITS)
    assert expired.state is S.FAILED and "100 s" in expired.error


def test_the_limits_come_from_the_launch_config():
    from datetime import timedelta
    cfg = type("Cfg", (), {"helper_start_timeout": timedelta(seconds=7), "rendezvous_timeout": timedelta(seconds=9),
                           "leave_timeout": timedelta(seconds=3)})()
    assert ResizeLimits.from_config(cfg) == ResizeLimits(7.0, 9.0, 9.0, 3.0)


# -- review defects (#27.2): each failed before its fix --------------------------------------------------------
@pytest.mark.parametrize("field, value", [("helper_start_s", 0), ("join_s", -1.0), ("switch_s", float("nan")),
                                          ("leave_s", float("inf")), ("exit_s", "5"), ("join_s", True)])
def test_limits_reject_a_wait_that_is_not_a_positive_finite_number_naming_it(field, value):
    with pytest.raises(ValueError, match=f"ResizeLimits.{field} must be a finite number of seconds > 0"):
        ResizeLimits(**{field: value})


@pytest.mark.parametrize("target", [0, -2, 1.5, None, True])
def test_an_op_to_no_nodes_or_a_non_integer_is_refused(target):
    with pytest.raises(ValueError, match="the target must be an integer >= 1"):
        ResizeOp(ResizeKind.SHRINK, target, "shrink", "test")


# -- a recovery holds the ops (RECOVERING) ----------------------------------------------------------------------
def test_a_recovery_holds_every_post_and_submit_but_not_a_cancel_nor_a_deadline():
    held = Observation(hold=True)
    op, acts = advance(grow_op(), held, 0.0, LIMITS)
    assert op.state is S.REQUESTED and acts == []                     # no helper submitted on a changing fleet
    op, acts = advance(shrink_op(), held, 0.0, LIMITS)
    assert op.state is S.REQUESTED and acts == []                     # no plan posted on an epoch in recovery
    op = allocated()
    assert advance(op, Observation(helper_state="RUNNING", joined=True, hold=True), 5.0, LIMITS) == (op, [])
    assert advance(op, Observation(helper_state="RUNNING", joined=True, hold=True, cancel="operator"), 5.0,
                   LIMITS)[0].cancelled
    failed, acts = advance(op, Observation(helper_state="RUNNING", joined=True, hold=True), 121.0, LIMITS)
    assert failed.state is S.FAILED and "held in allocated" in failed.error and ActionKind.CANCEL_HELPER in kinds(acts)
    lost = dataclasses.replace(joined(), plan_id=None, post_attempts=1)
    assert advance(lost, held, 3.0, LIMITS) == (lost, [])             # the re-post waits for the recovery
    posted = joined()
    assert advance(posted, Observation(switched=True, hold=True), 3.0, LIMITS)[0].state is S.SWITCHED


# -- releasing nodes ------------------------------------------------------------------------------------------
def test_a_release_gives_the_nodes_back_once_their_steps_ended():
    op, acts = advance_release(ReleaseOp(("node2",), "test"), ("node2",), 10.0, LIMITS)
    assert op.state is ReleaseState.EXITING and op.deadline == 10.0 + LIMITS.exit_s and acts == []
    giving, acts = advance_release(op, (), 11.0, LIMITS)
    assert giving.state is ReleaseState.GIVING_BACK and acts == [Action(ActionKind.GIVE_BACK, ("node2",))]
    assert advance_release(giving, (), 12.0, LIMITS) == (giving, [])  # a Slurm change still in flight: it waits
    done, acts = advance_release(giving, (), 13.0, LIMITS, given_back=True)
    assert done.done and acts == []                                   # GIVE_BACK asked once
    host, acts = advance_release(ReleaseOp(("node1",), "restart", give_back=False), (), 11.0, LIMITS)
    assert host.done and acts == []                                   # the batch host is never given back


def test_a_step_that_does_not_end_is_terminated_then_killed_one_stage_a_deadline():
    op, _ = advance_release(ReleaseOp(("node2", "node3"), "test"), ("node2", "node3"), 0.0, LIMITS)
    assert advance_release(op, ("node2",), 4.99, LIMITS) == (op, [])
    op, acts = advance_release(op, ("node2",), 5.0, LIMITS)
    assert op.state is ReleaseState.TERMINATING and acts == [Action(ActionKind.TERMINATE, ("node2",))]
    op, acts = advance_release(op, ("node2",), 25.0, LIMITS)
    assert op.state is ReleaseState.KILLING and acts == [Action(ActionKind.KILL, ("node2",))]
    giving, acts = advance_release(op, ("node2",), 45.0, LIMITS)     # given up on: given back anyway
    assert giving.state is ReleaseState.GIVING_BACK and kinds(acts) == [ActionKind.GIVE_BACK]


# -- recovering a failed node ---------------------------------------------------------------------------------
def test_a_recovery_follows_the_survivors_epoch_then_releases_the_node():
    op, acts = advance_recovery(RecoveryOp("node3", ("w3",)), RecoveryObservation(True, 4), 0.0, LIMITS)
    assert op.state is RecoveryState.DETECTED and op.deadline == 120.0 and acts == [] and not op.settled
    op, acts = advance_recovery(op, RecoveryObservation(False, 5), 1.0, LIMITS)
    assert (op.state, op.plan_id, op.recovered, op.deadline) == (RecoveryState.EVICTED, 5, True, 101.0)
    assert advance_recovery(op, RecoveryObservation(False, 5), 2.0, LIMITS) == (op, [])
    op, acts = advance_recovery(op, RecoveryObservation(False, 5, switched=True), 3.0, LIMITS)
    assert op.state is RecoveryState.RELEASING and op.settled and acts == [Action(ActionKind.RELEASE_NODES, ("node3",))]
    assert advance_recovery(op, RecoveryObservation(False, 5, True), 4.0, LIMITS) == (op, [])
    done, acts = advance_recovery(op, RecoveryObservation(False, 5, True, released=True), 5.0, LIMITS)
    assert done.done and kinds(acts) == [ActionKind.FINISH]


def test_a_recovery_that_never_comes_or_never_switches_releases_the_node_at_the_deadline():
    op, _ = advance_recovery(RecoveryOp("node3", ("w3",)), RecoveryObservation(True, 4), 0.0, LIMITS)
    given_up, acts = advance_recovery(op, RecoveryObservation(True, 4), 120.0, LIMITS)
    assert given_up.state is RecoveryState.RELEASING and not given_up.recovered and kinds(acts) == [ActionKind.RELEASE_NODES]
    op, _ = advance_recovery(op, RecoveryObservation(False, 5), 1.0, LIMITS)
    late, acts = advance_recovery(op, RecoveryObservation(False, 5), 101.0, LIMITS)
    assert late.state is RecoveryState.RELEASING and late.recovered and kinds(acts) == [ActionKind.RELEASE_NODES]
