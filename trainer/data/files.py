"""File lists: the images of the training and validation splits, listed exactly as
``torchvision.datasets.ImageFolder`` lists them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError, TrainConfig

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPEG", ".JPG")


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
