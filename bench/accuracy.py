"""Accuracy benchmark of the throughput predictor against the Pollux step-time model on measured public data.

Run: `python bench/accuracy.py [--datasets pollux-t4,morphling-a800,elasticflow-a100] [--no-write] [--dump F]`
Prints one table per protocol and writes bench/results/accuracy.md and accuracy.json.

Protocols (both models fitted on exactly the same rows; ours jointly over all models of the dataset, so the
links' behaviour learnt on other models' rows is used, Pollux per model as in AdaptDL):
- A (layouts held out): for each model m and GPU count G at which m has several layouts, fit on every row of
  the dataset except m's rows with that G (m's other G and the other models' rows, all G, stay), predict the
  held-out rows. No row of (m, G) is ever seen, so permutations of a held-out layout (`1133` / `1313`) are not
  leaked.
- B (small to large): fit on the rows with G <= 4 (all models), predict the rows with G >= 8; on T4 also
  scalability.csv (6-16 nodes, up to 64 GPUs), reported as its own line.
Metrics: MAPE of throughput over the predicted rows; per (model, G, batch) group of >= 2 layouts: Kendall tau
of predicted vs measured throughput, chosen/best (measured throughput of the predicted-best layout over the best
measured; predicted ties = uniform random pick, i.e. the mean over the tie), the same over multi-node layouts
only, and near-best (chosen within 3 % of the best). Group metrics are averaged over groups.
The "ceiling" row is no model: in each held-out group it picks the layout class (multiset of GPUs per node,
so permutations count as one) whose measured throughput, relative to the best of its group, is highest on
average over the OTHER batch sizes of the same (model, G). It reads held-out measurements, so it bounds what
any model that cannot tell permutations apart (ours, Pollux) can reach on chosen/best under this noise.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor.datasets import load_elasticflow, load_morphling, load_pollux  # noqa: E402
from predictor.engine import Predictor  # noqa: E402
from predictor.pollux import PolluxModel  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DUMP: dict[str, list] = {}  # per-row predictions, written with --dump
TARGETS = {("pollux-t4", "A"): 6.5, ("pollux-t4", "B"): 10.0, ("pollux-t4", "B-scal"): 15.0,
           ("morphling-a800", "A"): 12.0}
REFERENCE = {("pollux-t4", "A"): "7.7% / 0.929 / 0.899", ("pollux-t4", "B"): "25.5%",
             ("pollux-t4", "B-scal"): "44.7%", ("morphling-a800", "A"): "24.8% / - / 0.764"}


def _G(r):
    return sum(r["layout"])


def _tput(r, iter_s):
    return _G(r) * float(r["per_gpu_batch"]) / iter_s


def predict_ours(model: Predictor, profiles, rows) -> np.ndarray:
    """Step seconds for rows, batched per (profile, gpu, batch)."""
    out = np.empty(len(rows))
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r["profile"], r["gpu"], r["per_gpu_batch"]), []).append(i)
    for (prof, gpu, b), idx in groups.items():
        cands = [{"layout": rows[i]["layout"], "intra_link": rows[i]["intra_link"],
                  "inter_link": rows[i].get("inter_link")} for i in idx]
        for i, p in zip(idx, model.predict(profiles[prof], gpu, b, cands)):
            out[i] = p["iter_s"]
    return out


def group_metrics(rows, pred_iter, rng) -> dict:
    """Kendall tau, chosen/best (all, multi-node), near-best over (model, G, batch) groups of >= 2 layouts."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r["profile"], _G(r), r["per_gpu_batch"]), []).append(i)
    taus, cb, cb_multi, near = [], [], [], []
    for idx in groups.values():
        if len({tuple(rows[i]["layout"]) for i in idx}) < 2:
            continue
        meas = np.array([_tput(rows[i], rows[i]["iter_s"]) for i in idx])
        pred = np.array([_tput(rows[i], pred_iter[i]) for i in idx])
        tau = kendalltau(pred, meas).statistic
        if np.isfinite(tau):
            taus.append(tau)
        ties = np.isclose(pred, pred.max(), rtol=1e-9)
        cb.append(float(np.mean(meas[ties]) / meas.max()))
        near.append(float(np.mean(meas[ties] >= 0.97 * meas.max())))
        multi = np.array([len(rows[i]["layout"]) > 1 for i in idx])
        if multi.sum() >= 2:
            pm, mm = pred[multi], meas[multi]
            t = np.isclose(pm, pm.max(), rtol=1e-9)
            cb_multi.append(float(np.mean(mm[t]) / mm.max()))
    mean = lambda v: float(np.mean(v)) if v else None  # noqa: E731
    return {"groups": len(cb), "kendall_tau": mean(taus), "chosen_best": mean(cb),
            "chosen_best_multinode": mean(cb_multi), "near_best": mean(near)}


