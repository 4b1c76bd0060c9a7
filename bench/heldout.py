"""Held-out accuracy of the frozen throughput model (issue 25): strict protocols on a collection made after the freeze.

Run: `python bench/heldout.py [--data DIR ...] [--no-write]`; default: every committed collection (the held-out ones
under bench/data/heldout/ and the development ones under bench/data/coldstart/); writes bench/results/heldout.md and
bench/results/heldout.json.

A collection is *held out* for the model that scores it only if it was collected after that model was frozen: its
`env` records name the `MODEL_VERSION` (predictor/stepmodel.py) the code had when it was measured, and the score is
held out when that version is the one scoring it. Any change to the model bumps the version, so a score of a later
version on the same collection is printed as **seen** (the collection was there while the model changed).
bench/data/coldstart/ (and its session7/ and repeat/) are the data the model was developed on: always **dev**.

Protocols (each row's throughput X = G * b / step, MAPE of measured against predicted), all fitted through
predictor.engine.Predictor with the service's defaults, the way the service fits what a site posts:
- **strict** (submit time, the headline): for each model m and each multi-GPU launch L (one world size, one
  transport), fit on every all-reduce sweep, m's own 1-GPU steps (its 1-GPU launch), m's tensor profile, and every
  other model's steps *except those of launch L* (a site never has other jobs' rows from the very moment and host
  state it predicts for); predict m's rows in L.
- **cold cluster** (a new cluster's first job): no multi-GPU step history at all. Fit on every sweep and every
  model's 1-GPU steps; predict every multi-GPU row.
- **leave one model out** (bench/coldstart.py's protocol A, secondary): m's multi-GPU rows held out, other models'
  rows from every launch kept.
Rows are reported apart by regime, from the model's own 1-GPU steps: a batch is **host-bound** where doubling it
costs the 1-GPU step less than 1.5x (`host_bound_between`: the step is the host's Python and kernel launches, not
the GPU's work), else
**GPU-bound** (for the largest batch of a ladder, the doubling that reached it).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coldstart  # noqa: E402
from coldstart import err, load, predicted  # noqa: E402
from predictor.engine import Predictor  # noqa: E402
from predictor.stepmodel import MODEL_VERSION  # noqa: E402

HERE = Path(__file__).resolve().parent
HELDOUT = HERE / "data" / "heldout"
DEV = [HERE / "data" / "coldstart", HERE / "data" / "coldstart" / "session7"]
RESULTS = HERE / "results"


HOST_BOUND_GROWTH = 1.5  # 1-GPU step growth per batch doubling below which a batch is host-bound


def host_bound_between(b0: float, t0: float, b1: float, t1: float) -> bool:
    """Going from batch b0 (step t0) to b1 > b0 (step t1) on one GPU, the step grows less than HOST_BOUND_GROWTH
    per doubling of the batch: the host's work, not the GPU's (a GPU-bound step about doubles)."""
    return (t1 / t0) ** (math.log(2.0) / math.log(b1 / b0)) < HOST_BOUND_GROWTH


def collected_under(data: Path) -> str | None:
    """The MODEL_VERSION the collection's env records name (None: collected before versions existed)."""
    versions = set()
    for f in data.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "env":
                versions.add(r.get("model_version_at_collection"))
    versions.discard(None)
    if len(versions) > 1:
        raise ValueError(f"{data}: launches collected under different model versions {sorted(versions)}")
    return versions.pop() if versions else None


def standing(data: Path) -> str:
    """held out | seen | dev: whether this collection can score the current model honestly."""
    under = collected_under(data)
    if under is None:
        return "dev"
    return "held out" if under == MODEL_VERSION else "seen"


def regimes(steps) -> dict[tuple[str, int], str]:
    """(model, batch) -> host-bound | GPU-bound, from the model's 1-GPU ladder."""
    out = {}
    for m in {r["profile"] for r in steps}:
        ladder = sorted((r["per_gpu_batch"], r["iter_s"]) for r in steps if r["profile"] == m and sum(r["layout"]) == 1)
        for i, (b, t) in enumerate(ladder):
            j = i + 1 if i + 1 < len(ladder) else i - 1
            if j < 0:
                out[(m, b)] = "GPU-bound"
                continue
            (b0, t0), (b1, t1) = sorted([ladder[i], ladder[j]])
            out[(m, b)] = "host-bound" if host_bound_between(b0, t0, b1, t1) else "GPU-bound"
    return out


def strict(profiles, coll, steps) -> list[tuple[dict, float]]:
    """Held out by model and launch (see the module docstring)."""
    out = []
    multi = [r for r in steps if sum(r["layout"]) > 1]
    for m in sorted({r["profile"] for r in multi}):
        own_one = [r for r in steps if r["profile"] == m and sum(r["layout"]) == 1]
        for launch in sorted({r["launch"] for r in multi if r["profile"] == m}):
            train = own_one + [r for r in steps if r["profile"] != m and r["launch"] != launch]
            rows = [r for r in multi if r["profile"] == m and r["launch"] == launch]
            out += predicted(Predictor().fit(profiles, coll + train), profiles, rows)
    return out


