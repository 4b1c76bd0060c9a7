"""Where a held-out collection's errors and wrong GPU-count choices come from (issue 38), row by row.

Run: `python bench/loco_rows.py [--held NAME ...]` (default `coldstart/session7`); prints markdown, writes nothing.

bench/loco.py's protocol (its `held_out_store`: every other collection in the store, the held-out one's profiles,
sweeps and 1-GPU ladders only). Per held-out multi-GPU row: the measured step, the step model's prediction and its
split (compute_s: the 1-GPU step T1 at the row's batch, from the pooled ladder; comm_s: the all-reduce from the first
bucket's start to the last one's end; host: the ladder's floor plus DDP's fitted host work; gate), beside the held-out
collection's own 1-GPU step. Then:
- **own sweep / pooled sweep**: the held-out collection's all-reduce sweep over the sweep the model reads (each
  point's median over owners, all collections pooled), at the sizes of DDP's buckets (>= 1 MiB);
- **variants**: MAPE and same choices at min_efficiency 0.7 (bench/loco.py's `decisions`) of the model as fitted and
  with the pooled sweep replaced by the held-out collection's own (a candidate mechanism: the host's own sweep);
- **signed error by launch and gate**: mean of measured / predicted - 1 (negative: the model predicts too slow);
- **wrong choices**: the groups (model, batch, link) whose predicted choice differs from the measured one at 0.7,
  with the measured and predicted scaling efficiency X_G / (G X_1) at each GPU count G (the policy,
  predictor.planner's `_efficiency`, judges the step from its anchor: (X_G - X_a) / ((G - a) X_a / a) >= 0.7,
  which from 1 GPU is a scaling efficiency of 0.85 at 2 GPUs and 0.775 at 4, and from 2 to 4 GPUs X_4 / X_2 >= 1.7).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loco  # noqa: E402
from coldstart import load  # noqa: E402
from predictor import stepmodel  # noqa: E402
from predictor.engine import Predictor  # noqa: E402

MIN_EFF = 0.7


def rows_of(data: dict, held: str, own_sweep: bool = False) -> list[dict]:
    """Each held-out multi-GPU row with the model's prediction, its split, and the 1-GPU prediction at its batch."""
    profiles, obs, rows = loco.held_out_store(data, held)
    params = Predictor().fit(profiles, obs).params_
    if own_sweep:
        params = dataclasses.replace(params, collectives=stepmodel.Collectives.from_rows(data[held][1]))
    out = []
    for r in rows:
        prof, b = profiles[r["profile"]], r["per_gpu_batch"]
        lad = params.ladders[(r["profile"], r["gpu"])]
        p = stepmodel.predict_layouts(params, lad, prof, r["gpu"], b, [r["layout"], [1]], r["intra_link"], None)
        host = params.host(r["gpu"]).seconds(len(prof.buckets_bytes), len(prof.tensors))
        out.append({**loco._row(r), "launch": r["launch"], "pred_s": float(p["iter_s"][0]),
                    "one_pred_s": float(p["iter_s"][1]), "compute_s": float(p["compute_s"][0]),
                    "comm_s": float(p["comm_s"][0]), "host_s": min(lad.floor, float(p["compute_s"][0])) + host,
                    "gate": str(p["gate"][0])})
    return out


def signed_error(rows: list[dict]) -> dict[str, dict[str, tuple[float, int]]]:
    """{launch: {gate: (mean of measured / predicted - 1, rows)}}."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["launch"], {}).setdefault(r["gate"], []).append(r["iter_s"] / r["pred_s"] - 1.0)
    return {l: {g: (float(np.mean(v)), len(v)) for g, v in gs.items()} for l, gs in by.items()}


def wrong_choices(rows: list[dict], one: dict, min_eff: float) -> list[dict]:
    """The groups (profile, batch, link) whose GPU count picked from the predicted curve differs from the one picked
    from the measured curve (bench/loco.py's `choice`; 1 GPU: `one[(profile, batch)]` measured, `one_pred_s`
    predicted), with each curve's scaling efficiency {G: X_G / (G X_1)} and the gates of the rows' predictions."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["profile"], r["per_gpu_batch"], r["intra_link"]), []).append(r)
    out = []
    for (m, b, link), rs in groups.items():
        meas = {1: b / one[(m, b)]} | {sum(r["layout"]): sum(r["layout"]) * b / r["iter_s"] for r in rs}
        pred = {1: b / rs[0]["one_pred_s"]} | {sum(r["layout"]): sum(r["layout"]) * b / r["pred_s"] for r in rs}
        want, got = loco.choice(meas, min_eff), loco.choice(pred, min_eff)
        if want != got:
            eff = lambda c: {g: c[g] / (g * c[1]) for g in c if g > 1}  # noqa: E731
            out.append({"profile": m, "per_gpu_batch": b, "link": link, "want": want, "got": got,
                        "measured": eff(meas), "predicted": eff(pred), "gates": sorted({r["gate"] for r in rs})})
    return out


