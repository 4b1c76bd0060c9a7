"""AutoscalePolicy: Or et al.'s scaling-efficiency test, limits, revert and ceiling (no I/O)."""
import pytest

from elastic_launcher.autoscale import (NO_DIRECTIVES, NO_SERVICE, PLANNER, UNREACHABLE, Decision, PlanAdvice,
                                        TimeBudget, advice_from_plan)
from elastic_launcher.controller import AutoscalePolicy, Measurement, scaling_efficiency


def m(nodes, sps, slots=1):
    return Measurement(nodes=nodes, workers=nodes * slots, samples_per_s=sps)


def test_efficiency_matches_or_et_al_formula():
    assert scaling_efficiency(m(2, 100.0), m(4, 200.0)) == pytest.approx(1.0)
    assert scaling_efficiency(m(2, 100.0), m(4, 100.0)) == pytest.approx(0.0)
    assert scaling_efficiency(m(2, 100.0), m(4, 150.0)) == pytest.approx(0.5)
    assert scaling_efficiency(m(2, 100.0), m(4, 80.0)) < 0


def test_efficiency_rejects_equal_sizes_and_zero_throughput():
    with pytest.raises(ValueError, match="2 workers"):
        scaling_efficiency(m(2, 100.0), m(2, 120.0))
    with pytest.raises(ValueError, match="throughput"):
        scaling_efficiency(m(2, 0.0), m(4, 120.0))


def test_grows_when_nodes_free_and_no_history_of_failure():
    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(2, 100.0))
    decision = policy.decide(free_nodes=2)
    assert (decision.action, decision.target_nodes) == ("grow", 4)


def test_keeps_grow_that_paid_and_reverts_one_that_did_not():
    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(2, 100.0))
    policy.record(m(4, 190.0))            # s = 0.9
    keep = policy.decide(free_nodes=0)
    assert keep.action == "keep" and keep.efficiency == pytest.approx(0.9)

    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(2, 100.0))
    policy.record(m(4, 120.0))            # s = 0.2
    revert = policy.decide(free_nodes=4)
    assert (revert.action, revert.target_nodes) == ("revert", 2)
    assert "did not pay" in revert.reason
    # back at 2 nodes: never try 4 again even with free nodes; 3 is still worth a try
    policy.record(m(2, 101.0))
    again = policy.decide(free_nodes=4)
    assert (again.action, again.target_nodes) == ("grow", 3) and policy.ceiling_nodes_ == 4
    policy.record(m(3, 102.0))            # 3 did not pay either: back to 2, and stay there
    assert policy.decide(free_nodes=4).action == "revert"
    policy.record(m(2, 100.0))
    assert policy.decide(free_nodes=4).action == "keep" and policy.ceiling_nodes_ == 3


def test_ceiling_allows_smaller_grow():
    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(1, 50.0))
    policy.record(m(3, 60.0))
    assert policy.decide(free_nodes=4).action == "revert"
    policy.record(m(1, 50.0))
    decision = policy.decide(free_nodes=4)
    assert (decision.action, decision.target_nodes) == ("grow", 2)


def test_max_global_batch_caps_growth():
    policy = AutoscalePolicy(max_global_batch=96, per_gpu_batch=16, slots_per_node=2, grow_step_nodes=2)
    policy.record(m(2, 100.0, slots=2))   # 2 nodes x 2 x 16 = 64 <= 96; 3 nodes = 96; 4 nodes = 128
    decision = policy.decide(free_nodes=2)
    assert (decision.action, decision.target_nodes) == ("grow", 3)
    policy.record(m(3, 150.0, slots=2))
    assert policy.decide(free_nodes=1).action == "keep"


