"""GcWindow: automatic collection off while held and back on after, collection time counted."""
from __future__ import annotations

import gc

import pytest

from elastic_launcher.gc_window import GcWindow


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_hold_turns_automatic_collection_off_until_release():
    w = GcWindow().start()
    try:
        w.hold()
        assert not gc.isenabled() and w.held
        w.hold()  # idempotent: a second hold must not remember "off" as the state to restore
        w.release()
        assert gc.isenabled() and not w.held
        w.release()
        assert gc.isenabled()
    finally:
        w.close()


def test_release_keeps_a_program_s_own_gc_disable():
    gc.disable()
    w = GcWindow().start()
    try:
        w.hold()
        w.release()
        assert not gc.isenabled()
    finally:
        w.close()
        gc.enable()


def test_disabled_window_only_counts():
    w = GcWindow(enabled=False).start()
    try:
        w.hold()
        assert gc.isenabled() and not w.held
        before = (w.seconds, w.collections)
        gc.collect()
        assert w.collections == before[1] + 1 and w.seconds > before[0]
    finally:
        w.close()


def test_close_releases_and_stops_counting():
    w = GcWindow().start()
    assert gc.callbacks.count(w._on_gc) == 1
    w.start()  # a second start does not count twice
    assert gc.callbacks.count(w._on_gc) == 1
    w.hold()
    w.close()
    assert gc.isenabled() and w._on_gc not in gc.callbacks
    n = w.collections
    gc.collect()
    assert w.collections == n
