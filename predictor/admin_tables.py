"""What admins read: rows for models, links and decisions, and a table renderer that fits a terminal.

The row builders are shared by the CLI (`elastic-predictor models`, `links`: predictor/admin_cli.py;
`decisions` lives in cli.py) and the /admin page (predictor/api/web.py), so both show the same numbers. This
module is pure: it imports neither the CLI nor the web app (tests/unit/test_import_layers.py checks that no
circle of imports forms inside predictor):

- `model_rows(store, predictor)`: one row per (profile, GPU type) seen in step history, plus registered
  profiles never observed: parameters, gradient bytes, step records, layouts seen, fit error (log RMSE of
  the step model on its own history) and the basis a prediction would have (observed / profile / prior).
- `link_rows(store, predictor)`: one row per link class: collective records, fitted latency and
  bandwidth, fit error, and how many step records used the link.
- `decision_rows(store, limit)`: the newest /v1/plan decisions with the chosen partition, layout and prediction.
- `alternative_rows(decision)`: for a decision that compared partitions, one row per partition (layout,
  samples/s, cost per sample, reason), the chosen one marked.

`render_table` right-aligns numbers, left-aligns text and shortens the widest text column with an
ellipsis so a line never exceeds the width (the terminal's, by default).
"""
from __future__ import annotations

import datetime
import json
import math
import shutil
from collections import Counter, defaultdict

from slurm_plugin.contracts.records import layout_name

Column = tuple[str, str, str]  # (row key, header, format spec; "" for text)


def cell(value, spec: str) -> str:
    """One formatted table cell (`-` for missing or non-finite values)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec) if spec else str(value)


def render_table(rows: list[dict], columns: list[Column], width: int | None = None) -> str:
    """Plain-text table; numbers (columns with a format spec) right-aligned, text left-aligned.

    Args:
        rows: dicts holding the column keys (missing or None: `-`).
        columns: (key, header, format spec) per column.
        width: maximum line length; None: the terminal's width (at least 60).
    """
    width = width or max(60, shutil.get_terminal_size((120, 24)).columns)
    cells = [[h for _, h, _ in columns]] + [[cell(r.get(k), f) for k, _, f in columns] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    text_cols = [i for i, (_, _, f) in enumerate(columns) if not f]
    while sum(widths) + 2 * (len(columns) - 1) > width and text_cols:
        widest = max(text_cols, key=lambda i: widths[i])
        over = sum(widths) + 2 * (len(columns) - 1) - width
        new = max(len(columns[widest][1]), 8, widths[widest] - over)
        if new >= widths[widest]:
            break
        widths[widest] = new
        for row in cells:
            if len(row[widest]) > new:
                row[widest] = row[widest][: new - 1] + "…"
    lines = []
    for n, row in enumerate(cells):
        parts = [c.ljust(w) if not columns[i][2] else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --- rows -------------------------------------------------------------------------------------------------
MODEL_COLUMNS: list[Column] = [("profile", "profile", ""), ("gpu", "gpu", ""), ("params_m", "params (M)", ".1f"),
                               ("grad_mb", "grad MB", ".1f"), ("steps", "step records", "d"),
                               ("users", "users", "d"),
                               ("layouts", "layouts seen", ""), ("log_rmse", "fit log RMSE", ".3f"),
                               ("basis", "basis", "")]
LINK_COLUMNS: list[Column] = [("link", "link", ""), ("collectives", "collectives", "d"), ("users", "users", "d"),
                              ("alpha_us", "latency (us)", ".1f"), ("bandwidth_gbs", "bandwidth (GB/s)", ".2f"),
                              ("log_rmse", "fit log RMSE", ".3f"), ("n_steps", "step records", "d")]
CONSTANT_COLUMNS: list[Column] = [("kind", "kind", ""), ("key", "link / GPU type", ""),
                                  ("kappa", "all-reduce slowdown in backward", ".2f"), ("o_ms", "per step (ms)", ".2f"),
                                  ("c_step_ms", "DDP host per step (ms)", ".2f"),
                                  ("c_bucket_us", "per bucket (us)", ".1f"), ("c_tensor_us", "per tensor (us)", ".1f"),
                                  ("basis", "basis", "")]
TRUST_COLUMNS: list[Column] = [("owner", "user (uid) or job", ""), ("weight", "its vote's weight in the fit", ".3f")]
INTERVAL_COLUMNS: list[Column] = [("basis", "basis", ""), ("residuals", "held-out residuals", "d"),
                                  ("low", "80% interval low", ".3f"), ("high", "high", ".3f"), ("source", "from", "")]
DECISION_COLUMNS: list[Column] = [("decision_id", "id", ""), ("when", "when (UTC)", ""), ("source", "source", ""),
                                  ("action", "action", ""), ("model", "model", ""), ("partition", "partition", ""),
                                  ("layout", "layout", ""), ("samples_per_s", "pred. samples/s", ".1f"),
                                  ("reason", "reason", "")]
ALTERNATIVE_COLUMNS: list[Column] = [("chosen", "chosen", ""), ("partition", "partition", ""), ("gpu", "gpu", ""),
                                     ("layout", "layout", ""), ("samples_per_s", "pred. samples/s", ".1f"),
                                     ("cost_per_sample", "cost per sample", ".3g"), ("reason", "reason", "")]


def _profile_sizes(store) -> dict[str, dict]:
    """Each profile's size from its stored summary (#24.6: parsing every body took /admin to 800 ms)."""
    return {row["name"]: {"params_m": row["params"] / 1e6, "grad_mb": row["grad_bytes"] / 1e6}
            for row in store.profile_summaries()}


