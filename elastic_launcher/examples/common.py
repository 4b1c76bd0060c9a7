"""What the example scripts share: their entry-point options, the device, and the elastic training loop.

`train()` is the loop of docs/launcher.md written once: it builds the ElasticTrainer from what
`elastic-launch` passed (ELASTIC_* variables, SLURM_LOCALID), iterates `et.loader`, commits once per batch,
reports progress to the controller (its throughput measurements and straggler detection read it) and
prints a line every `--log-every` steps on rank 0. Scripts supply the model, the dataset and a
`loss_of(model, batch)` function; the loss must be the mean over the local batch.

Entry point rule: `WorkerEnv.from_environ` is the only place these scripts read the environment.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
from torch.utils.data import default_collate

from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.errors import LeftGroup
from elastic_launcher.gpu_speeds import worker_speed
from elastic_launcher.links import gpu_type_of
from elastic_launcher.process_group import StoreAddr, connect_store
from elastic_launcher.telemetry import Telemetry
from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
from elastic_launcher.workers import ProgressReporter, worker_identity


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """What elastic-launch tells one worker: its id, the job's store, its node and GPU slot, and how many CPUs
    Slurm gave it (``SLURM_CPUS_PER_TASK``; else the CPUs this process may run on, shared by the node's
    ``ELASTIC_SLOTS`` workers when they span the whole machine)."""

    wid: str
    store: str
    node: str
    local_id: int
    cpus: int = 1
    speed: float = 1.0                       # ELASTIC_SPEED: this node's GPUs' relative speed (mixed types)
    per_gpu_batch: Optional[int] = None      # ELASTIC_PER_GPU_BATCH: the #ELASTIC per_gpu_batch, if the job set it
    max_global_batch: Optional[int] = None   # ELASTIC_MAX_GLOBAL_BATCH: likewise
    model: Optional[str] = None              # ELASTIC_MODEL: the #ELASTIC model=, if the job set it

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "WorkerEnv":
        """Raises: SystemExit with a hint when not started by elastic-launch."""
        try:
            wid, store = worker_identity(environ)
        except KeyError as exc:
            raise SystemExit(f"missing {exc.args[0]}: run this script under elastic-launch "
                             "(see sbatch_templates/ and docs/user-guide.md)") from None
        cpus = len(os.sched_getaffinity(0))
        if environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
            cpus = int(environ["SLURM_CPUS_PER_TASK"])
        elif cpus >= (os.cpu_count() or cpus):  # not bound per task: the node's workers share its CPUs
            cpus //= max(1, int(environ.get("ELASTIC_SLOTS", "1") or 1))
        def number(key: str, kind):
            text = environ.get(key)
            try:
                return kind(text) if text else None
            except ValueError:
                raise SystemExit(f"{key}={text!r}: expected a number (elastic-launch sets it)") from None

        try:
            speed = worker_speed(environ)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        return cls(wid, store, environ.get("ELASTIC_NODE", "?"), int(environ["SLURM_LOCALID"]), max(1, cpus),
                   speed=speed, per_gpu_batch=number("ELASTIC_PER_GPU_BATCH", int),
                   max_global_batch=number("ELASTIC_MAX_GLOBAL_BATCH", int), model=environ.get("ELASTIC_MODEL") or None)

    def profile(self, given: str) -> str:
        """The predictor profile this worker's rows are labelled with: the script's ``--profile``, which must be the
        job's ``#ELASTIC model=`` when it set one (#42: the launcher plans and labels the job's rows with the
        directive's).

        Raises:
            SystemExit: they differ (the job stops at start, naming both).
        """
        if self.model is not None and given != self.model:
            raise SystemExit(f"--profile {given} disagrees with the job's `#ELASTIC model={self.model}`: the "
                             "launcher plans and labels the job's history with the directive's; pass --profile "
                             f"{self.model} or fix the directive")
        return given

    def agreed(self, option: str, given: Optional[int], directive: Optional[int], default: Optional[int]):
        """The value a job runs with for ``option``: the script's own (``given``), else the directive's, else the
        script's ``default``; one owner (#26.2), so a value of the script's that differs from the directive's is
        refused, not run with rows labelled otherwise.

        Raises:
            SystemExit: ``given`` and ``directive`` both set and different.
        """
        if given is not None and directive is not None and given != directive:
            name = option.lstrip("-").replace("-", "_")
            raise SystemExit(f"{option} {given} disagrees with the job's `#ELASTIC {name}={directive}`: the "
                             f"launcher plans and labels the job's history with the directive's; drop {option} "
                             "or make them equal")
        return next((v for v in (given, directive, default) if v is not None), None)


def add_common_args(parser: argparse.ArgumentParser, *, steps: int, per_gpu_batch: int, lr: float) -> None:
    """Options every example takes (their defaults come from the script)."""
    parser.add_argument("--steps", type=int, default=steps, help="global steps to train (default %(default)s)")
    parser.add_argument("--per-gpu-batch", type=int, default=None,
                        help=f"samples per worker and step (default: the job's #ELASTIC per_gpu_batch under "
                             f"elastic-launch, else {per_gpu_batch}); a different value than the directive's is "
                             "refused")
    parser.add_argument("--max-global-batch", type=int, default=None,
                        help="cap on the global batch when growing (default: the job's #ELASTIC max_global_batch, "
                             "else none)")
    parser.set_defaults(script_per_gpu_batch=per_gpu_batch)
    parser.add_argument("--lr", type=float, default=lr, help="learning rate at the first size")
    parser.add_argument("--lr-scaling", choices=("linear", "sqrt", "none"), default="linear",
                        help="how the LR follows the global batch across resizes")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: the GPU of this slot when CUDA is available, else the CPU")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per worker (CPU runs)")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader worker processes per training process (default: on a GPU, the CPUs "
                             "Slurm gave the task but one, at most 8; on the CPU 0, loading in the training "
                             "process, whose threads have the CPUs)")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                        help="torch.autocast precision (fp16 with a gradient scaler); auto: bf16 on GPUs that "
                             "support it, else fp32")
    parser.add_argument("--log-every", type=int, default=20, help="rank 0 prints a line every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-profile", type=Path, default=None, metavar="DIR",
                        help="the first GPU slot of each node profiles steps %d-%d with torch.profiler and writes "
                             "DIR/profile_<worker>.txt (operators by GPU and by CPU time)" % PROFILE_STEPS)
    parser.add_argument("--observations", type=Path, default=None,
                        help="rank 0 appends its predictor observation records (JSON lines) here as the runtime "
                             "hands them over; import them with `elastic-predictor import`")


PROFILE_STEPS = (100, 110)  # --profile: the steps profiled (after the commit schedule's ramp and the loader's fill)


class StepProfiler:
    """``--torch-profile``: ``torch.profiler`` over the steps ``PROFILE_STEPS`` of one process, written as a text
    report (operators by self GPU time and by self CPU time, and the wall time of the profiled steps).

    Call :meth:`step` once per training step; :meth:`close` writes the report (once, when the steps were reached).
    """

    def __init__(self, out: Optional[Path], name: str) -> None:
        self.out = out / f"profile_{name}.txt" if out is not None else None
        self.steps = 0
        self._prof = None
        self._t0 = 0.0
        if self.out is not None:
            from torch.profiler import ProfilerActivity, profile, schedule
            first, last = PROFILE_STEPS
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=acts, schedule=schedule(wait=first - 1, warmup=1, active=last - first))
            self._prof.start()

    def step(self) -> None:
        if self._prof is None:
            return
        self.steps += 1
        if self.steps == PROFILE_STEPS[0]:
            self._t0 = time.perf_counter()
        self._prof.step()
        if self.steps == PROFILE_STEPS[1]:
            self.close()

    def close(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.stop()
        if self.steps < PROFILE_STEPS[1]:
            return
        first, last = PROFILE_STEPS
        avg = prof.key_averages()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.out, "w", encoding="utf-8") as f:
            f.write(f"steps {first}-{last}: {(time.perf_counter() - self._t0) / (last - first) * 1e3:.2f} ms a step "
                    "(wall, profiler on)\n\n")
            if torch.cuda.is_available():
                f.write(avg.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n")
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")


def pick_device(choice: str, local_id: int) -> torch.device:
    """The device of GPU slot `local_id` (`cuda:<slot mod visible GPUs>`), or the CPU.

    Raises:
        SystemExit: `--device cuda` without CUDA.
    """
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this node")
    index = local_id % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_type(device: torch.device) -> str:
    """Short GPU type for observations (`H100` from `NVIDIA H100 80GB HBM3`: links.gpu_type_of), `cpu` on the CPU."""
    if device.type != "cuda":
        return "cpu"
    return gpu_type_of(torch.cuda.get_device_name(device))


def _to(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    return batch


def default_workers(env: WorkerEnv, device: torch.device) -> int:
    """DataLoader workers when ``--workers`` is not given: on a GPU the task's CPUs but one (the training
    process's own), at most 8; on the CPU none (the training threads use the CPUs)."""
    return 0 if device.type != "cuda" else max(1, min(8, env.cpus - 1))


