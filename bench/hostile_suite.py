"""The hostile-client suite in one table (issue #14, "Done when"): attacks tried, 5xx, memory and disk growth,
/v1/plan p99 under slow connections, poisoning impact.

Run: `python bench/hostile_suite.py [--full] [--output bench/results/hostile_suite.md]`

It runs the three benches as libraries, each in its quick form unless `--full`:
- bench/hostile_clients.py (plots, /v1/predict memory, /v1/plan disk) against `elastic-predictor serve`, plot attacks
  5 s each (20 s with --full), and, on a second served instance, the malformed bodies of item 7 (`MALFORMED`);
- bench/slow_clients.py on `serve` (nginx): K = 0 and 200 connections of each slow variant
  (--full: K = 0, 2, 8, 200);
- bench/poisoning.py: one job's 200 made-up rows with one vote per owner, weighed by its agreement (the model), and
  with every row a vote;
- one address holding `IDLE_HELD` idle connections (issue #24, item 3), against `serve`: how many of
  `IDLE_PROBES` GET /healthz from another address (127.0.0.2, each on a fresh connection) are answered 200, and
  their p99 (`--no-idle` leaves it out).
- bench/hostile_round2.py (issue #24, items 7, 2, 12, 14) against `serve`'s default front end: the issue's 300
  profiles of one job, 4 rows each (`ROUND2_PROFILES`), with the fit's time and a legitimate write's staleness.
- bench/hostile_round3.py (issue #24, items 1, 4, 5, 6, 8, 9, 10, 11, 13, 15, 16) with a victim POSTing /v1/plan at
  20/s from another address: all of them when the Slurm testbed is up in `--lab` (default $ELASTIC_SLURM_LAB, else
  /var/tmp/elastic-slurm-dev: items 1, 4, 6, 11, 15 need its munged and jobs), else the others and a row naming
  the ones left out (`--round3-items` picks, '' for none). Its table has the issue's columns: the victim's
  /v1/plan p99 during each attack (target <= 100 ms), the victim's 5xx, the attacker's answers, memory and disk
  growth with their bound, others' plan and predictions moved, model staleness ("-" where the item does not
  measure one), the item's own check, and its verdict: the check and, for every item, the victim's p99 and 5xx
  targets (what it failed on follows a FAIL).
The per-bench tables stay in their own results files; this prints the summary and the raw rows it came from.
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import hostile_clients  # noqa: E402
import hostile_round2  # noqa: E402
import hostile_round3  # noqa: E402
import hostile_round4  # noqa: E402
import poisoning  # noqa: E402
import slow_clients  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MB = 1024 * 1024
# item 7: (label, headers, body); each must be a 4xx
MALFORMED = [
    ("/v1/plan, 50 MB body (Content-Length)", {"Content-Type": "application/json"}, b"x" * (50 * MB)),
    ("/v1/plan, 50 MB chunked body", {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
     b"x" * (50 * MB)),
    ("/v1/plan, JSON nested 100,000 deep", {"Content-Type": "application/json"}, b"[" * 100_000 + b"]" * 100_000),
    ("/v1/plan, truncated JSON", {"Content-Type": "application/json"}, b'{"source": "launcher", "directives": '),
    ("/v1/observations, NaN seconds", {"Content-Type": "application/json"},
     b'[{"kind": "collective", "op": "allreduce", "link": "ib", "world": 2, "bytes": 1, "seconds": NaN}]'),
]


def _chunked(body: bytes, size: int = 1 << 20) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


def malformed(work: Path) -> dict:
    """The MALFORMED bodies against a served instance: a `Tally` row shaped like hostile_clients' rows."""
    db = work / "malformed.db"
    hostile_clients.seed(ROOT, db)
    service = hostile_clients.Service(ROOT, db, 2, work / "malformed.log")
    tally = hostile_clients.Tally()
    try:
        service.wait_ready()
        rss, size = service.worker_rss_mb(), hostile_clients.db_mb(db)
        auth = {"Authorization": f"Bearer {hostile_clients.TOKEN}"}
        for label, headers, body in MALFORMED:
            path = "/v1/observations" if "observations" in label else "/v1/plan"
            if headers.get("Transfer-Encoding") == "chunked":
                body = _chunked(body)
            hostile_clients.send(service.port, tally, "POST", path, body, {**headers, **auth})
        return {"attack": f"malformed bodies ({len(MALFORMED)}: 50 MB, 50 MB chunked, nested, truncated, NaN)",
                "tally": tally, "rss": (rss, service.worker_rss_mb()), "db": (size, hostile_clients.db_mb(db)),
                "plan_p99": None}
    finally:
        service.stop()


