"""bench/loco_rows.py: where a held-out collection's wrong GPU-count choices come from (issue 38), on made-up rows."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import loco_rows  # noqa: E402


def _row(g, meas, pred, link="nvlink", gate="host-gated", launch=None, b=8):
    return {"profile": "m", "gpu": "G", "layout": [g], "intra_link": link, "per_gpu_batch": b, "iter_s": meas,
            "pred_s": pred, "one_pred_s": 0.100, "gate": gate, "launch": launch or f"w{g}_{link}"}


def test_a_host_gated_curve_predicted_flat_picks_one_gpu_where_the_measured_one_scales_to_four():
    # measured at 1 GPU 0.100 s; 2 GPUs 0.147 s (scaling 0.68), 4 GPUs 0.103 s (0.97): from 1 to 4 the policy's
    # efficiency is 0.96, so 4; predicted 0.141 s at 2 and 4 (0.71 both): 1 -> 2 is 0.42, 1 -> 4 0.61, so 1
    rows = [_row(2, 0.147, 0.141), _row(4, 0.103, 0.141)]
    (w,) = loco_rows.wrong_choices(rows, {("m", 8): 0.100}, 0.7)
    assert (w["want"], w["got"], w["gates"]) == (4, 1, ["host-gated"])
    assert w["measured"] == {2: pytest.approx(0.680, abs=1e-3), 4: pytest.approx(0.971, abs=1e-3)}
    assert w["predicted"] == {2: pytest.approx(0.709, abs=1e-3), 4: pytest.approx(0.709, abs=1e-3)}
    # predicted as measured: no wrong choice
    assert loco_rows.wrong_choices([_row(2, 0.147, 0.147), _row(4, 0.103, 0.103)], {("m", 8): 0.100}, 0.7) == []


def test_signed_error_is_the_mean_of_measured_over_predicted_by_launch_and_gate():
    rows = [_row(2, 0.080, 0.100), _row(2, 0.120, 0.100, b=16), _row(2, 0.110, 0.100, gate="compute-gated"),
            _row(4, 0.090, 0.100)]
    out = loco_rows.signed_error(rows)
    assert out["w2_nvlink"]["host-gated"] == (pytest.approx(0.0), 2)       # -20% and +20%
    assert out["w2_nvlink"]["compute-gated"] == (pytest.approx(0.10), 1)
    assert out["w4_nvlink"] == {"host-gated": (pytest.approx(-0.10), 1)}
