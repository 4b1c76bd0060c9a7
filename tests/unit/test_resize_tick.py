"""Resizer.tick and Controller._tick with fake Slurm, store, membership and a fake clock (#27.2): a grow or a
shrink moves one state a tick and never waits; deadlines, failures and operator requests during a grow end it
with its helper released. No real time, no Slurm, no workers."""
import json
import time

import pytest

from elastic_launcher import resize as resize_module
from elastic_launcher import resize_ops
from elastic_launcher import store_keys as keys
from elastic_launcher.controller import Controller
from elastic_launcher.launch_config import Allocation, Directives, LaunchConfig
from elastic_launcher.membership import Plan
from elastic_launcher.reporting import RecordLog
from elastic_launcher.resize import Fleet, MeasureWindow, NodeSlot, Resizer
from elastic_launcher.resize_ops import ResizeKind, ResizeState
from elastic_launcher.steering import JobPhase
from elastic_launcher.stragglers import StragglerDetector
from slurm_plugin.errors import JobNotFoundError

S = ResizeState
SCRIPT = "#!/bin/bash\n#ELASTIC model=resnet50 gpus=1-8 per_gpu_batch=16 max_global_batch=64\npython train.py\n"


class Clock:
    """A monotonic clock that moves only when told (or when the controller 'sleeps')."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds


class FakeSlurm:
    """Jobs by id: state and nodes; submit queues a PENDING helper; cancel ends it."""

    def __init__(self, free=("node3", "node4")):
        self.free = list(free)
        self.jobs: dict[int, dict] = {}
        self.submitted: list[str] = []
        self.cancelled: list[int] = []
        self.next_id = 100

    def submit(self, script):
        self.next_id += 1
        self.submitted.append(script)
        self.jobs[self.next_id] = {"state": "PENDING", "nodes": ()}
        return self.next_id

    def start(self, job, nodes):
        self.jobs[job] = {"state": "RUNNING", "nodes": tuple(nodes)}

    def job(self, job_id):
        if job_id not in self.jobs:
            raise JobNotFoundError(job_id)
        j = self.jobs[job_id]
        return type("Job", (), {"state": j["state"], "nodes": j["nodes"]})()

    def cancel(self, job_id):
        self.cancelled.append(job_id)
        if job_id in self.jobs:
            self.jobs[job_id]["state"] = "CANCELLED"

    def shrink(self, job_id, keep):
        self.shrunk = getattr(self, "shrunk", []) + [(job_id, list(keep))]
        job = type("Job", (), {"nodelist": ",".join(keep), "nodes": list(keep)})()
        return type("Result", (), {"job": job, "apply": lambda self, env: dict(env)})()


class FakeKV(dict):
    def set(self, key, value):
        self[key] = value.encode() if isinstance(value, str) else value

    def check(self, ks):
        return all(k in self for k in ks)

    def get(self, key):
        return dict.__getitem__(self, key)


class FakeCoord:
    """Membership: the current plan, who joined, posted plans, switch records, who left."""

    def __init__(self, members):
        self.plan = Plan(1, tuple(members))
        self.joined_ids: list[str] = []
        self.posted: list[Plan] = []
        self.switched_ids: set[int] = set()
        self.left: set[str] = set()

    def current(self):
        return self.plan

    def joined(self):
        return sorted(self.joined_ids)

    def request_resize(self, members, base=None):
        plan = Plan(self.plan.id + 1 + len(self.posted), tuple(members), self.plan.id, "resize")
        self.posted.append(plan)
        return plan

    def switch(self, plan):
        self.switched_ids.add(plan.id)
        self.plan = plan

    def switched(self, plan):
        return {"epoch": plan.id, "pause_s": 0.05} if plan.id in self.switched_ids else None

    def has_left(self, wid):
        return wid in self.left


class FakeStep:
    def __init__(self, node, owner):
        self.node, self.owner_job, self.leaving, self.code = node, owner, False, None

    def alive(self):
        return self.code is None

    def returncode(self):
        return self.code


class FakePool:
    def __init__(self, nodes, owner="42"):
        self.steps = {n: FakeStep(n, owner) for n in nodes}
        self.signals: list[tuple[str, int]] = []
        self.started: list[str] = []

    def forget(self, node):
        return self.steps.pop(node, None)

    def signal_step(self, node, sig):
        """A signal ends the step (unless the test says it ignores them: `step.stubborn`)."""
        self.signals.append((node, sig))
        step = self.steps.get(node)
        if step is not None and step.alive() and not getattr(step, "stubborn", False):
            step.code = -sig

    def start(self, node, slots, env, owner_job):
        self.started.append(node)
        group = f"j{owner_job}-{node}-g{len(self.started)}"
        self.steps[node] = FakeStep(node, owner_job)
        return type("Step", (), {"group": group})()


def make_config(tmp_path, nodes=2):
    alloc = Allocation(job_id="42", nodes=tuple(f"node{i + 1}" for i in range(nodes)), batch_host="node1",
                       gpus_per_node=1, partition="debug")
    return LaunchConfig(command=("python", "train.py"), allocation=alloc, directives=Directives.from_script(SCRIPT),
                        run_dir=tmp_path, grow_step_nodes=2)


def wids(node, owner="42", slots=1):
    return tuple(f"j{owner}-{node}-g0-{i}" for i in range(slots))


def make_resizer(tmp_path, clock, slurm=None, nodes=2):
    config = make_config(tmp_path, nodes)
    fleet = Fleet("42", config.allocation, 1)
    for n in config.allocation.nodes:
        fleet.nodes[n] = NodeSlot(n, "42", f"j42-{n}-g0-", wids(n))
    coord = FakeCoord([w for n in config.allocation.nodes for w in wids(n)])
    slurm = slurm or FakeSlurm()
    progress = {}  # wid -> progress record (the epoch rank 0 is in)
    r = Resizer(config, fleet, coord=coord, pool=FakePool(config.allocation.nodes), slurm=slurm, kv=FakeKV(),
                records=RecordLog(tmp_path / "records.jsonl"), stragglers=StragglerDetector(1.5, 3),
                window=MeasureWindow(), store_addr="127.0.0.1:1",
                progress=lambda ws: {w: progress[w] for w in ws if w in progress},
                free_nodes=lambda: [n for n in slurm.free if n not in fleet.nodes], clock=clock)
    r.progress_records = progress
    return r


def switch(r, plan):
    """The workers of `plan` took their first step in it."""
    r.coord.switch(plan)
    r.progress_records[plan.members[0]] = {"epoch": plan.id, "recent": []}


def records(r, kind):
    return [x for x in r.records.items if x["kind"] == kind]


def test_a_grow_moves_one_state_a_tick_and_never_waits(tmp_path, monkeypatch):
    clock = Clock()
    r = make_resizer(tmp_path, clock)
    monkeypatch.setattr(resize_module, "wait_until", lambda *a, **k: pytest.fail("a tick waited"))
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("a tick slept"))
    r.request_grow(4, "grow", "test")
    assert r.tick().state is S.SUBMITTED and len(r.slurm.submitted) == 1
    helper = r.active.helper
    assert r.fleet.helpers == {helper: []} and "#SBATCH --nodes=2" in r.slurm.submitted[0]
    clock.t += 5
    assert r.tick().state is S.SUBMITTED                      # still queued: the tick returns at once
    r.slurm.start(int(helper), ["node3", "node4"])
    assert r.tick().state is S.ALLOCATED and set(r.fleet.joining) == {"node3", "node4"}
    assert set(r.fleet.nodes) == {"node1", "node2"}          # not members yet: no failure handling, no measuring
    r.coord.joined_ids = [*wids("node3", helper), *wids("node4", helper)]
    r.fleet.joining["node3"].prefix = f"j{helper}-node3-g0-"
    r.fleet.joining["node4"].prefix = f"j{helper}-node4-g0-"
    op = r.tick()
    assert op.state is S.JOINED and op.plan_id == r.coord.posted[0].id and not r.fleet.joining
    assert r.coord.posted[0].members[-2:] == (*wids("node3", helper), *wids("node4", helper))
    assert set(r.fleet.nodes) == {"node1", "node2", "node3", "node4"} and not r.settled
    assert r.tick().state is S.JOINED
    switch(r, r.coord.posted[0])
    clock.t += 2
    op = r.tick()
    assert op.state is S.SWITCHED and not r.busy and r.last is op
    (t,) = records(r, "transition")
    assert (t["action"], t["from_nodes"], t["to_nodes"], t["helper"], t["wall_s"], t["pause_s"]) == \
        ("grow", 2, 4, helper, 7.0, 0.05)
    assert t["allocate_s"] == 5.0 and r.window.epoch is None


def _posted_grow(r, clock):
    r.request_grow(4, "grow", "test")
    r.tick()
    helper = r.active.helper
    r.slurm.start(int(helper), ["node3", "node4"])
    r.tick()
    r.coord.joined_ids = [*wids("node3", helper), *wids("node4", helper)]
    r.fleet.joining["node3"].prefix = f"j{helper}-node3-g0-"
    r.fleet.joining["node4"].prefix = f"j{helper}-node4-g0-"
    assert r.tick().state is S.JOINED
    return helper, r.coord.posted[0]


@pytest.mark.parametrize("keeps_newcomers", [True, False], ids=["carried", "dropped"])
def test_a_recovery_that_replaces_a_posted_grow_keeps_newcomers_it_carried(tmp_path, keeps_newcomers):
    """The grow's plan switched and a recovery (node2 died) replaced it before its first step was reported: when the
    recovery's epoch holds the newcomers, the grow finishes (its helper is not cancelled, which would kill members
    that train); when it dropped them, the grow fails and the helper goes."""
    clock = Clock()
    r = make_resizer(tmp_path, clock)
    helper, posted = _posted_grow(r, clock)
    r.coord.switch(posted)                                     # switched; no first step reported in it
    survivors = [w for w in posted.members if not w.startswith("j42-node2")]
    if not keeps_newcomers:
        survivors = [w for w in survivors if w.startswith("j42-")]
    recovered = Plan(posted.id + 1, tuple(survivors), posted.id, "recovery")
    r.coord.plan = recovered
    clock.t += 1
    op = r.tick()
    if keeps_newcomers:
        assert op.state is S.SWITCHED and r.slurm.cancelled == [] and keys.helper_stop(helper) not in r.kv
        assert {"node3", "node4"} <= set(r.fleet.nodes)
        (t,) = records(r, "transition")
        assert t["helper"] == helper and t["nodes_in"] == ["node3", "node4"]
    else:
        assert op.state is S.FAILED and "superseded" in op.error and r.slurm.cancelled == [int(helper)]


@pytest.mark.parametrize("stage, limit", [("submitted", 60.0), ("allocated", 120.0), ("joined", 120.0)])
def test_each_deadline_fails_the_grow_and_cancels_the_helper(tmp_path, stage, limit):
    clock = Clock()
    r = make_resizer(tmp_path, clock)
    r.request_grow(3, "grow", "test")
    r.tick()
    helper = r.active.helper
    if stage != "submitted":
        r.slurm.start(int(helper), ["node3"])
        r.tick()
    if stage == "joined":
        r.fleet.joining["node3"].wids = ()
        r.coord.joined_ids = list(wids("node3", helper))
        r.fleet.joining["node3"].prefix = f"j{helper}-node3-g0-"
        assert r.tick().state is S.JOINED
    t0 = clock.t
    ticks = 0
    while r.busy:
        clock.t += 1.0
        ticks += 1
        r.tick()
    assert ticks == int(limit)                     # polled every tick until the deadline, not a wait
    assert clock.t - t0 == limit and r.last.state is S.FAILED
    assert r.slurm.cancelled == [int(helper)] and r.fleet.helpers == {} and not r.fleet.joining
    assert set(r.fleet.nodes) == {"node1", "node2"}
    (f,) = records(r, "transition_failed")
    assert f["state"] == stage and not f["cancelled"]
    assert keys.helper_stop(helper) in r.kv
    assert r.fleet.failures_in_a_row == (0 if stage == "submitted" else 1)


def test_a_helper_that_fails_while_queued_or_whose_workers_fail_ends_the_grow_at_once(tmp_path):
    clock = Clock()
    r = make_resizer(tmp_path, clock)
    r.request_grow(3, "grow", "test")
    r.tick()
    r.slurm.jobs[int(r.active.helper)]["state"] = "FAILED"
    assert r.tick().state is S.FAILED
    r.request_grow(3, "grow", "again")
    r.tick()
    helper = r.active.helper
    r.slurm.start(int(helper), ["node3"])
    r.tick()
    r.kv.set(keys.helper_status(helper), json.dumps({"steps": {"node3": 1}}))
    op = r.tick()
    assert op.state is S.FAILED and "node3" in op.error and clock.t == 1000.0   # no deadline waited for
    assert r.slurm.cancelled[-1] == int(helper) and not r.fleet.joining


def test_no_free_nodes_skips_the_grow_and_a_failed_submit_fails_it(tmp_path):
    r = make_resizer(tmp_path, Clock(), slurm=FakeSlurm(free=()))
    r.request_grow(3, "grow", "test")
    assert r.tick().skipped and records(r, "transition_skipped")[0]["reason"] == "no free nodes"
    from slurm_plugin.errors import SlurmError

    def refuse(script):
        raise SlurmError(["sbatch"], 1, "sbatch: refused")
    r.slurm.free, r.slurm.submit = ["node3"], refuse
    r.request_grow(3, "grow", "test")
    op = r.tick()
    assert op.state is S.FAILED and "refused" in op.error and r.fleet.helpers == {}


def test_a_shrink_of_a_helper_node_posts_switches_and_releases_once_left(tmp_path, monkeypatch):
    clock = Clock()
    r = make_resizer(tmp_path, clock, nodes=3)
    r.fleet.nodes["node3"] = NodeSlot("node3", "77", "j77-node3-", ("j77-node3-0",))
    r.fleet.nodes.pop("node2")  # node1 (batch host), node3 (helper 77's)
    r.fleet.helpers["77"] = ["node3"]
    r.slurm.start(77, ["node3"])
    r.coord.plan = Plan(1, ("j42-node1-g0-0", "j77-node3-0"))
    r.pool.forget("node2"), r.pool.forget("node3")  # a helper node's step is its agent's, not the controller's
    monkeypatch.setattr(resize_module, "wait_until", lambda *a, **k: pytest.fail("a tick waited"))
    r.request_shrink(1, "shrink", "test")
    op = r.tick()
    assert (op.state, op.nodes) == (S.JOINED, ("node3",)) and r.coord.posted[0].members == ("j42-node1-g0-0",)
    switch(r, r.coord.posted[0])
    assert r.tick().state is S.SWITCHED and "node3" in r.fleet.nodes
    assert r.tick().state is S.SWITCHED                 # waits (ticks) for the leaver, up to leave_timeout
    r.coord.left.add("j77-node3-0")
    op = r.tick()
    assert op.state is S.RELEASING and set(r.fleet.nodes) == {"node1"} and r.fleet.helpers == {}
    assert r.kv[keys.helper_stop("77")] == b"test" and r.slurm.cancelled == []   # asked; its grace runs
    op = r.tick()
    assert op.state is S.RELEASED and not r.busy
    (t,) = records(r, "transition")
    assert (t["action"], t["from_nodes"], t["to_nodes"], t["nodes_out"], t["left_cleanly"]) == \
        ("shrink", 2, 1, ["node3"], True)
    assert not records(r, "helper_ended")
    r.slurm.jobs[77]["state"] = "COMPLETED"                   # the agent ended the helper by itself
    r.tick()
    (e,) = records(r, "helper_ended")
    assert (e["helper"], e["cancelled"]) == ("77", False) and r.slurm.cancelled == []


def test_a_post_that_loses_a_race_is_posted_again_next_tick(tmp_path):
    from elastic_launcher.errors import ResizeConflict
    r = make_resizer(tmp_path, Clock(), nodes=2)
    real = r.coord.request_resize
    tries = []

    def racy(members, base=None):
        tries.append(members)
        if len(tries) == 1:
            raise ResizeConflict(1, 2)
        return real(members, base)
    r.coord.request_resize = racy
    r.request_shrink(1, "shrink", "test")
    op = r.tick()
    assert op.state is S.JOINED and op.plan_id is None and r.pool.steps["node2"].leaving
    op = r.tick()
    assert op.plan_id is not None and len(tries) == 2


# -- the controller loop -----------------------------------------------------------------------------


class FakeInbox:
    def __init__(self):
        self.requests, self.replies = [], {}

    def poll(self):
        out, self.requests = self.requests, []
        return out

    def reply(self, seq, ok, message, **extra):
        self.replies[seq] = {"ok": ok, "message": message, **extra}


def make_controller(tmp_path, clock, nodes=2):
    config = make_config(tmp_path, nodes)
    c = Controller(config, registry=tmp_path / "registry", slurm=None, start_step=None, clock=clock,
                   sleep=clock.sleep)
    r = make_resizer(tmp_path, clock, nodes=nodes)
    c.fleet, c.slurm, c.coord, c.kv, c.pool, c.window = r.fleet, r.slurm, r.coord, r.kv, r.pool, r.window
    c.records, c.resizer, c.inbox = r.records, r, FakeInbox()
    c._write_status = lambda: None
    c._measure = lambda: None
    c.phase = JobPhase.RUNNING
    return c


def test_the_loop_ticks_while_a_grow_waits_in_the_queue_and_cancels_it_at_the_deadline(tmp_path, monkeypatch):
    clock = Clock()
    c = make_controller(tmp_path, clock)
    calls = []
    real = resize_ops.advance

    def spy(op, obs, now, limits):
        calls.append((now, op.state))
        return real(op, obs, now, limits)
    monkeypatch.setattr(resize_module, "advance", spy)
    c.resizer.request_grow(3, "grow", "test")
    phases = []
    for _ in range(400):  # 400 ticks at poll_interval 0.2 s: 80 s of fake time
        assert c._tick() is None
        phases.append(c.phase)
        c.sleep(c.config.poll_interval.total_seconds())
    nows = [now for now, _ in calls]
    assert len(calls) > 300 and all(b - a == pytest.approx(0.2) for a, b in zip(nows, nows[1:]))  # once a tick
    assert c.resizer.last.state is S.FAILED and "did not start within 60 s" in c.resizer.last.error
    assert phases[0] is JobPhase.RESIZING and phases[-1] is JobPhase.RUNNING
    assert c.slurm.cancelled == [101] and c.fleet.helpers == {}


def test_an_operator_shrink_during_a_queued_grow_is_answered_and_the_grow_cancelled_in_the_same_tick(tmp_path):
    clock = Clock()
    c = make_controller(tmp_path, clock)
    c.resizer.request_grow(3, "grow", "autoscale")
    c._tick()
    assert c.resizer.active.state is S.SUBMITTED and c.phase is JobPhase.RESIZING
    c.inbox.requests = [(1, {"nodes": 1})]
    c._tick()
    reply = c.inbox.replies[1]
    assert reply["ok"] and reply["target_nodes"] == 1 and "grow in flight (submitted) is cancelled" in reply["message"]
    assert c.slurm.cancelled == [101] and c.fleet.helpers == {}
    (f,) = [x for x in c.records.items if x["kind"] == "transition_failed"]
    assert f["cancelled"] and "operator asked for 1 nodes" in f["error"]
    assert c.resizer.active.kind is ResizeKind.SHRINK and c.operator_cap == 1
    c._tick()
    assert c.resizer.active.state is S.JOINED and c.resizer.active.nodes == ("node2",)


def test_an_operator_grow_beyond_a_submitted_grow_keeps_it_and_queues_behind_it(tmp_path):
    """Review: a request in the grow's own direction said "after the grow in flight" but cancelled it."""
    clock = Clock()
    c = make_controller(tmp_path, clock)
    c.resizer.request_grow(3, "grow", "autoscale")
    c._tick()
    assert c.resizer.active.state is S.SUBMITTED
    c.inbox.requests = [(1, {"nodes": 4})]
    c._tick()
    assert "after the grow in flight (submitted)" in c.inbox.replies[1]["message"]
    assert c.slurm.cancelled == [] and not [x for x in c.records.items if x["kind"] == "transition_failed"]
    assert c.resizer.active.state is S.SUBMITTED and c.resizer.active.helper == "101"


