"""The templates' fast paths (#39): padded vocabulary and the loss inside the GPT, data made on the device, the
switches that turn each fast path on or off, and the bench's best-recipe arm and utilisation table."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

ROOT = Path(__file__).resolve().parents[2]


def test_padded_vocabulary_keeps_the_models_outputs_and_its_loss_covers_every_row():
    from elastic_launcher.examples import models

    size = models.TransformerSize(32, 1, 4, 16, vocab=50)
    torch.manual_seed(0)
    gpt = models.GPT(size, vocab_multiple=64)
    assert gpt.tokens.weight.shape == (64, 32)  # 50 padded to 64
    tokens = torch.randint(0, 50, (2, 16))
    targets = torch.randint(0, 50, (2, 16))
    logits = gpt(tokens)
    assert logits.shape == (2, 16, 50)  # callers see the real vocabulary
    full = gpt.norm(gpt.blocks[0](gpt.tokens(tokens) + gpt.positions(torch.arange(16)))) @ gpt.tokens.weight.T
    assert torch.allclose(logits, full[..., :50], atol=1e-5)
    expected = F.cross_entropy(full.reshape(-1, 64), targets.reshape(-1))  # padded rows take part, as in nanoGPT
    assert torch.allclose(gpt(tokens, targets), expected, atol=1e-5)
    assert models.GPT(size).tokens.weight.shape == (50, 32)


def test_gpu_made_images_are_the_same_per_index_whatever_the_batch_and_carry_their_label():
    from elastic_launcher.examples import data

    ds = data.DeviceSyntheticImages(1000, 8, 10, seed=3, pool=4, memory_format=torch.channels_last)
    assert ds[7] == (7, 7)  # the loader's workers only pass the index and label on
    cpu = torch.device("cpu")
    x, y = ds.to_device(default_collate([ds[i] for i in (7, 2, 11)]), cpu)
    assert x.shape == (3, 3, 8, 8) and x.is_contiguous(memory_format=torch.channels_last)
    assert y.tolist() == [7, 2, 1]
    alone, _ = ds.to_device(default_collate([ds[7]]), cpu)
    assert torch.equal(alone[0], x[0])
    other, _ = data.DeviceSyntheticImages(1000, 8, 10, seed=3, pool=4).to_device(default_collate([ds[7]]), cpu)
    assert torch.equal(other[0], x[0])
    # i and i + pool share a pool image; the label's offset tells them apart (the loss can fall)
    same, _ = ds.to_device(default_collate([ds[3], ds[7]]), cpu)
    assert torch.allclose(same[1] - same[0], torch.full_like(same[0], (7 - 3) / 10))


def test_each_fast_path_is_an_option_and_auto_keeps_the_cpu_runs_plain(monkeypatch):
    from elastic_launcher.examples import common, gpt_lm, resnet50

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    args = gpt_lm.build_parser().parse_args([])
    assert args.per_gpu_batch is None and args.script_per_gpu_batch == 16 and args.vocab_multiple == 64
    assert common.compile_wanted(args, gpu) and not common.compile_wanted(args, cpu)
    assert common.optimizer_options(args) == {}  # auto, no GPU
    assert common.optimizer_options(gpt_lm.build_parser().parse_args(["--fused-optimizer", "on"])) == {"fused": True}
    assert not common.compile_wanted(gpt_lm.build_parser().parse_args(["--compile", "off"]), gpu)
    assert common.compile_wanted(gpt_lm.build_parser().parse_args(["--compile", "on"]), cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert common.optimizer_options(args) == {"fused": True}
    r = resnet50.build_parser().parse_args([])
    # measured: compile's default mode did not pay for ResNet-50 (session 19); CUDA graphs did, 2.4x (session 29)
    assert common.compile_wanted(r, gpu) and not common.compile_wanted(r, cpu)
    assert common.compile_label(r, gpu) == "on (reduce-overhead)" and common.compile_label(r, cpu) == "off"
    assert common.compile_label(gpt_lm.build_parser().parse_args([]), gpu) == "on"
    with pytest.raises(SystemExit):
        resnet50.build_parser().parse_args(["--compile-mode", "fast"])
    assert resnet50.memory_format(r) is torch.channels_last
    assert resnet50.memory_format(resnet50.build_parser().parse_args(["--channels-last", "off"])) \
        is torch.contiguous_format
    ds, classes = resnet50.build_dataset(r)
    assert type(ds).__name__ == "DeviceSyntheticImages" and classes == 1000
    ds, _ = resnet50.build_dataset(resnet50.build_parser().parse_args(["--gpu-data", "off"]))
    assert type(ds).__name__ == "SyntheticImages"


def test_gpu_decode_refuses_a_folder_with_other_images(tmp_path):
    from PIL import Image

    from elastic_launcher.examples import data

    (tmp_path / "cat").mkdir()
    Image.new("RGB", (20, 10)).save(tmp_path / "cat" / "a.jpg")
    folder = data.EncodedImageFolder(tmp_path, 8)
    encoded, label = folder[0]
    assert encoded.dtype == torch.uint8 and bytes(encoded[:2].tolist()) == b"\xff\xd8" and label == 0
    joined, lengths, labels = folder.collate([folder[0], folder[0]])
    assert torch.equal(joined, torch.cat([encoded, encoded])) and lengths.tolist() == [len(encoded)] * 2
    assert labels.tolist() == [0, 0]
    Image.new("RGB", (20, 10)).save(tmp_path / "cat" / "b.png")
    with pytest.raises(ValueError, match="b.png: not a JPEG"):
        data.EncodedImageFolder(tmp_path, 8)


def test_auto_decodes_a_folder_with_other_images_on_the_cpu_and_on_refuses_it(tmp_path, monkeypatch):
    from PIL import Image

    from elastic_launcher.examples import resnet50

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (20, 10)).save(tmp_path / "cat" / "a.jpg")
    Image.new("RGB", (20, 10)).save(tmp_path / "cat" / "b.png")
    folder, classes = resnet50.build_dataset(resnet50.build_parser().parse_args(["--data", str(tmp_path)]))
    assert type(folder).__name__ == "ImageFolder" and len(folder) == 2 and classes == 1
    with pytest.raises(SystemExit, match="--gpu-data on: .*b.png: not a JPEG"):
        resnet50.build_dataset(resnet50.build_parser().parse_args(["--data", str(tmp_path), "--gpu-data", "on"]))


def test_the_best_recipe_arm_runs_the_tasks_recipe_script(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import vs_torchrun

    cmds = []
    monkeypatch.setattr(vs_torchrun.subprocess, "run", lambda cmd, **kw: cmds.append(cmd) or
                        vs_torchrun.subprocess.CompletedProcess(cmd, 0, stdout="", stderr=""))
    vs_torchrun.run_plain("gpt-lm", "tokens", 1, "bf16", 8, Path("unused"), arm="C", extra=("--compile", "off"))
    vs_torchrun.run_plain("resnet50", "jpeg", 1, "bf16", 8, Path("j"), arm="C")
    assert cmds[0][5].endswith("recipe_nanogpt.py") and cmds[0][cmds[0].index("--compile") + 1] == "off"
    assert cmds[1][5].endswith("recipe_torchvision.py") and cmds[1][cmds[1].index("--data") + 1] == "j"


def test_utilisation_reads_mfu_and_the_gpu_bound_rate_from_the_synthetic_rows_best_recipe():
    sys.path.insert(0, str(ROOT / "bench"))
    import vs_torchrun

    rows = [("tokens", "bf16", 1, 8, {"A": [100.0], "B": [400.0]}, [4.0]),
            ("synthetic", "bf16", 1, 8, {"B": [900.0, 950.0], "C": [1000.0, 1000.0]}, [0.9]),
            ("jpeg", "bf16", 1, 8, {"B": [800.0]}, [1.0]), ("jpeg", "fp32", 1, 8, {"B": [300.0]}, [1.0])]
    text = vs_torchrun.utilisation(rows, peak=800.0, flops=1e12)
    assert "| tokens | bf16 | 1 | B | 400 | 50.0% MFU of 800 TFLOP/s |" in text
    assert "| synthetic | bf16 | 1 | B | 900, 950 | 90.0%, 95.0% of the GPU-bound rate |" in text
    assert "| jpeg | bf16 | 1 | B | 800 | 80.0% of the GPU-bound rate |" in text
    assert "| jpeg | fp32 | 1 | B | 300 | (no synthetic C row" in text
    # GPT-2 small: 6 N + 12 L d T per token, N = 124.4 M without the position table, T = 1024
    assert vs_torchrun.gpt_flops_per_sample() == pytest.approx((6 * 123_653_376 + 12 * 12 * 768 * 1024) * 1024)


@pytest.mark.slow  # a fresh interpreter importing torch
def test_the_recompile_count_reads_what_torch_logs_for_a_module_compiled_in_place():
    """The string bench/compile_resize.py counts is the one this torch logs (else its 0 would mean nothing)."""
    probe = ("import torch\n"
             "class M(torch.nn.Module):\n"
             "    def forward(self, x):\n"
             "        return x.relu()\n"
             "m = M(); m.compile(backend='eager', dynamic=False)\n"
             "m(torch.randn(2)); m(torch.randn(3))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TORCH_LOGS": "recompiles"})
    assert out.stdout.count("Recompiling function") + out.stderr.count("Recompiling function") == 1


@pytest.mark.slow  # a compile of the tiny GPT on the CPU (10-95 s on 2 shared cores)
def test_a_reform_reuses_the_compiled_model_without_a_recompile():
    sys.path.insert(0, str(ROOT / "bench"))
    import argparse

    import compile_resize

    args = argparse.Namespace(task="gpt_lm", size="tiny", compile_mode="default", device="cpu", batch=4, reforms=2,
                              settle=0.5, timeout=300.0)
    res = compile_resize.run("on", args)
    assert res["compiled"]  # the worker's first line says it ran with compile on
    assert [r["epoch"] for r in res["reforms"]] == [res["join"]["epoch"] + 1, res["join"]["epoch"] + 2]
    assert res["recompiles"] == 0
