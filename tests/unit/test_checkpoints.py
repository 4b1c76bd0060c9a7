"""Checkpoints of the example scripts (elastic_launcher.checkpoint, torch.distributed.checkpoint): what a saved
checkpoint holds comes back into a fresh trainer state; the scripts save periodically, on SIGTERM and at the
end, and `--resume` continues from the latest checkpoint at another world size (issue #45.1)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from elastic_launcher.checkpoint import Checkpoints, load_model, save_model
from elastic_launcher.sampler import ElasticSampler
from elastic_launcher.state import TrainingState


def _state(seed: int, size: int = 100) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    scaler = torch.amp.GradScaler("cpu")
    return TrainingState(model, optimizer, scheduler, ElasticSampler(size, seed=seed), extras={"scaler": scaler})


def _train(state: TrainingState, steps: int) -> None:
    for _ in range(steps):
        state.model(torch.randn(5, 4)).sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.sampler.advance([5, 5])
        state.counters["step"] += 1


def test_a_checkpoint_puts_back_model_optimizer_sampler_counters_and_extras(tmp_path):
    a = _state(0)
    _train(a, 3)
    a.counters.update(lr_factor=0.5, ref_global=64)
    a.extras["scaler"].load_state_dict({**a.extras["scaler"].state_dict(), "scale": 128.0})
    path = Checkpoints(tmp_path).save(a)

    b = _state(1)  # another init, a fresh optimizer (no state yet), another sampler position
    resumed = Checkpoints(tmp_path).load(b)
    assert resumed.path == path and resumed.step == 3
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for i, st in sa["state"].items():
        assert torch.equal(st["exp_avg_sq"], sb["state"][i]["exp_avg_sq"]) and float(st["step"]) == 3.0
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]   # the scheduler's LR
    assert b.scheduler.state_dict() == a.scheduler.state_dict()
    assert b.sampler.state_dict() == a.sampler.state_dict() == {"epoch": 0, "pos": 30, "size": 100, "seed": 0}
    assert b.counters["step"] == 3 and (b.counters["lr_factor"], b.counters["ref_global"]) == (0.5, 64)
    assert b.extras["scaler"].get_scale() == 128.0
    _train(a, 1)
    _train(b, 0)
    assert not torch.equal(a.model[0].weight, b.model[0].weight)   # b holds step 3, not a's live step 4


def test_latest_names_the_newest_complete_checkpoint_and_two_are_kept(tmp_path):
    ckpts = Checkpoints(tmp_path / "ck")
    assert ckpts.latest() is None and ckpts.load(_state(0)) is None
    s = _state(0)
    for step in (2, 4, 6):
        _train(s, 2)
        assert ckpts.save(s).name == f"step-{step:08d}"
    assert ckpts.latest() == tmp_path / "ck" / "step-00000006"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.is_dir()) == ["step-00000004", "step-00000006"]
    (tmp_path / "ck" / ".step-00000008.partial").mkdir()          # a save cut off by SIGKILL: never "latest"
    assert Checkpoints(tmp_path / "ck").load(_state(1)).step == 6


def test_a_checkpoint_of_another_model_or_dataset_is_refused_naming_it(tmp_path):
    ckpts = Checkpoints(tmp_path)
    first = _state(0)
    _train(first, 1)
    ckpts.save(first)
    other = _state(0)
    other.model = torch.nn.Sequential(torch.nn.Linear(4, 16))
    other.optimizer = torch.optim.AdamW(other.model.parameters())
    with pytest.raises(ValueError, match=r"step-00000001 does not fit this model and optimizer: Size mismatch "
                                         r"between saved torch.Size\(\[8, 4\]\) and current: torch.Size\(\[16, 4\]\)"):
        ckpts.load(other)
    with pytest.raises(ValueError, match=r"sampler state for 100 samples loaded into one of 50 \(a different dataset"):
        ckpts.load(_state(0, size=50))


def test_the_saved_model_loads_into_a_fresh_one_and_converts_to_one_file(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    a = _state(0)
    _train(a, 2)
    save_model(a.model, tmp_path / "model")
    b = load_model(_state(1).model, tmp_path / "model")
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.state_dict().values()))
    dcp_to_torch_save(tmp_path / "model", tmp_path / "model.pt")   # the user guide's one-file recipe
    weights = torch.load(tmp_path / "model.pt")["model"]
    assert torch.equal(weights["0.weight"], a.model[0].weight)


def test_resume_without_a_checkpoint_dir_is_refused():
    from elastic_launcher.examples import resnet50
    from elastic_launcher.examples.common import Checkpointing
    with pytest.raises(SystemExit, match="--resume needs --checkpoint-dir"):
        Checkpointing.of(resnet50.build_parser().parse_args(["--resume"]))


# ---- the example scripts, two worker processes under a local coordinator (what elastic-launch does) -------------

RESNET = [sys.executable, "-m", "elastic_launcher.examples.resnet50", "--arch", "resnet-tiny", "--image-size", "16",
          "--classes", "4", "--dataset-size", "256", "--per-gpu-batch", "4", "--device", "cpu", "--log-every", "2"]


def _run(workers: int, args: list, *, stop_at_step: int | None = None, timeout: float = 240) -> list:
    """Runs ``args`` as ``workers`` workers of one job; with ``stop_at_step`` SIGTERM goes to every worker once
    rank 0's progress passed that step. Returns [(exit code, output)] by worker."""
    import torch.distributed as dist
    from elastic_launcher.membership import Coordinator

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = []
    for i in range(workers):
        env = {**os.environ, "ELASTIC_STORE_ADDR": f"127.0.0.1:{server.port}", "ELASTIC_GROUP": f"ck-n{i}-g1",
               "SLURM_LOCALID": "0", "ELASTIC_NODE": f"n{i}", "ELASTIC_SLOTS": "1", "ELASTIC_JOB_ID": "1"}
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + timeout
        while len([k for k in server.list_keys() if k.startswith("elastic/joined/")]) < workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail("workers did not join: " + " | ".join(
                    f"exit {p.poll()}: {p.stdout.read()[-2000:] if p.poll() is not None else 'running'}" for p in procs))
            time.sleep(0.1)
        Coordinator(server, timeout=timedelta(seconds=60)).start([f"ck-n{i}-g1-0" for i in range(workers)])
        if stop_at_step is not None:
            while _progress(server) < stop_at_step:
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no progress"
                time.sleep(0.05)
            for p in procs:
                p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=max(1, deadline - time.monotonic()))[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def _progress(server) -> int:
    """The highest step the workers reported (store_keys.progress)."""
    from elastic_launcher import store_keys as keys
    return max([json.loads(server.get(k))["step"] for k in server.list_keys()
                if k.startswith(keys.progress(""))] or [0])


@pytest.mark.slow  # three runs of two worker processes
def test_a_resumed_run_continues_where_the_checkpoint_stopped(tmp_path):
    """One run of 4 steps checkpoints at its first commit point past step 2 and at 4; resumed to 8 from either,
    both end with the same weights: model, optimizer, sampler position and LR counters all came back (a resume
    that lost one of them trains other steps from the earlier one than from 4)."""
    first = _run(2, RESNET + ["--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"])
    assert [code for code, _ in first] == [0, 0], first
    assert Checkpoints(tmp_path / "ck").latest().name == "step-00000004"
    earlier = min(p.name for p in (tmp_path / "ck").glob("step-*"))
    assert earlier != "step-00000004"
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    (tmp_path / "ck2" / "latest").write_text(earlier + "\n")
    weights = {}
    for ck, step in (("ck", 4), ("ck2", int(earlier.split("-")[1]))):
        again = _run(2, RESNET + ["--steps", "8", "--checkpoint-dir", str(tmp_path / ck), "--resume",
                                  "--save", str(tmp_path / f"model-{ck}")])
        assert [code for code, _ in again] == [0, 0], again
        out = "".join(text for _, text in again)
        assert out.count(f"resumed from {tmp_path / ck / f'step-{step:08d}'} (step {step})") == 2, out
        assert "done: 8 steps" in out and f"model {tmp_path / f'model-{ck}'}" in out, out
        from elastic_launcher.examples import models
        weights[ck] = load_model(models.build_resnet("resnet-tiny", 4), tmp_path / f"model-{ck}").state_dict()
    for name, a in weights["ck"].items():
        assert torch.allclose(a.float(), weights["ck2"][name].float(), atol=1e-5), name


@pytest.mark.slow  # two runs of worker processes
def test_sigterm_saves_at_a_commit_point_and_the_job_resumes_at_another_size(tmp_path):
    """SIGTERM (scancel, the time limit) to every worker: each stops after its current step, rank 0 writes the
    last commit point (the state every rank agreed on), and a run with one worker instead of two continues from
    that step."""
    ck = tmp_path / "ck"
    stopped = _run(2, RESNET + ["--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-every", "100000"],
                   stop_at_step=6)
    assert [code for code, _ in stopped] == [128 + signal.SIGTERM] * 2, stopped
    step = int(Checkpoints(ck).latest().name.split("-")[1])
    assert step >= 6
    outs = "".join(text for _, text in stopped)
    assert outs.count("stopped by SIGTERM after step") == 2, outs
    assert f"checkpoint {ck / f'step-{step:08d}'} (step {step}): submit the job again with --resume" in outs, outs
    resumed = _run(1, RESNET + ["--steps", str(step + 3), "--checkpoint-dir", str(ck), "--resume"])
    code, out = resumed[0]
    assert code == 0 and f"(step {step})" in out and f"done: {step + 3} steps" in out, out
    assert Checkpoints(ck).latest().name == f"step-{step + 3:08d}"
