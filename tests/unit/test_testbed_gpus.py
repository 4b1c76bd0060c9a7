"""`elastic-slurm testbed up --gpus untyped` (#26.3): the lab's GPUs as plain GRES, remembered for later commands;
`Testbed.reconfigure` waits for nodes that a restarted slurmctld (24.11) has not heard from yet."""
from datetime import timedelta

import pytest
from click.testing import CliRunner

from slurm_plugin.client import Node
from slurm_plugin.errors import TestbedError
from slurm_plugin.lab import cli as lab_cli
from slurm_plugin.lab import testbed_conf
from slurm_plugin.lab.testbed import Testbed


def _run(monkeypatch, args, lab):
    seen = []

    def fake_up(self):
        seen.append(self.config)
        (self.config.lab / "etc").mkdir(parents=True, exist_ok=True)
        (self.config.etc / "gpus").write_text("typed\n" if self.config.gpu_types else "untyped\n")  # as up() does
        return {}
    monkeypatch.setattr(Testbed, "up", fake_up)
    monkeypatch.setattr(Testbed, "status", lambda self: [])
    result = CliRunner().invoke(lab_cli.testbed_group, ["up", "--lab", str(lab), "--port-base", "17000", *args])
    assert result.exit_code == 0, result.output
    return seen[-1], result.output


def test_untyped_lab_has_plain_gres_and_only_the_debug_partition(monkeypatch, tmp_path):
    cfg, out = _run(monkeypatch, ["--gpus", "untyped"], tmp_path / "lab")
    assert cfg.gpu_types == () and "untyped GPUs" in out
    conf = testbed_conf.slurm_conf(cfg, [])
    assert "Gres=gpu:4 " in conf and "gpu:h100" not in conf and "PartitionName=h100" not in conf
    assert all(line.startswith("Name=gpu File=") for line in testbed_conf.gres_conf(cfg).splitlines())


def test_the_lab_keeps_the_gpus_it_was_started_with_until_told_otherwise(monkeypatch, tmp_path):
    lab = tmp_path / "lab"
    assert _run(monkeypatch, [], lab)[0].gpu_types  # typed by default
    _run(monkeypatch, ["--gpus", "untyped"], lab)
    assert testbed_conf.recorded_gpus(lab) == "untyped"
    assert _run(monkeypatch, [], lab)[0].gpu_types == ()  # a later `up` (and status, down, env) reads it
    assert _run(monkeypatch, ["--gpus", "typed"], lab)[0].gpu_types



def test_switching_gpus_on_a_running_lab_is_refused_naming_the_option(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import pytest

    from slurm_plugin.errors import TestbedError
    from slurm_plugin.lab.testbed_conf import TestbedConfig
    lab = tmp_path / "lab"
    (lab / "etc").mkdir(parents=True)
    (lab / "etc" / "gpus").write_text("typed\n")
    bed = Testbed(TestbedConfig(lab=lab, port_base=17000, gpu_types=()))
    monkeypatch.setattr(Testbed, "status", lambda self: [SimpleNamespace(running=True)])
    monkeypatch.setattr(Testbed, "_prepare", lambda self: pytest.fail("must refuse before writing the configs"))
    with pytest.raises(TestbedError, match="running with typed GPUs, not untyped; pass --gpus typed"):
        bed.up()


# -- `Testbed.reconfigure` waits for the nodes a restarted slurmctld has not heard from yet ------------------------
class _Reconfiguring:
    """A client whose nodes read `unknown` for the first `unknown_reads` queries after `reconfigure` (24.11's
    reconfigure restarts slurmctld, which knows its nodes only once their slurmd registers again)."""

    def __init__(self, unknown_reads):
        self.unknown_reads, self.calls = unknown_reads, []

    def reconfigure(self, timeout=None):
        self.calls.append("reconfigure")

    def nodes(self, timeout=None):
        self.calls.append("nodes")
        state = "unknown" if self.calls.count("nodes") <= self.unknown_reads else "idle"
        return [Node(f"node{i}", state, 4, 0, None, ("debug",)) for i in (1, 2)]


def _bed(tmp_path, client, timeout_s=60, dead=()):
    """A lab on `client` whose daemons all run but the slurmd of the nodes in `dead`."""
    bed = Testbed(testbed_conf.TestbedConfig(lab=tmp_path / "lab", port_base=17000,
                                             start_timeout=timedelta(seconds=timeout_s)))
    bed.client = client
    bed._pid = lambda d: None if d.name.removeprefix("slurmd-") in dead else 1
    return bed


def test_reconfigure_returns_once_no_node_reads_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr("slurm_plugin.lab.testbed.time.sleep", lambda s: None)
    client = _Reconfiguring(unknown_reads=3)
    _bed(tmp_path, client).reconfigure()
    assert client.calls == ["reconfigure", "nodes", "nodes", "nodes", "nodes"]


def test_reconfigure_names_the_nodes_still_unknown_at_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr("slurm_plugin.lab.testbed.time.sleep", lambda s: None)
    with pytest.raises(TestbedError, match=r"nodes not registered 0 s after scontrol reconfigure: node1, node2"):
        _bed(tmp_path, _Reconfiguring(unknown_reads=10**6), timeout_s=0).reconfigure()


def test_a_node_whose_slurmd_is_down_is_not_waited_for(tmp_path, monkeypatch):
    # a fault test restarts slurmctld while it has killed a node's slurmd: that node stays unknown, the rest register
    monkeypatch.setattr("slurm_plugin.lab.testbed.time.sleep", lambda s: None)
    client = _Reconfiguring(unknown_reads=10**6)
    client.nodes = lambda timeout=None: [Node("node1", "idle", 4, 0, None, ()), Node("node2", "unknown", 4, 0, None, ())]
    _bed(tmp_path, client, dead=("node2",)).reconfigure()
    with pytest.raises(TestbedError, match=r": node2$"):
        _bed(tmp_path, client, timeout_s=0).reconfigure()
