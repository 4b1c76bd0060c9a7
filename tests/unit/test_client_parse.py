"""slurm_plugin.client on output captured from the 22.05.8 testbed (tests/unit/fixtures/slurm/); no Slurm runs.

Fixtures: squeue_running.json (job 1: `sbatch -N2 --gres=gpu:4`, running on node[1-2]); squeue_3node.json
(job 2: `-N3 --ntasks-per-node=2 --gres=gpu:2`); squeue_shrunk.json (job 2 after `NumNodes=2`, job 1
cancelled); sinfo_busy.json (while job 1 ran); sacct_2.json (job 2 after one shrink); topology.txt,
partitions.txt (`scontrol show topology`, `scontrol show partition -o`). From the 24.11.5 testbed (the same
parsers read both): squeue_24.11_running.json (job 1: `-N3 --gres=gpu:4`, one step a node), nodes_24.11_busy.json
(`scontrol --json show nodes` then), sacct_24.11_resized.json (job 1 after shrinks to node[1-2] and node1).
The same moment on every backend (job 1 `-N2 -w node1,node2 --gres=gpu:4` running, node2 and node4 drained; then job
2, `trap '' TERM; sleep 60` on node3, scancelled and still being ended within KillWait): sinfo_22.05_drained.json and
squeue_22.05_completing.json (22.05); nodes_24.11_drained.json, squeue_24.11_drained.json and
squeue_24.11_completing.json (24.11's commands); pyslurm_24.11_drained.json and pyslurm_24.11_completing.json (what
pyslurm 24.11 gave for the fields PyslurmBackend reads, written inside the root by
bench/results/slurm_versions/pyslurm_dump.py).
"""
import json
import re
import subprocess
import sys
import types
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_plugin.client import (
    CommandBackend,
    PyslurmBackend,
    compress_counts,
    compress_hostlist,
    expand_hostlist,
    parse_jobs,
    parse_nodes,
    parse_partitions,
    parse_sacct,
    parse_topology,
    parse_version,
)
from slurm_plugin.contracts.tres import gpus_in_tres, job_desc_number, requested_shape
from slurm_plugin.errors import JobNotFoundError, ResizeError, SlurmError

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"


def _json(name):
    return json.loads((FIXTURES / name).read_text())


def _text(name):
    return (FIXTURES / name).read_text()


def _job(fixture, job_id):
    return next(j for j in parse_jobs(_json(fixture)) if j.job_id == job_id)


def test_topology_maps_each_node_to_its_leaf_not_the_spine():
    assert parse_topology(_text("topology.txt")) == {
        "node1": "leaf1", "node2": "leaf1", "node3": "leaf2", "node4": "leaf2"}


def test_nodes_have_four_gpus_and_the_running_job_uses_node1_and_node2():
    nodes = {n.name: n for n in parse_nodes(_json("sinfo_busy.json"), parse_topology(_text("topology.txt")))}
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    assert {n.gpus for n in nodes.values()} == {4}
    assert [nodes[n].gpus_alloc for n in sorted(nodes)] == [4, 4, 0, 0]
    assert nodes["node1"].state == "mixed" and nodes["node4"].state == "idle"
    assert nodes["node3"].switch == "leaf2" and nodes["node2"].partitions == ("debug",)


def test_partitions_from_scontrol_text():
    (part,) = parse_partitions(_text("partitions.txt"))
    assert (part.name, part.default, part.state) == ("debug", True, "UP")
    assert part.nodes == ("node1", "node2", "node3", "node4")


def test_running_two_node_gpu_job():
    job = _job("squeue_running.json", 1)
    assert (job.state, job.nodes, job.batch_host, job.comment) == ("RUNNING", ("node1", "node2"), "node1", "hello")
    assert job.gpus_per_node == (4, 4) and job.tres_per_node == "gres:gpu:4"
    assert job.cpus_per_node == (1, 1)
    assert job.end_time == 1827210468   # when its time limit ends it (restart mode prices the time left)


def test_resize_env_after_shrink_counts_cpus_per_node():
    before, after = _job("squeue_3node.json", 2), _job("squeue_shrunk.json", 2)
    assert before.resize_env()["SLURM_JOB_CPUS_PER_NODE"] == "2(x3)"
    assert after.resize_env() == {
        "SLURM_NODELIST": "node[1-2]", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}


def test_cancelled_job_has_no_per_node_gres():
    job = _job("squeue_shrunk.json", 1)
    assert job.state == "CANCELLED" and job.gpus_per_node == ()


