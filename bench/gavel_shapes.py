"""Shape features of Gavel's seven job types, counted from small torch.nn definitions written here.

Run: `python bench/gavel_shapes.py` (CPU, meta tensors: nothing is computed, ~seconds). Writes
predictor/data/roofline/gavel_model_shapes.csv, the file predictor/roofline.py reads.

torchvision is not installed, so each model below is this file's own definition of the workload's architecture
as Gavel launches it (scheduler/job_table.py of stanford-futuredata/gavel, from memory of its defaults; see
predictor/data/roofline/SOURCE.md for the assumptions behind each). One training step (forward, loss, backward;
the optimizer's element-wise update counted as bytes only) is traced at two batch sizes on the meta device:
- flops: torch.utils.flop_counter.FlopCounterMode (matmul / conv / attention FLOPs, forward and backward);
- out_bytes: bytes of every tensor every ATen op of the step writes (a proxy of the memory traffic: each is
  written once and read at least once);
- ops: ATen ops dispatched per step (a proxy of the kernel launches, the host's share of a step), each LSTM
  counted as one fused call per pass as cuDNN runs it (`FUSED_RNN`; on the meta device it decomposes).
The per-sample parts (FLOPs, activation bytes) are the slope between the two batches, the per-step parts the
intercept. Parameter bytes are fp32 parameters; the update moves ~4x that (weights, gradients, momentum).
"""
from __future__ import annotations

import csv
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

OUT = Path(__file__).resolve().parents[1] / "predictor" / "data" / "roofline" / "gavel_model_shapes.csv"


# ---------------------------------------------------------------- models
FUSED_RNN = False  # count ops with each recurrent layer as one fused call (cuDNN / the fused LSTM cell on CUDA)


class _FusedLSTM(nn.Module):
    """Stand-in of nn.LSTM for the op count: one call (one matmul forward, its backward), same output shape."""

    def __init__(self, i, h, layers=1):
        super().__init__()
        self.lin = nn.Linear(i, h)

    def forward(self, x):
        return self.lin(x), None


class _FusedCell(_FusedLSTM):
    def forward(self, x, hc):
        y = self.lin(x)
        return y, y


def _lstm(i, h, layers):
    return _FusedLSTM(i, h, layers) if FUSED_RNN else nn.LSTM(i, h, layers)


def _cell(i, h):
    return _FusedCell(i, h) if FUSED_RNN else nn.LSTMCell(i, h)

class Basic(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.sc = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.sc(x))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        cout = 4 * mid
        self.body = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                                  nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                                  nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.sc = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return F.relu(self.body(x) + self.sc(x))


def resnet18_cifar():
    """kuangliu/pytorch-cifar ResNet18 (Gavel's image_classification/cifar10): 3x3 stem, no max-pool, 32x32."""
    layers, cin = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))
    return net, lambda b: (torch.empty(b, 3, 32, 32), torch.zeros(b, dtype=torch.long)), F.cross_entropy


def resnet50_imagenet():
    """torchvision's resnet50 architecture (Gavel's image_classification/imagenet), 224x224."""
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for mid, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            layers.append(Bottleneck(cin, mid, stride if i == 0 else 1))
            cin = 4 * mid
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))
    return net, lambda b: (torch.empty(b, 3, 224, 224), torch.zeros(b, dtype=torch.long)), F.cross_entropy


class Seq2Seq(nn.Module):
    """attention-is-all-you-need-pytorch (Gavel's translation, Multi30k): d_model 512, 8 heads, d_inner 2048,
    6 + 6 layers, target embedding shared with the projection. Vocabularies and sentence length assumed."""

    SRC_V, TGT_V, LEN = 9_000, 7_000, 30

    def __init__(self):
        super().__init__()
        self.src, self.tgt = nn.Embedding(self.SRC_V, 512), nn.Embedding(self.TGT_V, 512)
        self.t = nn.Transformer(512, 8, 6, 6, 2048, dropout=0.1, batch_first=True)
        self.proj = nn.Linear(512, self.TGT_V, bias=False)
        self.proj.weight = self.tgt.weight

    def forward(self, x):
        s, t = x
        return self.proj(self.t(self.src(s), self.tgt(t)))


