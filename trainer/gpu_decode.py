"""The ``nvjpeg-gpu``, ``nvjpeg-hw`` and ``hybrid`` input pipelines: loader workers read bytes; the rank's GPU
decodes and augments.

On the H200 machines one CPU core decodes + crops ~350 JPEGs/s while one GPU trains ResNet-50 at ~4,500-6,000
imgs/s, so the CPU paths cannot keep up however many workers they get. nvJPEG decodes thousands of imgs/s in batches
of 256; what remains is to keep everything after the decode batched too, and cheap in both device time and host
(GIL) time, because it shares the GPU and the process with training (see ``../shared/GPU.md`` for the
measurements behind each choice here):

- Workers return one batch as ONE uint8 tensor of concatenated file bytes + lengths + labels: every tensor that
  crosses the worker queue costs a shared-memory handle, and 256 small ones per batch halved throughput.
- RandomResizedCrop boxes are sampled for the whole batch at once with torchvision's rule (10 tries, log-uniform
  aspect ratio, centre-crop fallback), on the CPU with the pipeline's own generator: no GPU sync, reproducible.
- Crop + resize of all images is one row gather and two batched matmuls with antialiased bilinear weights,
  computed exactly as ``torch.nn.functional.interpolate(mode="bilinear", antialias=True)`` (what torchvision's
  ``resized_crop`` uses) computes them; the flip is folded into the horizontal weights and normalization into the
  final write, which also produces the channels_last layout. A per-image Python loop after the decode cut
  21,800 imgs/s to 4,400. The gather indexes whole crop rows (one offset per image, row and channel), and the
  weights are computed only for the few taps each output reads, then scattered into the matmul operands; all
  per-image host numbers reach the device in one pinned copy per batch.
- Decode and augment run one batch ahead in a background thread on a high-priority side CUDA stream, handed over
  with an event: decoding synchronously on the training stream cost ~20 %.
- ``hybrid`` moves a fixed share of every batch back to the workers (decoded and augmented there as in the
  ``torchvision-cpu`` path), so spare CPU cores take work off the GPU and the pipeline's thread.
- ``nvjpeg-hw`` changes only the decode: the GPU's fixed-function JPEG engines (NVJPG on A100/H100/H200) through
  nvImageCodec instead of nvJPEG's CUDA kernels, which on 2xH200 took SMs from training (GPM SM activity 74 % with
  nvjpeg-gpu vs 89 % on synthetic data; 9,300 vs 11,920 imgs/s). What the engines refuse goes to nvJPEG's CUDA
  decoder, what that refuses to ``decode_batch``.

Every function before the pipeline classes is device-agnostic (CPU tensors in tests, CUDA tensors in training).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import queue
import threading
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from trainer.config import ConfigError, TrainConfig
from trainer.data import IMAGENET_MEAN, IMAGENET_STD, TensorJPEGDataset, train_sampler

# ---- worker side: bytes only -----------------------------------------------------------------------------------------


class JpegBytesDataset(Dataset):
    """``(file bytes, label)`` for each ``(path, label)`` sample, in the order given (ImageFolder's)."""

    def __init__(self, samples: Sequence[tuple[str, int]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        path, label = self.samples[i]
        with open(path, "rb") as f:
            return f.read(), label


def pack_bytes(blobs: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate byte strings into one uint8 tensor; returns it and the int64 lengths."""
    lengths = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    buf = torch.empty(int(lengths.sum()), dtype=torch.uint8)
    view, pos = buf.numpy(), 0
    for b in blobs:
        view[pos:pos + len(b)] = memoryview(b)
        pos += len(b)
    return buf, lengths


def unpack_bytes(buf: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """The per-file views of a packed buffer (no copies)."""
    return list(torch.split(buf, lengths.tolist()))


def collate_bytes(batch: Sequence[tuple[bytes, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DataLoader ``collate_fn``: ``(packed bytes, lengths, labels)`` — three tensors per batch, whatever its size."""
    buf, lengths = pack_bytes([b for b, _ in batch])
    return buf, lengths, torch.tensor([label for _, label in batch], dtype=torch.int64)


# ---- worker side, hybrid: part decoded here, part as bytes -----------------------------------------------------------


def cpu_share(batch_size: int, fraction: float) -> int:
    """How many images of a batch the ``hybrid`` path decodes in the loader workers: ``fraction`` of the batch,
    rounded half up, so every batch splits the same way."""
    return min(batch_size, max(0, math.floor(fraction * batch_size + 0.5)))


class HybridDataset(Dataset):
    """The ``hybrid`` path's worker side. Fetched a batch at a time (the DataLoader calls ``__getitems__`` with the
    batch's indices): the first ``cpu_share`` positions are decoded and augmented here exactly as the
    ``torchvision-cpu`` path does it (``TensorJPEGDataset``: libjpeg-turbo, transforms.v2 on uint8), the rest are
    read as bytes for the GPU. Positions, not file indices, decide, so the split is exact in every batch and
    deterministic in the sampler's order (which is already a shuffle)."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform, cpu_fraction: float):
        self.samples, self.cpu_fraction = samples, cpu_fraction
        self.decoded = TensorJPEGDataset(samples, transform)
        self.raw = JpegBytesDataset(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        return self.raw[i]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor | bytes, int]]:
        k = cpu_share(len(indices), self.cpu_fraction)
        return [self.decoded[i] if p < k else self.raw[i] for p, i in enumerate(indices)]


class HybridCollate:
    """``collate_fn`` of the hybrid path: ``(CPU share as ONE uint8 k x 3 x S x S tensor, packed bytes of the GPU
    share, their lengths, labels)`` — labels in output order, CPU share first. One tensor for all decoded images:
    each tensor crossing the worker queue costs a shared-memory handle (``default_collate`` stacks straight into
    shared memory in a worker)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, batch: Sequence[tuple[torch.Tensor | bytes, int]]):
        cpu = [(x, y) for x, y in batch if isinstance(x, torch.Tensor)]
        raw = [(x, y) for x, y in batch if not isinstance(x, torch.Tensor)]
        images = (default_collate([x for x, _ in cpu]) if cpu
                  else torch.empty((0, 3, self.size, self.size), dtype=torch.uint8))
        buf, lengths = pack_bytes([x for x, _ in raw])
        return images, buf, lengths, torch.tensor([y for _, y in cpu + raw], dtype=torch.int64)


# ---- decode ----------------------------------------------------------------------------------------------------------


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


# ---- decode on the hardware JPEG engines (nvjpeg-hw) -----------------------------------------------------------------

NVJPEG_HW_INSTALL = "pip install 'ddp-autotune[nvjpeg-hw]'"

HW_DECODE_CPU_THREADS = 4
"""Host threads of each rank's nvImageCodec decoder. The engines do the Huffman decoding; the host only parses
headers and feeds the few images the engines refuse to nvJPEG's CUDA decoder. nvImageCodec's default (one thread per
core, per rank) would compete with the loader workers for the cores."""


def import_nvimgcodec():
    """``nvidia.nvimgcodec``, or a ConfigError naming the extra that installs it (and libnvjpeg with it)."""
    try:
        return importlib.import_module("nvidia.nvimgcodec")
    except ModuleNotFoundError:
        problem = f"data.decode=nvjpeg-hw needs NVIDIA nvImageCodec, which is not installed: {NVJPEG_HW_INSTALL}"
    except (ImportError, OSError) as e:  # installed but broken (a missing shared library, another CUDA major)
        problem = f"data.decode=nvjpeg-hw: nvImageCodec does not load ({e}): reinstall it with {NVJPEG_HW_INSTALL}"
    raise ConfigError([problem]) from None


def make_hw_decoder(device: torch.device | str):
    """An nvImageCodec decoder on ``device`` that tries the hardware JPEG engines first and nvJPEG's CUDA decoder
    for what they refuse (progressive, CMYK or oddly subsampled JPEGs). Decoders allocate engine state and pinned
    buffers: make one per pipeline, in the thread that decodes (a pipeline's ``_decode`` does)."""
    nvimgcodec = import_nvimgcodec()
    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigError(["data.decode=nvjpeg-hw needs a CUDA GPU: use torchvision-cpu or pil on this machine"])
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Only these backends may decode. nvImageCodec offers each image to its highest-priority decoder (the engines)
    # and passes what that refuses or fails on to the next one; a load_hint of 1 (the default) holds back nothing.
    backends = [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY),
                nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY)]
    return nvimgcodec.Decoder(device_id=index, max_num_cpu_threads=HW_DECODE_CPU_THREADS, backends=backends)


def hw_decode_params(nvimgcodec=None):
    """RGB, interleaved (HWC: the engines' native output), uint8, and no EXIF rotation — the same pixel grid the
    other paths decode (torchvision's ``decode_jpeg`` ignores EXIF orientation too)."""
    nvimgcodec = nvimgcodec or import_nvimgcodec()
    return nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                   allow_any_depth=False, sample_format=nvimgcodec.SampleFormat.I_RGB)