def test_an_operator_request_after_the_plan_is_posted_is_queued_behind_the_grow(tmp_path):
    clock = Clock()
    c = make_controller(tmp_path, clock)
    r = c.resizer
    r.request_grow(3, "grow", "autoscale")
    c._tick()
    helper = r.active.helper
    r.slurm.start(int(helper), ["node3"])
    c._tick()
    r.coord.joined_ids = list(wids("node3", helper))
    r.fleet.joining["node3"].prefix = f"j{helper}-node3-g0-"
    c._tick()
    assert r.active.state is S.JOINED
    c.inbox.requests = [(1, {"nodes": 2})]
    c._tick()
    assert "after the grow in flight (joined)" in c.inbox.replies[1]["message"]
    assert [op.kind for op in r.ops] == [ResizeKind.GROW, ResizeKind.SHRINK] and r.slurm.cancelled == []


def recover(c, node, epoch_id=None):
    """The survivors' recovery epoch without `node`'s workers becomes current and takes its first step."""
    plan = Plan(epoch_id or c.coord.plan.id + 10, tuple(w for w in c.coord.plan.members
                                                        if w not in c.fleet.nodes[node].wids), c.coord.plan.id)
    switch(c.resizer, plan)
    return plan


def test_a_main_node_failure_while_a_grow_is_queued_is_followed_tick_by_tick_without_waiting(tmp_path, monkeypatch):
    """#27.2: the failure was handled by a blocking Resizer.node_failed (up to rendezvous_timeout for the recovery
    epoch, EXIT_GRACE for the step) and RECOVERING was set and reset inside it, read by nobody."""
    clock = Clock()
    c = make_controller(tmp_path, clock)
    monkeypatch.setattr(resize_module, "wait_until", lambda *a, **k: pytest.fail("a tick waited"))
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("a tick slept"))
    c.resizer.request_grow(3, "grow", "autoscale")
    c._tick()
    assert c.resizer.active.state is S.SUBMITTED
    c.pool.steps["node2"].code = 1
    c._tick()
    (f,) = [x for x in c.records.items if x["kind"] == "failure"]
    assert f["node"] == "node2" and c.phase is JobPhase.RECOVERING and c.resizer.active.state is S.SUBMITTED
    for _ in range(3):  # no recovery epoch yet: the phase holds, nothing is measured or posted, nothing waits
        clock.t += 1
        c._tick()
        assert c.phase is JobPhase.RECOVERING and not c.resizer.settled and c.coord.posted == []
    assert [x["kind"] for x in c.records.items].count("failure") == 1          # not handled twice
    recover(c, "node2")
    c._tick()                                                   # EVICTED: the recovery epoch is current
    c._tick()                                                   # switched: the node's release starts and ends
    c._tick()                                                   # released: transition recorded
    (t,) = [x for x in c.records.items if x["kind"] == "transition"]
    assert (t["action"], t["node"], t["from_nodes"], t["to_nodes"], t["recovered"]) == ("failure", "node2", 2, 1, True)
    assert t["wall_s"] == 3.0 and c.slurm.shrunk == [(42, ["node1"])] and set(c.fleet.nodes) == {"node1"}
    assert c.phase is JobPhase.RESIZING and c.resizer.active.state is S.SUBMITTED      # the grow goes on


