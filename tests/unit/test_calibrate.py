"""The calibration job's parts on CPU (elastic_launcher/calibrate.py, issue #38.2): the probes' rows at world 1 on
gloo (DDP's real buckets and tensors, the paired arithmetic), the sweep pairs, the job script and its CLI."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from elastic_launcher import calibrate
from elastic_launcher.calibrate import PROBES, Probe, hooked_shape, measure_probe, pairs
from predictor.profiles import profile_from_module
from predictor.cli import main as cli
from predictor.stepmodel import host_cost_from_probes
from slurm_plugin.calibration import job_script
from slurm_plugin.contracts.records import validate_record


@pytest.fixture
def solo(tmp_path):
    """A gloo process group of one rank in this process (the world-1 group the job gives rank 0)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    yield dist.new_group([0])
    dist.destroy_process_group()


def profile_shape(probe: Probe) -> tuple[int, int, int]:
    """(buckets, tensors, bytes) of the probe as `predictor.profiles.bucket_sizes` assigns them (DDP's default cap;
    with a cap of its own DDP has no 1 MiB first bucket, which bucket_sizes always assumes)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(probe.width, probe.width, bias=False)
                                      for _ in range(probe.layers)])
    profile = profile_from_module(model, probe.name, bucket_cap_mb=probe.bucket_cap_mb or 25.0)
    return len(profile.buckets_bytes), len(profile.tensors), sum(profile.buckets_bytes)


@pytest.mark.slow  # DDP and plain steps of the four probes (~7 s on a busy host)
def test_probe_rows_at_world_1_carry_ddps_real_buckets_and_valid_timings(solo):
    rows = [measure_probe(p, torch.device("cpu"), solo, 1, rounds=1, window_s=0.001, warmup=1) for p in PROBES]
    for probe, row in zip(PROBES, rows):
        shape = (row["buckets"], row["tensors"], row["bytes"])   # read off DDP's reducer
        assert shape == hooked_shape(probe, torch.device("cpu"), solo), probe.name   # counted by a comm hook
        if probe.bucket_cap_mb is None:      # DDP's default cap: predictor.profiles assigns the same buckets
            assert shape == profile_shape(probe), probe.name
        assert row["world"] == 1 and row["probe"] == probe.name
        assert validate_record(dict(row, gpu="cpu"), "row")["extra_s"] == row["extra_s"]
    shapes = {(r["buckets"], r["tensors"], r["bytes"]) for r in rows}
    assert len(shapes) == len(PROBES) == 4   # four distinct shapes: per step, bucket, tensor and byte
    many_small = rows[0]
    assert many_small["tensors"] >= 100 * rows[1]["tensors"]


def test_the_hook_count_stands_in_where_the_reducer_does_not_say(solo, monkeypatch):
    # a torch whose reducer has no `_get_zeros_like_grad_buckets`: the row's shape comes from the hook's count
    monkeypatch.setattr(calibrate, "ddp_shape", lambda _model: None)
    row = measure_probe(Probe("cap", 6, 128, bucket_cap_mb=0.01), torch.device("cpu"), solo, 1, rounds=1,
                        window_s=0.001, warmup=1)
    assert (row["buckets"], row["tensors"], row["bytes"]) == (6, 6, 6 * 128 * 128 * 4)   # a bucket a tensor


def test_extra_s_is_the_median_over_rounds_of_ddp_minus_plain(solo, monkeypatch):
    # scripted windows, plain then DDP in each round: the paired median (2 ms) is not the medians' difference
    # (31 - 10 = 21 ms): a drift in round 2 hits both of its windows and cancels
    script = iter([0.010, 0.012, 0.010, 0.040, 0.030, 0.031])
    monkeypatch.setattr(calibrate, "windows", lambda *a, **k: [next(script)])
    row = measure_probe(Probe("tiny", 3, 8), torch.device("cpu"), solo, 1, rounds=3, window_s=0.001, warmup=1)
    assert row["plain_s"] == pytest.approx(0.010) and row["ddp_s"] == pytest.approx(0.031)
    assert row["extra_s"] == pytest.approx(0.002)
    assert (row["buckets"], row["tensors"], row["bytes"]) == (1, 3, 3 * 8 * 8 * 4)


def test_host_cost_fit_recovers_constants_from_rows_of_the_probe_shapes():
    # the probes' shapes pin the constants: world-1 rows made from known constants, with a per-byte copy cost the
    # fit keeps apart, give them back; the world-2 rows (all-reduces exposed) do not move them
    shapes = [(2, 400, 1.6e6), (3, 4, 64e6), (2, 4, 16e6), (40, 40, 10e6)]
    c = (2e-3, 5e-5, 4e-6, 1.5e-9)
    rows = [{"gpu": "cpu", "world": 1, "buckets": b, "tensors": t, "bytes": n,
             "extra_s": c[0] + c[1] * b + c[2] * t + c[3] * n} for b, t, n in shapes]
    rows += [dict(r, world=2, extra_s=r["extra_s"] + 0.3) for r in rows]
    cost = host_cost_from_probes(rows)["cpu"]
    assert (cost.c_step, cost.c_bucket, cost.c_tensor) == pytest.approx(c[:3], rel=1e-6)
    assert cost.basis == "calibrated"


@pytest.mark.parametrize("nodes,expected", [
    ([0], []),
    ([0, 0], [("intra", (0, 1))]),
    ([0, 1], [("inter", (0, 1))]),
    ([0, 0, 1, 1], [("intra", (0, 1)), ("inter", (0, 2))]),
    ([0, 1, 1], [("intra", (1, 2)), ("inter", (0, 1))]),
])
def test_sweep_pairs_per_link(nodes, expected):
    assert pairs(nodes) == expected


def test_job_script_is_valid_bash_and_runs_every_rank_under_srun(tmp_path):
    script = job_script("http://svc:8470", 2, 2, 2, python="/opt/py/bin/python", partition="h200",
                        extra_sbatch=["--account=ops"])
    lines = script.splitlines()
    assert {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
            "#SBATCH --partition=h200", "#SBATCH --account=ops"} <= set(lines)
    srun = [line for line in lines if line.startswith("srun ")]
    assert len(srun) == 1 and "-m elastic_launcher.calibrate" in srun[0] and "--predictor http://svc:8470" in srun[0]
    assert '--out "elastic-calibrate-${SLURM_JOB_ID}.jsonl"' in srun[0]
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    cpu = job_script("http://svc:8470", 1, 2, 0)
    assert "--gpus-per-node" not in cpu and "--device cpu" in cpu


def test_cli_prints_and_writes_the_script(tmp_path):
    runner = CliRunner()
    printed = runner.invoke(cli, ["calibrate", "--predictor", "http://svc:8470", "--nodes", "2",
                                  "--gpus-per-node", "0"])
    assert printed.exit_code == 0, printed.output
    assert "#SBATCH --nodes=2" in printed.output and "#SBATCH --ntasks-per-node=1" in printed.output
    out = tmp_path / "cal.sbatch"
    wrote = runner.invoke(cli, ["calibrate", "--predictor", "http://svc:8470", "--out", str(out)])
    assert wrote.exit_code == 0 and Path(out).read_text().startswith("#!/bin/bash")
    missing = runner.invoke(cli, ["calibrate"])
    assert missing.exit_code == 2 and "--predictor" in missing.output
