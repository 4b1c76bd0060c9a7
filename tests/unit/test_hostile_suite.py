"""bench/hostile_suite.py runs round 3 (#24) and prints it in the issue's columns; without the testbed it runs the
items that do not need it and names the ones it left out (the attacks themselves: bench/hostile_round3.py)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import hostile_round2  # noqa: E402
import hostile_round3  # noqa: E402
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


def test_round3_table_gives_each_measure_its_column_and_a_dash_where_an_item_takes_none():
    measured = {**_row(9, 20.0), "measures": {"disk": "DB 5.4 -> 20.9 MB (bound: decisions budget 16 MiB)",
                                              "staleness": "reflected after 1.0-1.1 s"}}
    head, _, nine, four = hostile_suite.round3_table({"rows": [measured, _row(4, 11.7)], "left_out": (),
                                                      "why": ""}).splitlines()
    columns = [c.strip() for c in head.strip("|").split("|")]
    assert columns[5:9] == ["memory growth (bound)", "disk growth (bound)",
                            "others' plan and predictions moved (target <= 10%, plan unchanged)",
                            "model staleness (target <= 5 s)"]
    cells = [c.strip() for c in nine.strip("|").split("|")]
    assert cells[5:9] == ["-", "DB 5.4 -> 20.9 MB (bound: decisions budget 16 MiB)", "-", "reflected after 1.0-1.1 s"]
    assert [c.strip() for c in four.strip("|").split("|")][5:9] == ["-"] * 4
    assert len(cells) == len(columns)


class _SlowVictim:
    """Stands in for hostile_round3.Victim: every plan answered 200 in `seconds`."""
    seconds = 0.1028

    def __init__(self, port, body=None):
        self.results = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.results = [(200, self.seconds)] * 59


def test_an_item_whose_check_passes_fails_when_the_victims_p99_misses_its_target(monkeypatch):
    # session 16's item 11: its own check passed with the victim's p99 at 102.8 ms, and the row said PASS
    monkeypatch.setattr(hostile_round3, "Victim", _SlowVictim)
    monkeypatch.setattr(hostile_round3, "BASELINE_S", 0.0)
    row = hostile_round3.attack(1, 11, "collectives", lambda tally: ("ib bandwidth -0.9%", True))
    assert row["verdict"] == "FAIL" and row["failed_on"] == ["victim p99 102.8 ms > 100"]
    _SlowVictim.seconds = 0.0051
    try:
        assert hostile_round3.attack(1, 11, "collectives", lambda tally: ("ok", True))["verdict"] == "PASS"
    finally:
        _SlowVictim.seconds = 0.1028


def test_an_item_fails_on_a_victims_5xx_whatever_the_item(monkeypatch):
    class Broken(_SlowVictim):
        def __exit__(self, *exc):
            self.results = [(200, 0.005)] * 58 + [(502, 0.005)]

    monkeypatch.setattr(hostile_round3, "Victim", Broken)
    monkeypatch.setattr(hostile_round3, "BASELINE_S", 0.0)
    for item in (11, 13):
        row = hostile_round3.attack(1, item, "x", lambda tally: ("ok", True))
        assert row["verdict"] == "FAIL" and row["failed_on"] == ["victim 5xx 1"], item


def test_round3_without_the_testbed_leaves_out_only_the_job_items_and_says_why(tmp_path):
    res = hostile_suite.round3(tmp_path, (1, 4, 6, 11, 15), tmp_path / "no-lab", full=False)
    assert res["rows"] == [] and res["left_out"] == (1, 4, 6, 11, 15)
    assert "not up" in res["why"] or res["why"]
    last = hostile_suite.round3_table(res).splitlines()[-1]
    assert last.startswith("| 1, 4, 6, 11, 15 | not run: they need the Slurm testbed")


def test_the_other_items_print_in_the_same_columns():
    import hostile_clients  # noqa: PLC0415

    tally = hostile_clients.Tally()
    tally.add(201)
    round2 = [{"attack": "#24.2 one job's 300 profiles, 4 rows each", "tally": tally, "rss": (139.0, 141.0),
               "db": (2.2, 4.4), "plan_p99": (6.5, 46), "over_100ms": 0, "plan_errors": 0, "check": "fit 1.2 s",
               "passed": True, "measures": {"staleness": "a legitimate write reflected after 2.1 s (<= 5 s)"},
               "bounds": hostile_round2.bounds(0.5)}]
    round2[0]["failed_on"] = hostile_round2.verdict(round2[0])
    round2[0]["verdict"] = "FAIL" if round2[0]["failed_on"] else "PASS"
    idle = [{"held": 1000, "probes": 40, "answered": 40, "within_100ms": 40,
             "statuses": {"200": 40}, "p99_ms": 8.1}]
    head, _, two, three = hostile_suite.other_items_table(round2, idle).splitlines()
    columns = [c.strip() for c in head.strip("|").split("|")]
    cells = [c.strip() for c in two.strip("|").split("|")]
    assert len(cells) == len(columns) == len([c for c in three.strip("|").split("|")])
    assert cells[0] == "2" and cells[2].startswith("6.5 ms (yes;") and cells[3] == "0 of 46"
    assert cells[8] == "a legitimate write reflected after 2.1 s (<= 5 s)" and cells[7] == "-"
    assert three.startswith("| 3 | one address holds 1000 idle connections") and "40 of 40 answered 200" in three
    assert cells[5].startswith("largest worker 139 -> 141 MB (bound +81 MB: 64 MiB prediction cache")
    assert cells[6].startswith("DB 2.2 -> 4.4 MB (bound +21.5 MB: 16 MiB decisions budget") and cells[-1] == "**PASS**"
    assert three.endswith("| **PASS** |")


def test_round2_rows_state_memory_and_disk_bounds_from_the_services_limits_and_fail_beyond_them():
    """#24, items 2, 7, 12, 14: their rows said "no bound stated" and had no verdict. Now each has a memory and a
    disk bound from the service's limits (prediction cache, plot cache, decisions budget, WAL limit, the model
    kept; for the tool token's writes, what it sent), and fails beyond either, as round 3's rows do."""
    import hostile_clients  # noqa: PLC0415

    tally = hostile_clients.Tally()
    bound = hostile_round2.bounds(1.0, (3 * 2**20, "3 writes"))
    assert bound["memory"] == 64 + 16 + 2 and bound["disk"] == 16 + 4 + 3 + 3
    assert "ELASTIC_PREDICTOR_CACHE_BYTES" in bound["memory_why"] and "plotcache.MAX_BYTES" in bound["memory_why"]
    assert "ELASTIC_PREDICTOR_DECISIONS_MAX_BYTES" in bound["disk_why"] and "3 writes" in bound["disk_why"]
    row = {"tally": tally, "rss": (139.0, 140.0), "db": (2.0, 3.0), "plan_p99": (6.5, 46), "plan_errors": 0,
           "passed": True, "bounds": bound}
    assert hostile_round2.verdict(row) == []
    assert hostile_round2.verdict({**row, "rss": (139.0, 139.0 + 83)}) == ["memory +83 MB > 82"]
    assert hostile_round2.verdict({**row, "db": (2.0, 2.0 + 27)}) == ["disk +27.0 MB > 26.0"]
    assert hostile_round2.verdict({**row, "passed": False, "plan_p99": (101.0, 46), "plan_errors": 1}) == [
        "check", "p99 101.0 ms > 100", "5xx 1"]


def test_item3_reads_the_per_token_cap_from_the_services_own_nginx_conf(tmp_path):
    """Round 3's item 3 (one token from 8 addresses) holds the attacked service to the cap its rendered nginx.conf
    has (none in a version without it), not to this checkout's default."""
    from predictor import front_nginx  # noqa: PLC0415

    assert 3 in hostile_round3.ALL_ITEMS and 3 in hostile_round3.LABELS
    assert hostile_round3.rendered_cap(tmp_path) is None and hostile_round3.rendered_cap(None) is None
    (tmp_path / "nginx.conf").write_text(front_nginx.render(
        front_nginx.NginxLimits(per_credential_requests=5), host="127.0.0.1", port=1, runtime=str(tmp_path),
        load_module="", user=None, side_pool=True))
    assert hostile_round3.rendered_cap(tmp_path) == 5