def test_a_queued_shrink_posts_nothing_while_a_failed_node_recovers(tmp_path):
    """RECOVERING is read: an op posts no plan on an epoch the survivors are replacing."""
    clock = Clock()
    c = make_controller(tmp_path, clock, nodes=3)
    c.pool.steps["node3"].code = 1
    c._tick()
    c.inbox.requests = [(1, {"nodes": 1})]
    c._tick()
    assert c.inbox.replies[1]["message"] == "resizing from 2 to 1 node"   # the failed node is not counted
    assert c.phase is JobPhase.RECOVERING and c.resizer.active.state is S.REQUESTED and c.coord.posted == []
    recover(c, "node3")
    for _ in range(3):
        c._tick()
    assert not c.resizer.recovering and c.resizer.active.state is S.JOINED
    assert c.coord.posted[-1].members == wids("node1") and c.resizer.active.nodes == ("node2",)


def test_a_hung_node_left_out_by_the_survivors_is_terminated_then_killed_on_deadlines(tmp_path):
    clock = Clock()
    c = make_controller(tmp_path, clock)
    c.pool.steps["node2"].stubborn = True
    c.coord.plan = Plan(5, wids("node1"), 1)                   # the survivors declared node2's workers dead
    c._tick()
    (f,) = [x for x in c.records.items if x["kind"] == "failure"]
    assert f["cause"] == "left out of the membership while running" and c.phase is JobPhase.RECOVERING
    switch(c.resizer, c.coord.plan)
    c._tick()
    c._tick()
    assert c.pool.signals == [] and "node2" in c.fleet.nodes                  # exit_s (5 s) not passed yet
    clock.t += 5
    c._tick()
    assert c.pool.signals == [("node2", 15)]
    clock.t += 20
    c._tick()
    assert c.pool.signals[-1] == ("node2", 9)
    clock.t += 20
    c._tick()
    c._tick()
    assert "node2" not in c.fleet.nodes and c.phase is JobPhase.RUNNING
    assert [x["action"] for x in c.records.items if x["kind"] == "transition"] == ["failure"]


