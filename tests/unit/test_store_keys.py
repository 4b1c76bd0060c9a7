"""The job store's key layout lives in elastic_launcher/store_keys.py alone.

The builders return the byte-identical keys that workers and controllers of one job (and helper agents and
``elastic-launch ctl`` of other versions) agree on; the scan keeps every other module from spelling a key.
"""
from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic_launcher import store_keys as keys
from elastic_launcher.control import launcher_store
from elastic_launcher.membership import Coordinator, Membership, Plan
from elastic_launcher.workers import ProgressReporter

PACKAGE = Path(keys.__file__).parent

# Methods of a torch Store (and of membership._Keys, helper_agent.read_key) whose first argument is a key.
STORE_ONLY = {"check", "wait", "compare_set", "delete_key", "multi_get", "multi_set", "has", "wait_get",
              "read_key", "num_keys"}
# Also methods of dicts, sets and lists: a key only when the receiver is a store.
SHARED = {"get", "set", "add", "append"}
PREFIXES = {"PrefixStore", "with_prefix"}
STORE_NAMES = ("store", "kv", "server", "_k", "k", "bench")


def _is_literal_key(node: ast.AST) -> bool:
    """A key spelled in place: a string, an f-string, a concatenation with one, or a list of those."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _is_literal_key(node.left) or _is_literal_key(node.right)
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_literal_key(e) for e in node.elts)
    return False


def _receiver_is_store(receiver: ast.AST, store_classes: bool) -> bool:
    text = ast.unparse(receiver)
    last = text.rsplit(".", 1)[-1]
    return last in STORE_NAMES or last.endswith("store") or (text == "self" and store_classes)


class _Scan(ast.NodeVisitor):
    """Store calls whose key (or PrefixStore prefix) is spelled in place; ``self.<method>`` counts as a store
    call inside a class that keeps a ``self.store``."""

    def __init__(self, name: str) -> None:
        self.name, self.found, self._store_class = name, [], [False]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        holds = any(isinstance(t, ast.Attribute) and t.attr == "store" and ast.unparse(t.value) == "self"
                    for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets)
        self._store_class.append(holds)
        self.generic_visit(node)
        self._store_class.pop()

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        args = node.args
        key = args[1] if name == "read_key" and len(args) > 1 else args[0] if args else None  # read_key(store, key)
        spelled = key is not None and _is_literal_key(key)
        if name in SHARED:
            spelled = spelled and isinstance(f, ast.Attribute) and _receiver_is_store(f.value, self._store_class[-1])
        elif name not in STORE_ONLY | PREFIXES:
            spelled = False
        if spelled:
            self.found.append(f"{self.name}:{node.lineno}: {ast.unparse(node)[:100]}")
        self.generic_visit(node)


# How the layout's keys and prefixes begin (a string starting so is a key spelled in place, wherever it goes).
KEY_HEADS = ("plan/", "next/", "recover/", "hb/", "joined/", "switched/", "left/", "ctl/", "helper/", "launcher/",
             "elastic/", "progress/", "observations/", "hosts/", "speed/", "state/", "epoch/", "elastic-state",
             "elastic-wrap/")


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)}


def spelled_keys(source: str, name: str = "<source>") -> list[str]:
    """Store calls given a key spelled in place, and strings (or f-string parts) that begin like a key."""
    tree = ast.parse(source)
    scan = _Scan(name)
    scan.visit(tree)
    docs = _docstrings(tree)
    heads = [f"{name}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
             and n.value.lstrip("/").startswith(KEY_HEADS)]
    return scan.found + heads


def test_no_module_but_store_keys_spells_a_store_key():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "store_keys.py":
            found += spelled_keys(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "store keys spelled outside elastic_launcher/store_keys.py:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    'store.set(f"speed/{wid}", "1.0")',
    'self._store.get("speed/" + wid)',
    'self.kv.set("status", "{}")',
    'k.store.check([f"hb/{m}" for m in peers] + ["hb/x"])',
    'self._k.has(f"left/{w}")',
    'store.wait(["master"], timeout)',
    'server.compare_set("next/1", "", "2")',
    'dist.PrefixStore("launcher", server)',
    'addr.with_prefix(addr.prefix + "/elastic-state")',
    'read_key(store, "heartbeat")',
    'class Keys:\n    def __init__(self, s):\n        self.store = s\n    def f(self):\n        return self.get("current")',
])
def test_the_scan_finds_a_spelled_key(source):
    assert spelled_keys(source) != []


@pytest.mark.parametrize("source", [
    'PROGRESS_PREFIX = "launcher/progress/"',
    'key = f"{LAUNCHER_PREFIX}/progress/{wid}"',
    'keys = [f"hb/{m}" for m in peers]',
    'self.state.broadcast(group, src, self.store, f"state/{plan.id}", timeout)',
])
def test_the_scan_finds_a_key_built_apart_from_its_call(source):
    assert spelled_keys(source) != []


@pytest.mark.parametrize("source", [
    'reply.get("action")', 'os.environ.get("SLURM_JOB_ID")', 'out.append("x")', 'seen.add("n1")',
    'store.set(keys.speed(wid), "1.0")', 'self._stop.wait(0.5)', 'self.store.check([key])',
    'class C:\n    def f(self):\n        return self.get("current")',
    'def f():\n    "plan/<id> is read here"',
    'raise RendezvousTimeout(f"no plan includes {wid}")',
])
def test_the_scan_passes_builders_and_dicts(source):
    assert spelled_keys(source) == []


def test_builders_spell_the_layout_byte_for_byte():
    # the strings workers and controllers of running jobs exchange; a change here breaks mixed versions
    assert (keys.RUNTIME, keys.LAUNCHER) == ("elastic", "launcher")
    # #27.1: membership is one record (``state``); seq/plan/current/next/recover keys of earlier versions are gone
    assert (keys.STATE, keys.JOINED_LIST, keys.switched(3)) == ("state", "joined", "switched/3")
    assert [keys.beat("g-0"), keys.joined("g-0"), keys.left("g-0")] == ["hb/g-0", "joined/g-0", "left/g-0"]
    assert (keys.CONTROLLER_BEAT, keys.STATUS, keys.CTL_SEQ) == ("heartbeat", "status", "ctl/seq")
    assert [keys.ctl_request(7), keys.ctl_reply(7)] == ["ctl/req/7", "ctl/reply/7"]
    assert [keys.helper_status("42"), keys.helper_stop("42")] == ["helper/42/status", "helper/42/stop"]
    assert [keys.progress("g-0"), keys.observations("g-0"), keys.hosts("g-0")] == \
        ["launcher/progress/g-0", "launcher/observations/g-0", "launcher/hosts/g-0"]
    assert [keys.speed("g-0"), keys.state(3)] == ["speed/g-0", "state/3"]
    assert [keys.state_channel(""), keys.state_channel("job")] == ["/elastic-state", "job/elastic-state"]
    assert [keys.group_channel("", 3), keys.group_channel("job", 3)] == ["/epoch/3", "job/epoch/3"]
    assert keys.epoch_group(3) == Plan(3, ("a",)).group_prefix == "epoch/3"
    assert (keys.wrap_channel(3), keys.WRAP_MASTER) == ("elastic-wrap/3", "master")


@pytest.fixture()
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_the_two_sides_meet_on_the_full_keys(server):
    """What a worker writes through its clients lands where the controller and ctl read, under the
    channel prefixes the docstring table names."""
    coord = Coordinator(server)
    plan = coord.start(["w-0"])
    member = Membership(lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False), "w-0")
    member.start()
    try:
        member.report_switched(plan, {"pause_s": 0.1})
        ProgressReporter(dist.TCPStore("127.0.0.1", server.port, is_master=False), "w-0", "n1").report(
            plan.id, 4, 64, 0.5)
        launcher_store("127.0.0.1", server.port, timedelta(seconds=10)).set(keys.STATUS, "{}")
        assert coord.joined() == ["w-0"] and coord.switched(plan) == {"pause_s": 0.1}
        for full in ("elastic/state", "elastic/hb/w-0", "elastic/joined",
                     "elastic/joined/w-0", "elastic/switched/1", "launcher/progress/w-0", "launcher/status"):
            assert server.check([full]), full
    finally:
        member.stop()
