"""Hostile clients, round 3 (issue #24): the items round 2 (bench/hostile_round2.py: 2, 7, 12, 14) and the idle-
connection attack (bench/hostile_suite.py: 3, one address) leave out, each as the issue's attack against a real
service; item 3 here is its credential half: one bearer token from 8 addresses.

Run: `python bench/hostile_round3.py [--lab /var/tmp/elastic-slurm-dev] [--items 1,4,...] [--flood-s 30]
      [--output bench/results/hostile_round3.md]`

The service is `elastic-predictor serve` as round 2 starts it (bench/hostile_clients.Service: its default front
end, nginx where installed; 2 gunicorn workers; the tool token; decisions budget 16 MiB), here with an admin token
too. Items 1, 4, 6, 11 and 15 need job credentials or jobs: they run against a second instance with munge on
(ELASTIC_PREDICTOR_MUNGE=1, the lab's munged and slurm.conf), and real jobs on the Slurm testbed in `--lab`
(`elastic-slurm testbed up --lab LAB --port-base 17800` first); the attacker is an unprivileged user (`cloudsdk`,
else `nobody`), who signs with `runuser -u USER -- munge`. Item 5 is the hook's side: the real job_submit.lua
(lua5.1 with the stub `slurm` table of tests/unit/test_lua_hook.py) against a hostile HTTP service. Item 10 puts
the database on a small tmpfs and fills it (needs root; else SKIP).

For each item a legitimate client (the victim, from another address, 127.0.0.2) POSTs /v1/plan at 20/s, open
loop, each timed from its scheduled send: `BASELINE_S` seconds before the attack and all through it. Each row
prints the attack, the victim's p50/p99 and status codes before and during, the attacker's status codes, the
issue's measures where the item takes them (memory and disk growth with their bound, others moved, staleness),
the item's own check and PASS/FAIL against the issue's expectation: the check, and for every item the victim's
p99 <= 100 ms and no 5xx to it (`verdict`).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import contextlib
import http.client
import json
import multiprocessing
import os
import platform
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import hostile_clients as hc  # noqa: E402

AUTH = {"Authorization": f"Bearer {hc.TOKEN}"}
ADMIN_TOKEN = "bench-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
VICTIM_ADDRESS = "127.0.0.2"        # Linux routes all of 127.0.0.0/8 to loopback
BASELINE_S = 3.0
PLAN_RATE = 20.0
P99_TARGET_MS = hc.P99_TARGET_MS
STALENESS_TARGET_S = hc.STALENESS_TARGET_S
DEFAULT_LAB = Path("/var/tmp/elastic-slurm-dev")
ALL_ITEMS = (1, 3, 4, 5, 6, 8, 9, 10, 11, 13, 15, 16)


# --- clients ------------------------------------------------------------------------------------------------------
def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            source: str | None = None, timeout: float = 90.0) -> tuple[int, bytes]:
    return hc.request(port, method, path, body, headers, timeout, source)


def send(port: int, tally: hc.Tally, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         source: str | None = None) -> tuple[int, bytes]:
    try:
        status, answer = request(port, method, path, body, headers, source)
    except (OSError, http.client.HTTPException):
        status, answer = 0, b""
    tally.add(status)
    return status, answer


class Victim:
    """POST /v1/plan at PLAN_RATE from VICTIM_ADDRESS until stopped; (status, seconds from the scheduled send)."""

    def __init__(self, port: int, body: bytes | None = None):
        self.port, self.body = port, body or json.dumps(hc.PLAN).encode()
        self.results: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.perf_counter()
        with cf.ThreadPoolExecutor(16) as pool:
            i = 0
            while not self._stop.is_set():
                at = start + i / PLAN_RATE
                delay = at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(self._one, at)
                i += 1

    def _one(self, at: float) -> None:
        try:
            status, _ = request(self.port, "POST", "/v1/plan", self.body, source=VICTIM_ADDRESS, timeout=30)
        except (OSError, http.client.HTTPException):
            status = 0
        self.results.append((status, time.perf_counter() - at))

    def __enter__(self) -> "Victim":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def quantile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


def victim_summary(results: list[tuple[int, float]]) -> dict:
    seconds = [s for _, s in results]
    return {"n": len(results), "p50": quantile_ms(seconds, 0.5), "p99": quantile_ms(seconds, 0.99),
            "codes": dict(sorted(collections.Counter(c for c, _ in results).items())),
            "errors": sum(1 for c, _ in results if c >= 500 or c == 0)}


MEASURES = ("memory", "disk", "moved", "staleness")   # the columns an item fills where it measures them


def verdict(passed: bool, during: dict | None, victim_503_ok: bool = False,
            p50_target_ms: float | None = None) -> list[str]:
    """What an item failed on (empty: PASS): its own check, and for every item with a victim the issue's targets,
    the victim's /v1/plan p99 during the attack (<= P99_TARGET_MS) and its 5xx or unanswered plans (0; with
    ``victim_503_ok`` the documented 503 'cannot be written' does not count, item 10)."""
    failed = [] if passed else ["check"]
    if during is None:
        return failed
    errors = during["errors"] - (during["codes"].get(503, 0) if victim_503_ok else 0)
    if not during["p99"] <= P99_TARGET_MS:
        failed.append(f"victim p99 {during['p99']:.1f} ms > {P99_TARGET_MS:g}")
    if errors:
        failed.append(f"victim 5xx {errors}")
    if p50_target_ms is not None and not during["p50"] <= p50_target_ms:
        failed.append(f"victim p50 {during['p50']:.1f} ms > {p50_target_ms:g}")
    return failed


def attack(port: int | None, item: int, label: str, run, victim_503_ok: bool = False,
           p50_target_ms: float | None = None) -> dict:
    """``run(tally) -> (check, passed[, measures])`` while the victim plans (port None: no service, no victim);
    ``measures`` fills the issue's columns (`MEASURES`) the item measures. The verdict is the check and, for every
    item with a victim, the victim's p99 and 5xx targets (`verdict`); with ``p50_target_ms`` its p50 too (item 4)."""
    tally = hc.Tally()
    before = during = None
    measures: dict = {}
    started = time.monotonic()
    try:
        if port is None:
            result = run(tally)
        else:
            with Victim(port) as quiet:
                time.sleep(BASELINE_S)
            before = victim_summary(quiet.results)
            with Victim(port) as victim:
                result = run(tally)
            during = victim_summary(victim.results)
        check, passed = result[:2]
        measures = dict(result[2]) if len(result) > 2 else {}
    except Exception as exc:  # noqa: BLE001 - one broken attack must not hide the others' rows
        check, passed = f"the attack itself failed: {type(exc).__name__}: {exc}", False
    if p50_target_ms is not None and during is not None:
        check = f"{check}; victim p50 during {during['p50']:.0f} ms (target <= {p50_target_ms:g} ms, the hook's budget)"
    failed = verdict(passed, during, victim_503_ok, p50_target_ms)
    row = {"item": item, "attack": label, "before": before, "during": during, "attacker": tally.summary() or "-",
           "check": " ".join(str(check).split()), "latency_ok": during is None or during["p99"] <= P99_TARGET_MS,
           "measures": {k: " ".join(str(measures[k]).split()) for k in MEASURES if measures.get(k)},
           "verdict": "FAIL" if failed else "PASS", "failed_on": failed, "seconds": time.monotonic() - started}
    print(f"#24.{item} {row['verdict']} {label}: {row['check']} | victim {during} | attacker {row['attacker']}"
          + (f" | failed on: {', '.join(failed)}" if failed else ""), file=sys.stderr, flush=True)
    return row


def wait_fresh(port: int, timeout_s: float = 120.0) -> tuple[float, dict]:
    """Seconds until /healthz shows a model of the stored data."""
    t0 = time.perf_counter()
    health: dict = {}
    while time.perf_counter() - t0 < timeout_s:
        try:
            status, answer = request(port, "GET", "/healthz", timeout=10)
            health = json.loads(answer)
            if status == 200 and health.get("model_generation") == health.get("generation"):
                return time.perf_counter() - t0, health
        except (OSError, ValueError, http.client.HTTPException):
            pass
        time.sleep(0.1)
    return float("inf"), health


