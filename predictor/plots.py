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

What a figure draws is bounded, whatever the history holds (issue #14.4: 400 GPU names made a 400-panel
figure that took a worker past its timeout): at most MAX_PANELS panels and MAX_SERIES series per panel (those
with the most records), MAX_POINTS observed points per series (the newest) and MAX_CURVE_POINTS predicted
points per curve; what was left out is named in a note on the image (`omitted`).

Everything renders off-screen (Agg canvas, no pyplot state), so it is safe in server threads. The service
draws only in its background renderer (predictor.plotcache), never in a request.
"""
from __future__ import annotations

import dataclasses
import io
from collections import Counter, defaultdict

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from slurm_plugin.contracts.records import layout_name
from predictor.errors import NotFoundError
from predictor.profiles import Profile

MARKERS = ["o", "s", "^", "D", "v", "P"]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
MAX_PANELS = 12            # scaling panels (profile, GPU type) drawn: the ones with the most step records
MAX_SERIES = len(COLORS)   # layout families per panel, links in the link plot: the ones with the most records
MAX_WORLDS = len(MARKERS)  # participant counts (marker shapes) per link: the most frequent
MAX_POINTS = 400           # observed points per series (or per link and participant count): the newest
MAX_CURVE_POINTS = 64      # predicted points per curve
MAX_NOTE_NAMES = 8         # names a note lists before "and N more"


@dataclasses.dataclass(frozen=True)
class Bounded:
    """What a plot draws (`items`: panels or link series) and what it left out, in words (`omitted`)."""

    items: list[dict]
    omitted: list[str]


def _most(groups: dict, limit: int, what: str, omitted: list[str], hint: str = "") -> list:
    """The keys of `groups` with the most members (at most `limit`, ties by key); the rest named in `omitted`."""
    ranked = sorted(groups, key=lambda k: (-len(groups[k]), str(k)))
    kept, dropped = ranked[:limit], ranked[limit:]
    if dropped:
        names = ", ".join(_name(k) for k in dropped[:MAX_NOTE_NAMES])
        more = f" and {len(dropped) - MAX_NOTE_NAMES} more" if len(dropped) > MAX_NOTE_NAMES else ""
        omitted.append(f"{len(dropped)} {what} not drawn (fewest records): {names}{more}{hint}")
    return kept


def _name(key) -> str:
    if isinstance(key, tuple):
        return " on ".join(str(k) for k in key if k is not None) or "-"
    return str(key)


def _newest(records: list, limit: int, what: str, omitted: list[str]) -> list:
    if len(records) > limit:
        omitted.append(f"{what}: the newest {limit} of {len(records)} records drawn")
        return records[-limit:]
    return records


def _note(fig: Figure, omitted: list[str]) -> None:
    if omitted:
        lines = omitted[:MAX_NOTE_NAMES] + ([f"... and {len(omitted) - MAX_NOTE_NAMES} more notes"]
                                            if len(omitted) > MAX_NOTE_NAMES else [])
        fig.supxlabel("\n".join(line[:160] for line in lines), fontsize=7, color="#555555")


def _figure(**kwargs) -> Figure:
    """A matplotlib Figure. matplotlib (0.3-0.5 s of imports) loads with the first plot drawn, not with
    predictor.app: the service, its workers and the CLI start without it."""
    from matplotlib.figure import Figure  # noqa: PLC0415 - matplotlib: at the first plot

    return Figure(**kwargs)


def _png(fig: Figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - matplotlib: at the first plot

    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _message(text: str, size=(7.0, 3.0)) -> bytes:
    fig = _figure(figsize=size)
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
        top = max(r["layout"][0] for r in fam)
        return [{"layout": [g], "intra_link": intra} for g in _spread(top)]
    nodes = max(2, 2 * max(len(r["layout"]) for r in fam))
    return [{"layout": [per_node] * n, "intra_link": intra, **({"inter_link": inter or intra} if n > 1 else {})}
            for n in _spread(nodes)]


def _spread(top: int) -> list[int]:
    """1..top, or MAX_CURVE_POINTS of them evenly spread (1 and top included) when there are more."""
    if top <= MAX_CURVE_POINTS:
        return list(range(1, top + 1))
    return sorted({int(round(x)) for x in np.linspace(1, top, MAX_CURVE_POINTS)})


def scaling_series(store, predictor, profile: str | None = None, gpu: str | None = None) -> list[dict]:
    """The panels the scaling plot draws (`scaling_data(...).items`).

    Raises:
        NotFoundError: a profile/GPU filter that matches no step history.
    """
    return scaling_data(store, predictor, profile, gpu).items


def scaling_data(store, predictor, profile: str | None = None, gpu: str | None = None) -> Bounded:
    """The data of the scaling plot: per panel, observed points and predicted curves per layout family,
    bounded (MAX_PANELS, MAX_SERIES, MAX_POINTS, MAX_CURVE_POINTS), with what was left out.

    Raises:
        NotFoundError: a profile/GPU filter that matches no step history.
    """
    groups: dict = defaultdict(list)
    for rec in store.observations(kind="step"):
        if (profile is None or rec.get("profile") == profile) and (gpu is None or rec.get("gpu") == gpu):
            groups[(rec["profile"], rec["gpu"])].append(rec)
    if not groups and (profile or gpu):
        raise NotFoundError("step history", f"{profile or '*'} on {gpu or '*'}", "list what exists with "
                                                                                 "`elastic-predictor models`")
    omitted: list[str] = []
    drawn = _most(groups, MAX_PANELS, "model/GPU panels", omitted, "; narrow with ?profile=&gpu=")
    panels = []
    for name, gpu_type in sorted(drawn):
        recs = groups[(name, gpu_type)]
        batch = Counter(r["per_gpu_batch"] for r in recs).most_common(1)[0][0]
        recs = [r for r in recs if r["per_gpu_batch"] == batch]
        families: dict = defaultdict(list)
        for r in recs:
            families[_family(r)].append(r)
        kept = _most(families, MAX_SERIES, f"layout families of {name} on {gpu_type}", omitted)
        prof = None
        if predictor is not None:
            try:
                prof = Profile.from_dict(store.get_profile(name))
            except NotFoundError:
                prof = None
        series = []
        for (per_node, intra, inter) in sorted(kept, key=str):
            label = f"1 node, {intra}" if per_node == 0 else f"{per_node} GPU{'' if per_node == 1 else 's'}/node, {intra}+{inter}"
            fam = _newest(families[(per_node, intra, inter)], MAX_POINTS, f"{name} on {gpu_type}, {label}", omitted)
            observed = [(sum(r["layout"]), sum(r["layout"]) * batch / r["iter_s"], layout_name(r["layout"]))
                        for r in fam]
            curve = []
            if prof is not None:
                preds = predictor.predict(prof, gpu_type, batch, _candidates(per_node, intra, inter, fam))
                curve = [(sum(p["layout"]), p["samples_per_s"]) for p in preds]
            series.append({"label": label, "observed": observed, "predicted": curve})
        panels.append({"profile": name, "gpu": gpu_type, "per_gpu_batch": batch, "series": series})
    return Bounded(panels, omitted)


def scaling_png(store, predictor, profile: str | None = None, gpu: str | None = None) -> bytes:
    """PNG of predicted vs observed scaling curves (see the module docstring)."""
    data = scaling_data(store, predictor, profile, gpu)
    panels = data.items
    if not panels:
        return _message("no step history yet: observations of kind 'step' appear here")
    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig = _figure(figsize=(6.0 * cols, 4.2 * rows), layout="constrained")
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
    _note(fig, data.omitted)
    return _png(fig)


def _bus(nbytes: float, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of a ring all-reduce: (bytes / seconds) x 2 (p - 1) / p."""
    return nbytes / seconds * (2 * (world - 1) / world if world > 1 else 1.0)


