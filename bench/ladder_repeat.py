"""How far one GPU's step moves between launches of the same code on the same machine (issue 38's ceiling).

Run: `python bench/ladder_repeat.py [DIR...]` (default: the session-27 launches under
bench/results/gpu_runs/2026-12-04_session27/); writes bench/results/ladder_repeat.md with `--out`.

Each DIR holds the `w1_none.jsonl` of several 1-GPU launches of bench/coldstart_collect.py (`r<N>.jsonl`, run one
after the other by `bash bench/gpu_suite.sh coldstart 1`: same host, code, models and batches, a minute apart). Per
(model, batch): the spread of the launches' step times (max / min - 1), and whether the step is the host's or the
GPU's: host-bound where the step at this batch is under HOST_BOUND times the step at the ladder's smallest batch
(doubling the batch hardly moves it: Python and kernel launches set it), GPU-bound otherwise. The step model reads
one launch's ladder: a host-bound row cannot be predicted closer than the next launch moves it, and neither can the
efficiency a GPU-count decision compares against it (bench/loco.py's `remeasured` row shows the same on the
committed collections' multi-GPU launches).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coldstart import load  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = HERE / "results" / "gpu_runs" / "2026-12-04_session27"
HOST_BOUND = 1.5


def ladders(folder: Path) -> list[dict[tuple[str, int], float]]:
    """Each launch's 1-GPU steps {(model, batch): seconds}, read by bench/coldstart.py's `load` (one launch a file)."""
    out: dict[str, dict] = {}
    for r in load(folder)[2]:
        out.setdefault(r["launch"], {})[(r["profile"], int(r["per_gpu_batch"]))] = float(r["iter_s"])
    return [out[k] for k in sorted(out)]


def spreads(launches: list[dict]) -> list[dict]:
    """Per (model, batch) measured in every launch: its steps, spread (max / min - 1) and kind (host or GPU)."""
    keys = sorted(set.intersection(*(set(l) for l in launches)))
    smallest = {m: min(b for mm, b in keys if mm == m) for m, _ in keys}
    out = []
    for m, b in keys:
        steps = np.array([l[(m, b)] for l in launches])
        floor = np.median([l[(m, smallest[m])] for l in launches])
        out.append({"model": m, "batch": b, "steps_ms": (steps * 1e3).round(2).tolist(),
                    "spread": float(steps.max() / steps.min() - 1.0),
                    "kind": "host" if np.median(steps) < HOST_BOUND * floor else "GPU"})
    return out


def render(folders: list[Path]) -> str:
    lines = ["# One GPU's step, launch after launch (`python bench/ladder_repeat.py`)", "",
             "Same H200, code, models and batches, launches a minute apart (bench/coldstart_collect.py at world size "
             f"1). `kind`: host-bound where the step is under {HOST_BOUND}x the ladder's smallest batch's, else "
             "GPU-bound. Spread: max / min - 1 over the launches.", ""]
    summary = []
    for folder in folders:
        launches = ladders(folder)
        rows = spreads(launches)
        lines += [f"## {folder.relative_to(HERE.parent)} ({len(launches)} launches)", "",
                  "| model | batch | kind | step ms, launch by launch | spread |", "|---|---:|---|---|---:|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['kind']} | {' / '.join(f'{s:.2f}' for s in r['steps_ms'])} "
                  f"| {r['spread']:.1%} |" for r in rows]
        for kind in ("host", "GPU"):
            s = [r["spread"] for r in rows if r["kind"] == kind]
            if s:
                summary.append(f"{folder.name}, {kind}-bound: {len(s)} rows, spread median {np.median(s):.1%}, "
                               f"max {max(s):.1%}")
        lines.append("")
    return "\n".join(lines + ["Summary:", "", *[f"- {s}" for s in summary], ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    folders = [f.resolve() for f in a.folders] or sorted(p for p in RUNS.iterdir() if p.is_dir())
    text = render(folders)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