IDLE_HELD, IDLE_PROBES, IDLE_PROBE_TIMEOUT_S = 1000, 40, 5.0
OTHER_ADDRESS = "127.0.0.2"    # Linux routes all of 127.0.0.0/8 to loopback


def idle_flood(work: Path) -> dict:
    """127.0.0.1 holds IDLE_HELD connected, silent connections to `serve` (2 workers) while
    OTHER_ADDRESS sends IDLE_PROBES GET /healthz, each on a fresh connection, one after another."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_PREDICTOR_")}
    with open(work / "idle.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--db", str(work / "idle.db")],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    held: list[socket.socket] = []
    probes: list[tuple[int, float]] = []
    try:
        deadline = time.monotonic() + 120
        while _healthz(port, "127.0.0.1")[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not come up (see {work}/idle.log)")
            time.sleep(0.2)
        for _ in range(IDLE_HELD):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            held.append(sock)
        time.sleep(1.0)
        probes = [_healthz(port, OTHER_ADDRESS) for _ in range(IDLE_PROBES)]
    finally:
        for sock in held:
            sock.close()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"held": IDLE_HELD, "probes": IDLE_PROBES,
            "answered": sum(status == 200 for status, _ in probes),
            "within_100ms": sum(status == 200 and seconds <= 0.1 for status, seconds in probes),
            "statuses": dict(collections.Counter(status for status, _ in probes)),
            "p99_ms": hostile_clients.p99_ms([seconds for _, seconds in probes])}


def _healthz(port: int, source: str) -> tuple[int, float]:
    """(status, seconds) of one GET /healthz from `source`; status 0: no answer within IDLE_PROBE_TIMEOUT_S."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=IDLE_PROBE_TIMEOUT_S, source_address=(source, 0))
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        response.read()
        return response.status, time.monotonic() - started
    except (OSError, http.client.HTTPException):
        return 0, time.monotonic() - started
    finally:
        conn.close()


ROUND2_PROFILES = 300    # #24.2's reproduction: one job's 300 profiles, 4 rows each ("Done when": the fit under 5 s)
ROUND3_LAB_ITEMS = (1, 4, 6, 11, 15)   # need the Slurm testbed (munged, jobs)


def round3(work: Path, items: tuple[int, ...], lab: Path, full: bool, root: Path = ROOT) -> dict:
    """bench/hostile_round3.py's `items` against the service of checkout `root`; those that need the testbed
    only when it is up in `lab`."""
    left_out: tuple[int, ...] = ()
    if any(i in ROUND3_LAB_ITEMS for i in items):
        try:
            if not (lab / "etc" / "slurm.conf").is_file():     # no testbed there: no Slurm command waits on it
                raise RuntimeError(f"no testbed in {lab} (elastic-slurm testbed up --lab {lab})")
            hostile_round3.Lab(lab)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            left_out = tuple(i for i in items if i in ROUND3_LAB_ITEMS)
            items = tuple(i for i in items if i not in ROUND3_LAB_ITEMS)
            left_out_why = str(exc)
    args = argparse.Namespace(flood_s=30.0 if full else 10.0, posts=400, credentials=600, profiles=100,
                              keep_work=False, honest_users=list(hostile_round3.HONEST_USERS))
    rows = hostile_round3.run_all(root, items, lab, work, args) if items else []
    return {"rows": rows, "left_out": left_out, "why": left_out_why if left_out else ""}


