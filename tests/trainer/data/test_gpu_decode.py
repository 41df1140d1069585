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


class _FakeNvImgCodec:
    """What ``decode_crops_hw`` uses of nvImageCodec, decoding with libjpeg-turbo on the CPU: code streams that know
    their size from the header, regions, and a decoder that returns H x W x 3 arrays (None where it refuses)."""

    class Region:
        def __init__(self, start_y, start_x, end_y, end_x):
            self.box = (start_y, start_x, end_y, end_x)

    class CodeStream:
        def __init__(self, array, region=None):
            from torchvision.io import decode_jpeg

            if array[:2].tolist() != [0xFF, 0xD8]:
                raise RuntimeError("not a JPEG")
            self.array, self.region = array, region
            self.height, self.width = decode_jpeg(torch.from_numpy(array.copy())).shape[-2:]

        def get_sub_code_stream(self, region=None):
            return type(self)(self.array, region)

    class Decoder:
        def __init__(self, refuse=()):
            self.refuse, self.calls = set(refuse), 0

        def decode(self, streams, params=None, cuda_stream=0):
            from torchvision.io import decode_jpeg

            out = []
            for cs in streams:
                self.calls += 1
                if self.calls in self.refuse:
                    out.append(None)
                    continue
                hwc = decode_jpeg(torch.from_numpy(cs.array.copy())).permute(1, 2, 0)
                if cs.region is not None:
                    y0, x0, y1, x1 = cs.region.box
                    hwc = hwc[y0:y1, x0:x1]
                out.append(hwc.contiguous().numpy())
            return out


@pytest.mark.parametrize("refuse", [(), (2, 5)])
def test_roi_decode_gives_the_full_decodes_crops_and_falls_back_whole_per_image(folder, monkeypatch, refuse):
    from torchvision.io import read_file

    from tests.trainer.data.common import samples_of
    from trainer.data.gpu.crop import batched_resized_crop, sample_crop_boxes
    from trainer.data.gpu.decode import decode_crops_hw

    monkeypatch.setattr("trainer.data.gpu.decode.import_nvimgcodec", lambda: _FakeNvImgCodec)
    monkeypatch.setattr("trainer.data.gpu.decode.hw_decode_params", lambda nvimgcodec=None: None)
    blobs = [read_file(path) for path, _ in samples_of(folder)[:10]]
    png = io.BytesIO()
    Image.open(io.BytesIO(bytes(blobs[3].numpy()))).save(png, "PNG")
    blobs[3] = torch.frombuffer(bytearray(png.getvalue()), dtype=torch.uint8)  # no JPEG header: decoded whole
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    images, boxes = decode_crops_hw(blobs, "cpu", _FakeNvImgCodec.Decoder(refuse), scale=scale, ratio=ratio,
                                    generator=torch.Generator().manual_seed(7))
    full = decode_batch(blobs, "cpu")
    ref_boxes = sample_crop_boxes(torch.tensor([im.shape[-2] for im in full]),
                                  torch.tensor([im.shape[-1] for im in full]), scale=scale, ratio=ratio,
                                  generator=torch.Generator().manual_seed(7))
    whole = {3, *(i if i < 3 else i + 1 for i in (r - 1 for r in refuse))}  # refused calls, counted without the PNG
    for i, (image, box, ref) in enumerate(zip(images, boxes, ref_boxes, strict=True)):
        if i in whole:
            assert torch.equal(box, ref) and image.shape == full[i].shape  # decoded whole, the box kept
        else:
            assert box[:2].tolist() == [0, 0] and box[2:].tolist() == ref[2:].tolist()
            assert tuple(image.shape) == (3, *ref[2:].tolist())  # only the box was decoded
    flip = torch.arange(10) % 2 == 1
    torch.testing.assert_close(batched_resized_crop(images, boxes, 32, flip=flip),
                               batched_resized_crop(full, ref_boxes, 32, flip=flip), atol=0, rtol=0)
