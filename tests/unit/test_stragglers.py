"""StragglerDetector: persistent slowness is reported, one-off hiccups are not."""
import pytest

from elastic_launcher.stragglers import StragglerDetector


def test_persistently_slow_node_is_reported_after_n_windows():
    detector = StragglerDetector(ratio=1.5, windows=3)
    window = {"node1": 0.10, "node2": 0.11, "node3": 0.30, "node4": 0.10}
    assert detector.observe(window) == []
    assert detector.observe(window) == []
    assert detector.observe(window) == ["node3"]


def test_one_off_hiccup_resets_the_count():
    detector = StragglerDetector(ratio=1.5, windows=2)
    slow = {"node1": 0.1, "node2": 0.4}
    fine = {"node1": 0.1, "node2": 0.1}
    assert detector.observe(slow) == []
    assert detector.observe(fine) == []
    assert detector.observe(slow) == []
    assert detector.observe(slow) == ["node2"]


def test_uniformly_slow_cluster_has_no_straggler():
    detector = StragglerDetector(ratio=1.5, windows=1)
    assert detector.observe({"a": 1.0, "b": 1.1, "c": 0.95}) == []


def test_single_node_cannot_be_compared():
    detector = StragglerDetector(windows=1)
    assert detector.observe({"node1": 5.0}) == []


def test_protected_node_is_never_reported_and_left_nodes_are_forgotten():
    detector = StragglerDetector(ratio=1.5, windows=1, protected=frozenset({"node1"}))
    assert detector.observe({"node1": 1.0, "node2": 0.1, "node3": 0.1}) == []
    detector.observe({"node2": 0.1, "node3": 0.5})
    assert detector.slow_counts_ == {"node2": 0, "node3": 1}
    detector.observe({"node2": 0.1, "node4": 0.1})
    assert "node3" not in detector.slow_counts_


@pytest.mark.parametrize("kwargs", [{"ratio": 1.0}, {"windows": 0}])
def test_bad_parameters_are_named(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        StragglerDetector(**kwargs)
