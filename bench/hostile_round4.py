"""Hostile clients, round 4 (issue #41): the attacks of #41 that are not the poisoning of the shared fit, each with
the victim's /v1/plan p99 and 5xx during it (hostile_round3.attack: the same columns and targets), its bounds and
its own check.

Run: `python bench/hostile_round4.py [--items 11a,11b,11c,4,6,8,9] [--lab LAB] [--output FILE]`
(`bench/hostile_suite.py --round4-items ...` runs it in the suite). Items 11a, 11b, 11c and 4 need the Slurm
testbed up in `--lab` (default $ELASTIC_SLURM_LAB): they install the real job_submit hook there (JobSubmitPlugins=lua)
and remove it at the end.

- 11a: three scripts of one user that the service refuses (400: an invalid UTF-8 byte in an #ELASTIC comment, 66
  #ELASTIC lines), then 20 #ELASTIC jobs of another user, every one asking the service (cache TTL 0): how many planned
  (target 20; before #41 the breaker opened on the 400s and none was).
- 11b: a hung service (accepts, never answers), 10 submissions in one breaker period: how many waited a budget
  (target 1; K = 3 before).
- 11c: a plain job whose header is 2 MB of comment lines, sbatch with the hook off and on, alternating: the median
  difference (target <= 10 ms; +308 ms before, bench/results/hook_2mb_header.md).
- 4: 8 addresses x 256 idle connections hold every slot but the hook's (`serve --hook-from`), then 20 uncached
  #ELASTIC submissions: how many planned (target 20), and whether another address still gets a connection (no).
- 6: SIGKILL of the nginx master: seconds until /healthz answers again, the old master's workers left (target:
  healed within 10 s, none left).
- 8: two clients of the tool token use one Idempotency-Key with different bodies: the second is refused (409) and
  the rows stored are the first body's; the first client's retry replays.
- 9: a bare `serve` (no token, munge off): writes refused, the database 0600.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import hostile_clients as hc  # noqa: E402
import hostile_round3 as r3  # noqa: E402

ALL_ITEMS = ("11a", "11b", "11c", "4", "10", "6", "8", "9")
ELASTIC = "#ELASTIC model=resnet50 gpus=2-8\n#ELASTIC per_gpu_batch=64\n"
SCRIPT = "#!/bin/bash\n#SBATCH -N1 --gpus=4 -t 5\n" + ELASTIC + "srun true\n"
PLANNED = "sbatch: elastic: 2 nodes x 4 GPUs"
HOOK_HOSTS = "127.0.0.1,127.0.0.2"        # slurmctld's (the lab's) and the victim's: the hook's kind of client
HEAL_TARGET_S = 10.0
LABELS = {
    "11a": "three scripts of one user the service refuses (400), then 20 #ELASTIC jobs of another user (uncached)",
    "11b": "a hung service (accepts, never answers), 10 submissions in one breaker period",
    "11c": "a plain job with a 2 MB header of comment lines, sbatch hook off / on, 15 each alternating",
    "4": "8 addresses x 256 idle connections hold every other slot; 20 uncached #ELASTIC submissions",
    "10": "1 GiB of request bodies just under the size cap from 8 addresses, 4 senders each, while the hook's kind plans",
    "6": "SIGKILL of the nginx master",
    "8": "two clients of the tool token, one Idempotency-Key, different bodies",
    "9": "a bare serve: no token, munge off",
}


class HookLab:
    """The testbed with the real job_submit hook installed against `url` (r3.Lab for the jobs, cancelled at close)."""

    def __init__(self, lab: Path):
        from slurm_plugin.lab.testbed import Testbed  # noqa: PLC0415
        self.lab = r3.Lab(lab)
        self.bed = Testbed(self.lab.config)
        self.others = [ln for ln in self.bed.slurm_conf_lines() if not ln.startswith(("JobSubmitPlugins",
                                                                                      "CliFilterPlugins"))]
        self.work = Path(tempfile.mkdtemp(prefix="hostile-round4-jobs-"))
        os.chmod(self.work, 0o755)

    def enable(self, url: str | None, budget_ms: int = 100, failures: int = 3, open_s: float = 300.0) -> None:
        from slurm_plugin.installer import PluginConfig, install  # noqa: PLC0415
        if url is not None:
            install(PluginConfig(self.bed.config.etc, url, timedelta(milliseconds=budget_ms), failures,
                                 timedelta(seconds=open_s)))
        self.bed.set_slurm_conf_lines(self.others + (["JobSubmitPlugins=lua"] if url is not None else []))
        self.bed.reconfigure()
        time.sleep(1)

    def sbatch(self, text: str | bytes, user: str | None = None) -> tuple[float, str]:
        """(seconds, stderr) of one held sbatch of `text` (on stdin), as `user`."""
        argv = ["sbatch", "--parsable", "-H", "--output=/dev/null"]
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        data = text.encode() if isinstance(text, str) else text
        t0 = time.perf_counter()
        proc = subprocess.run(argv, input=data, env=self.lab.env, capture_output=True, timeout=120)
        seconds = time.perf_counter() - t0
        if proc.returncode == 0:
            self.lab.jobs.append(int(proc.stdout.split(b";")[0]))
        return seconds, proc.stderr.decode(errors="replace")

    def close(self) -> None:
        self.enable(None)
        self.lab.close()
        shutil.rmtree(self.work, ignore_errors=True)


def _service(root: Path, work: Path, name: str, *args: str, env: dict | None = None) -> hc.Service:
    db = work / f"{name}.db"
    hc.seed(root, db)
    service = hc.Service(root, db, 2, work / f"{name}.log", env or {}, args=args)
    service.wait_ready()
    return service


def item11a_bad_scripts(service: hc.Service, hl: HookLab):
    def run(tally):
        hl.enable(f"http://127.0.0.1:{service.port}", failures=3, open_s=300)
        bad = [SCRIPT.replace("srun true", "#ELASTIC gpus=2-8 # caf\xe9\nsrun true").encode("latin-1"),
               ("#!/bin/bash\n#SBATCH -N1 --gpus=4\n" + "#ELASTIC per_gpu_batch=64\n" * 66 + "srun true\n").encode()]
        said = [hl.sbatch(text, user=r3.ATTACKER)[1] for text in (bad[0], bad[1], bad[1])]
        refused = sum("HTTP 400" in s for s in said)
        others = [hl.sbatch(SCRIPT)[1] for _ in range(20)]
        for s in said + others:
            tally.add(200 if s.startswith(PLANNED) else 400 if "HTTP 400" in s else 0)
        planned = sum(s.startswith(PLANNED) for s in others)
        skipped = next((s.strip() for s in others if not s.startswith(PLANNED)), "")
        return (f"{refused} of 3 bad scripts answered 400 (the job's problem); then {planned} of 20 #ELASTIC jobs of "
                f"another user planned (target 20){'; first not planned: ' + skipped if skipped else ''}"), \
            planned == 20 and refused == 3
    return run


def item11b_hung_service(hl: HookLab):
    def run(tally):
        with socket.socket() as hole:
            hole.bind(("127.0.0.1", 0))
            hole.listen(64)     # accepts (the kernel does), never answers
            hl.enable(f"http://127.0.0.1:{hole.getsockname()[1]}", failures=3, open_s=300)
            said = [hl.sbatch(SCRIPT) for _ in range(10)]
        waited = sum("prediction skipped (timeout" in s for _, s in said)
        for _, s in said:
            tally.add(0 if "timeout" in s else 200)
        times = ", ".join(f"{seconds * 1000:.0f}" for seconds, _ in said[:4])
        return (f"{waited} of 10 submissions waited for the budget (target 1: one per breaker period; K = 3 before), "
                f"the others skipped at once; sbatch ms of the first four: {times}"), waited == 1
    return run


def item11c_2mb_header(hl: HookLab, rounds: int = 15):
    def run(tally):
        big = "#!/bin/bash\n#SBATCH -N1 --gpus=4 -t 5\n" + ("# " + "x" * 61 + "\n") * 32768 + "srun true\n"
        off, on = [], []
        log = hl.bed.config.lab / "log" / "slurmctld.log"
        offset = log.stat().st_size
        for _ in range(rounds):
            hl.enable(None)
            off.append(hl.sbatch(big)[0])
            hl.enable("http://127.0.0.1:9")
            seconds, said = hl.sbatch(big)
            on.append(seconds)
            tally.add(200 if not said.strip() else 0)
        added = (statistics.median(on) - statistics.median(off)) * 1000
        with open(log, "rb") as f:   # the hook's own scan inside slurmctld, from its log line (job_submit.lua)
            f.seek(offset)
            scans = [float(ms) for ms in re.findall(rb"header scan stopped at [^(]*\(([0-9.]+) ms", f.read())]
        scan = f"{statistics.median(scans):.2f} ms median, {max(scans):.2f} max" if scans else "no log line"
        return (f"sbatch median {statistics.median(off) * 1000:.0f} ms hook off, {statistics.median(on) * 1000:.0f} "
                f"ms on: {added:+.1f} ms (target <= 10 ms; {rounds} each, alternating); the hook's scan inside "
                f"slurmctld (its log, {len(scans)} lines): {scan}"), added <= 10.0, {
            "memory": "the hook reads at most 1024 lines / 64 KiB of a header (elastic_common.lua)"}
    return run


def item4_hook_path(service: hc.Service, hl: HookLab):
    def run(tally):
        hl.enable(f"http://127.0.0.1:{service.port}", failures=1000, open_s=30)
        held = []
        try:
            for k in range(8):
                for _ in range(256):
                    sock = socket.socket()
                    sock.setblocking(False)
                    sock.bind((f"127.0.0.{20 + k}", 0))
                    sock.connect_ex(("127.0.0.1", service.port))
                    held.append(sock)
            time.sleep(1.0)
            try:
                other = r3.request(service.port, "GET", "/healthz", source="127.0.0.3", timeout=5)[0]
            except OSError:
                other = 0
            said = [hl.sbatch(SCRIPT)[1] for _ in range(20)]
        finally:
            for sock in held:
                sock.close()
        planned = sum(s.startswith(PLANNED) for s in said)
        for s in said:
            tally.add(200 if s.startswith(PLANNED) else 0)
        return (f"{len(held)} connections held; another address's GET /healthz: {other or 'no connection'} "
                f"(every other slot taken); {planned} of 20 uncached #ELASTIC submissions planned (target 20)"), \
            planned == 20 and other == 0
    return run


def _cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes have used."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def item10_body_flood(service: hc.Service, total_bytes: int = 1 << 30, addresses: int = 8, senders: int = 4):
    """Anonymous POST /v1/observations bodies just under ELASTIC_PREDICTOR_MAX_BODY, ``total_bytes`` of them from
    ``addresses`` addresses with ``senders`` connections each sending body after body (``sendfile``: the sender's own
    CPU stays small on a shared host); the victim is a --hook-from host's plan (#41.10: p99 1.6 s and 0.65 s in two
    runs before the hook had a path of its own)."""
    def run(tally):
        from predictor.front_nginx import NginxLimits  # noqa: PLC0415
        body_bytes = NginxLimits().max_body - 1024
        count = max(1, total_bytes // body_bytes)
        head = (f"POST /v1/observations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {body_bytes}\r\nConnection: close\r\n\r\n").encode()
        nginx = [pid for pid in hc.tree_pids(service.proc.pid) if r3.comm(pid) == "nginx"]
        cpu0 = _cpu_s(nginx)
        next_body, lock = iter(range(count)), threading.Lock()
        with tempfile.NamedTemporaryFile() as blob:
            blob.write(b"[" + b" " * (body_bytes - 2) + b"]")
            blob.flush()

            def sender(address: str) -> None:
                while True:
                    with lock:
                        if next(next_body, None) is None:
                            return
                    try:
                        with socket.create_connection(("127.0.0.1", service.port), timeout=60,
                                                      source_address=(address, 0)) as sock, open(blob.name, "rb") as f:
                            sock.sendall(head)
                            sock.sendfile(f)
                            status = sock.makefile("rb").readline().split()
                        tally.add(int(status[1]) if len(status) > 1 else 0)
                    except OSError:
                        tally.add(0)
            threads = [threading.Thread(target=sender, args=(f"127.0.0.{40 + k}",))
                       for k in range(addresses) for _ in range(senders)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - t0
        cpu = _cpu_s(nginx) - cpu0
        return (f"{count} bodies of {body_bytes / 2**20:.2f} MiB ({count * body_bytes / 2**30:.2f} GiB) from "
                f"{addresses} addresses x {senders} senders in {seconds:.1f} s ({count * body_bytes / 2**20 / seconds:.0f} "
                f"MiB/s); nginx used {cpu:.1f} CPU-s receiving them; answers {tally.summary()} (verdict: the victim's "
                f"p99)"), True
    return run


def _group(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (ValueError, OSError):
            continue
        if entry.name.isdigit() and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def item6_kill_nginx(service: hc.Service):
    def run(tally):
        master = next(p for p in hc.tree_pids(service.proc.pid) if r3.comm(p) == "nginx"
                      and r3.comm(int((Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split())[1])) != "nginx")
        os.kill(master, 9)
        t0 = time.perf_counter()
        left_at, healed_s = None, None
        while time.perf_counter() - t0 < 60:
            if left_at is None and not _group(master):
                left_at = time.perf_counter() - t0
            status = r3.send(service.port, tally, "GET", "/healthz")[0]
            if status == 200 and left_at is not None:
                healed_s = time.perf_counter() - t0
                break
            time.sleep(0.05)
        healed = healed_s is not None and healed_s <= HEAL_TARGET_S and service.proc.poll() is None
        return (f"{tally.summary()} to GET /healthz every 50 ms until then; healed (GET /healthz 200 from a new nginx) after {healed_s if healed_s is None else round(healed_s, 2)}"
                f" s (target <= {HEAL_TARGET_S:g} s); the old master's workers gone after "
                f"{left_at if left_at is None else round(left_at, 2)} s; serve still running: "
                f"{service.proc.poll() is None}"), healed
    return run


def item8_key_reuse(service: hc.Service):
    def run(tally):
        auth = {**r3.AUTH, "Content-Type": "application/json", "Idempotency-Key": "shared-batch-1"}
        before = json.loads(r3.request(service.port, "GET", "/v1/observations")[1])["counts"]["step"]
        rows = [{"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [1], "intra_link": "nvlink",
                 "per_gpu_batch": 64, "iter_s": 0.031 + 0.0001 * i} for i in range(3)]
        first = r3.send(service.port, tally, "POST", "/v1/observations", json.dumps(rows[:1]).encode(), auth)[0]
        other = r3.send(service.port, tally, "POST", "/v1/observations", json.dumps(rows[1:]).encode(), auth)
        retry = r3.send(service.port, tally, "POST", "/v1/observations", json.dumps(rows[:1]).encode(), auth)
        after = json.loads(r3.request(service.port, "GET", "/v1/observations")[1])["counts"]["step"]
        replayed = retry[0] == 201 and json.loads(retry[1]).get("replayed") is True
        return (f"first client 201? {first}; the second client's other body with the same key: {other[0]} "
                f"(target 409; before: 201 'replayed' and its 2 rows dropped); the first's retry replayed: {replayed}; "
                f"rows stored {after - before} (target 1)"), (first, other[0], after - before) == (201, 409, 1) and replayed
    return run


def item9_defaults(root: Path, work: Path):
    def run(tally):
        db = work / "bare.db"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_PREDICTOR_")}
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--port", str(port), "--db", str(db),
                                 "--workers", "1", "--side-workers", "0"], cwd=root, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    if r3.request(port, "GET", "/healthz", timeout=2)[0] == 200:
                        break
                except OSError:
                    time.sleep(0.2)
            write = r3.send(port, tally, "POST", "/v1/observations", b"[]", {"Content-Type": "application/json"})[0]
        finally:
            os.killpg(proc.pid, 15)
            said = proc.communicate(timeout=60)[0].decode(errors="replace")
        mode = stat.S_IMODE(db.stat().st_mode)
        policy = next((line for line in said.splitlines() if line.startswith("writes ")), "?")
        return (f"an anonymous write: {write} (target 401); database mode {oct(mode)} (target 0o600); serve said "
                f"'{policy[:80]}...'"), write == 401 and mode == 0o600
    return run


def run_all(root: Path, items: tuple[str, ...], lab_dir: Path, work: Path) -> list[dict]:
    rows = []

    def add(item: str, port, run):
        row = r3.attack(port, 0, LABELS[item], run)
        row["item"] = f"41.{item}"
        rows.append(row)

    lab_items = [i for i in ("11a", "11b", "11c", "4") if i in items]
    try:
        hl = HookLab(lab_dir) if lab_items else None
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:   # no testbed: named rows, not a crash
        rows.extend({"item": f"41.{i}", "attack": LABELS[i], "before": None, "during": None, "attacker": "-",
                     "check": f"not run: it needs the Slurm testbed ({exc})", "latency_ok": True, "verdict": "SKIP",
                     "seconds": 0} for i in lab_items)
        lab_items, hl = [], None
    if lab_items:
        try:
            if "11a" in lab_items:
                service = _service(root, work, "plain-ttl0", env={"ELASTIC_PREDICTOR_PLAN_CACHE_TTL_S": "0"})
                try:
                    add("11a", service.port, item11a_bad_scripts(service, hl))
                finally:
                    service.stop()
            if "11b" in lab_items:
                add("11b", None, item11b_hung_service(hl))
            if "11c" in lab_items:
                add("11c", None, item11c_2mb_header(hl))
            if "4" in lab_items:
                service = _service(root, work, "hook-from", "--hook-from", HOOK_HOSTS, "--read-timeout", "120",
                                   env={"ELASTIC_PREDICTOR_PLAN_CACHE_TTL_S": "0"})
                try:
                    add("4", service.port, item4_hook_path(service, hl))
                finally:
                    service.stop()
        finally:
            hl.close()
    if "10" in items:
        service = _service(root, work, "hook-from-flood", "--hook-from", HOOK_HOSTS)
        try:
            add("10", service.port, item10_body_flood(service))
        finally:
            service.stop()
    if "6" in items or "8" in items:
        service = _service(root, work, "plain")
        try:
            if "8" in items:
                add("8", service.port, item8_key_reuse(service))
            if "6" in items:   # no victim: every request fails while nginx restarts (the row counts them)
                add("6", None, item6_kill_nginx(service))
        finally:
            service.stop()
    if "9" in items:
        add("9", None, item9_defaults(root, work))
    return rows


def table(rows: list[dict]) -> str:
    return r3.table(rows).replace("| #24.41.", "| #41.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--lab", type=Path, default=Path(os.environ.get("ELASTIC_SLURM_LAB", r3.DEFAULT_LAB)))
    ap.add_argument("--items", default=",".join(ALL_ITEMS))
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args(argv)
    items = tuple(x for x in args.items.split(",") if x)
    started, load = time.time(), os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="hostile-round4-"))
    try:
        rows = run_all(args.root.resolve(), items, args.lab, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = (f"{len(os.sched_getaffinity(0))} usable cores shared with other work (load average {load:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after), Python {platform.python_version()}, {date.today().isoformat()}, "
              f"{time.time() - started:.0f} s; victim: POST /v1/plan at {r3.PLAN_RATE:g}/s from {r3.VICTIM_ADDRESS}.")
    text = header + "\n\n" + table(rows) + "\n"
    print(text)
    if args.output:
        command = "python bench/hostile_round4.py " + " ".join(sys.argv[1:] if argv is None else argv)
        args.output.write_text(f"# Hostile clients, round 4 (#41)\n\nCommand: `{command.strip()}`\n\n{text}")
    return 0 if all(r["verdict"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
