"""What-if replay benchmark (issue #40): every policy on the Pollux workloads and ITP clusters, and the scale run.

    python bench/replay.py pollux [--workloads 1-8] [--out bench/results/replay]
    python bench/replay.py itp --clusters cluster06,cluster10 [--out ...]
    python bench/replay.py scale [--policy as-submitted]      # all 10 ITP clusters (69,351 jobs), one policy, timed

Pollux: 16 nodes x 4 T4 (the paper's 64-GPU cluster). ITP: T4 nodes of 4 GPUs, as many as put the trace's GPU
demand (GPU-seconds over its span) at LOAD of the cluster, at least 16 (the traces' largest job is 64 GPUs).
Jobs without `#ELASTIC` lines get `gpus=<min-scale x asked>-<max-scale x asked>` (replay_inputs.elastic_lines).
Each history writes summary.json, jobs.csv and replay.png under OUT/<name>/, and the tables to OUT/README.md's
section printed here (stdout).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor import replay_inputs as ri  # noqa: E402
from predictor import replay_report  # noqa: E402
from predictor.cluster import Cluster  # noqa: E402
from predictor.replay import POLICIES, Params, Replay, later_than, replay_all  # noqa: E402

LOAD = 0.7
ITP_CLUSTERS = [f"cluster{i:02d}" for i in range(1, 11)]
ITP_DIR = Path(__file__).resolve().parent / "data" / "itp-elasticflow-traces" / "raw"


def shape(nodes: int) -> Cluster:
    return Cluster.from_dict({"default_partition": "t4", "partitions": [
        {"name": "t4", "nodes": f"n[1-{nodes}]", "gpus_per_node": 4, "gpu": "T4", "intra_link": "pcie",
         "inter_link": "ethernet"}]})


def itp_nodes(jobs) -> int:
    span = max(j.submit_s for j in jobs) - min(j.submit_s for j in jobs)
    demand = sum(j.gpus * j.duration_s for j in jobs) / max(span, 1.0)
    return max(16, math.ceil(demand / ri.GPUS_PER_NODE / LOAD))


def params(args) -> Params:
    return Params(tick_s=args.tick, fewer_nodes_within=args.fewer_nodes_within, seed=args.seed)


def with_lines(jobs, truth, total, args):
    for j in jobs:
        if j.limit_s:   # --limit-factor: users' limits above the run time (1: exact, the histories' own)
            j.limit_s *= args.limit_factor
        j.directives = ri.elastic_lines(j.model, j.global_batch, j.gpus, truth, args.max_scale, total, args.min_scale)
    return jobs


def run_one(name, jobs, cluster, truth, args):
    t = time.perf_counter()
    res = replay_all(jobs, cluster, truth, args.policies, params(args))
    summary = replay_report.write(res, Path(args.out) / name, name)
    print(f"\n### {name}: {len(jobs)} jobs, {len(cluster.partition().nodes)} nodes x 4 T4 "
          f"({time.perf_counter() - t:.1f} s)\n")
    print(replay_report.markdown(summary["rows"], summary["oracle_gap"], names=6), flush=True)
    return summary, res


def past_limit(res) -> int:
    """Jobs that ran (start to end, resize pauses included) longer than their time limit: Slurm would have ended
    them (the replay does not; issue #40)."""
    return sum(1 for r in res.runs if r.job.limit_s and r.end - r.start > r.job.limit_s + 1e-6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["pollux", "itp", "scale"])
    ap.add_argument("--workloads", default="1-8")
    ap.add_argument("--clusters", default="cluster06,cluster10")
    ap.add_argument("--policy", dest="policies", default=",".join(POLICIES))
    ap.add_argument("--min-scale", type=float, default=0.5)
    ap.add_argument("--max-scale", type=float, default=1.0)
    ap.add_argument("--tick", type=float, default=300.0)
    ap.add_argument("--fewer-nodes-within", type=float, default=0.0,
                    help="what-if of a planner rule it does not have (Params.fewer_nodes_within); 0: the planner as is")
    ap.add_argument("--limit-factor", type=float, default=1.0,
                    help="time limits x this (1: the history's own; Pollux: each job's run time as asked)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the measurement noise the service is fitted on")
    ap.add_argument("--out", default="bench/results/replay")
    args = ap.parse_args(argv)
    if not args.limit_factor > 0:
        ap.error(f"--limit-factor {args.limit_factor}: expected a number above 0 (1: the history's own limits)")
    args.policies = args.policies.split(",")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# bench/replay.py {' '.join(argv or sys.argv[1:])}\ncommit {commit}, {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, min_scale {args.min_scale}, max_scale {args.max_scale}, tick {args.tick} s, "
          f"fewer_nodes_within {args.fewer_nodes_within}, limit_factor {args.limit_factor}, seed {args.seed}")
    truth = ri.PolluxTruth()
    if args.what == "pollux":
        lo, _, hi = args.workloads.partition("-")
        gaps, cuts, late, long_, over = [], [], [], [], []
        for n in range(int(lo), int(hi or lo) + 1):
            jobs = with_lines(ri.load_pollux_workload(n, truth), truth, 64, args)
            s, res = run_one(f"pollux-workload-{n}", jobs, shape(16), truth, args)
            by = {r["policy"]: r for r in s["rows"]}
            if "elastic" in by:
                cuts.append(by["elastic"]["vs_submitted"])
                late.append(len(by["elastic"].get("late_jobs", [])) / by["elastic"]["jobs"])
                over.append(past_limit(res["elastic"]))
                if "as-submitted" in res:
                    long_.append(len(later_than(res["as-submitted"], res["elastic"], 1.5)))
            if s["oracle_gap"] is not None:
                gaps.append(s["oracle_gap"])
        if cuts:
            print(f"\nPollux {args.workloads}: elastic avg JCT vs as-submitted: "
                  + ", ".join(f"{c:+.1%}" for c in cuts) + f"; mean {sum(cuts) / len(cuts):+.1%}")
            print("elastic jobs >10% later: " + ", ".join(f"{x:.1%}" for x in late))
            print(f"elastic jobs >50% later: {', '.join(map(str, long_))}; in all: {sum(long_)}")
            print(f"elastic jobs run past their time limit: {', '.join(map(str, over))}; in all: {sum(over)}")
        if gaps:
            print("elastic vs oracle avg JCT: " + ", ".join(f"{g:+.1%}" for g in gaps))
    elif args.what == "itp":
        for name in args.clusters.split(","):
            jobs = ri.load_itp(ITP_DIR / f"{name}.csv", truth)
            nodes = itp_nodes(jobs)
            run_one(f"itp-{name}", with_lines(jobs, truth, nodes * 4, args), shape(nodes), truth, args)
    else:
        total_jobs, total_s, cpu0 = 0, 0.0, time.process_time()
        print("\n| cluster | jobs | nodes | load s | replay s (" + ",".join(args.policies) + ") |")
        print("|---|---|---|---|---|")
        for name in ITP_CLUSTERS:
            t = time.perf_counter()
            jobs = ri.load_itp(ITP_DIR / f"{name}.csv", truth)
            nodes = itp_nodes(jobs)
            with_lines(jobs, truth, nodes * 4, args)
            t_load = time.perf_counter() - t
            walls = []
            for p in args.policies:
                res = Replay(jobs, shape(nodes), truth, p, params(args)).run()
                walls.append(res.wall_s)
            total_jobs += len(jobs)
            total_s += t_load + sum(walls)
            print(f"| {name} | {len(jobs)} | {nodes} | {t_load:.1f} | {', '.join(f'{w:.1f}' for w in walls)} |",
                  flush=True)
        print(f"\nall 10 clusters: {total_jobs} jobs, {total_s:.1f} s wall (loading + replay, one process), "
              f"{time.process_time() - cpu0:.1f} s of CPU; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
