"""Datasets of the example scripts: synthetic by default, real files when a path is given.

Every dataset is map-style (`len`, `[i]`) and deterministic: item `i` is the same on every rank and after
every resize, which the elastic sampler relies on. Items are `(input, target)` pairs.
"""
from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp"}


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class SyntheticImages(torch.utils.data.Dataset):
    """Random images whose mean depends on the label (so the loss falls), generated per index."""

    def __init__(self, size: int, image_size: int, classes: int, seed: int = 0):
        self.size, self.image_size, self.classes, self.seed = size, image_size, classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        label = i % self.classes
        image = torch.randn(3, self.image_size, self.image_size, generator=_generator(self.seed, i))
        return image + (label / self.classes - 0.5), label


class DeviceSyntheticImages(SyntheticImages):
    """SyntheticImages made on the training device (#39): an item is only its index and label, so the loader's
    workers do no work, and :meth:`to_device` builds the batch there from a pool of ``pool`` random images made
    once from ``seed`` (image i = pool[i mod pool] plus the label's offset: deterministic per index, as the
    sampler needs). ``memory_format`` is the model's (channels_last for ResNets)."""

    def __init__(self, size: int, image_size: int, classes: int, seed: int = 0, pool: int = 256,
                 memory_format: torch.memory_format = torch.contiguous_format):
        super().__init__(size, image_size, classes, seed)
        self.pool_size, self.memory_format = pool, memory_format
        self._pool: dict[torch.device, torch.Tensor] = {}

    def __getitem__(self, i: int):
        return i, i % self.classes

    def to_device(self, batch, device: torch.device):
        index, labels = (t.to(device, non_blocking=True) for t in batch)
        if device not in self._pool:
            g = torch.Generator(device).manual_seed(self.seed)
            self._pool[device] = torch.randn(self.pool_size, 3, self.image_size, self.image_size, generator=g,
                                             device=device)
        images = self._pool[device].index_select(0, index % self.pool_size)
        images += (labels.to(images.dtype) / self.classes - 0.5).view(-1, 1, 1, 1)
        return images.contiguous(memory_format=self.memory_format), labels


class ImageFolder(torch.utils.data.Dataset):
    """`root/<class>/<image>` files (ImageNet layout), decoded with Pillow, resized and normalised.

    Raises:
        FileNotFoundError: no class folder with images under `root`.
    """

    def __init__(self, root: Path, image_size: int):
        self.image_size = image_size
        classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        self.items = [(f, c) for c, name in enumerate(classes) for f in sorted((Path(root) / name).iterdir())
                      if f.suffix.lower() in IMAGE_SUFFIXES]
        if not self.items:
            raise FileNotFoundError(f"{root}: no images in class folders (expected root/<class>/<image>.jpg)")
        self.classes = len(classes)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from PIL import Image  # noqa: PLC0415 - only for folder datasets

        path, label = self.items[i]
        with Image.open(path) as img:
            img = img.convert("RGB").resize((self.image_size, self.image_size))
            data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        image = data.view(self.image_size, self.image_size, 3).permute(2, 0, 1).float() / 255.0
        return (image - 0.45) / 0.225, label


class TensorFile(torch.utils.data.Dataset):
    """A `torch.save`d dict `{"inputs": Tensor[N, ...], "targets": Tensor[N, ...]}`.

    Raises:
        ValueError: keys missing or lengths differ.
    """

    def __init__(self, path: Path):
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or "inputs" not in data or "targets" not in data:
            raise ValueError(f"{path}: expected a dict with 'inputs' and 'targets' tensors")
        if len(data["inputs"]) != len(data["targets"]):
            raise ValueError(f"{path}: {len(data['inputs'])} inputs but {len(data['targets'])} targets")
        self.inputs, self.targets = data["inputs"], data["targets"]

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int):
        return self.inputs[i], self.targets[i]


class SyntheticSequences(torch.utils.data.Dataset):
    """Token sequences `start, start+k, start+2k, ... (mod vocab)`: the next token is learnable.

    With `classes`, items are `(tokens, label)` with label = the step `k` modulo `classes` (a sequence
    classification task); otherwise `(tokens[:-1], tokens[1:])` for next-token prediction.
    """

    def __init__(self, size: int, context: int, vocab: int, classes: int | None = None, seed: int = 0):
        self.size, self.context, self.vocab, self.classes, self.seed = size, context, vocab, classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = _generator(self.seed, i)
        start, step = torch.randint(0, self.vocab, (2,), generator=g).tolist()
        tokens = (start + (step + 1) * torch.arange(self.context + 1)) % self.vocab
        if self.classes is not None:
            return tokens[: self.context], (step + 1) % self.classes
        return tokens[:-1], tokens[1:]


class TextBytes(torch.utils.data.Dataset):
    """Byte-level language modelling on a text file: item i is the window starting at i * context.

    Raises:
        ValueError: the file is shorter than one window.
    """

    def __init__(self, path: Path, context: int):
        self.data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
        self.context = context
        if len(self.data) <= context:
            raise ValueError(f"{path}: {len(self.data)} bytes, need more than the context of {context}")

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i: int):
        window = self.data[i * self.context: i * self.context + self.context + 1]
        return window[:-1], window[1:]


class EncodedImageFolder(ImageFolder):
    """An ImageFolder of JPEG files decoded on the GPU (#39): the loader's workers only read each file's bytes;
    :meth:`to_device` decodes the batch with nvJPEG (``torchvision.io.decode_jpeg(device=...)``), resizes and
    normalises it there as ImageFolder does on the CPU. ``memory_format`` is the model's.

    Raises:
        FileNotFoundError: as ImageFolder.
        ValueError: a file in the folder is not a JPEG (use ImageFolder, the CPU path).
    """

    def __init__(self, root: Path, image_size: int, memory_format: torch.memory_format = torch.contiguous_format):
        super().__init__(root, image_size)
        others = [f for f, _ in self.items if f.suffix.lower() not in {".jpg", ".jpeg"}]
        if others:
            raise ValueError(f"{others[0]}: not a JPEG; GPU decode reads JPEG folders only (decode on the CPU)")
        self.memory_format = memory_format

    def __getitem__(self, i: int):
        path, label = self.items[i]
        return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), label

    @staticmethod
    def collate(items):
        """The batch's files end to end in one byte tensor, their lengths and labels: one shared-memory block
        a batch from the loader's workers, and one to pin, instead of one per image."""
        return (torch.cat([data for data, _ in items]), torch.tensor([len(data) for data, _ in items]),
                torch.tensor([label for _, label in items]))

    def to_device(self, batch, device: torch.device):
        from torchvision.io import ImageReadMode, decode_jpeg  # noqa: PLC0415 - only for GPU decode

        joined, lengths, labels = batch
        encoded = list(torch.split(joined, lengths.tolist()))   # views of the one buffer (contiguous, 1-D)
        images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        size = (self.image_size, self.image_size)
        by_shape: dict[tuple, list[int]] = {}
        for i, img in enumerate(images):
            by_shape.setdefault(tuple(img.shape), []).append(i)
        resized = [None] * len(images)
        for rows in by_shape.values():  # one resize per distinct shape (a photo folder has few)
            same = torch.nn.functional.interpolate(torch.stack([images[i] for i in rows]).float(), size=size,
                                                   mode="bilinear", antialias=True, align_corners=False)
            for j, i in enumerate(rows):
                resized[i] = same[j]
        out = torch.stack(resized) if len(by_shape) > 1 else same
        out = ((out / 255.0 - 0.45) / 0.225).contiguous(memory_format=self.memory_format)
        return out, labels.to(device, non_blocking=True)
