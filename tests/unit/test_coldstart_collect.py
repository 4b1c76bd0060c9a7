"""bench/coldstart_collect.py on CPU (gloo, 2 processes): each multi-GPU step record carries the model's 1-GPU step
measured in the same launch, in rounds interleaved with the W-GPU and no_sync() windows; the old fields stay."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_process_launch_records_in_launch_one_gpu_step(tmp_path):
    out = tmp_path / "w2.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    str(ROOT / "bench" / "coldstart_collect.py"), "--device", "cpu", "--models", "tiny",
                    "--window-s", "0.02", "--windows", "2", "--sweep-budget-s", "0.5", "--no-sync-windows", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, timeout=240, capture_output=True)
    steps = [r for r in map(json.loads, out.read_text().splitlines()) if r["kind"] == "step"]
    assert {r["per_gpu_batch"] for r in steps} == {8, 16}
    for r in steps:
        assert r["layout"] == [2] and r["profile"] == "tiny"
        for k in ("iter_s", "windows", "local_s"):  # the record format bench/coldstart.py reads is kept
            assert k in r
        assert r["rounds"] == 2
        assert len(r["windows"]) == len(r["solo_windows"]) == len(r["local_windows"]) == len(r["round_t"]) == 2
        assert all(w > 0 for w in r["solo_windows"]) and r["solo_s"] > 0
        assert r["round_t"] == sorted(r["round_t"]) and r["round_t"][0] >= 0
        assert min(r["solo_windows"]) <= r["solo_s"] <= max(r["solo_windows"])