def test_sacct_keeps_one_record_per_size_and_filters_other_jobs():
    records = parse_sacct(_json("sacct_2.json"), 2)
    assert [(r.state, r.nodelist, r.gpus) for r in records] == [("RESIZING", "node[1-3]", 6), ("RUNNING", "node[1-2]", 4)]
    assert parse_sacct(_json("sacct_2.json"), 1) == []


@pytest.mark.parametrize("expr, names", [
    ("node[1-2,4]", ["node1", "node2", "node4"]),
    ("node3", ["node3"]),
    ("gpu[08-10],login", ["gpu08", "gpu09", "gpu10", "login"]),
])
def test_hostlist_expand_and_compress(expr, names):
    assert expand_hostlist(expr) == names
    assert sorted(expand_hostlist(compress_hostlist(names))) == sorted(names)


@given(st.sets(st.integers(min_value=0, max_value=60), min_size=1))
def test_compress_hostlist_round_trips(nums):
    names = [f"node{i}" for i in nums]
    assert sorted(expand_hostlist(compress_hostlist(names))) == sorted(names)


def test_compress_counts():
    assert compress_counts([8, 8, 4]) == "8(x2),4"
    assert compress_counts([2]) == "2"


class FixtureBackend(CommandBackend):
    """The real backend with `_run` answering from fixtures and recording updates."""

    def __init__(self, squeue_fixture):
        super().__init__(slurm_conf=Path("/nonexistent/slurm.conf"))
        self.squeue = _text(squeue_fixture)
        self.calls = []

    def _run(self, argv, timeout, stdin=None):
        self.calls.append(list(argv))
        out = self.squeue if argv[:2] == ["squeue", "--json"] else ""
        return subprocess.CompletedProcess(argv, 0, out, "")


def test_shrink_validates_before_touching_slurm():
    backend = FixtureBackend("squeue_3node.json")
    with pytest.raises(ResizeError, match="job 2: .*asked for 4 nodes but it has 3"):
        backend.shrink(2, 4)
    with pytest.raises(ResizeError, match="job 2: .*drop its batch host node1"):
        backend.shrink(2, ["node[2-3]"])
    with pytest.raises(ResizeError, match="job 2: .*node4 not in its allocation"):
        backend.shrink(2, ["node1", "node4"])
    with pytest.raises(JobNotFoundError, match="job 999"):
        backend.shrink(999, 1)
    assert not [c for c in backend.calls if c[0] == "scontrol"]


def test_shrink_by_count_keeps_batch_host_and_names_nodes():
    backend = FixtureBackend("squeue_3node.json")
    backend.shrink(2, 2)
    assert ["scontrol", "update", "JobId=2", "NodeList=node[1-2]"] in backend.calls


def test_shrink_accepts_a_slurm_node_list_string():
    backend = FixtureBackend("squeue_3node.json")
    backend.shrink(2, "node[1,3]")
    assert ["scontrol", "update", "JobId=2", "NodeList=node[1,3]"] in backend.calls


def test_shrink_refuses_finished_job():
    with pytest.raises(ResizeError, match="job 1: .*CANCELLED"):
        FixtureBackend("squeue_shrunk.json").shrink(1, 1)


def test_run_timeout_raises_slurm_error():
    backend = CommandBackend(timeout=timedelta(seconds=0.2))
    with pytest.raises(SlurmError, match="timed out after 0.2 s") as info:
        backend._run(["sleep", "5"], timedelta(seconds=0.2))
    assert info.value.rc is None


def test_a_missing_slurm_conf_is_named_and_no_command_runs(tmp_path):
    # Slurm without its config looks for one over DNS until the timeout: the client says so at once instead
    marker = tmp_path / "ran"
    backend = CommandBackend(slurm_conf=tmp_path / "slurm.conf", timeout=timedelta(seconds=60))
    with pytest.raises(SlurmError, match=f"SLURM_CONF {tmp_path / 'slurm.conf'} is not a file"):
        backend._run(["sh", "-c", f"touch {marker}"], timedelta(seconds=60))
    assert not marker.exists()
    (tmp_path / "slurm.conf").write_text("")
    backend._run(["sh", "-c", f"touch {marker}"], timedelta(seconds=60))
    assert marker.exists()


def test_run_nonzero_exit_carries_stderr():
    with pytest.raises(SlurmError) as info:
        CommandBackend()._run(["sh", "-c", "echo boom >&2; exit 3"], timedelta(seconds=5))
    assert info.value.rc == 3 and "boom" in str(info.value)


@pytest.mark.parametrize("spec,problem", [("n[1-2],n2", "names a node twice"), ("n[3-1]", "bad range"),
                                          ("n[1-x]", "not a host name"), ("a b", "not a host name")])
