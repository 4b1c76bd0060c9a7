"""Admin plots (matplotlib, PNG bytes): how well the fitted model matches the history.

- `scaling_png`: one panel per (profile, GPU type). x: GPUs, y: samples/s. Dots are step records
  (samples/s = GPUs x per-GPU batch / iter_s), one colour per layout family (one node; or several nodes
  with the same GPUs per node and links); the line of the same colour is the model's prediction for that
  family (1, 2, ... GPUs on one node; 1, 2, ... nodes); the grey
  dashed line is linear scaling from the family's smallest prediction. Only the per-GPU batch with the
  most records is drawn in each panel (named in its title).
- `links_png`: one panel. x: message size (bytes), y: bus bandwidth of an all-reduce as nccl-tests reports
  it, (bytes / seconds) x 2 (p - 1) / p, which puts every participant count p on one scale; markers are
  collective records (colour: link class, shape: participants); the line is the fitted link model at the
  most frequent participant count of that link (named in the legend). Small messages are latency-bound
  (the rising part), large ones reach the link's bandwidth (the plateau).

Reading them: dots on their line mean the model has learnt that family; dots above the line mean the model
is pessimistic there (it will under-size jobs), dots below mean optimistic (it will over-size them).

Everything renders off-screen (Agg canvas, no pyplot state), so it is safe in server threads.
"""
from __future__ import annotations

import io
from collections import Counter, defaultdict

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from predictor.records import layout_name
from predictor.errors import NotFoundError

MARKERS = ["o", "s", "^", "D", "v", "P"]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _message(text: str, size=(7.0, 3.0)) -> bytes:
    fig = Figure(figsize=size)
    ax = fig.add_subplot()
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=11, wrap=True)
    return _png(fig)


def _family(rec: dict) -> tuple:
    """Single-node layouts form one family per intra link; multi-node ones one per GPUs/node and links."""
    layout = rec["layout"]
    if len(layout) == 1:
        return 0, rec.get("intra_link"), None
    return max(layout), rec.get("intra_link"), rec.get("inter_link")


def _candidates(per_node: int, intra: str, inter: str | None, fam: list[dict]) -> list[dict]:
    if per_node == 0:   # one node: 1 .. the most GPUs seen on one node
        return [{"layout": [g], "intra_link": intra} for g in range(1, max(r["layout"][0] for r in fam) + 1)]
    nodes = max(2, 2 * max(len(r["layout"]) for r in fam))
    return [{"layout": [per_node] * n, "intra_link": intra, **({"inter_link": inter or intra} if n > 1 else {})}
            for n in range(1, nodes + 1)]


def scaling_series(store, predictor, profile: str | None = None, gpu: str | None = None) -> list[dict]:
    """The data of the scaling plot: per panel, observed points and predicted curves per layout family.

    Raises:
        NotFoundError: a profile/GPU filter that matches no step history.
    """
    from predictor.profiles import Profile  # noqa: PLC0415

    groups: dict = defaultdict(list)
    for rec in store.observations(kind="step"):
        if (profile is None or rec.get("profile") == profile) and (gpu is None or rec.get("gpu") == gpu):
            groups[(rec["profile"], rec["gpu"])].append(rec)
    if not groups and (profile or gpu):
        raise NotFoundError("step history", f"{profile or '*'} on {gpu or '*'}", "list what exists with "
                                                                                 "`elastic-predictor models`")
    panels = []
    for (name, gpu_type), recs in sorted(groups.items()):
        batch = Counter(r["per_gpu_batch"] for r in recs).most_common(1)[0][0]
        recs = [r for r in recs if r["per_gpu_batch"] == batch]
        families: dict = defaultdict(list)
        for r in recs:
            families[_family(r)].append(r)
        prof = None
        if predictor is not None:
            try:
                prof = Profile.from_dict(store.get_profile(name))
            except NotFoundError:
                prof = None
        series = []
        for (per_node, intra, inter), fam in sorted(families.items(), key=lambda kv: str(kv[0])):
            observed = [(sum(r["layout"]), sum(r["layout"]) * batch / r["iter_s"], layout_name(r["layout"]))
                        for r in fam]
            curve = []
            if prof is not None:
                preds = predictor.predict(prof, gpu_type, batch, _candidates(per_node, intra, inter, fam))
                curve = [(sum(p["layout"]), p["samples_per_s"]) for p in preds]
            label = f"1 node, {intra}" if per_node == 0 else f"{per_node} GPUs/node, {intra}+{inter}"
            series.append({"label": label, "observed": observed, "predicted": curve})
        panels.append({"profile": name, "gpu": gpu_type, "per_gpu_batch": batch, "series": series})
    return panels


