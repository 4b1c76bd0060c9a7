"""job_submit.lua under apt's lua5.1 with a stub `slurm` table and a small local HTTP server.

Each test installs the hook into a temporary directory (as `elastic-slurm install-plugin` lays it out),
then runs a sequence of submissions through `slurm_job_submit` in ONE lua5.1 process, so module state
(the circuit breaker) lives as long as it does in slurmctld. The hook's clock (breaker, cache) is the driver's,
stepped by a case's `advance` seconds, and the HTTP budget is generous where a test is not about timeouts:
the tests hold on a loaded host (issue #26.7). The server's behaviour for a request is
chosen by the job name in the request body (`mode-500`, `mode-sleep`, ...), and it counts requests.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from predictor import planner

LUA_DIR = pathlib.Path(__file__).parents[2] / "slurm_plugin" / "lua"
REJECT_CODE = 2072

REWRITE = {"decision_id": "d-42", "action": "rewrite", "nodes": 2, "gpus_per_node": 2, "tasks_per_node": 2,
           "switches": 1, "reason": "elastic: 2 nodes x 2 GPUs (2x2) predicted 3120 samples/s",
           "layout": [2, 2], "predicted": {"samples_per_s": 3120.0}, "curve": []}

REWRITE_1X1 = {**REWRITE, "nodes": 1, "gpus_per_node": 1, "tasks_per_node": 1, "switches": None, "layout": [1],
               "reason": "elastic: 1 node x 1 GPU (1x1) predicted 1640 samples/s"}
SLOWER = {**REWRITE_1X1, "decision_id": "d-70", "time_limit_min": 84,
          "reason": "elastic: 1 node x 1 GPU (1x1) predicted 1640 samples/s, 0.7x of 1x4; time limit 60 -> 84 min"}
# a comparison of partitions (issue #16): the service moved the job to partition a100 (predictor/planner.py)
MOVED = {**REWRITE, "decision_id": "d-50", "partition": "a100", "gpu": "A100",
         "reason": "elastic: partition a100: 2x2 A100 predicted 1.5x of h100 2x2 at 0.5x its cost per sample; "
                   "2 nodes x 2 GPUs (2x2) predicted 3120 samples/s",
         "alternatives": [{"partition": "a100", "gpu": "A100", "layout": [2, 2], "samples_per_s": 3120.0},
                          {"partition": "h100", "gpu": "H100", "layout": [2, 2], "samples_per_s": 2080.0}]}
# a mixed-type plan (predictor/mixed.py): placed in a partition holding both types, by node-feature counts
MIXED = {**MOVED, "decision_id": "d-51", "partition": "debug", "gpu": "H100+A100", "nodes": 4, "gpus_per_node": 4,
         "tasks_per_node": 4, "switches": None, "layout": [4, 4, 4, 4], "constraint": "[h100*2&a100*2]",
         "reason": "elastic: mixed 2x4 H100 + 2x4 A100 on partition debug predicted 25090 samples/s"}
NO_VAL = 4294967294
NO_VAL16 = 65534
INFINITE = 4294967295
# job_submit's part_list as slurmctld 22.05 hands it to the hook on the testbed (read there with a probe hook):
# keyed by name, Slurm's node counts; and the GPUs a node the installer reads from Slurm for elastic.conf (#24.5)
PARTS = {name: {"name": name, "total_nodes": nodes, "max_nodes": INFINITE, "min_nodes": 0, "flag_default": default}
         for name, nodes, default in (("debug", 4, 1), ("h100", 2, 0), ("a100", 2, 0))}
MAX_GPUS_PER_NODE = {"debug": 4, "h100": 4, "a100": 4}
TABLE = json.loads((pathlib.Path(__file__).parents[1] / "vectors" / "policy.json").read_text())["tables"][0]
BANDS_LINES = ("#ELASTIC model=resnet50 per_gpu_batch=16", "#ELASTIC gpus=2-8 min_efficiency=0.5")
BANDS_JOB = {"min_nodes": 1, "tres_per_job": "gres:gpu:4"}    # as job() below asks
BANDS = planner.min_efficiency_bands(TABLE, planner.parse_request({"directives": list(BANDS_LINES)}).directives,
                                     planner.requested(BANDS_JOB))

DRIVER = r"""
local cjson = require("cjson")
local socket = require("socket")
local msgs = {}
slurm = {
  SUCCESS = 0, ERROR = -1, ESLURM_INVALID_GRES = 2072,
  user_msg = function(fmt, ...) table.insert(msgs, {"user_msg", string.format(fmt, ...)}) end,
  log_user = function(fmt, ...) table.insert(msgs, {"log_user", string.format(fmt, ...)}) end,
  log_info = function(fmt, ...) table.insert(msgs, {"log_info", string.format(fmt, ...)}) end,
  log_error = function(fmt, ...) table.insert(msgs, {"log_error", string.format(fmt, ...)}) end,
  jobs = {},   -- slurmctld's jobs as job_submit.lua sees them (keyed by the id as a string): a submission that
}              -- succeeds and is no `test_only` case (sbatch --test-only: no job follows) becomes one, with its comment
-- the hook's clock (elastic_common's M.now: breaker, cache) is this one, stepped by a case's `advance` seconds;
-- M.cache_key's calls are counted (`key_builds` of each case)
local clock, key_builds = 1000000.0, 0
local real_dofile = dofile
function dofile(path)
  local m = real_dofile(path)
  if path:match("elastic_common%.lua$") and type(m) == "table" then
    m.now = function() return clock end
    local cache_key = m.cache_key
    m.cache_key = function(...) key_builds = key_builds + 1; return cache_key(...) end
  end
  return m
end
local init_rc = dofile(DIR .. "/job_submit.lua")
local init_msgs = msgs
local out = {}
for i, case in ipairs(cjson.decode(CASES)) do
  clock = clock + (case.advance or 0)
  if case.wait then socket.sleep(case.wait) end   -- real seconds (a late answer on its way)
  msgs, key_builds = {}, 0
  local t0 = socket.gettime()
  local rc = slurm_job_submit(case.job_desc, case.part_list or cjson.decode(PARTS), case.uid or 1001)
  if rc == slurm.SUCCESS and not case.test_only then slurm.jobs[tostring(i)] = { comment = case.job_desc.comment } end
  out[i] = { rc = rc, elapsed = socket.gettime() - t0, job_desc = case.job_desc, msgs = msgs, key_builds = key_builds }
