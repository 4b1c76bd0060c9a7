"""Model tensor profiles: what a model's gradient synchronisation moves, and what a sample costs to compute.

A profile lists the parameter tensors (name, numel, dtype) in the order DDP buckets them (reverse
registration order) and the bucket sizes DDP forms at its cap (first bucket 1 MiB, then `bucket_cap_mb`;
one bucket never mixes dtypes). Sources: a live `torch.nn.Module` (`profile_from_module`), a spec string
(`profile_from_spec("torchvision:resnet50")`, `"transformers:bert-base-uncased"` or a built-in name (`BUILTIN`,
our own parameter shapes from the published configs), all built on the meta device so no weights are
downloaded), or the API (`Profile.from_dict`).

Callers may assume a `Profile` is immutable and validated: numels are positive integers below 1e12 and dtypes
are known, so `grad_bytes` is exact.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from predictor.errors import NotFoundError, ValidationError
from slurm_plugin.contracts.profiles import module_tensors

DTYPE_BYTES = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8, "double": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1, "int32": 4, "int64": 8, "bool": 1,
}
FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
_MAX_NUMEL = 10**12
_MAX_BUCKETS = 100_000


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor: `name`, element count `numel`, `dtype` (torch name without `torch.`)."""

    name: str
    numel: int
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Profile:
    """A model's gradient tensors and compute cost.

    Attributes:
        name: profile name (the `model` directive).
        tensors: parameter tensors in DDP bucketing order (reverse registration order).
        buckets_bytes: DDP bucket sizes in bytes, in reduction order.
        compute_s_per_sample: measured forward+backward seconds per sample on a reference GPU, if known.
        flops_per_sample: training FLOPs per sample (forward + backward), if known.
        reference_gpu: GPU type `compute_s_per_sample` was measured on.
        source: where the profile came from (module, spec, api).
    """

    name: str
    tensors: tuple[TensorSpec, ...]
    buckets_bytes: tuple[int, ...]
    compute_s_per_sample: float | None = None
    flops_per_sample: float | None = None
    reference_gpu: str | None = None
    source: str = "api"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def grad_bytes(self) -> int:
        """Bytes all-reduced per step (sum of the buckets)."""
        return int(sum(self.buckets_bytes))

    @property
    def n_params(self) -> int:
        return int(sum(t.numel for t in self.tensors))

    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "tensors": [{"name": t.name, "numel": t.numel, "dtype": t.dtype} for t in self.tensors],
            "buckets_bytes": list(self.buckets_bytes),
            "compute_s_per_sample": self.compute_s_per_sample,
            "flops_per_sample": self.flops_per_sample,
            "reference_gpu": self.reference_gpu,
            "source": self.source,
        }
        return d

    @classmethod
    def from_dict(cls, d: Any, bucket_cap_mb: float = 25.0) -> "Profile":
        """Validate a JSON profile (design.md shape) and build it.

        `buckets_bytes` is optional; when absent it is computed from the tensors at `bucket_cap_mb`.

        Raises:
            ValidationError: naming the JSON path of the bad field (`tensors[3].numel`).
        """
        if not isinstance(d, dict):
            raise ValidationError("$", "profile must be a JSON object")
        name = d.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise ValidationError("name", "must be a non-empty string of at most 200 characters")
        raw = d.get("tensors")
        if not isinstance(raw, list) or not raw:
            raise ValidationError("tensors", "must be a non-empty list of {name, numel, dtype}")
        if len(raw) > 1_000_000:
            raise ValidationError("tensors", "more than 1,000,000 tensors")
        tensors = []
        for i, t in enumerate(raw):
            path = f"tensors[{i}]"
            if not isinstance(t, dict):
                raise ValidationError(path, "must be an object {name, numel, dtype}")
            tname = t.get("name", f"t{i}")
            if not isinstance(tname, str):
                raise ValidationError(f"{path}.name", "must be a string")
            numel = _positive_int(t.get("numel"), f"{path}.numel", _MAX_NUMEL)
            dtype = t.get("dtype", "float32")
            if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in DTYPE_BYTES:
                raise ValidationError(f"{path}.dtype", f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
            tensors.append(TensorSpec(tname, numel, dtype.removeprefix("torch.")))
        if d.get("buckets_bytes") is not None:
            bb = d["buckets_bytes"]
            if not isinstance(bb, list) or not bb or len(bb) > _MAX_BUCKETS:
                raise ValidationError("buckets_bytes", "must be a non-empty list of positive integers")
            buckets = tuple(_positive_int(b, f"buckets_bytes[{i}]", 8 * _MAX_NUMEL) for i, b in enumerate(bb))
        else:
            buckets = bucket_sizes(tensors, bucket_cap_mb)
        cps = _optional_positive(d.get("compute_s_per_sample"), "compute_s_per_sample", 1e4)
        fps = _optional_positive(d.get("flops_per_sample"), "flops_per_sample", 1e18)
        ref = d.get("reference_gpu")
        if ref is not None and not isinstance(ref, str):
            raise ValidationError("reference_gpu", "must be a string")
        return cls(name.strip(), tuple(tensors), buckets, cps, fps, ref, str(d.get("source", "api")))


def _positive_int(v: Any, path: str, limit: float) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValidationError(path, f"must be a positive integer, got {v!r}")
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v) or v != int(v)):
        raise ValidationError(path, f"must be a positive integer, got {v!r}")
    if v <= 0:
        raise ValidationError(path, f"must be positive, got {v!r}")
    if v > limit:
        raise ValidationError(path, f"absurd value {v!r} (limit {limit:g})")
    return int(v)