def decode_batch_hw(blobs: Sequence[torch.Tensor], device: torch.device | str, decoder,
                    params=None) -> list[torch.Tensor]:
    """Decode JPEG byte tensors (CPU) with an nvImageCodec ``decoder`` (``make_hw_decoder``) to 3xHxW uint8 RGB
    on ``device``, like ``decode_batch``; images nvImageCodec cannot decode go to ``decode_batch``.

    The decode runs on the current CUDA stream: nvImageCodec allocates each output there (stream-ordered) and its
    hardware decoder runs there; its CUDA decoder makes that stream wait for its own. So kernels queued next on the
    same stream see the pixels, and freeing an output (when its last tensor dies) is ordered after them. Each
    output is wrapped without a copy (``__cuda_array_interface__``; the tensor keeps the Image alive) and returned
    as a CHW *view* of the HWC buffer: ``batched_resized_crop`` flattens each image with ``reshape``, which makes
    that one copy into its batch buffer in CHW order."""
    device = torch.device(device)
    nvimgcodec = import_nvimgcodec()
    out: list[torch.Tensor | None] = [None] * len(blobs)
    streams, positions, failed = [], [], []
    for i, blob in enumerate(blobs):
        try:  # wraps the bytes without a copy; the numpy view keeps the packed buffer alive while the stream lives
            streams.append(nvimgcodec.CodeStream(blob.numpy()))
            positions.append(i)
        except (RuntimeError, ValueError):  # unreadable bytes; 0.9 parses lazily and reports them as None below
            failed.append(i)
    if streams:
        decoded = decoder.decode(streams, params=params or hw_decode_params(nvimgcodec),
                                 cuda_stream=torch.cuda.current_stream(device).cuda_stream)
        if len(decoded) != len(streams):  # nvImageCodec before 0.9 dropped failed images instead of returning None
            raise RuntimeError(f"nvImageCodec returned {len(decoded)} images for {len(streams)} files: "
                               f"install the tested version with {NVJPEG_HW_INSTALL}")
        for i, image in zip(positions, decoded):
            if image is None:  # not a JPEG, or one neither the engines nor the CUDA decoder accept
                failed.append(i)
            else:
                out[i] = torch.as_tensor(image, device=device).permute(2, 0, 1)
    if failed and len(failed) == len(blobs) and len(blobs) >= 8:
        # A whole batch refused is not odd files but a decoder without codecs (libnvjpeg not found): failing
        # loudly beats quietly decoding every image through the fallback.
        raise RuntimeError(f"nvImageCodec decoded none of {len(blobs)} images (is libnvjpeg installed?): "
                           f"{NVJPEG_HW_INSTALL}")
    if failed:
        failed.sort()
        for i, image in zip(failed, decode_batch([blobs[i] for i in failed], device)):
            out[i] = image
    return out