end
io.write(cjson.encode({ init_rc = init_rc, init_msgs = init_msgs, results = out }))
"""


class Predictor:
    """A fake /v1/plan: a malformed `#ELASTIC` line is its 422, as the service's (predictor.planner.parse_request:
    the hook parses no directive); else the job name picks the behaviour. `requests` keeps every body received."""

    REPLIES = {"rewrite": REWRITE, "moved": MOVED, "badpartition": {**MOVED, "partition": "a100,h100"},
               "mixed": MIXED, "badconstraint": {**MIXED, "constraint": "h100*2|a100"},
               "onepartition": {**REWRITE, "partition": "a100", "gpu": "A100"},  # no comparison: stays put
               "rewrite3": {**REWRITE, "tasks_per_node": 3}, "rewrite1x1": REWRITE_1X1,
               # issue #40: 1x1 predicted slower than the job's 1x4 (tests/unit/test_lua_time_limit.py)
               "slower": SLOWER, "badlimit": {**SLOWER, "time_limit_min": 84.5},
               # with cache_ttl_s: the hook may reuse these (tests/unit/test_lua_hook_cache.py)
               "cached": {**REWRITE, "decision_id": "d-44", "cache_ttl_s": 30},
               "cached-short": {**REWRITE, "decision_id": "d-45", "cache_ttl_s": 0.3},
               "cached-zero": {**REWRITE, "decision_id": "d-46", "cache_ttl_s": 0},
               "cached-nan": {**REWRITE, "decision_id": "d-52", "cache_ttl_s": float("nan")},   # json.dumps: NaN
               "cached-huge": {**REWRITE, "decision_id": "d-53", "cache_ttl_s": 1e300},
               "cached-keep": {"decision_id": "d-47", "action": "keep", "reason": "elastic: request already "
                               "matches the plan", "cache_ttl_s": 30},
               # with decision bands (the first table of tests/vectors/policy.json: resnet50, per_gpu_batch 16)
               "bands": {**REWRITE, "decision_id": "d-48", "cache_ttl_s": 30, "bands": BANDS},
               "bands-short": {**REWRITE, "decision_id": "d-49", "cache_ttl_s": 0.3, "bands": BANDS},
               # an older service's prediction table: the hook ignores it (bench/hostile_round3.py item 5)
               "table": {**REWRITE, "decision_id": "d-48", "cache_ttl_s": 30, "table": TABLE},
               # #24.5: decisions the testbed's partitions cannot run (debug: 4 nodes x 4 GPUs; h100, a100: 2 x 4)
               "gpus8": {**REWRITE, "decision_id": "d-60", "nodes": 1, "gpus_per_node": 8, "tasks_per_node": 8,
                         "switches": None, "reason": "elastic: 1 node x 8 GPUs (1x8)"},
               "nodes8": {**REWRITE, "decision_id": "d-61", "nodes": 8, "gpus_per_node": 1, "tasks_per_node": 1,
                          "switches": None, "reason": "elastic: 8 nodes x 1 GPU (8x1)"},
               "moved4": {**MOVED, "nodes": 4, "gpus_per_node": 1, "tasks_per_node": 1, "switches": None},
               # #24.5: more than the hook reads of a reply
               "huge": {**REWRITE, "padding": "x" * (600 * 1024)}}

    def __init__(self):
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body,
                                       "claimed": self.headers.get("X-Elastic-Claimed")})
                mode = (body.get("job", {}).get("name") or "mode-rewrite")[len("mode-"):]
                try:
                    planner.parse_request(body)
                except planner.DirectiveProblem as exc:
                    mode = json.dumps({"error": exc.message, "field": exc.field, "line": exc.line})
                try:
                    outer.respond(self, mode)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @staticmethod
    def respond(handler, mode):
        def send(code, payload: bytes):
            handler.send_response(code)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)

        if mode.startswith("{"):     # the service's 422 for a malformed #ELASTIC line
            send(422, mode.encode())
        elif mode in Predictor.REPLIES:
            send(200, json.dumps(Predictor.REPLIES[mode]).encode())
        elif mode == "fresh":    # as the service: each answer a decision of its own (an id no earlier job holds)
            send(200, json.dumps({**REWRITE, "decision_id": f"d-{time.time_ns()}", "cache_ttl_s": 30}).encode())
        elif mode == "keep":
            send(200, json.dumps({"decision_id": "d-43", "action": "keep", "reason": "elastic: unknown model x; kept"}).encode())
        elif mode == "422":
            send(422, json.dumps({"error": "line 1: unknown model 'nosuch'", "field": "directives[0]"}).encode())
        elif mode == "422-second":   # as predictor/planner.py words it: the service counts the lines it was sent
            send(422, json.dumps({"error": "line 2: gpus: minimum 64 exceeds the 16 GPUs of partition debug: "
                                           "'#ELASTIC gpus=64-128'", "field": "directives[1]",
                                  "line": "#ELASTIC gpus=64-128"}).encode())
        elif mode == "500":
            send(500, b"<html>Internal Server Error</html>")
        elif mode == "400":    # the service's answer to a directive block it cannot read (e.g. 65 lines)
            send(400, json.dumps({"error": "at most 64 directive lines", "field": "directives"}).encode())
        elif mode == "hang":   # accepts, never answers (within a test)
            time.sleep(10)
        elif mode == "sleep500":
            time.sleep(0.5)
            send(500, b"<html>Internal Server Error</html>")
        elif mode == "garbage":
            send(200, b"{\"decision_id\": ")
        elif mode == "badnodes":
            send(200, json.dumps({**REWRITE, "nodes": 0}).encode())
        elif mode == "sleep":
            time.sleep(1.0)
            send(200, json.dumps(REWRITE).encode())
        elif mode == "drip":  # one byte every 20 ms: each receive() is quick, the whole reply is not
            payload = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + json.dumps(REWRITE).encode()
            for byte in payload:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(0.02)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def predictor():
    server = Predictor()
    yield server
    server.close()


def install(tmp_path, url, budget_ms=5000, failures=3, open_s=30, gpus=MAX_GPUS_PER_NODE):
    for name in ("elastic_common.lua", "job_submit.lua"):
        shutil.copy(LUA_DIR / name, tmp_path / name)
    (tmp_path / "elastic.conf").write_text(
        f"predictor_url = {url}\nbudget_ms = {budget_ms}\nbreaker_failures = {failures}\nbreaker_open_s = {open_s}\n"
        + ("" if gpus is None else "max_gpus_per_node = " + ",".join(f"{k}={v}" for k, v in gpus.items()) + "\n"))
    return tmp_path


def run_hook(conf_dir, cases, init_msgs=None):
    """The results of `cases`; `init_msgs`, a list, receives what the hook logged while loading."""
    code = (f"DIR = {json.dumps(str(conf_dir))}\nCASES = [==[{json.dumps(cases)}]==]\n"
            f"PARTS = [==[{json.dumps(PARTS)}]==]\n" + DRIVER)
    proc = subprocess.run(["lua5.1", "-"], input=code, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["init_rc"] == 0
    if init_msgs is not None:
        init_msgs.extend(out["init_msgs"] or [])
    return out["results"]


def test_an_unusable_config_line_is_logged_with_file_line_and_key_and_the_default_kept(tmp_path, predictor):
    conf = install(tmp_path, predictor.url)
    (conf / "elastic.conf").write_text((conf / "elastic.conf").read_text() + "budget_ms = fast\n")
    logged = []
    result = run_hook(conf, [{"job_desc": job("rewrite")}], init_msgs=logged)[0]
    assert [m for m in logged if m[0] == "log_error"] == [["log_error", f"slurm_job_submit: elastic: {conf}/elastic.conf:6: budget_ms: expected a "
                                    f"number, got \"fast\"; default 100 used"]]
    assert result["rc"] == 0 and result["job_desc"]["min_nodes"] == 2          # still works, on the default
    clean = []
    run_hook(install(tmp_path, predictor.url), [], init_msgs=clean)
    assert [m for m in clean if m[0] == "log_error"] == [] and clean   # loading still logs its info line


def script(*directives, body="srun python train.py"):
    return "#!/bin/bash\n#SBATCH -N1 --gpus=4\n" + "".join(d + "\n" for d in directives) + body + "\n"


def job(mode="rewrite", directives=("#ELASTIC model=resnet50 gpus=2-8",), **fields):
    desc = {"script": script(*directives), "name": f"mode-{mode}", "user_name": "alice", "partition": "debug",
            "min_nodes": 1, "max_nodes": 1, "ntasks_per_node": 65534, "num_tasks": 4294967294,
            "tres_per_job": "gres:gpu:4", "time_limit": 60, "comment": "my run",
            "environment": {"SLURM_GPUS": "4", "HOME": "/home/alice"}}
    desc.update(fields)
    return {key: value for key, value in desc.items() if value is not None}  # nil fields are absent


def kinds(result, kind):
    return [text for k, text in result["msgs"] if k == kind]


def test_job_without_directives_is_untouched_and_silent(tmp_path, predictor):
    desc = job(directives=())
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    assert result["rc"] == 0
    assert result["job_desc"] == desc
    assert not result["msgs"]  # no user_msg at all: Slurm's own tests need srun stderr empty
    assert predictor.requests == []


def test_a_header_past_the_scan_caps_is_logged_and_its_directives_unplanned(tmp_path, predictor):
    """#41.11: the scan reads 1024 lines / 64 KiB of header under slurmctld's locks, says so in slurmctld's log, and
    plans no job whose directive block goes on past them (its later #ELASTIC lines would be unread); a plain job
    with a 2 MB header of comments goes in silently, without a request."""
    comments = ("# a comment line" + "x" * 47 + "\n") * 32768           # 2 MiB of comment lines
    cases = [{"job_desc": job(directives=("#ELASTIC model=resnet50 gpus=2-8", comments + "#ELASTIC gpus=4"))},
             {"job_desc": job(directives=(comments,))},
             {"job_desc": job(directives=("#ELASTIC model=resnet50 gpus=2-8", "# " * 2000))}]   # one long line: read
    results = run_hook(install(tmp_path, predictor.url), cases)
    assert [r["body"]["job"]["name"] for r in predictor.requests] == ["mode-rewrite"]
    assert kinds(results[0], "user_msg") == [
        "elastic: prediction skipped (#ELASTIC lines after line 1025 are not read: the header is read up to 1024 "
        "lines and 65536 bytes); job submitted as written"]
    assert results[0]["job_desc"]["min_nodes"] == 1 and results[1]["job_desc"]["min_nodes"] == 1
    for result in results[:2]:
        [log] = [t for t in kinds(result, "log_info") if "header scan" in t]
        assert log.startswith("slurm_job_submit: elastic: uid 1001: header scan stopped at line 1025 (")
        assert log.endswith(" ms; caps 1024 lines, 65536 bytes)")
    assert kinds(results[1], "user_msg") == [] and results[2]["job_desc"]["min_nodes"] == 2


def test_rewrite_is_applied_and_reason_shown(tmp_path, predictor):
    directives = ("#ELASTIC model=resnet50 gpus=2-8", "#ELASTIC per_gpu_batch=64")
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(directives=directives), "uid": 1001}])
    assert result["rc"] == 0
    got = result["job_desc"]
    assert (got["min_nodes"], got["max_nodes"]) == (2, 2)
    assert got["tres_per_node"] == "gres:gpu:2"
    assert got["tres_per_job"] == ""
    assert got["ntasks_per_node"] == 2
    assert got["req_switch"] == 1
    assert got["comment"] == "my run elastic:decision=d-42"
    # what sbatch exported for --gpus=4 must match the new request, or a plain srun in the job fails
    assert got["environment"] == {"SLURM_GPUS": "4", "SLURM_GPUS_PER_NODE": "2", "HOME": "/home/alice"}
    assert kinds(result, "user_msg") == [REWRITE["reason"]]
    [request] = predictor.requests
    assert request["path"] == "/v1/plan"
    body = request["body"]
    assert body["source"] == "job_submit"
    assert body["directives"] == list(directives)
    assert body["job"] == {"user": "alice", "uid": 1001, "partition": "debug", "name": "mode-rewrite",
                           "min_nodes": 1, "max_nodes": 1, "tres_per_job": "gres:gpu:4", "time_limit_min": 60}
    planner.parse_request(body)  # the service accepts exactly what the hook sends (no 400)


def test_rewrite_fixes_slurm_gpus_when_the_total_changes(tmp_path, predictor):
    desc = job(tres_per_job=None, tres_per_node="gres:gpu:h100:4,gres:nic:1", environment={"SLURM_GPUS_PER_NODE": "4"})
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    got = result["job_desc"]
    assert got["tres_per_node"] == "gres:nic:1,gres:gpu:h100:2"
    assert got["environment"] == {"SLURM_GPUS": "4", "SLURM_GPUS_PER_NODE": "2"}


def test_rewrite_keeps_tasks_and_gpus_per_task_consistent(tmp_path, predictor):
    desc = job(tres_per_job=None, tres_per_task="gres:gpu:1", num_tasks=4, min_cpus=4,
               environment={"SLURM_GPUS_PER_TASK": "1", "SLURM_NTASKS": "4"})
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    got = result["job_desc"]
    assert (got["min_nodes"], got["ntasks_per_node"], got["num_tasks"], got["min_cpus"]) == (2, 2, 4, 4)
    assert got["tres_per_task"] == "gres:gpu:1" and got["tres_per_node"] == "gres:gpu:2"
    assert got["environment"] == {"SLURM_GPUS_PER_TASK": "1", "SLURM_NTASKS": "4", "SLURM_GPUS": "4",
                                  "SLURM_GPUS_PER_NODE": "2"}


# sbatch derives min_cpus from its node count when no task count is given (-N2: min_cpus 2, -N2 -c3: 6;
# values read in slurmctld on the testbed). Left as it was, a 2-node request rewritten to 1 node x 1 task asks
# for 2 CPUs where ntasks_per_node=1 allows 1: "Requested node configuration is not available". A job without a
# task count gets nodes x tasks_per_node: 22.05 derived it, 24.11 does not (srun in the job then starts one task a
# node; docs/slurm-versions.md).
@pytest.mark.parametrize("mode, fields, expect", [
    ("rewrite1x1", dict(min_nodes=2, max_nodes=2, min_cpus=2),
     dict(min_nodes=1, ntasks_per_node=1, num_tasks=1, min_cpus=1)),
    ("rewrite1x1", dict(min_nodes=2, max_nodes=2, min_cpus=6, cpus_per_task=3, pn_min_cpus=3),
     dict(min_nodes=1, ntasks_per_node=1, num_tasks=1, min_cpus=3, cpus_per_task=3, pn_min_cpus=3)),
    ("rewrite1x1", dict(min_nodes=2, max_nodes=2, min_cpus=2, ntasks_per_node=1, num_tasks=2),  # --ntasks-per-node=1
     dict(min_nodes=1, ntasks_per_node=1, num_tasks=1, min_cpus=1)),
    ("rewrite1x1", dict(min_nodes=3, max_nodes=3, min_cpus=12, ntasks_per_node=2, num_tasks=6, cpus_per_task=2),
     dict(min_nodes=1, ntasks_per_node=1, num_tasks=1, min_cpus=2, cpus_per_task=2)),
    ("rewrite", dict(min_nodes=1, max_nodes=1, min_cpus=1),                                   # the reverse: 1 -> 2x2
     dict(min_nodes=2, ntasks_per_node=2, num_tasks=4, min_cpus=4)),
], ids=["N2-to-1x1", "N2-c3-to-1x1", "N2-ntasks-per-node-to-1x1", "N3-ntasks-per-node2-c2-to-1x1", "N1-to-2x2"])
def test_rewrite_derives_min_cpus_and_num_tasks_for_the_new_node_count(tmp_path, predictor, mode, fields, expect):
    desc = job(mode=mode, tres_per_job=None, tres_per_node="gres:gpu:1", environment={"SLURM_GPUS_PER_NODE": "1"},
               **fields)
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    assert result["rc"] == 0
    got = result["job_desc"]
    assert got["max_nodes"] == got["min_nodes"]
    assert {key: got.get(key) for key in expect} == expect
    reply = Predictor.REPLIES[mode]
    assert got["tres_per_node"] == f"gres:gpu:{reply['gpus_per_node']}"
    assert kinds(result, "user_msg") == [reply["reason"]]


def test_rewrite_that_cannot_be_applied_consistently_leaves_the_job_as_written(tmp_path, predictor):
    desc = job(mode="rewrite3", tres_per_task="gres:gpu:1", num_tasks=2)  # reply: 2 GPUs, 3 tasks per node
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    assert result["rc"] == 0 and result["job_desc"] == desc
    assert kinds(result, "user_msg") == ["elastic: prediction skipped (plan not applied: 2 GPUs per node do not "
                                         "split over 3 tasks (--gpus-per-task)); job submitted as written"]


def test_a_comparison_moves_the_job_to_the_chosen_partition(tmp_path, predictor):
    directives = ("#ELASTIC model=resnet50 gpus=2-8", "#ELASTIC per_gpu_batch=64")
    named = job(mode="moved", directives=directives, partition="h100,a100")
    typed_other = job(mode="moved", partition="h100,a100", tres_per_job=None, tres_per_node="gres:gpu:h100:4")
    typed_same = job(mode="moved", partition="h100,a100", tres_per_job=None, tres_per_node="gres:gpu:a100:4,gres:nic:1")
    any_type = job(mode="moved", directives=("#ELASTIC model=resnet50 gpu_type=any",), partition=None)
    results = run_hook(install(tmp_path, predictor.url),
                       [{"job_desc": d} for d in (named, typed_other, typed_same, any_type)])
    got = [r["job_desc"] for r in results]
    assert [g["partition"] for g in got] == ["a100"] * 4
    assert got[0]["tres_per_node"] == "gres:gpu:2" and got[0]["min_nodes"] == 2
    # a typed request naming the other partition's type would not fit a100's nodes: it becomes untyped
    assert got[1]["tres_per_node"] == "gres:gpu:2" and got[2]["tres_per_node"] == "gres:nic:1,gres:gpu:a100:2"
    assert all(kinds(r, "user_msg") == [MOVED["reason"]] for r in results)
    assert [r["body"]["job"].get("partition") for r in predictor.requests] == ["h100,a100"] * 3 + [None]
    assert predictor.requests[3]["body"]["directives"] == ["#ELASTIC model=resnet50 gpu_type=any"]


def test_a_mixed_plan_asks_for_each_types_node_count(tmp_path, predictor):
    typed = job(mode="mixed", partition="h100,a100,debug", tres_per_job=None, tres_per_node="gres:gpu:h100:4")
    bad = job(mode="badconstraint", partition="h100,a100,debug")
    mixed, refused = run_hook(install(tmp_path, predictor.url), [{"job_desc": typed}, {"job_desc": bad}])
    got = mixed["job_desc"]
    assert got["partition"] == "debug" and got["features"] == "[h100*2&a100*2]" and got["min_nodes"] == 4
    assert got["tres_per_node"] == "gres:gpu:4"   # a typed request would hold it to one type: untyped
    assert kinds(mixed, "user_msg") == [MIXED["reason"]]
    assert refused["job_desc"] == bad and kinds(refused, "user_msg") == [
        "elastic: prediction skipped (bad constraint h100*2|a100); job submitted as written"]


def test_a_single_partition_answer_never_moves_the_job(tmp_path, predictor):
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="onepartition", partition=None)}])
    assert "partition" not in result["job_desc"] and result["job_desc"]["min_nodes"] == 2


def test_a_malformed_partition_in_the_reply_fails_open(tmp_path, predictor):
    desc = job(mode="badpartition", partition="h100,a100")
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    assert result["rc"] == 0 and result["job_desc"] == desc
    assert kinds(result, "user_msg") == ["elastic: prediction skipped (bad partition a100,h100); job submitted as "
                                         "written"]


OUTSIDE = "elastic: prediction skipped (decision outside its partition: "


@pytest.mark.parametrize("mode, partition, why", [
    ("gpus8", "debug", "1 node x 8 GPUs, partition debug takes at most 4 nodes x 4 GPUs"),
    ("nodes8", "debug", "8 nodes x 1 GPU, partition debug takes at most 4 nodes x 4 GPUs"),
    ("nodes8", None, "8 nodes x 1 GPU, partition debug takes at most 4 nodes x 4 GPUs"),   # the default partition
    ("rewrite", "secret", "2 nodes x 2 GPUs, partition secret takes at most 0 nodes x ? GPUs (not in elastic.conf)"),
    ("moved4", "h100,a100", "4 nodes x 1 GPU, partition a100 takes at most 2 nodes x 4 GPUs"),   # where it moves
    ("rewrite", "", "no partition to run in")])   # none named, no default one the user may use
def test_a_decision_beyond_its_partition_is_dropped_and_the_job_submitted_as_written(tmp_path, predictor, mode,
                                                                                     partition, why):
    """#24.5: Slurm would refuse it (a service failure blocking a submission); node counts are part_list's,
    GPUs a node elastic.conf's max_gpus_per_node; a partition the job may not use (not in part_list) fits nothing."""
    desc = job(mode=mode, partition=partition or None)
    case = {"job_desc": desc, **({"part_list": {"h100": PARTS["h100"]}} if partition == "" else {})}
    [result] = run_hook(install(tmp_path, predictor.url), [case])
    assert result["rc"] == 0 and result["job_desc"] == desc
    assert kinds(result, "user_msg") == [OUTSIDE + why + "); job submitted as written"]


def test_the_bounds_are_slurms_and_the_installers(tmp_path, predictor):
    """A partition list fits when one partition fits; the node bound is part_list's (max_nodes too), the GPU
    bound elastic.conf's: without its line every rewrite is dropped (an older install), a keep still applies."""
    parts = {**PARTS, "debug": {**PARTS["debug"], "max_nodes": 1}}
    cases = [{"job_desc": job(mode="nodes8", partition="h100,debug"), "part_list": {
                 **PARTS, "debug": {**PARTS["debug"], "total_nodes": 8}}},   # debug fits, h100 does not
             {"job_desc": job(mode="rewrite"), "part_list": parts}]           # debug's MaxNodes=1
    fits, capped = run_hook(install(tmp_path, predictor.url, gpus={"debug": 4}), cases)
    assert fits["job_desc"]["min_nodes"] == 8 and kinds(fits, "user_msg") == [Predictor.REPLIES["nodes8"]["reason"]]
    assert kinds(capped, "user_msg") == [OUTSIDE + "2 nodes x 2 GPUs, partition debug takes at most 1 node x 4 GPUs); "
                                         "job submitted as written"]
    (tmp_path / "old").mkdir()
    dropped, kept = run_hook(install(tmp_path / "old", predictor.url, gpus=None),
                             [{"job_desc": job(mode="rewrite")}, {"job_desc": job(mode="keep")}])
    assert dropped["job_desc"]["min_nodes"] == 1 and "? GPUs (not in elastic.conf)" in kinds(dropped, "user_msg")[0]
    assert kept["job_desc"]["comment"] == "my run elastic:decision=d-43"


def test_a_cached_decision_that_no_longer_fits_asks_the_service(tmp_path, predictor):
    """The cache holds what fitted when it was stored; a later submission checks it against the partition as it is
    then (one node left in debug): not applied, the service asked again, its answer checked too."""
    shrunk = {**PARTS, "debug": {**PARTS["debug"], "total_nodes": 1}}
    first, second = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="cached")},
                                                                {"job_desc": job(mode="cached"), "part_list": shrunk}])
    assert first["job_desc"]["min_nodes"] == 2 and second["job_desc"]["min_nodes"] == 1
    assert len(predictor.requests) == 2 and kinds(second, "user_msg")[0].startswith(OUTSIDE + "2 nodes x 2 GPUs")


