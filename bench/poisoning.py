"""History poisoning (#14.2): how far one job's 200 made-up step rows move other users' predictions and plans.

Eight honest jobs ran resnet50 on the default cluster (H200, 4 GPUs a node) at 1, 2, 4, 8 and 16 GPUs, three rows
each; an attacker posts 200 rows claiming 2 and 4 nodes are 5x slower. For each per-job cap of the fit
(`Predictor(job_rows_cap=)`, default 20; 10**9 = no cap, the fit before #14.2) it prints how much the stranger's
predictions moved and the plan before and after. Run: `python bench/poisoning.py`.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from predictor.engine import Predictor  # noqa: E402
from tests.unit.test_poisoning import ATTACK, CANDS, PROFILES, PART, _history, _plan  # noqa: E402


def impact(cap: int) -> dict:
    """One cap's figures: `moved` (the stranger's predicted samples/s, poisoned / clean - 1, at 1 / 2 / 4 nodes),
    the plan's layout before and after the attack."""
    clean = Predictor(job_rows_cap=cap).fit(PROFILES, _history())
    poisoned = Predictor(job_rows_cap=cap).fit(PROFILES, _history() + ATTACK)
    a = clean.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    b = poisoned.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    return {"moved": [y["samples_per_s"] / x["samples_per_s"] - 1 for x, y in zip(a, b)],
            "before": _plan(clean)["layout"], "after": _plan(poisoned)["layout"]}


def main() -> None:
    print("| per-job cap (rows) | prediction moved, 1 / 2 / 4 nodes | plan before | plan after |")
    print("|---|---|---|---|")
    for cap in (1, 5, 20, 10 ** 9):
        r = impact(cap)
        moved = " / ".join(f"{m:+.1%}" for m in r["moved"])
        label = "none" if cap == 10 ** 9 else str(cap)
        print(f"| {label} | {moved} | {r['before']} | {r['after']} |")

if __name__ == "__main__":
    main()
