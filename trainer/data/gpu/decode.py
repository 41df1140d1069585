"""Decode JPEG byte tensors to 3xHxW uint8 RGB on the device: nvJPEG's CUDA decoder through torchvision
(``decode_batch``: ``nvjpeg-gpu`` and ``hybrid``; libjpeg-turbo on a CPU device)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def decode_batch(blobs: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Decode JPEG byte tensors to 3xHxW uint8 RGB on ``device`` (nvJPEG batch decode on CUDA).

    Grayscale and CMYK JPEGs come out as RGB too. If the batch decode fails (a file nvJPEG cannot read, or a PNG
    named .jpg, as ImageNet has), that batch is decoded image by image, falling back to the CPU decoders."""
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    device = torch.device(device)
    try:
        return decode_jpeg(list(blobs), mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    out = []
    for blob in blobs:
        try:
            img = decode_jpeg(blob, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            img = decode_image(blob, mode=ImageReadMode.RGB).to(device)
        out.append(img)
    return out