def test_keep_records_decision_and_changes_nothing_else(tmp_path, predictor):
    desc = job(mode="keep")
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    assert result["rc"] == 0
    assert result["job_desc"] == {**desc, "comment": "my run elastic:decision=d-43"}
    assert kinds(result, "user_msg") == ["elastic: unknown model x; kept"]


def test_malformed_directive_is_the_services_422_quoting_the_script_line(tmp_path, predictor):
    """The hook parses no directive (#26.3): the service's 422 rejects the job, naming the script's line."""
    desc = job(directives=("#ELASTIC model=resnet50", "#ELASTIC gpus=8-2"))
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    assert result["rc"] == REJECT_CODE and result["job_desc"] == desc
    # Slurm prints its own line last ("Batch job submission failed: <the code's text>"): ours says it is this
    assert kinds(result, "log_user") == ["elastic: line 4: gpus: minimum 8 is above maximum 2: '#ELASTIC gpus=8-2'; "
                                         "job rejected: Slurm's next line (\"Invalid generic resource (gres) "
                                         "specification\") is this rejection"]
    assert kinds(result, "user_msg") == []


def test_malformed_directive_with_the_service_down_is_submitted_as_written(tmp_path):
    """Without the service nobody parses the lines: the job goes in as written, like any other (fail open)."""
    desc = job(directives=("#ELASTIC model=resnet50", "#ELASTIC gpus=8-2"))
    [result] = run_hook(install(tmp_path, "http://127.0.0.1:9"), [{"job_desc": desc}])
    assert result["rc"] == 0 and result["job_desc"] == desc
    assert kinds(result, "user_msg") == ["elastic: prediction skipped (connection refused); job submitted as written"]


