"""How to split a JPEG batch's decode between the loader's CPU workers and the GPU (#39): ResNet-50 (bf16,
channels_last, fused SGD) on one GPU, fed by a DataLoader over the template's own ``EncodedImageFolder`` (its
``collate`` decodes ``cpu_share`` of each batch with Pillow in the workers, its ``to_device`` the rest with nvJPEG)
through the template's own ``DeviceStage`` (the next batch finished in a thread and stream of its own).

Prints, one line each:
- ``decode``: one batch's GPU decode (share 0), host and device time (CUDA events), alone on an idle GPU, and one
  batch's CPU decode (share 1) on one core;
- training rates, samples/s, in alternating rounds: ``on-gpu`` (batches already on the GPU: the GPU-bound rate)
  and ``loader w=W s=S`` for every worker count W and share S asked, each with its median over ``on-gpu``'s;
- ``best``: the (W, S) with the highest median rate.

    python bench/jpeg_probe.py --workers 8,15 --shares 0,0.25,0.5,0.75,1 --steps 150 --rounds 2
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_launcher.examples.data import EncodedImageFolder  # noqa: E402
from elastic_launcher.loading import DeviceStage  # noqa: E402
from vs_torchrun import write_jpegs  # noqa: E402


def fractions(text: str) -> list[float]:
    out = [float(x) for x in text.split(",")]
    if any(not 0 <= x <= 1 for x in out):
        raise SystemExit(f"--shares {text!r}: want fractions from 0 to 1")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=Path, default=None, help="a JPEG ImageFolder (default: 3000 written here)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150, help="timed steps a run (after 10 untimed)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", default="8", help="loader worker counts, comma-separated")
    ap.add_argument("--shares", type=fractions, default=[0.0, 0.5, 1.0], help="CPU-decode shares, comma-separated")
    a = ap.parse_args()
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    root = a.images or write_jpegs(Path(tempfile.mkdtemp(prefix="jpeg_probe_")), n=3000, total=3000)
    folders = {s: EncodedImageFolder(root, 224, memory_format=torch.channels_last, cpu_share=s) for s in a.shares}
    gpu_only = EncodedImageFolder(root, 224, memory_format=torch.channels_last)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"{len(gpu_only)} JPEGs from {root}, batch {a.batch}", flush=True)

    held = [gpu_only.collate([gpu_only[(k * a.batch + j) % len(gpu_only)] for j in range(a.batch)]) for k in range(8)]
    held = [tuple(t.pin_memory() for t in b) for b in held]
    for _ in range(3):
        gpu_only.to_device(held[0], device)
    torch.cuda.synchronize()
    host, dev = [], []
    for k in range(8):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        gpu_only.to_device(held[k], device)
        e1.record()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        dev.append(e0.elapsed_time(e1) / 1e3)
    # what the GPU does in those milliseconds: its kernels' own time, by kernel (the host's Huffman work and the
    # decoder's waits are not in it), and the resize alone in float32 and bf16
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(8):
            gpu_only.to_device(held[k], device)
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.device_time_total / 8 / 1e3) for e in prof.key_averages() if e.device_time_total),
                     key=lambda kv: -kv[1])
    busy = sum(ms for _, ms in kernels)
    print(f"decode kernels: {busy:.2f} ms of GPU time a batch of {a.batch}; by kernel: "
          + "; ".join(f"{name[:60]} {ms:.2f} ms" for name, ms in kernels[:8]), flush=True)
    decoded = torchvision.io.decode_jpeg(list(torch.split(held[0][1], held[0][2].tolist())), device=device)
    stacked = torch.stack(decoded)
    for dtype in (torch.float32, torch.bfloat16):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            torch.nn.functional.interpolate(stacked.to(dtype), size=(224, 224), mode="bilinear", antialias=True,
                                            align_corners=False)
        e1.record()
        torch.cuda.synchronize()
        print(f"resize {tuple(stacked.shape)} in {dtype}: {e0.elapsed_time(e1) / 10:.2f} ms", flush=True)
    on_cpu = EncodedImageFolder(root, 224, cpu_share=1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader worker
    t0 = time.perf_counter()
    on_cpu.collate([on_cpu[j] for j in range(a.batch)])
    cpu_s = time.perf_counter() - t0
    torch.set_num_threads(threads)
    print(f"decode: GPU host {statistics.median(host) * 1e3:.2f} ms, device {statistics.median(dev) * 1e3:.2f} ms a "
          f"batch of {a.batch} ({a.batch / statistics.median(dev):.0f} images/s of device time); CPU {cpu_s * 1e3:.0f} "
          f"ms a batch on one core ({a.batch / cpu_s:.0f} images/s a worker)", flush=True)

    model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    crit = torch.nn.CrossEntropyLoss()

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    on_gpu = [gpu_only.to_device(b, device) for b in held[:4]]

    def run_on_gpu(n):
        for k in range(n):
            step(*on_gpu[k % 4])

    def loader_run(workers: int, share: float):
        def run(n):
            ds = folders[share]
            sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=(n + 10) * a.batch,
                                                     generator=torch.Generator().manual_seed(0))
            loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, sampler=sampler, collate_fn=ds.collate,
                                                 num_workers=workers, pin_memory=True, prefetch_factor=4)
            stage = DeviceStage(lambda b: ds.to_device(b, device), device)
            it = iter(loader)
            nxt = stage.submit(next(it))
            for k in range(n + 10):
                if k == 10:  # the workers started and warm: time from here
                    torch.cuda.synchronize()
                    t0[0] = time.perf_counter()
                batch = stage.take(nxt)
                if k + 1 < n + 10:
                    nxt = stage.submit(next(it))
                step(*batch)
            stage.close()
            del it, loader
        return run

    t0 = [0.0]
    arms = {"on-gpu": run_on_gpu}
    for w, s in itertools.product((int(x) for x in a.workers.split(",")), a.shares):
        arms[f"loader w={w} s={s:g}"] = loader_run(w, s)
    run_on_gpu(10)  # warm-up: cuDNN's autotuning, the allocator
    rates: dict[str, list] = {k: [] for k in arms}
    for r in range(a.rounds):
        for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            torch.cuda.synchronize()
            t0[0] = time.perf_counter()
            arms[name](a.steps)
            torch.cuda.synchronize()
            rates[name].append(a.steps * a.batch / (time.perf_counter() - t0[0]))
            print(f"round {r} {name}: {rates[name][-1]:.1f} images/s", flush=True)
    base = statistics.median(rates["on-gpu"])
    for name, rs in rates.items():
        print(f"rate {name:<20} {' '.join(f'{x:7.1f}' for x in rs)} images/s; median / on-gpu "
              f"{statistics.median(rs) / base:.3f}", flush=True)
    best = max((n for n in rates if n != "on-gpu"), key=lambda n: statistics.median(rates[n]))
    print(f"best: {best} at {statistics.median(rates[best]) / base:.3f} of on-gpu", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