def links_series(store, predictor) -> list[dict]:
    """The link series the link plot draws (`links_data(...).items`)."""
    return links_data(store, predictor).items


def links_data(store, predictor) -> Bounded:
    """The data of the link plot: per link, observed (bytes, B/s, world) and the fitted curve, bounded
    (MAX_SERIES links, MAX_WORLDS participant counts per link, MAX_POINTS points per count), with what was
    left out."""
    by_link: dict = defaultdict(list)
    for rec in store.observations(kind="collective"):
        if rec.get("op", "allreduce") == "allreduce" and rec.get("seconds", 0) > 0 and rec.get("bytes", 0) > 0:
            by_link[rec["link"]].append(rec)
    omitted: list[str] = []
    out = []
    for link in sorted(_most(by_link, MAX_SERIES, "links", omitted)):
        recs = by_link[link]
        counts = Counter(r["world"] for r in recs)
        world = counts.most_common(1)[0][0]
        by_world: dict = defaultdict(list)
        for r in recs:
            by_world[r["world"]].append(r)
        observed = []
        for w in sorted(_most(by_world, MAX_WORLDS, f"participant counts of {link}", omitted)):
            for r in _newest(by_world[w], MAX_POINTS, f"{link}, {w} ranks", omitted):
                observed.append((r["bytes"], _bus(r["bytes"], r["seconds"], r["world"]), r["world"]))
        curve = []
        params = getattr(predictor, "params_", None)
        if params is not None:   # the step model reads the link's sweep (predictor/stepmodel.py Collectives)
            lo, hi = min(r["bytes"] for r in recs), max(r["bytes"] for r in recs)
            sizes = np.logspace(np.log10(max(lo / 4, 1)), np.log10(hi * 4), 40)
            seconds = params.collectives.time(link, world, sizes)
            curve = [(float(b), _bus(float(b), float(t), world)) for b, t in zip(sizes, seconds) if t > 0]
        out.append({"link": link, "world": world, "observed": observed, "predicted": curve})
    return Bounded(out, omitted)


