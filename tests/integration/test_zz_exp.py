import os, subprocess, numpy as np
from tests.integration.test_replay_fidelity import bed, release_s, wait_and_read  # noqa

def jittered(bed, tmp, n=12, seed=0, nodes=None, gpn=None):
    cfg = bed.config; env = {**os.environ, **bed.env()}
    rng = np.random.default_rng(seed); sleeps = np.round(2 + rng.uniform(0, 1, n), 2)
    ids = []
    for i, s in enumerate(sleeps):
        (tmp / f"c{i}.sh").write_text(f"#!/bin/bash\nsleep {s:.2f}\n")
        p = subprocess.run(["sbatch", "--parsable", "-N", str(nodes or cfg.nodes), f"--gpus-per-node={gpn or cfg.gpus_per_node}",
                            "--time=1", "-J", f"j{i}", f"--output={tmp}/j%j.out", str(tmp / f"c{i}.sh")],
                           capture_output=True, text=True, env=env, timeout=60, check=True)
        ids.append(p.stdout.strip())
    rows = wait_and_read(env, ids)
    st = np.array([rows[f"j{i}"]["start"] for i in range(n)])
    order = np.argsort(st, kind="stable")
    return ((st[order][-1] - st[order][0]) - sleeps[order][:-1].sum()) / (n - 1)

def test_exp(bed, tmp_path):
    for k in range(2):
        (tmp_path / f"a{k}").mkdir(); (tmp_path / f"b{k}").mkdir()
        a = release_s(bed, tmp_path / f"a{k}")
        b = jittered(bed, tmp_path / f"b{k}", seed=k)
        print(f"\nround {k}: integer sleep release {a:.2f}, jittered {b:.2f}", flush=True)
