"""bench/hostile_suite.py runs round 3 (#24) and prints it in the issue's columns; without the testbed it runs the
items that do not need it and names the ones it left out (the attacks themselves: bench/hostile_round3.py)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import hostile_suite  # noqa: E402


def _row(item, p99, verdict="PASS", errors=0):
    during = {"n": 60, "p50": 3.0, "p99": p99, "codes": {200: 60 - errors, 502: errors}, "errors": errors}
    return {"item": item, "attack": f"attack {item}", "before": {"p99": 5.0}, "during": during,
            "attacker": "429: 570", "check": "DB 2.0 -> 3.0 MB (bound 16 MiB)", "latency_ok": p99 <= 100,
            "verdict": verdict}


def test_round3_table_has_the_issues_columns_per_item():
    text = hostile_suite.round3_table({"rows": [_row(4, 11.7), _row(13, 140.0, "FAIL", errors=1)],
                                       "left_out": (), "why": ""})
    head, rule, four, thirteen = text.splitlines()
    assert "victim /v1/plan p99 during (target <= 100 ms)" in head and "victim 5xx" in head and "verdict" in head
    assert four.startswith("| 4 | attack 4 | 11.7 ms (yes;") and "| 0 of 60 |" in four and "**PASS**" in four
    assert "140.0 ms (no;" in thirteen and "1 of 60 ({200: 59, 502: 1})" in thirteen and "**FAIL**" in thirteen
    assert "DB 2.0 -> 3.0 MB (bound 16 MiB)" in four


def test_round3_without_the_testbed_leaves_out_only_the_job_items_and_says_why(tmp_path):
    res = hostile_suite.round3(tmp_path, (1, 4, 6, 11, 15), tmp_path / "no-lab", full=False)
    assert res["rows"] == [] and res["left_out"] == (1, 4, 6, 11, 15)
    assert "not up" in res["why"] or res["why"]
    last = hostile_suite.round3_table(res).splitlines()[-1]
    assert last.startswith("| 1, 4, 6, 11, 15 | not run: they need the Slurm testbed")