def scaling_png(store, predictor, profile: str | None = None, gpu: str | None = None) -> bytes:
    """PNG of predicted vs observed scaling curves (see the module docstring)."""
    panels = scaling_series(store, predictor, profile, gpu)
    if not panels:
        return _message("no step history yet: observations of kind 'step' appear here")
    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig = Figure(figsize=(6.0 * cols, 4.2 * rows), layout="constrained")
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for j, s in enumerate(panel["series"]):
            color = COLORS[j % len(COLORS)]
            if s["predicted"]:
                xs, ys = zip(*sorted(s["predicted"]))
                ax.plot(xs, ys, "-", color=color, label=s["label"])
                ax.plot(xs, [ys[0] * x / xs[0] for x in xs], ":", color="#999999", linewidth=1)
            if s["observed"]:
                ax.plot([o[0] for o in s["observed"]], [o[1] for o in s["observed"]], "o", color=color,
                        markersize=6, markeredgecolor="black", label=None if s["predicted"] else s["label"])
        ax.set_title(f"{panel['profile']} on {panel['gpu']}, per-GPU batch {panel['per_gpu_batch']}", fontsize=10)
        ax.set_xlabel("GPUs   (dots: observed, lines: predicted, grey: linear scaling)", fontsize=8)
        ax.set_ylabel("samples/s")
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left")
    return _png(fig)


def _bus(nbytes: float, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of a ring all-reduce: (bytes / seconds) x 2 (p - 1) / p."""
    return nbytes / seconds * (2 * (world - 1) / world if world > 1 else 1.0)


def links_series(store, predictor) -> list[dict]:
    """The data of the link plot: per link, observed (bytes, B/s, world) and the fitted curve."""
    by_link: dict = defaultdict(list)
    for rec in store.observations(kind="collective"):
        if rec.get("op", "allreduce") == "allreduce" and rec.get("seconds", 0) > 0 and rec.get("bytes", 0) > 0:
            by_link[rec["link"]].append(rec)
    out = []
    for link, recs in sorted(by_link.items()):
        world = Counter(r["world"] for r in recs).most_common(1)[0][0]
        observed = [(r["bytes"], _bus(r["bytes"], r["seconds"], r["world"]), r["world"]) for r in recs]
        curve = []
        if hasattr(getattr(predictor, "links_", None), "time"):   # the engine's LinkModel
            lo, hi = min(r["bytes"] for r in recs), max(r["bytes"] for r in recs)
            sizes = np.logspace(np.log10(max(lo / 4, 1)), np.log10(hi * 4), 40)
            seconds = predictor.links_.time(link, "allreduce", world, sizes)
            curve = [(float(b), _bus(float(b), float(t), world)) for b, t in zip(sizes, seconds) if t > 0]
        out.append({"link": link, "world": world, "observed": observed, "predicted": curve})
    return out


def links_png(store, predictor) -> bytes:
    """PNG of per-link all-reduce bandwidth against message size (see the module docstring)."""
    series = links_series(store, predictor)
    if not series:
        return _message("no collective history yet: observations of kind 'collective' appear here")
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for j, s in enumerate(series):
        color = COLORS[j % len(COLORS)]
        if s["predicted"]:
            xs, ys = zip(*s["predicted"])
            ax.plot(xs, ys, "-", color=color, label=f"{s['link']} model ({s['world']} ranks)")
        for k, world in enumerate(sorted({o[2] for o in s["observed"]})):
            pts = [o for o in s["observed"] if o[2] == world]
            ax.plot([o[0] for o in pts], [o[1] for o in pts], MARKERS[k % len(MARKERS)], color=color, markersize=5,
                    markeredgecolor="black", label=f"{s['link']} observed, {world} ranks")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("all-reduce bus bandwidth (bytes/s)")
    ax.set_title("per-link all-reduce bandwidth against message size", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig)
