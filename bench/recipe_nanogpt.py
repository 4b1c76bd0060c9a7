"""The language-model "best recipe" arm of bench/vs_torchrun.py (#39): a nanoGPT-style training script.

Written for this bench in the style of Karpathy's nanoGPT train.py/model.py (not copied from it): one file, the
model defined in it (GPT-2 small: flash attention through F.scaled_dot_product_attention, tied embeddings, the
vocabulary padded to 50304, loss inside the model), tokens read from a uint16 memmap by ``get_batch`` into pinned
memory (no DataLoader), fused AdamW with weight decay on matrices only, bf16 autocast, ``torch.compile`` before
the DDP wrap, TF32 on. It prints the same progress lines as the template (``step N/M ... X samples/s``).

    python -m torch.distributed.run --standalone --nproc_per_node=1 bench/recipe_nanogpt.py --per-gpu-batch 16
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# GPT-2 small, as the template's `--size gpt2-small`
n_layer, n_head, n_embd, block_size, vocab_size = 12, 12, 768, 1024, 50304  # 50257 padded to a multiple of 64


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention()
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block() for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-gpu-batch", type=int, default=16)  # the template's default
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--compile", choices=("on", "off"), default="on")
    p.add_argument("--tokens", type=Path, default=Path("/tmp/recipe_nanogpt_train.bin"),
                   help="uint16 token file (made with random GPT-2 tokens when absent)")
    p.add_argument("--workers", type=int, default=0, help="ignored: nanoGPT loads in the training process")
    p.add_argument("--data", default=None, help="ignored (synthetic tokens)")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, local, world = dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
    device = f"cuda:{local}"
    torch.cuda.set_device(device)
    torch.manual_seed(1337 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if rank == 0 and not args.tokens.exists():
        tmp = args.tokens.with_suffix(".tmp")
        np.random.default_rng(0).integers(0, 50257, 20_000_000, dtype=np.uint16).tofile(tmp)
        tmp.rename(args.tokens)
    dist.barrier()
    data = np.memmap(args.tokens, dtype=np.uint16, mode="r")
    batch_size = args.per_gpu_batch

    def get_batch():
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model = GPT().to(device)
    optimizer = model.configure_optimizers(0.1, 3e-4, (0.9, 0.95), "cuda")
    if args.compile == "on":
        model = torch.compile(model)
    model = DDP(model, device_ids=[local])
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()
    X, Y = get_batch()
    t0, done0 = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        with ctx:
            loss = model(X, Y)
        X, Y = get_batch()  # the next batch while the GPU works, as nanoGPT does
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            lossf = loss.item()
            t, done = time.perf_counter(), step * batch_size * world
            print(f"step {step}/{args.steps}  workers {world}  global batch {batch_size * world}  loss {lossf:.4f}"
                  f"  {(done - done0) / (t - t0):.1f} samples/s", flush=True)
            t0, done0 = t, done
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