# ---- RandomResizedCrop, batched --------------------------------------------------------------------------------------


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
        shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=torch.float32).view(1, 3, 1, 1)
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
    not B * Hc * 3 * Wc (~400x fewer than a per-pixel index). Then two batched matmuls resample rows and columns.
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
    groups = _groups_by_crop_size(box_list, max_cells)

    # Host metadata, one row per image in group order: [position, first pixel of the crop in the flat buffer,
    # image width, last crop row, channel plane size, crop height, crop width, flip].
    meta, spans, offset, offsets = [], [], 0, []
    for im in images:
        offsets.append(offset)
        offset += im.numel()
    for members in groups:
        start = len(meta)
        for i in members:
            top, left, h, w = box_list[i]
            height, width = images[i].shape[-2], images[i].shape[-1]
            meta.append([i, offsets[i] + top * width + left, width, h - 1, height * width, h, w, int(flips[i])])
        spans.append((start, len(meta), _round_up(max(box_list[i][2] for i in members)),
                      _round_up(max(box_list[i][3] for i in members))))
    meta_d = _to_device(torch.tensor(meta, dtype=torch.int64), device)
    position, row0, width, last_row, plane, crop_h, crop_w, flip_d = (meta_d[:, k] for k in range(8))

    # Resampling taps of all rows (heights) and columns (widths) of the batch at once: a few small kernels.
    max_len = max(max(b[2], b[3]) for b in box_list)
    taps = _tap_count(max_len, size)
    tap_flip = torch.cat([torch.zeros_like(flip_d), flip_d]).bool() if flip is not None else None
    tap_index, tap_w = _antialias_taps(torch.cat([crop_h, crop_w]), size, taps, flip=tap_flip)
    tap_w = tap_w.to(compute_dtype)

    # The tail pad lets the last row's run read Wc cells past the end; uint8 needs no initialization to be finite.
    flat = torch.empty(offset + max(s[3] for s in spans), dtype=torch.uint8, device=device)
    torch.cat([im.reshape(-1) for im in images], out=flat[:offset])
    channel = torch.arange(3, device=device)
    for start, end, hc, wc in spans:
        g = end - start
        ys = torch.arange(hc, device=device).view(1, -1)
        rows = row0[start:end, None] + torch.minimum(ys, last_row[start:end, None]) * width[start:end, None]
        first = rows.view(g, hc, 1) + plane[start:end, None, None] * channel  # g x Hc x 3 run starts
        crops = flat.unfold(0, wc, 1).index_select(0, first.view(-1)).to(compute_dtype).view(g, hc, 3 * wc)
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


