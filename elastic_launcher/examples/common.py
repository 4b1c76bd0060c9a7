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
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
import torch.profiler
from torch.utils.data import default_collate

from elastic_launcher.batch_policy import BatchPolicy
from elastic_launcher.checkpoint import Checkpoints, save_model
from elastic_launcher.errors import LeftGroup
from elastic_launcher.gpu_speeds import worker_speed
from elastic_launcher.links import gpu_type_of
from elastic_launcher.process_group import StoreAddr, connect_store
from elastic_launcher.telemetry import Telemetry
from elastic_launcher.trainer import ElasticTrainer, TrainerConfig
from elastic_launcher.workers import ProgressReporter, worker_identity
from slurm_plugin.contracts.profiles import profile_body


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
    parser.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                        help="write checkpoints here (torch.distributed.checkpoint): every --checkpoint-every "
                             "steps, when the job is signalled (SIGTERM: scancel, the time limit) and at the end")
    parser.add_argument("--checkpoint-every", type=int, default=500, metavar="STEPS",
                        help="steps between checkpoints (default %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir, at whatever size the job "
                             "has now (none there: start at step 0)")
    parser.add_argument("--save", type=Path, default=None, metavar="DIR",
                        help="write the trained model's weights here at the end (a DCP checkpoint; "
                             "elastic_launcher.checkpoint.load_model reads it)")
    parser.add_argument("--observations", type=Path, default=None,
                        help="rank 0 appends its predictor observation records (JSON lines) here as the runtime "
                             "hands them over; import them with `elastic-predictor import`")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def add_speed_args(parser: argparse.ArgumentParser, *, compile_default: str, compile_mode: str = "default") -> None:
    """The fast paths every example can turn off (#39); ``compile_default`` and ``compile_mode`` are the script's
    choice on a GPU, by measurement (bench/results/gpu_runs/2026-12-02_session19, 2026-12-05_session29). ``auto``
    means: on a GPU as chosen, off on the CPU (where a compile costs more than it saves in a test's few steps)."""
    group = parser.add_argument_group("speed")
    group.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                       help=f"torch.compile the model in place (default on a GPU: {compile_default}); the DDP wrapper "
                            "stays outside it, so a resize re-wraps without a recompile")
    group.add_argument("--compile-mode", choices=COMPILE_MODES, default=compile_mode,
                       help="torch.compile's mode (default %(default)s); reduce-overhead replays the step's kernels "
                            "as CUDA graphs, taking the host's launches out of a step that waits on them")
    group.add_argument("--fused-optimizer", choices=("auto", "on", "off"), default="auto",
                       help="the optimizer's fused implementation (auto: on a GPU)")
    group.add_argument("--cudnn-benchmark", choices=("on", "off"), default="on",
                       help="on a GPU, cuDNN times its convolution kernels once per shape and keeps the fastest")
    parser.set_defaults(compile_default=compile_default)


def on_gpu(args: argparse.Namespace) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def optimizer_options(args: argparse.Namespace) -> dict:
    """Keyword arguments for the script's torch.optim optimizer: ``fused=True`` where ``--fused-optimizer`` wants it."""
    choice = getattr(args, "fused_optimizer", "off")
    return {"fused": True} if choice == "on" or (choice == "auto" and on_gpu(args)) else {}


def compile_wanted(args: argparse.Namespace, device: torch.device) -> bool:
    choice = getattr(args, "compile", "off")
    if choice == "auto":
        return device.type == "cuda" and args.compile_default == "on"
    return choice == "on"


