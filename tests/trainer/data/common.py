"""Helpers of the input-pipeline tests: the sample list of an image folder and a pipeline test config."""

from __future__ import annotations

from torchvision.datasets.folder import find_classes, make_dataset

from trainer.config import TrainConfig


def samples_of(root):
    _, class_to_idx = find_classes(str(root))
    return make_dataset(str(root), class_to_idx, extensions=(".jpg",))


def config(**overrides) -> TrainConfig:
    # Train mode: these tests iterate whole epochs (measure runs stream epochs without end).
    base = {"data.kind": "imagefolder", "data.path": "unused", "data.image_size": 48, "training.batch_size": 8,
            "loader.num_workers": 2, "training.channels_last": True, "training.seed": 5,
            "training.mode": "train", "training.epochs": 1}
    return TrainConfig().with_overrides({**base, **overrides})