def model_rows(store, predictor=None) -> list[dict]:
    """One row per (profile, GPU) with step history, then registered profiles never observed.

    Args:
        store: the history Store.
        predictor: a fitted engine Predictor (None: no fit error or basis columns).
    """
    sizes = _profile_sizes(store)
    counts: Counter = Counter()
    layouts: dict = defaultdict(set)
    for entry in store.observation_summary("step"):    # the writes' summary, not every row (#41.3)
        key = (entry["profile"], entry["gpu"])
        counts[key] += entry["rows"]
        layouts[key].add(tuple(entry["layout"] or ()))
    errors = getattr(predictor, "log_rmse_", {}) if predictor is not None else {}
    ladders = getattr(getattr(predictor, "params_", None), "ladders", {})
    rows = []
    for (profile, gpu), n in sorted(counts.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        seen = sorted(layouts[(profile, gpu)], key=lambda lay: (sum(lay), len(lay)))
        known = profile in sizes
        lad = ladders.get((profile, gpu))
        rows.append({"profile": profile, "gpu": gpu, **sizes.get(profile, {}), "steps": n,
                     "users": lad.users if lad is not None and lad.basis == "measured" else None,
                     "layouts": " ".join(layout_name(lay) for lay in seen), "log_rmse": errors.get((profile, gpu)),
                     "basis": ("observed" if (profile, gpu) in errors else "not fitted") if known
                     else "no profile registered"})
    observed = {p for p, _ in counts}
    for name, size in sorted(sizes.items()):
        if name not in observed:
            rows.append({"profile": name, "gpu": None, **size, "steps": 0, "layouts": "",
                         "basis": "profile only (estimate)"})
    return rows


def link_rows(store, predictor=None) -> list[dict]:
    """One row per link class: collective records and the fitted alpha-beta parameters."""
    counts: Counter = Counter()
    for entry in store.observation_summary("collective"):
        counts[entry["link"]] += entry["rows"]
    stats = {}
    if predictor is not None:
        stats = {s["link"]: s for s in predictor.link_stats()}
    else:
        stats = {s["link"]: s for s in store.link_fits()}
    rows = []
    for link in sorted(set(counts) | set(stats), key=str):
        s = stats.get(link, {})
        alpha, bw = s.get("alpha_s"), s.get("bandwidth_Bps")
        rows.append({"link": link, "collectives": counts.get(link, 0), "users": s.get("users"),
                     "alpha_us": None if alpha is None else alpha * 1e6,
                     "bandwidth_gbs": None if bw is None else bw / 1e9, "log_rmse": s.get("log_rmse"),
                     "n_steps": s.get("n_steps", 0)})
    return rows


def constant_rows(doc: dict) -> list[dict]:
    """The step model's fitted constants, from its JSON document (`Params.to_dict`, the `model` of a stored model):
    per link its all-reduce slowdown inside the backward and per-step cost, per host class (GPU type) DDP's host
    seconds per step, bucket and tensor; each with its basis (calibrated, fitted, default)."""
    rows = [{"kind": "link", "key": k, "kappa": v["kappa"], "o_ms": v["o"] * 1e3, "basis": v["basis"]}
            for k, v in sorted(doc.get("links", {}).items())]
    rows += [{"kind": "host", "key": g, "c_step_ms": v["c_step"] * 1e3, "c_bucket_us": v["c_bucket"] * 1e6,
              "c_tensor_us": v["c_tensor"] * 1e6, "basis": v["basis"]} for g, v in sorted(doc.get("hosts", {}).items())]
    return rows


def trust_rows(doc: dict) -> list[dict]:
    """The owners whose vote the constants' fit weighed under `stepmodel.TRUST_KEPT` (their rows far from the
    others': `stepmodel.owner_trust`), least trusted first, from the model's JSON document."""
    return [{"owner": k, "weight": v} for k, v in sorted(doc.get("trust", {}).items(), key=lambda kv: (kv[1], kv[0]))]


def interval_rows(doc: dict) -> list[dict]:
    """Per basis, and per basis and what gates a multi-GPU step where the fit pooled its residuals so, the factors
    of an 80% interval around a prediction and how many held-out residuals back them (`Params.interval`: fewer than
    MIN_RESIDUALS and the basis's pool, then the prior spread, stands)."""
    from predictor.stepmodel import MIN_RESIDUALS, PRIOR_SPREAD, Params  # noqa: PLC0415 - numpy, scipy: off the CLI's start

    params = Params.from_dict(doc)
    rows = []
    for basis in PRIOR_SPREAD:
        gates = sorted(k.split(" ", 1)[1] for k in params.residuals if k.startswith(basis + " "))
        for gate in [None, *gates]:
            key = f"{basis} {gate}" if gate else basis
            low, high = params.interval(basis, gate)
            n = len(params.residuals.get(key, []))
            rows.append({"basis": key, "residuals": n, "low": low, "high": high,
                         "source": "held-out residuals" if n >= MIN_RESIDUALS else
                         "the basis's residuals" if gate and len(params.residuals.get(basis, [])) >= MIN_RESIDUALS
                         else "prior spread"})
    return rows


def decision_rows(store, limit: int = 50) -> list[dict]:
    """The newest decisions with their partition, layout and predicted throughput (from the stored response)."""
    return [decision_row(store.get_decision(d["decision_id"])) for d in store.list_decisions(limit=limit)]


def decision_row(full: dict) -> dict:
    """One decision (`Store.get_decision`'s answer) as a row: `when`, the chosen `partition` (None where the
    answer named none), `layout`, `samples_per_s` and the request's directives as JSON."""
    response = full.get("response") or {}
    predicted = response.get("predicted") or {}
    when = datetime.datetime.fromtimestamp(full["created_at_s"], datetime.timezone.utc)
    row = {k: v for k, v in full.items() if k not in ("request", "response")}
    return {**row, "when": when.strftime("%Y-%m-%d %H:%M:%S"), "partition": response.get("partition"),
            "layout": layout_name(response.get("layout")), "samples_per_s": predicted.get("samples_per_s"),
            "request": json.dumps((full.get("request") or {}).get("directives", []))}


def alternative_rows(full: dict) -> list[dict]:
    """The partitions a decision compared (its response's `alternatives`), the chosen one first and marked
    `chosen`; [] for a decision that compared none. Stored text is shown as stored (the page escapes it)."""
    response = full.get("response") or {}
    alternatives = response.get("alternatives")
    if not isinstance(alternatives, list):
        return []
    rows = []
    for alt in alternatives:
        if not isinstance(alt, dict):
            continue
        # the partition and the GPU type: a mixed-type candidate may be placed in a partition a single plan also uses
        chosen = alt.get("partition") is not None and alt.get("partition") == response.get("partition") \
            and alt.get("gpu") in (response.get("gpu"), None)
        rows.append({"chosen": "yes" if chosen else "", "partition": alt.get("partition"), "gpu": alt.get("gpu"),
                     "layout": layout_name(alt["layout"] if isinstance(alt.get("layout"), list) else None),
                     "samples_per_s": _number(alt.get("samples_per_s")),
                     "cost_per_sample": _number(alt.get("cost_per_sample")), "reason": alt.get("reason")})
    return sorted(rows, key=lambda r: not r["chosen"])   # stable: the compared order after the chosen one


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
