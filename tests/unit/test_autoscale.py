"""AutoscalePolicy: Or et al.'s scaling-efficiency test, limits, revert and ceiling (no I/O)."""
import pytest

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


def test_plan_bounds_growth_but_never_exceeds_policy_limits():
    policy = AutoscalePolicy(grow_step_nodes=2, max_workers=4)
    policy.record(m(2, 100.0))
    assert policy.decide(free_nodes=2, plan_nodes=2).action == "keep"
    assert policy.decide(free_nodes=2, plan_nodes=3).target_nodes == 3
    assert policy.decide(free_nodes=2, plan_nodes=16).target_nodes == 4


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
        decision = policy.decide(free_nodes=rng.randint(0, 4))
        assert decision.target_nodes >= 1
        if decision.action == "grow":
            assert decision.target_nodes > nodes
            assert decision.target_nodes * policy.slots_per_node * 16 <= policy.max_global_batch
            if policy.ceiling_nodes_ is not None:
                assert decision.target_nodes < policy.ceiling_nodes_
        if decision.action == "keep":
            assert decision.target_nodes == nodes
        nodes = decision.target_nodes