@pytest.mark.parametrize("planner_nodes", [2, 1, None], ids=["planner-wants-it", "planner-shrinks", "no-advice"])
def test_a_fenced_out_node_rejoins_as_a_newcomer_when_the_planner_wants_it(tmp_path, planner_nodes):
    """#42.3: node2's workers still ran (hung past the arrival deadline) when the survivors fenced them out. The
    planner wants 2 nodes: the node's step is ended but the node is kept, and fresh workers there join as newcomers
    (a grow); the planner wants 1, or has not answered yet: the node is given back, as before."""
    from elastic_launcher.autoscale import PLANNER, PlanAdvice
    clock = Clock()
    c = make_controller(tmp_path, clock)
    if planner_nodes is not None:
        c._plan_cache = (2, clock.t, PlanAdvice(planner_nodes, PLANNER, "test"))
    c.coord.plan = Plan(5, wids("node1"), 1, "recovery")       # the survivors fenced node2's workers out
    c._tick()
    (f,) = [x for x in c.records.items if x["kind"] == "failure"]
    assert f["cause"] == "left out of the membership while running" and f["rejoin"] is (planner_nodes == 2)
    switch(c.resizer, c.coord.plan)
    for _ in range(3):
        c._tick()
    clock.t += 5
    for _ in range(3):
        c._tick()
    assert c.pool.signals[0] == ("node2", 15)                   # the hung workers' step is ended either way
    if planner_nodes != 2:
        assert c.pool.started == [] and "node2" not in c.fleet.nodes and "node2" not in c.fleet.joining
        assert c.slurm.shrunk, "the node was not given back"
        return
    assert c.pool.started == ["node2"] and "node2" in c.fleet.joining and not getattr(c.slurm, "shrunk", None)
    new = ["j42-node2-g1-0"]
    c.coord.joined_ids = new
    c._tick()
    assert c.coord.posted[-1].members == (*wids("node1"), *new) and c.coord.posted[-1].kind == "resize"
    switch(c.resizer, c.coord.posted[-1])
    c._tick()
    assert c.phase is JobPhase.RUNNING and set(c.fleet.nodes) == {"node1", "node2"}
    assert [x["action"] for x in c.records.items if x["kind"] == "transition"] == ["failure", "rejoin"]


