"""The SQLite history store: schema, migrations, durability settings, atomic writes, several handles."""
from __future__ import annotations

import sqlite3
import threading

import pytest

from predictor.errors import NotFoundError
from predictor.store import MIGRATIONS, Store
from tests.unit._service_fakes import COLLECTIVE, STEP


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "h.db"))
    s.migrate()
    yield s
    s.close()


def test_migrations_are_named_recorded_and_idempotent(tmp_path):
    s = Store(str(tmp_path / "m.db"))
    assert s.migrate() == [name for name, _ in MIGRATIONS]
    assert s.migrate() == []
    assert s.migrations() == [name for name, _ in MIGRATIONS]
    tables = set(s.db.table_names())
    assert {"migrations", "profiles", "observations", "decisions", "link_fits", "meta"} <= tables
    s.close()


def test_wal_and_synchronous_normal(store):
    assert store.db.journal_mode == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 1


def test_generation_moves_with_fitting_data_only(store):
    start = store.generation()
    store.add_observations([STEP])
    store.put_profile("resnet50", {"name": "resnet50"})
    assert store.generation() == start + 2
    store.add_decision({"directives": []}, {"action": "keep", "reason": "r"}, "cli", None)
    assert store.generation() == start + 2


def test_observations_batch_is_atomic(store):
    store.add_observations([STEP])
    with pytest.raises(sqlite3.IntegrityError):
        store.add_observations([COLLECTIVE, dict(COLLECTIVE, kind=None)])      # NOT NULL fails on the 2nd row
    assert store.observation_counts() == {"collective": 0, "step": 1, "ddp_overhead": 0}
    assert [o["kind"] for o in store.observations()] == ["step"]


def test_profiles_upsert_keeps_created_time(store):
    assert store.put_profile("a", {"name": "a", "v": 1}) is True
    created = store.list_profiles()[0]["created_at_s"]
    assert store.put_profile("a", {"name": "a", "v": 2}) is False
    row = store.list_profiles()[0]
    assert row["created_at_s"] == created and row["body"]["v"] == 2
    with pytest.raises(NotFoundError) as info:
        store.get_profile("b")
    assert "POST /v1/profiles" in str(info.value)


def test_decisions_ids_paging_and_lookup(store):
    ids = [store.add_decision({"n": i}, {"action": "keep", "reason": f"r{i}"}, "cli", "g1")["decision_id"]
           for i in range(5)]
    assert ids == ["d-1", "d-2", "d-3", "d-4", "d-5"]
    page = store.list_decisions(limit=2)
    assert [d["decision_id"] for d in page] == ["d-5", "d-4"]
    assert [d["decision_id"] for d in store.list_decisions(limit=2, before=4)] == ["d-3", "d-2"]
    full = store.get_decision("d-3")
    assert full["request"] == {"n": 2} and full["response"]["decision_id"] == "d-3"
    for bad in ("d-99", "3", "d-x", "d-" + "9" * 30):
        with pytest.raises(NotFoundError):
            store.get_decision(bad)


def test_two_handles_on_one_file_see_each_other(tmp_path):
    path = str(tmp_path / "shared.db")
    first, second = Store(path), Store(path)
    first.migrate()
    assert second.migrate() == []
    first.add_observations([STEP])
    assert second.observation_counts()["step"] == 1 and second.generation() == first.generation()
    first.close()
    second.close()


def test_concurrent_writers_all_land(store):
    errors = []

    def write():
        try:
            for _ in range(20):
                store.add_observations([COLLECTIVE, STEP])
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.observation_counts() == {"collective": 80, "step": 80, "ddp_overhead": 0}


def test_link_fits_are_replaced(store):
    store.replace_link_fits("g1", [{"link": "nvlink", "n": 3}, {"link": "ib", "n": 1}])
    store.replace_link_fits("g2", [{"link": "ib", "n": 5}])
    assert [(f["model_version"], f["link"], f["n"]) for f in store.link_fits()] == [("g2", "ib", 5)]


def test_a_write_names_the_generation_it_produced_even_with_writers_beside_it(store):
    seen = []

    def write():
        for _ in range(10):
            seen.append(store.write_observations([STEP]).generation)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 31)) and store.generation() == 30   # each write its own number
    generation, profiles, observations = store.fit_inputs()
    assert (generation, profiles, len(observations)) == (30, [], 30)


def test_models_keep_the_newest_and_a_success_clears_older_failures(store):
    assert store.newest_model_head() is None and store.newest_model() is None
    store.add_fit_failure(1, "fit failed on generation 1: boom")
    for version in (2, 3, 4, 5):
        store.put_model(version, b"blob-%d" % version, "code", 100.0 + version, 0.5, keep=3)
    assert [r[0] for r in store.db.execute("SELECT version FROM models ORDER BY version")] == [3, 4, 5]
    assert store.newest_model_head() == (5, 105.0, "code")
    assert store.newest_model().blob == b"blob-5" and store.newest_model().fit_s == 0.5
    assert store.newest_fit_failure() is None                 # model 2 superseded the failure of 1
    store.add_fit_failure(6, "fit failed on generation 6: boom")
    assert store.newest_fit_failure()[:2] == (6, "fit failed on generation 6: boom")
    store.put_model(5, b"again", "code", 200.0, 0.1)          # the same version fitted again replaces it
    assert store.newest_model_head() == (5, 200.0, "code") and store.newest_fit_failure().version == 6


def test_an_older_releases_pickled_models_are_dropped_by_the_migration_and_json_ones_kept(tmp_path):
    import pickle
    db = str(tmp_path / "old.db")
    store = Store(db)
    store.migrate()
    store.put_model(1, pickle.dumps({"predictor": object.__class__}), "old-code", 1.0, 0.1, keep=5)
    store.put_model(2, b'{"format": "elastic-predictor/model-1"}', "new-code", 2.0, 0.1, keep=5)
    store.db.execute("DELETE FROM migrations WHERE name = '0013_models_json'")   # as a database of that release
    store.close()
    again = Store(db)
    assert again.migrate() == ["0013_models_json"]          # what the service does when it opens a database
    assert [row[0] for row in again.db.execute("SELECT version FROM models")] == [2]
    again.close()
