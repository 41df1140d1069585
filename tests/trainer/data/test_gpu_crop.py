"""The batched RandomResizedCrop against torchvision, on CPU: crop boxes drawn from torchvision's distribution
(fallback rule included), and crop + resize + flip + normalize matching its per-image ``resized_crop``."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as T
from torchvision.transforms.v2 import functional as F

from trainer.data.cpu import IMAGENET_MEAN, IMAGENET_STD
from trainer.data.gpu.crop import antialias_weights, batched_resized_crop, sample_crop_boxes


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = torch.sort(a).values, torch.sort(b).values
    points = torch.cat([a, b])
    fa = torch.searchsorted(a, points, right=True) / len(a)
    fb = torch.searchsorted(b, points, right=True) / len(b)
    return float((fa - fb).abs().max())


# ---- crop + resize ---------------------------------------------------------------------------------------------------


def reference(images, boxes, size, flip, *, dtype):
    out = []
    for img, (top, left, h, w), f in zip(images, boxes.tolist(), flip.tolist(), strict=True):
        r = F.resized_crop(img.to(dtype) if dtype != torch.uint8 else img, top, left, h, w, [size, size],
                           antialias=True)
        out.append(r.flip(-1) if f else r)
    return torch.stack(out).float()


def test_batched_crop_matches_torchvision_per_image(decoded):
    g = torch.Generator().manual_seed(0)
    heights = torch.tensor([im.shape[1] for im in decoded])
    widths = torch.tensor([im.shape[2] for im in decoded])
    boxes = sample_crop_boxes(heights, widths, generator=g)
    # The extremes too: the whole image, a 9x13 crop blown up 20x, and a crop already at the output size.
    boxes[0] = torch.tensor([0, 0, heights[0], widths[0]])
    boxes[1] = torch.tensor([5, 7, 9, 13])
    boxes[2] = torch.tensor([3, 4, 224, 224])
    flip = torch.rand(len(decoded), generator=g) < 0.5

    out = batched_resized_crop(decoded, boxes, 224, flip=flip, normalize=False)
    assert out.shape == (len(decoded), 3, 224, 224) and out.dtype == torch.float32
    # Same maths as interpolate(antialias=True) on float input; measured: mean 6e-6, max 4.4e-4 (0-255 scale).
    err = (out - reference(decoded, boxes, 224, flip, dtype=torch.float32)).abs()
    assert err.mean() < 1e-4 and err.max() < 5e-3, (err.mean(), err.max())
    # torchvision's uint8 kernel rounds with fixed-point weights; rounding ours lands within 1 (measured: mean 0.17).
    err8 = (out.round().clamp(0, 255) - reference(decoded, boxes, 224, flip, dtype=torch.uint8)).abs()
    assert err8.max() <= 1 and err8.mean() < 0.3, (err8.mean(), err8.max())

    # float16 matmuls (the CUDA default): measured mean 0.04, max 0.26 — below the uint8 path's own rounding.
    half = batched_resized_crop(decoded[:4], boxes[:4], 224, flip=flip[:4], normalize=False,
                                compute_dtype=torch.float16)
    err16 = (half - out[:4]).abs()
    assert err16.mean() < 0.1 and err16.max() < 1.0, (err16.mean(), err16.max())


def test_antialias_taps_hold_every_weight_of_the_dense_filter():
    # The dense definition (every input column, same float32 arithmetic), against the taps-only computation, from
    # 224x up to 16x down.
    lengths = torch.tensor([1, 9, 13, 224, 225, 300, 448, 451, 1999, 3584])
    size, max_len = 224, 3584
    flip = torch.arange(len(lengths)) % 2 == 1
    length = lengths.float().view(-1, 1, 1)
    scale = length / size
    support = scale.clamp(min=1.0)
    centre = scale * (torch.arange(size, dtype=torch.float32).view(1, -1, 1) + 0.5)
    j = torch.arange(max_len, dtype=torch.float32).view(1, 1, -1)
    dense = (1 - ((j + 0.5 - centre) / support).abs()).clamp(min=0) * (j < length)
    dense = dense / dense.sum(2, keepdim=True)
    dense = torch.where(flip.view(-1, 1, 1), dense.flip(1), dense)
    ours = antialias_weights(lengths, size, max_len, flip=flip)
    assert ours.shape == (len(lengths), size, max_len)
    torch.testing.assert_close(ours, dense, atol=1e-6, rtol=0)  # only the order of the sums differs
    assert bool(((ours > 0).sum(2) == (dense > 0).sum(2)).all())  # no tap lost at any scale


def test_grouping_by_crop_size_changes_nothing(decoded):
    # One big photo among small ones: grouped by crop size, each group padded to its own largest crop.
    big = torch.nn.functional.interpolate(decoded[0][None].float(), size=(900, 1300), mode="bilinear")[0]
    images = [big.round().to(torch.uint8), *decoded[1:12]]
    heights = torch.tensor([im.shape[1] for im in images])
    widths = torch.tensor([im.shape[2] for im in images])
    boxes = sample_crop_boxes(heights, widths, generator=torch.Generator().manual_seed(2))
    boxes[0] = torch.tensor([10, 20, 850, 1200])
    flip = torch.arange(12) % 3 == 0
    whole = batched_resized_crop(images, boxes, 32, flip=flip, channels_last=True, max_cells=2**40)
    grouped = batched_resized_crop(images, boxes, 32, flip=flip, channels_last=True, max_cells=120_000)
    assert grouped.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(grouped, whole, atol=1e-4, rtol=1e-4)
    ref = reference(images, boxes, 32, flip, dtype=torch.float32)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(grouped, (ref / 255 - mean) / std, atol=1e-4, rtol=1e-4)


def test_normalize_and_channels_last(decoded):
    boxes = sample_crop_boxes(torch.tensor([im.shape[1] for im in decoded[:6]]),
                              torch.tensor([im.shape[2] for im in decoded[:6]]), generator=torch.Generator())
    raw = batched_resized_crop(decoded[:6], boxes, 64, normalize=False)
    norm = batched_resized_crop(decoded[:6], boxes, 64, channels_last=True)
    assert norm.is_contiguous(memory_format=torch.channels_last)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(norm, (raw / 255 - mean) / std, atol=1e-5, rtol=1e-5)


# ---- crop sampling ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("height, width", [(375, 500), (500, 333), (300, 300), (60, 400)])
def test_crop_boxes_follow_torchvision_distribution(height, width):
    n, scale, ratio = 4000, (0.08, 1.0), (3 / 4, 4 / 3)
    torch.manual_seed(0)
    ref = torch.tensor([T.RandomResizedCrop.get_params(torch.empty(1, height, width), scale, ratio)
                        for _ in range(n)], dtype=torch.float64)
    ours = sample_crop_boxes(torch.full((n,), height), torch.full((n,), width), scale=scale, ratio=ratio,
                             generator=torch.Generator().manual_seed(1))
    assert ours.dtype == torch.int64 and ours.shape == (n, 4)
    top, left, h, w = ours.double().unbind(1)
    assert bool(((top >= 0) & (left >= 0) & (h >= 1) & (w >= 1)).all())
    assert bool(((top + h <= height) & (left + w <= width)).all())

    def features(b):
        top, left, h, w = b.double().unbind(1)
        return {"area": h * w / (height * width), "log_ratio": torch.log(w / h),
                "top": top / (height - h + 1), "left": left / (width - w + 1)}

    # Two-sample Kolmogorov-Smirnov at alpha = 0.001: critical value 1.949 * sqrt(2 / n) = 0.044 for n = 4000.
    fr, fo = features(ref), features(ours)
    for key in fr:
        assert ks_statistic(fr[key], fo[key]) < 0.044, key
    # 60x400 (aspect 6.7) fails many tries: the centre-crop fallback must be as frequent as torchvision's.
    if (height, width) == (60, 400):
        def fallback_rate(b):
            top, left, h, w = b.unbind(1)
            return float(((h == 60) & (w == 80) & (top == 0) & (left == 160)).double().mean())

        assert fallback_rate(ref) > 0.2
        assert abs(fallback_rate(ref) - fallback_rate(ours.double())) < 0.03


def test_inside_the_ranges_and_the_fallback_rule():
    heights = torch.tensor([375, 500, 300, 60, 480])
    widths = torch.tensor([500, 333, 300, 400, 64])
    g = torch.Generator().manual_seed(3)
    boxes = sample_crop_boxes(heights.repeat(400), widths.repeat(400), scale=(0.2, 0.5), ratio=(0.5, 2.0),
                              generator=g)
    h, w = boxes[:, 2].double(), boxes[:, 3].double()
    area = h * w / (heights.repeat(400) * widths.repeat(400))
    tried = area < 0.55  # boxes that are not the fallback; rounding moves the area a little
    assert tried.float().mean() > 0.9
    assert bool(((area[tried] > 0.18) & (area[tried] < 0.52)).all())
    assert bool(((w / h)[tried] > 0.5 * 0.9).all() and ((w / h)[tried] < 2.0 * 1.1).all())

    # No try can fit (the aspect ratios asked for are far beyond any image's): the centred crop, exactly torchvision's.
    for extreme in ((1000.0, 2000.0), (0.0005, 0.001)):
        ours = sample_crop_boxes(heights, widths, ratio=extreme, generator=g)
        for k in range(len(heights)):
            ref = T.RandomResizedCrop.get_params(torch.empty(1, int(heights[k]), int(widths[k])), (0.08, 1.0),
                                                 extreme)
            assert tuple(ours[k].tolist()) == tuple(ref), (extreme, k)


@pytest.mark.parametrize("max_cells", [2**40, 60_000])
def test_interleaved_images_crop_exactly_as_planar_ones_without_a_copy_each(decoded, max_cells):
    """libjpeg-turbo decodes to H x W x 3 and hands over CHW views of it: the crop gathers their rows as pixels and
    gives bit for bit what it gives the same images stored plane by plane (in one group or several)."""
    from trainer.data.gpu.crop import _is_hwc_view

    images = [im.contiguous() for im in decoded[:12]]
    interleaved = [im.permute(1, 2, 0).contiguous().permute(2, 0, 1) for im in images]
    assert all(_is_hwc_view(im) for im in interleaved) and not any(_is_hwc_view(im) for im in images)
    heights = torch.tensor([im.shape[1] for im in images])
    widths = torch.tensor([im.shape[2] for im in images])
    boxes = sample_crop_boxes(heights, widths, generator=torch.Generator().manual_seed(4))
    flip = torch.arange(12) % 2 == 0
    planar = batched_resized_crop(images, boxes, 40, flip=flip, channels_last=True, max_cells=max_cells)
    hwc = batched_resized_crop(interleaved, boxes, 40, flip=flip, channels_last=True, max_cells=max_cells)
    assert torch.equal(hwc, planar)
    mixed = batched_resized_crop(interleaved[:6] + images[6:], boxes, 40, flip=flip, channels_last=True,
                                 max_cells=max_cells)  # a mixed batch copies each image into CHW order
    assert torch.equal(mixed, planar)
