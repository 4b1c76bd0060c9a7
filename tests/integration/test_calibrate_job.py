"""`elastic-predictor calibrate --submit` on the real testbed (issue #38.2): a 2-node sbatch job whose two gloo
ranks sweep the link the launcher detects and time the DDP probes at 1 and 2 ranks, and post the rows signed with
the lab's munge to a service that has stored nothing before; the test reads what the service stored."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from elastic_launcher.calibrate import PROBES
from predictor.app import create_app
from predictor.cluster import Cluster
from predictor.config import Config
from slurm_plugin.lab.demo_follow import ENDED
from slurm_plugin.lab.demo_services import PredictorService
from tests.unit._service_fakes import FakePredictor
from tests.unit.test_calibrate import profile_shape

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def service(testbed, tmp_path):
    """A fresh service over real HTTP, munge-signed job writes checked against the lab's Slurm, the lab's cluster
    model (one CPU worker a node, gpu `cpu`)."""
    config = Config(db_path=str(tmp_path / "calibrate.db"), token="tool", munge_auth=True,
                    munge_socket=str(testbed.config.munge_socket), slurm_conf=str(testbed.config.slurm_conf),
                    cluster=Cluster.from_dict(PredictorService(testbed).cluster()),
                    refit_debounce=timedelta(0), refit_min_interval=timedelta(0))
    app = create_app(config, predictor_factory=FakePredictor, start_refit=False)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield app.extensions["elastic_predictor"].store, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()
    app.extensions["elastic_predictor"].store.close()


def test_calibration_job_posts_sweeps_and_probe_rows_signed_for_itself(testbed, slurm, idle_nodes, wait_until,
                                                                     service, tmp_path):
    store, url = service
    assert sum(store.observation_counts().values()) == 0
    env = {**os.environ, "SLURM_CONF": str(testbed.config.slurm_conf),
           "ELASTIC_MUNGE_SOCKET": str(testbed.config.munge_socket),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("ELASTIC_PREDICTOR_TOKEN", None)      # the job must not need the tool token
    proc = subprocess.run([sys.executable, "-m", "predictor.cli", "calibrate", "--predictor", url, "--nodes", "2",
                           "--gpus-per-node", "1", "--sweep-budget-s", "4", "--rounds", "3", "--window-s", "0.1",
                           "--submit"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = int(proc.stdout.split()[-1])
    try:
        job = wait_until(lambda: (lambda j: j if j.state in ENDED else None)(slurm.job(job_id)), 420,
                         f"calibration job {job_id} to end")
    finally:
        if slurm.job(job_id).state in ("PENDING", "RUNNING"):
            slurm.cancel(job_id)
    log = (tmp_path / f"elastic-calibrate-{job_id}.out").read_text()
    assert job.state == "COMPLETED", log
    assert f"signed for job {job_id}" in log, log

    coll = store.observations(kind="collective")
    probes = store.observations(kind="ddp_overhead")
    written = [json.loads(line) for line in (tmp_path / f"elastic-calibrate-{job_id}.jsonl").read_text().splitlines()]
    assert len(written) == len(coll) + len(probes)
    # every row is the job's, signed by its user (root: uid 0), not a token's
    assert {(r["job_id"], r["uid"], r["gpu"], r["source"]) for r in coll + probes} == {(job_id, 0, "cpu", "calibrate")}

    # the sweep: the link the launcher labels two gloo ranks on the testbed's "nodes" (one host) with
    assert {(r["link"], r["world"], r["nodes"], r["op"]) for r in coll} == {("loopback", 2, 2, "allreduce")}
    sizes = sorted({r["bytes"] for r in coll})
    assert sizes[0] == 4096 and len(sizes) >= 4 and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert all(sum(r["bytes"] == b for r in coll) == 2 for b in sizes)   # two windows a size, from one rank
    assert all(r["seconds"] > 0 for r in coll)
    small = min(r["seconds"] for r in coll if r["bytes"] == sizes[0])
    large = max(r["seconds"] for r in coll if r["bytes"] == sizes[-1])
    assert large > small                    # more bytes took longer over the same link

    # the probes: each at 1 and 2 ranks, with DDP's buckets and tensors of that probe model
    assert sorted((r["probe"], r["world"]) for r in probes) == sorted((p.name, w) for p in PROBES for w in (1, 2))
    for row in probes:
        probe = next(p for p in PROBES if p.name == row["probe"])
        if probe.bucket_cap_mb is None:     # DDP's default cap: as predictor.profiles assigns the buckets
            assert (row["buckets"], row["tensors"], row["bytes"]) == profile_shape(probe), row
        else:                               # a cap below every tensor: a bucket a tensor
            assert row["buckets"] == row["tensors"] == probe.layers, row
        assert -row["plain_s"] <= row["extra_s"] <= row["ddp_s"], row
    # DDP's per-tensor work: the many-small probe's vote in the host fit (the median of its rows, 1 and 2 ranks) is
    # positive per tensor (one row alone is not: on a loaded 2-core host 1 of 9 world-2 rows came out at -2.7 ms)
    many_small = [r["extra_s"] / r["tensors"] for r in probes if r["probe"] == PROBES[0].name]
    assert statistics.median(many_small) > 0, many_small
