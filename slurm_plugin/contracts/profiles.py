"""The tensors of a model profile (`POST /v1/profiles`), one rule for the service and the runtime.

A profile lists the trainable parameter tensors in the order DDP buckets them (reverse registration order),
each as ``{"name", "numel", "dtype"}`` (dtype: torch's name without ``torch.``). The service builds profiles from
modules with it (predictor.profiles.profile_from_module); a job's workers send theirs with it, so the launcher can
register the model the script really built (issue #45.2). Duck-typed: no torch import here.
"""
from __future__ import annotations

from typing import Iterable


def module_tensors(named_parameters: Iterable) -> list[dict]:
    """``[{"name", "numel", "dtype"}]`` of ``module.named_parameters()``: the trainable ones, last registered first."""
    params = [(name, p) for name, p in named_parameters if p.requires_grad]
    return [{"name": name, "numel": int(p.numel()), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in reversed(params)]


def profile_body(name: str, named_parameters: Iterable) -> dict:
    """A `POST /v1/profiles` body for a model (``source`` "job": registered by a running job's launcher)."""
    return {"name": name, "tensors": module_tensors(named_parameters), "source": "job"}
