"""The what-if replay's report: tables in Markdown, a JSON summary, per-job CSV and the PNG (predictor.plots).

Read by `elastic-predictor replay` and bench/replay.py; the /admin page shows the newest report written to the
service's replay folder (`summary.json`, `replay.png`).
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from predictor.plots import replay_png
from predictor.replay import Result, later_than

COLUMNS = [("policy", "policy", "s"), ("jobs", "jobs", "d"), ("avg_jct_s", "avg JCT s", ",.0f"),
           ("p99_jct_s", "p99 JCT s", ",.0f"), ("avg_queue_s", "avg queue s", ",.0f"),
           ("makespan_s", "makespan s", ",.0f"), ("gpu_hours", "GPU-h", ",.0f"), ("utilisation", "util", ".2f"),
           ("vs_submitted", "avg JCT vs as-submitted", "+.1%"), ("late", "jobs >10% later", "s"),
           ("resizes", "resizes", "d"), ("wall_s", "replay s", ".1f")]


def rows(results: dict[str, Result]) -> list[dict]:
    """One row per policy: its summary, its average JCT against as-submitted, and how many jobs finish more than
    10% later than as-submitted (count and share)."""
    base = results.get("as-submitted")
    out = []
    for policy, res in results.items():
        s = res.summary()
        if base is not None:
            b = base.summary()["avg_jct_s"]
            s["vs_submitted"] = s["avg_jct_s"] / b - 1 if b else math.nan
            late = later_than(base, res)
            s["late"] = f"{len(late)} ({len(late) / max(1, s['jobs']):.1%})"
            s["late_jobs"] = [{"job": n, "as_submitted_jct_s": a, "jct_s": j} for n, a, j in late]
        out.append(s)
    return out


def oracle_gap(results: dict[str, Result]) -> float | None:
    """Average JCT of the prediction-driven elastic policy over the oracle's, minus 1 (None without both)."""
    if "elastic" in results and "oracle" in results:
        return results["elastic"].summary()["avg_jct_s"] / results["oracle"].summary()["avg_jct_s"] - 1
    return None


def markdown(rows_: list[dict], gap: float | None = None, names: int = 10) -> str:
    """The policy table, the oracle gap, and the jobs >10% later than as-submitted (the first `names` per policy)."""
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows_:
        lines.append("| " + " | ".join("-" if r.get(k) is None else format(r[k], f) for k, _, f in COLUMNS) + " |")
    if gap is not None:
        lines.append(f"\nprediction-driven elastic vs oracle (average JCT): {gap:+.1%}")
    for r in rows_:
        late = r.get("late_jobs") or []
        if late and r["policy"] != "as-submitted":
            shown = ", ".join(f"{j['job']} ({j['as_submitted_jct_s']:,.0f} -> {j['jct_s']:,.0f} s)"
                              for j in late[:names])
            more = f", and {len(late) - names} more" if len(late) > names else ""
            lines.append(f"\n{r['policy']}: later than as-submitted by >10%: {shown}{more}")
    return "\n".join(lines)


def write(results: dict[str, Result], out: Path, title: str = "") -> dict:
    """summary.json (the rows, the oracle gap, the title), jobs.csv (every job under every policy) and replay.png
    into `out`; returns the summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"title": title, "rows": rows(results), "oracle_gap": oracle_gap(results)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / "jobs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "job", "submit_s", "start_s", "end_s", "jct_s", "queue_s", "gpu_s", "gpus_asked",
                    "gpus_start", "resizes"])
        for policy, res in results.items():
            for name, j in res.jobs().items():
                w.writerow([policy, name, f"{j['submit']:.1f}", f"{j['start']:.1f}", f"{j['end']:.1f}",
                            f"{j['jct']:.1f}", f"{j['queue']:.1f}", f"{j['gpu_s']:.0f}", j["gpus_asked"],
                            j["gpus_start"], j["resizes"]])
    (out / "replay.png").write_bytes(replay_png(results, title))
    return summary
