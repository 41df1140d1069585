"""The decode step on CPU: ``decode_batch``'s fallbacks for odd files."""

from __future__ import annotations

import io

import torch
from PIL import Image

from trainer.data.gpu.decode import decode_batch


def test_decode_batch_gray_cmyk_and_png_as_rgb():
    rgb = Image.new("RGB", (40, 30), (200, 30, 10))
    blobs = []
    for mode, fmt in (("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "JPEG"), ("RGB", "PNG")):
        b = io.BytesIO()
        rgb.convert(mode).save(b, fmt)
        blobs.append(torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8))
    out = decode_batch(blobs, "cpu")
    assert [tuple(t.shape) for t in out] == [(3, 30, 40)] * 4
    assert all(t.dtype == torch.uint8 for t in out)
    assert (out[2][:, 15, 20].int() - torch.tensor([200, 30, 10])).abs().max() < 8  # colours survive
