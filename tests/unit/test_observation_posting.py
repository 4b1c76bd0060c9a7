"""The launcher applies the service's record contract (slurm_plugin.contracts.records) before it posts: the service
refuses a whole batch for one bad record, so a bad record is dropped, named, and the rest are posted."""
from elastic_launcher.controller import Controller
from elastic_launcher.links import Links
from elastic_launcher.observations import postable, step_record
from tests.unit.test_controller_plan import FakePredictor, make_controller

GOOD = step_record("resnet50", "H200", [2], Links("nvlink", None), 64, 0.032)


class RecordingPredictor(FakePredictor):
    def __init__(self):
        super().__init__([])
        self.posted: list[list[dict]] = []

    def observe(self, records):
        self.posted.append(list(records))
        return True


class NoWorkerRecords:
    def collect(self, wids):
        return []


def test_postable_keeps_what_the_contract_accepts_and_says_why_the_rest_would_be_refused():
    bad = dict(GOOD, iter_s=1e-300)
    kept, refused = postable([GOOD, bad, "junk"])
    assert kept == [GOOD]
    assert refused[0].startswith("records[1].iter_s: ") and "implausible" in refused[0]
    assert refused[1].startswith("records[2]: expected an object")


def test_one_bad_record_costs_itself_not_the_post(tmp_path):
    c = make_controller(tmp_path, RecordingPredictor())
    c.observations = NoWorkerRecords()
    Controller._post_observations(c, [GOOD, dict(GOOD, layout=[2, 0])])
    assert c.predictor.posted == [[dict(GOOD, job_id=42)]]
    (dropped,) = [r for r in c.records.items if r["kind"] == "observations_dropped"]
    assert dropped["count"] == 1 and dropped["first"].startswith("records[1].layout[1]: ")
