"""Loaders turning the measured public data vendored in predictor/data into step observations and profiles.

The data ships with the package (`predictor/data/<folder>/`, each folder with a SOURCE.md naming origin,
commit and license), so a clone or an installed package needs nothing outside it. `LOADERS` maps the
dataset names (`pollux-t4`, `morphling-a800`, `elasticflow-a100`) to their loaders; `check(name)` raises
`DatasetError` naming the first missing file before anything is loaded.

Each loader returns a `Dataset`: step records with the shapes of docs/design.md (`kind="step"`, plus
`sync_s` where the source measured it and `source`, the file and row) and the tensor profiles of its models
(built-in architectures, see profiles.BUILTIN). What each source is assumed to mean:

- Pollux T4 (`pollux-osdi21/traces/<model>/placements.csv`, `scalability.csv`): g4dn.12xlarge, 4 T4 per
  node on PCIe, nodes on 50 Gb/s Ethernet -> intra_link "pcie", inter_link "ethernet". `local_bsz` is the per-GPU
  batch, `step_time` the step, `sync_time` the exposed sync. scalability.csv gives only (nodes, replicas):
  the layout is assumed as even as possible (replicas spread round-robin over the nodes). `ncf` is the model
  of AdaptDL's benchmark (benchmark/models/ncf: NeuMF on MovieLens-1M, factor 32, 3 layers, 1.6 M parameters;
  profiles.BUILTIN `ncf-ml-1m`), not NeuMF on MovieLens-20M (5.9 M).
- Morphling A800 (`morphling-a800/traces/<model>/placements.csv`, `exec_plan == "ga"` rows of bert, roberta,
  vit): 8 A800 per node, "nvlink" inside, "ib" across (interconnect not stated in the source). An iteration is
  one global batch at every placement: the origin's scheduler takes a job's throughput as `local_bsz /
  iter_time` whatever its placement (simulator/job.py), with `local_bsz` bert 32, roberta 64, vit 64
  (sched/models/<model>.py, where `orig_tpt = local_bsz / <the ga,8 row's iter_time>` ties it to these rows;
  vit's per-phase profile, perf_model_profile/vit/config.csv, names the same 64). So per_gpu_batch =
  MORPHLING_GLOBAL_BATCH[model] / G (fractional where G does not divide it: DDP's ranks then differ by one
  sample). bert's forward phase shrinks with G as this split says; roberta's forward column stays at 20-23 ms
  from 1 to 8 GPUs (its per-phase profile has 120 ms at 4 GPUs, 60 ms at 8: the two files disagree). vit's
  layouts across nodes take 0.066-0.083 s an iteration where every node has an even GPU count (5 layouts),
  0.12-0.23 s at one GPU a node (`11`, `1111`, `11111111`) and 0.27-0.45 s where odd and other counts mix (17
  layouts: `13`, `35`, `111122`, ...); bert's and roberta's show no such split, so no link learnt from them
  foresees it.
- ElasticFlow A100 (`elasticflow-a100/throughputs_A100/*.csv`): 8 A100 per node, NVLink inside, HDR IB
  across; cells are iterations/s at a global batch, G <= 8 on one node, else packed 8 per node. The origin's
  trainer (elastic-training-executor/trainer.py) gives each of G ranks `batch_size // world_size` and writes
  `iterations / seconds since DDP was built` into row `per-GPU batch * G`, column G: per_gpu_batch = row / G,
  the step 1 / cell, with the first iterations' warm-up in it (how many iterations ran is not recorded).
Every row's owner (`uid`) is its model's trace (`_step`).
"""
from __future__ import annotations

import ast
import csv
import dataclasses
import gzip
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from predictor.profiles import Profile, profile_from_spec

DEFAULT_ROOT = Path(__file__).resolve().parent / "data"

POLLUX_MODELS = {"bert": "bert-base-uncased", "cifar10": "resnet18_cifar10", "deepspeech2": "deepspeech2",
                 "imagenet": "resnet50", "ncf": "ncf-ml-1m", "yolov3": "yolov3"}
MORPHLING_MODELS = {"bert": "bert-large-uncased", "roberta": "roberta-large", "vit": "vit-base-patch16-224"}
MORPHLING_GLOBAL_BATCH = {"bert": 32, "roberta": 64, "vit": 64}   # samples an iteration (module docstring)
ELASTICFLOW_MODELS = {"bert": "bert-base-uncased", "deepspeech2": "deepspeech2", "gpt2": "gpt2",
                      "inception3": "inception_v3", "resnet50": "resnet50", "resnet50_cifar10": "resnet50_cifar10",
                      "vgg16": "vgg16"}


