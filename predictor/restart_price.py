"""What a restart resize costs and whether it pays (#43), for jobs that resize by restarting.

A job under `#ELASTIC mode=restart` runs its unchanged script under torchrun's elastic agent: a resize stops every
worker, and they start again at the new size from the script's last checkpoint. The launcher measures that cost per
job (its signal to the first step at the new size, `restart_cost_s`) and sends it, with the time the job has left
(`remaining_s`), in `current` of every /v1/plan request; the service keeps both with the decision. The planner
prices the plans of jobs whose directives say `mode=restart`. The resize pays when

    gained = (new_rate - current_rate) * max(0, remaining_s - restart_cost_s)    samples won at the new size
    lost   = current_rate * restart_cost_s                                        samples not trained meanwhile

gives gained > lost. A plan that does not pay is answered `keep`, and the reason says why; one that pays says so
too. A resize that lowers the throughput (objective efficiency or cost) is not priced in samples: it saves GPUs,
not samples, and stands as planned.
"""
from __future__ import annotations

import dataclasses

DEFAULT_RESTART_COST_S = 15.0   # before a job measured its own: the 10-18 s checkpoint-restarts measured here (#43)


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


def priced(out: dict, current: dict) -> dict:
    """A launcher's plan answer `out` for a restart job (`#ELASTIC mode=restart`; `current.restart_cost_s` is its
    measured cost, DEFAULT_RESTART_COST_S until it measured one): a resize that raises throughput but does not pay
    back becomes `keep`; one that pays says so in its reason. Other answers unchanged."""
    predicted = (out.get("predicted") or {}).get("samples_per_s")
    rate = current.get("samples_per_s")
    layout = current.get("layout") or []
    if out.get("action") != "rewrite" or predicted is None or rate is None or out.get("layout") == layout:
        return out
    if predicted <= rate:
        return out
    if current.get("remaining_s") is None:
        return {**out, "reason": out["reason"] + "; restart not priced: the job's remaining time is unknown"}
    price = price_restart(rate, predicted, current.get("restart_cost_s", DEFAULT_RESTART_COST_S),
                          current["remaining_s"])
    if price.pays:
        return {**out, "reason": out["reason"] + "; " + price.note}
    return {**out, "action": "keep", "nodes": None, "gpus_per_node": None, "tasks_per_node": None, "switches": None,
            "layout": None, "reason": f"elastic: stays on {len(layout)} node(s): {price.note} "
                      f"(planned: {out['reason'].removeprefix('elastic: ')})"}
