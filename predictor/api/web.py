"""GET /admin: a small read-only HTML page for admins, and the plots as PNG.

    /admin                          model state, models, links, the newest decisions (`?limit=`, default 50); its
                                    cost does not grow with the rows stored (#41.3: the counts come from the writes'
                                    summary, predictor.store.observation_summary) and a worker renders it at most
                                    once a `PAGE_TTL_S` per `limit`
    /admin/outliers                 step rows far from the model and jobs whose rows mostly are (predictor.outliers):
                                    the heavy part, for the admin token only (anyone while writes are open)
    /admin/decisions/<id>           one decision: what was asked and answered, and the partitions it compared
    /admin/plots/scaling.png        predicted vs observed scaling (`?profile=&gpu=` to narrow it)
    /admin/plots/links.png          per-link all-reduce bandwidth against message size
    /admin/plots/replay.png         the what-if replay's figure (`elastic-predictor replay --out` wrote it to the
                                    service's replay_dir, $ELASTIC_PREDICTOR_REPLAY_DIR; the page shows its table)

Same rows as the CLI tables (predictor/admin_tables.py) and the same figures as `elastic-predictor plot`.
Nothing here writes: the page has no forms, and every link goes to a GET. No request draws a plot: each
worker's predictor.plotcache.PlotRenderer draws them in a background thread, per model version, and the
routes answer its cached PNG (200), a "being drawn" placeholder (202, Retry-After) before the first drawing,
404 for a filter that names no history, 429 (Retry-After) while too many plots wait to be drawn.
"""
from __future__ import annotations

import datetime
import json
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

from flask import Blueprint, Response, current_app, jsonify, request, url_for
from markupsafe import Markup, escape

from predictor import admin_tables, outliers
from predictor.api import authenticator, int_arg, services
from predictor.config import ENV_REPLAY_DIR
from predictor.errors import NotFoundError, ValidationError
from predictor.plotcache import RETRY_AFTER_S, PlotKey
from slurm_plugin.contracts.records import LINK_RE, NAME_RE