# ---- the pipeline ----------------------------------------------------------------------------------------------------


class BatchedDecodePipeline:
    """Byte-reading DataLoader + batched decode and augmentation on ``device``, one batch ahead in a thread.

    The protocol of every pipeline in ``trainer/data.py``: iterating yields ``(images, labels)`` on the device
    (float32, normalized, channels_last when configured; int64); ``len()`` is batches per epoch on this rank;
    ``set_epoch``; ``close``. On CUDA the work runs on a side stream and the consumer's stream waits on an event,
    so training kernels and the next batch's decode overlap. The side stream has high priority (``stream_priority``,
    lower is higher): its kernels are small and many, and at equal priority each one queues behind the training
    kernels that fill the GPU, which stretches the next batch's preparation well past its own GPU time. On a CPU
    device the same code decodes with libjpeg-turbo (used by the tests and the benchmark's smoke run;
    ``GpuDecodePipeline`` is what training uses).
    """

    def __init__(self, cfg: TrainConfig, samples: Sequence[tuple[str, int]], *, rank: int, world_size: int,
                 device: torch.device | str, ahead: int = 1, stream_priority: int = -1):
        self.device = torch.device(device)
        self.cfg = cfg
        batch = cfg.training.batch_size
        if len(samples) < batch * world_size:
            raise ConfigError([f"{len(samples)} training images cannot fill one batch of {batch} on each of "
                               f"{world_size} ranks: lower training.batch_size or add images"])
        self.dataset, collate = self._dataset(samples)
        self.sampler = train_sampler(self.dataset, cfg, rank=rank, world_size=world_size)
        ld = cfg.loader
        self.loader = DataLoader(
            self.dataset, batch_size=batch, sampler=self.sampler, collate_fn=collate, drop_last=True,
            num_workers=ld.num_workers, prefetch_factor=ld.prefetch_factor if ld.num_workers > 0 else None,
            pin_memory=ld.pin_memory and self.device.type == "cuda",
            persistent_workers=ld.persistent_workers and ld.num_workers > 0, **self._loader_seeding())
        self.rank, self.ahead, self.epoch = rank, ahead, 0
        self.stream = (torch.cuda.Stream(self.device, priority=stream_priority) if self.device.type == "cuda"
                       else None)
        self._producer: _Producer | None = None
        self._hw_decoder = None  # nvjpeg-hw: made on first use, in the producer thread (``_decode``)

    def _dataset(self, samples):
        return JpegBytesDataset(samples), collate_bytes

    def _loader_seeding(self) -> dict:
        return {}

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._producer is not None:  # an earlier iteration the consumer left unfinished
            self._producer.stop()
        # Crops and flips derive from (seed, epoch, rank): a resumed run replays its epoch's augmentation.
        seed = (self.cfg.training.seed * 100_003 + self.epoch) * 4_099 + self.rank
        generator = torch.Generator().manual_seed(seed)
        if self.loader.generator is not None:  # worker RNG seeds (hybrid's CPU share) are drawn from it below
            self.loader.generator.manual_seed(seed)
        producer = _Producer(self, iter(self.loader), generator)  # workers fork here, in the caller's thread
        self._producer = producer
        try:
            while True:
                item = producer.get()
                if item is None:
                    return
                images, labels, ready = item
                if ready is not None:
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(ready)
                    # Allocated on the side stream but consumed on this one: without this the allocator could hand
                    # the memory to the next batch while this stream's kernels still read it.
                    images.record_stream(stream)
                    labels.record_stream(stream)
                yield images, labels
        finally:
            producer.stop()
            if self._producer is producer:
                self._producer = None

    def prepare(self, batch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch from the loader (packed bytes, lengths, labels) -> ``(images, labels)`` on the device (on the
        current stream)."""
        buf, lengths, labels = batch
        return self.decode_and_crop(buf, lengths, generator), labels.to(self.device, non_blocking=True)

    def decode_and_crop(self, buf: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode the packed JPEGs on the device and RandomResizedCrop + flip + normalize them (into ``out``)."""
        d = self.cfg.data
        images = self._decode(unpack_bytes(buf, lengths))
        heights = torch.tensor([im.shape[-2] for im in images])
        widths = torch.tensor([im.shape[-1] for im in images])
        boxes = sample_crop_boxes(heights, widths, scale=d.crop_scale, ratio=d.crop_ratio, generator=generator)
        flip = torch.rand(len(images), generator=generator) < 0.5 if d.hflip else None
        return batched_resized_crop(images, boxes, d.image_size, flip=flip,
                                    channels_last=self.cfg.training.channels_last, out=out)

    def _decode(self, blobs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The decode step ``data.decode`` names: nvImageCodec on the hardware engines for ``nvjpeg-hw``,
        ``decode_batch`` (torchvision's nvJPEG, libjpeg-turbo on a CPU device) for the others."""
        if self.cfg.data.decode != "nvjpeg-hw":
            return decode_batch(blobs, self.device)
        if self._hw_decoder is None:  # one per pipeline, created by the thread that decodes, on the rank's device
            self._hw_decoder = make_hw_decoder(self.device)
        return decode_batch_hw(blobs, self.device, self._hw_decoder)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.stop()
            self._producer = None
        self._hw_decoder = None  # frees the engines' state and pinned buffers now, not at interpreter exit
        iterator = getattr(self.loader, "_iterator", None)  # persistent workers live here between epochs
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


class GpuDecodePipeline(BatchedDecodePipeline):
    """``data.decode: nvjpeg-gpu`` or ``nvjpeg-hw`` — needs a CUDA device (and, for ``nvjpeg-hw``, nvImageCodec:
    checked here, before the workers start, so a missing package is a config error and not a crash mid-run)."""

    def __init__(self, cfg: TrainConfig, samples: Sequence[tuple[str, int]], *, rank: int, world_size: int,
                 device: torch.device | str, ahead: int = 1, stream_priority: int = -1):
        # Anything but nvjpeg-hw decodes as nvjpeg-gpu here (``_decode``), and is named so.
        decode, problems = ("nvjpeg-hw" if cfg.data.decode == "nvjpeg-hw" else "nvjpeg-gpu"), []
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            problems.append(f"data.decode={decode} needs a CUDA GPU: use torchvision-cpu or pil on this machine")
        if decode == "nvjpeg-hw":
            try:
                import_nvimgcodec()
            except ConfigError as e:
                problems.extend(e.problems)
        if problems:
            raise ConfigError(problems)
        super().__init__(cfg, samples, rank=rank, world_size=world_size, device=device, ahead=ahead,
                         stream_priority=stream_priority)


class HybridDecodePipeline(BatchedDecodePipeline):
    """``data.decode: hybrid`` — ``data.hybrid_cpu_fraction`` of every batch is decoded and augmented by the loader
    workers (``HybridDataset``), the rest by the device as in ``nvjpeg-gpu``; the output is the CPU share
    (normalized on the device) followed by the GPU share, labels alike. The fraction trades CPU cores for device
    time, which is what the tuner balances. Works on a CPU device too (both shares then decode with libjpeg-turbo).
    """

    def _dataset(self, samples):
        from trainer.data import cpu_transforms

        transform = cpu_transforms(self.cfg, train=True, decode="torchvision-cpu")
        return (HybridDataset(samples, transform, self.cfg.data.hybrid_cpu_fraction),
                HybridCollate(self.cfg.data.image_size))

    def _loader_seeding(self) -> dict:
        from trainer.data import _seed_worker

        # The CPU share's transforms draw from each worker's torch RNG, seeded from this generator (as in the
        # torchvision-cpu path); __iter__ reseeds it from (seed, epoch, rank).
        return {"worker_init_fn": _seed_worker, "generator": torch.Generator().manual_seed(self.cfg.training.seed)}

    def prepare(self, batch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        cpu_images, buf, lengths, labels = batch
        k, size = cpu_images.shape[0], self.cfg.data.image_size
        fmt = torch.channels_last if self.cfg.training.channels_last else torch.contiguous_format
        out = torch.empty((k + lengths.numel(), 3, size, size), dtype=torch.float32, device=self.device,
                          memory_format=fmt)
        if k:
            normalize_into(out[:k], cpu_images.to(self.device, non_blocking=True))
        if lengths.numel():
            self.decode_and_crop(buf, lengths, generator, out=out[k:])
        return out, labels.to(self.device, non_blocking=True)


class _Producer:
    """The background thread of one iteration: loader batch -> prepared batch -> bounded queue."""

    def __init__(self, pipeline: BatchedDecodePipeline, batches, generator: torch.Generator):
        self.pipeline, self.batches, self.generator = pipeline, batches, generator
        self.queue: queue.Queue = queue.Queue(maxsize=pipeline.ahead)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gpu-decode", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        p = self.pipeline
        try:
            on_side_stream = contextlib.ExitStack()
            if p.stream is not None:  # the current device and stream are per thread: set both here
                on_side_stream.enter_context(torch.cuda.device(p.device))
                on_side_stream.enter_context(torch.cuda.stream(p.stream))
            with on_side_stream:
                for batch in self.batches:
                    if self.stopping.is_set():
                        return
                    if p.stream is not None:
                        # nvJPEG writes its outputs from its own stream; memory this stream freed (the last batch's
                        # temporaries) may be handed to those outputs only once this stream's reads of it are done.
                        p.stream.synchronize()
                    # The decoders may read the last batch's pinned file bytes asynchronously until that sync, and the
                    # loop variable let go of them before it: this reference keeps them from the caching host
                    # allocator (and the loader's pin thread) until now.
                    self.in_use = batch
                    images, labels = p.prepare(batch, self.generator)
                    ready = None
                    if p.stream is not None:
                        ready = torch.cuda.Event()
                        ready.record(p.stream)
                    if not self._put((images, labels, ready)):
                        return
            self._put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self._put(e)

    def _put(self, item) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self):
        """The next prepared batch, None at the end of the epoch; re-raises the thread's exception."""
        while True:
            try:
                item = self.queue.get(timeout=1.0)
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    raise RuntimeError("the GPU decode thread ended without handing over a result") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def stop(self, timeout: float = 60.0) -> None:
        self.stopping.set()
        while True:  # unblock a put() in progress and free the prepared batches
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.thread.join(timeout)
        if not self.pipeline.loader.persistent_workers and hasattr(self.batches, "_shutdown_workers"):
            self.batches._shutdown_workers()