def class_ceiling(rows) -> dict | None:
    """Chosen/best of the cross-batch layout-class oracle described in the module docstring."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["profile"], _G(r), r["per_gpu_batch"]), []).append(r)
    rel: dict[tuple, dict] = {}
    for (m, G, b), g in groups.items():
        best = max(_tput(r, r["iter_s"]) for r in g)
        for r in g:
            cls = rel.setdefault((m, G), {}).setdefault(tuple(sorted(r["layout"])), {})
            cls.setdefault(b, []).append(_tput(r, r["iter_s"]) / best)
    out = {False: [], True: []}
    for (m, G, b), g in groups.items():
        for multi in (False, True):
            cand = [r for r in g if len(r["layout"]) > 1 or not multi]
            if len({tuple(r["layout"]) for r in cand}) < 2:
                continue
            def score(cls):  # noqa: E306
                v = [np.mean(x) for bb, x in rel[(m, G)][cls].items() if bb != b]
                return float(np.mean(v)) if v else 0.0
            pick = max({tuple(sorted(r["layout"])) for r in cand}, key=score)
            meas = [_tput(r, r["iter_s"]) for r in cand]
            chosen = [t for r, t in zip(cand, meas) if tuple(sorted(r["layout"])) == pick]
            out[multi].append(float(np.mean(chosen)) / max(meas))
    batches: dict[tuple, set] = {}
    for r in rows:
        batches.setdefault((r["profile"], _G(r)), set()).add(r["per_gpu_batch"])
    if not out[False] or all(len(v) < 2 for v in batches.values()):
        return None  # one batch size per (model, G): nothing to learn a class preference from
    return {"rows": len(rows), "mape_pct": None, "groups": len(out[False]), "kendall_tau": None,
            "chosen_best": float(np.mean(out[False])),
            "chosen_best_multinode": float(np.mean(out[True])) if out[True] else None, "near_best": None}


def evaluate(rows, pred_iter, rng) -> dict:
    meas = np.array([_tput(r, r["iter_s"]) for r in rows])
    pred = np.array([_tput(r, t) for r, t in zip(rows, pred_iter)])
    ok = np.isfinite(pred)
    mape = float(np.mean(np.abs(pred[ok] - meas[ok]) / meas[ok]) * 100) if ok.any() else None
    return {"rows": int(ok.sum()), "mape_pct": mape, **group_metrics(rows, pred_iter, rng)}


def _fit_both(ds, train, only_profile=None):
    """Ours on all training rows; Pollux (a per-job model) on the training rows of the job(s) predicted."""
    ours = Predictor().fit(ds.profiles, train)
    ref = PolluxModel().fit([r for r in train if only_profile in (None, r["profile"])])
    return ours, ref


def protocol_a(ds, rng):
    held = sorted({(r["profile"], _G(r)) for r in ds.steps})
    held = [(m, G) for m, G in held
            if len({tuple(r["layout"]) for r in ds.steps if r["profile"] == m and _G(r) == G}) >= 2]
    rows, ours_pred, ref_pred = [], [], []
    for m, G in held:
        test = [r for r in ds.steps if r["profile"] == m and _G(r) == G]
        train = [r for r in ds.steps if not (r["profile"] == m and _G(r) == G)]
        ours, ref = _fit_both(ds, train, m)
        rows += test
        ours_pred.append(predict_ours(ours, ds.profiles, test))
        ref_pred.append(ref.predict(test))
    if not rows:
        return None
    DUMP.setdefault(ds.name + "/A", []).extend(
        {**r, "pred_ours": float(a), "pred_pollux": float(b)}
        for r, a, b in zip(rows, np.concatenate(ours_pred), np.concatenate(ref_pred)))
    return {"fits": len(held), "ours": evaluate(rows, np.concatenate(ours_pred), rng),
            "pollux": evaluate(rows, np.concatenate(ref_pred), rng), "ceiling": class_ceiling(rows)}


def protocol_b(ds, rows, rng):
    train = [r for r in ds.steps if _G(r) <= 4]
    test = [r for r in rows if _G(r) >= 8 and r["profile"] in {t["profile"] for t in train}]
    if not test:
        return None
    ours, ref = _fit_both(ds, train)
    po, pp = predict_ours(ours, ds.profiles, test), ref.predict(test)
    DUMP.setdefault(ds.name + "/B" + ("-scal" if rows is ds.extra else ""), []).extend(
        {**r, "pred_ours": float(a), "pred_pollux": float(b)} for r, a, b in zip(test, po, pp))
    return {"fits": 1, "ours": evaluate(test, po, rng), "pollux": evaluate(test, pp, rng)}



def _fmt(v, pct=False):
    if v is None:
        return "-"
    return f"{v:.1f}%" if pct else f"{v:.3f}"


def table(results) -> str:
    head = ("| dataset | protocol | model | rows | groups | MAPE | Kendall tau | chosen/best | chosen/best multi-node "
            "| near-best | target MAPE | issue's Pollux (MAPE / c/b / c/b multi) |")
    lines = [head, "|" + "---|" * 12]
    for (dname, proto), res in results.items():
        if res is None:
            lines.append(f"| {dname} | {proto} | n/a (no G with several layouts) | | | | | | | | | |")
            continue
        for who in ("ours", "pollux", "ceiling"):
            e = res.get(who)
            if e is None:
                continue
            tgt = TARGETS.get((dname, proto))
            lines.append(f"| {dname} | {proto} | {who} | {e['rows']} | {e['groups']} | {_fmt(e['mape_pct'], True)} | "
                         f"{_fmt(e['kendall_tau'])} | {_fmt(e['chosen_best'])} | {_fmt(e['chosen_best_multinode'])} | "
                         f"{_fmt(e['near_best'])} | {'<= %.1f%%' % tgt if tgt and who == 'ours' else ''} | "
                         f"{REFERENCE.get((dname, proto), '') if who == 'pollux' else ''} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="pollux-t4,morphling-a800,elasticflow-a100")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write bench/results")
    ap.add_argument("--dump", help="also write every predicted row (measured and both predictions) to this JSON file")
    args = ap.parse_args(argv)
    loaders = {"pollux-t4": load_pollux, "morphling-a800": load_morphling, "elasticflow-a100": load_elasticflow}
    rng = np.random.default_rng(0)
    results, t0 = {}, time.time()
    for name in args.datasets.split(","):
        ds = loaders[name]()
        results[(name, "A")] = protocol_a(ds, rng)
        results[(name, "B")] = protocol_b(ds, ds.steps, rng)
        if ds.extra:
            results[(name, "B-scal")] = protocol_b(ds, ds.extra, rng)
        print(f"{name}: done at {time.time() - t0:.0f} s", file=sys.stderr)
    if args.dump:
        Path(args.dump).write_text(json.dumps(DUMP), encoding="utf-8")
    text = table(results)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "accuracy.md").write_text(
            "# Throughput prediction accuracy (`python bench/accuracy.py`)\n\n" + __doc__.split("\n", 2)[2]
            + "\n" + text + f"\n\nWall time {time.time() - t0:.0f} s.\n", encoding="utf-8")
        (RESULTS / "accuracy.json").write_text(json.dumps(
            {f"{d}/{p}": r for (d, p), r in results.items()}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