bp = Blueprint("web", __name__, url_prefix="/admin")
PAGE_TTL_S = 1.0   # a worker renders /admin at most once a second per `limit` (a flood of readers reads one render)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; white-space: nowrap; }
td.reason, td.layouts { white-space: normal; }
th { background: #e8eef6; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.rewrite td.action { color: #1a7f37; font-weight: bold; } tr.keep td.action { color: #555; }
tr.chosen td { font-weight: bold; background: #eef7ee; }
.status { background: #f6f8fa; border: 1px solid #ddd; padding: 0.5em 0.8em; display: inline-block; }
.bad { color: #b42318; } img { max-width: 100%; border: 1px solid #ddd; margin: 0.4em 0; }
"""


def _predictor(svc):
    try:
        return svc.models.predictor()
    except Exception:  # noqa: BLE001 - ModelUnavailable: nothing fitted yet, the page says so
        return None


def _html_table(rows: list[dict], columns: list, row_class=None, links=None) -> Markup:
    """An HTML table with the CLI table's columns; `links` maps a column key to `row -> url`."""
    links = links or {}
    head = "".join(f"<th>{escape(h)}</th>" for _, h, _ in columns)
    body = []
    for row in rows:
        cls = f' class="{escape(row_class(row))}"' if row_class else ""
        cells = []
        for key, _, spec in columns:
            text = escape(admin_tables.cell(row.get(key), spec))
            if key in links and row.get(key) is not None:
                text = Markup(f'<a href="{escape(links[key](row))}">{text}</a>')
            cells.append(f'<td class="{"n" if spec else escape(key)}">{text}</td>')
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    if not rows:
        body.append(f'<tr><td colspan="{len(columns)}">none yet</td></tr>')
    return Markup(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def _parameters(predictor) -> Markup:
    """The step model's constants with their basis, and each basis's 80% interval (`elastic-predictor model show`
    prints the same)."""
    params = getattr(predictor, "params_", None)
    if params is None:
        return Markup("<h2>Model parameters</h2><p>none fitted yet</p>")
    doc = params.summary()
    head = (f"<h2>Model parameters: step model {escape(doc['version'])}</h2><p><small>"
            f"{doc['n_ladders']} 1-GPU ladders, {doc['n_curves']} swept (link, world) "
            "curves. Basis: <b>calibrated</b> (the calibration job's probes on this host class), <b>fitted</b> "
            "(the multi-GPU steps that ran here), <b>default</b> (none: the no-fit reference's 0).</small></p>")
    trusted = admin_tables.trust_rows(doc)
    return (Markup(head) + _html_table(admin_tables.constant_rows(doc), admin_tables.CONSTANT_COLUMNS)
            + Markup("<h3>Votes weighed down: users whose rows sit far from everyone else's</h3>")
            + (_html_table(trusted, admin_tables.TRUST_COLUMNS) if trusted else Markup("<p>none</p>"))
            + Markup("<h3>Intervals: a prediction's 80% interval, as factors of it, by basis</h3>")
            + _html_table(admin_tables.interval_rows(doc), admin_tables.INTERVAL_COLUMNS))


@bp.get("")
def index():
    limit = int_arg("limit", 50, 1, 1000)
    pages, lock = current_app.extensions.setdefault("elastic_predictor_admin_pages", ({}, threading.Lock()))
    with lock:    # one render at a time; the readers behind it get that render
        now = time.monotonic()
        cached = pages.get(limit)
        if cached is None or cached[0] <= now:
            cached = pages[limit] = (now + PAGE_TTL_S, _index_page(limit))
    return Response(cached[1], mimetype="text/html")


def _index_page(limit: int) -> str:
    svc = services()
    predictor = _predictor(svc)
    status = svc.models.status()
    counts = svc.store.observation_counts()
    fitted = status["fitted_at_s"]
    fitted_text = datetime.datetime.fromtimestamp(fitted, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") \
        if fitted else "not yet"
    error = f'<br><span class="bad">last fit failed: {escape(status["last_error"])}</span>' \
        if status["last_error"] else ""
    models = admin_tables.model_rows(svc.store, predictor)
    scaling_link = {"profile": lambda r: url_for("web.scaling_png") + "?" + urlencode(
        {k: v for k, v in (("profile", r["profile"]), ("gpu", r.get("gpu"))) if v})}
    decisions = admin_tables.decision_rows(svc.store, limit)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>elastic-predictor admin</title><style>{STYLE}</style></head>
<body>
<h1>elastic-predictor</h1>
<div class="status">model <b>{escape(status["model_version"] or "none")}</b>, fitted {escape(fitted_text)}
 &middot; store generation {svc.store.generation()} &middot; {counts.get("step", 0)} step and
 {counts.get("collective", 0)} collective records &middot; {len(models)} model rows{error}</div>
<h2>Decisions (newest {limit})</h2>
{_html_table(decisions, admin_tables.DECISION_COLUMNS, row_class=lambda r: r.get("action") or "",
             links={"decision_id": lambda r: url_for("web.decision", decision_id=r["decision_id"])})}
<h2>Models</h2>
{_html_table(models, admin_tables.MODEL_COLUMNS, links=scaling_link)}
<h2>Outliers</h2>
<p>Step rows far from the model, and the jobs whose rows mostly are: <a href="{url_for("web.outliers_page")}">/admin/outliers</a>
 (the admin token).</p>
<h2>Links</h2>
{_html_table(admin_tables.link_rows(svc.store, predictor), admin_tables.LINK_COLUMNS)}
<h2>Scaling: predicted vs observed</h2>
<img src="{url_for("web.scaling_png")}"
 alt="predicted vs observed throughput against GPUs, per model and layout family">
<h2>Links: bandwidth against message size</h2>
<img src="{url_for("web.links_png")}" alt="all-reduce bus bandwidth against message size per link">
{_parameters(predictor)}
{_replay_section(svc.config.replay_dir)}
<p><small>Read-only. JSON: <a href="{url_for("decisions.index")}">/v1/decisions</a> &middot;
 <a href="{url_for("links.index")}">/v1/links</a> &middot; <a href="{url_for("health.healthz")}">/healthz</a> &middot;
 <a href="{url_for("metrics.metrics")}">/metrics</a></small></p>
</body></html>
"""


@bp.get("/outliers")
def outliers_page():
    """The outlier report (predictor.outliers): the heavy part of /admin (a prediction per row checked), for the admin
    token only (#41.3: four anonymous readers of /admin filled the side pool)."""
    authenticator().check_admin(request.headers)
    svc = services()
    flagged = outliers.outlier_report(svc.store, _predictor(svc))
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>elastic-predictor outliers</title><style>{STYLE}</style></head>
<body>
<h1>Outliers</h1>
<h2>Outliers: jobs whose step rows are mostly far from the model</h2>
<p><small>A row is an outlier when its log residual against the model's prediction for its layout is more than
 {outliers.K:g} robust sigma (now {flagged.sigma:.3f}) from the median; {flagged.checked} rows checked.</small></p>
{_html_table(flagged.jobs, outliers.JOB_COLUMNS)}
<h2>Outlier rows (largest {outliers.SHOWN})</h2>
{_html_table(flagged.rows, outliers.OUTLIER_COLUMNS)}
<p><small>Read-only. <a href="{url_for("web.index")}">/admin</a></small></p>
</body></html>
"""
    return Response(page, mimetype="text/html")


DECISION_FIELDS = [("decision_id", "id", ""), ("when", "when (UTC)", ""), ("source", "source", ""),
                   ("action", "action", ""), ("model", "model", ""), ("partition", "partition", ""),
                   ("layout", "layout", ""), ("samples_per_s", "pred. samples/s", ".1f"),
                   ("model_version", "model version", ""), ("request", "directives", ""), ("reason", "reason", "")]


@bp.get("/decisions/<decision_id>")
def decision(decision_id: str):
    """One decision as a page: its fields, and for a decision that compared partitions, each partition's layout,
    samples/s, cost per sample and reason, the chosen one first (NotFoundError for an unknown id: 404)."""
    full = services().store.get_decision(decision_id)
    row = admin_tables.decision_row(full)
    fields = "".join(f'<tr><th>{escape(header)}</th><td class="{escape(key)}">'
                     f"{escape(admin_tables.cell(row.get(key), spec))}</td></tr>"
                     for key, header, spec in DECISION_FIELDS)
    alternatives = admin_tables.alternative_rows(full)
    compared = f"""<h2>Partitions compared</h2>
{_html_table(alternatives, admin_tables.ALTERNATIVE_COLUMNS, row_class=lambda r: "chosen" if r["chosen"] else "")}
""" if alternatives else "<p>This decision compared no partitions.</p>"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>decision {escape(row["decision_id"])}</title>
<style>{STYLE}</style></head>
<body>
<h1>Decision {escape(row["decision_id"])}</h1>
<table class="{escape(row.get("action") or "")}">{fields}</table>
{compared}
<p><small>Read-only. <a href="{url_for("web.index")}">/admin</a> &middot; JSON:
 <a href="{url_for("decisions.show", decision_id=row["decision_id"])}">{escape(url_for("decisions.show",
                                                                                     decision_id=row["decision_id"]))}</a></small></p>
</body></html>
"""
    return Response(page, mimetype="text/html")


REPLAY_COLUMNS = [("policy", "policy", ""), ("jobs", "jobs", "d"), ("avg_jct_s", "avg JCT s", ",.0f"),
                  ("p99_jct_s", "p99 JCT s", ",.0f"), ("avg_queue_s", "avg queue s", ",.0f"),
                  ("gpu_hours", "GPU-h", ",.0f"), ("utilisation", "utilisation", ".2f"),
                  ("vs_submitted", "avg JCT vs as-submitted", "+.1%"), ("late", "jobs >10% later", "")]


def _replay_summary(folder: str | None) -> dict | None:
    """The report `elastic-predictor replay --out` wrote to the configured folder, or None."""
    if not folder:
        return None
    try:
        return json.loads((Path(folder) / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _replay_section(folder: str | None) -> Markup:
    summary = _replay_summary(folder)
    if summary is None:
        where = escape(folder) if folder else ENV_REPLAY_DIR
        return Markup(f"<h2>What-if replay</h2><p><small>No replay report in {where}: run <code>elastic-predictor "
                      f"replay --sacct JOBS.txt --out DIR</code> with {ENV_REPLAY_DIR}=DIR set for the service "
                      "(docs/admin-guide.md, \"What-if replay\").</small></p>")
    gap = summary.get("oracle_gap")
    note = f" &middot; prediction-driven elastic vs oracle: {gap:+.1%} average JCT" if gap is not None else ""
    return Markup(f"<h2>What-if replay: {escape(summary.get('title') or '')}</h2>"
                  f"<p><small>Each policy on the same history (predictor/replay.py){note}.</small></p>"
                  f"{_html_table(summary.get('rows') or [], REPLAY_COLUMNS)}"
                  f'<img src="{url_for("web.replay_png")}" alt="job completion time CDF and GPUs busy per policy">')


@bp.get("/plots/replay.png")
def replay_png():
    folder = services().config.replay_dir
    path = Path(folder or ".") / "replay.png"
    if not folder or not path.is_file():
        raise NotFoundError("replay report", "replay.png", "run `elastic-predictor replay --out DIR` and set "
                                                          f"{ENV_REPLAY_DIR}=DIR for the service")
    return Response(path.read_bytes(), mimetype="image/png", headers={"Cache-Control": "no-cache"})


def _plot(key: PlotKey) -> Response:
    """The renderer's answer for one plot, as HTTP (see the module docstring); never draws."""
    answer = services().plots.answer(key)
    if answer.status == 404:
        raise answer.error
    if answer.status == 429:
        response = jsonify(error="too many plots are waiting to be drawn; retry shortly", field=None)
        response.status_code = 429
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response
    headers = {"Cache-Control": "no-cache" if answer.status == 200 else "no-store",
               "X-Plot-Model-Version": answer.model_version or "none"}
    if answer.status == 202:
        headers["Retry-After"] = str(RETRY_AFTER_S)
        headers["X-Plot-State"] = "drawing"
    else:
        headers["X-Plot-State"] = answer.state
    return Response(answer.png, status=answer.status, mimetype="image/png", headers=headers)


def _filter(name: str, pattern) -> str | None:
    """A `?profile=` / `?gpu=` value; one no stored name can have is a 404 at once (nothing matches it)."""
    value = request.args.get(name) or None
    if value is not None and not pattern.match(value):
        raise NotFoundError("step history", value[:64], f"no {name} is named like that; list what exists with "
                                                        "`elastic-predictor models`")
    return value


@bp.get("/plots/scaling.png")
def scaling_png():
    return _plot(PlotKey("scaling", _filter("profile", NAME_RE), _filter("gpu", LINK_RE)))


@bp.get("/plots/links.png")
def links_png():
    return _plot(PlotKey("links"))