def cold_cluster(profiles, coll, steps) -> list[tuple[dict, float]]:
    """No multi-GPU step history: sweeps and 1-GPU steps only."""
    pred = Predictor().fit(profiles, coll + [r for r in steps if sum(r["layout"]) == 1])
    return predicted(pred, profiles, [r for r in steps if sum(r["layout"]) > 1])


def leave_one_model_out(profiles, coll, steps) -> list[tuple[dict, float]]:
    return coldstart.cold_start(profiles, coll, steps, {})


PROTOCOLS = {"strict": strict, "cold cluster": cold_cluster, "leave one model out": leave_one_model_out}


def summary(results, regime) -> dict:
    """MAPE (%) over all rows, per transport, per regime, per model; row counts."""
    def pick(f):
        return [x for x in results if f(x[0])]
    out = {"rows": len(results), "all": err(results)}
    for link in sorted({r["intra_link"] for r, _ in results}):
        out[f"transport {link}"] = err(pick(lambda r: r["intra_link"] == link))
    for reg in ("host-bound", "GPU-bound"):
        rows = pick(lambda r: regime[(r["profile"], r["per_gpu_batch"])] == reg)
        out[reg] = err(rows) if rows else None
        out[f"{reg} rows"] = len(rows)
    for m in sorted({r["profile"] for r, _ in results}):
        out[f"model {m}"] = err(pick(lambda r: r["profile"] == m))
    out["worst row"] = max(abs(r["iter_s"] / t - 1.0) for r, t in results) * 100
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def score(data: Path) -> dict:
    profiles, coll, steps = load(data)
    regime = regimes(steps)
    return {"collection": str(data.relative_to(HERE.parent)), "standing": standing(data),
            "collected_under": collected_under(data), "model_version": MODEL_VERSION,
            "protocols": {name: summary(fn(profiles, coll, steps), regime) for name, fn in PROTOCOLS.items()}}


def render(scores: list[dict]) -> list[str]:
    lines = ["# Held-out accuracy (`python bench/heldout.py`)", "",
             f"Model `{MODEL_VERSION}` (predictor/stepmodel.py MODEL_VERSION). A collection is **held out** only when "
             "it was collected under this very version; **seen**: collected under an earlier version that was changed "
             "since (the change may have been tuned on it); **dev**: the data the model was developed on.", ""]
    for s in scores:
        lines += [f"## {s['collection']}: {s['standing']} (collected under {s['collected_under'] or 'no version'})", "",
                  "| protocol | rows | all | " + " | ".join(k for k in s["protocols"]["strict"] if k.startswith("transport"))
                  + " | host-bound (rows) | GPU-bound (rows) | worst row |",
                  "|---|---|---|" + "---|" * sum(k.startswith("transport") for k in s["protocols"]["strict"])
                  + "---|---|---|"]
        for name, p in s["protocols"].items():
            tr = " | ".join(f"{v:.1f}%" for k, v in p.items() if k.startswith("transport"))
            fmt = lambda reg: "-" if p[reg] is None else f"{p[reg]:.1f}% ({p[reg + ' rows']})"  # noqa: E731
            lines.append(f"| {name} | {p['rows']} | {p['all']:.1f}% | {tr} | {fmt('host-bound')} | {fmt('GPU-bound')} "
                         f"| {p['worst row']:.0f}% |")
        models = [k for k in s["protocols"]["strict"] if k.startswith("model ")]
        lines += ["", "| model | " + " | ".join(s["protocols"]) + " |", "|---|" + "---|" * len(s["protocols"])]
        for k in models:
            lines.append(f"| {k[6:]} | " + " | ".join(f"{p[k]:.1f}%" for p in s["protocols"].values()) + " |")
        lines.append("")
    lines += ["Targets of issue 25 (on a held-out collection): strict <= 8% over all rows, <= 10% per transport and on "
              "host-bound rows; cold cluster <= 10%."]
    return lines


def collections() -> list[Path]:
    held = sorted(p for p in HELDOUT.iterdir() if p.is_dir() and any(p.glob("*.jsonl"))) if HELDOUT.exists() else []
    return held + [d for d in DEV if any(d.glob("*.jsonl"))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, action="append", help="a collection folder (repeatable; default: all)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    scores = [score(d.resolve()) for d in (a.data or collections())]
    text = "\n".join(render(scores))
    print(text)
    if not a.no_write:
        (RESULTS / "heldout.md").write_text(text + "\n")
        (RESULTS / "heldout.json").write_text(json.dumps(scores, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