def report(data: dict, held: str) -> list[str]:
    one = {(r["profile"], r["per_gpu_batch"]): r["iter_s"] for r in data[held][2] if sum(r["layout"]) == 1}
    rows = rows_of(data, held)
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    lines = [f"## {held}", "", "| model | batch | GPUs | link | measured ms | predicted ms | error | T1 pooled | "
             "T1 own | comm_s | host path | gate |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['profile']} | {r['per_gpu_batch']} | {sum(r['layout'])} | {r['intra_link']} | "
                     f"{ms(r['iter_s'])} | {ms(r['pred_s'])} | {(r['iter_s'] / r['pred_s'] - 1) * 100:+.1f}% | "
                     f"{ms(r['compute_s'])} | {ms(one[(r['profile'], r['per_gpu_batch'])])} | {ms(r['comm_s'])} | "
                     f"{ms(r['host_s'])} | {r['gate']} |")
    own = stepmodel.Collectives.from_rows(data[held][1])
    pooled = Predictor().fit(*loco.held_out_store(data, held)[:2]).params_.collectives
    lines += ["", "Own sweep / pooled sweep at DDP's bucket sizes (>= 1 MiB), range over sizes:", ""]
    for (link, world), (bs, ts) in sorted(own.curves.items()):
        ratio = ts[bs >= 2 ** 20] / pooled.time(link, world, bs[bs >= 2 ** 20])
        lines.append(f"- {link} world {world}: {ratio.min():.2f}-{ratio.max():.2f} (median {np.median(ratio):.2f})")
    lines += ["", "| variant | MAPE | nvlink | shm | tcp | same @0.7 | too few | too many |", "|---|---|---|---|---|---|---|---|"]
    for name, rs in (("model", rows), ("own sweep", rows_of(data, held, own_sweep=True))):
        d = loco.decisions(rs, one)[str(MIN_EFF)]
        lines.append(f"| {name} | {loco.mape(rs):.1f}% | " + " | ".join(
            f"{loco.mape([r for r in rs if r['intra_link'] == l]):.1f}%" for l in ("nvlink", "shm", "tcp"))
            + f" | {d['same']}/{d['groups']} | {d['under']} | {d['over']} |")
    lines += ["", "Signed error (measured / predicted - 1) by launch and gate:", ""]
    lines += [f"- {launch}: " + ", ".join(f"{g} {e * 100:+.1f}% (n={n})" for g, (e, n) in sorted(by.items()))
              for launch, by in sorted(signed_error(rows).items())]
    lines += ["", f"Wrong choices at {MIN_EFF} (scaling efficiency X_G / (G X_1) at G = 2, 4; measured, predicted):", ""]
    fmt = lambda e: " ".join(f"{g}:{v:.2f}" for g, v in sorted(e.items()))  # noqa: E731
    lines += [f"- {w['profile']} b{w['per_gpu_batch']} {w['link']}: measured {w['want']} GPUs ({fmt(w['measured'])}), "
              f"predicted {w['got']} ({fmt(w['predicted'])}); gates {', '.join(w['gates'])}"
              for w in wrong_choices(rows, one, MIN_EFF)]
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--held", action="append", metavar="NAME", help="held-out collection (repeatable)")
    a = ap.parse_args(argv)
    data = {loco.name_of(p): load(p) for p in loco.collections()}
    held = a.held or ["coldstart/session7"]
    unknown = sorted(set(held) - set(data))
    if unknown:
        ap.error(f"--held {', '.join(unknown)}: no such collection (there are: {', '.join(sorted(data))})")
    print("\n".join([f"# Held-out rows, split (`python bench/loco_rows.py --held ...`; model "
                     f"`{stepmodel.MODEL_VERSION}`)", ""] + [x for h in held for x in report(data, h)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