def test_gpus_max_caps_growth_and_free_nodes_limit_it():
    policy = AutoscalePolicy(max_workers=3, grow_step_nodes=2)
    policy.record(m(2, 100.0))
    assert policy.decide(free_nodes=2).target_nodes == 3
    policy = AutoscalePolicy(grow_step_nodes=2)
    policy.record(m(2, 100.0))
    assert policy.decide(free_nodes=0).action == "keep"
    assert "no free nodes" in policy.decide(free_nodes=0).reason


def planned(nodes):
    return PlanAdvice(nodes, PLANNER, f"plan of {nodes} nodes")


UNREACHABLE_ADVICE = PlanAdvice(None, UNREACHABLE, "connection refused")


def test_plan_bounds_growth_but_never_exceeds_policy_limits():
    policy = AutoscalePolicy(grow_step_nodes=2, max_workers=4)
    policy.record(m(2, 100.0))
    assert policy.decide(free_nodes=2, advice=planned(2)).action == "keep"
    assert policy.decide(free_nodes=2, advice=planned(3)).target_nodes == 3
    assert policy.decide(free_nodes=2, advice=planned(16)).target_nodes == 4


# -- one policy: the planner decides, the heuristic runs only while the service is unreachable ---------------
def test_plan_keep_means_no_grow_even_with_free_nodes():
    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(1, 100.0))
    keep = advice_from_plan({"action": "keep", "nodes": 1, "reason": "request already matches the plan; "
                             "elastic: 1 node x 1 GPUs (1x1); 2x1 efficiency 0.38 < 0.7"}, 1, 1)
    assert keep == PlanAdvice(1, PLANNER, keep.note) and "2x1 efficiency 0.38" in keep.note
    decision = policy.decide(free_nodes=3, advice=keep)
    assert (decision.action, decision.target_nodes) == ("keep", 1) and "plan says 1 node" in decision.reason and "1 nodes" not in decision.reason
    cannot_judge = advice_from_plan({"action": "keep", "nodes": None, "reason": "no step history"}, 1, 1)
    assert cannot_judge.nodes == 1 and policy.decide(free_nodes=3, advice=cannot_judge).action == "keep"


def test_plan_of_more_nodes_grows_to_the_plan_only():
    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(2, 100.0))
    decision = policy.decide(free_nodes=4, advice=planned(3))
    assert (decision.action, decision.target_nodes) == ("grow", 3)
    assert decision.reason.startswith("plan says 3 nodes;") and "heuristic" not in decision.reason
    assert policy.decide(free_nodes=4, advice=planned(8)).target_nodes == 4    # one grow step at a time


def test_plan_of_fewer_nodes_shrinks_toward_it_never_below_gpus_min():
    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(2, 100.0))
    decision = policy.decide(free_nodes=4, advice=planned(1))
    assert (decision.action, decision.target_nodes) == ("shrink", 1) and "plan says 1 node" in decision.reason and "1 nodes" not in decision.reason
    bounded = AutoscalePolicy(min_workers=2)
    bounded.record(m(3, 100.0))
    assert (bounded.decide(free_nodes=0, advice=planned(1)).action,
            bounded.decide(free_nodes=0, advice=planned(1)).target_nodes) == ("shrink", 2)
    bounded = AutoscalePolicy(min_workers=2)
    bounded.record(m(2, 100.0))
    assert bounded.decide(free_nodes=2, advice=planned(1)).action == "keep"


def test_unreachable_service_runs_the_heuristic_and_says_so():
    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(1, 100.0))
    for advice in (UNREACHABLE_ADVICE, advice_from_plan(None, 1, 1)):
        decision = policy.decide(free_nodes=3, advice=advice)
        assert (decision.action, decision.target_nodes) == ("grow", 3)
        assert decision.reason.startswith("heuristic (service unreachable);")
    # no service at all runs the same heuristic, and says that instead (#45.4)
    decision = policy.decide(free_nodes=3, advice=NO_SERVICE)
    assert (decision.action, decision.target_nodes) == ("grow", 3)
    assert decision.reason.startswith("heuristic (no predictor configured);")
    assert policy.decide(free_nodes=3).reason == policy.decide(free_nodes=3, advice=NO_SERVICE).reason


