"""A job-signed record must fit what Slurm says about that job (predictor.jobcheck, issue #14.2).

Through the Flask app with the fakes of test_auth (a fake unmunger, a fake Slurm client). Job 7 is 2 nodes x 4
GPUs in partition debug (H200 in the default cluster model), running since NOW - 7200.
"""
from __future__ import annotations

import pytest

from slurm_plugin.errors import SlurmError
from tests.unit._service_fakes import COLLECTIVE, DDP_OVERHEAD, STEP
from tests.unit.test_auth import NOW, TOKEN, FakeJobs, app, body_of, facts, sign  # noqa: F401 - app: fixture

GOOD_STEP = dict(STEP, layout=[4, 4], timestamp_s=NOW - 60)


@pytest.fixture
def jobs(app, monkeypatch):
    """The fake Slurm's jobs, writable per test."""
    table = dict(FakeJobs.jobs)
    monkeypatch.setattr(FakeJobs, "jobs", table)
    return table


def stored(app) -> int:
    return len(app.extensions["elastic_predictor"].store.observations())


def post(client, records, job=7):
    body = body_of(records)
    return client.post("/v1/observations", data=body, headers=sign(body, job))


@pytest.mark.parametrize("record,field,words", [
    (dict(STEP, gpu="A100"), "gpu", "runs on 'H200'"),
    (dict(STEP, layout=[2, 2, 2]), "layout", "spans 3 nodes"),
    (dict(STEP, layout=[8], inter_link=None), "layout", "8 GPUs on a node"),
    (dict(COLLECTIVE, world=16), "world", "16 ranks"),
    (dict(COLLECTIVE, nodes=3), "nodes", "3 nodes"),
    (dict(COLLECTIVE, gpu="A100"), "gpu", "runs on 'H200'"),
    (dict(COLLECTIVE, link="nvswitch"), "link", "could only have crossed nvlink, ib, shm"),  # #24.11
    (dict(STEP, inter_link="roce"), "inter_link", "link 'roce'"),
    (dict(STEP, timestamp_s=NOW - 3 * 86400), "timestamp_s", "outside job 7's run window"),
    (dict(STEP, timestamp_s=NOW + 3600), "timestamp_s", "outside job 7's run window"),
    (dict(DDP_OVERHEAD, world=9), "world", "9 ranks"),
    (dict(DDP_OVERHEAD, gpu="A100"), "gpu", "runs on 'H200'"),
    (dict(DDP_OVERHEAD, timestamp_s=NOW - 3 * 86400), "timestamp_s", "outside job 7's run window"),
])
def test_a_record_that_does_not_fit_the_job_is_refused_by_field_and_nothing_is_stored(app, jobs, record, field,
                                                                                        words):
    record = {k: v for k, v in record.items() if v is not None}
    before = stored(app)
    r = post(app.test_client(), [GOOD_STEP, COLLECTIVE, record])
    assert r.status_code == 403, r.json
    assert (r.json["reason"], r.json["field"]) == ("record_mismatch", f"observations[2].{field}")
    assert words in r.json["error"]
    assert stored(app) == before


def test_records_that_fit_are_stored(app, jobs):
    r = post(app.test_client(), [GOOD_STEP, dict(STEP, layout=[1]), dict(COLLECTIVE, world=8, nodes=2)])
    assert r.status_code == 201, r.json
    assert r.json["stored"] == 3


def test_a_jobs_ddp_overhead_rows_are_stored_with_its_job_and_signer(app, jobs):
    rows = [dict(DDP_OVERHEAD, world=1, timestamp_s=NOW - 60), dict(DDP_OVERHEAD, world=8)]
    r = post(app.test_client(), rows)
    assert r.status_code == 201, r.json
    kept = app.extensions["elastic_predictor"].store.observations(kind="ddp_overhead")
    assert [(o["world"], o["job_id"], o["extra_s"]) for o in kept] == [(1, 7, 0.0082), (8, 7, 0.0082)]
    assert all(o["uid"] == 1000 for o in kept)           # the signer's (sign: uid 1000)


def test_a_resized_job_may_post_the_layouts_of_its_former_size(app, jobs):
    # shrunk to 1 node: Slurm's facts (parse_owner) keep the most nodes it held, so the windows measured
    # before the shrink still fit
    jobs[7] = facts(7, 1000, "RUNNING", None, max_nodes=2, max_gpus=8)
    assert post(app.test_client(), [GOOD_STEP]).status_code == 201