def test_a_failed_batch_host_is_restarted_and_rejoins_without_a_wait(tmp_path, monkeypatch):
    clock = Clock()
    c = make_controller(tmp_path, clock)
    monkeypatch.setattr(resize_module, "wait_until", lambda *a, **k: pytest.fail("a tick waited"))
    c.pool.steps["node1"].code = 1
    c._tick()
    recover(c, "node1")
    for _ in range(3):
        c._tick()
    assert c.pool.started == ["node1"] and "node1" in c.fleet.joining and c.phase is JobPhase.RECOVERING
    assert not getattr(c.slurm, "shrunk", None)                  # the batch host is never given back
    new = [f"j42-node1-g1-0"]
    c.coord.joined_ids = new
    c._tick()
    assert c.coord.posted[-1].members == (*wids("node2"), *new)
    switch(c.resizer, c.coord.posted[-1])
    c._tick()
    assert c.phase is JobPhase.RUNNING and set(c.fleet.nodes) == {"node1", "node2"}
    assert [x["action"] for x in c.records.items if x["kind"] == "transition"] == ["failure", "rejoin"]


def test_startup_is_ticked_requests_are_answered_while_the_workers_join(tmp_path, monkeypatch):
    """#27.2: the start waited (wait_joined, wait_switched) before the loop's first tick."""
    clock = Clock()
    c = make_controller(tmp_path, clock)
    monkeypatch.setattr(resize_module, "wait_until", lambda *a, **k: pytest.fail("a tick waited"))
    c.phase = JobPhase.STARTING
    c._start_deadline = clock.t + 120
    c.coord.plan = None
    for node in ("node1", "node2"):
        c.fleet.nodes[node].wids = ()
    c.coord.start = lambda members: setattr(c.coord, "plan", Plan(1, tuple(members))) or c.coord.plan
    c.inbox.requests = [(1, {"nodes": 1})]
    c._tick()
    assert c.inbox.replies[1]["ok"] and c.phase is JobPhase.STARTING and c.coord.plan is None
    c.coord.joined_ids = [*wids("node1"), *wids("node2")]
    c._tick()
    assert c.coord.plan.members == (*wids("node1"), *wids("node2")) and c.phase is JobPhase.STARTING
    switch(c.resizer, c.coord.plan)
    c._tick()
    assert c.phase is JobPhase.RUNNING and [x["action"] for x in c.records.items if x["kind"] == "transition"] == ["start"]
    c._tick()
    assert c.resizer.active.kind is ResizeKind.SHRINK            # the request queued during the start runs now


