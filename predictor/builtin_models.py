"""The built-in architectures of `predictor.profiles.BUILTIN` as torch modules: parameter shapes only, from the
published configs, built on the meta device by `profiles._builtin_tensors`.

A module of its own so that torch is imported at its top: `predictor.profiles` (which the CLI and the service
import without torch) imports this module only when it builds a built-in profile.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _transformer(vocab: int, pos: int, d: int, layers: int, ffn: int | None = None, types: int = 0,
                 pooler: bool = False, patch: int = 0, fused_qkv: bool = False):
    ffn = ffn or 4 * d
    m = nn.Module()
    if patch:
        m.patch_embed = nn.Conv2d(3, d, patch, patch)
        m.cls_token = nn.Parameter(torch_empty(1, 1, d))
        m.pos_embed = nn.Parameter(torch_empty(1, pos, d))
    else:
        m.word_embeddings = _embedding(vocab, d)
        m.position_embeddings = _embedding(pos, d)
        if types:
            m.token_type_embeddings = _embedding(types, d)
        m.emb_norm = nn.LayerNorm(d)
    blocks = nn.ModuleList()
    for _ in range(layers):
        b = nn.Module()
        if fused_qkv:
            b.qkv = nn.Linear(d, 3 * d)
        else:
            b.query, b.key, b.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        b.attn_out, b.norm1 = nn.Linear(d, d), nn.LayerNorm(d)
        b.ffn_in, b.ffn_out, b.norm2 = nn.Linear(d, ffn), nn.Linear(ffn, d), nn.LayerNorm(d)
        blocks.append(b)
    m.layers = blocks
    if pooler:
        m.pooler = nn.Linear(d, d)
    if patch:
        m.norm, m.head = nn.LayerNorm(d), nn.Linear(d, 1000)
    return m


def torch_empty(*shape):
    return torch.empty(*shape)


def _embedding(num: int, dim: int):
    """`nn.Embedding(num, dim)`'s one parameter (`weight`) without its `normal_` init, which on the meta device
    imports torch._dynamo: 1.5 s of CPU in the first profile a process builds."""
    m = nn.Module()
    m.weight = nn.Parameter(torch_empty(num, dim))
    return m


def _resnet(blocks: list[int], bottleneck: bool, classes: int = 1000, cifar: bool = False):
    m = nn.Module()
    m.conv1 = nn.Conv2d(3, 64, 3 if cifar else 7, 1 if cifar else 2, bias=False)
    m.bn1 = nn.BatchNorm2d(64)
    inp, exp, stages = 64, 4 if bottleneck else 1, nn.ModuleList()
    for i, n in enumerate(blocks):
        w = 64 * 2**i
        for j in range(n):
            b = nn.Module()
            if bottleneck:
                b.conv1, b.bn1 = nn.Conv2d(inp, w, 1, bias=False), nn.BatchNorm2d(w)
                b.conv2, b.bn2 = nn.Conv2d(w, w, 3, bias=False), nn.BatchNorm2d(w)
                b.conv3, b.bn3 = nn.Conv2d(w, w * exp, 1, bias=False), nn.BatchNorm2d(w * exp)
            else:
                b.conv1, b.bn1 = nn.Conv2d(inp, w, 3, bias=False), nn.BatchNorm2d(w)
                b.conv2, b.bn2 = nn.Conv2d(w, w, 3, bias=False), nn.BatchNorm2d(w)
            if j == 0 and inp != w * exp:
                b.down, b.down_bn = nn.Conv2d(inp, w * exp, 1, bias=False), nn.BatchNorm2d(w * exp)
            inp = w * exp
            stages.append(b)
    m.layers, m.fc = stages, nn.Linear(inp, classes)
    return m


def _vgg16():
    m, inp, convs = nn.Module(), 3, nn.ModuleList()
    for c in [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]:
        convs.append(nn.Conv2d(inp, c, 3))
        inp = c
    m.features = convs
    m.fc1, m.fc2, m.fc3 = nn.Linear(512 * 49, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 1000)
    return m


def _flat(total_params: int, n_tensors: int):
    """Approximate architecture: `n_tensors` equal tensors summing to a published parameter count."""
    m, each = nn.Module(), max(1, total_params // n_tensors)
    m.params = nn.ParameterList([nn.Parameter(torch_empty(each)) for _ in range(n_tensors)])
    return m


def _neumf(users: int, items: int, factor: int = 32, layers: int = 3):
    """NeuMF-end (He et al. 2017) as the NCF benchmark registers it: the GMF and MLP embeddings of users and items,
    the MLP tower halving from 2 factor 2^(layers-1) wide, the predict layer over both paths."""
    m = nn.Module()
    wide = factor * 2 ** (layers - 1)
    m.embed_user_gmf, m.embed_item_gmf = _embedding(users, factor), _embedding(items, factor)
    m.embed_user_mlp, m.embed_item_mlp = _embedding(users, wide), _embedding(items, wide)
    m.mlp = nn.ModuleList([nn.Linear(2 * wide // 2 ** i, wide // 2 ** i) for i in range(layers)])
    m.predict = nn.Linear(2 * factor, 1)
    return m


def _deepspeech2():
    m = nn.Module()
    m.conv1, m.conv2 = nn.Conv2d(1, 32, (41, 11)), nn.Conv2d(32, 32, (21, 11))
    m.rnn = nn.GRU(1312, 800, num_layers=5, bidirectional=True)
    m.fc = nn.Linear(1600, 29)
    return m


# name -> builder (the names of profiles.BUILTIN)
BUILDERS = {
    "resnet50": lambda: _resnet([3, 4, 6, 3], True),
    "resnet18": lambda: _resnet([2, 2, 2, 2], False),
    "resnet18_cifar10": lambda: _resnet([2, 2, 2, 2], False, 10, cifar=True),
    "resnet50_cifar10": lambda: _resnet([3, 4, 6, 3], True, 10, cifar=True),
    "vgg16": _vgg16,
    "bert-base-uncased": lambda: _transformer(30522, 512, 768, 12, types=2, pooler=True),
    "bert-large-uncased": lambda: _transformer(30522, 512, 1024, 24, types=2, pooler=True),
    "roberta-base": lambda: _transformer(50265, 514, 768, 12, types=1, pooler=True),
    "roberta-large": lambda: _transformer(50265, 514, 1024, 24, types=1, pooler=True),
    "vit-base-patch16-224": lambda: _transformer(0, 197, 768, 12, patch=16, fused_qkv=True),
    "gpt2": lambda: _transformer(50257, 1024, 768, 12, fused_qkv=True),
    "gpt2-xl": lambda: _transformer(50257, 1024, 1600, 48, fused_qkv=True),
    "inception_v3": lambda: _flat(23_834_568, 94),  # approximate shapes
    "yolov3": lambda: _flat(61_949_149, 75),  # approximate shapes
    "ncf": lambda: _flat(5_860_000, 8),  # NeuMF on MovieLens-20M, approximate
    # the Pollux/AdaptDL benchmark's NCF (benchmark/models/ncf: MovieLens-1M, 6040 users x 3706 items, factor 32,
    # 3 MLP layers): 1.60 M parameters
    "ncf-ml-1m": lambda: _neumf(6040, 3706),
    "deepspeech2": _deepspeech2,  # approximate (5 bi-GRU, hidden 800)
}