class DatasetError(FileNotFoundError):
    """A data file a loader needs is missing; the message names it and where the data comes from."""


@dataclass
class Dataset:
    """Step observations of one cluster. `extra` holds rows evaluated separately (T4 scalability.csv)."""

    name: str
    gpu: str
    profiles: dict[str, Profile]
    steps: list[dict]
    extra: list[dict] = field(default_factory=list)


def _profiles(models: dict[str, str]) -> dict[str, Profile]:
    return {m: dataclasses.replace(profile_from_spec(spec), name=m) for m, spec in models.items()}


def _step(model, gpu, layout, intra, inter, b, iter_s, source, sync_s=None) -> dict:
    """One step record; its owner (`uid`) is the model's trace (`<dataset source>/<model>`): one session of one
    job, so that in a fit each model's trace weighs one vote, however many rows it has (stepmodel.owner_of)."""
    rec = {"kind": "step", "profile": model, "gpu": gpu, "layout": list(layout), "intra_link": intra,
           "per_gpu_batch": b, "iter_s": float(iter_s), "source": source, "uid": source.split("/", 1)[0] + "/" + model}
    if len(layout) > 1:
        rec["inter_link"] = inter
    if sync_s is not None:
        rec["sync_s"] = float(sync_s)
    return rec


def _read(path: Path) -> list[dict]:
    """The rows of one CSV file.

    Raises:
        DatasetError: the file does not exist (the message names it and its folder's SOURCE.md).
    """
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        raise DatasetError(_missing(Path(path))) from None


def _missing(path: Path) -> str:
    folder = next((parent for parent in path.parents if (parent / "SOURCE.md").exists()), None)
    where = (f"see {folder / 'SOURCE.md'} for its origin" if folder is not None else
             f"the data is vendored in {DEFAULT_ROOT} (predictor/data of the package)")
    return f"dataset file missing: {path} ({where}; reinstall the package or restore the file from git)"