Service = hc.Service  # round 2's service: `serve`'s default front end, the tool token, decisions budget 16 MiB


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def nginx_rss_mb(service: hc.Service) -> float:
    return sum(hc._rss_mb(pid) for pid in hc.tree_pids(service.proc.pid) if comm(pid) == "nginx")


def gunicorn_workers(service: hc.Service) -> list[int]:
    return [pid for pid in service.worker_pids() if comm(pid) != "nginx"]


# --- the Slurm testbed and munge ------------------------------------------------------------------------------------
ATTACKER = "cloudsdk" if any(p.pw_name == "cloudsdk" for p in pwd.getpwall()) else "nobody"


class Lab:
    """The testbed in `lab`: its slurm.conf and munged socket; jobs submitted here are cancelled by `close`."""

    def __init__(self, lab: Path):
        from slurm_plugin.lab.testbed_conf import DEFAULT_PORT_BASE, TestbedConfig, recorded_port_base  # noqa
        self.config = TestbedConfig(lab=lab, port_base=recorded_port_base(lab) or DEFAULT_PORT_BASE)
        self.env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": str(self.config.slurm_conf)}
        self.jobs: list[int] = []
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True, timeout=20)
        if out.returncode != 0 or not out.stdout.strip():
            raise RuntimeError(f"the Slurm testbed in {lab} is not up (elastic-slurm testbed up --lab {lab})")

    @property
    def socket(self) -> str:
        return str(self.config.munge_socket)

    def service_env(self) -> dict:
        return {"ELASTIC_PREDICTOR_MUNGE": "1", "ELASTIC_PREDICTOR_MUNGE_SOCKET": self.socket,
                "ELASTIC_PREDICTOR_SLURM_CONF": str(self.config.slurm_conf),
                "ELASTIC_PREDICTOR_ADMIN_TOKEN": ADMIN_TOKEN}

    def sbatch(self, *args: str, user: str | None = None) -> int:
        argv = ["sbatch", "--parsable", *args]
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30, check=True).stdout
        job = int(out.strip().split(";")[0])
        self.jobs.append(job)
        return job

    def state(self, job: int) -> str:
        """squeue's state, else sacct's (the lab's accounting may hold an older job of the same id: squeue first)."""
        out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%T", "-j", str(job)], env=self.env,
                             capture_output=True, text=True, timeout=20).stdout.split()
        if out:
            return out[0]
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", str(job)], env=self.env,
                             capture_output=True, text=True, timeout=20).stdout.splitlines()
        return out[-1].split()[0] if out else "UNKNOWN"

    def cancel(self, *jobs: int) -> None:
        for job in jobs:
            subprocess.run(["scancel", str(job)], env=self.env, capture_output=True, timeout=20, check=False)

    def wait_state(self, job: int, states: tuple[str, ...], timeout_s: float = 90.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state(job)
            if state in states or time.monotonic() > deadline:
                return state
            time.sleep(0.5)

    def sign(self, body: bytes, job: int, user: str | None = ATTACKER) -> dict:
        from slurm_plugin.contracts.signing import MUNGE_HEADER, munge_payload  # noqa: PLC0415
        argv = ["munge", "-s", munge_payload(body, job), f"--socket={self.socket}"]
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        cred = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
        return {MUNGE_HEADER: cred.strip()}

    def mint(self, body: bytes, jobs: list[int], user: str = ATTACKER) -> list[dict]:
        """Credentials for ``jobs`` (signing ``body``), minted by one shell of ``user`` (as fast as munge goes)."""
        from slurm_plugin.contracts.signing import MUNGE_HEADER, munge_payload  # noqa: PLC0415
        script = "".join(f"munge -s '{munge_payload(body, job)}' --socket={self.socket}\n" for job in jobs)
        out = subprocess.run(["runuser", "-u", user, "--", "sh"], input=script, capture_output=True, text=True,
                             timeout=600, check=True).stdout
        return [{MUNGE_HEADER: line.strip()} for line in out.splitlines() if line.startswith("MUNGE:")]

    def close(self) -> None:
        for job in self.jobs:
            subprocess.run(["scancel", str(job)], env=self.env, capture_output=True, timeout=20, check=False)


# --- seeding: eight honest jobs' history (tests/unit/test_poisoning.py) ---------------------------------------------
HONEST_JOB_BASE = 900000  # the seeded honest jobs' ids: past any id a (freshly started) testbed hands out
HONEST_UID_BASE = 60001   # the seeded honest users' uids: none of the testbed's accounts (the attacker's is one)
HONEST_USERS = (1, 2, 3, 8)   # #41.1: item 1 against the history of this many honest users each


def seed_history(root: Path, db: Path, users: int | None = None) -> None:
    """The poisoning test's honest history, its jobs 1-8 renumbered HONEST_JOB_BASE + 1-8 (on a testbed started
    afresh the attacker's jobs are 1, 2, 3: the outlier report then could not tell them from the honest ones),
    signed by `users` users (jobs dealt round-robin; None: unsigned, each job its own owner)."""
    from tests.unit.test_poisoning import _history  # noqa: PLC0415 - the test's history, built by the test module
    rows = [{**r, "job_id": HONEST_JOB_BASE + int(r["job_id"])} if r.get("job_id") is not None else r
            for r in _history()]
    if not users:
        hc.seed(root, db, rows)
        return
    hc.seed(root, db, [])    # the profile and sweeps; the signed rows as the service stores a credential's
    from predictor.store import Store  # noqa: PLC0415 - the service's store (an import takes no signer's uid)
    store = Store(str(db))
    try:
        store.write_observations([{**r, "uid": HONEST_UID_BASE + (int(r["job_id"]) - HONEST_JOB_BASE - 1) % users}
                                  for r in rows])
    finally:
        store.close()


VICTIM_PLAN = {"source": "job_submit", "directives": ["#ELASTIC model=resnet50 gpus=4-16 per_gpu_batch=64"],
               "job": {"partition": "debug", "user": "victim"}}


def victim_view(port: int) -> tuple[object, list[float]]:
    """Another user's plan (its layout) and predicted samples/s at 1 x 4, 2 x 4 and 4 x 4 GPUs."""
    from tests.unit.test_poisoning import CANDS  # noqa: PLC0415
    status, answer = request(port, "POST", "/v1/plan", json.dumps(VICTIM_PLAN).encode())
    plan = json.loads(answer)
    layout = plan.get("layout") or (plan.get("nodes"), plan.get("gpus_per_node"))
    status, answer = request(port, "POST", "/v1/predict", json.dumps(
        {"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 64, "candidates": CANDS}).encode())
    predictions = json.loads(answer)
    return layout, [p["samples_per_s"] for p in predictions.get("predictions", predictions.get("candidates", []))]


# --- the attacks --------------------------------------------------------------------------------------------------
def item1_several_jobs(service: hc.Service, lab: Lab):
    """Three 1-second jobs of one user (`sbatch -N4 --gres=gpu:4 --wrap "sleep 1"`), each posting 20 signed rows
    after it ended, claiming 2 x 4 and 4 x 4 are 5x slower."""
    from tests.unit.test_poisoning import _t  # noqa: PLC0415

    def run(tally):
        wait_fresh(service.port)
        plan0, pred0 = victim_view(service.port)
        jobs = [lab.sbatch("-N4", "--gres=gpu:4", "-t", "1", "--chdir=/tmp", "-o", "/dev/null", "--wrap", "sleep 1",
                           user=ATTACKER) for _ in range(3)]
        states = [lab.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")) for job in jobs]
        answers = []
        for job in jobs:
            rows = [{"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": layout, "per_gpu_batch": 64,
                     "intra_link": "nvlink", "inter_link": "ib", "iter_s": 5 * _t(layout), "job_id": job}
                    for layout in ([4, 4], [4, 4, 4, 4]) for _ in range(10)]
            body = json.dumps(rows).encode()
            status, answer = send(service.port, tally, "POST", "/v1/observations", body, lab.sign(body, job))
            answers.append(f"{status} {json.loads(answer or b'{}').get('reason', '')}".strip())
            if status != 201:
                answers[-1] += ': ' + json.loads(answer or b'{}').get('error', '')[:160]
        fresh_s, _ = wait_fresh(service.port)
        plan1, pred1 = victim_view(service.port)
        moved = max((abs(b / a - 1) for a, b in zip(pred0, pred1)), default=float("nan"))
        _, page = request(service.port, "GET", "/admin/outliers", headers=ADMIN)   # the admin token's (#41.3)
        text = page.decode(errors="replace")
        jobs_table = text.split("<h2>Outlier rows")[0].rsplit("<h2>Outliers", 1)[-1]
        listed = sorted({int(j) for j in re.findall(r'<td class="job_id">(\d+)</td>', jobs_table)})
        uid = pwd.getpwnam(ATTACKER).pw_uid
        honest_listed = [j for j in listed if j in range(HONEST_JOB_BASE + 1, HONEST_JOB_BASE + 9)]
        named = f'<td class="uid">{uid}' in jobs_table
        passed = (moved <= 0.10 and plan0 == plan1 and not honest_listed and any(j in jobs for j in listed)
                  and fresh_s <= STALENESS_TARGET_S)
        return (f"jobs {jobs} of {ATTACKER} (uid {uid}) ended {states}; their posts: {answers}; another user's "
                f"predictions at 1/2/4 nodes moved {' / '.join(f'{b / a - 1:+.1%}' for a, b in zip(pred0, pred1))} "
                f"(target <= 10%), plan {plan0} -> {plan1} (target unchanged); model fresh {fresh_s:.1f} s after; "
                f"/admin outlier jobs listed {listed} (attacker's: {[j for j in listed if j in jobs]}, honest jobs "
                f"{HONEST_JOB_BASE + 1}-{HONEST_JOB_BASE + 8}: {honest_listed}; uid {uid} named: {named})"), passed, {
            "moved": f"{' / '.join(f'{b / a - 1:+.1%}' for a, b in zip(pred0, pred1))} at 1/2/4 nodes (<= 10%); plan "
                     f"{'unchanged' if plan0 == plan1 else f'{plan0} -> {plan1}'}",
            "staleness": f"the attack's rows in the model {fresh_s:.1f} s after (<= {STALENESS_TARGET_S:g} s)"}
    return run


def item4_made_up_job_ids(service: hc.Service, lab: Lab, credentials: int):
    """Valid munge credentials of one user for made-up job ids, as fast as it can post them."""
    def run(tally):
        body = json.dumps([{"kind": "collective", "op": "allreduce", "link": "ib", "world": 2, "bytes": 1 << 20,
                            "seconds": 1e-3}]).encode()
        t0 = time.perf_counter()
        creds = lab.mint(body, [90_000_000 + i for i in range(credentials)])
        mint_s = time.perf_counter() - t0
        reasons: collections.Counter = collections.Counter()
        lock = threading.Lock()
        todo = iter(creds)

        def flood():
            while True:
                with lock:
                    cred = next(todo, None)
                if cred is None:
                    return
                status, answer = send(service.port, tally, "POST", "/v1/observations", body, cred)
                try:
                    reason = json.loads(answer).get("reason", "")
                except ValueError:
                    reason = ""
                with lock:
                    reasons[f"{status} {reason}".strip()] += 1

        t0 = time.perf_counter()
        threads = [threading.Thread(target=flood) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        flood_s = time.perf_counter() - t0
        documented = all(k.startswith(("403 job_not_found", "429 lookup_rate", "503 slurm_busy")) for k in reasons)
        return (f"{len(creds)} valid credentials of {ATTACKER} for made-up job ids (minted in {mint_s:.1f} s), posted "
                f"by 8 threads in {flood_s:.1f} s ({len(creds) / flood_s:.0f}/s): {dict(reasons)} (documented "
                f"refusals only: {'yes' if documented else 'no'})"), documented
    return run


def item5_hostile_tables(work: Path):
    """A hostile service's decision bands (the hook's cache of decisions for other min_efficiency values, #26.3; it
    cached prediction tables before) and a 9 MB reply, to the real job_submit.lua (lua5.1): each hostile band must be
    refused (the later job asks the service), and a later submission stay within the hook's 100 ms."""
    def run(tally):
        from tests.unit.test_lua_hook import BANDS, BANDS_LINES, Predictor, install, job, run_hook  # noqa: PLC0415
        base = Predictor.REPLIES["bands"]
        cases = {"zero nodes": {"nodes": 0}, "2.5 GPUs a node": {"gpus_per_node": 2.5},
                 "8 GPUs on 4-GPU nodes": {"gpus_per_node": 8}, "8 nodes of a 4-node partition": {"nodes": 8},
                 "-1 switches": {"switches": -1}}
        added = []
        for name, change in cases.items():
            mode = "r3-" + re.sub(r"[^a-z0-9]+", "-", name)
            Predictor.REPLIES[mode] = {**base, "bands": [{**band, **change} for band in BANDS]}
            added.append((name, mode))
        Predictor.REPLIES["r3-9mb"] = {**base, "bands": list(BANDS) * 9000}
        added.append((f"{len(json.dumps(Predictor.REPLIES['r3-9mb'])) / 1e6:.1f} MB of bands", "r3-9mb"))
        server = Predictor()

        def bands_job(mode, efficiency="0.5"):
            return job(mode=mode, directives=(BANDS_LINES[0], f"#ELASTIC gpus=2-8 min_efficiency={efficiency}"))

        out, passed = [], True
        try:
            for name, mode in [("valid bands", "bands")] + added:
                conf = work / f"hook-{mode}"
                conf.mkdir()
                first = {"job_desc": bands_job(mode)}
                # each submission's time inside slurm_job_submit (the driver's clock), not a lua5.1 process's wall
                # time: process start-up under host load is no part of the hook's cost
                first_ms = run_hook(install(conf, server.url), [first])[0]["elapsed"] * 1000
                (conf / "again").mkdir()
                server.requests.clear()
                results = run_hook(install(conf / "again", server.url), [first, {"job_desc": bands_job("rewrite", "0.3")}])
                hook_ms = results[1]["elapsed"] * 1000   # the later submission's own
                asked = [r["body"]["job"]["name"] for r in server.requests]
                second = results[1]["job_desc"]
                from_band = asked == [f"mode-{mode}"]
                tally.add(200)
                if mode == "bands":
                    passed &= from_band
                    out.append(f"valid bands: 2nd job decided from them without a call: {from_band}, later "
                               f"submission ~{hook_ms:.0f} ms")
                    continue
                bad = from_band or second.get("min_nodes") != Predictor.REPLIES["rewrite"]["nodes"]
                passed &= not bad and hook_ms <= 100
                out.append(f"{name}: 2nd job asked the service (band not used): {not from_band}, applied "
                           f"{second.get('min_nodes')} node(s) x {second.get('tres_per_node', '-')}, first submission "
                           f"{first_ms:.0f} ms (hostile service's reply included), later submission ~{hook_ms:.0f} ms")
        finally:
            server.close()
            for _, mode in added:
                Predictor.REPLIES.pop(mode, None)
        return "; ".join(out) + (" (target: the valid bands decide; no hostile band decides a job; a later submission "
                                 "within the hook's 100 ms)"), passed
    return run


def table_mb(db: Path) -> dict:
    """MB each table (with its indexes) of ``db`` holds, by SQLite's dbstat (empty where it is not compiled in)."""
    import sqlite3  # noqa: PLC0415
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
            rows = con.execute("SELECT s.name, m.tbl_name, SUM(s.pgsize) FROM dbstat s JOIN sqlite_master m "
                               "ON m.name = s.name GROUP BY m.tbl_name").fetchall()
    except sqlite3.Error:
        return {}
    return {table: size / 2**20 for _, table, size in rows}


def item6_profiles(service: hc.Service, lab: Lab, count: int):
    """One job's `count` profiles of 3.85 MB, a squat on `llama-70b`, then three anonymous readers."""
    def run(tally):
        job = lab.sbatch("-N1", "--gres=gpu:4", "-t", "10", "--chdir=/tmp", "-o", "/dev/null", "--wrap", "sleep 600",
                         user=ATTACKER)
        lab.wait_state(job, ("RUNNING",), 60)
        db0, tables0 = hc.db_mb(service.db), table_mb(service.db)
        t0 = time.perf_counter()
        _, listing = request(service.port, "GET", "/v1/profiles")
        list_ms0 = (time.perf_counter() - t0) * 1000
        reasons: collections.Counter = collections.Counter()
        for i in range(count):
            tensors = [{"name": f"layer{k:06d}." + "w" * 200, "numel": 4096 + k, "dtype": "float32"}
                       for k in range(15_000)]
            body = json.dumps({"name": f"big{i}", "tensors": tensors}).encode()
            status, answer = send(service.port, tally, "POST", "/v1/profiles", body, lab.sign(body, job))
            reasons[f"{status} {json.loads(answer or b'{}').get('reason', '')}".strip()] += 1
            if i >= 40 and reasons.get("201", 0) + reasons.get("200", 0) == 0:
                break
        size_mb = len(body) / 1e6
        squat = json.dumps({"name": "llama-70b", "tensors": [{"name": "a", "numel": 1, "dtype": "float32"},
                                                             {"name": "b", "numel": 1, "dtype": "float32"}]}).encode()
        status, answer = send(service.port, tally, "POST", "/v1/profiles", squat, lab.sign(squat, job))
        squat_result = f"{status} {json.loads(answer or b'{}').get('reason', '')}".strip()
        # whose plans the squat decides: another user's (target: none, the unknown-model keep) and the attacker's own
        squat_plans = {}
        fresh_s, _ = wait_fresh(service.port, 60)   # the fitted model has the squat (a plan reads fitted profiles)
        for who, uid in (("another user", 4242), (ATTACKER, pwd.getpwnam(ATTACKER).pw_uid)):
            plan_body = {"source": "job_submit", "directives": ["#ELASTIC model=llama-70b gpus=4-16 per_gpu_batch=64"],
                         "job": {"partition": "debug", "user": "victim" if uid == 4242 else ATTACKER, "uid": uid}}
            status, answer = request(service.port, "POST", "/v1/plan", json.dumps(plan_body).encode())
            reply = json.loads(answer or b"{}")
            squat_plans[who] = ("unknown model" in str(reply.get("reason")), reply.get("cache_ttl_s"))
        db1, tables1 = hc.db_mb(service.db), table_mb(service.db)
        grown = {t: tables1[t] - tables0.get(t, 0.0) for t in tables1 if tables1[t] - tables0.get(t, 0.0) >= 0.05}
        wal_mb = (Path(f"{service.db}-wal").stat().st_size / 2**20) if Path(f"{service.db}-wal").exists() else 0.0
        # the victim's /v1/plan decisions (20/s all through the item) are not the attacker's
        attack_growth = db1 - db0 - grown.get("decisions", 0.0)
        stop, read_ms = threading.Event(), collections.defaultdict(list)

        def reader(path):
            while not stop.is_set():
                t = time.perf_counter()
                status, _ = send(service.port, tally, "GET", path)
                read_ms[path].append(time.perf_counter() - t)

        readers = [threading.Thread(target=reader, args=(p,)) for p in ("/v1/profiles", "/admin", "/v1/profiles")]
        for t in readers:
            t.start()
        time.sleep(10)
        stop.set()
        for t in readers:
            t.join()
        lab.cancel(job)
        accepted = sum(n for k, n in reasons.items() if k.startswith("20"))
        bound_mb = 16 * 1.048576
        list_p50, admin_p50 = quantile_ms(read_ms['/v1/profiles'], .5), quantile_ms(read_ms['/admin'], .5)
        other_unknown = squat_plans["another user"][0]
        # the squat may stand as the attacker's own name (201) or be refused (403): it must decide no one else's plan
        passed = (attack_growth <= bound_mb + 2 and (squat_result.startswith("403") or other_unknown)
                  and all(k.startswith(("20", "403 profile_quota")) for k in reasons)
                  and list_p50 <= P99_TARGET_MS and admin_p50 <= P99_TARGET_MS and fresh_s <= STALENESS_TARGET_S)
        plans = "; ".join(f"{who}'s plan of llama-70b: {'unknown model (not from the squat)' if unknown else 'from it'}"
                          f", cache_ttl_s {ttl}" for who, (unknown, ttl) in squat_plans.items())
        return (f"job {job} of {ATTACKER}: {sum(reasons.values())} profiles of {size_mb:.2f} MB: {dict(reasons)} "
                f"({accepted} stored); DB {db0:.1f} -> {db1:.1f} MB, {attack_growth:.1f} MB without the victim's decisions "
                f"(bound: 32 profiles, 16 MiB a user, + 2 MB; grown by table: "
                f"{', '.join(f'{t} {mb:.1f}' for t, mb in sorted(grown.items(), key=lambda kv: -kv[1]))}; "
                f"WAL {wal_mb:.1f} MB); squat on "
                f"'llama-70b' with 2 tensors: {squat_result} ({plans}; target: 403, or no other user's plan from "
                f"it; asked {fresh_s:.1f} s after, once the model had it); 3 anonymous readers for 10 s: GET /v1/profiles p50 {list_p50:.0f} ms (one before the attack "
                f"{list_ms0:.0f} ms), GET /admin p50 {admin_p50:.0f} ms (target <= {P99_TARGET_MS:g} ms each)"), passed, {
            "disk": f"DB +{attack_growth:.1f} MB besides the victim's decisions (bound {bound_mb + 2:.1f} MB: 16 MiB "
                    f"a user + 2 MB)",
            "moved": f"another user's llama-70b plan from the squat: {'no' if other_unknown else 'yes'} (target no)",
            "staleness": f"the attack's profiles in the model {fresh_s:.1f} s after (<= {STALENESS_TARGET_S:g} s)"}
    return run


def send_all_but_the_last_byte(port: int, head: bytes, body_bytes: int, sources: list) -> tuple[list, dict, float]:
    """One connection to the service per entry of `sources` (a source address, or None: the default), 16 at a time,
    each sending `head` and all but the last of its `body_bytes` body bytes. Returns the sockets that sent it all
    (still open), the failures by exception name, and the seconds it took."""
    chunk = b" " * (body_bytes - 1)
    failed: collections.Counter = collections.Counter()

    def one(source):
        address = (source, 0) if source is not None else None
        sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=address)
        try:
            sock.sendall(head)
            sock.sendall(chunk)
            return sock
        except OSError as exc:
            sock.close()
            failed[type(exc).__name__] += 1
            return None

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(16) as pool:
        socks = [s for s in pool.map(one, sources) if s is not None]
    return socks, dict(failed), time.perf_counter() - t0


def item8_front_memory(service: hc.Service, connections: int = 240, body_bytes: int = 4 * 1024 * 1024):
    """``connections`` connections each send all but the last byte of a 4 MiB body, and hold."""
    def run(tally):
        from predictor.front_nginx import CONNECTION_BYTES, WORKER_BASE_BYTES, NginxLimits  # noqa: PLC0415
        limits = NginxLimits()
        front0, worker0 = nginx_rss_mb(service), service.worker_rss_mb()
        head = (f"POST /v1/observations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                f"Bearer {hc.TOKEN}\r\nContent-Length: {body_bytes}\r\n\r\n").encode()
        held, failed, send_s = send_all_but_the_last_byte(service.port, head, body_bytes, [None] * connections)
        time.sleep(1.0)
        front1, worker1 = nginx_rss_mb(service), service.worker_rss_mb()
        for sock in held:
            sock.close()
        tally.codes["held, then closed"] = len(held)
        bound = (limits.max_connections * CONNECTION_BYTES + limits.worker_processes * WORKER_BASE_BYTES) / 2**20
        passed = front1 - front0 <= bound and worker1 - worker0 <= 50
        return (f"{len(held)} of {connections} connections sent {body_bytes - 1} of {body_bytes} body bytes in "
                f"{send_s:.1f} s ({dict(failed) or 'no send failed'}); nginx RSS (all its processes) {front0:.0f} -> "
                f"{front1:.0f} MB (bound {bound:.0f} MB: {limits.max_connections} connections x "
                f"{CONNECTION_BYTES // 1024} KiB + {limits.worker_processes} x {WORKER_BASE_BYTES >> 20} MiB; bodies "
                f"go to temp files); largest gunicorn worker {worker0:.0f} -> {worker1:.0f} MB"), passed, {
            "memory": f"nginx {front0:.0f} -> {front1:.0f} MB (bound +{bound:.0f} MB); largest gunicorn worker "
                      f"{worker0:.0f} -> {worker1:.0f} MB (bound +50 MB)"}
    return run


CREDENTIAL_ADDRESSES = tuple(f"127.0.0.{20 + k}" for k in range(8))   # item 3's attacker: one token, 8 addresses
OTHER_CLIENT = "127.0.0.3"                                            # ... and another credential's client


def nginx_runtime(service: hc.Service) -> Path | None:
    """The runtime folder (`-p`) of the service's nginx, where its body temp files are (None: no nginx)."""
    for pid in hc.tree_pids(service.proc.pid):
        try:       # nginx's master rewrites its argv as one title: "nginx: master process /usr/sbin/nginx ... -p DIR"
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found = re.search(r" -p (\S+)", title) if comm(pid) == "nginx" else None
        if found:
            return Path(found.group(1))
    return None


def rendered_cap(runtime: Path | None) -> int | None:
    """The per-bearer-token cap in the service's rendered nginx.conf (`limit_conn http_credential N;`), or None."""
    try:
        found = re.search(r"^\s*limit_conn http_credential (\d+);", (runtime / "nginx.conf").read_text(), re.M)
    except (OSError, TypeError):
        return None
    return int(found.group(1)) if found else None


def temp_bytes(service: hc.Service, runtime: Path | None) -> int:
    """Bytes on disk of the files nginx's processes hold open under their runtime folder: its request body temp
    files (nginx unlinks each as it creates it, so only its open descriptors show them)."""
    total = 0
    if runtime is None:
        return 0
    for pid in hc.tree_pids(service.proc.pid):
        if comm(pid) != "nginx":
            continue
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd).startswith(str(runtime) + "/"):
                    total += os.stat(fd).st_blocks * 512
            except OSError:
                continue
    return total


def _token_holder(port: int, head: bytes, body_bytes: int, sources: list[str], out, done) -> None:
    """Item 3's attacker (in a child process, so its sending takes no GIL from the victim's clock): one request a
    source address, its head and all but the last body byte; after 1 s puts on `out` how each was answered
    ('held': nothing yet), then holds them until `done` is set."""
    socks, failed, send_s = send_all_but_the_last_byte(port, head, body_bytes, sources)
    time.sleep(1.0)
    answers: collections.Counter = collections.Counter()
    for sock in socks:
        sock.setblocking(False)
        try:
            data = sock.recv(65536)
            answers[data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else "closed"] += 1
        except BlockingIOError:
            answers["held"] += 1
        except OSError:
            answers["closed"] += 1
    out.put({"answers": dict(answers), "failed": dict(failed), "send_s": send_s, "sent": len(socks)})
    done.wait(60)
    for sock in socks:
        sock.close()


def item3_one_token_many_addresses(service: hc.Service, body_bytes: int = 256 * 1024):
    """The tool token from the 8 `CREDENTIAL_ADDRESSES`: each opens as many requests as its address may have in
    progress (`--per-address-requests`, 64) and sends all but the last byte of a 256 KiB body (above 16 KiB a body
    goes to a temp file: disk), then holds them; meanwhile another credential (the admin token, from OTHER_CLIENT) writes,
    and the token is tried from a 9th address. Since #41.5 nginx counts a request against its bearer token only once
    its body is whole: the held bodies take their own addresses' slots and none of the token's, so the token from a
    9th address is answered (201), and the temp files are those bodies' bytes."""
    def run(tally):
        from predictor.front_nginx import CONNECTION_BYTES, NginxLimits  # noqa: PLC0415
        limits = NginxLimits()
        runtime = nginx_runtime(service)
        cap = rendered_cap(runtime)          # the attacked service's own: None where it has no per-token cap
        bound_cap = cap or getattr(limits, "per_credential_requests", 16)   # ... held to this version's default
        disk0, front0 = temp_bytes(service, runtime), nginx_rss_mb(service)
        head = (f"POST /v1/observations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                f"Bearer {hc.TOKEN}\r\nContent-Length: {body_bytes}\r\n\r\n").encode()
        sources = [a for a in CREDENTIAL_ADDRESSES for _ in range(limits.per_address_requests)]
        ctx = multiprocessing.get_context("fork")
        out, done = ctx.SimpleQueue(), ctx.Event()
        holder = ctx.Process(target=_token_holder, args=(service.port, head, body_bytes, sources, out, done))
        holder.start()
        try:
            got = out.get()
            disk1, front1 = temp_bytes(service, runtime), nginx_rss_mb(service)
            rows = json.dumps([{"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [1],
                                "intra_link": "nvlink", "per_gpu_batch": 64, "iter_s": 0.0331}]).encode()
            others = collections.Counter(request(service.port, "POST", "/v1/observations", rows, ADMIN,
                                                 source=OTHER_CLIENT, timeout=30)[0] for _ in range(10))
            fresh, _ = request(service.port, "POST", "/v1/observations", rows, AUTH, source="127.0.0.28", timeout=30)
        finally:
            done.set()
            holder.join(90)
        answers = got["answers"]
        for code, n in answers.items():
            tally.codes[code] += n
        held = answers.get("held", 0)
        disk_mb, front_mb = (disk1 - disk0) / 2**20, front1 - front0
        disk_bound = held * body_bytes / 2**20      # a held body is in the outer server's temp file only
        mem_bound = limits.memory_bound() / 2**20
        per_address = limits.per_address_requests
        passed = (held <= per_address * len(CREDENTIAL_ADDRESSES) and disk_mb <= disk_bound
                  and front_mb <= mem_bound and set(others) == {201} and fresh == 201)
        return (f"{got['sent']} requests with the tool token from {len(CREDENTIAL_ADDRESSES)} addresses "
                f"({per_address} each, the per-address cap), each {body_bytes - 1} of {body_bytes} "
                f"body bytes sent in {got['send_s']:.1f} s ({got['failed'] or 'no send failed'}): {answers}; held "
                f"in progress {held} (target <= {per_address} an address; none counts against the token's cap of "
                f"{bound_cap}: #41.5); the token from a 9th address meanwhile: {fresh} (target 201: the held bodies "
                f"hold none of its slots); another credential (admin token, {OTHER_CLIENT}) x 10 writes meanwhile: "
                f"{dict(others)} (target all 201); nginx's body temp files {disk0 / 2**20:.1f} -> "
                f"{disk1 / 2**20:.1f} MB"), passed, {
            "memory": f"nginx {front0:.0f} -> {front1:.0f} MB (bound +{mem_bound:.0f} MB: "
                      f"{limits.max_connections} connections x {CONNECTION_BYTES // 1024} KiB + workers)",
            "disk": f"body temp files +{disk_mb:.1f} MB (bound {disk_bound:.0f} MB: the {held} held bodies' bytes; "
                    f"at most 2 x connections x ELASTIC_PREDICTOR_MAX_BODY {limits.max_body >> 20} MiB in all)",
            "moved": f"another credential's writes {dict(others)}, the token from a 9th address {fresh} "
                     f"(target all 201)"}
    return run


def _plan_flood(port: int, flood_s: float, threads: int, out) -> None:
    """Item 9's attacker (in a child process): `threads` threads post the largest valid /v1/plan bodies, without a
    credential, for `flood_s` seconds; puts {status: count} on `out`."""
    tally = hc.Tally()
    stop, counter, lock = threading.Event(), iter(range(10 ** 9)), threading.Lock()

    def flood():
        while not stop.is_set():
            with lock:
                i = next(counter)
            send(port, tally, "POST", "/v1/plan", hc.largest_plan(i))

    workers = [threading.Thread(target=flood) for _ in range(threads)]
    for t in workers:
        t.start()
    time.sleep(flood_s)
    stop.set()
    for t in workers:
        t.join()
    out.put(dict(tally.codes))


def item9_decisions(service: hc.Service, flood_s: float):
    """The hook's decisions (from VICTIM_ADDRESS), then four anonymous threads posting the largest valid
    /v1/plan bodies for ``flood_s`` seconds."""
    def run(tally):
        ids = []
        for i in range(20):
            body = json.dumps({**hc.PLAN, "job": {**hc.PLAN["job"], "name": f"hook-{i}"}}).encode()
            status, answer = request(service.port, "POST", "/v1/plan", body, source=VICTIM_ADDRESS)
            ids.append(json.loads(answer).get("decision_id"))
        db0 = hc.db_mb(service.db)
        # the four threads run in a process of their own: building and sending 166 KB bodies in the victim's
        # process took its GIL, so the victim's clock counted the attacker's Python as the service's latency
        # (more so once the service answers the flood's plans faster, or refuses them)
        queue = multiprocessing.get_context("fork").SimpleQueue()
        flooder = multiprocessing.get_context("fork").Process(target=_plan_flood,
                                                               args=(service.port, flood_s, 4, queue))
        flooder.start()
        codes = queue.get()
        flooder.join()
        for code, n in codes.items():
            for _ in range(n):
                tally.add(code)
        kept = sum(request(service.port, "GET", f"/v1/decisions/{d}")[0] == 200 for d in ids if d)
        db1 = hc.db_mb(service.db)
        _, answer = request(service.port, "GET", "/v1/decisions?limit=1000")
        newest = json.loads(answer)["decisions"]
        return (f"20 hook decisions from {VICTIM_ADDRESS}, then {tally.total} largest valid plans (~166 KB stored "
                f"each) from 4 anonymous threads over {flood_s:g} s: {kept} of {len([d for d in ids if d])} hook "
                f"decisions still there (target: all); DB {db0:.1f} -> {db1:.1f} MB (decisions budget 16 MiB); "
                f"{len(newest)} decisions listed"), kept == len([d for d in ids if d]) and kept > 0, {
            "disk": f"DB {db0:.1f} -> {db1:.1f} MB (bound: decisions budget 16 MiB)",
            "moved": f"hook decisions kept {kept} of {len([d for d in ids if d])} (target all)"}
    return run


def item10_full_disk(root: Path, work: Path):
    """The database on a 64 MiB tmpfs, filled to the last byte; GET /metrics and the victim's plans."""
    mount = work / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True).returncode:
        return None
    service = None
    try:
        db = mount / "full.db"
        hc.seed(root, db)
        service = Service(root, db, 2, work / "full.log", {"ELASTIC_PREDICTOR_ADMIN_TOKEN": ADMIN_TOKEN})
        service.wait_ready()

        def run(tally):
            for _ in range(20):   # counts for the spool before the disk fills
                request(service.port, "GET", "/metrics")
            with open(mount / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
                try:
                    while True:
                        f.write(b"\0" * 512)
                        f.flush()
                except OSError:
                    pass
            free = shutil.disk_usage(mount).free
            with Victim(service.port) as victim:
                codes = collections.Counter(send(service.port, tally, "GET", "/metrics")[0] for _ in range(40))
                time.sleep(2)
            plans = victim_summary(victim.results)
            status, answer = request(service.port, "POST", "/v1/plan", json.dumps(hc.PLAN).encode())
            documented = status == 503 and b"cannot be written" in answer
            (mount / "filler").unlink()
            after = send(service.port, tally, "GET", "/metrics")[0]
            return (f"disk full ({free} bytes free): GET /metrics x 40 answered {dict(codes)} (target: all 200); "
                    f"the victim's /v1/plan while full: {plans['codes']} (p50 {plans['p50']:.0f} ms; a 503 is the "
                    f"documented 'cannot be written' answer with Retry-After: {documented}: "
                    f"{json.loads(answer).get('error', '')[:90]!r}); after freeing: /metrics {after}"), \
                set(codes) == {200} and (status == 200 or documented)
        return service, run
    except Exception:
        if service:
            service.stop()
        subprocess.run(["umount", str(mount)], check=False)
        raise


def item11_collectives(service: hc.Service, lab: Lab, rows: int):
    """A link the partition lacks, a CPU-only job's ib/nvlink collectives, and ``rows`` rows of one job at one
    point of the ib fit."""
    def run(tally):
        gpu_job = lab.sbatch("-N2", "--gres=gpu:4", "-t", "10", "--chdir=/tmp", "-o", "/dev/null", "--wrap",
                             "sleep 600", user=ATTACKER)
        cpu_job = lab.sbatch("-N1", "-t", "10", "--chdir=/tmp", "-o", "/dev/null", "--wrap", "sleep 600",
                             user=ATTACKER)
        lab.wait_state(gpu_job, ("RUNNING",), 60)
        lab.wait_state(cpu_job, ("RUNNING",), 60)

        def post(records, job):
            body = json.dumps(records).encode()
            status, answer = send(service.port, tally, "POST", "/v1/observations", body, lab.sign(body, job))
            return f"{status} {json.loads(answer or b'{}').get('reason', '')}".strip()

        point = {"kind": "collective", "op": "allreduce", "world": 8, "nodes": 2, "bytes": 1 << 27}
        nvswitch = post([dict(point, link="nvswitch", seconds=1e-3)], gpu_job)
        cpu = [post([dict(point, link=link, world=2, nodes=1, seconds=1e-3)], cpu_job) for link in ("ib", "nvlink")]
        wait_fresh(service.port)
        bw0 = ib_bandwidth(service.port)
        true_s = 2e-5 + 2 * 7 / 8 * (1 << 27) / 2.5e10
        flood = [post([dict(point, link="ib", seconds=2 * true_s, job_id=gpu_job)] * 4096, gpu_job)
                 for _ in range(rows // 4096)]
        lab.cancel(gpu_job, cpu_job)
        fresh_s, _ = wait_fresh(service.port)
        bw1 = ib_bandwidth(service.port)
        moved = bw1 / bw0 - 1 if bw0 and bw1 else float("nan")
        passed = (nvswitch.startswith("403 record_mismatch") and all(c.startswith("403 record_mismatch") for c in cpu)
                  and abs(moved) <= 0.10 and fresh_s <= STALENESS_TARGET_S)
        return (f"GPU job {gpu_job} (2 x 4 GPUs, debug) posts an nvswitch collective: {nvswitch}; CPU-only job "
                f"{cpu_job} posts ib / nvlink collectives: {cpu} (target: 403 record_mismatch); {rows // 4096 * 4096} "
                f"rows of job {gpu_job} at one ib point, each twice the true time: posts {collections.Counter(flood)}, "
                f"/v1/links ib bandwidth {bw0:.3g} -> {bw1:.3g} ({moved:+.1%}, target <= 10%); the attack's rows in "
                f"the model {fresh_s:.1f} s after"), passed, {
            "moved": f"ib bandwidth (everyone's link fit) {moved:+.1%} (<= 10%)",
            "staleness": f"the attack's rows in the model {fresh_s:.1f} s after (<= {STALENESS_TARGET_S:g} s)"}
    return run


def ib_bandwidth(port: int) -> float | None:
    _, answer = request(port, "GET", "/v1/links")
    links = json.loads(answer)["links"]
    entry = links.get("ib") if isinstance(links, dict) else next((x for x in links if x.get("link") == "ib"), None)
    if not entry:
        return None
    for key in ("bandwidth_Bps", "bandwidth_bps", "bandwidth", "bus_bandwidth_Bps", "bw_Bps"):
        if isinstance(entry.get(key), (int, float)):
            return float(entry[key])
    numbers = {k: v for k, v in entry.items() if isinstance(v, (int, float)) and "band" in k.lower()}
    return float(next(iter(numbers.values()))) if numbers else None


def item13_retries_under_sigkill(service: hc.Service, posts: int, kills: int, every_s: float = 1.0):
    """Writers post one row each with an Idempotency-Key and retry with the same key until answered 2xx, while
    gunicorn workers are SIGKILLed; then count each post's rows in the database."""
    def run(tally):
        import sqlite3  # noqa: PLC0415
        base = 1.9e9 + random.random() * 1e6
        acked, retries, lock, stop = set(), collections.Counter(), threading.Lock(), threading.Event()
        todo = iter(range(10 ** 9))
        sent = []

        def writer():
            while not stop.is_set():
                with lock:
                    i = next(todo)
                    sent.append(i)
                key = str(uuid.uuid4())
                row = [{"kind": "collective", "op": "allreduce", "link": "ib", "world": 2, "bytes": 1 << 20,
                        "seconds": 1e-3 * (1 + (i % 7) * 0.01), "timestamp_s": base + i}]
                for attempt in range(200):
                    status, _ = send(service.port, tally, "POST", "/v1/observations", json.dumps(row).encode(),
                                     {**AUTH, "Idempotency-Key": key})
                    if 200 <= status < 300:
                        with lock:
                            acked.add(i)
                        break
                    with lock:
                        retries[status] += 1
                    time.sleep(0.05)

        threads = [threading.Thread(target=writer) for _ in range(4)]
        for t in threads:
            t.start()
        killed = 0
        while killed < kills or len(sent) < posts:
            time.sleep(every_s)
            workers = gunicorn_workers(service)
            if workers and killed < kills:
                os.kill(random.choice(workers), signal.SIGKILL)
                killed += 1
        stop.set()
        for t in threads:
            t.join()
        conn = sqlite3.connect(f"file:{service.db}?mode=ro", uri=True, timeout=30)
        stored = collections.Counter(
            round(ts - base) for (ts,) in conn.execute(
                "SELECT json_extract(body, '$.timestamp_s') FROM observations WHERE kind = 'collective' AND "
                "json_extract(body, '$.timestamp_s') >= ?", (base - 0.5,)))
        conn.close()
        twice = sum(1 for n in stored.values() if n > 1)
        lost = sum(1 for i in acked if stored.get(i, 0) == 0)
        posts_made = len(sent)
        return (f"{posts_made} posts by 4 writers, {killed} gunicorn workers SIGKILLed (one each {every_s:g} s); "
                f"answers retried with the same key "
                f"{dict(retries)}; {len(acked)} acknowledged; stored twice: {twice} (target 0), acknowledged but "
                f"lost: {lost} (target 0); not acknowledged after 200 tries: {posts_made - len(acked)}"), \
            twice == 0 and lost == 0 and len(acked) == posts_made
    return run


def item15_token_in_files(service: hc.Service, lab: Lab, work: Path, root: Path = ROOT):
    """A real launcher job with ELASTIC_PREDICTOR_TOKEN set: is the token in its records.jsonl or .out file? The
    job runs checkout `root`'s launcher (PYTHONPATH; the lab's jobs get no environment of ours)."""
    def run(tally):
        secret = "tok-" + uuid.uuid4().hex
        job_dir = work / "launcher-job"
        job_dir.mkdir(mode=0o755)
        train = [sys.executable, str(ROOT / "tests" / "integration" / "train_tiny.py"), "--steps", "30",
                 "--per-gpu-batch", "4", "--dataset-size", "1000", "--compute-ms", "20", "--out",
                 str(job_dir / "samples")]
        script = job_dir / "job.sh"
        script.write_text(f"""#!/bin/bash
#SBATCH --job-name=r3-token --nodes=1 --gres=gpu:1 --output={job_dir}/job.out --chdir={job_dir} -t 5
#ELASTIC model=tiny gpus=1 per_gpu_batch=4
export ELASTIC_PREDICTOR_TOKEN={secret}
export ELASTIC_LAUNCH_REGISTRY={job_dir}/registry
export PYTHONPATH={root}
exec {sys.executable} -m elastic_launcher.cli --script "$0" --workers-per-node 1 --run-dir {job_dir}/run \\
    --predictor http://127.0.0.1:{service.port} --intra-link shm --inter-link socket --measure-steps 4 \\
    --warmup-steps 1 -- {' '.join(train)}
""")
        job = lab.sbatch(str(script))
        state = lab.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 240)
        found, modes = [], {}
        for path in sorted(job_dir.rglob("*")):
            if path.is_file() and path.name != "job.sh":
                if secret.encode() in path.read_bytes():
                    found.append(str(path.relative_to(job_dir)))
                if path.name in ("records.jsonl", "job.out"):
                    modes[path.name] = oct(path.stat().st_mode & 0o777)
        tally.add(200 if state == "COMPLETED" else 0)
        records = job_dir / "run" / "records.jsonl"
        said = ""
        if records.exists():
            said = next((f"launch config says predictor_token={json.loads(line).get('predictor_token')!r}"
                         for line in records.read_text().splitlines() if '"predictor_token"' in line), "")
        out_file = job_dir / "job.out"
        if state != "COMPLETED" and out_file.exists():   # why the job failed, in the row itself
            tail = out_file.read_text(errors="replace").strip().splitlines()[-3:]
            said += f"; job.out ends: {' / '.join(line[:200] for line in tail) or '(empty)'}"
        passed = not found and records.exists() and out_file.exists()
        return (f"launcher job {job} ({state}) with the token exported: the token appears in {found or 'no file'} "
                f"of its run dir and .out (target: none; modes {modes}); {said}"), passed
    return run


def item16_read_your_writes(service: hc.Service, runs: int = 5, after: int = 300):
    """A write, then /v1/predict until an answer reflects it, then ``after`` more answers: any older or failed?"""
    def run(tally):
        body = json.dumps({"profile": "resnet50", "gpu": "H200", "per_gpu_batch": 64,
                           "candidates": [{"layout": [2], "intra_link": "nvlink"}]}).encode()
        out, bad_total, firsts = [], 0, []
        for r in range(runs):
            row = [{"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [2], "intra_link": "nvlink",
                    "per_gpu_batch": 64, "iter_s": 0.0325 * (1 + 0.001 * r)}]
            status, answer = request(service.port, "POST", "/v1/observations", json.dumps(row).encode(), AUTH)
            pending = json.loads(answer)["model_version_pending"]
            t0 = time.perf_counter()
            while True:
                status, answer = send(service.port, tally, "POST", "/v1/predict", body)
                if status == 200 and json.loads(answer)["model_generation"] >= pending:
                    break
                if time.perf_counter() - t0 > 60:
                    break
                time.sleep(0.02)
            first_s = time.perf_counter() - t0
            firsts.append(first_s)
            bad = 0
            for _ in range(after):
                status, answer = send(service.port, tally, "POST", "/v1/predict", body)
                if status != 200 or json.loads(answer)["model_generation"] < pending:
                    bad += 1
            bad_total += bad
            out.append(f"{bad}/{after} (first fresh {first_s:.1f} s)")
        return (f"{runs} runs: stale or failed answers after the first that reflected the write: "
                f"{'; '.join(out)} (target 0 in every run)"), bad_total == 0 and max(firsts) <= STALENESS_TARGET_S, {
            "staleness": f"a legitimate write reflected after {min(firsts):.1f}-{max(firsts):.1f} s in {runs} runs "
                         f"(<= {STALENESS_TARGET_S:g} s); {bad_total} older or failed answers after (target 0)"}
    return run


# --- the run ------------------------------------------------------------------------------------------------------
LABELS = {
    1: "three 1-second jobs of one user post 20 signed rows each after they ended (2x4, 4x4 5x slower)",
    3: "one credential (the tool token) from 8 addresses, 64 requests in progress each (256 KiB bodies held one "
       "byte short)",
    4: "valid munge credentials of one user for made-up job ids, 8 threads",
    5: "hostile decision bands (0 nodes, 2.5 or 8 GPUs a node, 8 nodes, -1 switches) and 9 MB of bands to the real hook",
    6: "one job's 3.85 MB profiles, a squat on 'llama-70b', three anonymous readers",
    8: "240 connections each send all but the last byte of a 4 MiB body",
    9: "four anonymous threads post the largest valid /v1/plan bodies",
    10: "GET /metrics with the database's disk full",
    11: "unchecked collectives: nvswitch, a CPU job's ib/nvlink, 20,480 rows of one job at one ib point",
    13: "retried writes (Idempotency-Key) while gunicorn workers are SIGKILLed",
    15: "the predictor token in a launcher job's records.jsonl and .out",
    16: "read-your-writes: 300 /v1/predict after the first answer reflecting a write, 5 runs",
}


def run_all(root: Path, items: tuple[int, ...], lab_dir: Path, work: Path, args) -> list[dict]:
    rows = []
    extra_env = dict(kv.split("=", 1) for kv in getattr(args, "service_env", []))
    plain_items = [i for i in (16, 9, 8, 3, 13) if i in items]
    if plain_items:
        db = work / "plain.db"
        hc.seed(root, db)
        service = Service(root, db, 2, work / "plain.log", {"ELASTIC_PREDICTOR_ADMIN_TOKEN": ADMIN_TOKEN, **extra_env})
        try:
            service.wait_ready()
            attacks = {16: item16_read_your_writes(service), 9: item9_decisions(service, args.flood_s),
                       8: item8_front_memory(service), 3: item3_one_token_many_addresses(service),
                       13: item13_retries_under_sigkill(service, args.posts, 8, 1.5)}
            for item in plain_items:
                rows.append(attack(service.port, item, LABELS[item], attacks[item]))
        finally:
            service.stop()
    if 10 in items:
        made = item10_full_disk(root, work)
        if made is None:
            rows.append({"item": 10, "attack": LABELS[10], "before": None, "during": None, "attacker": "-",
                         "check": "SKIP: cannot mount a tmpfs here (not root?)", "latency_ok": True, "verdict": "SKIP",
                         "seconds": 0})
        else:
            service, run = made
            try:
                rows.append(attack(service.port, 10, LABELS[10], run, victim_503_ok=True))
            finally:
                service.stop()
                subprocess.run(["umount", str(work / "full")], check=False)
    if 5 in items:
        rows.append(attack(None, 5, LABELS[5], item5_hostile_tables(work)))
    for users in args.honest_users if 1 in items else ():   # #41.1: item 1 against 1, 2, 3 and 8 honest users
        lab = Lab(lab_dir)
        db = work / f"honest{users}.db"
        seed_history(root, db, users)
        service = Service(root, db, 2, work / f"honest{users}.log", {**lab.service_env(), **extra_env})
        try:
            service.wait_ready()
            rows.append(attack(service.port, 1, f"{LABELS[1]}, against the history of {users} honest "
                                                f"user{'s' if users > 1 else ''} (8 jobs)",
                               item1_several_jobs(service, lab)))
        finally:
            service.stop()
            lab.close()
    munge_items = [i for i in (4, 6, 11, 15) if i in items]
    if munge_items:
        lab = Lab(lab_dir)
        db = work / "munge.db"
        seed_history(root, db)
        service = Service(root, db, 2, work / "munge.log", {**lab.service_env(), **extra_env})
        try:
            service.wait_ready()
            attacks = {4: item4_made_up_job_ids(service, lab, args.credentials),
                       6: item6_profiles(service, lab, args.profiles), 11: item11_collectives(service, lab, 20_480),
                       15: item15_token_in_files(service, lab, work, root)}
            for item in munge_items:
                rows.append(attack(service.port, item, LABELS[item], attacks[item],
                                   p50_target_ms=P99_TARGET_MS if item == 4 else None))
        finally:
            service.stop()
            lab.close()
    return sorted(rows, key=lambda r: r["item"])


def fmt_victim(v: dict | None) -> str:
    if v is None:
        return "-"
    return f"p50 {v['p50']:.1f} / p99 {v['p99']:.1f} ms, {v['codes']}"


def table(rows: list[dict]) -> str:
    out = ["| item | attack | victim /v1/plan before | victim /v1/plan during (p99 <= 100 ms?) | attacker's answers | "
           "memory, disk, others moved, staleness | check | verdict |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        during = fmt_victim(r["during"])
        if r["during"] is not None:
            during += " (yes)" if r["latency_ok"] else " (no)"
        measures = "; ".join(f"{k}: {v}" for k, v in r.get("measures", {}).items()) or "-"
        failed = f" ({'; '.join(r['failed_on'])})" if r.get("failed_on") else ""
        out.append(f"| #24.{r['item']} | {r['attack']} | {fmt_victim(r['before'])} | {during} | {r['attacker']} | "
                   f"{measures} | {r['check']} | **{r['verdict']}**{failed} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose service is attacked")
    ap.add_argument("--lab", type=Path, default=Path(os.environ.get("ELASTIC_SLURM_LAB", DEFAULT_LAB)))
    ap.add_argument("--items", default=",".join(map(str, ALL_ITEMS)))
    ap.add_argument("--flood-s", type=float, default=30.0, help="item 9's flood")
    ap.add_argument("--posts", type=int, default=400, help="item 13's posts")
    ap.add_argument("--credentials", type=int, default=600, help="item 4's credentials")
    ap.add_argument("--honest-users", type=lambda v: [int(x) for x in v.split(",")], default=list(HONEST_USERS),
                    help="item 1: the honest history's user counts, one run each (default 1,2,3,8)")
    ap.add_argument("--profiles", type=int, default=100, help="item 6's profiles")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--service-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an extra variable for the attacked service (before/after pairs, e.g. "
                         "ELASTIC_PREDICTOR_MUNGE_IN_PROCESS=0 for the `unmunge` run a credential)")
    ap.add_argument("--keep-work", action="store_true",
                    help="keep the work directory (service logs, item 15's launcher job dir and job.out) and print it")
    args = ap.parse_args(argv)
    items = tuple(int(x) for x in args.items.split(",") if x)
    started, load = time.time(), os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="hostile-round3-"))
    try:
        rows = run_all(args.root.resolve(), items, args.lab, work, args)
    finally:
        subprocess.run(["umount", str(work / "full")], capture_output=True, check=False)
        if args.keep_work:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    header = (f"{len(os.sched_getaffinity(0))} usable cores shared with other work (load average {load:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after), Python {platform.python_version()}, {date.today().isoformat()}, "
              f"{time.time() - started:.0f} s; victim: POST /v1/plan at {PLAN_RATE:g}/s from {VICTIM_ADDRESS}, "
              f"{BASELINE_S:g} s before each attack and all through it.")
    text = header + "\n\n" + table(rows) + "\n"
    print(text)
    if args.output:
        command = "python bench/hostile_round3.py " + " ".join(sys.argv[1:] if argv is None else argv)
        args.output.write_text(f"# Hostile clients, round 3 (#24)\n\nCommand: `{command.strip()}`\n\n{text}")
    return 0 if all(r["verdict"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