def pick_precision(choice: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype of ``--precision`` (None: fp32, no autocast).

    Raises:
        SystemExit: bf16 or fp16 asked for on a device that cannot run it.
    """
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if choice == "fp32":
        return None
    if device.type != "cuda" and choice == "fp16":
        raise SystemExit("--precision fp16 needs a GPU (use bf16 or fp32 on the CPU)")
    if device.type == "cuda" and choice == "bf16" and not torch.cuda.is_bf16_supported():
        raise SystemExit(f"--precision bf16: {torch.cuda.get_device_name(device)} does not support bfloat16")
    return torch.bfloat16 if choice == "bf16" else torch.float16


@dataclasses.dataclass(frozen=True)
class Precision:
    """One training step's arithmetic: autocast to ``dtype`` (None: fp32), and for fp16 a gradient scaler (its
    state travels with the trainer's, so every rank scales alike)."""

    device_type: str
    dtype: Optional[torch.dtype]
    scaler: Optional[torch.amp.GradScaler]

    @classmethod
    def of(cls, dtype: Optional[torch.dtype], device: torch.device) -> "Precision":
        scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
        return cls(device.type, dtype, scaler)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward_and_step(self, loss: torch.Tensor, optimizer) -> None:
        if self.scaler is None:
            loss.backward()
            optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(optimizer)
            self.scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def extra_state(self) -> dict:
        return {"scaler": self.scaler} if self.scaler is not None else {}


def _local_step(model, optimizer, dataset, loss_of: Callable, batch: int, device: torch.device,
                precision: Precision):
    """The warm-up step for ``ElasticTrainer(warm_up=)`` on a GPU (CUDA loads each kernel on its first use; the
    trainer runs it before joining and puts the state back); None on a CPU, where there is nothing to load."""
    if device.type != "cuda":
        return None
    sample = _to(default_collate([dataset[i] for i in range(min(len(dataset), batch))]), device)

    def step(m: torch.nn.Module) -> None:
        with precision.autocast():
            loss = loss_of(m, sample)
        precision.backward_and_step(loss, optimizer)
    return step


def train(args: argparse.Namespace, model: torch.nn.Module, make_optimizer: Callable, dataset,
          loss_of: Callable, *, profile: str, environ: Mapping[str, str]) -> int:
    """Run the elastic loop until `args.steps` global steps; returns the process exit status.

    Args:
        args: the parsed common options (`add_common_args`).
        model: the bare model (moved to this worker's device here).
        make_optimizer: `params -> optimizer`, called after the move.
        dataset: map-style dataset of `(input, target)` items.
        loss_of: `(model, batch on device) -> scalar loss` (mean over the local batch).
        profile: the predictor profile name (`#ELASTIC model=`), for observations.
        environ: the process environment (read here once).
    """
    env = WorkerEnv.from_environ(environ)
    profile = env.profile(profile)
    batch = env.agreed("--per-gpu-batch", args.per_gpu_batch, env.per_gpu_batch, args.script_per_gpu_batch)
    cap = env.agreed("--max-global-batch", args.max_global_batch, env.max_global_batch, None)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.threads))
    device = pick_device(args.device, env.local_id)
    model = model.to(device)
    optimizer = make_optimizer(model.parameters())
    precision = Precision.of(pick_precision(args.precision, device), device)
    workers = args.workers if args.workers is not None else default_workers(env, device)
    loading = {"num_workers": workers, "pin_memory": device.type == "cuda"}
    if workers:
        loading.update(persistent_workers=True, prefetch_factor=4)
    print(f"{env.wid}: {device}, precision {args.precision} ({precision.dtype or torch.float32}), "
          f"{workers} DataLoader worker(s) per process", flush=True)
    telemetry = Telemetry(profile=profile, gpu=gpu_type(device),
                          intra_link="nvlink" if device.type == "cuda" else "shm")
    policy = BatchPolicy(per_gpu_batch=batch, lr_scaling=args.lr_scaling,
                         **({"max_global_batch": cap} if cap else {}))
    config = TrainerConfig(backend="nccl" if device.type == "cuda" else "gloo", seed=args.seed)
    reporter = ProgressReporter(connect_store(StoreAddr.parse(env.store), timedelta(seconds=60)), env.wid, env.node)
    et = ElasticTrainer(model, optimizer, store_addr=env.store, worker_id=env.wid, policy=policy,
                        config=config, telemetry=telemetry, device=device,
                        progress=_Progress(reporter, args.observations, lambda: et.rank),
                        warm_up=_local_step(model, optimizer, dataset, loss_of, batch, device, precision),
                        extra_state=precision.extra_state(), speed=env.speed)
    et.prepare_loader(dataset, **loading).join()  # loader workers start and load a batch before announcing
    loss = torch.tensor(float("nan"))
    profiler = StepProfiler(args.torch_profile if env.local_id == 0 else None, env.wid)
    window = (time.perf_counter(), 0)
    rank = None  # the group is gone after close(): remember the last rank
    try:
        for batch in et.loader(dataset, max_steps=args.steps, **loading):
            # no host synchronisation in the step: the runtime reports progress at its commit points, and a
            # non-finite loss is voted on there (watch_loss keeps the check on the device)
            batch = _to(batch, device)
            with precision.autocast():
                loss = loss_of(et.model, batch)
            et.watch_loss(loss)
            precision.backward_and_step(loss, optimizer)
            went_on = et.commit()
            profiler.step()
            if not et.left:
                rank = et.rank
                samples = et.sampler.epoch * len(dataset) + et.sampler.pos
                if rank == 0 and (et.step % args.log_every == 0 or et.step == args.steps):
                    t, done = time.perf_counter(), samples
                    rate = (done - window[1]) / max(t - window[0], 1e-9)
                    window = (t, done)
                    print(f"step {et.step}/{args.steps}  workers {et.world_size}  global batch {sum(et.batches)}"
                          f"  loss {loss.item():.4f}  {rate:.1f} samples/s", flush=True)
            if not went_on:
                break
    except LeftGroup as exc:
        print(f"{env.wid}: {exc}", file=sys.stderr)
        return 3
    finally:
        profiler.close()
        et.close()
    if et.left:
        print(f"{env.wid}: left the job at step {et.step} (its node was released)", flush=True)
    elif rank == 0:
        print(f"done: {et.step} steps, final loss {loss.item():.4f}, {len(et.switches)} resize(s)", flush=True)
    return 0


@dataclasses.dataclass(frozen=True)
class _Progress:
    """The trainer's progress hook: the launcher's channel, and with `--observations FILE` a copy of the
    observation records rank 0 hands over (appended as JSON lines as they come, for `elastic-predictor import`)."""

    reporter: ProgressReporter
    observations: Optional[Path]
    rank: Callable[[], int]

    def report(self, epoch: int, step: int, samples: int, compute_s: float, steps: int = 1) -> None:
        self.reporter.report(epoch, step, samples, compute_s, steps=steps)

    def publish_host(self, facts_json: str) -> None:
        self.reporter.publish_host(facts_json)

    def publish(self, records: list) -> None:
        self.reporter.publish(records)
        if self.observations is not None and self.rank() == 0:
            with open(self.observations, "a", encoding="utf-8") as out:
                for record in records:
                    out.write(json.dumps(record) + "\n")