def _optional_positive(v: Any, path: str, limit: float) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 or v > limit:
        raise ValidationError(path, f"must be a finite positive number below {limit:g}, got {v!r}")
    return float(v)


def bucket_sizes(tensors: Iterable[TensorSpec], bucket_cap_mb: float = 25.0) -> tuple[int, ...]:
    """DDP bucket sizes (bytes) for tensors given in gradient-ready order (reverse registration order).

    Mirrors the assignment DDP's reducer rebuilds after its first step: one open bucket per dtype, each with
    its own limit sequence (1 MiB for its first bucket, then `bucket_cap_mb` MiB); a bucket closes once it
    reaches its limit. Buckets are ordered by their first tensor.
    """
    limits = [FIRST_BUCKET_BYTES, int(bucket_cap_mb * 1024 * 1024)]
    open_: dict[str, list[int]] = {}  # dtype -> [first index, bytes, buckets closed so far]
    closed: list[tuple[int, int]] = []
    for i, t in enumerate(tensors):
        b = open_.setdefault(t.dtype, [i, 0, 0])
        if b[1] == 0:
            b[0] = i
        b[1] += t.nbytes
        if b[1] >= limits[min(b[2], 1)]:
            closed.append((b[0], b[1]))
            b[1], b[2] = 0, b[2] + 1
    closed.extend((b[0], b[1]) for b in open_.values() if b[1] > 0)
    return tuple(size for _, size in sorted(closed))


def _module_tensors(module) -> tuple[TensorSpec, ...]:
    """A module's trainable parameters as tensor specs, in reverse registration order (DDP's bucketing order:
    slurm_plugin.contracts.profiles, the rule a job's launcher registers its model's profile with)."""
    return tuple(TensorSpec(**t) for t in module_tensors(module.named_parameters()))


def _profile_of(tensors: tuple[TensorSpec, ...], name: str, bucket_cap_mb: float, **kwargs) -> Profile:
    if not tensors:
        raise ValidationError("module", f"{name!r} has no trainable parameters")
    return Profile(name, tensors, bucket_sizes(tensors, bucket_cap_mb), source="module", **kwargs)


def profile_from_module(module, name: str, bucket_cap_mb: float = 25.0, **kwargs) -> Profile:
    """Profile of a live (or meta-device) `torch.nn.Module`: trainable parameters, reverse registration order."""
    return _profile_of(_module_tensors(module), name, bucket_cap_mb, **kwargs)


def profile_from_spec(spec: str, bucket_cap_mb: float = 25.0, dtype: str | None = None,
                      name: str | None = None) -> Profile:
    """Profile from `torchvision:<name>`, `transformers:<hf name>`, a built-in name, or `package.module:callable`
    (any importable callable that returns a `torch.nn.Module` when called without arguments: your own model's
    constructor or builder), built on the meta device. ``name``: the profile's name (default: the part after
    the colon).

    Falls back to the built-in architectures below when torchvision/transformers can't be imported.

    Raises:
        NotFoundError: the spec names nothing we can build.
        ValidationError: a `module:callable` that does not import, is not callable or returns no module.
    """
    lib, _, arch = spec.partition(":") if ":" in spec else ("", "", spec)
    flops = BUILTIN.get(_canonical(arch))
    if lib and lib not in ("torchvision", "transformers"):
        return _profile_of_callable(lib, arch, name or arch, bucket_cap_mb, dtype)
    if name is not None and name != arch:
        return dataclasses.replace(profile_from_spec(spec, bucket_cap_mb, dtype), name=name)
    if lib not in ("torchvision", "transformers"):  # the built-in shapes: the same tensors every time
        return _profile_of(_builtin_tensors(arch, dtype), arch, bucket_cap_mb, flops_per_sample=flops)
    import torch  # noqa: PLC0415 - torch: the CLI and the service import profiles

    module = None
    with torch.device("meta"):
        if lib == "torchvision":
            try:
                import torchvision.models as tvm  # noqa: PLC0415 - optional: torchvision

                module = tvm.get_model(arch, weights=None)
            except Exception:  # torchvision absent or broken beside this torch: use our own shapes
                module = None
        elif lib == "transformers":
            try:
                import transformers  # noqa: PLC0415 - optional: transformers

                cfg = transformers.AutoConfig.from_pretrained(arch, local_files_only=True)
                module = transformers.AutoModel.from_config(cfg)
            except Exception:  # not installed or config not cached: built-in shapes
                module = None
    if module is None:
        return _profile_of(_builtin_tensors(arch, dtype), arch, bucket_cap_mb, flops_per_sample=flops)
    if dtype is not None:
        module = module.to(getattr(torch, dtype))
    return profile_from_module(module, arch, bucket_cap_mb, flops_per_sample=flops)