def even_layout(nodes: int, gpus: int) -> list[int]:
    """GPUs spread round-robin over `nodes` nodes (largest first)."""
    return sorted((gpus // nodes + (1 if i < gpus % nodes else 0) for i in range(nodes)), reverse=True)


def load_pollux(root: Path = DEFAULT_ROOT) -> Dataset:
    """Pollux T4 placements (steps) and scalability (extra) rows, with sync times."""
    base = Path(root) / "pollux-osdi21" / "traces"
    steps, extra = [], []
    for model in POLLUX_MODELS:
        for i, r in enumerate(_read(base / model / "placements.csv")):
            layout = [int(c) for c in r["placement"]]
            steps.append(_step(model, "T4", layout, "pcie", "ethernet", int(r["local_bsz"]), r["step_time"],
                               f"pollux/{model}/placements.csv:{i + 2}", r["sync_time"]))
        for i, r in enumerate(_read(base / model / "scalability.csv")):
            layout = even_layout(int(r["num_nodes"]), int(r["num_replicas"]))
            extra.append(_step(model, "T4", layout, "pcie", "ethernet", int(r["local_bsz"]), r["step_time"],
                               f"pollux/{model}/scalability.csv:{i + 2}", r["sync_time"]))
    return Dataset("pollux-t4", "T4", _profiles(POLLUX_MODELS), steps, extra)


def load_morphling(root: Path = DEFAULT_ROOT) -> Dataset:
    """Morphling A800 `ga` rows: one global batch an iteration (MORPHLING_GLOBAL_BATCH), split over the GPUs."""
    base = Path(root) / "morphling-a800" / "traces"
    steps = []
    for model in MORPHLING_MODELS:
        for i, r in enumerate(_read(base / model / "placements.csv")):
            t = float(r["iter_time"] or 0)
            if r["exec_plan"] != "ga" or not t > 0:
                continue
            layout = [int(c) for c in r["placement"]]
            b = MORPHLING_GLOBAL_BATCH[model] / sum(layout)
            steps.append(_step(model, "A800", layout, "nvlink", "ib", b, t,
                               f"morphling/{model}/placements.csv:{i + 2}"))
    return Dataset("morphling-a800", "A800", _profiles(MORPHLING_MODELS), steps)


def load_elasticflow(root: Path = DEFAULT_ROOT) -> Dataset:
    """ElasticFlow A100 tables: iterations/s at a global batch on G GPUs packed 8 per node."""
    base = Path(root) / "elasticflow-a100" / "throughputs_A100"
    steps = []
    for model in ELASTICFLOW_MODELS:
        for i, r in enumerate(_read(base / f"{model}.csv")):
            gb = int(r["global_batch_size"])
            for col, v in r.items():
                if col == "global_batch_size" or not v:
                    continue
                G, ips = int(col), float(v)
                if not (math.isfinite(ips) and ips > 0) or gb < G:
                    continue
                layout = [G] if G <= 8 else [8] * (G // 8)
                steps.append(_step(model, "A100", layout, "nvlink", "ib", gb / G, 1.0 / ips,
                                   f"elasticflow/{model}.csv:{i + 2}:{col}"))
    return Dataset("elasticflow-a100", "A100", _profiles(ELASTICFLOW_MODELS), steps)


# Gavel job types: the model behind each name and its parameter count (approximate: the workloads' default
# configurations, see predictor/data/gavel-osdi20/SOURCE.md); A3C and CycleGAN name no batch size.
GAVEL_MODELS = {"ResNet-18": 11.2e6, "ResNet-50": 25.6e6, "Transformer": 5.0e7, "LM": 1.4e7,
                "Recommendation": 2.4e7, "A3C": 6.0e5, "CycleGAN": 2.8e7}
GAVEL_DEFAULT_BATCH = {"A3C": 4, "CycleGAN": 1}
GAVEL_TYPES = ("k80", "p100", "v100")


def load_gavel(root: Path = DEFAULT_ROOT) -> list[dict]:
    """Gavel's isolated throughputs, consolidated workers (one server), K80/P100/V100, 1-8 GPUs.

    One row per measured (job type, GPU count, GPU type): `job_type` (Gavel's name), `model`, `n_params`,
    `batch`, `gpus`, `gpu` (upper case), `steps_per_s` and `source`. Zero throughputs (ResNet-50 bs 128 on
    K80: not measured) are left out.

    Raises:
        DatasetError: the file is missing.
    """
    path = Path(root) / "gavel-osdi20" / "physical_cluster_throughputs.json.gz"
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DatasetError(_missing(path)) from None
    rows = []
    for gpu in GAVEL_TYPES:
        for key, v in data[gpu].items():
            job, gpus = ast.literal_eval(key)
            model = job.split(" (")[0]
            m = re.search(r"batch size (\d+)", job)
            tput = float(v["null"])
            if not tput > 0:
                continue
            rows.append({"job_type": job, "model": model, "n_params": GAVEL_MODELS[model],
                         "batch": int(m.group(1)) if m else GAVEL_DEFAULT_BATCH[model], "gpus": int(gpus),
                         "gpu": gpu.upper(), "steps_per_s": tput, "source": f"gavel/{gpu}/{key}"})
    return rows


LOADERS = {"pollux-t4": load_pollux, "morphling-a800": load_morphling, "elasticflow-a100": load_elasticflow}


def files(name: str, root: Path = DEFAULT_ROOT) -> list[Path]:
    """The data files the loader of dataset `name` reads.

    Raises:
        ValueError: no dataset of that name (the message lists the known ones).
    """
    root = Path(root)
    if name == "pollux-t4":
        return [root / "pollux-osdi21" / "traces" / m / f for m in POLLUX_MODELS
                for f in ("placements.csv", "scalability.csv")]
    if name == "morphling-a800":
        return [root / "morphling-a800" / "traces" / m / "placements.csv" for m in MORPHLING_MODELS]
    if name == "elasticflow-a100":
        return [root / "elasticflow-a100" / "throughputs_A100" / f"{m}.csv" for m in ELASTICFLOW_MODELS]
    if name == "gavel":
        return [root / "gavel-osdi20" / "physical_cluster_throughputs.json.gz"]
    raise ValueError(f"no dataset {name!r} (known: {', '.join(LOADERS)})")


def check(name: str, root: Path = DEFAULT_ROOT) -> None:
    """Raise before loading: ValueError for an unknown name, DatasetError naming the first missing file."""
    for path in files(name, root):
        if not path.is_file():
            raise DatasetError(_missing(path))


def load_all(root: Path = DEFAULT_ROOT) -> list[Dataset]:
    return [loader(root) for loader in LOADERS.values()]
