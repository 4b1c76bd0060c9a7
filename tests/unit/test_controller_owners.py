"""#27.2 review: one owner for each rule of the controller, and the checks its entry points were missing. Each test
failed before its fix (Controller._helper_status beside Resizer.helper_status; Resizer._cancel_helper beside
_end_helper and the controller's own stop-key loop at exit; the worker-id prefix spelled in resize.py and
controller.py beside workers.py; ResizeLimits and request_shrink(0) unchecked)."""
import ast
from pathlib import Path

import pytest

import elastic_launcher
from elastic_launcher import workers
from elastic_launcher.controller import Controller
from elastic_launcher.resize import Resizer
from elastic_launcher.resize_ops import ResizeLimits
from tests.unit.test_resize_tick import Clock, make_resizer

PACKAGE = Path(elastic_launcher.__file__).parent


def calls_in(module: str, name: str) -> list[int]:
    """Lines of `module` that call `<anything>.<name>(...)` or `name(...)`."""
    tree = ast.parse((PACKAGE / module).read_text())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and
            (getattr(n.func, "attr", None) == name or getattr(n.func, "id", None) == name)]


def test_the_helper_status_key_has_one_reader_in_the_controller():
    assert not hasattr(Controller, "_helper_status")
    readers = {m for m in ("controller.py", "resize.py", "release.py") if calls_in(m, "helper_status")}
    assert calls_in("controller.py", "read_key") == [] and readers == {"controller.py", "resize.py"}
    src = (PACKAGE / "controller.py").read_text()
    assert "keys.helper_status" not in src and "self.resizer.helper_status(" in src


def test_a_helper_ends_one_way_release_end_helper():
    for gone in ("_cancel_helper", "_end_helper", "cancel", "helper_gone"):
        assert not hasattr(Resizer, gone), gone
    writers = [m for m in ("controller.py", "resize.py", "release.py") if calls_in(m, "helper_stop")]
    assert writers == ["release.py"]
    assert calls_in("release.py", "helper_stop")


def test_the_worker_id_rule_is_spelled_in_workers_py_alone():
    for module in ("controller.py", "resize.py", "release.py", "helper_agent.py"):
        src = (PACKAGE / module).read_text()
        assert 'f"j{' not in src and 'rsplit("-", 1)' not in src and '.group + "-"' not in src, module
    group = workers.step_group("77", "node3", 2)
    wid = workers.worker_id(group, 5)
    assert wid == "j77-node3-g2-5" and wid.startswith(workers.node_prefix("77", "node3"))
    assert wid.startswith(workers.step_prefix(group)) and workers.worker_slot(wid) == 5


@pytest.mark.parametrize("target", [0, -1, 2.0, None])
def test_a_shrink_or_grow_to_no_nodes_is_refused_and_nothing_is_queued(tmp_path, target):
    r = make_resizer(tmp_path, Clock())
    with pytest.raises(ValueError, match="the target must be an integer >= 1"):
        r.request_shrink(target, "shrink", "test")
    with pytest.raises(ValueError, match="the target must be an integer >= 1"):
        r.request_grow(target, "grow", "test")
    assert not r.busy


def test_a_launch_config_with_a_zero_timeout_is_refused_by_the_resizer(tmp_path):
    from datetime import timedelta
    cfg = type("Cfg", (), {"helper_start_timeout": timedelta(0), "rendezvous_timeout": timedelta(seconds=9),
                           "leave_timeout": timedelta(seconds=3)})()
    with pytest.raises(ValueError, match="ResizeLimits.helper_start_s"):
        ResizeLimits.from_config(cfg)