def test_service_422_rejects_with_its_message(tmp_path, predictor):
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="422")}])
    assert result["rc"] == REJECT_CODE
    assert kinds(result, "log_user") == ["elastic: line 3: unknown model 'nosuch'; job rejected: Slurm's next line "
                                         "(\"Invalid generic resource (gres) specification\") is this rejection"]


def test_service_422_names_the_script_line_as_the_hooks_own_errors_do(tmp_path, predictor):
    """The service numbers the #ELASTIC lines it was sent; the user reads the script's (issue #26.6)."""
    directives = ("#ELASTIC model=resnet50", "#SBATCH --time=10", "# a comment", "#ELASTIC gpus=64-128")
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": job(mode="422-second",
                                                                            directives=directives)}])
    assert result["rc"] == REJECT_CODE
    assert kinds(result, "log_user") == [
        "elastic: line 6: gpus: minimum 64 exceeds the 16 GPUs of partition debug: '#ELASTIC gpus=64-128'; job "
        "rejected: Slurm's next line (\"Invalid generic resource (gres) specification\") is this rejection"]
    from slurm_plugin.contracts.directives import directive_lines

    assert directive_lines(script(*directives))[1] == (6, "#ELASTIC gpus=64-128")   # the Python parser's count


@pytest.mark.parametrize("mode, why", [("500", "HTTP 500"), ("garbage", "unreadable reply"),
                                       ("badnodes", "bad nodes 0"), ("sleep", "timeout"), ("drip", "timeout")])