def transformer():
    L, V = Seq2Seq.LEN, Seq2Seq.TGT_V
    return Seq2Seq(), (lambda b: ((torch.zeros(b, L, dtype=torch.long), torch.zeros(b, L, dtype=torch.long)),
                                  torch.zeros(b * L, dtype=torch.long))), \
        (lambda y, t: F.cross_entropy(y.reshape(-1, V), t))


class WordLM(nn.Module):
    """pytorch/examples word_language_model defaults (Gavel's language_modeling, WikiText-2): 2-layer LSTM,
    200 embedding / hidden units, 33,278-word vocabulary, 35-token BPTT window (one sample = one window)."""

    V, BPTT = 33_278, 35

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.dec = nn.Embedding(self.V, 200), _lstm(200, 200, 2), nn.Linear(200, self.V)

    def forward(self, x):
        return self.dec(self.rnn(self.emb(x))[0])


def lm():
    V, T = WordLM.V, WordLM.BPTT
    return WordLM(), (lambda b: (torch.zeros(T, b, dtype=torch.long), torch.zeros(T * b, dtype=torch.long))), \
        (lambda y, t: F.cross_entropy(y.reshape(-1, V), t))


class MultVAE(nn.Module):
    """Mult-VAE for collaborative filtering on ML-20M (Liang et al., WWW '18; Gavel's recommendation):
    20,108 items -> 600 -> 200 (mean and log-variance) -> 600 -> 20,108, tanh."""

    ITEMS = 20_108

    def __init__(self):
        super().__init__()
        self.e1, self.e2 = nn.Linear(self.ITEMS, 600), nn.Linear(600, 400)
        self.d1, self.d2 = nn.Linear(200, 600), nn.Linear(600, self.ITEMS)

    def forward(self, x):
        h = self.e2(torch.tanh(self.e1(F.dropout(F.normalize(x), 0.5))))
        mu, logvar = h[:, :200], h[:, 200:]
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.d2(torch.tanh(self.d1(z))), mu, logvar


def recommendation():
    def loss(out, x):
        y, mu, logvar = out
        return -(F.log_softmax(y, 1) * x).sum(1).mean() - 0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(1).mean()
    I = MultVAE.ITEMS
    return MultVAE(), (lambda b: (torch.empty(b, I), torch.empty(b, I))), loss


class A3CNet(nn.Module):
    """ikostrikov/pytorch-a3c (Gavel's rl, Pong): four 32-channel 3x3 stride-2 convolutions on a 1x42x42 frame,
    LSTMCell(288, 256), actor (6 actions) and critic heads; one sample = one 20-step rollout, stepped frame by
    frame as the workload does (batch = the workers' frames in parallel)."""

    STEPS = 20

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(1 if i == 0 else 32, 32, 3, 2, 1) for i in range(4)])
        self.lstm, self.actor, self.critic = _cell(288, 256), nn.Linear(256, 6), nn.Linear(256, 1)

    def forward(self, x):
        b = x.shape[0]
        h = c = x.new_zeros(b, 256)
        outs = []
        for t in range(self.STEPS):
            y = x[:, t]
            for conv in self.convs:
                y = F.elu(conv(y))
            h, c = self.lstm(y.reshape(b, -1), (h, c))
            outs.append(self.actor(h).log_softmax(1).sum() + self.critic(h).sum())
        return torch.stack(outs)


def a3c():
    return A3CNet(), (lambda b: (torch.empty(b, A3CNet.STEPS, 1, 42, 42), None)), (lambda y, t: y.sum())


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c), nn.ReLU(True),
                                  nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c))

    def forward(self, x):
        return x + self.body(x)


