"""What a resize costs with ``torch.compile`` on (#39): a template re-formed 1 -> 1 a few times.

One worker runs ``python -m elastic_launcher.examples.<task>`` (``--task``: gpt_lm, resnet50) under the launcher's
fixed-size start without Slurm (as bench/vs_torchrun.py's B side); this process then asks for a resize to the same
member (a re-form: new communicator, DDP re-wrapped, state kept) ``--reforms`` times and reads each switch's record
(``pause_s``: from the decision to the end of the first step on the new group, device-synchronised;
``first_step_s``: that first step). With ``--compile on`` the model is compiled in place once, before the job
starts, and the DDP wrapper stays outside it, so a re-form must not recompile: the worker runs with
``TORCH_LOGS=recompiles`` and the recompiles it logs are counted. Both settings run in the same invocation,
alternating. ``--compile-mode reduce-overhead``: the compiled step replayed as CUDA graphs (a re-form must not
record them again either).

    python bench/compile_resize.py --device cpu --size tiny          # gloo, the CPU
    python bench/compile_resize.py --device cuda --size gpt2-small   # NCCL, one GPU
    python bench/compile_resize.py --device cuda --task resnet50 --batch 64 --compile-mode reduce-overhead
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(compile_: str, args) -> dict:
    import torch.distributed as dist
    from elastic_launcher.membership import Coordinator
    from elastic_launcher.workers import worker_env, worker_id
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=args.timeout))
    group = f"jcompile-localhost-g{int(time.time() * 1000)}"
    wid = worker_id(group, 0)
    coord = Coordinator(dist.PrefixStore("job", server), timeout=timedelta(seconds=args.timeout))
    plan = coord.start([wid])
    cmd = [sys.executable, "-m", f"elastic_launcher.examples.{args.task}", "--device", args.device,
           "--compile", compile_, "--compile-mode", args.compile_mode, "--steps", "1000000", "--log-every", "100000",
           "--per-gpu-batch", str(args.batch)] + (["--size", args.size] if args.task == "gpt_lm" else [])
    env = dict(os.environ, SLURM_LOCALID="0", TORCH_LOGS="recompiles",
               **worker_env(f"127.0.0.1:{server.port}/job", "bench", "localhost", group, 1))
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    records = []
    try:
        first = coord.wait_switched(plan)
        time.sleep(args.settle)
        for _ in range(args.reforms):
            plan = coord.request_resize([wid])
            records.append(coord.wait_switched(plan))
            time.sleep(args.settle)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    recompiles = len(re.findall(r"Recompiling function", out))
    return {"compile": compile_, "join": first, "reforms": records, "recompiles": recompiles,
            "compiled": f"compile {compile_}," in out or f"compile {compile_} (" in out, "log_tail": out[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--task", choices=("gpt_lm", "resnet50"), default="gpt_lm")
    ap.add_argument("--size", default="tiny", help="gpt_lm's model size")
    ap.add_argument("--compile-mode", default="default", help="the template's --compile-mode with compile on")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reforms", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each setting, alternating")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of training between re-forms")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", type=Path, default=None, help="write every run's records here")
    a = ap.parse_args()
    runs = []
    for r in range(a.rounds):
        for c in (("on", "off") if r % 2 == 0 else ("off", "on")):
            res = run(c, a)
            runs.append(res)
            pauses = [x["pause_s"] for x in res["reforms"]]
            firsts = [x.get("first_step_s") for x in res["reforms"]]
            print(f"compile {c} round {r}: join pause {res['join'].get('pause_s', float('nan')):.3f} s; re-form "
                  f"pauses {' '.join(f'{p:.3f}' for p in pauses)} s (first steps "
                  f"{' '.join(f'{f:.3f}' for f in firsts if f is not None)} s); recompiles logged "
                  f"{res['recompiles']}", flush=True)
    print("\n| compile | re-forms | pause_s median | pause_s range | recompiles logged |\n|---|---|---|---|---|")
    for c in ("on", "off"):
        pauses = [x["pause_s"] for res in runs if res["compile"] == c for x in res["reforms"]]
        rec = sum(res["recompiles"] for res in runs if res["compile"] == c)
        print(f"| {c} | {len(pauses)} | {statistics.median(pauses):.3f} | {min(pauses):.3f}-{max(pauses):.3f} "
              f"| {rec} |")
    if a.json:
        a.json.write_text(json.dumps(runs, indent=1, default=str))


if __name__ == "__main__":
    main()
