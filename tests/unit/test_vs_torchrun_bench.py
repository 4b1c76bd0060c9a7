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


def test_the_diagnostic_arm_turns_off_ddps_buffer_broadcast_and_the_baseline_keeps_ddps_default(monkeypatch):
    cmds = []

    def fake_run(cmd, **kw):
        cmds.append(cmd)
        return vs_torchrun.subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
    monkeypatch.setattr(vs_torchrun.subprocess, "run", fake_run)
    vs_torchrun.run_plain("resnet50", "synthetic", 1, "bf16", 8, Path("unused"), arm="A")
    vs_torchrun.run_plain("resnet50", "synthetic", 1, "bf16", 8, Path("unused"), arm="A-nobcast")
    assert "--broadcast-buffers" not in cmds[0]  # the user's script as written: DDP's default
    assert cmds[1][cmds[1].index("--broadcast-buffers") + 1] == "off"
    # the plain script takes the option (its parser refuses an unknown one)
    script = (ROOT / "bench" / "torchrun_plain.py").read_text()
    assert '"--broadcast-buffers", choices=("on", "off"), default="on"' in script


def test_the_table_gives_b_over_the_first_arm_per_round_and_over_each_further_arm():
    rows = [("jpeg", "fp32", 1, 8, {"A": [1000.0, 1100.0], "A-nobcast": [1050.0, 1100.0], "B": [1200.0, 1100.0]},
             [1.2, 1.0])]
    head, rule, row = vs_torchrun.table(rows, ["A", "A-nobcast"]).splitlines()
    assert "A-nobcast, samples/s" in head and head.endswith("B/A-nobcast (median) |")
    assert rule.count("|---") == head.count("|") - 1
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4:7] == ["1000, 1100", "1050, 1100", "1200, 1100"] and cells[8] == "**1.100**"
    assert float(cells[9]) == pytest.approx((1200 / 1050 + 1.0) / 2, abs=5e-4)


def test_image_rows_are_read_against_the_faster_way_to_train_on_batches_already_on_the_gpu():
    # the GPU-bound rate is the faster of the synthetic row's C and B (medians): here B's (CUDA graphs), not C's
    rows = [("synthetic", "bf16", 1, 8, {"C": [2000.0, 2400.0], "B": [4000.0, 4400.0]}, None),
            ("jpeg", "bf16", 1, 8, {"C": [1100.0], "B": [3360.0]}, None),
            ("synthetic", "fp32", 1, 8, {"C": [1000.0], "B": [900.0]}, None),
            ("jpeg", "fp32", 1, 8, {"B": [800.0]}, None),
            ("jpeg", "bf16", 2, 8, {"B": [800.0]}, None)]
    table = vs_torchrun.utilisation(rows, peak=790.0, flops=1.0)
    assert "| jpeg | bf16 | 1 | B | 3360 | 80.0% of the GPU-bound rate |" in table
    assert "| jpeg | bf16 | 1 | C | 1100 | 26.2% of the GPU-bound rate |" in table
    assert "| jpeg | fp32 | 1 | B | 800 | 80.0% of the GPU-bound rate |" in table   # C the faster there
    assert "| jpeg | bf16 | 2 | B | 800 | (no synthetic C row: GPU-bound rate not measured) |" in table
