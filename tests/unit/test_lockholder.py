"""The side pool holds SQLite's write lock at the plan pool's priority (#24.11; predictor.lockholder).

Before, the side pool's gunicorn ran at nice 10 as a whole, so the write lock the hook's /v1/plan waits for was
held by a thread at nice 10: beside one busy task it got a tenth of a core, and a 4096-row write held the lock
330-450 ms instead of 55-76 ms (a priority inversion; #24.11's victim p99 102.8 ms). These tests assert who holds
the lock and at what nice value, never how long anything takes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from predictor import lockholder
from predictor.store import ClaimExceeded, Store
from tests.unit._service_fakes import COLLECTIVE, STEP

ROOT = Path(__file__).resolve().parents[2]


def test_the_holder_runs_each_callable_in_its_own_thread_and_hands_back_result_and_error():
    holder = lockholder.LockHolder()
    assert holder.run(threading.get_ident) not in (threading.get_ident(), None)
    assert holder.run(lambda: holder.run(threading.get_ident)) == holder.run(threading.get_ident)  # nested: inline
    with pytest.raises(KeyError, match="missing"):
        holder.run(lambda: {}["missing"])
    assert holder.run(lambda: 41 + 1) == 42                # an error does not stop the thread


def test_the_holder_leaves_a_gap_between_queued_transactions_for_other_processes_writers():
    # item 13: four writers' transactions back to back in one thread took the lock again the instant it was let go,
    # and the hook's decision, polling every WRITE_POLL_S from another process, missed the releases
    from predictor.store import WRITE_POLL_S  # noqa: PLC0415

    gaps, started, release, order = [], threading.Event(), threading.Event(), []
    holder = lockholder.LockHolder(sleep=gaps.append)
    assert holder.yield_s >= 2 * WRITE_POLL_S
    first = threading.Thread(target=holder.run, args=(lambda: (started.set(), release.wait(10), order.append(1)),))
    first.start()
    assert started.wait(10)                                 # the first transaction is running
    second = threading.Thread(target=holder.run, args=(lambda: order.append(2),))
    second.start()
    while not holder._jobs.qsize():                         # the second is queued behind it
        threading.Event().wait(0.001)
    release.set()
    first.join(10)
    second.join(10)
    assert order == [1, 2] and gaps == [holder.yield_s]     # one gap: after the first, none after the last
    holder.run(lambda: None)
    assert gaps == [holder.yield_s]                         # a lone transaction waits for nothing


def test_with_a_holder_the_store_takes_the_write_lock_in_its_thread_and_writes_the_same(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "h.db"))
    store.migrate()
    holder = lockholder.LockHolder()
    monkeypatch.setattr(lockholder, "current", lambda: holder)
    takers = []
    begin = Store._begin_immediate
    monkeypatch.setattr(Store, "_begin_immediate", lambda self, db: (takers.append(threading.get_ident()),
                                                                    begin(self, db))[1])
    first = store.write_observations([COLLECTIVE] * 3)
    again = store.write_observations([COLLECTIVE], key=("tool", "k1", "d1"))
    replayed = store.write_observations([COLLECTIVE], key=("tool", "k1", "d1"))
    store.put_profile("resnet50", {"name": "resnet50"})
    store.add_decision({"directives": []}, {"action": "keep", "reason": "x"}, "job_submit", None)
    with pytest.raises(ClaimExceeded):
        store.write_observations([dict(STEP, iter_s=5.0)], claim=(7, 1.0))
    assert set(takers) == {holder.run(threading.get_ident)} and len(takers) == 6
    assert first.ids == [1, 2, 3] and again.ids == [4] and replayed.replayed and replayed.ids == [4]
    assert [o["id"] for o in store.observations()] == [1, 2, 3, 4]          # the claim's row was not stored
    store.close()


SIDE_WORKER = r"""
import json, os, sys, threading
from predictor import front_nginx
from predictor.store import Store

out, db = sys.argv[1], sys.argv[2]
Store(db).migrate()
begin = Store._begin_immediate


def taking(self, conn):                      # who takes the write lock, at what nice value
    with open(out, "a") as f:
        f.write(json.dumps({"lock_nice": os.getpriority(os.PRIO_PROCESS, 0)}) + "\n")
    return begin(self, conn)


Store._begin_immediate = taking


def load():
    store = Store(db)

    def app(environ, start_response):
        with open(out, "a") as f:
            f.write(json.dumps({"request_nice": os.getpriority(os.PRIO_PROCESS, 0)}) + "\n")
        store.write_observations([{"kind": "collective", "op": "allreduce", "link": "ib", "world": 2,
                                   "bytes": 1024, "seconds": 0.001}] * 4096)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"stored"]
    return app


sock = os.path.join(os.path.dirname(out), "side.sock")
pid = front_nginx._fork_gunicorn(load, f"unix:{sock}", 1, 2, 30, nice=10)
import http.client, socket, time
deadline = time.monotonic() + 60
while True:
    try:
        conn = http.client.HTTPConnection("localhost", timeout=30)
        conn.sock = socket.socket(socket.AF_UNIX)
        conn.sock.connect(sock)
        conn.request("POST", "/v1/observations", b"{}")
        print(conn.getresponse().status)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
os.kill(pid, 15)
os.waitpid(pid, 0)
"""


@pytest.mark.slow  # a real gunicorn
def test_the_side_pools_worker_yields_the_cpu_but_holds_the_write_lock_at_our_priority(tmp_path):
    out = tmp_path / "seen.jsonl"
    done = subprocess.run([sys.executable, "-c", SIDE_WORKER, str(out), str(tmp_path / "h.db")], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == "200", done.stderr[-3000:]
    seen = [json.loads(line) for line in out.read_text().splitlines()]
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert [s["request_nice"] for s in seen if "request_nice" in s] == [ours + 10]   # the request yields the CPU
    assert [s["lock_nice"] for s in seen if "lock_nice" in s][-1] == ours            # the write lock does not