def test_service_failure_accepts_unchanged_within_budget(tmp_path, predictor, mode, why):
    desc = job(mode=mode)
    [result] = run_hook(install(tmp_path, predictor.url, budget_ms=100), [{"job_desc": desc}])
    assert result["rc"] == 0
    assert result["job_desc"] == desc
    [msg] = kinds(result, "user_msg")
    assert msg.startswith("elastic: prediction skipped (") and why in msg and msg.endswith("job submitted as written")
    # `why` names how it gave up (timeout at its budget); the time a call takes against the 100 ms budget is
    # reported by bench/unit_timings.py, sbatch's by bench/hook_latency.py


def test_service_down_accepts_unchanged(tmp_path):
    desc = job()
    [result] = run_hook(install(tmp_path, "http://127.0.0.1:9"), [{"job_desc": desc}])
    assert result["rc"] == 0 and result["job_desc"] == desc
    assert "connection refused" in kinds(result, "user_msg")[0]


def test_breaker_opens_after_k_failures_and_closes_after_t(tmp_path, predictor):
    """The hook's clock is stepped, not waited on: 30 s of breaker in no time, exact on a loaded host."""
    conf = install(tmp_path, predictor.url, failures=2, open_s=30)
    cases = [{"job_desc": job(mode="500")}, {"job_desc": job(mode="500")},   # 2 failures: opens
             {"job_desc": job(mode="rewrite")},                                # skipped, not sent
             {"job_desc": job(mode="rewrite"), "advance": 29.9},               # still open: not sent
             {"job_desc": job(mode="rewrite"), "advance": 0.2}]                # 30.1 s on: closed again, sent
    results = run_hook(conf, cases)
    assert [r["rc"] for r in results] == [0, 0, 0, 0, 0]
    assert "not asking again for 30 s" in kinds(results[1], "user_msg")[0]
    assert "predictor unavailable, retry in 30 s" in kinds(results[2], "user_msg")[0]
    assert "predictor unavailable, retry in 1 s" in kinds(results[3], "user_msg")[0]
    assert results[2]["job_desc"]["min_nodes"] == 1 and results[3]["job_desc"]["min_nodes"] == 1
    assert [r["body"]["job"]["name"] for r in predictor.requests] == ["mode-500", "mode-500", "mode-rewrite"]
    assert results[4]["job_desc"]["min_nodes"] == 2