def test_no_directives_means_no_autoscaling_grow():
    policy = AutoscalePolicy(grow_step_nodes=2)
    policy.record(m(1, 100.0))
    decision = policy.decide(free_nodes=3, advice=PlanAdvice(None, NO_DIRECTIVES))
    assert (decision.action, decision.target_nodes) == ("keep", 1) and "no #ELASTIC directives" in decision.reason


def test_planned_grow_that_did_not_pay_is_reverted_and_not_tried_again():
    policy = AutoscalePolicy(min_efficiency=0.7, grow_step_nodes=2)
    policy.record(m(2, 100.0))
    assert policy.decide(free_nodes=4, advice=planned(3)).target_nodes == 3
    policy.record(m(3, 110.0))            # s = 0.2 < 0.7, although the plan still says 3
    revert = policy.decide(free_nodes=4, advice=planned(3))
    assert (revert.action, revert.target_nodes) == ("revert", 2) and "did not pay" in revert.reason
    policy.record(m(2, 100.0))
    again = policy.decide(free_nodes=4, advice=planned(3))
    assert (again.action, again.target_nodes) == ("keep", 2) and "did not pay before" in again.reason


def test_plan_answers_map_to_node_counts():
    rewrite = {"action": "rewrite", "nodes": 3, "gpus_per_node": 4, "layout": [4, 4, 4], "reason": "elastic:\n 3x4"}
    assert advice_from_plan(rewrite, 2, 4) == PlanAdvice(3, PLANNER, "elastic: 3x4")
    # a layout with another GPU count per node: its GPUs in whole nodes of the job, rounded down
    assert advice_from_plan({**rewrite, "nodes": 1, "gpus_per_node": 2, "layout": [2]}, 1, 1).nodes == 2
    assert advice_from_plan({**rewrite, "nodes": 3, "gpus_per_node": 2, "layout": [2, 2, 2]}, 1, 4).nodes == 1
    garbage = advice_from_plan({"action": "rewrite", "nodes": None}, 2, 4)
    assert garbage.source == UNREACHABLE and "unusable" in garbage.note
    with pytest.raises(ValueError, match="source"):
        PlanAdvice(2, "guess")
    with pytest.raises(ValueError, match="nodes"):
        PlanAdvice(None, PLANNER)


def test_node_range_is_the_directive_bounds_without_the_ceiling():
    policy = AutoscalePolicy(min_efficiency=0.7, max_global_batch=512, per_gpu_batch=64, slots_per_node=2,
                             min_workers=4, max_workers=12, grow_step_nodes=2)
    assert policy.node_range() == (2, 4)
    policy.record(m(2, 100.0, slots=2))
    policy.record(m(4, 100.0, slots=2))
    assert policy.decide(free_nodes=0).action == "revert" and policy.max_nodes() == 3
    assert policy.node_range() == (2, 4)
    assert AutoscalePolicy(max_global_batch=16, per_gpu_batch=32, min_workers=2).node_range() == (2, 2)


def test_shrinks_when_above_limits():
    policy = AutoscalePolicy(max_global_batch=64, per_gpu_batch=32)
    policy.record(m(4, 100.0))
    decision = policy.decide(free_nodes=0)
    assert (decision.action, decision.target_nodes) == ("shrink", 2)


def test_revert_respects_min_workers():
    policy = AutoscalePolicy(min_workers=3, grow_step_nodes=2)
    policy.record(m(2, 100.0))
    policy.record(m(4, 100.0))
    assert policy.decide(free_nodes=0).target_nodes == 3


def test_no_measurement_keeps():
    assert AutoscalePolicy().decide(free_nodes=3).action == "keep"


