"""GPT-style language model pre-training under elastic-launch (template `gpt-lm`).

A decoder-only transformer (models.GPT; `--size gpt2-small` has GPT-2 small's shapes) trained on next-token
prediction: synthetic sequences by default, or `--data FILE.txt` as byte-level text (vocabulary 256).
`--size tiny` is the CPU-sized variant the testbed runs.

Example (the command of an sbatch script):
    elastic-launch --script "$0" -- python -m elastic_launcher.examples.gpt_lm --size gpt2-small --per-gpu-batch 16
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

from elastic_launcher.examples import common, data, models


def loss_of(model: torch.nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return model(tokens, targets)  # models.GPT's own loss: inside the (compiled) module


def build_parser() -> argparse.ArgumentParser:
    """The script's options (the templates' commands are checked against it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, steps=5000, per_gpu_batch=16, lr=3e-4)
    parser.add_argument("--size", choices=sorted(models.GPT_SIZES), default="gpt2-small")
    parser.add_argument("--context", type=int, default=None, help="tokens per sample (default: the size's context)")
    parser.add_argument("--data", type=Path, default=None, help="text file, byte-level (default: synthetic)")
    parser.add_argument("--dataset-size", type=int, default=1_000_000, help="samples of the synthetic data")
    parser.add_argument("--profile", default="gpt2", help="predictor profile name (#ELASTIC model=)")
    parser.add_argument("--vocab-multiple", type=int, default=64,
                        help="pad the embedding to a multiple of this (nanoGPT's 50304; 1: off)")
    common.add_speed_args(parser, compile_default="on")
    return parser


def build_model_and_data(args: argparse.Namespace):
    """The model and the dataset the options name."""
    size = models.GPT_SIZES[args.size]
    if args.context:
        size = dataclasses.replace(size, context=args.context)
    if args.data is not None:
        size = dataclasses.replace(size, vocab=256)
        dataset = data.TextBytes(args.data, size.context)
    else:
        dataset = data.SyntheticSequences(args.dataset_size, size.context, size.vocab, seed=args.seed)
    return models.GPT(size, vocab_multiple=args.vocab_multiple), dataset


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model, dataset = build_model_and_data(args)
    fused = common.optimizer_options(args)
    return common.train(args, model, lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.1, **fused),
                        dataset, loss_of, profile=args.profile, environ=os.environ)


if __name__ == "__main__":
    sys.exit(main())