def compile_label(args: argparse.Namespace, device: torch.device) -> str:
    """``off``, ``on``, or ``on (MODE)`` for a mode other than the default: what the worker's first line says."""
    mode = getattr(args, "compile_mode", "default")
    return "off" if not compile_wanted(args, device) else "on" if mode == "default" else f"on ({mode})"


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
            first, last = PROFILE_STEPS
            activity = torch.profiler.ProfilerActivity
            acts = [activity.CPU] + ([activity.CUDA] if torch.cuda.is_available() else [])
            self._prof = torch.profiler.profile(
                activities=acts, schedule=torch.profiler.schedule(wait=first - 1, warmup=1, active=last - first))
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
                precision: Precision, collate: Callable, to_device: Callable):
    """The warm-up step for ``ElasticTrainer(warm_up=)`` on a GPU (CUDA loads each kernel on its first use; the
    trainer runs it before joining and puts the state back); None on a CPU, where there is nothing to load."""
    if device.type != "cuda":
        return None
    sample = to_device(collate([dataset[i] for i in range(min(len(dataset), batch))]), device)

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
        dataset: map-style dataset of `(input, target)` items; a dataset with ``collate(items)`` and
            ``to_device(batch, device)`` methods batches its items and finishes them on the device itself (GPU
            decode, data made on the GPU: data.py), else default_collate and a copy.
        loss_of: `(model, batch on device) -> scalar loss` (mean over the local batch).
        profile: the predictor profile name (`#ELASTIC model=`), for observations.
        environ: the process environment (read here once).
    """
    env = WorkerEnv.from_environ(environ)
    profile = env.profile(profile)
    saving = Checkpointing.of(args)
    batch = env.agreed("--per-gpu-batch", args.per_gpu_batch, env.per_gpu_batch, args.script_per_gpu_batch)
    cap = env.agreed("--max-global-batch", args.max_global_batch, env.max_global_batch, None)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.threads))
    device = pick_device(args.device, env.local_id)
    model = model.to(device, memory_format=torch.channels_last if getattr(args, "channels_last", "off") == "on"
                     else torch.preserve_format)
    if compile_wanted(args, device):
        # in place: state_dict keys unchanged, DDP wraps the module as before
        model.compile(mode=getattr(args, "compile_mode", "default"))
    if device.type == "cuda" and getattr(args, "cudnn_benchmark", "off") == "on":
        torch.backends.cudnn.benchmark = True
    optimizer = make_optimizer(model.parameters())
    precision = Precision.of(pick_precision(args.precision, device), device)
    collate = getattr(dataset, "collate", default_collate)
    to_device = getattr(dataset, "to_device", _to)
    workers = args.workers if args.workers is not None else default_workers(env, device)
    loading = {"num_workers": workers, "pin_memory": device.type == "cuda"}
    if workers:
        loading.update(persistent_workers=True, prefetch_factor=4)
    print(f"{env.wid}: {device}, precision {args.precision} ({precision.dtype or torch.float32}), "
          f"{workers} DataLoader worker(s) per process, compile {compile_label(args, device)}, "
          f"fused optimizer {'on' if optimizer_options(args) else 'off'}", flush=True)
    telemetry = Telemetry(profile=profile, gpu=gpu_type(device),
                          intra_link="nvlink" if device.type == "cuda" else "shm")
    policy = BatchPolicy(per_gpu_batch=batch, lr_scaling=args.lr_scaling,
                         **({"max_global_batch": cap} if cap else {}))
    config = TrainerConfig(backend="nccl" if device.type == "cuda" else "gloo", seed=args.seed)
    reporter = ProgressReporter(connect_store(StoreAddr.parse(env.store), timedelta(seconds=60)), env.wid, env.node)
    if env.local_id == 0:   # the model's shapes (registered when the predictor lacks the model) and the steps
        reporter.publish_profile(profile_body(profile, model.named_parameters()))
        reporter.publish_total(args.steps)
    et = ElasticTrainer(model, optimizer, store_addr=env.store, worker_id=env.wid, policy=policy,
                        config=config, telemetry=telemetry, device=device,
                        progress=_Progress(reporter, args.observations, lambda: et.rank),
                        warm_up=_local_step(model, optimizer, dataset, loss_of, batch, device, precision, collate,
                                            to_device),
                        extra_state=precision.extra_state(), speed=env.speed)
    def finish(b):   # on a GPU one batch ahead, on a stream of its own (ElasticTrainer.loader)
        return to_device(b, device)
    et.prepare_loader(dataset, collate_fn=collate, to_device=finish, **loading)
    resumed = saving.resume(et.state)  # every worker: the state broadcast at the start then agrees at any size
    if resumed is not None:
        print(f"{env.wid}: resumed from {resumed.path} (step {resumed.step})", flush=True)
    saving.catch_sigterm(et.request_stop)
    et.join()  # loader workers start and load a batch before announcing
    loss = torch.tensor(float("nan"))
    profiler = StepProfiler(args.torch_profile if env.local_id == 0 else None, env.wid)
    window = (time.perf_counter(), et.sampler.epoch * len(dataset) + et.sampler.pos)  # resumed: not from 0
    rank = None  # the group is gone after close(): remember the last rank
    try:
        for batch in et.loader(dataset, collate_fn=collate, max_steps=args.steps, to_device=finish, **loading):
            # no host synchronisation in the step: the runtime reports progress at its commit points, and a
            # non-finite loss is voted on there (watch_loss keeps the check on the device)
            with precision.autocast():
                loss = loss_of(et.model, batch)
            et.watch_loss(loss)
            precision.backward_and_step(loss, optimizer)
            went_on = et.commit()
            profiler.step()
            if not et.left:
                rank = et.rank
                if saving.after_step(et.state, et.step, et.committed_step, rank, et.stopping):
                    break  # SIGTERM: every rank stops at the commit point the vote agreed on; rank 0 saved it
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
        saving.release_sigterm()   # training is over here: a SIGTERM now (a shrink's release) ends the process
        profiler.close()
        et.close()
        saving.drain()
    if et.left:
        print(f"{env.wid}: left the job at step {et.step} (its node was released)", flush=True)
        return 0
    if saving.signalled or et.stopping:   # a rank not signalled stops where its peers do
        print(f"{env.wid}: stopped by SIGTERM after step {et.step}", flush=True)
        return 128 + signal.SIGTERM
    if rank == 0:
        saving.finish(et.state, et.step)
        print(f"done: {et.step} steps, final loss {loss.item():.4f}, {len(et.switches)} resize(s)" +
              "".join(f", {what} {where}" for what, where in saving.written()), flush=True)
    return 0


class Checkpointing:
    """One worker's ``--checkpoint-dir``, ``--checkpoint-every``, ``--resume`` and ``--save`` (DCP,
    :mod:`elastic_launcher.checkpoint`), and SIGTERM (scancel, the time limit) as a request to stop.

    Only the rank 0 of the moment writes, and what it writes is the trainer's rollback point (the state every rank
    agreed on at the last commit point): every ``every`` steps at a commit point (a thread writes it while training
    goes on), after a SIGTERM (the next commit point's vote carries it, and every rank stops there: a rank that
    stopped after its own step would leave its peers waiting in the next step's collectives, where no Python signal
    handler runs) and at the end. A worker that gets SIGTERM and does not stop within ``grace_s`` exits (Slurm's
    KillWait is 30 s by default).
    """

    def __init__(self, checkpoints: Optional[Checkpoints], every: int, resume: bool, save_to: Optional[Path],
                 grace_s: float = 20.0) -> None:
        self.checkpoints, self.every, self.want_resume, self.save_to = checkpoints, every, resume, save_to
        self.grace_s = grace_s
        self.saved: Optional[Path] = None  # the last checkpoint written or resumed from
        self.saved_step = 0
        self.signalled = False

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Checkpointing":
        """Raises: SystemExit naming the option that cannot work."""
        if args.resume and args.checkpoint_dir is None:
            raise SystemExit("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
        if args.checkpoint_every < 1:
            raise SystemExit(f"--checkpoint-every {args.checkpoint_every}: expected a number of steps >= 1")
        return cls(Checkpoints(args.checkpoint_dir) if args.checkpoint_dir is not None else None,
                   args.checkpoint_every, args.resume, args.save)

    def resume(self, state):
        """``--resume``: the latest checkpoint loaded into ``state`` (None: nothing to resume from)."""
        if not self.want_resume:
            return None
        try:
            resumed = self.checkpoints.load(state)
        except (ValueError, FileNotFoundError) as exc:
            raise SystemExit(f"--resume: {exc}") from None
        if resumed is None:
            print(f"--resume: no checkpoint in {self.checkpoints.directory} yet: starting at step 0", flush=True)
            return None
        self.saved, self.saved_step = resumed.path, resumed.step
        return resumed

    def catch_sigterm(self, request_stop) -> None:
        """From here on SIGTERM asks every worker to stop at the next commit point (``request_stop``: the trainer's;
        with --checkpoint-dir only: without one there is nothing to save and SIGTERM ends the process as before)."""
        if self.checkpoints is None:
            return

        def stop(_signum, _frame):
            if not self.signalled:
                self.signalled = True
                request_stop()
                timer = threading.Timer(self.grace_s, os._exit, (128 + signal.SIGTERM,))
                timer.daemon = True
                timer.start()
        signal.signal(signal.SIGTERM, stop)

    def release_sigterm(self) -> None:
        """SIGTERM ends the process again (its default): after the loop, nothing waits for a step to end."""
        if self.checkpoints is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def after_step(self, state, step: int, committed: int, rank: int, stopping: bool) -> bool:
        """After a step (``committed``: the last commit point's; ``stopping``: its vote said stop, and this step is
        it): rank 0 starts a checkpoint of the rollback point when one is due at this commit point, or when
        stopping (then waited for). Returns True to stop."""
        due = stopping or (committed == step and step - self.saved_step >= self.every)
        if self.checkpoints is not None and rank == 0 and due and committed != self.saved_step:
            self.saved, self.saved_step = self.checkpoints.begin(state, state.last_snapshot), committed
        if stopping and self.checkpoints is not None:
            self.checkpoints.wait()
            if rank == 0 and self.saved is not None:   # said at once: the time limit's KillWait may end us soon
                print(f"SIGTERM after step {step}: checkpoint {self.saved} (step {self.saved_step}): submit the job "
                      "again with --resume to continue", flush=True)
        return stopping

    def finish(self, state, step: int) -> None:
        """Rank 0 at the end (a commit point): the last checkpoint (a job submitted again has nothing left to do)
        and ``--save``."""
        if self.checkpoints is not None:
            if step != self.saved_step:
                self.saved, self.saved_step = self.checkpoints.begin(state, state.last_snapshot), step
            self.checkpoints.wait()
        if self.save_to is not None:
            save_model(state.model, self.save_to)

    def drain(self) -> None:
        """Waits for a checkpoint still being written (a worker leaving the job, or failing, lets it finish)."""
        if self.checkpoints is None:
            return
        try:
            self.checkpoints.wait()
        except Exception as exc:  # noqa: BLE001 - the training's own outcome decides the exit status
            print(f"checkpoint {self.saved} not written: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            self.saved = None

    def written(self) -> list[tuple[str, Path]]:
        return ([("checkpoint", self.saved)] if self.saved is not None and self.checkpoints is not None else []) + \
            ([("model", self.save_to)] if self.save_to is not None else [])


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
