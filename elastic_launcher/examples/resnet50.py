"""ResNet-50 data-parallel image classification under elastic-launch (template `resnet50`).

Synthetic 224x224 images by default; `--data DIR` reads an ImageNet-style folder (`DIR/<class>/<image>`),
`--data FILE.pt` a tensor file (see data.TensorFile). The model is torchvision's `resnet50` when torchvision
imports, else the same architecture from `models.ResNet`. `--arch resnet-tiny --image-size 32` is the
CPU-sized variant the testbed runs.

Example (the command of an sbatch script):
    elastic-launch --script "$0" -- python -m elastic_launcher.examples.resnet50 --steps 2000 --per-gpu-batch 64
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from elastic_launcher.examples import common, data, models


def memory_format(args: argparse.Namespace) -> torch.memory_format:
    return torch.channels_last if getattr(args, "channels_last", "off") == "on" else torch.contiguous_format


def build_dataset(args: argparse.Namespace):
    """The dataset the options name, and its class count."""
    on_gpu = getattr(args, "gpu_data", "off") == "on" or (
        getattr(args, "gpu_data", "off") == "auto" and common.on_gpu(args))
    if args.data is None:
        if on_gpu:
            return data.DeviceSyntheticImages(args.dataset_size, args.image_size, args.classes, args.seed,
                                              memory_format=memory_format(args)), args.classes
        return data.SyntheticImages(args.dataset_size, args.image_size, args.classes, args.seed), args.classes
    if args.data.is_dir():
        folder = None
        if on_gpu and (args.gpu_data == "on" or importlib.util.find_spec("torchvision") is not None):
            try:
                folder = data.EncodedImageFolder(args.data, args.image_size, memory_format(args))
            except ValueError as exc:
                if args.gpu_data == "on":
                    raise SystemExit(f"--gpu-data on: {exc}") from None
                print(f"{exc}: decoding on the CPU", file=sys.stderr)  # auto: the folder decides
        folder = folder or data.ImageFolder(args.data, args.image_size)
        return folder, folder.classes
    tensors = data.TensorFile(args.data)
    return tensors, int(tensors.targets.max()) + 1


def loss_of(model: torch.nn.Module, batch, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images.contiguous(memory_format=memory_format)
                                 if memory_format is not torch.preserve_format else images), labels)


def build_parser() -> argparse.ArgumentParser:
    """The script's options (the templates' commands are checked against it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, steps=2000, per_gpu_batch=64, lr=0.1)
    parser.add_argument("--arch", default="resnet50", help="resnet50 | resnet101 | resnet-tiny (CPU tests)")
    parser.add_argument("--data", type=Path, default=None, help="image folder or .pt tensor file (default: synthetic)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--classes", type=int, default=1000, help="classes of the synthetic data")
    parser.add_argument("--dataset-size", type=int, default=1_281_167, help="samples of the synthetic data")
    parser.add_argument("--profile", default="resnet50", help="predictor profile name (#ELASTIC model=)")
    parser.add_argument("--channels-last", choices=("on", "off"), default="on",
                        help="model and images in channels_last memory format (NHWC: cuDNN's fast convolutions)")
    parser.add_argument("--gpu-data", choices=("auto", "on", "off"), default="auto",
                        help="synthetic images made on the GPU, JPEG folders decoded there (nvJPEG); auto: on a GPU")
    common.add_speed_args(parser, compile_default="on", compile_mode="reduce-overhead")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    dataset, classes = build_dataset(args)
    model = models.build_resnet(args.arch, classes)
    fused = common.optimizer_options(args)
    return common.train(args, model,
                        lambda p: torch.optim.SGD(p, lr=args.lr, momentum=0.9, weight_decay=1e-4, **fused),
                        dataset, functools.partial(loss_of, memory_format=memory_format(args)),
                        profile=args.profile, environ=os.environ)


if __name__ == "__main__":
    sys.exit(main())
