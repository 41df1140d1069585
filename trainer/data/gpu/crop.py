"""RandomResizedCrop + horizontal flip + normalization of a whole batch at once, each image computed as torchvision
computes it alone.

- Boxes are sampled for the whole batch at once with torchvision's rule (10 tries, log-uniform aspect ratio,
  centre-crop fallback), on the CPU with the pipeline's own generator: no GPU sync, reproducible.
- Crop + resize of all images is one row gather and two batched matmuls with antialiased bilinear weights,
  computed exactly as ``torch.nn.functional.interpolate(mode="bilinear", antialias=True)`` (what torchvision's
  ``resized_crop`` uses) computes them; the flip is folded into the horizontal weights and normalization into the
  final write, which also produces the channels_last layout: a per-image Python loop after the decode would be
  several times slower (docs/benchmarks.md). The gather indexes whole crop rows (one offset per image, row and
  channel), and the weights are computed only for the few taps each output reads, then scattered into the matmul
  operands; all per-image host numbers reach the device in one pinned copy per batch.

Everything here is device-agnostic (CPU tensors in tests, CUDA tensors in training).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer.data.cpu import IMAGENET_MEAN, IMAGENET_STD


def sample_crop_boxes(heights: torch.Tensor, widths: torch.Tensor, *, scale: tuple[float, float] = (0.08, 1.0),
                      ratio: tuple[float, float] = (3 / 4, 4 / 3), generator: torch.Generator | None = None,
                      attempts: int = 10) -> torch.Tensor:
    """RandomResizedCrop boxes ``[top, left, height, width]`` (int64, B x 4) for images of the given sizes.

    The rule of ``torchvision.transforms.v2.RandomResizedCrop``: up to ``attempts`` tries of an area fraction
    uniform in ``scale`` and an aspect ratio log-uniform in ``ratio``, the first that fits wins and is placed
    uniformly; if none fits, the largest centred crop whose aspect ratio is clamped to ``ratio``. All tries of all
    images are drawn at once (the first fitting one per image is picked), so the cost does not grow with a loop.
    """
    h_img = torch.as_tensor(heights, dtype=torch.float64).reshape(-1, 1)
    w_img = torch.as_tensor(widths, dtype=torch.float64).reshape(-1, 1)
    n = h_img.shape[0]
    u = torch.rand(n, attempts, 2, dtype=torch.float64, generator=generator)
    area = h_img * w_img * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * u[..., 1])
    w = torch.round(torch.sqrt(area * aspect))  # round half to even, like Python's round() in torchvision
    h = torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (w <= w_img) & (h > 0) & (h <= h_img)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # index of the first fitting try
    found = fits.any(dim=1)
    h_try, w_try = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)

    h_img, w_img = h_img.squeeze(1), w_img.squeeze(1)
    in_ratio = w_img / h_img
    r_min, r_max = min(ratio), max(ratio)
    h_fb = torch.where(in_ratio < r_min, torch.round(w_img / r_min), h_img)
    w_fb = torch.where(in_ratio > r_max, torch.round(h_img * r_max), w_img)
    h_box = torch.where(found, h_try, h_fb)
    w_box = torch.where(found, w_try, w_fb)

    pos = torch.rand(n, 2, dtype=torch.float64, generator=generator)
    span_h, span_w = h_img - h_box + 1, w_img - w_box + 1
    top = torch.where(found, torch.minimum(torch.floor(pos[:, 0] * span_h), span_h - 1), torch.floor((span_h - 1) / 2))
    left = torch.where(found, torch.minimum(torch.floor(pos[:, 1] * span_w), span_w - 1), torch.floor((span_w - 1) / 2))
    return torch.stack([top, left, h_box, w_box], dim=1).to(torch.int64)


def _antialias_taps(lengths: torch.Tensor, out_size: int, taps: int, *,
                    flip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The nonzero part of each resampling row: ``(index, weight)``, both ``len(lengths) x out_size x taps``.

    The weights are those of ``interpolate(mode="bilinear", antialias=True)``: a triangle stretched by the downscale
    factor, pixel centres aligned, renormalized over the taps inside the image. Output ``i`` only reads input
    pixels within ``support`` of its centre, so ``taps = ceil(2 * support) + 2`` columns starting just below
    ``centre - support`` hold every nonzero weight (``_tap_count``); computing just those instead of a dense
    row over the whole crop is what keeps this cheap (``taps`` is ~8 where a crop row is ~400 pixels). Taps outside
    ``[0, length)`` get weight 0 and an index clamped into that range, so adding them anywhere changes nothing.
    ``flip[b]`` reverses the output order (a horizontal flip when used for columns)."""
    device = lengths.device
    length = lengths.to(torch.float32).view(-1, 1, 1)
    scale = length / out_size
    support = torch.clamp(scale, min=1.0)  # downscaling widens the filter to cover every input pixel
    centre = scale * (torch.arange(out_size, device=device, dtype=torch.float32).view(1, -1, 1) + 0.5)
    j = torch.floor(centre - support - 0.5) + torch.arange(taps, device=device, dtype=torch.float32).view(1, 1, -1)
    w = torch.clamp(1.0 - ((j + 0.5 - centre) / support).abs(), min=0.0)
    w = w * ((j >= 0) & (j < length))
    w = w / w.sum(dim=2, keepdim=True)
    index = torch.minimum(j.clamp(min=0), length - 1).to(torch.int64)
    if flip is not None:
        f = flip.to(device).view(-1, 1, 1)
        index, w = torch.where(f, index.flip(1), index), torch.where(f, w.flip(1), w)
    return index, w


