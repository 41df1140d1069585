"""Datasets and input pipelines.

Every pipeline yields ``(images, labels)`` already on the device, images float32 normalized (channels_last when the
config asks), labels int64 — so the loop never knows which path produced them:

- ``synthetic``: one random batch made on the device and replayed: the compute ceiling, no input cost at all.
- ``pil``: the classic — PIL decode, transforms on PIL images, ToTensor + Normalize in the loader workers (float32
  crosses the worker queue and the PCIe bus).
- ``torchvision-cpu``: ``torchvision.io.decode_jpeg`` (libjpeg-turbo) and transforms.v2 on uint8 tensors in the
  workers; uint8 crosses the queue and the bus (4x fewer bytes) and normalization runs on the device.
- ``nvjpeg-gpu``: workers only read bytes; the GPU decodes and augments (``trainer/gpu_decode.py``).
- ``nvjpeg-hw``: as ``nvjpeg-gpu``, decoded by the GPU's hardware JPEG engines through nvImageCodec (``gpu_decode.py``).
- ``hybrid``: a fixed share of every batch as ``torchvision-cpu``, the rest as ``nvjpeg-gpu`` (``gpu_decode.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer.config import ConfigError, TrainConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPEG", ".JPG")
GPU_DECODE_PATHS = ("nvjpeg-gpu", "nvjpeg-hw", "hybrid")
"""``data.decode`` values whose training pipeline decodes on the device (``gpu_decode.py``)."""


# ---- file lists ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Split:
    samples: list[tuple[str, int]]
    """(path, class index) in ImageFolder order."""

    classes: list[str]


def list_samples(root: str | Path) -> tuple[list[tuple[str, int]], list[str]]:
    """Files and labels exactly as ``torchvision.datasets.ImageFolder(root)`` lists them."""
    from torchvision.datasets.folder import find_classes, make_dataset

    root = Path(root)
    if not root.is_dir():
        raise ConfigError([f"data folder {root} does not exist (make one with `autotune make-data {root}`)"])
    try:
        classes, class_to_idx = find_classes(str(root))
        samples = make_dataset(str(root), class_to_idx, extensions=tuple(e.lower() for e in IMG_EXTENSIONS))
    except FileNotFoundError as e:
        raise ConfigError([f"data folder {root}: {e}"]) from None
    return samples, classes


def resolve_splits(cfg: TrainConfig) -> tuple[Split, Split | None]:
    """The training and validation file lists: ``path/train`` + ``path/val`` when present, else ``path`` with
    ``val_fraction`` of each class held out (deterministically, by seed)."""
    d = cfg.data
    root = Path(d.path)
    train_root = root / "train" if (root / "train").is_dir() else root
    samples, classes = list_samples(train_root)
    if not samples:
        raise ConfigError([f"data folder {train_root} holds no images ({', '.join(IMG_EXTENSIONS)})"])
    val_root = Path(d.val_path) if d.val_path else (root / "val" if (root / "val").is_dir() else None)
    if val_root is not None:
        val_samples, val_classes = list_samples(val_root)
        if val_classes != classes:
            raise ConfigError([f"validation folder {val_root} has other classes than {train_root}"])
        return Split(samples=samples, classes=classes), Split(samples=val_samples, classes=classes)
    if d.val_fraction > 0:
        rng = random.Random(cfg.training.seed)
        by_class: dict[int, list[tuple[str, int]]] = {}
        for s in samples:
            by_class.setdefault(s[1], []).append(s)
        train, val = [], []
        for items in by_class.values():
            rng.shuffle(items)
            k = max(1, int(len(items) * d.val_fraction))
            val += items[:k]
            train += items[k:]
        return Split(samples=sorted(train), classes=classes), Split(samples=sorted(val), classes=classes)
    return Split(samples=samples, classes=classes), None


def num_classes(cfg: TrainConfig) -> int:
    if cfg.data.num_classes is not None:
        return cfg.data.num_classes
    if cfg.data.kind == "synthetic":
        return 1000
    return len(resolve_splits(cfg)[0].classes)


# ---- CPU decode datasets -------------------------------------------------------------------------------------------


class ImageFileDataset(Dataset):
    """(transformed image, label) per file; subclasses say how a file becomes an image."""

    def __init__(self, samples, transform):
        self.samples, self.transform = samples, transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        return self.transform(self.load(path)), label

    def load(self, path: str):
        raise NotImplementedError


class PILDataset(ImageFileDataset):
    """The classic ImageFolder path: PIL decode, transforms on PIL images, float32 normalized in the worker."""

    def load(self, path):
        from PIL import Image

        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")


class TensorJPEGDataset(ImageFileDataset):
    """libjpeg-turbo decode to uint8 tensors and uint8 transforms; normalization is left to the device."""

    def load(self, path):
        from torchvision.io import ImageReadMode, decode_image, read_file

        return decode_image(read_file(path), mode=ImageReadMode.RGB)


def cpu_transforms(cfg: TrainConfig, *, train: bool, decode: str):
    from torchvision.transforms import v2

    d = cfg.data
    if train:
        geometric = [v2.RandomResizedCrop(d.image_size, scale=d.crop_scale, ratio=d.crop_ratio, antialias=True)]
        if d.hflip:
            geometric.append(v2.RandomHorizontalFlip())
    else:
        geometric = [v2.Resize(int(round(d.image_size / 0.875)), antialias=True), v2.CenterCrop(d.image_size)]
    if decode == "pil":
        return v2.Compose([*geometric, v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True),
                           v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    return v2.Compose(geometric)  # uint8 out: normalized on the device by DeviceNormalize


# ---- pipelines ------------------------------------------------------------------------------------------------------


class StreamingSampler(DistributedSampler):
    """DistributedSampler that runs on into the next epoch instead of stopping, for measure and loader runs.

    An epoch boundary drains the loader's prefetch queue and waits for every worker's first batch of the next epoch.
    On ImageNet (1.28 M images) that happens every two minutes at 10k imgs/s and costs nothing measurable; on a
    benchmark set of 32k images it happens every 3 s — as often as a measurement window — and measures the set's
    size, not the pipeline. One endless stream of epochs (each shuffled as DistributedSampler would) measures the
    steady state a long training run sees. Train runs keep real epochs.
    """

    def __iter__(self):
        epoch = self.epoch
        while True:
            self.epoch = epoch
            yield from super().__iter__()
            epoch += 1


def train_sampler(dataset, cfg: TrainConfig, *, rank: int, world_size: int) -> DistributedSampler:
    cls = DistributedSampler if cfg.training.mode == "train" else StreamingSampler
    # drop_last keeps every rank on the same number of steps.
    return cls(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.training.seed, drop_last=True)


class DeviceNormalize:
    """uint8 NCHW -> float32 normalized on the device; fused into one pass by working in place."""

    def __init__(self, device: torch.device, channels_last: bool):
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
        self.inv_std = 1.0 / (torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype == torch.uint8:
            images = images.to(dtype=torch.float32, memory_format=self.memory_format).sub_(self.mean)
            return images.mul_(self.inv_std)
        return images.contiguous(memory_format=self.memory_format)


class LoaderPipeline:
    """A DataLoader over a CPU-decode dataset, moved to the device with non-blocking copies."""

    def __init__(self, cfg: TrainConfig, split: Split, *, train: bool, rank: int, world_size: int,
                 device: torch.device):
        decode = cfg.data.decode
        transform = cpu_transforms(cfg, train=train, decode=decode)
        dataset = (PILDataset if decode == "pil" else TensorJPEGDataset)(split.samples, transform)
        batch = cfg.training.batch_size
        if train and len(dataset) < batch * world_size:
            raise ConfigError([f"{len(dataset)} training images cannot fill one batch of {batch} on each of "
                               f"{world_size} ranks: lower training.batch_size or add images"])
        # Validation shards are disjoint and unpadded (rank::world), so no image is counted twice.
        self.sampler = (train_sampler(dataset, cfg, rank=rank, world_size=world_size) if train
                        else range(rank, len(dataset), world_size))
        self.seed = cfg.training.seed
        ld = cfg.loader
        self.loader = DataLoader(
            dataset, batch_size=batch, sampler=self.sampler, num_workers=ld.num_workers,
            prefetch_factor=ld.prefetch_factor if ld.num_workers > 0 else None,
            pin_memory=ld.pin_memory and device.type == "cuda", persistent_workers=ld.persistent_workers,
            drop_last=train, worker_init_fn=_seed_worker, generator=torch.Generator().manual_seed(cfg.training.seed))
        self.device = device
        self.normalize = DeviceNormalize(device, cfg.training.channels_last)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)
        # Worker augmentation seeds are drawn from this generator when an epoch's iterator starts.
        self.loader.generator.manual_seed(self.seed * 100_003 + epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.loader:
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            yield self.normalize(images), labels

    def close(self) -> None:
        # Persistent workers otherwise outlive the run until interpreter exit.
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


class SyntheticPipeline:
    """One fixed random batch, made on the device: measures the model, DDP and the GPU, nothing else."""

    def __init__(self, cfg: TrainConfig, *, device: torch.device, classes: int, steps_per_epoch: int = 1000):
        g = torch.Generator(device="cpu").manual_seed(cfg.training.seed)
        b, s = cfg.training.batch_size, cfg.data.image_size
        fmt = torch.channels_last if cfg.training.channels_last else torch.contiguous_format
        self.images = torch.randn(b, 3, s, s, generator=g).to(device, memory_format=fmt)
        self.labels = torch.randint(0, classes, (b,), generator=g).to(device)
        self.steps = steps_per_epoch

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        while True:  # a train epoch is `len()` steps; measure runs take what they need
            yield self.images, self.labels

    def close(self) -> None:
        pass


def build_pipeline(cfg: TrainConfig, *, rank: int, world_size: int, device: torch.device, split: str = "train"):
    """The pipeline for ``split`` ("train" or "val"); ``None`` for "val" when there is no validation data."""
    if cfg.data.kind == "synthetic":
        if split == "val":
            return None
        return SyntheticPipeline(cfg, device=device, classes=num_classes(cfg))
    train_split, val_split = resolve_splits(cfg)
    chosen = train_split if split == "train" else val_split
    if chosen is None:
        return None
    if cfg.data.decode in GPU_DECODE_PATHS and split == "train":
        from trainer.gpu_decode import GpuDecodePipeline, HybridDecodePipeline

        cls = HybridDecodePipeline if cfg.data.decode == "hybrid" else GpuDecodePipeline
        return cls(cfg, chosen.samples, rank=rank, world_size=world_size, device=device)
    if split == "val" and cfg.data.decode in GPU_DECODE_PATHS:
        # Validation is a small fraction of the run: the CPU tensor path is accurate and simple.
        cfg = cfg.with_overrides({"data.decode": "torchvision-cpu"})
    return LoaderPipeline(cfg, chosen, train=split == "train", rank=rank, world_size=world_size, device=device)


def _seed_worker(worker_id: int) -> None:
    # transforms.v2 draws from torch's RNG, which DataLoader already seeds per worker; python's `random` is not.
    random.seed(torch.initial_seed() % 2**32)