def test_a_typed_gres_decides_the_gpu_type(app, jobs):
    jobs[7] = facts(7, 1000, "RUNNING", None, gpu_type="h100", partition="elsewhere")
    client = app.test_client()
    r = post(client, [GOOD_STEP])
    assert (r.status_code, r.json["field"]) == (403, "observations[0].gpu")
    assert "GRES type (h100)" in r.json["error"]
    assert post(client, [dict(GOOD_STEP, gpu="H100")]).status_code == 201


@pytest.mark.parametrize("alloc,words", [
    ({"max_gpus": 0, "gpus_per_node": None}, "holds no GPUs"),
    ({"partition": "elsewhere"}, "cannot confirm GPU 'H200'"),
])
def test_a_gpu_slurm_cannot_confirm_is_refused(app, jobs, alloc, words):
    jobs[7] = facts(7, 1000, "RUNNING", None, **alloc)
    r = post(app.test_client(), [GOOD_STEP])
    assert (r.status_code, r.json["field"], r.json["reason"]) == (403, "observations[0].gpu", "record_mismatch")
    assert words in r.json["error"]


def test_an_ended_job_posts_records_of_its_run_window_only(app, jobs):
    client = app.test_client()
    assert post(client, [dict(GOOD_STEP, timestamp_s=NOW - 100)], job=9).status_code == 201
    r = post(client, [dict(GOOD_STEP, timestamp_s=NOW - 60 + 500)], job=9)      # after its end + slack
    assert (r.status_code, r.json["field"]) == (403, "observations[0].timestamp_s")


def test_tokens_are_not_bound_to_a_job(app, jobs):
    r = app.test_client().post("/v1/observations", json=[dict(STEP, layout=[8] * 64, inter_link="ib", gpu="A100")],
                               headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 201, r.json


def test_slurm_unreachable_fails_closed(app, jobs, monkeypatch):
    def down(self, job_id):
        raise SlurmError(["squeue"], None, "", "timed out after 5 s")

    monkeypatch.setattr(FakeJobs, "job_owner", down)
    before = stored(app)
    r = post(app.test_client(), [GOOD_STEP], job=77)
    assert (r.status_code, r.json["reason"]) == (503, "slurm_unavailable")
    assert stored(app) == before



def test_a_record_of_unknown_gpu_is_stored_under_the_jobs_gpu_type(app, jobs):
    """The launcher sends gpu 'unknown' when the job gave no `#ELASTIC gpu_type=`: Slurm's answer fills it."""
    r = post(app.test_client(), [dict(GOOD_STEP, gpu="unknown")])
    assert r.status_code == 201, r.json
    assert app.extensions["elastic_predictor"].store.observations()[-1]["gpu"] == "H200"


def test_a_job_without_gpus_posts_no_gpu_link(app, jobs):
    # #24.11: a CPU-only job posted ib and nvlink collectives
    from predictor.cluster import Cluster
    from predictor.jobcheck import RecordMismatch, check_records

    cpu_job = type("Job", (), {"job_id": 9, "max_gpus": 0, "max_cpus": 8, "max_nodes": 2, "partition": "debug",
                               "gpu_type": None, "started_at_s": NOW - 60, "ended_at_s": None})()
    record = {k: v for k, v in COLLECTIVE.items() if k != "gpu"}
    check_records([dict(record, link="socket", world=4)], cpu_job, Cluster.default(), now=NOW)
    for link in ("ib", "nvlink"):
        with pytest.raises(RecordMismatch, match=f"link '{link}'"):
            check_records([dict(record, link=link, world=4)], cpu_job, Cluster.default(), now=NOW)


def test_a_mixed_jobs_step_row_is_stored_and_its_layout_still_checked(app, jobs):
    # #42.7: a row of several GPU types (kept as what ran, never fit) is not held to the job's one type; its layout
    # and time are checked as any row's
    mixed = dict(GOOD_STEP, gpu="A100+H200", gpu_by_node=["H200", "A100"], rank_batches=[64] * 4 + [36] * 4)
    client = app.test_client()
    r = post(client, [mixed])
    assert r.status_code == 201, r.json
    wide = dict(mixed, layout=[4, 4, 4], gpu_by_node=["H200", "A100", "A100"], rank_batches=[64] * 12)
    r = post(client, [wide])
    assert (r.status_code, r.json["field"]) == (403, "observations[0].layout"), r.json