def generator():
    """junyanz/pytorch-CycleGAN-and-pix2pix ResnetGenerator, ngf 64, 9 blocks, instance norm."""
    L = [nn.ReflectionPad2d(3), nn.Conv2d(3, 64, 7), nn.InstanceNorm2d(64), nn.ReLU(True)]
    for c in (64, 128):
        L += [nn.Conv2d(c, 2 * c, 3, 2, 1), nn.InstanceNorm2d(2 * c), nn.ReLU(True)]
    L += [ResBlock(256) for _ in range(9)]
    for c in (256, 128):
        L += [nn.ConvTranspose2d(c, c // 2, 3, 2, 1, output_padding=1), nn.InstanceNorm2d(c // 2), nn.ReLU(True)]
    L += [nn.ReflectionPad2d(3), nn.Conv2d(64, 3, 7), nn.Tanh()]
    return nn.Sequential(*L)


def discriminator():
    """The same repository's 70x70 PatchGAN (NLayerDiscriminator, ndf 64, 3 layers)."""
    L, c = [nn.Conv2d(3, 64, 4, 2, 1), nn.LeakyReLU(0.2, True)], 64
    for i, s in enumerate((2, 2, 1)):
        L += [nn.Conv2d(c, min(c * 2, 512), 4, s, 1), nn.InstanceNorm2d(min(c * 2, 512)), nn.LeakyReLU(0.2, True)]
        c = min(c * 2, 512)
    L += [nn.Conv2d(c, 1, 4, 1, 1)]
    return nn.Sequential(*L)


class CycleGANStep(nn.Module):
    """One CycleGAN iteration (monet2photo, 256x256): G and D losses as the repository computes them."""

    def __init__(self):
        super().__init__()
        self.GA, self.GB, self.DA, self.DB = generator(), generator(), discriminator(), discriminator()

    def forward(self, x):
        a, b = x[:, 0], x[:, 1]
        fb, fa = self.GA(a), self.GB(b)
        rec = (self.GB(fb) - a).abs().mean() + (self.GA(fa) - b).abs().mean()
        idt = (self.GA(b) - b).abs().mean() + (self.GB(a) - a).abs().mean()
        g = self.DA(fb).pow(2).mean() + self.DB(fa).pow(2).mean() + 10 * rec + 5 * idt
        d = sum(D(r).pow(2).mean() + D(f.detach()).pow(2).mean() for D, r, f in ((self.DA, b, fb), (self.DB, a, fa)))
        return g + d


def cyclegan():
    return CycleGANStep(), (lambda b: (torch.empty(b, 2, 3, 256, 256), None)), (lambda y, t: y)


MODELS = {"ResNet-18": resnet18_cifar, "ResNet-50": resnet50_imagenet, "Transformer": transformer, "LM": lm,
          "Recommendation": recommendation, "A3C": a3c, "CycleGAN": cyclegan}


# ---------------------------------------------------------------- counting
class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.bytes += t.numel() * t.element_size()
        return out


def step_counts(name: str, b: int) -> tuple[float, int, int]:
    """FLOPs, bytes written and ATen ops of one training step of `name` at batch b (meta device)."""
    with torch.device("meta"):
        net, data, loss_fn = MODELS[name]()
        x, t = data(b)
    net.train()
    flops, count = FlopCounterMode(display=False), _Count()
    with flops, count:
        loss_fn(net(x), t).backward()
    return float(flops.get_total_flops()), count.bytes, count.ops


def shape(name: str, b1: int = 4, b2: int = 8) -> dict:
    """FLOPs and bytes of the model as defined (an LSTM's per-time-step matmuls included); ops with each
    recurrent layer as one fused call, as cuDNN (nn.LSTM) and the fused cell kernel (nn.LSTMCell) run it on a
    GPU: on the meta device they decompose into per-time-step ATen ops a GPU step does not launch from the host."""
    global FUSED_RNN
    f1, m1, _ = step_counts(name, b1)
    f2, m2, _ = step_counts(name, b2)
    FUSED_RNN = True
    try:
        o1 = step_counts(name, b1)[2]
    finally:
        FUSED_RNN = False
    with torch.device("meta"):
        net = MODELS[name]()[0]
    params = list(net.parameters())
    return {"model": name, "n_params": sum(p.numel() for p in params), "n_tensors": len(params),
            "param_bytes": 4 * sum(p.numel() for p in params),
            "train_flops_per_sample": (f2 - f1) / (b2 - b1),
            "act_bytes_per_sample": (m2 - m1) / (b2 - b1),
            "step_bytes_fixed": max(m1 - (m2 - m1) / (b2 - b1) * b1, 0.0), "ops_per_step": o1}


def main() -> int:
    rows = [shape(n) for n in MODELS]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