@pytest.mark.parametrize("mode", ["sleep", "drip"])
def test_a_slow_answer_opens_the_breaker_only_until_it_comes(tmp_path, predictor, mode):
    """#41.11 and #26.3: an answer past the budget opens the breaker at once (a hung service costs one budget a
    period), and the late answer, once it has come (the fake's, 1 s after the request), closes it: the next
    submission asks again. Before, a hung service cost K budgets in a row."""
    conf = install(tmp_path, predictor.url, budget_ms=100, failures=3, open_s=30)
    cases = [{"job_desc": job(mode=mode)},
             {"job_desc": job(mode="rewrite"), "advance": 0.01},                 # the answer has not come: skipped
             {"job_desc": job(mode="rewrite"), "advance": 1, "wait": 1.5}]       # it came: closed, asked
    results = run_hook(conf, cases)
    assert [r["body"]["job"]["name"] for r in predictor.requests] == [f"mode-{mode}", "mode-rewrite"]
    msgs = [kinds(r, "user_msg")[0] for r in results]
    assert msgs[0] == "elastic: prediction skipped (timeout; not asking again for 30 s); job submitted as written"
    assert msgs[1] == ("elastic: prediction skipped (predictor unavailable, retry in 30 s); "
                       "job submitted as written")
    assert msgs[2] == REWRITE["reason"] and results[2]["job_desc"]["min_nodes"] == 2