@pytest.mark.parametrize("seed", range(20))
def test_invariants_on_random_histories(seed):
    import random
    rng = random.Random(seed)
    policy = AutoscalePolicy(min_efficiency=rng.random(), max_global_batch=rng.randint(64, 1024),
                             per_gpu_batch=16, slots_per_node=rng.randint(1, 4), grow_step_nodes=rng.randint(1, 3))
    nodes = 1
    for _ in range(10):
        policy.record(m(nodes, rng.uniform(10, 1000), slots=policy.slots_per_node))
        advice = rng.choice([NO_SERVICE, PlanAdvice(rng.randint(1, 6), PLANNER), PlanAdvice(None, NO_DIRECTIVES)])
        decision = policy.decide(free_nodes=rng.randint(0, 4), advice=advice)
        assert decision.target_nodes >= 1
        if decision.action == "grow":
            assert decision.target_nodes > nodes and advice.source != NO_DIRECTIVES
            assert advice.source != PLANNER or decision.target_nodes <= advice.nodes
            assert decision.target_nodes * policy.slots_per_node * 16 <= policy.max_global_batch
            if policy.ceiling_nodes_ is not None:
                assert decision.target_nodes < policy.ceiling_nodes_
        if decision.action == "keep":
            assert decision.target_nodes == nodes
        nodes = decision.target_nodes


# -- what feeds the policy and what carries its decisions out --------------------------------------------
def test_directives_set_the_policy_limits():
    from elastic_launcher.launch_config import Directives

    d = Directives.from_script("#!/bin/bash\n#ELASTIC model=m gpus=4-12 per_gpu_batch=64\n"
                               "#ELASTIC max_global_batch=512 min_efficiency=0.8\npython train.py\n")
    assert (d.gpus_min, d.gpus_max, d.per_gpu_batch, d.max_global_batch, d.min_efficiency) == (4, 12, 64, 512, 0.8)
    assert d.raw_lines == ("#ELASTIC model=m gpus=4-12 per_gpu_batch=64", "#ELASTIC max_global_batch=512 min_efficiency=0.8")
    policy = AutoscalePolicy(d.min_efficiency, d.max_global_batch, d.per_gpu_batch, 2, d.gpus_min, d.gpus_max, 2)
    assert (policy.min_nodes(), policy.max_nodes()) == (2, 4)      # 512 / (64 * 2) = 4 nodes; 12 GPUs = 6 nodes
    assert Directives.from_script("python train.py\n") == Directives()


def test_malformed_directive_is_rejected_with_the_line():
    from elastic_launcher.launch_config import Directives
    from slurm_plugin.errors import DirectiveError

    with pytest.raises(DirectiveError, match="line 2"):
        Directives.from_script("#!/bin/bash\n#ELASTIC gpus=8-2\n")


def test_leavers_are_stragglers_then_helper_nodes_then_main_nodes_never_the_batch_host():
    from elastic_launcher.resize import choose_leavers

    order = ["node1", "node2", "node3", "node4"]
    owner = {"node1": "7", "node2": "7", "node3": "8", "node4": "9"}
    assert choose_leavers(order, owner, "7", "node1", 2) == ["node4", "node3"]
    assert choose_leavers(order, owner, "7", "node1", 3) == ["node4", "node3", "node2"]
    assert choose_leavers(order, owner, "7", "node1", 1, prefer=["node2"]) == ["node2"]
    assert choose_leavers(order, owner, "7", "node1", 1, prefer=["node1"]) == ["node4"]
    with pytest.raises(ValueError, match="only"):
        choose_leavers(order, owner, "7", "node1", 4)


def test_idle_time_is_the_boundary_gap_minus_a_normal_step():
    from elastic_launcher.workers import transition_idle_s

    recent = [(1, 1, 0.0), (1, 2, 0.2), (1, 3, 0.4), (2, 4, 1.4), (2, 5, 1.6)]
    idle, step = transition_idle_s(recent, 2)
    assert idle == pytest.approx(0.8) and step == pytest.approx(0.2)
    assert transition_idle_s(recent, 3) == (None, None)
    assert transition_idle_s([(1, 1, 0.0), (1, 2, 0.2), (2, 3, 0.39)], 2)[0] == 0.0   # jitter: clamped