def _tap_count(max_len: int, out_size: int) -> int:
    # Inputs j with |j + 0.5 - centre| < support: an open interval of length 2 * support, started one below.
    return math.ceil(2 * max(1.0, max_len / out_size)) + 2


def antialias_weights(lengths: torch.Tensor, out_size: int, max_len: int, *, dtype: torch.dtype = torch.float32,
                      flip: torch.Tensor | None = None) -> torch.Tensor:
    """Dense resampling matrices (B x out_size x max_len) taking each row of ``lengths[b]`` inputs to ``out_size``
    outputs with the weights of ``_antialias_taps``; columns past an image's length are zero. ``max_len`` must be
    at least ``lengths.max()``."""
    index, w = _antialias_taps(lengths, out_size, _tap_count(max_len, out_size), flip=flip)
    return _scatter_rows(index, w.to(dtype), max_len)


def _scatter_rows(index: torch.Tensor, w: torch.Tensor, width: int) -> torch.Tensor:
    # Each row's nonzero taps have distinct indices; the zero-weight ones land on some of them and add exactly 0.
    dense = torch.zeros((*index.shape[:2], width), dtype=w.dtype, device=w.device)
    return dense.scatter_add_(2, index, w)


def _round_up(x: int, multiple: int = 8) -> int:
    return -(-x // multiple) * multiple


_NORMALIZE: dict = {}


def _normalize_constants(device: torch.device, mean: Sequence[float], std: Sequence[float]):
    """``(scale, shift)`` with ``x * scale + shift == (x / 255 - mean) / std``, made once per device: creating
    them per batch cost two pageable host-to-device copies each time."""
    key = (device, tuple(mean), tuple(std))
    if key not in _NORMALIZE:
        scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32).view(1, 3, 1, 1)
        shift = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)], dtype=torch.float32).view(1, 3, 1, 1)
        _NORMALIZE[key] = (scale.to(device), shift.to(device))
    return _NORMALIZE[key]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A pageable source makes a "non-blocking" copy synchronous (the driver stages it); a pinned one is truly async.
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def normalize_into(target: torch.Tensor, images: torch.Tensor, *, mean: Sequence[float] = IMAGENET_MEAN,
                   std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """``target = (images / 255 - mean) / std`` in one pass, for uint8 or float 0-255 ``images`` (any layout)."""
    scale, shift = _normalize_constants(target.device, mean, std)
    return torch.addcmul(shift, images, scale, out=target)


def batched_resized_crop(images: Sequence[torch.Tensor], boxes: torch.Tensor, size: int, *,
                         flip: torch.Tensor | None = None, normalize: bool = True,
                         mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                         channels_last: bool = False, compute_dtype: torch.dtype | None = None,
                         out_dtype: torch.dtype = torch.float32, max_cells: int = 2**25,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Crop ``boxes[b] = [top, left, h, w]`` out of each 3xHxW uint8 image, resize it to ``size`` x ``size`` with
    antialiased bilinear interpolation (as ``torchvision.transforms.v2.functional.resized_crop(..., antialias=True)``),
    flip where ``flip`` is true, and (``normalize``) scale to [0, 1] and normalize by ``mean``/``std``; without
    ``normalize`` the output stays on the 0-255 scale. Returns B x 3 x size x size ``out_dtype``, written into
    ``out`` when given (any B x 3 x size x size view, e.g. a slice of a larger batch).

    ``boxes`` and ``flip`` live on the CPU (they are sampled there); the images on the device. Everything the host
    knows (sizes, boxes, flips, offsets) crosses to the device in one pinned copy; nothing waits for the device.

    ``compute_dtype`` is the matmuls' dtype: default float32 on CPU and float16 on CUDA (tensor cores, half the
    memory traffic; uint8 values are exact in it and the error stays below the uint8 rounding of the CPU paths).

    How: all images are concatenated into one flat uint8 buffer. A crop row of one channel is a contiguous run of
    that buffer, so ``flat.unfold(0, Wc, 1)`` (a view: row ``i`` is ``flat[i:i + Wc]``) indexed by one start
    offset per (image, row, channel) gathers every crop into B x Hc x 3 x Wc: the index has B * Hc * 3 entries,
    not B * Hc * 3 * Wc (Wc times fewer than a per-pixel index). Then two batched matmuls resample rows and columns.
    Cells beyond a crop (padding to Hc, Wc) hold whatever pixels follow it: finite, and their weights are zero.

    Crops are padded to the largest in their group (rounded up to a multiple of 8, which keeps every matmul
    operand's leading dimension 16-byte aligned for the tensor cores), so one 2000-px photo among 300-px ones would
    inflate the whole batch: images are grouped by crop size, each group holding at most ``max_cells`` padded
    pixels (a lone crop larger than that is a group of its own). Typical ImageNet-sized batches of 256 make two or
    three groups.
    """
    n, device = len(images), images[0].device
    if compute_dtype is None:
        compute_dtype = torch.float16 if device.type == "cuda" else torch.float32
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if out is None:
        out = torch.empty((n, 3, size, size), dtype=out_dtype, device=device, memory_format=fmt)
    elif tuple(out.shape) != (n, 3, size, size):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(n, 3, size, size)}")
    box_list = boxes.cpu().tolist()
    flips = flip.cpu().tolist() if flip is not None else [False] * n
    # Decoders that write interleaved pixels (libjpeg-turbo: HWC) hand over CHW views of them: gathered as pixels,
    # their crop rows need no per-image copy into CHW order first (one copy kernel per image).
    hwc = all(_is_hwc_view(im) for im in images)
    meta, spans, offset = _crop_metadata(images, box_list, flips, _groups_by_crop_size(box_list, max_cells), hwc=hwc)
    meta_d = _to_device(torch.tensor(meta, dtype=torch.int64), device)
    position, row0, width, last_row, plane, crop_h, crop_w, flip_d = (meta_d[:, k] for k in range(8))

    # Resampling taps of all rows (heights) and columns (widths) of the batch at once: a few small kernels.
    max_len = max(max(b[2], b[3]) for b in box_list)
    taps = _tap_count(max_len, size)
    tap_flip = torch.cat([torch.zeros_like(flip_d), flip_d]).bool() if flip is not None else None
    tap_index, tap_w = _antialias_taps(torch.cat([crop_h, crop_w]), size, taps, flip=tap_flip)
    tap_w = tap_w.to(compute_dtype)

    runs = _flat_buffer(images, offset, max(s[3] for s in spans), hwc=hwc)
    channel = torch.arange(3, device=device)
    # Each group: one gather, two matmuls, one fused normalize — kept in line, the device work in its order.
    for start, end, hc, wc in spans:
        g = end - start
        ys = torch.arange(hc, device=device).view(1, -1)
        rows = row0[start:end, None] + torch.minimum(ys, last_row[start:end, None]) * width[start:end, None]
        crops = _gather_rows(runs, rows, plane[start:end], channel, wc).to(compute_dtype).view(g, hc, 3 * wc)
        wy = _scatter_rows(tap_index[start:end], tap_w[start:end], hc)
        wx = _scatter_rows(tap_index[n + start:n + end], tap_w[n + start:n + end], wc)
        resampled = torch.bmm(wy, crops)  # g x size x (3 * Wc): rows, channels, columns
        resampled = torch.bmm(resampled.view(g, size * 3, wc), wx.transpose(1, 2))  # g x (size * 3) x size
        resampled = resampled.view(g, size, 3, size).permute(0, 2, 1, 3)
        target = out if len(spans) == 1 else torch.empty((g, 3, size, size), dtype=out.dtype, device=device,
                                                         memory_format=fmt)
        if normalize:
            normalize_into(target, resampled, mean=mean, std=std)
        else:
            target.copy_(resampled)
        if len(spans) > 1:
            out.index_copy_(0, position[start:end], target)
    return out


def _flat_buffer(images: Sequence[torch.Tensor], size: int, pad: int, *, hwc: bool) -> torch.Tensor:
    """All images in one flat uint8 buffer of ``size`` cells, then ``pad`` more: the last row's run reads Wc cells
    past the end (uint8 needs no initialization to be finite). Planar channels (a 1-D buffer), or with ``hwc``
    interleaved pixels (P pixels x 3 channels: offsets count pixels, a crop row of all three channels is one run)."""
    device = images[0].device
    if hwc:
        flat = torch.empty((size + pad) * 3, dtype=torch.uint8, device=device)
        torch.cat([im.permute(1, 2, 0).reshape(-1) for im in images], out=flat[:size * 3])
        return flat.view(-1, 3)
    flat = torch.empty(size + pad, dtype=torch.uint8, device=device)
    torch.cat([im.reshape(-1) for im in images], out=flat[:size])
    return flat


def _gather_rows(runs: torch.Tensor, rows: torch.Tensor, plane: torch.Tensor, channel: torch.Tensor,
                 wc: int) -> torch.Tensor:
    """Every crop row of a group (``rows``: g x Hc first pixels) in one gather from ``_flat_buffer``'s buffer:
    g * Hc * 3 runs of ``wc`` uint8 cells in (image, row, channel) order, ``plane`` apart for planar channels."""
    if runs.dim() == 2:  # unfold of P x 3 pixels: [i, c, j] = pixel i + j, channel c; one index per (image, row)
        return runs.unfold(0, wc, 1).index_select(0, rows.reshape(-1))
    g, hc = rows.shape
    first = rows.view(g, hc, 1) + plane[:, None, None] * channel  # g x Hc x 3 run starts
    return runs.unfold(0, wc, 1).index_select(0, first.view(-1))


def _crop_metadata(images: Sequence[torch.Tensor], boxes: list[list[int]], flips: list[bool],
                   groups: list[list[int]], *, hwc: bool = False,
                   ) -> tuple[list[list[int]], list[tuple[int, int, int, int]], int]:
    """Host numbers for the device, one row per image in group order: [position, first pixel of the crop in the
    flat buffer, image width, last crop row, channel plane size, crop height, crop width, flip]; each group's
    (first row, end row, padded height, padded width); and the flat buffer's size. ``hwc``: the buffer holds
    interleaved pixels, offsets count pixels, and there are no channel planes."""
    meta, spans, offset, offsets = [], [], 0, []
    for im in images:
        offsets.append(offset)
        offset += im.numel() // 3 if hwc else im.numel()
    for members in groups:
        start = len(meta)
        for i in members:
            top, left, h, w = boxes[i]
            height, width = images[i].shape[-2], images[i].shape[-1]
            plane = 0 if hwc else height * width
            meta.append([i, offsets[i] + top * width + left, width, h - 1, plane, h, w, int(flips[i])])
        spans.append((start, len(meta), _round_up(max(boxes[i][2] for i in members)),
                      _round_up(max(boxes[i][3] for i in members))))
    return meta, spans, offset


def _is_hwc_view(im: torch.Tensor) -> bool:
    """A 3 x H x W view of a contiguous H x W x 3 buffer (what ``decode_batch`` returns on a CPU device)."""
    return im.dim() == 3 and im.shape[0] == 3 and im.stride() == (1, 3 * im.shape[2], 3)


def _groups_by_crop_size(boxes: list[list[int]], max_cells: int) -> list[list[int]]:
    """Image indices grouped by crop area (plain Python on host numbers: no tensor indexing per image); a single
    group keeps the caller's order, so its output needs no scatter."""
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][2] * boxes[i][3])
    groups, current, max_h, max_w = [], [], 0, 0
    for i in order:
        h, w = boxes[i][2], boxes[i][3]
        grown_h, grown_w = max(max_h, h), max(max_w, w)
        if current and (len(current) + 1) * grown_h * grown_w > max_cells:
            groups.append(current)
            current, grown_h, grown_w = [], h, w
        current.append(i)
        max_h, max_w = grown_h, grown_w
    groups.append(current)
    if len(groups) == 1:
        return [list(range(len(boxes)))]
    return groups