def test_startup_fails_at_its_deadline_naming_the_nodes_short_of_workers(tmp_path):
    from elastic_launcher.errors import RendezvousTimeout
    clock = Clock()
    c = make_controller(tmp_path, clock)
    c.phase, c._start_deadline, c.coord.plan = JobPhase.STARTING, clock.t + 120, None
    c.coord.joined_ids = list(wids("node1"))
    c.fleet.nodes["node2"].wids = ()
    c._tick()
    clock.t += 120
    with pytest.raises(RendezvousTimeout, match=r"node2 \(0/1\)"):
        c._tick()


def test_no_autoscale_decision_while_resizing_but_the_measurement_is_recorded(tmp_path):
    from elastic_launcher.autoscale import Measurement
    clock = Clock()
    c = make_controller(tmp_path, clock)
    c._measure = lambda: (Measurement(nodes=2, workers=2, samples_per_s=200.0, step_s=0.1), {})
    c._post_observations = lambda own: None
    c._current_layout = lambda: [1, 1]
    c._ask_plan = lambda m, layout: pytest.fail("a decision was taken while resizing")
    c.resizer.request_grow(3, "grow", "autoscale")
    c._tick()
    assert c.phase is JobPhase.RESIZING
    assert [x["kind"] for x in c.records.items].count("measurement") == 1


