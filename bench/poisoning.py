"""History poisoning (#14.2): how far one job's 200 made-up step rows move other users' predictions and plans.

Eight honest jobs ran resnet50 on the default cluster (H200, 4 GPUs a node) at 1, 2, 4, 8 and 16 GPUs, three rows
each; an attacker posts 200 rows claiming 2 and 4 nodes are 5x slower. The step model counts each owner (user, else
job) as one vote (predictor/stepmodel.py); beside it, the same fit with every row its own vote (the fit before
#14.2). It prints how much the stranger's predictions moved and the plan before and after.
Run: `python bench/poisoning.py`.
"""
from __future__ import annotations

import os
import sys
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from predictor import stepmodel  # noqa: E402
from predictor.engine import Predictor  # noqa: E402
from tests.unit.test_poisoning import ATTACK, CANDS, PROFILES, PART, _history, _plan  # noqa: E402


def impact() -> dict:
    """`moved` (the stranger's predicted samples/s, poisoned / clean - 1, at 1 / 2 / 4 nodes), the plan's layout
    before and after the attack."""
    clean = Predictor().fit(PROFILES, _history())
    poisoned = Predictor().fit(PROFILES, _history() + ATTACK)
    a = clean.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    b = poisoned.predict(PROFILES["resnet50"], PART.gpu, 64, CANDS)
    return {"moved": [y["samples_per_s"] / x["samples_per_s"] - 1 for x, y in zip(a, b)],
            "before": _plan(clean)["layout"], "after": _plan(poisoned)["layout"]}


WEIGHTINGS = ("one vote per owner, weighed by its agreement (the model)", "every row a vote")


def compare() -> dict:
    """`impact()` under the model's weighting and with every row a vote, none weighed by trust (the weighting the
    model replaced), by label (`WEIGHTINGS`)."""
    with mock.patch.object(stepmodel, "_weights", lambda rows: np.ones(len(rows))), \
            mock.patch.object(stepmodel, "TRUST_ROUNDS", 0):
        every_row = impact()
    return dict(zip(WEIGHTINGS, (impact(), every_row)))


def main() -> None:
    print("| weighting | prediction moved, 1 / 2 / 4 nodes | plan before | plan after |")
    print("|---|---|---|---|")
    for label, r in compare().items():
        moved = " / ".join(f"{m:+.1%}" for m in r["moved"])
        print(f"| {label} | {moved} | {r['before']} | {r['after']} |")


if __name__ == "__main__":
    main()
