"""Where the GPU-decode JPEG row's time goes (#39): ResNet-50 (bf16, channels_last, fused SGD) on one GPU, fed by
a DataLoader over the template's own ``EncodedImageFolder`` (the workers read the files, ``to_device`` decodes the
batch with nvJPEG through torchvision) through the template's own ``DeviceStage`` (the next batch finished in a
thread and stream of its own).

Prints, one line each:
- ``decode kernels``: the GPU's own time in one batch's decode, by kernel (profiler), and the resize alone;
- ``interpreter lock``: a Python loop's pace alone and beside a thread decoding batch after batch;
- ``decode``: one batch's ``to_device``, host and elapsed device time (CUDA events), alone on an idle GPU;
- training rates, samples/s, in alternating rounds: ``on-gpu`` (batches already on the GPU: the GPU-bound rate)
  and ``loader w=W`` for every worker count W asked, each with its median over ``on-gpu``'s; with ``--compile``,
  the same arms for each ``torch.compile`` mode asked (``off``: eager; ``reduce-overhead``: CUDA graphs, the
  host's launches taken out of the step), each with the first compile's seconds.

    python bench/jpeg_probe.py --workers 8,15 --steps 200 --rounds 3 [--compile off,reduce-overhead]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_launcher.examples.data import EncodedImageFolder  # noqa: E402
from elastic_launcher.loading import DeviceStage  # noqa: E402
from vs_torchrun import write_jpegs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=Path, default=None, help="a JPEG ImageFolder (default: 3000 written here)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150, help="timed steps a run (after 10 untimed)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", default="8", help="loader worker counts, comma-separated")
    ap.add_argument("--compile", default="off", help="torch.compile modes, comma-separated (off: eager)")
    a = ap.parse_args()
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    root = a.images or write_jpegs(Path(tempfile.mkdtemp(prefix="jpeg_probe_")), n=3000, total=3000)
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
    decoded = torchvision.io.decode_jpeg(list(torch.split(held[0][0], held[0][1].tolist())), device=device)
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
    # does the decode hold the interpreter's lock? A Python loop's pace in this thread, alone and while a second
    # thread decodes batches back to back (the DeviceStage's place): it drops by the share of time the lock is held
    def spins(seconds: float) -> float:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n / seconds
    alone = spins(1.0)
    stop = threading.Event()

    def decode_loop():
        k = 0
        while not stop.is_set():
            gpu_only.to_device(held[k % 8], device)
            k += 1
        torch.cuda.synchronize()
    side = threading.Thread(target=decode_loop)
    side.start()
    time.sleep(0.2)
    beside = spins(1.0)
    stop.set()
    side.join()
    print(f"interpreter lock: a Python loop ran {alone / 1e6:.2f} M iterations/s alone, {beside / 1e6:.2f} M while a "
          f"thread decoded batch after batch ({beside / alone:.2f})", flush=True)
    print(f"decode: GPU host {statistics.median(host) * 1e3:.2f} ms, device {statistics.median(dev) * 1e3:.2f} ms a "
          f"batch of {a.batch} ({a.batch / statistics.median(dev):.0f} images/s of elapsed device time)", flush=True)

    crit = torch.nn.CrossEntropyLoss()

    def make_step(mode: str):
        torch.manual_seed(0)
        model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
        run = model if mode == "off" else torch.compile(model, mode=mode)

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    on_gpu = [gpu_only.to_device(b, device) for b in held[:4]]

    def on_gpu_run(step):
        def run(n):
            for k in range(n):
                step(*on_gpu[k % 4])
        return run

    def loader_run(workers: int, step):
        def run(n):
            ds = gpu_only
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
    arms = {}
    for mode in ["off"] + [m for m in a.compile.split(",") if m != "off"]:  # eager first: the baseline
        step = make_step(mode)
        tag = "" if mode == "off" else f" [{mode}]"
        c0 = time.perf_counter()
        on_gpu_run(step)(10)  # warm-up: the compile, cuDNN's autotuning, the allocator
        torch.cuda.synchronize()
        print(f"warm-up{tag or ' [eager]'}: {time.perf_counter() - c0:.1f} s (10 steps, the compile in them)",
              flush=True)
        arms[f"on-gpu{tag}"] = on_gpu_run(step)
        for w in (int(x) for x in a.workers.split(",")):
            arms[f"loader w={w}{tag}"] = loader_run(w, step)
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
        own = name[name.index(" ["):] if " [" in name else ""
        mine = statistics.median(rates[f"on-gpu{own}"])
        print(f"rate {name:<36} {' '.join(f'{x:7.1f}' for x in rs)} images/s; median / on-gpu (eager) "
              f"{statistics.median(rs) / base:.3f}, / on-gpu{own} {statistics.median(rs) / mine:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
