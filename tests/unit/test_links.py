"""Link labels (elastic_launcher.links): what each backend and host setting makes a collective cross."""
from __future__ import annotations

import pytest

from elastic_launcher.links import HostFacts, Links, links_for, nccl_transports
from slurm_plugin.contracts.records import validate_batch
from elastic_launcher.observations import relabel, step_record

HOST_A = dict(boot_id="aaaa", host="a")
HOST_B = dict(boot_id="bbbb", host="b")


def facts(backend="nccl", host=HOST_A, **kw) -> HostFacts:
    return HostFacts(backend=backend, **host, **kw)


def test_gloo_on_one_host_is_loopback_inside_and_between_pretend_nodes():
    lk = links_for([1, 1, 1], [facts("gloo")] * 3)
    assert (lk.intra, lk.inter) == ("loopback", "loopback")
    assert "same boot id" in lk.source


def test_gloo_between_hosts_is_tcp():
    lk = links_for([1, 1], [facts("gloo", HOST_A), facts("gloo", HOST_B)])
    assert lk.inter == "tcp" and lk.intra == "loopback"


@pytest.mark.parametrize("env,nvlink,want", [
    ({}, True, "nvlink"),
    ({}, False, "pcie"),
    ({"NCCL_P2P_DISABLE": "1"}, True, "shm"),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, True, "tcp"),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket"}, True, "tcp"),
])
def test_nccl_inside_a_node_follows_the_transport_switches_and_nvml(env, nvlink, want):
    lk = links_for([4], [facts(env=env, nvlink=nvlink)])
    assert lk.intra == want and lk.source.startswith("detected")


@pytest.mark.parametrize("env,net,want", [
    ({}, "ib", "ib"), ({}, "roce", "roce"), ({}, None, "tcp"),
    ({"NCCL_IB_DISABLE": "1"}, "ib", "tcp"), ({"NCCL_NET": "Socket"}, "ib", "tcp"),
])
def test_nccl_between_hosts_follows_the_net_plugin_switches_and_the_ib_ports(env, net, want):
    lk = links_for([4, 4], [facts(env=env, net=net, nvlink=True), facts("nccl", HOST_B, env=env,
                                                                          net=net, nvlink=True)])
    assert lk.inter == want and lk.intra == "nvlink"


def test_nccl_nodes_that_are_one_machine_use_the_host_transport_between_them():
    lk = links_for([1, 1], [facts(nvlink=True)] * 2)
    assert lk.inter == "nvlink"


def test_what_nccl_printed_wins_over_the_guess():
    text = ("n1:123:456 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
            "n1:123:456 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/IB/0\n")
    assert nccl_transports(text) == {"shm", "ib"}
    lk = links_for([1, 1], [facts(net=None, nvlink=True, nccl_via=("ib", "shm")),
                            facts("nccl", HOST_B, nccl_via=("ib", "shm"))])
    assert lk.inter == "ib" and lk.intra == "shm"


def test_facts_round_trip_and_a_bad_body_is_refused():
    f = facts(env={"NCCL_P2P_DISABLE": "1"}, nvlink=False, net="ib", nccl_via=("p2p",))
    assert HostFacts.from_json(f.to_json()) == f
    with pytest.raises(ValueError, match="not host facts"):
        HostFacts.from_json('{"backend": "mpi"}')


def test_a_node_not_heard_from_is_named_in_the_source():
    lk = links_for([1, 1, 1], [facts("gloo", HOST_A), facts("gloo", HOST_B)])
    assert "2 of 3 nodes reported" in lk.source
    assert links_for([1], []).source.startswith("default")


def test_probe_on_this_machine_reads_a_boot_id_and_labels_gloo_as_loopback():
    f = HostFacts.probe("gloo")
    assert f.boot_id and f.backend == "gloo" and f.nvlink is None
    assert links_for([1, 1], [f, f]).inter == "loopback"


def test_records_carry_the_labels_and_their_source_and_pass_the_validator():
    lk = links_for([1, 1], [facts("gloo")] * 2)
    step = step_record("tiny", "cpu", [1, 1], lk, 4, 0.1)
    coll = relabel([{"kind": "collective", "op": "allreduce", "link": "nvlink", "world": 2, "bytes": 1024,
                     "seconds": 0.001}], {2: [1, 1]}, {2: lk}, "tiny", "cpu")
    assert validate_batch([step] + coll) == [step] + coll
    assert step["inter_link"] == "loopback" and coll[0]["link"] == "loopback"
    assert coll[0]["link_source"] == step["link_source"] == lk.source
    assert Links().intra == "unknown"


def test_the_launcher_finds_the_hooks_predictor_in_elastic_conf(tmp_path):
    from slurm_plugin.installer import PluginConfig, site_predictor_url
    from datetime import timedelta
    conf = PluginConfig(conf_dir=tmp_path, predictor_url="http://10.0.0.5:8080/", budget=timedelta(seconds=2))
    (tmp_path / "elastic.conf").write_text(conf.conf_text())
    assert site_predictor_url({"SLURM_CONF": str(tmp_path / "slurm.conf")}) == "http://10.0.0.5:8080"
    assert site_predictor_url({"SLURM_CONF": str(tmp_path / "nowhere" / "slurm.conf")}) is None


def test_a_workers_device_type_travels_in_its_host_facts():
    # #26.2: rows carried the directive's GPU type (default unknown) though the worker knows its device
    from elastic_launcher.links import HostFacts, gpu_type_of
    assert gpu_type_of("NVIDIA H100 80GB HBM3") == "H100" and gpu_type_of("NVIDIA A100-SXM4-80GB") == "A100"
    assert gpu_type_of("NVIDIA H200") == "H200" and gpu_type_of("Some GPU") == "Some_GPU"
    facts = HostFacts.probe("gloo", None, gpu_name="NVIDIA H200")
    assert HostFacts.from_json(facts.to_json()).gpu == "H200"
    assert HostFacts.from_json(HostFacts.probe("gloo").to_json()).gpu == "cpu"   # #45.4: a CPU worker says so
