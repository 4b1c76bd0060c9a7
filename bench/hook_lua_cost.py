"""The hook's own Lua time a submission, outside slurmctld (issue 41: the in-lock cost of a cached answer).

Runs slurm_plugin/lua/job_submit.lua under apt's lua5.1 with a stub `slurm` table and plain-table job_descs (so
Slurm's C accessors, its log file and its locks are not in the figure: bench/hook_latency.py --storm measures
those), the service's answer given in-process, and times, in CPU microseconds a submission (median of rounds):

    cached   every submission the same request: the hook's kept decision answers (cache key, cache, apply)
    bands    every submission its own `min_efficiency=` value: the kept decision's bands answer
    plain    a job without #ELASTIC lines (the header scan only)

`--against REV` runs the same paths with another revision's Lua (`git show REV:slurm_plugin/lua/...`) in the same
run, alternating rounds, and prints the ratio:

    python bench/hook_lua_cost.py [--against HEAD~1] [--submissions 20000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LUA = ("job_submit.lua", "elastic_common.lua")
REPLY = {"decision_id": "d-42", "action": "rewrite", "nodes": 2, "gpus_per_node": 2, "tasks_per_node": 2,
         "switches": 1, "reason": "elastic: 2 nodes x 2 GPUs (2x2) predicted 3120 samples/s", "layout": [2, 2],
         "cache_ttl_s": 3600, "bands": [{"above": 0.0, "upto": 1.0, "action": "rewrite", "nodes": 2, "gpus_per_node": 2,
                                         "tasks_per_node": 2, "switches": 1,
                                         "reason": "elastic: 2x2 predicted 3120 samples/s (min_efficiency "
                                                   "{min_efficiency})"}]}
DRIVER = r"""
local cjson = require("cjson")
local DIR, N, PATH, REPLY = ...
N = tonumber(N)
slurm = { SUCCESS = 0, ERROR = -1, ESLURM_INVALID_GRES = 2072, jobs = {},
          user_msg = function() end, log_user = function() end, log_info = function() end, log_error = function() end }
local real_dofile = dofile
function dofile(path)   -- the service answers in-process: only the hook's own work is timed
  local m = real_dofile(path)
  if path:match("elastic_common%.lua$") and type(m) == "table" then m.post_json = function() return 200, REPLY end end
  return m
end
dofile(DIR .. "/job_submit.lua")
local PARTS = { debug = { name = "debug", total_nodes = 4, max_nodes = 4294967295, min_nodes = 0, flag_default = 1,
                          max_time = 4294967295 } }
local function desc(i)
  local elastic = PATH == "plain" and "" or "#ELASTIC model=resnet50 per_gpu_batch=16\n#ELASTIC gpus=2-8"
                  .. (PATH == "bands" and string.format(" min_efficiency=0.%04d", i % 10000) or " min_efficiency=0.5")
                  .. "\n"
  return { script = "#!/bin/bash\n#SBATCH --nodes=1 --gres=gpu:4\n" .. elastic .. "python train.py\n",
           name = "train", user_name = "alice", min_nodes = 1, max_nodes = 1, tres_per_node = "gres:gpu:4",
           ntasks_per_node = 65534, time_limit = 60, partition = "debug", num_tasks = 4294967294, min_cpus = 1,
           cpus_per_task = 65534, environment = { SLURM_GPUS_PER_NODE = "4" } }
end
local first = desc(0)   -- asked once, then held by a job: what the cache needs before it answers
slurm_job_submit(first, PARTS, 1001); slurm.jobs["1"] = { comment = first.comment }
local jobs = {}
for i = 1, N do jobs[i] = desc(i) end
local t0 = os.clock()
for i = 1, N do slurm_job_submit(jobs[i], PARTS, 1001) end
local spent = os.clock() - t0
assert(PATH == "plain" or jobs[N].min_nodes == 2, "the decision was not applied")
print(spent / N * 1e6)
"""


def lua_files(rev: str) -> dict[str, str]:
    """The hook's Lua files ({name: text}) as git revision `rev` of this checkout has them.

    Raises:
        SystemExit: `--against REV: ...` naming the revision and git's own message.
    """
    out = {}
    for name in LUA:
        proc = subprocess.run(["git", "show", f"{rev}:slurm_plugin/lua/{name}"], cwd=ROOT, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise SystemExit(f"--against {rev}: no slurm_plugin/lua/{name} there: {proc.stderr.strip()}")
        out[name] = proc.stdout
    return out


def lua_dir(rev: str | None, into: Path) -> Path:
    """The hook's Lua files of `rev` (None: this checkout) in a directory of their own, with an elastic.conf."""
    into.mkdir(parents=True)
    for name, text in (lua_files(rev) if rev else {}).items():
        (into / name).write_text(text)
    for name in LUA if rev is None else ():
        shutil.copy(ROOT / "slurm_plugin" / "lua" / name, into / name)
    (into / "elastic.conf").write_text("predictor_url = http://127.0.0.1:9\nmax_gpus_per_node = debug=4\n")
    return into


def run(directory: Path, path: str, n: int) -> float:
    proc = subprocess.run(["lua5.1", "-", str(directory), str(n), path, json.dumps(REPLY)], input=DRIVER,
                          capture_output=True, text=True, timeout=600, check=True)
    return float(proc.stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="also time this git revision's Lua, in the same run")
    ap.add_argument("--submissions", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"this checkout": lua_dir(None, Path(tmp) / "this")}
        if args.against:
            arms[args.against] = lua_dir(args.against, Path(tmp) / "against")
        times = {(arm, path): [] for arm in arms for path in ("cached", "bands", "plain")}
        for _ in range(args.rounds):
            for (arm, path), got in times.items():
                got.append(run(arms[arm], path, args.submissions))
    print(f"# The hook's Lua a submission, us of CPU (median of {args.rounds} rounds of {args.submissions}; lua5.1)\n")
    print("| path | " + " | ".join(arms) + (" | ratio |" if args.against else " |"))
    print("|---|" + "---:|" * (len(arms) + bool(args.against)))
    for path in ("cached", "bands", "plain"):
        med = [statistics.median(times[(arm, path)]) for arm in arms]
        ratio = f" | {med[0] / med[1]:.2f} |" if args.against else " |"
        print(f"| {path} | " + " | ".join(f"{m:.1f}" for m in med) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