def _profile_of_callable(module_name: str, attr: str, name: str, bucket_cap_mb: float,
                         dtype: str | None) -> Profile:
    """The profile of ``module_name:attr()`` built on the meta device (no weights allocated)."""
    import torch  # noqa: PLC0415 - torch: the CLI and the service import profiles

    where = f"{module_name}:{attr}"
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValidationError("spec", f"{where}: cannot import it ({exc}); give an importable "
                                      "package.module:callable (PYTHONPATH as for your job)") from None
    if not callable(factory):
        raise ValidationError("spec", f"{where} is a {type(factory).__name__}, not a callable")
    try:
        with torch.device("meta"):
            module = factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: say what it raised
        raise ValidationError("spec", f"{where}() raised {type(exc).__name__}: {exc} (it is called without "
                                      "arguments; wrap it in a function that passes yours)") from None
    if not isinstance(module, torch.nn.Module):
        raise ValidationError("spec", f"{where}() returned a {type(module).__name__}, not a torch.nn.Module")
    if dtype is not None:
        module = module.to(getattr(torch, dtype))
    return profile_from_module(module, name, bucket_cap_mb)


@functools.lru_cache(maxsize=64)
def _builtin_tensors(arch: str, dtype: str | None) -> tuple[TensorSpec, ...]:
    """The tensors of a built-in architecture (`BUILTIN`), built once per process on the meta device: a few
    milliseconds to ~20 ms each (ResNet-50, BERT), which the datasets' loaders, the CLI and the service's job
    profiles used to pay on every call. Raises NotFoundError (not cached) for a name that is not built in."""
    import torch  # noqa: PLC0415 - torch: the CLI and the service import profiles

    with torch.device("meta"):
        module = _build_builtin(arch)  # raises NotFoundError
    if dtype is not None:
        module = module.to(getattr(torch, dtype))
    return _module_tensors(module)


__all__ = ["TensorSpec", "Profile", "bucket_sizes", "profile_from_module", "profile_from_spec",
           "DTYPE_BYTES", "NotFoundError"]


# --- Built-in architectures (parameter shapes: predictor.builtin_models, which imports torch) ---
# name -> training FLOPs per sample (3x forward), or None
BUILTIN = {
    "resnet50": 3 * 4.1e9,
    "resnet18": 3 * 1.8e9,
    "resnet18_cifar10": 3 * 0.56e9,
    "resnet50_cifar10": 3 * 1.3e9,
    "vgg16": 3 * 15.5e9,
    "bert-base-uncased": 6 * 110e6 * 384,
    "bert-large-uncased": 6 * 335e6 * 128,
    "roberta-base": 6 * 125e6 * 128,
    "roberta-large": 6 * 355e6 * 128,
    "vit-base-patch16-224": 3 * 17.6e9,
    "gpt2": 6 * 124e6 * 1024,
    "gpt2-xl": 6 * 1.56e9 * 1024,
    "inception_v3": 3 * 5.7e9,  # approximate shapes
    "yolov3": 3 * 65.9e9,  # approximate shapes
    "ncf": 3 * 2e6,  # NeuMF on MovieLens-20M, approximate
    # the Pollux/AdaptDL benchmark's NCF: 2 x the MLP's multiply-adds a sample forward, x 3 for training
    "ncf-ml-1m": 3 * 2 * 43_000,
    "deepspeech2": 3 * 20e9,  # approximate (5 bi-GRU, hidden 800)
}
_ALIASES = {"bert": "bert-base-uncased", "bert-base": "bert-base-uncased", "bert-large": "bert-large-uncased",
            "roberta": "roberta-large", "vit": "vit-base-patch16-224", "vit_b_16": "vit-base-patch16-224",
            "imagenet": "resnet50", "cifar10": "resnet18_cifar10", "inception3": "inception_v3",
            "gpt2-small": "gpt2", "openai-community/gpt2": "gpt2",
            "google/vit-base-patch16-224": "vit-base-patch16-224",
            "FacebookAI/roberta-large": "roberta-large", "google-bert/bert-base-uncased": "bert-base-uncased"}


def _canonical(arch: str) -> str:
    return _ALIASES.get(arch, arch)


def _build_builtin(arch: str):
    from predictor import builtin_models  # noqa: PLC0415 - torch: the CLI and the service import profiles

    if _canonical(arch) not in BUILTIN:
        raise NotFoundError("architecture", arch, f"known built-ins: {sorted(BUILTIN)}")
    return builtin_models.BUILDERS[_canonical(arch)]()
