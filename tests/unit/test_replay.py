"""The what-if replay (predictor/replay.py, replay_inputs.py, replay_report.py): truth tables, FIFO + backfill,
the launcher's rules, decisions kept apart from truth, the sacct reader, the CLI."""
from __future__ import annotations

import csv
import dataclasses
import json
import re

import pytest
from click.testing import CliRunner

from predictor.cli import main
from predictor.cluster import Cluster
from predictor.replay import Params, Replay, calibrate_release, later_than
from predictor.replay_inputs import InputError, PolluxTruth, ReplayJob, elastic_lines, load_pollux_workload, load_sacct


@pytest.fixture(scope="module")
def truth():
    return PolluxTruth()


def shape(nodes: int, per_node: int = 4) -> Cluster:
    return Cluster.from_dict({"default_partition": "p", "partitions": [
        {"name": "p", "nodes": f"n[1-{nodes}]", "gpus_per_node": per_node, "gpu": "T4", "intra_link": "pcie",
         "inter_link": "ethernet"}]})


def fixed(name, submit, gpus, dur, limit=None, nodes=None):
    return ReplayJob(name, submit, gpus, nodes, duration_s=dur, limit_s=limit or dur)


def test_truth_is_the_measured_table_where_measured(truth):
    with open("predictor/data/pollux-osdi21/traces/cifar10/placements.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["placement"] == "22" and r["local_bsz"] == "64"]
    assert rows
    step, sync = truth.step("cifar10", (2, 2), 64 * 4)
    assert step == pytest.approx(float(rows[0]["step_time"]))
    assert sync == pytest.approx(float(rows[0]["sync_time"]))
    # the rotation and order of a placement do not matter; past the largest per-GPU batch, accumulation adds steps
    assert truth.step("cifar10", (1, 3), 256)[0] == truth.step("cifar10", (3, 1), 256)[0]
    one, _ = truth.step("bert", (4,), 48)            # 12 per GPU: bert's largest measured
    two, _ = truth.step("bert", (4,), 96)            # 24 per GPU: one accumulation micro-step more
    assert 1.5 * one < two < 2.1 * one


@pytest.fixture(scope="module")
def workload1(truth):
    return load_pollux_workload(1, truth)


def test_work_is_the_validation_tables_last_epoch(truth, workload1):
    with open("predictor/data/pollux-osdi21/traces/cifar10/validation-2048.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert truth.steps_to_finish("cifar10", 2048) == int(last["iteration"])
    jobs = workload1
    assert len(jobs) == 160 and jobs[0].name == "cifar10-0" and jobs[0].submit_s == 107
    assert jobs[0].duration_s == pytest.approx(jobs[0].steps * truth.step("cifar10", (4, 2), 2048)[0])


def test_fifo_then_backfill_by_time_limit(truth):
    jobs = [fixed("a", 0, 2, 100), fixed("head", 1, 4, 50), fixed("short", 2, 2, 40), fixed("long", 3, 2, 400)]
    got = Replay(jobs, shape(1), truth, "as-submitted").run().jobs()
    assert got["a"]["start"] == 0 and got["head"]["start"] == 100      # waits for a's 2 GPUs
    assert got["short"]["start"] == 2                                   # ends before head's reservation: backfilled
    assert got["long"]["start"] == 150                                  # would delay head: after it
    assert got["long"]["gpu_s"] == pytest.approx(2 * 400)


def test_release_is_recovered_from_a_history_replayed_with_it(truth):
    jobs = [fixed(f"j{i}", i, 4 if i % 3 else 2, 10 + i % 4) for i in range(12)]   # a queue: every end frees GPUs
    for release in (0.3, 1.7):
        measured = Replay(jobs, shape(1), truth, "as-submitted", Params(release_s=release)).run().summary()
        assert calibrate_release(jobs, shape(1), truth, measured["avg_jct_s"]) == pytest.approx(release, abs=0.02)
    alone = [fixed("a", 0, 1, 10)]          # nothing waits for its GPUs: no release lengthens it
    assert calibrate_release(alone, shape(1), truth, 9.0) == 0.0
    with pytest.raises(ValueError, match="even release_s=5.0 s replays the history faster .* 500.0 s"):
        calibrate_release(jobs, shape(1), truth, 500.0)
    with pytest.raises(ValueError, match="needs jobs and a measured average JCT"):
        calibrate_release([], shape(1), truth, 10.0)


def test_resizes_follow_the_launchers_rules_and_pay_the_pause(truth):
    """An elastic 8-GPU cifar10 job (gpus=4-8) on 2 nodes hands a node back to a pending short 4-GPU job yield_s
    after it queued (no wait for the next tick); the pending job starts then, the elastic job grows back to its 2
    nodes at the first tick after the short job ended (the node was lent: no plan's interval holds it back), and
    finishes later than alone (oracle: no hand-back) by its slower rate while lent, plus the pauses. Its time limit
    (1,800 s, twice its run time) leaves room for that (the next test: one that does not)."""
    lines = elastic_lines("cifar10", 2048, 8, truth, 1.0, 8, 0.5)
    big = ReplayJob("big", 0.0, 8, 2, "cifar10", 2048, 3178.0, 900.0, 1800.0, lines)
    small = fixed("small", 10, 4, 100, nodes=1)
    params = Params(tick_s=60.0, grow_pause_s=5.0, shrink_pause_s=7.0, yield_s=20.0)
    alone = Replay([big], shape(2), truth, "oracle", params).run().jobs()[big.name]
    rep = Replay([big, small], shape(2), truth, "elastic", params)    # the plan's interval alone keeps it at 1 node
    got = rep.run().jobs()
    assert 10.0 < got["small"]["start"] <= 10.0 + 20.0                  # within yield_s of queueing, before a tick
    assert rep.decisions.get("handback") == 1 and rep.decisions.get("grow") == 1 and got[big.name]["resizes"] == 2
    assert alone["end"] + 7.0 + 5.0 < got[big.name]["end"] < alone["end"] + 100.0


def test_no_hand_back_that_would_run_the_job_past_its_time_limit(truth):
    """Issue #40: the same job and pending job as above, the big job's limit now what it needs at its 2 nodes plus
    10%: at 1 node it would end past it, so it keeps its nodes (AutoscalePolicy.within_limit) and the small job
    waits for its end, which is within the limit. With twice that limit the hand-back happens."""
    lines = elastic_lines("cifar10", 2048, 8, truth, 1.0, 8, 0.5)
    params = Params(tick_s=60.0, grow_pause_s=5.0, shrink_pause_s=7.0, yield_s=20.0)
    alone = Replay([ReplayJob("big", 0.0, 8, 2, "cifar10", 2048, 3178.0, 900.0, None, lines)], shape(2), truth,
                   "oracle", params).run().jobs()["big"]
    runs = {}
    for limit in (1.1 * alone["end"], 2.2 * alone["end"]):
        big = ReplayJob("big", 0.0, 8, 2, "cifar10", 2048, 3178.0, 900.0, limit, lines)
        rep = Replay([big, fixed("small", 10, 4, 100, nodes=1)], shape(2), truth, "elastic", params)
        runs[limit] = (rep.run().jobs(), rep.decisions)
    (tight, tight_d), (loose, loose_d) = runs.values()
    assert "handback" not in tight_d and tight["big"]["resizes"] == 0
    assert tight["small"]["start"] >= tight["big"]["end"] and tight["big"]["end"] <= 1.1 * alone["end"]
    assert loose_d.get("handback") == 1 and loose["small"]["start"] <= 10.0 + 20.0


def test_no_hand_back_for_a_pending_job_longer_than_half_the_time_left(truth):
    """Params.yield_ratio: the same elastic job keeps its nodes for a pending job whose time limit is more than half
    of what it has left (the pending job waits for its end as under Slurm alone); inf hands back as the launcher
    does today."""
    lines = elastic_lines("cifar10", 2048, 8, truth, 1.0, 8, 0.5)
    big = ReplayJob("big", 0.0, 8, 2, "cifar10", 2048, 3178.0, 900.0, 1800.0, lines)
    long = fixed("long", 10, 4, 600, nodes=1)
    params = dict(tick_s=60.0, yield_s=20.0)
    kept = Replay([big, long], shape(2), truth, "oracle", Params(**params))
    got = kept.run().jobs()
    assert "handback" not in kept.decisions and got["long"]["start"] >= got[big.name]["end"]
    always = Replay([big, long], shape(2), truth, "oracle", Params(**params, yield_ratio=float("inf")))
    assert always.run().jobs()["long"]["start"] <= 10.0 + 20.0 and always.decisions.get("handback") == 1


def test_prediction_driven_sizing_starts_from_nothing_the_oracle_from_truth(truth, workload1):
    """Decisions come only from what the replay has measured: the first job is planned before any step row exists
    (kept as asked); the oracle plans it on the tables."""
    jobs = [dataclasses.replace(j) for j in workload1[:3]]
    for j in jobs:
        j.directives = elastic_lines(j.model, j.global_batch, j.gpus, truth, 1.0, 64, 0.5)
    sized, oracle = Replay(jobs, shape(16), truth, "right-sized"), Replay(jobs, shape(16), truth, "oracle")
    sized.run(), oracle.run()
    first = {r.job.name: r for r in sized.done}[jobs[0].name]
    assert first.planned is None and first.request == (None, jobs[0].gpus)
    assert first.layout == (4, 2)                                          # packed, as asked
    plan = oracle.oracle.plan(tuple(jobs[0].directives), oracle._job_fields((None, jobs[0].gpus)))
    assert plan["model_version"] == "truth" and plan["layout"] == [1] * 6       # 6 nodes x 1: truth's best
    assert plan["action"] == "keep"                   # the count asked, which Slurm places (planner: free placement)


def test_later_than_names_the_jobs(truth):
    a = Replay([fixed("x", 0, 4, 100), fixed("y", 0, 4, 100)], shape(1), truth, "as-submitted").run()
    b = Replay([fixed("y", 0, 4, 100), fixed("x", 1, 4, 100)], shape(1), truth, "as-submitted").run()
    assert [(n, base, got) for n, base, got in later_than(a, b)] == [("x", 100, 199)]   # y: 200 -> 100 s


SACCT = """JobID|JobName|Submit|Start|End|Timelimit|AllocTRES|NNodes|State|Comment
10|train|2026-11-01T10:00:00|2026-11-01T10:00:05|2026-11-01T11:00:05|02:00:00|billing=8,cpu=8,gres/gpu=8,node=2|2|COMPLETED|#ELASTIC model=cifar10;#ELASTIC per_gpu_batch=256;#ELASTIC gpus=4-8 elastic:decision=d-7
10.batch|batch|2026-11-01T10:00:05|2026-11-01T10:00:05|2026-11-01T11:00:05||cpu=4,gres/gpu=4|1|COMPLETED|
11|eval|2026-11-01T10:10:00|2026-11-01T10:20:00|2026-11-01T10:50:00|1-00:00:00|cpu=2,gres/gpu=1,node=1|1|COMPLETED|
12|cpu|2026-11-01T10:11:00|2026-11-01T10:20:00|2026-11-01T10:50:00|01:00:00|cpu=2,node=1|1|COMPLETED|
13|never|2026-11-01T10:12:00|Unknown|Unknown|01:00:00||1|CANCELLED|
"""


def test_sacct_export(tmp_path, truth):
    path = tmp_path / "sacct.txt"
    path.write_text(SACCT)
    jobs = load_sacct(path, truth)
    assert [j.name for j in jobs] == ["10", "11"]                 # no steps, no CPU-only job, no job that never ran
    a, b = jobs
    assert a.submit_s == 0 and b.submit_s == 600 and a.limit_s == 7200 and b.limit_s == 86400
    assert a.start_s == 5 and b.start_s == 1200
    assert a.model == "cifar10" and a.global_batch == 2048 and a.directives[2] == "#ELASTIC gpus=4-8"
    assert a.steps * truth.step("cifar10", (4, 4), 2048)[0] == pytest.approx(3600)
    assert b.model is None and b.duration_s == 1800
    path.write_text(SACCT.replace("2026-11-01T10:10:00", "yesterday"))
    with pytest.raises(InputError, match=r"sacct.txt:4: Submit: not a time: 'yesterday'"):
        load_sacct(path, truth)
    path.write_text("JobID|Submit\n1|2026-11-01T10:00:00\n")
    with pytest.raises(InputError, match="missing column"):
        load_sacct(path, truth)


def test_cli_fits_the_release_on_the_export_as_submitted(tmp_path):
    head = SACCT.splitlines()[0]
    # three whole-node jobs queued at once, each started 2 s after the one before it ended
    rows = [f"{i}|j|2026-11-01T10:00:00|2026-11-01T10:{m}|2026-11-01T10:{e}|01:00:00|gres/gpu=4,node=1|1|COMPLETED|"
            for i, m, e in ((1, "00:00", "01:40"), (2, "01:42", "03:22"), (3, "03:24", "05:04"))]
    path = tmp_path / "sacct.txt"
    path.write_text("\n".join([head, *rows]) + "\n")
    args = ["replay", "--sacct", str(path), "--nodes", "1", "--policy", "as-submitted"]
    result = CliRunner().invoke(main, [*args, "--release", "fit"])
    assert result.exit_code == 0, result.output
    fitted = float(re.search(r"release_s fitted on the history as submitted: ([\d.]+) s", result.output)[1])
    assert fitted == pytest.approx(2.0, abs=0.02)
    # the history's own average JCT, p99, queue and makespan
    assert "| as-submitted | 3 | 202 | 302 | 102 | 304 |" in result.output, result.output
    for bad, said in (("-1", "'-1': seconds at or above 0, or `fit`"), ("soon", "'soon': seconds at or above 0")):
        result = CliRunner().invoke(main, [*args, "--release", bad])
        assert result.exit_code == 2 and said in result.output, result.output
    result = CliRunner().invoke(main, ["replay", "--pollux-workload", "1", "--release", "fit"])
    assert result.exit_code == 2 and "`fit` needs a history with start times: --sacct" in result.output


def test_cli_replays_an_export_and_writes_the_report(tmp_path):
    path = tmp_path / "sacct.txt"
    path.write_text(SACCT)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["replay", "--sacct", str(path), "--nodes", "2", "--out", str(out),
                                       "--policy", "as-submitted,oracle"])
    assert result.exit_code == 0, result.output
    assert "| as-submitted | 2 |" in result.output and "| oracle | 2 |" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert [r["policy"] for r in summary["rows"]] == ["as-submitted", "oracle"]
    assert (out / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "jobs.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["policy"], r["job"]) for r in rows} == {(p, j) for p in ("as-submitted", "oracle") for j in ("10", "11")}
    bad = CliRunner().invoke(main, ["replay", "--sacct", str(path), "--nodes", "1", "--policy", "fifo"])
    assert bad.exit_code != 0 and "unknown fifo" in bad.output
    small = CliRunner().invoke(main, ["replay", "--sacct", str(path), "--nodes", "1", "--gpus-per-node", "4"])
    assert small.exit_code != 0 and "ask more than the cluster's 4 GPUs" in small.output


def test_admin_page_shows_the_newest_report(tmp_path, truth):
    from predictor.app import create_app
    from predictor.config import Config
    from predictor import replay_report

    jobs = [fixed("x", 0, 4, 100), fixed("y", 0, 4, 100)]
    results = {p: Replay(jobs, shape(1), truth, p).run() for p in ("as-submitted", "oracle")}
    out = tmp_path / "replay"
    replay_report.write(results, out, "site export")
    app = create_app(Config(db_path=str(tmp_path / "p.db"), replay_dir=str(out)), start_refit=False)
    page = app.test_client().get("/admin").get_data(as_text=True)
    assert "What-if replay: site export" in page and "<td class=\"policy\">oracle</td>" in page
    png = app.test_client().get("/admin/plots/replay.png")
    assert png.status_code == 200 and png.data == (out / "replay.png").read_bytes()
    bare = create_app(Config(db_path=str(tmp_path / "q.db")), start_refit=False).test_client()
    assert "No replay report" in bare.get("/admin").get_data(as_text=True)
    assert bare.get("/admin/plots/replay.png").status_code == 404


class _ShrinkAdvisor:
    """Plans that keep every job as submitted and tell every running one to go down to 1 node."""

    def plan(self, lines, job, current=None):
        if not current:
            return {"action": "keep", "reason": "as asked", "layout": None}
        return {"action": "rewrite", "reason": "1 node", "nodes": 1, "gpus_per_node": current[0],
                "layout": [current[0]]}


def test_a_plans_shrink_waits_for_a_pending_job(truth):
    """The plan's shrink frees nodes for others: carried out while a job pends (here a long one, which gets no
    hand-back), not while none does (the nodes would idle and the job run slower for nothing)."""
    lines = elastic_lines("cifar10", 2048, 8, truth, 1.0, 8, 0.5)
    big = ReplayJob("big", 0.0, 8, 2, "cifar10", 2048, 3178.0, 900.0, 1800.0, lines)
    runs = {}
    for name, jobs in (("alone", [big]), ("pending", [big, fixed("wide", 10, 12, 5000, nodes=3)])):
        rep = Replay(jobs, shape(3), truth, "oracle", Params(tick_s=60.0))
        rep.oracle = _ShrinkAdvisor()
        runs[name] = (rep.run().jobs()[big.name], rep.decisions)
    assert runs["alone"][0]["resizes"] == 0 and "shrink" not in runs["alone"][1]
    assert runs["pending"][1].get("shrink") == 1 and "handback" not in runs["pending"][1]


class _SlowerAdvisor:
    """Plans a submitted job down to 1x1 with the reply's longer time limit (`minutes`; None: none given)."""

    def __init__(self, minutes):
        self.minutes, self.asked = minutes, []

    def plan(self, lines, job, current=None):
        self.asked.append(job)
        limit = {} if self.minutes is None else {"time_limit_min": self.minutes}
        return {"action": "rewrite", "reason": "1x1", "nodes": 1, "gpus_per_node": 1, "layout": [1], **limit}


def test_a_right_sized_job_backfills_with_the_replys_longer_limit(truth):
    """Issue #40: the hook's longer limit is what backfill plans with. `m` asks 2 GPUs for 1 min (60 s) and is
    planned to 1 GPU: with its 1-minute limit it fits beside `a` before `head`'s reservation at 100 s; with the
    reply's 3 minutes it does not, and starts after `head`."""
    lines = elastic_lines("cifar10", 256, 2, truth, 1.0, 4, 0.5)
    starts = {}
    for minutes in (None, 3):
        jobs = [fixed("a", 0, 2, 100), fixed("head", 1, 4, 50),
                ReplayJob("m", 2.0, 2, 1, "cifar10", 256, 10.0, 30.0, 60.0, lines)]
        rep = Replay(jobs, shape(1), truth, "right-sized")
        rep.http = advisor = _SlowerAdvisor(minutes)
        starts[minutes] = rep.run().jobs()["m"]["start"]
        assert [j.get("time_limit_min") for j in advisor.asked] == [1]   # the job's own limit, whole minutes
    assert starts[None] == 2.0 and starts[3] >= 150.0