def test_a_hung_service_costs_one_budget_a_period(tmp_path, predictor):
    """A service that accepts and never answers: the first timeout opens the breaker, the submissions behind it
    are skipped without a call, and the trial after open_s that times out again reopens it at once."""
    conf = install(tmp_path, predictor.url, budget_ms=100, failures=3, open_s=30)
    cases = [{"job_desc": job(mode="hang")},
             {"job_desc": job(mode="rewrite"), "advance": 1},                  # open: skipped, not sent
             {"job_desc": job(mode="rewrite"), "advance": 28},                 # still open
             {"job_desc": job(mode="hang"), "advance": 1.5},                   # 30.5 s on: a trial, times out
             {"job_desc": job(mode="rewrite"), "advance": 1}]                  # reopened at once: not sent
    results = run_hook(conf, cases)
    assert [r["rc"] for r in results] == [0] * 5
    assert [r["body"]["job"]["name"] for r in predictor.requests] == ["mode-hang"] * 2
    msgs = [kinds(r, "user_msg")[0] for r in results]
    assert "timeout; not asking again for 30 s" in msgs[0] and "timeout; not asking again for 30 s" in msgs[3]
    assert "predictor unavailable, retry in 29 s" in msgs[1] and "retry in 29 s" in msgs[4]
    assert "predictor unavailable, retry in 1 s" in msgs[2]
    assert all(r["job_desc"]["min_nodes"] == 1 for r in results)


def test_a_late_5xx_keeps_the_breaker_open(tmp_path, predictor):
    conf = install(tmp_path, predictor.url, budget_ms=100, failures=3, open_s=30)
    cases = [{"job_desc": job(mode="sleep500")}, {"job_desc": job(mode="rewrite"), "advance": 1, "wait": 1.0}]
    results = run_hook(conf, cases)
    assert [r["body"]["job"]["name"] for r in predictor.requests] == ["mode-sleep500"]
    assert "predictor unavailable, retry in 29 s" in kinds(results[1], "user_msg")[0]


def test_a_4xx_is_the_jobs_problem_and_never_opens_the_breaker(tmp_path, predictor):
    """#41.11: three scripts the service refuses (400: an invalid byte, 65 #ELASTIC lines) opened the breaker, and
    every user's next #ELASTIC jobs went in unplanned. A 4xx (and a 422, which rejects the job) counts for nothing;
    the submitter reads the service's reason."""
    conf = install(tmp_path, predictor.url, failures=1, open_s=30)
    modes = ["400", "400", "422", "400", "rewrite"]
    results = run_hook(conf, [{"job_desc": job(mode=m)} for m in modes])
    assert [r["body"]["job"]["name"] for r in predictor.requests] == [f"mode-{m}" for m in modes]
    assert kinds(results[0], "user_msg") == ["elastic: prediction skipped (HTTP 400: at most 64 directive lines); "
                                             "job submitted as written"]
    assert results[4]["job_desc"]["min_nodes"] == 2


def test_success_resets_the_failure_count(tmp_path, predictor):
    conf = install(tmp_path, predictor.url, failures=2, open_s=30)
    modes = ["500", "rewrite", "500", "rewrite"]
    results = run_hook(conf, [{"job_desc": job(mode=m)} for m in modes])
    assert len(predictor.requests) == 4
    assert results[3]["job_desc"]["min_nodes"] == 2


@pytest.mark.parametrize("fields", [{"comment": "elastic-helper:1234"}, {"name": "elastic-helper-1234"},
                                    {"dependency": "expand:1234"}, {"script": None},
                                    {"comment": "x elastic:decision=d-1"}])
def test_helper_jobs_expand_and_planned_jobs_are_skipped(tmp_path, predictor, fields):
    desc = job(**fields)
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    assert result["rc"] == 0 and result["job_desc"] == desc and not result["msgs"]
    assert predictor.requests == []


def test_unexpected_error_fails_open_with_a_message(tmp_path, predictor):
    desc = job(environment="not a table")  # a field of a type Slurm never sends: assigning into it raises
    [result] = run_hook(install(tmp_path, predictor.url), [{"job_desc": desc}])
    assert result["rc"] == 0
    assert kinds(result, "user_msg") == ["elastic: prediction skipped (hook error, see slurmctld log); "
                                         "job submitted as written"]
    assert "hook error" in kinds(result, "log_error")[0]


def test_missing_common_module_fails_open(tmp_path):
    conf = install(tmp_path, "http://127.0.0.1:9")
    (conf / "elastic_common.lua").unlink()
    desc = job()
    [result] = run_hook(conf, [{"job_desc": desc}])
    assert result["rc"] == 0 and result["job_desc"] == desc


def test_installer_writes_hook_files_and_stamps_job_submit_past_the_last_load(tmp_path):
    from datetime import timedelta

    from slurm_plugin.installer import PluginConfig, install

    (tmp_path / "job_submit.lua").write_text("-- old\n")
    loaded_at = time.time()  # as if slurmctld loaded the old script just now
    waits: list[float] = []
    written = install(PluginConfig(tmp_path, "http://127.0.0.1:8470/", timedelta(milliseconds=80), 5,
                                   timedelta(seconds=12), cli_filter=True, max_gpus_per_node={"debug": 4, "a100": 8}),
                      sleep=waits.append)
    assert [p.name for p in written] == ["elastic_common.lua", "elastic.conf", "cli_filter.lua", "job_submit.lua"]
    mtime = (tmp_path / "job_submit.lua").stat().st_mtime
    assert mtime > int(loaded_at) and mtime == int(mtime)  # slurmctld compares whole seconds
    [wait] = waits                                          # until that second has come, never longer than one
    assert 0 < wait <= 1
    assert (tmp_path / "elastic.conf").read_text().splitlines()[1:] == [
        "predictor_url = http://127.0.0.1:8470", "budget_ms = 80", "breaker_failures = 5", "breaker_open_s = 12",
        "cache_entries = 1024", "max_gpus_per_node = a100=8,debug=4"]
    # the installed hook reads that config and works from its own directory
    [result] = run_hook(tmp_path, [{"job_desc": job()}])
    assert "connection refused" in kinds(result, "user_msg")[0]


