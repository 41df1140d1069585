"""The examples' data when none is given: a small generated ImageFolder (ImageNet-like JPEGs), made once by rank 0
and cached, the same set the built-in demo study uses."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist


def image_folder(images: int = 320, classes: int = 4) -> str:
    root = Path(os.environ.get("AUTOTUNE_CACHE") or Path.home() / ".cache" / "ddp-autotune") / "data" / \
        f"examples-{images}x{classes}"
    if dist.get_rank() == 0:
        from trainer.datagen import make_image_folder

        make_image_folder(root, images=images, classes=classes, progress=False)
    dist.barrier()  # the other ranks read what rank 0 wrote
    return str(root / "train")
