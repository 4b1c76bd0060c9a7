"""Cross-type prediction on Gavel's measured throughputs (26 job types x K80/P100/V100 x 1-8 GPUs, consolidated).

Run: `python bench/crosstype.py [--no-write]`. Prints the table and writes bench/results/crosstype.md.

A pair is (job type, GPU count, target type T, source type S): predict the job's steps/s on T from its steps/s on
S alone (not its third type) plus every row of the other job types on S and T. A job type is Gavel's
(name, GPU count) key, so 79 keys measured on all three types give 6 pairs each and 4 keys on two types (ResNet-50
bs 128, no K80 value) give 2: 482 pairs.
- leave-one-job-type-out: the other job types are every other (name, GPU count) key, the same model's other batch
  sizes and GPU counts included.
- (model, batch) held out: every GPU count of the job's (model, batch) is held out with it (the same model's other
  batch sizes stay): the issue's strict cross-type protocol, no interpolation across GPU counts of the same job.
- leave-one-model-out: every key of the same model (all batch sizes and GPU counts) is held out with it.
Models: the median-ratio baseline (steps/s on S times the median T/S ratio of the training keys; the issue's
36.6% on 482 pairs reproduces it) and ours (predictor/crosstype.py: a GP of the log ratio over parameter count,
batch, GPU count and the source step time, hyperparameters by ML-II on the training rows of each fit, around the
pooled centre (mean of the per-model median ratios); a model outside the training rows gets that centre, with
the spread it showed leaving each training model out).
Metric: MAPE of steps/s over the pairs; also the share of pairs whose measured value lies within ours'
1-sigma and 2-sigma band (calibration of the uncertainty).
Reading: leave-one-job-type-out is where the GP pays: the model's other batches and GPU counts on T say most.
Leave-one-model-out is the engine's case (a profile never run on T) and nothing model-specific carries over on
Gavel's 7 models: the parameter count (the only model feature; Gavel's job types carry no FLOPs) sent a held-out
model to the ratios of unrelated models of similar size (ResNet-50 25.6 M between Recommendation 24 M and
CycleGAN 28 M: 77.3%), the GPU-count terms alone scored 41-46%, and a shrinkage weight towards the centre chosen
by leave-one-model-out inside each fit's training rows 42-44%. So a new model gets the pooled centre (each model
one vote: 38.9% against the rows' median's 39.5%), and the spread it showed when each training model was left
out, which covers the error about as a normal band should.
Roofline prior (#25.3, predictor/roofline.py): the same GP, but a model outside the training rows is centred on
a ratio from its shape (training FLOPs and bytes per sample, bytes and kernel launches per step, gradient bytes,
counted by bench/gavel_shapes.py) and each type's datasheet peaks (FP32 FLOP/s, memory bandwidth, interconnect;
predictor/data/roofline/); its two constants per direction (host seconds per launch, how far T runs from its
peak relative to S) are fitted per pair on that pair's training keys only, so the held-out model never enters
its own fit. Models of the training rows keep the GP's answer (leave-one-job-type-out unchanged by design).
Even the model's own median ratio (in-sample oracle, one constant per model and direction) scores 27.4% on the
482 pairs (24.6% with the constant that minimises each model's own MAPE), and the roofline fitted on all 482
pairs, its held-out model included, 30.3% (in-sample, three constants per direction): much of what is left is the
GPU-count spread inside a model (P100 -> V100 ratios of one model span 0.2-1.4 over GPU counts), which no centre
from the model's shape can follow. So the 25% target is out of reach of a shape-based centre on these 7 models.
The engine (tm-2026.11.28-2, predictor/engine.py `_cross_type`) centres a profile never measured on the target
type on this prior, built from what a service profile knows (predictor.roofline.profile_shape: FLOPs per sample,
parameter bytes, tensor count x OPS_PER_TENSOR launches, no activation bytes); `--profile-shapes` scores that
case here (printed only; seen, tm-2026.11.28-2: 10.5% / 17.8% / 35.3% for the three protocols below).
Tried for a new model and not kept (seen, leave-one-model-out): a per-(direction, GPU count) offset of the
roofline's residuals over the training models, each one vote, 36.7-39.6%; the roofline as the GP's mean function
for every row (residual GP) 38.4% (and 19.1% with (model, batch) held out, against 18.1%); splitting the measured
source step into host and device shares by a fitted source efficiency 36.5-37.9%.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor.crosstype import CrossTypeModel, features, mape, median_ratio  # noqa: E402
from predictor.datasets import load_gavel  # noqa: E402
from predictor.roofline import (DATA, OPS_PER_TENSOR, RooflinePrior, Shape, load_gavel_shapes,  # noqa: E402
                                load_peaks)

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = {"leave-one-job-type-out": 15.0, "(model, batch) held out": 15.0, "leave-one-model-out": 25.0}
ISSUE_BASELINE = {"leave-one-job-type-out": "36.6% (482 pairs)", "(model, batch) held out": "ours 18.6%, baseline 37.0%",
                  "leave-one-model-out": "ours 38.9%, baseline 39.5%"}


def _x(rows, src_tput):
    """Features of rows whose source step time is 1 / src_tput (steps/s)."""
    return features([r["n_params"] for r in rows], [None] * len(rows), [r["batch"] for r in rows],
                    [r["gpus"] for r in rows], 1.0 / np.asarray(src_tput, dtype=float))


def roofline_prior(info, train, key, s, t, y, shapes, peaks) -> float:
    """The roofline prior of `key` for S -> T, its constants fitted on the `train` keys only (y their log
    ratios); NaN where the model has no shape."""
    prior = RooflinePrior(s, t, peaks).fit([shapes.get(info[k]["model"]) for k in train],
                                           [info[k]["batch"] for k in train], y,
                                           [info[k]["model"] for k in train], [info[k]["gpus"] for k in train])
    return float(prior.predict([shapes.get(info[key]["model"])], [info[key]["batch"]], [info[key]["gpus"]])[0])


def profile_shapes() -> dict[str, Shape]:
    """Gavel's models as the engine sees a service profile (predictor.roofline.profile_shape): FLOPs per sample,
    parameter bytes, tensor count x OPS_PER_TENSOR launches; no activation bytes, no counted ops."""
    import csv
    with open(DATA / "gavel_model_shapes.csv", encoding="utf-8", newline="") as f:
        return {r["model"]: Shape(float(r["train_flops_per_sample"]), 0.0, 4 * float(r["param_bytes"]),
                                  OPS_PER_TENSOR * float(r["n_tensors"]), float(r["param_bytes"]))
                for r in csv.DictReader(f)}


def run(rows, held_out, shapes=None, peaks=None) -> dict:
    """Predict every pair under `held_out(key, other_key) -> bool`; returns per model: MAPE, pairs, coverage
    (`ours`: the GP with the pooled centre for a new model, `roofline`: the same GP with the roofline prior
    as that centre)."""
    shapes = load_gavel_shapes() if shapes is None else shapes
    peaks = load_peaks() if peaks is None else peaks
    tput = {((r["job_type"], r["gpus"]), r["gpu"]): r["steps_per_s"] for r in rows}
    info = {(r["job_type"], r["gpus"]): r for r in rows}
    types = sorted({r["gpu"] for r in rows})
    meas, base, ours, std, roof, roof_std = [], [], [], [], [], []
    for key in sorted(info):
        for t in types:
            for s in types:
                if s == t or (key, t) not in tput or (key, s) not in tput:
                    continue
                train = [k for k in sorted(info) if (k, t) in tput and (k, s) in tput and not held_out(key, k)]
                y = np.log([tput[(k, s)] / tput[(k, t)] for k in train])  # log(step_T / step_S)
                model = CrossTypeModel().fit(_x([info[k] for k in train], [tput[(k, s)] for k in train]), y)
                xk = _x([info[key]], [tput[(key, s)]])
                m, sd = model.predict(xk, return_std=True)
                p = roofline_prior(info, train, key, s, t, y, shapes, peaks)
                mr, sdr = model.predict(xk, return_std=True, prior=[p])
                roof.append(tput[(key, s)] / np.exp(mr[0]))
                roof_std.append(sdr[0])
                meas.append(tput[(key, t)])
                base.append(tput[(key, s)] / np.exp(median_ratio(y)))
                ours.append(tput[(key, s)] / np.exp(m[0]))
                std.append(sd[0])
    meas, ours, std, roof, roof_std = map(np.array, (meas, ours, std, roof, roof_std))
    z = np.abs(np.log(meas / ours)) / std
    zr = np.abs(np.log(meas / roof)) / roof_std
    return {"pairs": len(meas), "baseline": mape(base, meas), "ours": mape(ours, meas),
            "within_1sd": float(np.mean(z <= 1)), "within_2sd": float(np.mean(z <= 2)),
            "roofline": mape(roof, meas), "roofline_1sd": float(np.mean(zr <= 1)),
            "roofline_2sd": float(np.mean(zr <= 2))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only; do not write bench/results")
    ap.add_argument("--profile-shapes", action="store_true",
                    help="the roofline from what a service profile knows (the engine's case), not the counted shapes")
    args = ap.parse_args(argv)
    shapes = profile_shapes() if args.profile_shapes else None
    rows, t0 = load_gavel(), time.time()
    protocols = {"leave-one-job-type-out": lambda key, k: k == key,
                 "(model, batch) held out": lambda key, k: k[0] == key[0],
                 "leave-one-model-out": lambda key, k: k[0].split(" (")[0] == key[0].split(" (")[0]}
    lines = ["| protocol | pairs | median-ratio baseline MAPE | ours (pooled centre) MAPE | within 1 sd / 2 sd | "
             "ours + roofline prior MAPE | within 1 sd / 2 sd | target | issue's baseline |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, held in protocols.items():
        r = run(rows, held, shapes)
        tgt = TARGET.get(name)
        lines.append(f"| {name} | {r['pairs']} | {r['baseline']:.1f}% | {r['ours']:.1f}% | "
                     f"{r['within_1sd']:.2f} / {r['within_2sd']:.2f} | {r['roofline']:.1f}% | "
                     f"{r['roofline_1sd']:.2f} / {r['roofline_2sd']:.2f} | {'<= %.0f%%' % tgt if tgt else ''} | "
                     f"{ISSUE_BASELINE.get(name, '')} |")
        print(f"{name}: done at {time.time() - t0:.0f} s", file=sys.stderr)
    text = "\n".join(lines)
    print(text)
    if not args.no_write and not args.profile_shapes:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "crosstype.md").write_text(
            "# Cross-type prediction on Gavel (`python bench/crosstype.py`)\n\n" + __doc__.split("\n", 2)[2]
            + "\n" + text + f"\n\nWall time {time.time() - t0:.0f} s.\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