def test_the_gpu_bound_is_slurms_own_count_or_the_admins(tmp_path, monkeypatch):
    """#24.5: one owner: Slurm's node GRES (client.most_gpus_per_node), read by the installer; or the admin's
    --max-gpus-per-node where Slurm does not answer, which is then named."""
    import functools

    from click.testing import CliRunner

    from slurm_plugin import installer
    from slurm_plugin.client import Node, Partition, most_gpus_per_node
    from slurm_plugin.installer import InstallError, PluginConfig, install, install_plugin

    # the command's install() waits for job_submit.lua's mtime second; no slurmctld here to wait for
    monkeypatch.setattr(installer, "install", functools.partial(installer.install, sleep=lambda _s: None))

    nodes = [Node("n1", "idle", 4, 0, None, ("p",)), Node("n2", "idle", 8, 0, None, ("p",)),
             Node("c1", "idle", 0, 0, None, ("cpu",))]
    parts = [Partition("p", ("n1", "n2"), True, "UP"), Partition("cpu", ("c1",), False, "UP")]
    assert most_gpus_per_node(nodes, parts) == {"p": 8, "cpu": 0}
    with pytest.raises(InstallError, match="--max-gpus-per-node"):   # no slurm.conf here, no Slurm
        install(PluginConfig(tmp_path, "http://127.0.0.1:8470"))
    args = ["--conf-dir", str(tmp_path), "--predictor-url", "http://127.0.0.1:8470", "--max-gpus-per-node"]
    assert CliRunner().invoke(install_plugin, [*args, "debug=4, a100=8"]).exit_code == 0
    assert "max_gpus_per_node = a100=8,debug=4" in (tmp_path / "elastic.conf").read_text().splitlines()
    refused = CliRunner().invoke(install_plugin, [*args, "debug=four"])
    assert refused.exit_code != 0 and "PARTITION=COUNT" in refused.output


def test_installer_merges_slurm_conf_lines(tmp_path):
    from slurm_plugin.installer import add_to_slurm_conf

    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=lab\nJobSubmitPlugins=all_partitions\n")
    assert add_to_slurm_conf(conf, ["JobSubmitPlugins=lua", "CliFilterPlugins=lua"])
    assert conf.read_text() == "ClusterName=lab\nJobSubmitPlugins=all_partitions,lua\nCliFilterPlugins=lua\n"
    assert not add_to_slurm_conf(conf, ["JobSubmitPlugins=lua"])


@pytest.mark.parametrize("url, budget_ms", [("https://x", 100), ("http://", 100), ("http://h:1", 0)])
def test_installer_rejects_bad_options(tmp_path, url, budget_ms):
    from datetime import timedelta

    from slurm_plugin.installer import InstallError, PluginConfig

    with pytest.raises(InstallError):
        PluginConfig(tmp_path, url, timedelta(milliseconds=budget_ms))


def test_cli_filter_moves_the_options_to_the_chosen_partition(tmp_path):
    """cli_filter's side of a comparison (cli_filter.lua's apply_cli_options): --partition and a typed --gres."""
    cases = [[{"partition": "h100,a100", "gres": "gpu:h100:4", "nodes": "1"}, MOVED],
             [{"partition": "h100", "gres": "gpu:h100:4", "nodes": "1"}, {**MOVED, "alternatives": None}]]
    code = (f"slurm = {{}}\ndofile({json.dumps(str(LUA_DIR / 'cli_filter.lua'))})\n"
            "local cjson = require('cjson')\nlocal out = {}\n"
            f"for i, case in ipairs(cjson.decode([==[{json.dumps(cases)}]==])) do\n"
            "  if case[2].alternatives == cjson.null then case[2].alternatives = nil end\n"
            "  apply_cli_options(case[1], case[2]); out[i] = case[1]\nend\nio.write(cjson.encode(out))\n")
    proc = subprocess.run(["lua5.1", "-"], input=code, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    moved, kept = json.loads(proc.stdout)
    assert moved == {"partition": "a100", "gres": "gpu:2", "nodes": "2", "ntasks-per-node": "2", "switches": "1",
                     "comment": "elastic:decision=d-50"}
    assert kept["partition"] == "h100" and kept["gres"] == "gpu:h100:2"


def test_the_gres_prefix_is_read_from_slurms_version_only_where_there_is_a_slurm_conf(tmp_path, monkeypatch):
    # the client's `scontrol --version` (with SLURM_CONF: 24.11 needs it) says gres: or gres/; without a slurm.conf
    # 22.05's scontrol looks for one over DNS until its timeout, so the installer does not ask (the hook keeps each
    # job's own spelling); with one, an scontrol that gives no version stops the install, naming its output
    import dataclasses

    from slurm_plugin import installer
    from slurm_plugin.installer import InstallError, PluginConfig

    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"

    def says(out):
        scontrol.write_text(f"#!/bin/sh\necho \"$* SLURM_CONF=$SLURM_CONF\" >> {asked}\necho '{out}'\n")
        scontrol.chmod(0o755)

    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    etc = tmp_path / "etc"
    etc.mkdir()
    conf = etc / "slurm.conf"
    says("slurm 24.11.5")
    config = PluginConfig(etc, "http://127.0.0.1:8470", max_gpus_per_node={"debug": 4})
    installer.install(config, sleep=lambda _s: None)
    assert "gres_prefix" not in (etc / "elastic.conf").read_text() and not asked.exists()
    conf.write_text("")
    for out, prefix in (("slurm 24.11.5", "gres/"), ("slurm 23.02.0", "gres/"), ("slurm-wlm 22.05.8", "gres:")):
        says(out)
        installer.install(config, sleep=lambda _s: None)
        assert f"gres_prefix = {prefix}" in (etc / "elastic.conf").read_text().splitlines(), out
    assert asked.read_text().splitlines() == [f"--version SLURM_CONF={conf}"] * 3
    says("Could not establish a configuration source")
    with pytest.raises(InstallError, match="Could not establish a configuration source.*--gres-prefix"):
        installer.install(config, sleep=lambda _s: None)
    # the admin's --gres-prefix: Slurm is not asked
    asked.unlink()
    installer.install(dataclasses.replace(config, gres_prefix="gres:"), sleep=lambda _s: None)
    assert "gres_prefix = gres:" in (etc / "elastic.conf").read_text().splitlines() and not asked.exists()
