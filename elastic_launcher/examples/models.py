"""Model code for the example scripts, used when torchvision / transformers cannot be imported.

- `ResNet`: the bottleneck ResNet of He et al. (`resnet50()` has ResNet-50's 25.6 M parameters); `tiny`
  variants for CPU tests.
- `GPT`: a decoder-only language model (pre-norm blocks, causal attention, tied embeddings); `GPT_SIZES`
  holds GPT-2 small and a tiny CPU size.
- `EncoderClassifier`: a bidirectional transformer encoder with a mean-pooled classification head, the
  built-in stand-in for a BERT-style fine-tune; `ENCODER_SIZES` holds a BERT-base-like and a tiny size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 convolutions with a projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, inp: int, width: int, stride: int):
        super().__init__()
        out = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.shortcut = None
        if stride != 1 or inp != out:
            self.shortcut = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    """Bottleneck ResNet. `small_input` uses a 3x3 stem without max-pool (32x32 images)."""

    def __init__(self, blocks=(3, 4, 6, 3), width: int = 64, classes: int = 1000, small_input: bool = False):
        super().__init__()
        if small_input:
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
        layers, inp = [], width
        for stage, n in enumerate(blocks):
            for i in range(n):
                layers.append(Bottleneck(inp, width * 2**stage, 2 if stage > 0 and i == 0 else 1))
                inp = width * 2**stage * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(inp, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


RESNETS = {
    "resnet50": dict(blocks=(3, 4, 6, 3), width=64),
    "resnet101": dict(blocks=(3, 4, 23, 3), width=64),
    "resnet-tiny": dict(blocks=(1, 1, 1, 1), width=8, small_input=True),
}


def build_resnet(arch: str, classes: int) -> nn.Module:
    """torchvision's model of that name when torchvision imports, else ours (same architecture).

    Raises:
        ValueError: unknown architecture.
    """
    if arch != "resnet-tiny":
        try:
            import torchvision.models as tvm  # noqa: PLC0415 - optional: torchvision

            return tvm.get_model(arch, weights=None, num_classes=classes)
        except ImportError:
            pass
    if arch not in RESNETS:
        raise ValueError(f"unknown --arch {arch!r}; known without torchvision: {sorted(RESNETS)}")
    return ResNet(classes=classes, **RESNETS[arch])


@dataclass(frozen=True)
class TransformerSize:
    """Width, depth, heads and context of a transformer; `vocab` is the token vocabulary."""

    d_model: int
    layers: int
    heads: int
    context: int
    vocab: int


GPT_SIZES = {
    "gpt2-small": TransformerSize(768, 12, 12, 1024, 50257),
    "gpt2-medium": TransformerSize(1024, 24, 16, 1024, 50257),
    "tiny": TransformerSize(64, 2, 4, 64, 256),
}
ENCODER_SIZES = {
    "bert-base": TransformerSize(768, 12, 12, 512, 30522),
    "tiny": TransformerSize(64, 2, 4, 64, 256),
}


def _init_embeddings(model: nn.Module) -> None:
    """GPT-2's embedding init (std 0.02): unit-variance embeddings make tied logits far too large."""
    nn.init.normal_(model.tokens.weight, std=0.02)
    nn.init.normal_(model.positions.weight, std=0.02)


class Block(nn.Module):
    """Pre-norm transformer block: attention (causal or not) and a 4x MLP, each with a residual."""

    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only language model; `forward(tokens)` returns next-token logits (batch, time, vocab),
    `forward(tokens, targets)` the mean next-token cross-entropy (inside the module, so a compiled module fuses it).

    `vocab_multiple` pads the embedding (and so the logits) to a multiple of it, as nanoGPT's 50304 for GPT-2's
    50257: matrix products of a round width run faster; the padded tokens never occur and their logits only fall.
    """

    def __init__(self, size: TransformerSize, vocab_multiple: int = 1):
        super().__init__()
        self.size = size
        rows = -(-size.vocab // vocab_multiple) * vocab_multiple
        self.tokens, self.positions = nn.Embedding(rows, size.d_model), nn.Embedding(size.context, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.heads, causal=True) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.d_model)
        _init_embeddings(self)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.tokens.weight.T
        if targets is None:
            return logits[..., : self.size.vocab]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class EncoderClassifier(nn.Module):
    """Bidirectional encoder with a mean-pooled head; `forward(tokens)` returns class logits."""

    def __init__(self, size: TransformerSize, classes: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(size.vocab, size.d_model), nn.Embedding(size.context, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.heads, causal=False) for _ in range(size.layers))
        self.norm, self.head = nn.LayerNorm(size.d_model), nn.Linear(size.d_model, classes)
        _init_embeddings(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))