def test_helper_job_script_is_marked_for_the_hook_and_runs_the_agent(tmp_path):
    from datetime import timedelta

    from elastic_launcher.resize import helper_script

    text = helper_script("42", 2, 4, "debug", ["node1", "node2"], "h:123", 4, timedelta(seconds=30), tmp_path,
                         ["python", "train.py", "--lr", "0.1 x"], tmp_path)
    assert "#SBATCH --job-name=elastic-helper-42\n" in text and "#SBATCH --comment=elastic-helper:42\n" in text
    assert "#SBATCH --gres=gpu:4\n" in text and "#SBATCH --exclude=node1,node2\n" in text
    assert "--main-job 42 --store h:123 --workers-per-node 4 --orphan-timeout 30" in text
    assert text.rstrip().endswith("-- python train.py --lr '0.1 x'")


def test_yield_gives_back_what_the_next_pending_job_lacks_and_keeps_the_minimum():
    from elastic_launcher.autoscale import PendingJob, yield_to_pending
    d = yield_to_pending(4, 1, 1, [PendingJob(9, 3, "Resources"), PendingJob(8, 2, "Priority")])
    assert (d.action, d.target_nodes) == ("shrink", 2) and "pending job 9" in d.reason   # the head: 3 - 1 idle
    # a smaller job behind a head the surplus cannot unblock does not jump the queue
    assert yield_to_pending(4, 2, 0, [PendingJob(9, 4, "Resources"), PendingJob(8, 1, "Priority")]) is None
    assert yield_to_pending(4, 3, 0, [PendingJob(9, 2, "Resources")]) is None              # minimum 3: 1 spare
    assert yield_to_pending(4, 1, 2, [PendingJob(9, 2, "Resources")]) is None              # idle nodes suffice
    assert yield_to_pending(2, 1, 0, []) is None


def test_pending_jobs_come_in_slurms_order_without_ours_or_another_partitions():
    from elastic_launcher.autoscale import PendingJob
    from slurm_plugin.client import Job

    def job(jid, prio, state="PENDING", part="debug", reason="Resources"):
        return Job(jid, f"j{jid}", state, (), "", (), (), "", "", "", reason, part, 2, 0, prio)
    jobs = [job(5, 10), job(6, 30), job(7, 30), job(8, 99, part="other"), job(9, 50, state="RUNNING"),
            job(3, 80), job(4, 20, reason="Dependency")]
    got = [p.job_id for p in PendingJob.of(jobs, ours={3}, partition="debug")]
    assert got == [6, 7, 5]                          # priority first, then the oldest; not ours, nor other's
    assert [p.job_id for p in PendingJob.of(jobs, ours=set())][:2] == [8, 3]   # no partition given: every one


# -- issue #40: a voluntary shrink never runs the job into its time limit ---------------------------------------
def timed(nodes, step_s):
    return Measurement(nodes=nodes, workers=nodes, samples_per_s=100.0 / step_s, step_s=step_s)


def at4(*earlier):
    policy = AutoscalePolicy(min_efficiency=0.7)
    for e in earlier:
        policy.record(e)
    policy.record(timed(4, 1.0))
    return policy


