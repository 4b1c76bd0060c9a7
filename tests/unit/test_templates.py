"""sbatch templates: their shape, rendering with parameters, the CLI, and the example training scripts
(data, models, and two workers training under a local coordinator, as elastic-launch would run them).
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from slurm_plugin import templates
from slurm_plugin.cli import main as slurm_cli
from slurm_plugin.contracts.directives import parse_script

NAMES = sorted(templates.templates())
PARSERS = {"elastic_launcher.examples.resnet50", "elastic_launcher.examples.gpt_lm",
           "elastic_launcher.examples.transformer_finetune", "elastic_launcher.examples.wrap",
           "elastic_launcher.examples.plain_train"}


def _parts(text: str):
    block, command = templates.split_script(text)
    launcher, worker, inner = templates.command_parts(command)
    return block, launcher, worker, inner


def _option(tokens: list[str], flag: str):
    return tokens[tokens.index(flag) + 1] if flag in tokens else None


def test_the_four_templates_exist():
    assert {"resnet50", "transformer-finetune", "gpt-lm", "wrap-train-py"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_template_shape_header_sbatch_elastic_then_one_command(name):
    text = templates.get(name).text
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert lines[1].startswith(f"# {name}: ")
    assert "What you will see" in text and f"elastic-slurm template new {name}" in text
    kinds = [("sbatch" if l.startswith("#SBATCH") else "elastic" if l.startswith("#ELASTIC") else "comment")
             for l in templates.split_script(text)[0]]
    first_sbatch, first_elastic = kinds.index("sbatch"), kinds.index("elastic")
    assert first_sbatch < first_elastic and "sbatch" not in kinds[first_elastic:], "#SBATCH lines, then #ELASTIC"
    assert "comment" not in kinds[first_sbatch:], "the header comment comes first"
    command = templates.split_script(text)[1]
    assert sum(1 for line in command if not line.rstrip().endswith("\\")) == 1, "exactly one command"
    assert not re.search(r"/(home|scratch|work|gpfs|lustre)/", text), "templates hold no site paths"
    # a dead node must cost the job that node only (elastic-launch drops it), not the whole job
    assert "#SBATCH --no-kill" in text
    rendered = templates.render(templates.get(name), templates.Params(gpus="2-16", sbatch={"time": "01:00:00"}))
    assert "#SBATCH --no-kill" in rendered


@pytest.mark.parametrize("name", NAMES)
def test_template_directives_parse_and_match_the_script(name):
    text = templates.get(name).text
    directives = parse_script(text)
    assert directives and directives["gpus"]["min"] <= directives["gpus"]["max"]
    _, launcher, worker, inner = _parts(text)
    assert launcher[:3] == ["elastic-launch", "--script", "$0"]
    assert worker[:2] == ["python", "-m"] and worker[2] in PARSERS
    module = importlib.import_module(worker[2])
    args = module.build_parser().parse_args(worker[3:] + inner)  # every option the template passes exists
    if name == "wrap-train-py":
        assert directives["elastic"] == "off" and inner[1:3] == ["python", "train.py"]
    elif name == "torchrun-restart":   # the launcher waits for the checkpoints the script writes
        assert directives["mode"] == "restart" and args.resume
        assert launcher[launcher.index("--checkpoint-dir") + 1] == str(args.checkpoint_dir)
    else:
        assert args.per_gpu_batch == directives["per_gpu_batch"], "#ELASTIC per_gpu_batch and --per-gpu-batch agree"
        assert args.profile == directives["model"], "the profile name matches the directive"
        assert args.lr_scaling == directives.get("lr_scaling", "linear"), "one learning-rate rule"


def test_template_as_written_has_a_request_inside_its_gpu_bounds():
    for name in NAMES:
        text = templates.get(name).text
        block = templates.split_script(text)[0]
        nodes = int(next(l.split("=")[1] for l in block if l.startswith("#SBATCH --nodes=")))
        per_node = int(next(l.split("=")[1] for l in block if l.startswith("#SBATCH --gpus-per-node=")))
        gpus = parse_script(text)["gpus"]
        assert gpus["min"] <= nodes * per_node <= gpus["max"], name


def test_render_sets_directives_request_and_script_options():
    text = templates.render(templates.get("resnet50"), templates.Params(
        gpus="2-16", directives={"per_gpu_batch": 64, "min_efficiency": "0.5", "gpu_type": "H100"},
        script_options={"--steps": "300", "--data": "/data/imagenet/train"}, sbatch={"time": "01:00:00"}))
    d = parse_script(text)
    assert d["gpus"] == {"min": 2, "max": 16} and d["per_gpu_batch"] == 64 and d["min_efficiency"] == 0.5
    assert d["gpu_type"] == "H100" and d["model"] == "resnet50"
    assert "#SBATCH --nodes=1" in text and "#SBATCH --gpus-per-node=2" in text and "#SBATCH --time=01:00:00" in text
    _, _, worker, _ = _parts(text)
    assert (_option(worker, "--per-gpu-batch"), _option(worker, "--steps"), _option(worker, "--data")) == \
           ("64", "300", "/data/imagenet/train")
    assert worker.count("--steps") == 1


def test_render_sizes_the_written_request_to_the_minimum():
    tpl = templates.get("gpt-lm")
    text = templates.render(tpl, templates.Params(gpus="6-12", gpus_per_node=4))
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
    text = templates.render(tpl, templates.Params(gpus="8"))
    assert "#SBATCH --nodes=2" in text and parse_script(text)["gpus"] == {"min": 8, "max": 8}


def test_gpus_per_node_is_written_as_given_or_refused():
    # #45.7: `--gpus 3-4 --gpus-per-node 4` wrote --gpus-per-node=3
    tpl = templates.get("gpt-lm")
    text = templates.render(tpl, templates.Params(gpus="3-4", gpus_per_node=4))
    assert "#SBATCH --nodes=1" in text and "#SBATCH --gpus-per-node=4" in text
    with pytest.raises(templates.TemplateError, match=r"--gpus 3-3 with --gpus-per-node 4: 1 node x 4 = 4 GPUs, "
                                                      r"above the maximum 3"):
        templates.render(tpl, templates.Params(gpus="3", gpus_per_node=4))


def test_render_with_the_templates_own_values_changes_nothing():
    for name in NAMES:
        tpl = templates.get(name)
        d = parse_script(tpl.text)
        gpus = f"{d['gpus']['min']}-{d['gpus']['max']}"
        again = templates.render(tpl, templates.Params(directives={"model": d["model"]}))
        assert parse_script(again) == d and _parts(again)[1:] == _parts(tpl.text)[1:]
        assert parse_script(templates.render(tpl, templates.Params(gpus=gpus)))["gpus"] == d["gpus"]


@pytest.mark.parametrize("gpus", ["8-2", "0-4", "x", "2-", "-3"])
def test_render_rejects_bad_gpu_bounds(gpus):
    with pytest.raises(templates.TemplateError, match="--gpus"):
        templates.render(templates.get("resnet50"), templates.Params(gpus=gpus))


def test_render_rejects_values_the_directive_grammar_refuses():
    with pytest.raises(templates.TemplateError, match="min_efficiency"):
        templates.render(templates.get("resnet50"), templates.Params(directives={"min_efficiency": "1.5"}))


def test_command_only_for_the_wrapper_and_unknown_names():
    with pytest.raises(templates.TemplateError, match="wrap-train-py only"):
        templates.render(templates.get("gpt-lm"), templates.Params(command=["python", "x.py"]))
    with pytest.raises(templates.TemplateError, match="known: .*resnet50"):
        templates.get("resnet-50")
    text = templates.render(templates.get("wrap-train-py"),
                            templates.Params(command=["python", "my train.py", "-e", "3"]))
    assert _parts(text)[3] == ["--", "python", "my train.py", "-e", "3"]
    assert "'my train.py'" in text


@pytest.mark.parametrize("name", NAMES)
def test_cpu_test_variant_is_small(name):
    text = templates.render(templates.get(name), templates.Params(cpu_test=True, python="/usr/bin/python3",
                                                                  launcher=["/opt/bin/elastic-launch"]))
    d = parse_script(text)
    assert d["gpus"] == {"min": 1, "max": 2}
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=1" in text and "#SBATCH --time=00:10:00" in text
    block, command = templates.split_script(text)
    tokens = " ".join(command)
    assert tokens.startswith("/opt/bin/elastic-launch --script \"$0\" ") and " --workers-per-node 1 -- " in tokens
    assert "/usr/bin/python3 -m elastic_launcher.examples." in tokens
    if name == "torchrun-restart":
        assert "elastic_launcher.examples.plain_train --steps 20 " in tokens and "--checkpoint-every 5" in tokens
    elif name != "wrap-train-py":
        assert "--device cpu" in tokens and "--steps 20" in tokens
        assert f"--per-gpu-batch {d['per_gpu_batch']}" in tokens
    else:
        assert "elastic_launcher.examples.plain_train --steps 20" in tokens


def test_cli_list_new_show(tmp_path):
    runner = CliRunner()
    listed = runner.invoke(slurm_cli, ["template", "list"])
    assert listed.exit_code == 0 and all(re.search(rf"^{n}\s+\S", listed.output, re.M) for n in NAMES)
    out = tmp_path / "job.sbatch"
    made = runner.invoke(slurm_cli, ["template", "new", "resnet50", "--gpus", "2-16", "--per-gpu-batch", "64",
                                     "--set", "lr=0.2", "--out", str(out)])
    assert made.exit_code == 0, made.output
    text = out.read_text()
    assert parse_script(text)["gpus"] == {"min": 2, "max": 16} and "--lr 0.2" in text
    assert os.access(out, os.X_OK)
    shown = runner.invoke(slurm_cli, ["template", "show", "gpt-lm"])
    assert shown.exit_code == 0 and shown.output == templates.get("gpt-lm").text
    bad = runner.invoke(slurm_cli, ["template", "new", "resnet50", "--gpus", "9-3"])
    assert bad.exit_code != 0 and "MIN <= MAX" in bad.output
    missing = runner.invoke(slurm_cli, ["template", "new", "nope"])
    assert missing.exit_code != 0 and "known:" in missing.output


def test_rendered_script_is_valid_bash(tmp_path):
    for name in NAMES:
        path = tmp_path / f"{name}.sbatch"
        path.write_text(templates.render(templates.get(name), templates.Params(gpus="4-8", cpu_test=True)))
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, name


# --- the example scripts' models and data -----------------------------------------------------------------
def test_models_have_the_published_parameter_counts_and_run():
    from elastic_launcher.examples import models

    with torch.device("meta"):  # a count needs the shapes only, not 150 M initialised floats (0.6 GB, ~2 s of CPU)
        resnet50, gpt2_small = models.ResNet(), models.GPT(models.GPT_SIZES["gpt2-small"])
    assert sum(p.numel() for p in resnet50.parameters()) == 25_557_032          # ResNet-50
    assert sum(p.numel() for p in gpt2_small.parameters()) == 124_439_808
    assert models.build_resnet("resnet-tiny", 10)(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert models.GPT(models.GPT_SIZES["tiny"])(torch.randint(0, 256, (2, 16))).shape == (2, 16, 256)
    assert models.EncoderClassifier(models.ENCODER_SIZES["tiny"], 3)(torch.randint(0, 256, (2, 16))).shape == (2, 3)
    with pytest.raises(ValueError, match="unknown --arch"):
        models.build_resnet("resnet-9000", 10)


def test_gpt_is_causal():
    from elastic_launcher.examples import models

    torch.manual_seed(0)
    gpt = models.GPT(models.GPT_SIZES["tiny"]).eval()
    a = torch.randint(0, 256, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 256
    assert torch.allclose(gpt(a)[0, :8], gpt(b)[0, :8], atol=1e-5)


def test_datasets_are_deterministic_and_shaped(tmp_path):
    from elastic_launcher.examples import data

    images = data.SyntheticImages(10, 16, 4, seed=1)
    assert torch.equal(images[3][0], data.SyntheticImages(10, 16, 4, seed=1)[3][0]) and images[3][1] == 3
    seq = data.SyntheticSequences(5, 8, 50)
    x, y = seq[2]
    assert x.shape == y.shape == (8,) and torch.equal(x[1:], y[:-1])
    tokens, label = data.SyntheticSequences(5, 8, 50, classes=3)[1]
    assert tokens.shape == (8,) and 0 <= label < 3
    (tmp_path / "t.txt").write_text("hello elastic world " * 10)
    text = data.TextBytes(tmp_path / "t.txt", 16)
    x, y = text[1]
    assert len(text) == (200 - 1) // 16 and bytes(x.tolist()) == b"rld hello elasti" and torch.equal(x[1:], y[:-1])
    torch.save({"inputs": torch.zeros(4, 3), "targets": torch.arange(4)}, tmp_path / "d.pt")
    assert len(data.TensorFile(tmp_path / "d.pt")) == 4
    torch.save({"inputs": torch.zeros(4, 3)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="'inputs' and 'targets'"):
        data.TensorFile(tmp_path / "bad.pt")


def test_image_folder_reads_class_folders(tmp_path):
    from PIL import Image

    from elastic_launcher.examples import data

    for cls, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (20, 10), colour).save(tmp_path / cls / "a.png")
    folder = data.ImageFolder(tmp_path, 8)
    assert len(folder) == 2 and folder.classes == 2
    image, label = folder[1]
    assert image.shape == (3, 8, 8) and label == 1 and image[2].mean() > image[0].mean()
    with pytest.raises(FileNotFoundError, match="class folders"):
        data.ImageFolder(tmp_path / "cat", 8)


def test_example_refuses_to_run_outside_elastic_launch(monkeypatch):
    """In this process (a fresh interpreter importing torch again took 1.5-5 s of CPU); `python -m` of the same
    example runs in test_two_workers_train_under_a_local_coordinator (slow)."""
    from elastic_launcher.examples import gpt_lm

    for key in [k for k in os.environ if k.startswith(("ELASTIC_", "SLURM_"))]:
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit) as refused:     # a message as its code: Python prints it and exits with 1
        gpt_lm.main(["--size", "tiny"])
    assert isinstance(refused.value.code, str) and "run this script under elastic-launch" in refused.value.code


@pytest.mark.slow  # two worker processes
def test_two_workers_train_under_a_local_coordinator(tmp_path):
    """What elastic-launch does, without Slurm: a store, a first plan, two worker processes."""
    import torch.distributed as dist

    from elastic_launcher.membership import Coordinator

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = []
    for i in range(2):
        env = {**os.environ, "ELASTIC_STORE_ADDR": f"127.0.0.1:{server.port}", "ELASTIC_GROUP": f"jt-n{i}-g1",
               "SLURM_LOCALID": "0", "ELASTIC_NODE": f"n{i}", "ELASTIC_SLOTS": "1", "ELASTIC_JOB_ID": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "elastic_launcher.examples.gpt_lm", "--size", "tiny", "--dataset-size", "64",
             "--steps", "6", "--per-gpu-batch", "2", "--log-every", "3", "--observations", str(tmp_path / "obs.jsonl")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 120
        while len([k for k in server.list_keys() if k.startswith("elastic/joined/")]) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "workers did not join"
            time.sleep(0.1)
        Coordinator(server, timeout=timedelta(seconds=60)).start(["jt-n0-g1-0", "jt-n1-g1-0"])
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "step 3/6  workers 2  global batch 4" in outputs[0] and "done: 6 steps" in outputs[0]
    assert "done:" not in outputs[1]                                       # rank 0 alone reports
    records = (tmp_path / "obs.jsonl").read_text().splitlines()
    assert any('"kind": "step"' in r and '"profile": "gpt2"' in r for r in records)


def test_the_script_takes_the_directives_batch_and_refuses_a_different_one():
    # #26.2: workers trained with --per-gpu-batch while the controller labelled rows with #ELASTIC per_gpu_batch,
    # unchecked; the launcher now hands the directive to the workers and the script refuses a different value
    from elastic_launcher.examples.common import WorkerEnv
    from elastic_launcher.launch_config import Directives
    d = Directives.from_script("#!/bin/bash\n#ELASTIC model=resnet50 per_gpu_batch=48 gpus=1-4\n")
    environ = {"ELASTIC_GROUP": "g", "ELASTIC_STORE_ADDR": "h:1/job", "SLURM_LOCALID": "0", "ELASTIC_SPEED": "0.5",
               **d.worker_env()}
    env = WorkerEnv.from_environ(environ)
    assert (env.per_gpu_batch, env.max_global_batch, env.speed) == (48, None, 0.5)
    assert env.agreed("--per-gpu-batch", None, env.per_gpu_batch, 64) == 48       # the directive's by default
    assert env.agreed("--per-gpu-batch", 48, env.per_gpu_batch, 64) == 48
    with pytest.raises(SystemExit, match=r"--per-gpu-batch 64 disagrees with the job's `#ELASTIC per_gpu_batch=48`"):
        env.agreed("--per-gpu-batch", 64, env.per_gpu_batch, 64)
    plain = WorkerEnv.from_environ({k: v for k, v in environ.items() if k != "ELASTIC_PER_GPU_BATCH"})
    assert plain.agreed("--per-gpu-batch", None, plain.per_gpu_batch, 64) == 64  # no directive: the script's
    assert Directives.from_script("#!/bin/bash\n#ELASTIC model=resnet50\n").worker_env() == {"ELASTIC_MODEL": "resnet50"}
