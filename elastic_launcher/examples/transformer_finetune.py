"""Transformer sequence-classification fine-tune under elastic-launch (template `transformer-finetune`).

With `transformers` installed: `--hf-model NAME_OR_DIR` builds `AutoModelForSequenceClassification` from the
config (random init, `--init random`) or loads local weights (`--init pretrained`; nothing is downloaded:
`local_files_only`). Without it: the built-in encoder (models.EncoderClassifier, `--size bert-base` has
BERT-base's shapes). Data: synthetic token sequences by default, or `--data FILE.pt` with `inputs` (token ids,
N x T) and `targets` (labels). `--size tiny` is the CPU-sized variant the testbed runs.

Example (the command of an sbatch script):
    elastic-launch --script "$0" -- python -m elastic_launcher.examples.transformer_finetune --per-gpu-batch 32
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from elastic_launcher.examples import common, data, models


class HFClassifier(torch.nn.Module):
    """`transformers` sequence classifier returning plain logits (the loop calls `model(tokens)`)."""

    def __init__(self, name: str, classes: int, pretrained: bool):
        super().__init__()
        import transformers  # noqa: PLC0415 - optional: transformers

        auto = transformers.AutoModelForSequenceClassification
        if pretrained:
            self.inner = auto.from_pretrained(name, num_labels=classes, local_files_only=True)
        else:
            config = transformers.AutoConfig.from_pretrained(name, num_labels=classes, local_files_only=True)
            self.inner = auto.from_config(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens).logits


def build_model(args: argparse.Namespace, classes: int) -> torch.nn.Module:
    if args.hf_model and importlib.util.find_spec("transformers") is not None:
        return HFClassifier(args.hf_model, classes, pretrained=args.init == "pretrained")
    if args.hf_model:
        print(f"transformers is not installed: training the built-in {args.size} encoder instead of "
              f"{args.hf_model}", file=sys.stderr)
    return models.EncoderClassifier(models.ENCODER_SIZES[args.size], classes)


def loss_of(model: torch.nn.Module, batch) -> torch.Tensor:
    tokens, labels = batch
    return F.cross_entropy(model(tokens), labels)


def build_parser() -> argparse.ArgumentParser:
    """The script's options (the templates' commands are checked against it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, steps=3000, per_gpu_batch=32, lr=2e-5)
    parser.add_argument("--hf-model", default=None, help="transformers model name or local directory")
    parser.add_argument("--init", choices=("random", "pretrained"), default="random",
                        help="random: config only; pretrained: local weights of --hf-model")
    parser.add_argument("--size", choices=sorted(models.ENCODER_SIZES), default="bert-base",
                        help="built-in encoder size (when transformers is absent or --hf-model not given)")
    parser.add_argument("--classes", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--data", type=Path, default=None, help=".pt file with inputs/targets (default: synthetic)")
    parser.add_argument("--dataset-size", type=int, default=100_000, help="samples of the synthetic data")
    parser.add_argument("--profile", default="bert-base-uncased", help="predictor profile name (#ELASTIC model=)")
    # compile off until measured on this template (#39: GPT-LM's 34% -> 51% MFU came with it; a Hugging Face model
    # may break its graph): `--compile on` to try it
    common.add_speed_args(parser, compile_default="off")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    dataset = data.TensorFile(args.data) if args.data is not None else None
    classes = int(dataset.targets.max()) + 1 if dataset is not None else args.classes
    model = build_model(args, classes)
    if dataset is None:   # synthetic tokens within the model's vocabulary and positions
        config = getattr(getattr(model, "inner", None), "config", None)
        size = models.ENCODER_SIZES[args.size]
        vocab = getattr(config, "vocab_size", size.vocab)
        seq_len = min(args.seq_len, getattr(config, "max_position_embeddings", size.context))
        dataset = data.SyntheticSequences(args.dataset_size, seq_len, vocab, classes=classes, seed=args.seed)
    fused = common.optimizer_options(args)
    return common.train(args, model, lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.01, **fused),
                        dataset, loss_of, profile=args.profile, environ=os.environ)


if __name__ == "__main__":
    sys.exit(main())
