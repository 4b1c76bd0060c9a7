"""Is a held-out collection predictable from the others? What bench/loco.py's scores of each collection rest on.

Run: `python bench/loco_consistency.py [--no-write]`; writes bench/results/loco_consistency.md and .json.

Per committed H200 collection (bench/loco.py's), from its own rows:
- **jitter**: the 1-GPU rows' timing windows, median of log(max / min) over the rows (3 windows a row): how much the
  host moves a host-bound step within one launch;
- **same launch / 1-GPU launch**: each multi-GPU launch's own 1-GPU step of the model (`solo_s`: rank 0 alone; the
  earliest collection has only `local_s`: the DDP model under `no_sync()`) over the 1-GPU ladder at that batch:
  median of each launch's rows, lowest to highest, and the range over all rows;
- **faster than 1 GPU**: multi-GPU rows whose step is under 0.95x the ladder's 1-GPU step at their batch (a DDP step
  does the 1-GPU step's work and more: in one host state it is never shorter) and groups (model, batch, link) whose
  4-GPU step is under 0.95x their 2-GPU step (more ranks, same work a rank);
- **alone, in sample**: the step model fitted on this collection only, every row of it (its own 1-, 2- and 4-GPU
  steps), scoring its own multi-GPU rows: the floor the model's form reaches on these rows with this host's own
  constants, and the constants (DDP's host seconds per gradient tensor c_tensor; per link the overlap slowdown
  kappa and the per-step cost o);
- **held out, own constants**: bench/loco.py's protocol (every other collection in the store) with the host and link
  constants replaced by the alone fit's: what the held-out error would be had the site calibrated its host, beside
  the held-out error as scored and the no-fit reference's;
- **drift removed**: each multi-GPU row's step times the 1-GPU ladder over its launch's own 1-GPU step (the row on
  the 1-GPU launch's host speed): how many measured choices at min_efficiency 0.7 that changes, and how many of the
  held-out model's and the reference's choices equal the changed ones (how far a decision score is the launches'
  drift);
- **wider intervals**: the held-out rows' coverage by the model's 80% intervals with their log bounds scaled by
  each of `WIDEN` (how much wider an interval must be to cover a collection's rows, and what that does to the others).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loco  # noqa: E402
from predictor.engine import Predictor  # noqa: E402
from predictor.stepmodel import ladders_from  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FASTER = 0.95        # a multi-GPU step under this times the 1-GPU step (or a 4-GPU under its 2-GPU) is counted
LINKS = ("nvlink", "shm", "tcp")
WIDEN = (1.0, 1.5, 2.0, 2.5)   # factors on the intervals' log bounds


def window_jitter(path: Path) -> float:
    """Median over the collection's 1-GPU rows of log(max / min) of their timing windows."""
    spans = []
    for f in sorted(path.glob("w1_*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r["kind"] == "step" and len(r.get("windows") or []) >= 2:
                spans.append(float(np.log(max(r["windows"]) / min(r["windows"]))))
    return float(np.median(spans)) if spans else float("nan")


def same_launch(steps: list[dict]) -> dict:
    """Per multi-GPU launch, the median of (the launch's own 1-GPU step / the 1-GPU ladder at the batch), and the
    range over every row; rows with neither `solo_s` nor `local_s` are left out."""
    ladders = ladders_from(steps)
    by: dict[str, list[float]] = {}
    for r in steps:
        own = r.get("solo_s") or r.get("local_s")
        if sum(r["layout"]) > 1 and own:
            by.setdefault(r["launch"], []).append(own / float(ladders[(r["profile"], r["gpu"])].at(r["per_gpu_batch"])[0]))
    every = [x for v in by.values() for x in v]
    return {"launch_medians": {k: float(np.median(v)) for k, v in sorted(by.items())},
            "range": [float(min(every)), float(max(every))] if every else None}


def drift_removed(steps: list[dict]) -> dict[tuple, float]:
    """(profile, batch, link, GPUs) -> the multi-GPU step times the ladder's 1-GPU step over its launch's own
    (`solo_s`, else `local_s`; rows with neither are left out)."""
    ladders = ladders_from(steps)
    return {(r["profile"], r["per_gpu_batch"], r["intra_link"], sum(r["layout"])):
            r["iter_s"] * float(ladders[(r["profile"], r["gpu"])].at(r["per_gpu_batch"])[0])
            / (r.get("solo_s") or r.get("local_s"))
            for r in steps if sum(r["layout"]) > 1 and (r.get("solo_s") or r.get("local_s"))}


def same_as_drift_removed(rows: list[dict], steps: list[dict]) -> tuple[int, int]:
    """(measured choices @0.7 that the drift's removal changes, predicted choices equal to the drift-removed ones)."""
    fixed = drift_removed(steps)
    moved = [{**r, "iter_s": fixed.get((r["profile"], r["per_gpu_batch"], r["intra_link"], sum(r["layout"])),
                                       r["iter_s"])} for r in rows]
    one = {(r["profile"], r["per_gpu_batch"]): r["iter_s"] for r in steps if sum(r["layout"]) == 1}
    both = [{**r, "pred_s": m["iter_s"], "one_pred_s": one[(r["profile"], r["per_gpu_batch"])]}
            for r, m in zip(rows, moved)]
    return (loco.decisions(both, one)["0.7"]["groups"] - loco.decisions(both, one)["0.7"]["same"],
            loco.decisions(moved, one)["0.7"]["same"])


def widened_coverage(rows: list[dict]) -> dict[str, float]:
    """Per factor of `WIDEN`: the share of rows whose measured step lies in the prediction's interval with its log
    bounds (around the predicted step) scaled by the factor."""
    inside = {}
    for f in WIDEN:
        hits = []
        for r in (r for r in rows if r.get("interval")):
            x = r["pred_s"] / (sum(r["layout"]) * r["per_gpu_batch"])       # seconds a sample, predicted
            lo, hi = np.log(r["interval"][0] * x), np.log(r["interval"][1] * x)
            e = np.log(r["pred_s"] / r["iter_s"])                              # measured throughput over predicted
            hits.append(f * lo <= e <= f * hi)
        inside[str(f)] = float(np.mean(hits)) if hits else float("nan")
    return inside


def faster_than_possible(steps: list[dict]) -> dict:
    """Rows (of the multi-GPU ones) under FASTER x the 1-GPU ladder's step at their batch, and groups (model, batch,
    link) whose 4-GPU step is under FASTER x their 2-GPU step."""
    ladders = ladders_from(steps)
    multi = [r for r in steps if sum(r["layout"]) > 1]
    rows = sum(r["iter_s"] < FASTER * float(ladders[(r["profile"], r["gpu"])].at(r["per_gpu_batch"])[0])
               for r in multi)
    at: dict[tuple, dict] = {}
    for r in multi:
        at.setdefault((r["profile"], r["per_gpu_batch"], r["intra_link"]), {})[sum(r["layout"])] = r["iter_s"]
    pairs = [g for g in at.values() if 2 in g and 4 in g]
    return {"rows": int(rows), "of": len(multi), "groups_4_under_2": sum(g[4] < FASTER * g[2] for g in pairs),
            "groups": len(pairs)}


def alone(held: str, data: dict) -> tuple[Predictor, list[dict]]:
    """The model fitted on collection `held` alone (every row, one signer) and its predictions of its own
    multi-GPU rows, in bench/loco.py's row shape."""
    prof, coll, steps = data[held]
    pred = Predictor().fit(prof, loco.signed(coll, 0) + loco.signed(steps, 0))
    out = []
    for r in (r for r in steps if sum(r["layout"]) > 1):
        p, one = pred.predict(prof[r["profile"]], r["gpu"], r["per_gpu_batch"],
                              [{"layout": r["layout"], "intra_link": r["intra_link"], "inter_link": None},
                               {"layout": [1], "intra_link": r["intra_link"], "inter_link": None}])
        out.append({**loco._row(r), "pred_s": p["iter_s"], "one_pred_s": one["iter_s"], "interval": p.get("interval")})
    return pred, out


def scored(rows: list[dict], steps: list[dict]) -> dict:
    one = {(r["profile"], r["per_gpu_batch"]): r["iter_s"] for r in steps if sum(r["layout"]) == 1}
    return {"all": loco.mape(rows), "transport": {l: loco.mape([r for r in rows if r["intra_link"] == l])
                                                  for l in LINKS if any(r["intra_link"] == l for r in rows)},
            "same_07": loco.decisions(rows, one)["0.7"]["same"], "groups": loco.decisions(rows, one)["0.7"]["groups"]}


def report(data: dict, paths: dict) -> dict:
    out = {}
    for held in sorted(data):
        steps = data[held][2]
        pred, own = alone(held, data)
        P = pred.params_
        new, ref = loco.predictions("new", data, held), loco.predictions("reference", data, held)
        changed, new_same = same_as_drift_removed(new, steps)
        out[held] = {"jitter": window_jitter(paths[held]), "same_launch": same_launch(steps),
                     "faster": faster_than_possible(steps), "alone": scored(own, steps),
                     "c_tensor_us": {g: h.c_tensor * 1e6 for g, h in P.hosts.items()},
                     "links": {l: {"kappa": c.kappa, "o_ms": c.o * 1e3} for l, c in sorted(P.links.items())},
                     "held_out": scored(new, steps),
                     "held_out_own_constants": scored(loco.predictions("new", data, held, constants=P), steps),
                     "reference": scored(ref, steps),
                     "drift_removed": {"changed": changed, "new_same": new_same,
                                       "reference_same": same_as_drift_removed(ref, steps)[1]},
                     "widened_coverage": widened_coverage(new)}
    return out


def render(rep: dict) -> list[str]:
    def fig(s):
        return (f"{s['all']:.1f}% (" + " / ".join(f"{s['transport'].get(l, float('nan')):.1f}" for l in LINKS)
                + f") {s['same_07']}/{s['groups']}")
    lines = ["# What each held-out collection's score rests on (`python bench/loco_consistency.py`)", "",
             "Module docstring for the columns. MAPE as `all (nvlink / shm / tcp)`, then the same GPU count as measured "
             "at min_efficiency 0.7.", "",
             "| collection | 1-GPU window jitter | same launch / 1-GPU launch: launch medians (row range) "
             "| multi-GPU rows < 0.95x 1-GPU | groups 4 GPUs < 0.95x 2 GPUs | alone, in sample | own c_tensor "
             "| own kappa, o (nvlink / shm / tcp) |", "|---|---|---|---|---|---|---|---|"]
    for held, r in rep.items():
        sl = r["same_launch"]
        meds = sorted(sl["launch_medians"].values())
        f = r["faster"]
        lines.append(f"| {held} | {r['jitter']:.3f} | {meds[0]:.2f}-{meds[-1]:.2f} ({sl['range'][0]:.2f}-"
                     f"{sl['range'][1]:.2f}) | {f['rows']}/{f['of']} | {f['groups_4_under_2']}/{f['groups']} "
                     f"| {fig(r['alone'])} | " + ", ".join(f"{v:.0f} us" for v in r["c_tensor_us"].values())
                     + " | " + " / ".join(f"{r['links'][l]['kappa']:.2f}, {r['links'][l]['o_ms']:.1f} ms"
                                          for l in LINKS if l in r["links"]) + " |")
    lines += ["", "Held out (bench/loco.py's protocol): as scored, with the collection's own host and link constants "
              "(its alone fit's) in place of the fitted ones, and the no-fit reference.", "",
              "| collection | held out | held out, own constants | reference | drift removed: measured choices "
              "changed; same choice as them, held out / reference |", "|---|---|---|---|---|"]
    for held, r in rep.items():
        d = r["drift_removed"]
        lines.append(f"| {held} | {fig(r['held_out'])} | {fig(r['held_out_own_constants'])} | {fig(r['reference'])} "
                     f"| {d['changed']}/{r['held_out']['groups']}; {d['new_same']} / {d['reference_same']} |")
    lines += ["", "The held-out rows' coverage by the 80% intervals with their log bounds scaled (the issue asks 70-90%).",
              "", "| collection | " + " | ".join(f"x{f}" for f in WIDEN) + " |", "|---|" + "---|" * len(WIDEN)]
    for held, r in rep.items():
        lines.append(f"| {held} | " + " | ".join(f"{v:.0%}" for v in r["widened_coverage"].values()) + " |")
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    paths = {loco.name_of(p): p for p in loco.collections()}
    data = {k: loco.load(p) for k, p in paths.items()}
    rep = report(data, paths)
    text = "\n".join(render(rep))
    print(text)
    if not a.no_write:
        (RESULTS / "loco_consistency.md").write_text(text + "\n")
        (RESULTS / "loco_consistency.json").write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