def test_at_exit_a_helper_still_in_its_release_grace_is_cancelled_within_the_exit_wait(tmp_path, monkeypatch):
    """A shrink gave helper 77 back with leave_s (20 s) of grace; the job ends 1 s later. The exit ends every helper
    within HELPER_EXIT_S: before, only the fleet's helpers were, so 77 (out of the fleet, still in its grace) was
    never scancelled (left to its agent and the orphan timeout)."""
    from elastic_launcher import controller as controller_module
    clock = Clock()
    c = make_controller(tmp_path, clock)
    c.slurm.start(77, ["node3"])
    c.resizer.releaser.end_helper("77", "shrink", c.resizer.limits.leave_s)
    assert c.slurm.cancelled == [] and "77" in c.resizer.releaser.ending
    clock.t += 1

    def fake_wait(predicate, timeout, interval=0.1):  # the exit's wait, on the fake clock
        clock.t += timeout.total_seconds()
        return predicate()
    monkeypatch.setattr(controller_module, "wait_until", fake_wait)
    c._cleanup("completed")
    assert c.slurm.cancelled == [77] and not c.resizer.releaser.ending
    (e,) = records(c.resizer, "helper_ended")
    assert (e["helper"], e["cancelled"]) == ("77", True)


def test_an_operator_request_counts_a_released_failed_node_once(tmp_path):
    """node3 failed and its release ended in the tick that started it (its step had ended), so it left the fleet while
    its RecoveryOp waits one more tick to finish: a request in that tick counted it out twice (3 - 1 - 1 = 1 node)."""
    clock = Clock()
    c = make_controller(tmp_path, clock, nodes=3)
    c.pool.steps["node3"].code = 1
    c._tick()
    recover(c, "node3")
    c._tick()                                                   # EVICTED
    c._tick()                                                   # switched: the release starts and ends at once
    assert "node3" not in c.fleet.nodes and [r.node for r in c.resizer.recoveries] == ["node3"]
    c.inbox.requests = [(1, {"nodes": 2})]
    c._tick()
    assert c.inbox.replies[1]["message"] == "already on 2 nodes"