def test_one_hostlist_parser_refuses_the_same_lists_everywhere(spec, problem):
    # #15: the client's copy gave n1,n2,n2 for n[1-2],n2 where the predictor's refused it
    from predictor.cluster import expand_hostlist as cluster_expand
    from predictor.errors import ValidationError
    from slurm_plugin.hostlist import HostlistError
    with pytest.raises(HostlistError, match=problem):
        expand_hostlist(spec)
    with pytest.raises(ValidationError, match=problem):
        cluster_expand(spec, "partitions[0].nodes")
    assert expand_hostlist("gpu[08-10],login") == ["gpu08", "gpu09", "gpu10", "login"]


@pytest.mark.parametrize("tres,count", [("gres:gpu:4", 4), ("gres/gpu:a100:2", 2), ("gpu:8", 8), ("gres/gpu=4", 4),
                                        ("gpu:tesla:2(IDX:0,2)", 2), ("gpu:4(S:0),gpu:a100:2", 6),
                                        ("gres:shard:2", None), ("", None), (None, None),
                                        ("gres:gpu:2,gres:shard:1", 2), ("gres:gpus:2", None)])
def test_gpus_in_tres(tres, count):
    """The one reading of GPU counts in TRES/GRES strings: the hook's job_desc, sinfo's gres and gres_used."""
    assert gpus_in_tres(tres) == count


@pytest.mark.parametrize("key,value,read", [("min_nodes", 4294967294, None), ("min_nodes", 4294967295, None),
                                            ("min_nodes", 0, None), ("min_nodes", 3, 3), ("time_limit_min", 0, 0),
                                            ("ntasks_per_node", 65534, None), ("ntasks_per_node", 65535, None),
                                            ("job_id", 65534, 65534)])
def test_job_desc_sentinels_read_as_unset(key, value, read):
    assert job_desc_number(key, value) == read


def test_requested_shape():
    assert requested_shape({"min_nodes": 2, "tres_per_node": "gres:gpu:4"}) == (2, 4, 8)
    assert requested_shape({"tres_per_job": "gres:gpu:6"}) == (None, None, 6)
    assert requested_shape({}) == (None, None, None)