def test_a_plans_shrink_goes_only_as_far_as_finishes_before_the_end():
    """1,000 steps left at 1 s a step on 4 nodes; an unmeasured size is taken linear (2 nodes: 2 s, 3: 1.33 s); the
    steps left need steps x step_s x 1.05 + 60 s: 2,160 s at 2 nodes, 1,460 s at 3."""
    plenty = at4().decide(0, planned(2), budget=TimeBudget(time_left_s=2200.0, steps_left=1000))
    assert (plenty.action, plenty.target_nodes) == ("shrink", 2) and "time limit" not in plenty.reason
    reduced = at4().decide(0, planned(2), budget=TimeBudget(time_left_s=2100.0, steps_left=1000))
    assert (reduced.action, reduced.target_nodes) == ("shrink", 3)
    assert "to 3 nodes, not 2" in reduced.reason and "2160 s at 2 nodes, 2100 s to the time limit" in reduced.reason
    refused = at4().decide(0, planned(2), budget=TimeBudget(time_left_s=1400.0, steps_left=1000))
    assert (refused.action, refused.target_nodes) == ("keep", 4) and "refused" in refused.reason


def test_a_measured_step_time_is_taken_over_the_linear_estimate():
    """Measured at 2 nodes: 1.9 s a step (sublinear scaling), 2,055 s for the steps left, inside 2,100 s (the
    linear 2 s would not be)."""
    policy = at4(timed(2, 1.9))
    assert policy.step_s_at(2) == 1.9 and policy.step_s_at(3) == pytest.approx(4 / 3)
    d = policy.decide(0, planned(2), budget=TimeBudget(time_left_s=2100.0, steps_left=1000))
    assert (d.action, d.target_nodes) == ("shrink", 2)


@pytest.mark.parametrize("budget, why", [(None, "no time budget given"),
                                         (TimeBudget(None, 1000), "the job's end time unknown"),
                                         (TimeBudget(100.0, None), "the steps left unknown"),
                                         (TimeBudget(None, None), "the job's end time and the steps left unknown")])
def test_without_the_end_or_the_steps_left_a_shrink_is_as_before_and_says_so(budget, why):
    d = at4().decide(0, planned(2), budget=budget)
    assert (d.action, d.target_nodes) == ("shrink", 2) and d.reason.endswith(f"; time limit not checked: {why}")


def test_a_revert_and_a_shrink_to_the_directives_limit_are_checked_too():
    tight = TimeBudget(time_left_s=100.0, steps_left=1000)
    grew = AutoscalePolicy(min_efficiency=0.7)
    grew.record(timed(2, 1.5))
    grew.record(timed(4, 1.0))                      # efficiency 0.5: a revert to 2, which would not finish
    assert grew.decide(0, budget=TimeBudget(time_left_s=2000.0, steps_left=1000)).action == "revert"
    kept = grew.decide(0, budget=tight)
    assert (kept.action, kept.target_nodes) == ("keep", 4)
    assert "did not pay" in kept.reason and "refused" in kept.reason
    capped = AutoscalePolicy(max_workers=2)       # above gpus max: the extra GPUs cost efficiency, not the batch
    capped.record(timed(4, 1.0))
    assert (capped.decide(0).action, capped.decide(0).target_nodes) == ("shrink", 2)
    assert (capped.decide(0, budget=tight).action, capped.decide(0, budget=tight).target_nodes) == ("keep", 4)


def test_a_hand_back_is_whole_or_refused():
    handback = Decision("shrink", 2, "handing 2 nodes back for pending job 9")
    budget = TimeBudget(time_left_s=2100.0, steps_left=1000)     # 3 nodes would fit, 2 not
    assert at4().within_limit(handback, 4, budget).target_nodes == 3
    assert at4().within_limit(handback, 4, budget, whole=True).action == "keep"
    assert at4().within_limit(handback, 4, TimeBudget(2200.0, 1000), whole=True) == handback
    grow = Decision("grow", 5, "plan says 5 nodes")
    assert at4().within_limit(grow, 4, TimeBudget(0.0, 1000)) == grow


def test_a_time_budget_rejects_negative_values_by_name():
    with pytest.raises(ValueError, match="TimeBudget.steps_left"):
        TimeBudget(10.0, -1)
    with pytest.raises(ValueError, match="TimeBudget.time_left_s"):
        TimeBudget(float("nan"), 1)
