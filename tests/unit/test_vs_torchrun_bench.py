"""bench/vs_torchrun.py: the rate it reads from the scripts' progress lines, and the JPEG folder it writes."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import vs_torchrun  # noqa: E402


def test_rate_is_total_samples_over_total_time_after_the_warm_windows():
    out = "\n".join(f"step {20 * (i + 1)}/120  workers 2  global batch 128  loss 6.9  {r} samples/s"
                    for i, r in enumerate([50.0, 900.0, 1000.0, 500.0]))
    rate, n = vs_torchrun.harmonic_rate("noise\n" + out, skip=2)
    assert n == 2 and rate == pytest.approx(2 / (1 / 1000 + 1 / 500))  # equal samples a window
    with pytest.raises(RuntimeError, match="no progress windows after the first 4"):
        vs_torchrun.harmonic_rate(out, skip=4)


def test_the_jpeg_folder_reaches_its_size_with_links_that_keep_their_class(tmp_path):
    vs_torchrun.write_jpegs(tmp_path, n=20, classes=4, total=50)
    files = sorted(tmp_path.rglob("*.jpg"))
    assert len(files) == 50 and len({f.stat().st_ino for f in files}) == 20
    for f in files:
        src = int(f.stem) % 20
        assert f.parent.name == f"c{src % 4}" and os.path.samefile(f, f.parent / f"{src}.jpg")


def test_the_plain_script_runs_one_intra_op_thread_as_the_template_unless_told(monkeypatch):
    # torchrun sets OMP_NUM_THREADS=1 only for 2+ processes a node; at 1 GPU the plain side had one thread per CPU
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert vs_torchrun.plain_env(1)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in vs_torchrun.plain_env(None)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert vs_torchrun.plain_env(None)["OMP_NUM_THREADS"] == "4" and vs_torchrun.plain_env(2)["OMP_NUM_THREADS"] == "2"