def links_png(store, predictor) -> bytes:
    """PNG of per-link all-reduce bandwidth against message size (see the module docstring)."""
    data = links_data(store, predictor)
    series = data.items
    if not series:
        return _message("no collective history yet: observations of kind 'collective' appear here")
    fig = _figure(figsize=(7.5, 4.8), layout="constrained")
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
    _note(fig, data.omitted)
    return _png(fig)


def rendering_png() -> bytes:
    """The placeholder the service answers (202) while a plot is drawn in the background."""
    return _message("this plot is being drawn in the background: reload in a moment", size=(6.0, 1.0))


def failed_png(error: str) -> bytes:
    """What the service shows for a plot whose drawing failed (the error, shortened)."""
    return _message(f"drawing this plot failed: {error[:300]}")


def replay_png(results: dict, title: str = "") -> bytes:
    """The what-if replay's figure (predictor/replay.py): left, the CDF of job completion time per policy (log x);
    right, GPUs busy over time per policy (hours from the history's start). `results`: policy -> Result."""
    fig = _figure(figsize=(11.0, 4.2))
    cdf, busy = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, (policy, res) in enumerate(results.items()):
        color = COLORS[i % len(COLORS)]
        jct = np.sort([j["jct"] for j in res.jobs().values()])
        cdf.plot(jct, np.arange(1, len(jct) + 1) / len(jct), color=color,
                 label=f"{policy} (avg {jct.mean():,.0f} s)")
        if res.busy:
            t, g = zip(*res.busy)
            busy.plot(np.array(t) / 3600, g, color=color, lw=0.8, label=policy)
    cdf.set_xscale("log")
    cdf.set_xlabel("job completion time (s)")
    cdf.set_ylabel("fraction of jobs")
    cdf.legend(fontsize=8, loc="lower right")
    cdf.grid(alpha=0.3)
    busy.set_xlabel("hours from the first submit")
    busy.set_ylabel(f"GPUs busy (of {next(iter(results.values())).total_gpus})")
    busy.legend(fontsize=8)
    busy.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _png(fig)
