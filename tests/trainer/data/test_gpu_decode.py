"""The decode step on CPU: ``decode_batch``'s fallbacks for odd files, and what a CPU machine can check of
nvjpeg-hw (hardware engines, GPU only): that a missing nvImageCodec is one config error naming the extra."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from tests.trainer.data.common import HW_INSTALL
from trainer.config import ConfigError
from trainer.data.gpu.decode import decode_batch, import_nvimgcodec, make_hw_decoder


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


def test_nvimgcodec_missing_is_one_line_naming_the_extra(no_nvimgcodec):
    with pytest.raises(ConfigError) as e:
        import_nvimgcodec()
    missing = f"data.decode=nvjpeg-hw needs NVIDIA nvImageCodec, which is not installed: {HW_INSTALL}"
    assert e.value.problems == [missing]
    with pytest.raises(ConfigError, match=r"ddp-autotune\[nvjpeg-hw\]"):
        make_hw_decoder("cuda")
