"""What the GPU benches share: the models, the worker helpers, the controller that spawns worker processes.

Workers are separate interpreters: ``bench/gpu_transition.py --role ROLE ...`` (one process per GPU).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from elastic_launcher.calibrate import sync  # noqa: E402 F401 - the benches' and the calibration job's one sync
SCRIPT = os.path.join(ROOT, "bench", "gpu_transition.py")
STORE_TIMEOUT = timedelta(seconds=100)


# ---------------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------------
DEFAULT_BATCH = {"resnet18": 64, "resnet50": 64, "vit_b_16": 32, "gpt2": 8, "bert": 16, "mlp": 32, "tiny": 16}
# models of the held-out collections (issue 25): never used while the throughput model was developed
FRESH_BATCH = {"resnet101": 48, "regnet_y_1_6gf": 48, "shufflenet_v2_x1_0": 96, "swin_t": 24, "opt125m": 6,
               "t5_small": 12}
# the second held-out set (session 13), collected after tm-2026.11.27-2 was frozen
FRESH2_BATCH = {"densenet121": 48, "mobilenet_v3_large": 96, "efficientnet_b0": 64, "convnext_tiny": 32,
                "distilbert": 12, "albert_base": 8}
# the third (session 14), collected after tm-2026.11.28-1 was frozen
FRESH3_BATCH = {"resnext50_32x4d": 48, "wide_resnet50_2": 32, "mobilenet_v2": 96, "vit_b_32": 64, "bart_base": 8,
                "electra_small": 16}
# the fourth (session 16), collected after tm-2026.11.28-2 was frozen
FRESH4_BATCH = {"resnet152": 32, "vgg16_bn": 32, "squeezenet1_1": 128, "maxvit_t": 16, "gpt_neo_125m": 6,
                "xlm_roberta_base": 4}
DEFAULT_BATCH.update(FRESH_BATCH)
DEFAULT_BATCH.update(FRESH2_BATCH)
DEFAULT_BATCH.update(FRESH3_BATCH)
DEFAULT_BATCH.update(FRESH4_BATCH)
MODELS = tuple(DEFAULT_BATCH)
CNNS = ("resnet18", "resnet50", "resnet101", "regnet_y_1_6gf", "shufflenet_v2_x1_0", "densenet121",
        "mobilenet_v3_large", "efficientnet_b0", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v2", "resnet152",
        "vgg16_bn", "squeezenet1_1")  # channels_last, SGD
VISION = CNNS + ("vit_b_16", "swin_t", "convnext_tiny", "vit_b_32", "maxvit_t")  # the others: AdamW


def build(name: str, device: torch.device, batch: int | None = None):
    """Returns (model, optimizer, per_gpu_batch, make_batch(n), loss_fn(model, batch)), bf16 autocast on CUDA.

    `batch`: the per-GPU batch (default DEFAULT_BATCH[name]); `make_batch(n)` slices n <= batch samples of it.
    """
    if name not in DEFAULT_BATCH:
        raise ValueError(f"unknown bench model {name!r}; known: {', '.join(MODELS)}")
    b = batch or DEFAULT_BATCH[name]
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    if name in VISION:
        import torchvision
        model = getattr(torchvision.models, name)().to(device)
        x = torch.randn(b, 3, 224, 224, device=device)
        if name in CNNS:
            model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        y = torch.randint(0, 1000, (b,), device=device)
        ce = torch.nn.CrossEntropyLoss()

        def loss_fn(m, batch):
            with torch.autocast(**amp):
                return ce(m(batch[0]), batch[1])
    elif name in ("gpt2", "bert", "opt125m", "t5_small", "distilbert", "albert_base", "bart_base", "electra_small",
                  "gpt_neo_125m", "xlm_roberta_base"):
        import transformers
        if name == "gpt2":
            model, seq, vocab = transformers.GPT2LMHeadModel(transformers.GPT2Config()).to(device), 1024, 50257
        elif name == "bert":
            model, seq, vocab = transformers.BertForMaskedLM(transformers.BertConfig()).to(device), 512, 30522
        elif name == "opt125m":  # OPTConfig's defaults are OPT-125m's shape (12 layers, 768 wide)
            model, seq, vocab = transformers.OPTForCausalLM(transformers.OPTConfig()).to(device), 512, 50272
        elif name == "distilbert":  # DistilBertConfig's defaults are distilbert-base's shape (6 layers, 768 wide)
            model, seq, vocab = transformers.DistilBertForMaskedLM(transformers.DistilBertConfig()).to(device), 512, 30522
        elif name == "albert_base":  # albert-base-v2's shape (AlbertConfig's defaults are xxlarge): 12 shared layers
            cfg = transformers.AlbertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072)
            model, seq, vocab = transformers.AlbertForMaskedLM(cfg).to(device), 512, 30000
        elif name == "bart_base":  # bart-base's shape (BartConfig's defaults are bart-large): 6+6 layers, 768 wide
            cfg = transformers.BartConfig(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                                          decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)
            model, seq, vocab = transformers.BartForConditionalGeneration(cfg).to(device), 512, 50265
        elif name == "gpt_neo_125m":  # gpt-neo-125M's shape (GPTNeoConfig's defaults are 1.3B's): 12 layers, 768
            cfg = transformers.GPTNeoConfig(hidden_size=768, num_layers=12, num_heads=12,  # wide, global/local (256)
                                            attention_types=[[["global", "local"], 6]])
            model, seq, vocab = transformers.GPTNeoForCausalLM(cfg).to(device), 1024, 50257
        elif name == "xlm_roberta_base":  # XLMRobertaConfig's defaults are BERT-base's body; xlm-roberta-base's
            cfg = transformers.XLMRobertaConfig(vocab_size=250002, max_position_embeddings=514,  # 250k vocabulary
                                                type_vocab_size=1, pad_token_id=1)
            model, seq, vocab = transformers.XLMRobertaForMaskedLM(cfg).to(device), 512, 250002
        elif name == "electra_small":  # ElectraConfig's defaults are ELECTRA-small's (12 layers, 256 wide)
            model, seq, vocab = transformers.ElectraForMaskedLM(transformers.ElectraConfig()).to(device), 512, 30522
        else:  # T5Config's defaults are t5-small's shape; labels of the same length feed the decoder
            model, seq, vocab = transformers.T5ForConditionalGeneration(
                transformers.T5Config(decoder_start_token_id=0, pad_token_id=0)).to(device), 256, 32128
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, vocab, (b, seq), device=device)
        y = x

        def loss_fn(m, batch):
            with torch.autocast(**amp):
                return m(input_ids=batch[0], labels=batch[1]).loss
    else:  # mlp: the CPU row (a step of tens of ms on one thread, a 21 MB gradient); tiny: CPU debugging
        widths = [512, 2048, 2048, 10] if name == "mlp" else [64, 256, 10]
        layers: list = []
        for w_in, w_out in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(w_in, w_out), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers[:-1]).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(b, widths[0], device=device)
        y = torch.randint(0, widths[-1], (b,), device=device)
        ce = torch.nn.CrossEntropyLoss()

        def loss_fn(m, batch):
            return ce(m(batch[0]), batch[1])

    def make_batch(n: int):
        return x[:n], y[:n]
    return model, opt, b, make_batch, loss_fn


def local_warmup(model, opt, make_batch, loss_fn, b: int, device) -> None:
    """Compute warm-up of a newcomer (kernels, cuDNN/cuBLAS handles) without touching weights or optimizer."""
    for _ in range(2):
        loss_fn(model, make_batch(b)).backward()
    model.zero_grad(set_to_none=True)
    sync(device)


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class LoadedItems(torch.utils.data.Dataset):
    """A sample of ``make_batch``'s on the CPU, built in ``item_ms`` of CPU time (a JPEG decode and resize is
    3-6 ms): what a DataLoader worker hands over for an image or token dataset."""

    def __init__(self, make_batch, item_ms: float, n: int = 1_000_000) -> None:
        self.sample = tuple(t[0].detach().cpu().contiguous() for t in make_batch(1))
        self.item_ms, self.n = item_ms, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        end = time.thread_time() + self.item_ms / 1000
        while time.thread_time() < end:
            pass
        return tuple(t.clone() for t in self.sample)


def to_device(batch, device: torch.device):
    """A collated CPU batch on ``device`` (images channels-last, as ``build`` makes them)."""
    out = []
    for t in batch:
        t = t.to(device, non_blocking=True)
        out.append(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t)
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# workers (separate interpreters)
# ---------------------------------------------------------------------------------------------------------------
def client(args, prefix: str = "") -> dist.Store:
    s = dist.TCPStore(args.host, args.port, is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore(prefix, s) if prefix else s


def pin_cpus(slot: int, slots: int) -> None:
    """Binds this process (and the threads it starts later) to its own share of the CPUs, as Slurm's task
    affinity binds a job's tasks: slot ``slot`` of ``slots`` equal, disjoint shares. Plain DDP and ours get the
    same binding; it takes the OS's migrations out of the host-bound steps' jitter."""
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // max(slots, 1)
    if per >= 1:
        os.sched_setaffinity(0, cpus[slot * per:(slot + 1) * per])


def device_of(args) -> torch.device:
    if args.device == "cuda":
        pin_cpus(args.gpu, torch.cuda.device_count())
        torch.cuda.set_device(args.gpu)
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = True
        return torch.device("cuda", args.gpu)
    torch.set_num_threads(1)
    return torch.device("cpu")

# ---------------------------------------------------------------------------------------------------------------
# controller
# ---------------------------------------------------------------------------------------------------------------
class Controller:
    def __init__(self, args) -> None:
        self.args = args
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
        self.port = self.server.port
        self.bench = dist.PrefixStore("bench", self.server)
        self.procs: list[subprocess.Popen] = []

    def spawn(self, role: str, wid: str, gpu: int, newcomer: bool = False, epoch: int = 0,
              ckpt: str = "", ckpt_out: str = "", extra: tuple = ()) -> subprocess.Popen:
        a = self.args
        cmd = [sys.executable, SCRIPT, "--role", role, "--wid", wid, "--gpu", str(gpu),
               "--port", str(self.port), "--model", a.model, "--device", a.device, "--epoch", str(epoch)]
        if newcomer:
            cmd.append("--newcomer")
        if ckpt:
            cmd += ["--ckpt", ckpt]
        if ckpt_out:
            cmd += ["--ckpt-out", ckpt_out]
        cmd += list(extra)
        logdir = os.environ.get("BENCH_WORKER_LOGS")  # one log file per worker, e.g. to find who died
        out = open(os.path.join(logdir, f"{role}_{wid}.log"), "a") if logdir else None
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if out else None)
        if out is not None:
            out.close()
        self.procs.append(p)
        return p

    def wait_step(self, wid: str, step: int, timeout: float = 100) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.bench.check([f"prog/{wid}"]) and int(self.bench.get(f"prog/{wid}")) >= step:
                return
            time.sleep(0.02)
        raise TimeoutError(f"{wid} did not reach step {step}")

    def wait_key(self, key: str, timeout: float = 100) -> str:
        self.bench.wait([key], timedelta(seconds=timeout))
        return self.bench.get(key).decode()

    def reap(self, procs, timeout: float = 60) -> None:
        for p in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode != 0:
                raise RuntimeError(f"worker {p.args[4:6]} exited with {p.returncode}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
