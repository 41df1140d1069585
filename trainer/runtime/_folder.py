"""What the runtime can tell of a script's own Dataset: whether it is an image folder that the project's input
pipelines (``run.image_loader``) could read as well, and at what crop. The search then measures those pipelines on
the same files where the script's own loader is what bounds its job, and says the figure beside the script's own."""

from __future__ import annotations

import os
from typing import Any

JPEG = (".jpg", ".jpeg")
"""What every pipeline of ``trainer.data`` decodes (nvJPEG, libjpeg-turbo, DALI and PIL alike)."""

CROPS = ("RandomResizedCrop", "CenterCrop", "RandomCrop")
"""Transforms (torchvision's ``transforms`` and ``transforms.v2`` alike) whose size is what the model sees."""


def image_folder(dataset: Any) -> dict[str, Any] | None:
    """``{"path": its folder, "classes": how many, "image_size": its crop}`` of a torchvision ``ImageFolder`` (any
    ``DatasetFolder``) of JPEG files: the folder ``run.image_loader`` would take, its classes, and the crop where its
    transform says one (a square RandomResizedCrop, CenterCrop or RandomCrop, the last of them); None for any other
    dataset."""
    try:
        from torchvision.datasets import DatasetFolder
    except ImportError:
        return None
    if not isinstance(dataset, DatasetFolder) or not dataset.samples:
        return None
    if not all(str(path).lower().endswith(JPEG) for path, *_ in dataset.samples):
        return None
    # Its classes: a folder given one level too high holds one, and a loss over one class never moves.
    out: dict[str, Any] = {"path": os.path.abspath(os.fspath(dataset.root)), "classes": len(dataset.classes)}
    size = crop_size(getattr(dataset, "transform", None))
    if size is not None:
        out["image_size"] = size
    return out


def crop_size(transform: Any) -> int | None:
    """The side of the square crop a transform (or a ``Compose`` of them) makes last; None where it makes none or
    its size is not square."""
    steps = getattr(transform, "transforms", None)
    size = None
    for t in steps if isinstance(steps, (list, tuple)) else [transform]:
        if type(t).__name__ not in CROPS:
            continue
        s = getattr(t, "size", None)
        sides = [s] if isinstance(s, int) else list(s) if isinstance(s, (list, tuple)) else []
        size = int(sides[0]) if sides and all(x == sides[0] for x in sides) else None
    return size
