"""The trainer's pure transition decisions (elastic_launcher.epochs): what a commit point, a recovery and a newly
posted plan lead to, from plain values (no group, no store, no process)."""
import pytest

from elastic_launcher.epoch_decisions import (CommitOutcome, PrepareKind, RecoveryKind, decide_commit, decide_prepare,
                                     decide_recovery, source_rank)
from elastic_launcher.errors import PeerFailure
from elastic_launcher.membership import Plan
from elastic_launcher.epoch_decisions import VoteTally

FINE = VoteTally(counted=True, collectives_ok=True, local_ok=True, ready=False, proposals=8)
READY = VoteTally(counted=True, collectives_ok=True, local_ok=True, ready=True, proposals=8)
LOCAL_ERROR = VoteTally(counted=True, collectives_ok=True, local_ok=False, ready=True, proposals=8)
BROKEN = VoteTally(counted=True, collectives_ok=False, local_ok=True, ready=True, proposals=8)


def test_a_clean_vote_commits_and_resets_the_failure_count():
    action = decide_commit(FINE, None, None, leaving=False, failures=2, max_retries=3)
    assert (action.outcome, action.failures, action.error) == (CommitOutcome.COMMIT, 0, None)


@pytest.mark.parametrize("leaving, outcome", [(False, CommitOutcome.SWITCH), (True, CommitOutcome.LEAVE)])
def test_everyone_ready_switches_or_leaves(leaving, outcome):
    assert decide_commit(READY, None, None, leaving, 0, 3).outcome is outcome


@pytest.mark.parametrize("leaving", [False, True])
def test_everyone_ready_arms_first_when_a_loader_needs_a_lead(leaving):
    # a rank whose loader has batches in flight is not armed for this commit point: everyone commits and switches
    # (or leaves) at the next one, which every rank read from the same vote
    armed_later = VoteTally.read([18, 2, 2, 2, 10, 32, 1], 2, 9)
    assert (armed_later.ready, armed_later.lead) == (True, 32)
    assert decide_commit(armed_later, None, None, leaving, 0, 3).outcome is CommitOutcome.ARM
    armed = VoteTally.read([18, 2, 2, 2, 10, 0, 0], 2, 9)
    assert decide_commit(armed, None, None, leaving, 0, 3).outcome is \
        (CommitOutcome.LEAVE if leaving else CommitOutcome.SWITCH)
    assert VoteTally.read([18, 4, 4, 4, 10, 16 + 32, 2], 4, 9).lead == 24  # the mean over the ranks that lead


def test_a_local_error_rolls_back_even_when_everyone_is_ready():
    err = ValueError("bad batch")
    action = decide_commit(LOCAL_ERROR, None, err, leaving=False, failures=0, max_retries=3)
    assert (action.outcome, action.failures, action.error) == (CommitOutcome.ROLLBACK, 1, err)
    other = decide_commit(LOCAL_ERROR, None, None, False, 0, 3)  # another rank's non-finite loss
    assert isinstance(other.error, FloatingPointError)


@pytest.mark.parametrize("tally, error", [(None, PeerFailure("epoch 3: b silent")), (BROKEN, None),
                                          (FINE, PeerFailure("aborted after the vote"))])
def test_a_failed_collective_recovers_before_anything_else(tally, error):
    action = decide_commit(tally, error, ValueError("local too"), leaving=True, failures=0, max_retries=3)
    assert (action.outcome, action.failures, action.error) == (CommitOutcome.RECOVER, 1, error)


def test_one_failure_more_than_max_retries_gives_up():
    assert decide_commit(None, None, None, False, failures=2, max_retries=3).outcome is CommitOutcome.RECOVER
    action = decide_commit(LOCAL_ERROR, None, None, False, failures=3, max_retries=3)
    assert (action.outcome, action.failures) == (CommitOutcome.GIVE_UP, 4)


def test_recovery_shrinks_without_the_dead_ranks_rebuilds_or_leaves():
    failed = Plan(4, ("a", "b", "c", "d"), prev=3, kind="resize")
    survivors = Plan(5, ("a", "c"), prev=4, kind="recovery")
    shrink = decide_recovery(failed, survivors, "c", try_shrink=True)
    assert (shrink.kind, shrink.dead_ranks) == (RecoveryKind.SHRINK, (1, 3))
    assert decide_recovery(failed, survivors, "c", try_shrink=False).kind is RecoveryKind.REBUILD
    assert decide_recovery(failed, survivors, "b", try_shrink=True).kind is RecoveryKind.LEAVE
    same = Plan(6, failed.members, prev=4, kind="recovery")  # nobody dead (a hung collective): a fresh group
    assert decide_recovery(failed, same, "a", try_shrink=True).kind is RecoveryKind.REBUILD


def test_a_posted_plan_is_built_by_its_members_and_left_by_the_others():
    nxt = Plan(7, ("a", "c"), prev=6, kind="resize")
    assert decide_prepare(nxt, "a").kind is PrepareKind.BUILD
    assert decide_prepare(nxt, "b").kind is PrepareKind.LEAVE


def test_state_comes_from_the_first_survivor():
    first = Plan(1, ("a", "b"))
    assert source_rank(first, None) == 0
    grown = Plan(2, ("n1", "b", "a"), prev=1, kind="resize")  # a newcomer took rank 0
    assert source_rank(grown, first) == 1
