"""Datasets and input pipelines.

Every pipeline yields ``(images, labels)`` already on the device, images float32 normalized (channels_last when the
config asks; DALI's float16 under ``data.dali_half_out`` in a half-precision run), labels int64 — so the loop never
knows which path produced them (``Pipeline`` is that contract):

- ``synthetic`` (``synthetic.py``): one random batch made on the device and replayed: the compute ceiling, no input
  cost at all.
- ``pil`` (``cpu.py``): the classic — PIL decode, transforms on PIL images, ToTensor + Normalize in the loader
  workers (float32 crosses the worker queue and the PCIe bus).
- ``torchvision-cpu`` (``cpu.py``): ``torchvision.io.decode_jpeg`` (libjpeg-turbo) and transforms.v2 on uint8
  tensors in the workers; uint8 crosses the queue and the bus (4x fewer bytes) and normalization runs on the device.
- ``nvjpeg-gpu`` (``gpu/``): workers only read bytes; the GPU decodes and augments.
- ``hybrid`` (``gpu/``): a fixed share of every batch as ``torchvision-cpu``, the rest as ``nvjpeg-gpu``.
- ``dali`` (``dali.py``): an NVIDIA DALI pipeline reads the files and decodes each image (its random crop alone, or
  the whole of it cropped after) on the GPU's hardware JPEG engines and CUDA; no DataLoader. Validation through it
  too, without augmentation.

``files.py`` lists the images of the training and validation splits; ``sampling.py`` decides which of them each
rank reads, in which order. The modules of this package import one another, never this one: it is the public API
(``build_pipeline``, ``num_classes``, ``prefetched_batches``, ``GPU_DECODE_PATHS``, ``Pipeline``) and imports them
all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from trainer.apply import DATALOADER_PREFETCH
from trainer.config import TrainConfig
from trainer.data.cpu import LoaderPipeline
from trainer.data.dali import DaliPipeline
from trainer.data.files import resolve_splits
from trainer.data.gpu import GpuDecodePipeline, HybridDecodePipeline
from trainer.data.synthetic import SyntheticPipeline
from trainer.knobs import knob

__all__ = ["GPU_DECODE_PATHS", "Pipeline", "build_pipeline", "num_classes", "prefetched_batches"]

GPU_DECODE_PATHS = knob("data.decode").gpu_values
"""``data.decode`` values whose training pipeline decodes on the device (``trainer.data.gpu``): the decode choices
that need a GPU (``trainer.knobs``)."""


@runtime_checkable
class Pipeline(Protocol):
    """What the training loop needs of an input pipeline; every pipeline ``build_pipeline`` returns meets it.

    A structural type, not a base class: the pipelines do not inherit from it (the modules that define them never
    import this package's ``__init__``), and ``isinstance(p, Pipeline)`` checks that the four methods exist.

    - Iterating yields ``(images, labels)`` on the device: images float32 (DALI's float16 where
      ``data.dali_half_out`` asks in an fp16 or bf16 run), normalized with the ImageNet mean and std, channels_last
      when ``training.channels_last`` asks; labels int64.
    - ``len()`` is the number of batches one epoch gives this rank. Measure and loader runs iterate on past it (their
      samplers stream epochs without end, and the synthetic pipeline repeats its batch forever): the loop takes what
      it needs.
    - ``set_epoch(epoch)`` before iterating: the epoch's shuffle and augmentation (where a pipeline has them) derive
      from the seed and ``epoch``.
    - ``close()`` joins the pipeline's loader workers and threads, so a pipeline can be closed and a new one built in
      the same process.
    """

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def close(self) -> None: ...


def num_classes(cfg: TrainConfig) -> int:
    """The model's output classes: ``data.num_classes`` when set, 1000 for synthetic data, else the training
    folder's."""
    if cfg.data.num_classes is not None:
        return cfg.data.num_classes
    if cfg.data.kind == "synthetic":
        return 1000
    return len(resolve_splits(cfg)[0].classes)


def build_pipeline(cfg: TrainConfig, *, rank: int, world_size: int, device: torch.device,
                   split: str = "train") -> Pipeline | None:
    """The pipeline for ``split`` ("train" or "val"); ``None`` for "val" when there is no validation data."""
    if cfg.data.kind == "synthetic":
        if split == "val":
            return None
        return SyntheticPipeline(cfg, device=device, classes=num_classes(cfg))
    train_split, val_split = resolve_splits(cfg)
    chosen = train_split if split == "train" else val_split
    if chosen is None:
        return None
    if cfg.data.decode == "dali":
        return DaliPipeline(cfg, chosen.samples, train=split == "train", rank=rank, world_size=world_size,
                            device=device)
    if cfg.data.decode in GPU_DECODE_PATHS and split == "train":
        cls = HybridDecodePipeline if cfg.data.decode == "hybrid" else GpuDecodePipeline
        return cls(cfg, chosen.samples, rank=rank, world_size=world_size, device=device)
    if split == "val" and cfg.data.decode in GPU_DECODE_PATHS:
        # Validation is a small fraction of the run: the CPU tensor path is accurate and simple.
        cfg = cfg.with_overrides({"data.decode": "torchvision-cpu"})
    return LoaderPipeline(cfg, chosen, train=split == "train", rank=rank, world_size=world_size, device=device)


def prefetched_batches(cfg: TrainConfig) -> int:
    """Batches ready before the first step whose work is already done: decoded by the loader workers, or decoded
    one ahead on the device. The workers of ``nvjpeg-gpu`` only read bytes: a buffer of bytes still
    has its decode ahead of it, so it does not make a step faster and is not discarded (draining a deep one would
    cost a trial seconds of its budget). DALI's queue holds batches decoded and augmented: its depth."""
    if cfg.data.kind == "synthetic":
        return 0
    if cfg.data.decode == "dali":
        return cfg.data.dali_prefetch
    if cfg.loader.num_workers == 0:
        return 0
    ahead = 1 if cfg.data.decode in GPU_DECODE_PATHS else 0
    if cfg.data.decode == "nvjpeg-gpu":
        return ahead
    return cfg.loader.num_workers * (cfg.loader.prefetch_factor or DATALOADER_PREFETCH) + ahead
