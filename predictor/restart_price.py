"""What a restart resize costs and whether it pays (#43), for jobs that resize by restarting.

A job under `#ELASTIC mode=restart` runs its unchanged script under torchrun's elastic agent: a resize stops every
worker, and they start again at the new size from the script's last checkpoint. The launcher measures that cost per
resize (its signal to the first step at the new size), posts it to the service as a `restart` observation
(slurm_plugin/contracts/records.py) and sends its last one (`restart_cost_s`), with the time the job has left
(`remaining_s`), in `current` of every /v1/plan request; the service keeps both with the decision. The planner
prices the plans of jobs whose directives say `mode=restart`, with the cost of (first found):

    the job's own last restart          `current.restart_cost_s`
    what this cluster measured          the median over the newest MAX_JOBS jobs of each job's median cost, of
                                        restarts the same way (grow or shrink), of the job's model when any
                                        job of it measured one, else of every model (`measured_cost`)
    DEFAULT_RESTART_COST_S              none measured yet

The resize pays when

    gained = (new_rate - current_rate) * max(0, remaining_s - restart_cost_s)    samples won at the new size
    lost   = current_rate * restart_cost_s                                        samples not trained meanwhile

gives gained > lost. A plan that does not pay is answered `keep`, and the reason says why; one that pays says so
too. A resize that lowers the throughput (objective efficiency or cost) is not priced in samples: it saves GPUs,
not samples, and stands as planned.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Optional, Sequence

DEFAULT_RESTART_COST_S = 15.0   # before any job measured one: the 10-18 s checkpoint-restarts measured here (#43)
MAX_JOBS = 20                   # the newest jobs whose restarts price a job that measured none
HISTORY_ROWS = 400              # the newest restart records the service reads for one restart job's plan


@dataclasses.dataclass(frozen=True)
class RestartPrice:
    """The pricing of one restart resize.

    Attributes:
        pays: gained > lost.
        gained: samples won at the new size over the time left after the restart.
        lost: samples not trained during the restart.
        note: one line for the plan's reason.
    """

    pays: bool
    gained: float
    lost: float
    note: str


def price_restart(current_rate: float, new_rate: float, cost_s: float, remaining_s: float) -> RestartPrice:
    """Whether a restart from `current_rate` to `new_rate` samples/s pays back before the job's time runs out.

    Raises:
        ValueError: a negative rate, cost or remaining time (named).
    """
    for name, value in (("current_rate", current_rate), ("new_rate", new_rate), ("cost_s", cost_s),
                        ("remaining_s", remaining_s)):
        if value < 0:
            raise ValueError(f"price_restart: {name} must be >= 0, got {value!r}")
    gained = (new_rate - current_rate) * max(0.0, remaining_s - cost_s)
    lost = current_rate * cost_s
    pays = gained > lost
    verb = "pays back" if pays else "would not pay back"
    note = (f"restart {verb}: +{gained:.0f} samples over the remaining {remaining_s:.0f} s against {lost:.0f} "
            f"lost in a {cost_s:.1f} s restart")
    return RestartPrice(pays, gained, lost, note)


def measured_cost(rows: Sequence[dict], profile: Optional[str], grow: bool) -> Optional[tuple[float, str]]:
    """The restart cost this cluster measured (module docstring) from its `restart` records `rows` (oldest first),
    and a note of what it is; None when no row is of a restart `grow`'s way. One job counts once however many
    restarts it posted (the median of its own), so no job outweighs the others."""
    same_way = [r for r in rows if (r["to_nodes"] > r["from_nodes"]) == grow]
    mine = [r for r in same_way if profile is not None and r.get("profile") == profile]
    by_job: dict = {}
    for index, row in enumerate(mine or same_way):
        by_job.setdefault(row.get("job_id", f"row {index}"), []).append(row["cost_s"])
    jobs = list(by_job.values())[-MAX_JOBS:]
    if not jobs:
        return None
    cost = statistics.median(statistics.median(costs) for costs in jobs)
    what = f"{'grows' if grow else 'shrinks'}{f' of {profile}' if mine else ''}"
    return cost, f"this cluster's median of {len(jobs)} job(s)' measured {what}"


def priced(out: dict, current: dict, profile: Optional[str] = None, history: Sequence[dict] = ()) -> dict:
    """A launcher's plan answer `out` for a restart job (`#ELASTIC mode=restart`) of model `profile`, priced with
    the cost the module docstring says (`history`: the cluster's `restart` records, oldest first): a resize that
    raises throughput but does not pay back becomes `keep`; one that pays says so in its reason, and either names
    the cost's source. Other answers unchanged."""
    predicted = (out.get("predicted") or {}).get("samples_per_s")
    rate = current.get("samples_per_s")
    layout = current.get("layout") or []
    if out.get("action") != "rewrite" or predicted is None or rate is None or out.get("layout") == layout:
        return out
    if predicted <= rate:
        return out
    if current.get("remaining_s") is None:
        return {**out, "reason": out["reason"] + "; restart not priced: the job's remaining time is unknown"}
    if "restart_cost_s" in current:
        cost, source = current["restart_cost_s"], "this job's last restart"
    else:
        cost, source = measured_cost(history, profile, sum(out["layout"] or ()) > sum(layout)) or \
            (DEFAULT_RESTART_COST_S, "the default: none measured yet")
    price = price_restart(rate, predicted, cost, current["remaining_s"])
    note = f"{price.note} ({source})"
    if price.pays:
        return {**out, "reason": out["reason"] + "; " + note}
    return {**out, "action": "keep", "nodes": None, "gpus_per_node": None, "tasks_per_node": None, "switches": None,
            "layout": None, "reason": f"elastic: stays on {len(layout)} node(s): {note} "
                      f"(planned: {out['reason'].removeprefix('elastic: ')})"}
