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
    c.coord = type("NoneJoined", (), {"joined": lambda self: []})()
    Controller._post_observations(c, [GOOD, dict(GOOD, layout=[2, 0])])
    assert c.predictor.posted == [[dict(GOOD, job_id=42)]]
    (dropped,) = [r for r in c.records.items if r["kind"] == "observations_dropped"]
    assert dropped["count"] == 1 and dropped["first"].startswith("records[1].layout[1]: ")


class InboxOf:
    """Worker records by worker id, handed over once (as ObservationInbox does)."""

    def __init__(self, by_wid):
        self.by_wid, self.asked = dict(by_wid), []

    def collect(self, wids):
        self.asked.append(sorted(wids))
        return [r for w in sorted(wids) for r in self.by_wid.pop(w, [])]


def test_the_records_of_workers_no_longer_in_the_fleet_are_posted(tmp_path):
    # #42: only the current fleet's workers were read, so the records a leaver (or a fenced-out worker) handed over
    # at its close, after its node left the fleet, were never posted
    from tests.unit.test_resize_tick import Clock, make_controller as make_ticking, wids
    c = make_ticking(tmp_path, Clock())
    c.predictor = RecordingPredictor()
    leaver = "j42-node3-g0-0"  # joined at a grow, left at a shrink; its node is given back
    c.coord.joined_ids = [*wids("node1"), *wids("node2"), leaver]
    coll = {"kind": "collective", "op": "allreduce", "world": 3, "bytes": 1 << 20, "seconds": 0.001}
    c.observations = InboxOf({leaver: [coll], wids("node1")[0]: [dict(coll, world=2)]})
    c._layouts, c._links = {3: [1, 1, 1], 2: [1, 1]}, {3: Links("shm", "tcp"), 2: Links("shm", "tcp")}
    Controller._post_observations(c, [])
    (posted,) = c.predictor.posted
    assert sorted(r["world"] for r in posted) == [2, 3], posted
    assert leaver in c.observations.asked[0]
