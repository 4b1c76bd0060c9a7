"""Where the GPU-decode JPEG row's time goes (#39): ResNet-50 (bf16, channels_last, fused SGD) on one GPU, its
JPEG batches decoded by the template's own ``EncodedImageFolder.to_device`` (nvJPEG through torchvision), with the
encoded bytes already in memory (no loader: the decode alone).

Prints, one line each:
- ``decode``: one batch's ``to_device``, host time and device time (CUDA events), alone on an idle GPU;
- ``blocks host``: ``to_device`` called behind 100 ms of queued GPU work; if it returns only after that work,
  the decode waits for the device (the host cannot run ahead of it, so no kernel of the next step is queued
  while the GPU trains);
- training rates, samples/s, in alternating rounds: ``on-gpu`` (batches already on the GPU: the GPU-bound rate),
  ``inline`` (the template's loop: ``to_device`` then the step), ``side-stream`` (the next batch decoded on a
  second stream, issued before this step's forward), ``thread`` (a thread decodes ahead on its own stream, two
  batches deep).

    python bench/jpeg_probe.py --steps 120 --rounds 2
"""
from __future__ import annotations

import argparse
import queue
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
from vs_torchrun import write_jpegs  # noqa: E402


def batches_of(ds: EncodedImageFolder, batch: int, n: int) -> list:
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    out = []
    for k in range(n):
        items = [ds[order[(k * batch + j) % len(ds)]] for j in range(batch)]
        out.append(tuple(t.pin_memory() for t in ds.collate(items)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=Path, default=None, help="a JPEG ImageFolder (default: 640 written here)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    root = a.images or write_jpegs(Path(tempfile.mkdtemp(prefix="jpeg_probe_")), n=640, total=640)
    ds = EncodedImageFolder(root, 224, memory_format=torch.channels_last)
    held = batches_of(ds, a.batch, 16)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"{len(ds)} JPEGs from {root}, batch {a.batch}", flush=True)

    # decode alone
    for _ in range(3):
        ds.to_device(held[0], device)
    torch.cuda.synchronize()
    host, dev = [], []
    for k in range(16):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        ds.to_device(held[k], device)
        e1.record()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        dev.append(e0.elapsed_time(e1) / 1e3)
    print(f"decode: host {statistics.median(host) * 1e3:.2f} ms, device {statistics.median(dev) * 1e3:.2f} ms a "
          f"batch of {a.batch} (medians of 16): {a.batch / statistics.median(dev):.0f} images/s of device time",
          flush=True)

    # does it wait for queued device work?
    torch.cuda.synchronize()
    torch.cuda._sleep(int(100e-3 * torch.cuda.clock_rate() * 1e3))  # ~100 ms of GPU time queued
    t0 = time.perf_counter()
    ds.to_device(held[1], device)
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"blocks host: to_device behind ~100 ms of queued GPU work returned after {waited * 1e3:.1f} ms "
          f"({'it waits for the device' if waited > 0.05 else 'it does not wait'})", flush=True)

    model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    crit = torch.nn.CrossEntropyLoss()

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    on_gpu = [ds.to_device(b, device) for b in held[:4]]

    def run_on_gpu(n):
        for k in range(n):
            step(*on_gpu[k % 4])

    def run_inline(n):
        for k in range(n):
            step(*ds.to_device(held[k % 16], device))

    side = torch.cuda.Stream(device)

    def staged(k):
        with torch.cuda.stream(side):
            x, y = ds.to_device(held[k % 16], device)
            ev = torch.cuda.Event()
            ev.record(side)
        return x, y, ev

    def take(x, y, ev):
        cur = torch.cuda.current_stream(device)
        cur.wait_event(ev)
        x.record_stream(cur)
        y.record_stream(cur)
        return x, y

    def run_side(n):
        nxt = staged(0)
        for k in range(n):
            x, y = take(*nxt)
            nxt = staged(k + 1)
            step(x, y)

    def run_thread(n):
        q: queue.Queue = queue.Queue(maxsize=2)

        def produce():
            s = torch.cuda.Stream(device)
            with torch.cuda.stream(s):
                for k in range(n):
                    x, y = ds.to_device(held[k % 16], device)
                    ev = torch.cuda.Event()
                    ev.record(s)
                    q.put((x, y, ev))
        t = threading.Thread(target=produce, daemon=True)
        t.start()
        for _ in range(n):
            step(*take(*q.get()))
        t.join()

    arms = {"on-gpu": run_on_gpu, "inline": run_inline, "side-stream": run_side, "thread": run_thread}
    for fn in arms.values():   # warm-up: cuDNN's autotuning, the allocator
        fn(10)
    rates: dict[str, list] = {k: [] for k in arms}
    for r in range(a.rounds):
        for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            arms[name](a.steps)
            torch.cuda.synchronize()
            rates[name].append(a.steps * a.batch / (time.perf_counter() - t0))
    base = statistics.median(rates["on-gpu"])
    for name, rs in rates.items():
        print(f"rate {name:<12} {' '.join(f'{x:7.1f}' for x in rs)} images/s; median / on-gpu "
              f"{statistics.median(rs) / base:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
