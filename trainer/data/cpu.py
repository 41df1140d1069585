"""The CPU-decode pipelines: loader workers decode and augment every image; the pipeline moves batches to the device.

- ``pil``: the classic — PIL decode, transforms on PIL images, ToTensor + Normalize in the loader workers (float32
  crosses the worker queue and the PCIe bus).
- ``torchvision-cpu``: ``torchvision.io.decode_jpeg`` (libjpeg-turbo) and transforms.v2 on uint8 tensors in the
  workers; uint8 crosses the queue and the bus (4x fewer bytes) and normalization runs on the device.

PIL and torchvision are imported inside the functions that use them: importing this module does not load them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

from trainer.apply import data_loader
from trainer.config import ConfigError, TrainConfig
from trainer.data.files import Split
from trainer.data.sampling import epoch_seed, train_sampler

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# ---- datasets --------------------------------------------------------------------------------------------------------


class UnreadableImage(Exception):
    """A file of the data folder that cannot be decoded; the message names it. Raised inside a loader worker, it
    reaches the job wrapped by the DataLoader and is recorded as a ``loader`` failure either way."""

    failure = "loader"


class ImageFileDataset(Dataset):
    """(transformed image, label) per file; subclasses say how a file becomes an image.

    ``seed``: the augmentation of a loader worker's images derives from (seed, epoch, worker): each worker reseeds
    its RNG at its first image of an epoch (``set_epoch``), whether it was started for the epoch or kept from the
    last one (persistent workers), so a run resumed at an epoch augments that epoch as the uninterrupted run did.
    ``None``: no reseeding (no augmentation to replay)."""

    def __init__(self, samples, transform, seed: int | None = None):
        self.samples, self.transform, self.seed = samples, transform, seed
        # Shared with the workers: the main process writes the epoch before the epoch's indices reach them.
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._seeded_for: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.samples)

    def _reseed(self) -> None:
        worker = get_worker_info()
        if self.seed is None or worker is None:  # in the main process its RNG is the run's, left alone
            return
        epoch = int(self.epoch)
        if self._seeded_for != epoch:
            self._seeded_for = epoch
            seed = epoch_seed(self.seed, epoch, worker.id)
            torch.manual_seed(seed)
            random.seed(seed)

    def __getitem__(self, i):
        self._reseed()
        path, label = self.samples[i]
        try:
            image = self.load(path)
        except (OSError, RuntimeError, ValueError) as e:  # PIL and torchvision.io say what, never which file
            raise UnreadableImage(f"cannot decode {path}: {type(e).__name__}: {e}; remove or replace the file") \
                from None
        return self.transform(image), label

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
        geometric = [v2.Resize(round(d.image_size / 0.875), antialias=True), v2.CenterCrop(d.image_size)]
    if decode == "pil":
        return v2.Compose([*geometric, v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True),
                           v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    return v2.Compose(geometric)  # uint8 out: normalized on the device by DeviceNormalize


# ---- the pipeline ----------------------------------------------------------------------------------------------------


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
        dataset = (PILDataset if decode == "pil" else TensorJPEGDataset)(
            split.samples, transform, seed=cfg.training.seed if train else None)
        self.dataset = dataset
        batch = cfg.training.batch_size
        if train and len(dataset) < batch * world_size:
            raise ConfigError([(f"{len(dataset)} training images cannot fill one batch of {batch} on each of "
                                f"{world_size} ranks: lower training.batch_size or add images")])
        # Validation shards are disjoint and unpadded (rank::world), so no image is counted twice.
        self.sampler = (train_sampler(dataset, cfg, rank=rank, world_size=world_size) if train
                        else range(rank, len(dataset), world_size))
        # The generator keeps the workers' start from drawing on the run's RNG; their augmentation is reseeded
        # from (seed, epoch, worker) by the dataset itself.
        self.loader = data_loader(
            dataset, cfg.loader, device, batch_size=batch, sampler=self.sampler, drop_last=train,
            generator=torch.Generator().manual_seed(cfg.training.seed))
        self.device = device
        self.normalize = DeviceNormalize(device, cfg.training.channels_last)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)
        self.dataset.set_epoch(epoch)

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
