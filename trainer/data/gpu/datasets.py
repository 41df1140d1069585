"""The worker side of the GPU-decode paths: loader workers read file bytes (``nvjpeg-gpu``) or, for
``hybrid``, decode a fixed share of every batch and read the rest as bytes.

- Workers return one batch as ONE uint8 tensor of concatenated file bytes + lengths + labels: every tensor that
  crosses the worker queue costs a shared-memory handle, and one small tensor per image costs the loader much of its
  throughput (docs/benchmarks.md).
- ``hybrid`` moves a fixed share of every batch back to the workers (decoded and augmented there as in the
  ``torchvision-cpu`` path), so spare CPU cores take work off the GPU and the pipeline's thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset, default_collate

from trainer.data.cpu import TensorJPEGDataset

# ---- bytes only ------------------------------------------------------------------------------------------------------


class JpegBytesDataset(Dataset):
    """``(file bytes, label)`` for each ``(path, label)`` sample, in the order given (ImageFolder's)."""

    def __init__(self, samples: Sequence[tuple[str, int]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        """Nothing to reseed: the bytes are augmented on the device, from the pipeline's own generator."""

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        path, label = self.samples[i]
        with open(path, "rb") as f:
            return f.read(), label


def pack_bytes(blobs: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate byte strings into one uint8 tensor; returns it and the int64 lengths."""
    lengths = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    buf = torch.empty(int(lengths.sum()), dtype=torch.uint8)
    view, pos = buf.numpy(), 0
    for b in blobs:
        view[pos:pos + len(b)] = memoryview(b)
        pos += len(b)
    return buf, lengths


def unpack_bytes(buf: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """The per-file views of a packed buffer (no copies)."""
    return list(torch.split(buf, lengths.tolist()))


def collate_bytes(batch: Sequence[tuple[bytes, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DataLoader ``collate_fn``: ``(packed bytes, lengths, labels)`` — three tensors per batch, whatever its size."""
    buf, lengths = pack_bytes([b for b, _ in batch])
    return buf, lengths, torch.tensor([label for _, label in batch], dtype=torch.int64)


# ---- hybrid: part decoded here, part as bytes ------------------------------------------------------------------------


def cpu_share(batch_size: int, fraction: float) -> int:
    """How many images of a batch the ``hybrid`` path decodes in the loader workers: ``fraction`` of the batch,
    rounded half up, so every batch splits the same way."""
    return min(batch_size, max(0, math.floor(fraction * batch_size + 0.5)))


class HybridDataset(Dataset):
    """The ``hybrid`` path's worker side. Fetched a batch at a time (the DataLoader calls ``__getitems__`` with the
    batch's indices): the first ``cpu_share`` positions are decoded and augmented here exactly as the
    ``torchvision-cpu`` path does it (``TensorJPEGDataset``: libjpeg-turbo, transforms.v2 on uint8), the rest are
    read as bytes for the GPU. Positions, not file indices, decide, so the split is exact in every batch and
    deterministic in the sampler's order (which is already a shuffle)."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform, cpu_fraction: float, seed: int | None = None):
        self.samples, self.cpu_fraction = samples, cpu_fraction
        self.decoded = TensorJPEGDataset(samples, transform, seed=seed)
        self.raw = JpegBytesDataset(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        return self.raw[i]

    def set_epoch(self, epoch: int) -> None:
        self.decoded.set_epoch(epoch)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor | bytes, int]]:
        k = cpu_share(len(indices), self.cpu_fraction)
        return [self.decoded[i] if p < k else self.raw[i] for p, i in enumerate(indices)]


class HybridCollate:
    """``collate_fn`` of the hybrid path: ``(CPU share as ONE uint8 k x 3 x S x S tensor, packed bytes of the GPU
    share, their lengths, labels)`` — labels in output order, CPU share first. One tensor for all decoded images:
    each tensor crossing the worker queue costs a shared-memory handle (``default_collate`` stacks straight into
    shared memory in a worker)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, batch: Sequence[tuple[torch.Tensor | bytes, int]]):
        cpu = [(x, y) for x, y in batch if isinstance(x, torch.Tensor)]
        raw = [(x, y) for x, y in batch if not isinstance(x, torch.Tensor)]
        images = (default_collate([x for x, _ in cpu]) if cpu
                  else torch.empty((0, 3, self.size, self.size), dtype=torch.uint8))
        buf, lengths = pack_bytes([x for x, _ in raw])
        return images, buf, lengths, torch.tensor([y for _, y in cpu + raw], dtype=torch.int64)