@pytest.mark.parametrize("backend", ["CommandBackend", "PyslurmBackend"])
def test_each_backend_implements_the_backend_protocol(backend):
    """Every method the protocol declares exists on each backend with the same parameters, and the
    protocol declares every public method (so callers typed as `Backend` can use what the client offers)."""
    import inspect

    from slurm_plugin import client
    from slurm_plugin.client import Backend

    cls = getattr(client, backend)
    declared = {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}
    offered = {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    assert declared == offered
    for name in declared:
        assert list(inspect.signature(getattr(Backend, name)).parameters) == \
            list(inspect.signature(getattr(cls, name)).parameters), name


def test_the_launcher_calls_only_what_backend_declares():
    """The launcher holds its Slurm client as `self.slurm` / `slurm`: each method it calls is in the protocol."""
    import ast

    from slurm_plugin.client import Backend

    called = set()
    for path in (Path(__file__).resolve().parents[2] / "elastic_launcher").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
                if name == "slurm":
                    called.add(node.func.attr)
    assert called and called <= set(vars(Backend)), called - set(vars(Backend))


# -- the Slurm release (`Backend.version`) --------------------------------------------------------------------------
@pytest.mark.parametrize("out, version", [
    ("slurm-wlm 22.05.8\n", (22, 5, 8)),      # Debian 12's package (the 22.05 testbed)
    ("slurm-wlm 24.11.5\n", (24, 11, 5)),     # Debian 13's (the 24.11 root)
    ("slurm 24.11.5\n", (24, 11, 5)),         # upstream's build
    ("slurm 24.05.0-0rc1\n", (24, 5, 0)),     # a release candidate
])
def test_scontrol_version_is_read_as_numbers_through_the_command_seam(out, version):
    calls = []

    class Scontrol(CommandBackend):
        def _run(self, argv, timeout, stdin=None):
            calls.append((list(argv), timeout))
            return subprocess.CompletedProcess(argv, 0, out, "")

    assert Scontrol(timeout=timedelta(seconds=3)).version() == version
    assert calls == [(["scontrol", "--version"], timedelta(seconds=3))]


@pytest.mark.parametrize("out", ["", "scontrol: error: Could not establish a configuration source\n",
                                 "slurm 24.11\n", "slurm-wlm 22.05.8 extra words\n", "munge 0.5.15\n"])
def test_a_scontrol_version_that_is_no_version_is_an_error_quoting_it(out):
    class Scontrol(CommandBackend):
        def _run(self, argv, timeout, stdin=None):
            return subprocess.CompletedProcess(argv, 0, out, "")

    assert parse_version(out) is None
    with pytest.raises(SlurmError, match=r"scontrol --version \(rc=0\): no Slurm version in its output " + re.escape(
            repr(out))):
        Scontrol().version()


def test_a_failing_scontrol_version_raises_the_commands_error():
    # no scontrol at all (PATH without it): the seam's "cannot run", not a version
    with pytest.raises(SlurmError, match=r"scontrol --version \(rc=None\): cannot run"):
        CommandBackend(env={"PATH": "/nonexistent"}).version()


def test_pyslurm_gives_the_slurm_release_it_was_built_against_not_its_own_patch_level(monkeypatch):
    # pyslurm 24.11.0 built on Slurm 24.11.5 (the root): __version__'s last number is pyslurm's patch level
    fake = types.SimpleNamespace(__version__="24.11.0", slurm_api_version=lambda: (24, 11, 5), RPCError=RuntimeError)
    monkeypatch.setitem(sys.modules, "pyslurm", fake)
    monkeypatch.delenv("SLURM_CONF", raising=False)
    assert PyslurmBackend().version() == (24, 11, 5)


# -- Slurm 24.11's JSON (docs/slurm-versions.md) ---------------------------------------------------------------
def test_24_11_squeue_job_reads_as_on_22_05():
    job = _job("squeue_24.11_running.json", 1)
    assert (job.state, job.nodes, job.nodelist, job.batch_host) == ("RUNNING", ("node1", "node2", "node3"),
                                                                    "node[1-3]", "node1")
    assert job.cpus_per_node == (1, 1, 1) and job.gpus_per_node == (4, 4, 4) and job.node_count == 3
    assert job.end_time == 1827733663
    assert job.tres_per_node == "gres/gpu:4" and gpus_in_tres(job.tres_per_node) == 4
    assert job.resize_env()["SLURM_JOB_CPUS_PER_NODE"] == "1(x3)"


def test_24_11_nodes_states_are_lists_joined_and_gres_read():
    nodes = {n.name: n for n in parse_nodes(_json("nodes_24.11_busy.json"), parse_topology(_text("topology.txt")))}
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    assert [(nodes[n].state, nodes[n].gpus, nodes[n].gpus_alloc) for n in sorted(nodes)] == [
        ("mixed", 4, 4), ("mixed", 4, 4), ("mixed", 4, 4), ("idle", 4, 0)]
    assert nodes["node3"].gpu_type == "a100" and nodes["node3"].switch == "leaf2"


def test_24_11_former_sizes_in_sacct_read_as_resizing():
    records = parse_sacct(_json("sacct_24.11_resized.json"), 1)
    assert [(r.state, r.nodelist, r.gpus) for r in records] == [
        ("RESIZING", "node[1-3]", 12), ("RESIZING", "node[1-2]", 8), ("RUNNING", "node1", 4)]


def test_a_jobs_time_limit_reads_in_seconds_on_both_versions():
    # as the lab's squeue printed them: 22.05 `--time=7` -> 7 (minutes), unset -> null; 24.11 `--time=1` -> the
    # struct below, unset (the fixture) -> {"set": false, "infinite": true}
    assert _job("squeue_running.json", 1).time_limit_s == 0
    assert _job("squeue_24.11_running.json", 1).time_limit_s == 0
    raw = _json("squeue_running.json")
    for limit, seconds in ((7, 420), ({"set": True, "infinite": False, "number": 1}, 60),
                           ({"set": True, "infinite": True, "number": 0}, 0), (4294967295, 0)):
        raw["jobs"][0]["time_limit"] = limit
        assert parse_jobs(raw)[0].time_limit_s == seconds, limit


# -- the same states from every backend (docs/slurm-versions.md) ---------------------------------------------------
class RecordedCommands(CommandBackend):
    """The real command backend answering from fixtures: `sinfo --json` (22.05's, or 24.11's without a `nodes`
    list, then `scontrol --json show nodes`), `squeue --json`, `scontrol show topology`."""

    def __init__(self, squeue, nodes, sinfo=None):
        super().__init__(slurm_conf=Path("/nonexistent/slurm.conf"))
        self.answers = {("squeue", "--json"): _text(squeue), ("scontrol", "--json"): _text(nodes),
                        ("sinfo", "--json"): _text(sinfo) if sinfo else json.dumps({"sinfo": []}),
                        ("scontrol", "show"): _text("topology.txt")}

    def _run(self, argv, timeout, stdin=None):
        return subprocess.CompletedProcess(argv, 0, self.answers[tuple(argv[:2])], "")


def _pyslurm_backend(monkeypatch, dump):
    """The real `PyslurmBackend` over a stand-in `pyslurm` module that answers `Nodes.load` and `Jobs.load` with what
    pyslurm 24.11 gave in the root (`dump`); its topology (a command) from topology.txt."""
    recorded = _json(dump)
    nodes = {n["name"]: types.SimpleNamespace(**n) for n in recorded["nodes"]}
    jobs = {j["id"]: types.SimpleNamespace(**j, get_resource_layout_per_node=lambda j=j: j["resource_layout_per_node"])
            for j in recorded["jobs"]}
    fake = types.SimpleNamespace(Nodes=types.SimpleNamespace(load=lambda: nodes),
                                 Jobs=types.SimpleNamespace(load=lambda: jobs), RPCError=RuntimeError)
    monkeypatch.setitem(sys.modules, "pyslurm", fake)
    monkeypatch.delenv("SLURM_CONF", raising=False)
    backend = PyslurmBackend()
    monkeypatch.setattr(backend.commands, "_run",
                        lambda argv, timeout, stdin=None: subprocess.CompletedProcess(argv, 0, _text("topology.txt"), ""))
    return backend


def test_a_drained_node_reads_the_same_on_every_backend_and_is_not_idle(monkeypatch):
    # 22.05's JSON calls a drained node `idle` and puts DRAIN in `state_flags`; 24.11's says ["IDLE", "DRAIN"]; pyslurm
    # `IDLE+DRAIN`. The launcher takes a plain `idle` node for a grow, so each must read `idle+drain`.
    backends = {"22.05": RecordedCommands("squeue_22.05_completing.json", "sinfo_22.05_drained.json",
                                          sinfo="sinfo_22.05_drained.json"),
                "24.11": RecordedCommands("squeue_24.11_drained.json", "nodes_24.11_drained.json"),
                "pyslurm 24.11": _pyslurm_backend(monkeypatch, "pyslurm_24.11_drained.json")}
    for name, backend in backends.items():
        assert [(n.name, n.state) for n in backend.nodes()] == [
            ("node1", "mixed"), ("node2", "mixed+drain"), ("node3", "idle"), ("node4", "idle+drain")], name


@pytest.mark.parametrize("moment", ["drained", "completing"])
def test_pyslurm_reads_every_field_as_the_commands_did_at_the_same_moment(monkeypatch, moment):
    commands = RecordedCommands(f"squeue_24.11_{moment}.json", "nodes_24.11_drained.json")
    pyslurm = _pyslurm_backend(monkeypatch, f"pyslurm_24.11_{moment}.json")
    assert pyslurm.jobs() == commands.jobs()
    if moment == "drained":
        assert pyslurm.nodes() == commands.nodes()


def test_a_job_still_being_ended_reads_completing_on_every_backend(monkeypatch):
    # job 2 was scancelled and ignores SIGTERM (ended at KillWait): 22.05's JSON and pyslurm say COMPLETING (libslurm's
    # job_state_string), 24.11's JSON ["CANCELLED", "COMPLETING"]. A job read as ended here would be taken for gone
    # while its processes still write (the template time-limit tests' SIGTERM checkpoint).
    assert _job("squeue_22.05_completing.json", 2).state == "COMPLETING"
    assert _job("squeue_24.11_completing.json", 2).state == "COMPLETING"
    assert next(j for j in _pyslurm_backend(monkeypatch, "pyslurm_24.11_completing.json").jobs()
                if j.job_id == 2).state == "COMPLETING"


@pytest.mark.parametrize("listed, state", [
    (["TIMEOUT", "COMPLETING"], "COMPLETING"), (["RUNNING"], "RUNNING"), (["TIMEOUT"], "TIMEOUT"),
    (["COMPLETED", "COMPLETING"], "COMPLETING"), (["RUNNING", "CONFIGURING"], "CONFIGURING"),
    (["PENDING", "RESIZING"], "RESIZING"), (["PENDING", "REQUEUED"], "REQUEUED"),
    (["CANCELLED", "COMPLETING", "STAGE_OUT"], "COMPLETING"), (["RUNNING", "CONFIGURING", "SIGNALING"], "CONFIGURING"),
    (["RUNNING", "UPDATE_DB"], "RUNNING")])
def test_a_24_11_state_list_reads_as_libslurm_names_the_state(listed, state):
    # 22.05's JSON and pyslurm give libslurm's job_state_string: the first of its flags set, else the base state
    raw = _json("squeue_24.11_running.json")
    raw["jobs"][0]["job_state"] = listed
    assert parse_jobs(raw)[0].state == state