def run(full: bool, idle: bool = True, round3_items: tuple[int, ...] = (),
        lab: Path = hostile_round3.DEFAULT_LAB, round4_items: tuple[str, ...] = ()) -> dict:
    work = Path(tempfile.mkdtemp(prefix="hostile-suite-"))
    try:
        rows = hostile_clients.run(ROOT, 2, 20.0 if full else 5.0, work)
        rows.append(malformed(work))
        db = str(work / "slow.db")
        slow_clients.seed(db)
        ks = slow_clients.KS if full else (0, 200)
        slow, _ = slow_clients.bench_server("nginx", db, 2, 2.0, 40.0, ks, slow_clients.VARIANTS, 0,
                                            subprocess.DEVNULL)
        idle = [idle_flood(work)] if idle else []
        (work / "round2").mkdir()
        round2 = hostile_round2.run(ROOT, ROUND2_PROFILES, work / "round2")
        (work / "round3").mkdir()
        rounds3 = round3(work / "round3", round3_items, lab, full)
        (work / "round4").mkdir()
        rounds4 = hostile_round4.run_all(ROOT, round4_items, lab, work / "round4")
    finally:
        subprocess.run(["umount", str(work / "round3" / "full")], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
    poison = poisoning.compare()
    return {"hostile": rows, "slow": slow, "poison": poison, "idle": idle, "round2": round2, "round3": rounds3,
            "round4": rounds4}


def round3_table(res: dict) -> str:
    """Round 3 in the issue's columns (#24, "Done when"): "-" where an item does not measure one."""
    out = ["| #24 item | attack | victim /v1/plan p99 during (target <= 100 ms) | victim 5xx or no answer | "
           "attacker's answers | memory growth (bound) | disk growth (bound) | others' plan and predictions moved "
           "(target <= 10%, plan unchanged) | model staleness (target <= 5 s) | check | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        during = r["during"]
        p99 = "-" if during is None else f"{during['p99']:.1f} ms ({'yes' if r['latency_ok'] else 'no'}; p50 " \
                                         f"{during['p50']:.1f}, before p99 {r['before']['p99']:.1f})"
        errors = "-" if during is None else \
            f"{during['errors']} of {during['n']}" + (f" ({during['codes']})" if during["errors"] else "")
        measures = " | ".join(r.get("measures", {}).get(k) or "-" for k in hostile_round3.MEASURES)
        failed = f" ({'; '.join(r['failed_on'])})" if r.get("failed_on") else ""
        out.append(f"| {r['item']} | {r['attack']} | {p99} | {errors} | {r['attacker']} | {measures} | "
                   f"{r['check']} | **{r['verdict']}**{failed} |")
    if res["left_out"]:
        out.append(f"| {', '.join(map(str, res['left_out']))} | not run: they need the Slurm testbed ({res['why']}) | "
                   + "- | " * 9)
    return "\n".join(out)


def other_items_table(round2: list[dict], idle: list[dict]) -> str:
    """#24's items 2, 3, 7, 12 and 14 (round 2 and the idle-connection attack) in round 3's columns: their
    legitimate client is /v1/plan paced at 20/s from the attacker's address (item 3: GET /healthz from another)."""
    out = ["| #24 item | attack | legitimate /v1/plan p99 during (target <= 100 ms) | legitimate client's 5xx or no "
           "answer | attacker's 5xx or no answer | memory growth (bound) | disk growth (bound) | others' plan and "
           "predictions moved | model staleness (target <= 5 s) | check | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in round2:
        item = r["attack"].split()[0].removeprefix("#24.")
        p99, n = r["plan_p99"]
        bound = r["bounds"]
        failed = f" ({'; '.join(r['failed_on'])})" if r["failed_on"] else ""
        out.append(f"| {item} | {r['attack'].split(' ', 1)[1]} | {p99:.1f} ms ({'yes' if p99 <= hostile_clients.P99_TARGET_MS else 'no'}; "
                   f"{r['over_100ms']} of {n} over 100 ms) | {r.get('plan_errors', '-')} of {n} | "
                   f"{r['tally'].server_errors} of {r['tally'].total} | largest worker {r['rss'][0]:.0f} -> "
                   f"{r['rss'][1]:.0f} MB (bound +{bound['memory']:.0f} MB: {bound['memory_why']}) | DB "
                   f"{r['db'][0]:.1f} -> {r['db'][1]:.1f} MB (bound +{bound['disk']:.1f} MB: {bound['disk_why']}) | "
                   f"{r.get('measures', {}).get('moved') or '-'} | "
                   f"{r.get('measures', {}).get('staleness') or '-'} | {' '.join(r['check'].split())} | "
                   f"**{r['verdict']}**{failed} |")
    for r in idle:
        failed = r["probes"] - r["statuses"].get("200", r["statuses"].get(200, 0))
        verdict = "PASS" if r["within_100ms"] >= 36 else "FAIL"
        out.append(f"| 3 | one address holds {r['held']} idle connections | GET /healthz "
                   f"from another address, not /v1/plan: p99 {r['p99_ms']:.0f} ms | {failed} of {r['probes']} not 200 "
                   f"({r['statuses']}) | - | - | - | - | - | {r['within_100ms']} of {r['probes']} answered 200 within "
                   f"100 ms (target >= 36) | **{verdict}** |")
    return "\n".join(out)


def idle_row(idle: list[dict]) -> str:
    fronts = "; ".join(f"{r['answered']} of {r['probes']} answered 200 "
                       f"({r['within_100ms']} within 100 ms; p99 {r['p99_ms']:.0f} ms over all; statuses {r['statuses']})"
                       for r in idle)
    return (f"| one address holds {IDLE_HELD} idle connections; GET /healthz from another | "
            f"{fronts or 'not run'} |")


def summary(res: dict) -> str:
    rows, slow, poison = res["hostile"], res["slow"], res["poison"]
    requests = sum(r["tally"].total for r in rows)
    errors = sum(r["tally"].server_errors for r in rows)
    busy = sum(r["tally"].busy for r in rows)
    rss = max(rows, key=lambda r: r["rss"][1] - r["rss"][0])
    disk = max(rows, key=lambda r: r["db"][1] - r["db"][0])
    held = [r for r in slow if r["k"]]
    worst = max(held, key=lambda r: r["p99"])
    capped, uncapped = (poison[w] for w in poisoning.WEIGHTINGS)
    attacks = len(rows) + len(held) + 1
    fmt = slow_clients.fmt_ms
    out = ["| figure | result |", "|---|---|",
           f"| attacks tried | {attacks}: {len(rows) - 1} hostile-client attacks (plots, /v1/predict, /v1/plan), "
           f"{len(MALFORMED)} malformed bodies, {len(held)} slow-connection cases "
           f"({', '.join(slow_clients.VARIANTS)} x K = {', '.join(str(r) for r in sorted({r['k'] for r in held}))}), "
           "1 poisoning attack (200 rows) |",
           f"| 5xx or no answer | {errors} of {requests} requests (besides them {busy} answers 429 'too many plots' "
           "with Retry-After: the renderer's full queue, backpressure on the asking client)"
           + (f"; {rows[-1]['tally'].server_errors} of them the malformed bodies' own (nginx, `serve`'s default "
              "front end, answers a 50 MB chunked body 413 at its limit and its stream layer resets the connection "
              "while the client still sends: the sender sees a reset, no one else anything)"
              if rows[-1]["tally"].server_errors else "") + " |",
           f"| worker memory growth | at most {rss['rss'][1] - rss['rss'][0]:+.0f} MB in one attack ({rss['attack']}: "
           f"{rss['rss'][0]:.0f} -> {rss['rss'][1]:.0f} MB); {rows[0]['rss'][0]:.0f} -> {rows[-2]['rss'][1]:.0f} MB "
           "over the hostile-client run |",
           f"| disk growth | at most {disk['db'][1] - disk['db'][0]:+.1f} MB in one attack ({disk['attack']}: "
           f"{disk['db'][0]:.1f} -> {disk['db'][1]:.1f} MB; decisions are pruned to their 16 MiB budget) |",
           f"| /v1/plan p99 with slow connections held | at most {fmt(worst['p99'], 2.0)} ms ({worst['variant']}, "
           f"K = {worst['k']}; {worst['failed']} probes failed, {sum(r['over'] for r in held)} of "
           f"{len(held) * slow_clients.PROBES} over 100 ms); "
           f"{fmt(next(r['p99'] for r in slow if not r['k']), 2.0)} ms with none |",
           f"| poisoning impact ({poisoning.WEIGHTINGS[0]}) | others' predictions moved "
           f"{' / '.join(f'{m:+.1%}' for m in capped['moved'])} at 1 / 2 / 4 nodes; plan {capped['before']} -> "
           f"{capped['after']} ({'changed' if capped['before'] != capped['after'] else 'unchanged'}) |",
           f"| poisoning impact ({poisoning.WEIGHTINGS[1]}) | {' / '.join(f'{m:+.1%}' for m in uncapped['moved'])}; plan "
           f"{uncapped['before']} -> {uncapped['after']} |", idle_row(res.get("idle", []))]
    out += [f"| {r['attack']} (#24, `serve`'s default front end) | legitimate /v1/plan p99 {r['plan_p99'][0]:.1f} ms; "
            f"{r['tally'].server_errors} 5xx of {r['tally'].total}; worker {r['rss'][0]:.0f} -> {r['rss'][1]:.0f} MB, "
            f"DB {r['db'][0]:.1f} -> {r['db'][1]:.1f} MB; {' '.join(r['check'].split())} |" for r in res.get("round2", [])]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the benches' full forms (longer plot attacks, all K)")
    ap.add_argument("--output", default=None, help="also write the summary and raw rows (markdown) here")
    ap.add_argument("--no-idle", action="store_true", help="leave the idle-connection attack out")
    ap.add_argument("--only-idle", action="store_true", help="run only the idle-connection attack, print its rows")
    ap.add_argument("--round3-items", default=",".join(map(str, hostile_round3.ALL_ITEMS)),
                    help="bench/hostile_round3.py's items to run ('' for none; 1, 4, 6, 11, 15 need the testbed)")
    ap.add_argument("--lab", type=Path, default=Path(os.environ.get("ELASTIC_SLURM_LAB", hostile_round3.DEFAULT_LAB)),
                    help="the Slurm testbed round 3's job items use")
    ap.add_argument("--only-round3", action="store_true", help="run only round 3, print its table")
    ap.add_argument("--round4-items", default=",".join(hostile_round4.ALL_ITEMS),
                    help="bench/hostile_round4.py's items (#41; '' for none; 11a, 11b, 11c, 4 need the testbed)")
    ap.add_argument("--only-round4", action="store_true", help="run only round 4 (#41), print its table")
    ap.add_argument("--root", type=Path, default=ROOT,
                    help="with --only-round3: the checkout whose service is attacked (an older commit's export)")
    args = ap.parse_args(argv)
    round3_items = tuple(int(x) for x in args.round3_items.split(",") if x)
    round4_items = tuple(x for x in args.round4_items.split(",") if x)
    if args.only_round4:
        return hostile_round4.main(["--items", ",".join(round4_items), "--lab", str(args.lab)]
                                   + (["--output", args.output] if args.output else []))
    if args.only_round3:
        started, load = time.time(), os.getloadavg()[0]
        work = Path(tempfile.mkdtemp(prefix="hostile-suite-"))
        try:
            res3 = round3(work, round3_items, args.lab, args.full, args.root.resolve())
        finally:
            subprocess.run(["umount", str(work / "full")], capture_output=True, check=False)
            shutil.rmtree(work, ignore_errors=True)
        text = (f"Hostile-client suite, round 3 only, {len(os.sched_getaffinity(0))} usable cores shared with other "
                f"users (load average {load:.2f} before, {os.getloadavg()[0]:.2f} after), Python "
                f"{platform.python_version()}, {date.today().isoformat()}, {time.time() - started:.0f} s; victim: POST "
                f"/v1/plan at {hostile_round3.PLAN_RATE:g}/s from {hostile_round3.VICTIM_ADDRESS}.\n\n"
                + round3_table(res3) + "\n")
        print(text)
        if args.output:
            command = "python bench/hostile_suite.py " + " ".join(sys.argv[1:] if argv is None else argv)
            Path(args.output).write_text(f"# Hostile-client suite, round 3 (issue #24)\n\nCommand: `{command.strip()}`"
                                         f"\n\n{text}")
        return 0 if all(r["verdict"] != "FAIL" for r in res3["rows"]) else 1
    if args.only_idle:
        work = Path(tempfile.mkdtemp(prefix="hostile-suite-"))
        try:
            idle = [idle_flood(work)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(idle_row(idle), *(json.dumps(r) for r in idle), sep="\n")
        return 0
    started, load = time.time(), os.getloadavg()[0]
    res = run(args.full, not args.no_idle, round3_items, args.lab, round4_items)
    header = (f"Hostile-client suite ({'full' if args.full else 'quick'}), {len(os.sched_getaffinity(0))} usable "
              f"cores shared with other users (load average {load:.2f} before, {os.getloadavg()[0]:.2f} after), "
              f"Python {platform.python_version()}, {date.today().isoformat()}, {time.time() - started:.0f} s.")
    raw = ["", "Raw: hostile clients (bench/hostile_clients.py's table)", "", hostile_clients.table(res["hostile"]),
           "", "Raw: slow connections (bench/slow_clients.py's rows)", "",
           *(json.dumps(r) for r in res["slow"]), "", "Raw: poisoning (bench/poisoning.py's impact)", "",
           json.dumps(res["poison"]),
           "", "Raw: idle connections from one address", "", *(json.dumps(r) for r in res["idle"]),
           "", "Raw: round 2 (bench/hostile_round2.py's table)", "", hostile_round2.table(res["round2"])]
    text = (header + "\n\n" + summary(res) + "\n\nRound 3 (bench/hostile_round3.py; victim: POST /v1/plan at "
            f"{hostile_round3.PLAN_RATE:g}/s from {hostile_round3.VICTIM_ADDRESS})\n\n" + round3_table(res["round3"])
            + "\n\n#24's other items (2, 3, 7, 12, 14: round 2 and the idle connections) in the same columns\n\n"
            + other_items_table(res["round2"], res["idle"]) + "\n\nRound 4 (#41; bench/hostile_round4.py)\n\n"
            + hostile_round4.table(res["round4"]) + "\n" + "\n".join(raw) + "\n")
    print(text)
    if args.output:
        command = "python bench/hostile_suite.py " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.output).write_text(f"# Hostile-client suite (issue #14)\n\nCommand: `{command.strip()}`\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