class SlurmDown:
    """FakeSlurm's shrink while slurmctld is down: every call fails as an unreachable controller does."""

    def __init__(self, slurm):
        self.slurm, self.down, self.attempts = slurm, True, 0
        self.real = slurm.shrink

    def __call__(self, job_id, keep):
        from slurm_plugin.client import UNREACHABLE
        from slurm_plugin.errors import SlurmError
        self.attempts += 1
        if self.down:
            raise SlurmError(["scontrol", "update"], 1, f"slurm_update error: {UNREACHABLE} (connect failure)")
        return self.real(job_id, keep)


def test_a_give_back_during_a_slurmctld_outage_is_retried_on_later_ticks_and_nothing_waits(tmp_path, monkeypatch,
                                                                                             caplog):
    """#27.2: a Slurm change was retried inside one tick (retry_transient, up to 120 s of sleeps): while slurmctld
    was down the controller handled no failure, request or measurement. Now each attempt is one tick's, backed off."""
    clock = Clock()
    c = make_controller(tmp_path, clock, nodes=3)
    monkeypatch.setattr(resize_module, "wait_until", lambda *a, **k: pytest.fail("a tick waited"))
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("a tick slept"))
    c.slurm.shrink = down = SlurmDown(c.slurm)
    c.pool.steps["node3"].code = 1
    c._tick()
    recover(c, "node3")
    c._tick()                                           # EVICTED
    c._tick()                                           # switched: the release starts, its step ended: GIVE_BACK
    assert down.attempts == 1 and "node3" in c.fleet.nodes and c.phase is JobPhase.RECOVERING
    c.inbox.requests = [(1, {"nodes": 1})]              # an operator request while slurmctld is down: answered
    c.pool.steps["node2"].code = 1                      # and a second node failure: handled
    c._tick()
    assert 1 in c.inbox.replies and [x["node"] for x in c.records.items if x["kind"] == "failure"] == ["node3", "node2"]
    assert down.attempts == 1                           # the next attempt waits for its backoff (1 s), not a tick
    clock.t += 1
    c._tick()
    assert down.attempts == 2 and "attempt 2 failed" in caplog.text and "retrying in 2.0 s" in caplog.text
    down.down = False
    clock.t += 2
    c._tick()
    assert "succeeded at attempt 3" in caplog.text and not c.resizer.releaser.changes
    (shrunk,) = [x for x in c.records.items if x["kind"] == "slurm_shrink"]
    assert shrunk["job"] == "42" and shrunk["nodelist"] == "node1,node2"     # node2's own release comes next
    assert "node3" not in c.fleet.nodes
    assert not [x for x in c.records.items if x["kind"] == "slurm_shrink_failed"]


def node3_given_back_while_slurmctld_is_down(tmp_path, clock):
    """A 3-node job whose node3 failed and was recovered from; its give-back's first attempt failed (slurmctld down)."""
    c = make_controller(tmp_path, clock, nodes=3)
    c.slurm.shrink = down = SlurmDown(c.slurm)
    c.pool.steps["node3"].code = 1
    c._tick()
    recover(c, "node3")
    for _ in range(2):
        c._tick()
    return c, down


def test_a_give_back_still_refused_after_its_retries_leaves_the_node_allocated_and_the_release_ends(tmp_path):
    clock = Clock()
    c, down = node3_given_back_while_slurmctld_is_down(tmp_path, clock)
    for _ in range(40):                                 # 120 s of fake time, a tick every 5 s
        clock.t += 5
        c._tick()
    (failed,) = [x for x in c.records.items if x["kind"] == "slurm_shrink_failed"]
    assert failed["keep"] == ["node1", "node2"] and "Unable to contact" in failed["error"]
    assert 10 <= down.attempts <= 20 and not c.resizer.releaser.changes          # backed off to 10 s, then stopped
    assert "node3" not in c.fleet.nodes and not c.resizer.recovering


def test_at_exit_a_slurm_change_still_in_flight_is_drained_within_its_deadline(tmp_path, monkeypatch):
    from elastic_launcher import controller as controller_module
    clock = Clock()
    c, down = node3_given_back_while_slurmctld_is_down(tmp_path, clock)
    assert c.resizer.releaser.changes and down.attempts == 1
    monkeypatch.setattr(controller_module, "wait_until", lambda predicate, timeout, interval=0.1: predicate())
    real_sleep = clock.sleep

    def sleep(seconds):                                  # slurmctld comes back 5 s into the exit's drain
        real_sleep(seconds)
        down.down = clock.t < 1005
    c.sleep = sleep
    c._cleanup("completed")
    assert not c.resizer.releaser.changes and [x["kind"] for x in c.records.items].count("slurm_shrink") == 1
    assert down.attempts == 4 and clock.t == 1007                  # attempts at 1000, 1001, 1003, 1007
