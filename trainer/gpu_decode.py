"""The ``nvjpeg-gpu`` input pipeline: loader workers only read file bytes; the rank's GPU decodes and augments.

On the H200 machines one CPU core decodes + crops ~350 JPEGs/s while one GPU trains ResNet-50 at ~4,500 imgs/s, so
the CPU paths cannot keep up however many workers they get. nvJPEG decodes ~21,800 imgs/s in batches of 256; what
remains is to keep everything after the decode batched too (see ``../shared/GPU.md`` for the measurements behind
each choice here):

- Workers return one batch as ONE uint8 tensor of concatenated file bytes + lengths + labels: every tensor that
  crosses the worker queue costs a shared-memory handle, and 256 small ones per batch halved throughput.
- RandomResizedCrop boxes are sampled for the whole batch at once with torchvision's rule (10 tries, log-uniform
  aspect ratio, centre-crop fallback), on the CPU with the pipeline's own generator: no GPU sync, reproducible.
- Crop + resize of all images is two batched matmuls with antialiased bilinear weights, computed exactly as
  ``torch.nn.functional.interpolate(mode="bilinear", antialias=True)`` (what torchvision's ``resized_crop`` uses)
  computes them; the flip is folded into the horizontal weights and normalization into the final write, which
  also produces the channels_last layout. A per-image Python loop after the decode cut 21,800 imgs/s to 4,400.
- Decode and augment run one batch ahead in a background thread on a side CUDA stream, handed over with an event:
  decoding synchronously on the training stream cost ~20 %.

Every function before the pipeline class is device-agnostic (CPU tensors in tests, CUDA tensors in training).
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer.config import ConfigError, TrainConfig
from trainer.data import IMAGENET_MEAN, IMAGENET_STD


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


def antialias_weights(lengths: torch.Tensor, out_size: int, max_len: int, *, dtype: torch.dtype = torch.float32,
                      flip: torch.Tensor | None = None) -> torch.Tensor:
    """Resampling matrices (B x out_size x max_len) taking each row of ``lengths[b]`` inputs to ``out_size``
    outputs: bilinear with the antialias filter of ``interpolate(mode="bilinear", antialias=True)`` (a triangle
    stretched by the downscale factor, pixel centres aligned, clamped at the edges); columns past an image's length
    are zero. ``flip[b]`` reverses the output order (a horizontal flip when used for columns)."""
    device = lengths.device
    length = lengths.to(torch.float32).view(-1, 1, 1)
    scale = length / out_size
    support = torch.clamp(scale, min=1.0)  # downscaling widens the filter to cover every input pixel
    centre = scale * (torch.arange(out_size, device=device, dtype=torch.float32).view(1, -1, 1) + 0.5)
    j = torch.arange(max_len, device=device, dtype=torch.float32).view(1, 1, -1)
    w = torch.clamp(1.0 - ((j + 0.5 - centre) / support).abs(), min=0.0)
    w = w * (j < length)
    w = w / w.sum(dim=2, keepdim=True)
    if flip is not None:
        w = torch.where(flip.to(device).view(-1, 1, 1), w.flip(1), w)
    return w.to(dtype)


def gather_crops(images: Sequence[torch.Tensor], boxes: torch.Tensor) -> torch.Tensor:
    """The crop of every 3xHxW uint8 image, packed into one B x Hc x 3 x Wc uint8 tensor (Hc, Wc: the largest
    crop). Rows-then-channels is the layout the vertical resample matmul can read without a copy. Cells beyond an
    image's crop repeat its last row/column: finite values, which the zero weights there ignore."""
    device = images[0].device
    boxes = boxes.cpu()
    n = len(images)
    sizes = torch.tensor([[im.shape[-2], im.shape[-1]] for im in images], dtype=torch.int64)
    numel = sizes[:, 0] * sizes[:, 1] * 3
    offsets = torch.cumsum(numel, 0) - numel
    hc, wc = int(boxes[:, 2].max()), int(boxes[:, 3].max())
    index_dtype = torch.int32 if int(numel.sum()) < 2**31 else torch.int64
    # One small host-to-device copy carries all per-image numbers; everything else is computed there.
    meta = torch.cat([offsets.view(-1, 1), sizes, boxes], dim=1).to(device, non_blocking=True)
    off, h_img, w_img, top, left, h, w = (meta[:, k:k + 1] for k in range(7))
    ys = torch.minimum(torch.arange(hc, device=device).view(1, -1), h - 1)
    xs = torch.minimum(torch.arange(wc, device=device).view(1, -1), w - 1)
    rows = off + (top + ys) * w_img + left  # B x Hc
    channels = torch.arange(3, device=device).view(1, -1) * (h_img * w_img)  # B x 3
    index = (rows.to(index_dtype).view(n, hc, 1, 1) + channels.to(index_dtype).view(n, 1, 3, 1)
             + xs.to(index_dtype).view(n, 1, 1, wc))
    flat = torch.cat([im.reshape(-1) for im in images])
    return torch.index_select(flat, 0, index.view(-1)).view(n, hc, 3, wc)


def batched_resized_crop(images: Sequence[torch.Tensor], boxes: torch.Tensor, size: int, *,
                         flip: torch.Tensor | None = None, normalize: bool = True,
                         mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                         channels_last: bool = False, compute_dtype: torch.dtype | None = None,
                         out_dtype: torch.dtype = torch.float32, max_cells: int = 2**25) -> torch.Tensor:
    """Crop ``boxes[b] = [top, left, h, w]`` out of each 3xHxW uint8 image, resize it to ``size`` x ``size`` with
    antialiased bilinear interpolation (as ``torchvision.transforms.v2.functional.resized_crop(..., antialias=True)``),
    flip where ``flip`` is true, and (``normalize``) scale to [0, 1] and normalize by ``mean``/``std``; without
    ``normalize`` the output stays on the 0-255 scale. Returns B x 3 x size x size ``out_dtype``.

    ``compute_dtype`` is the matmuls' dtype: default float32 on CPU and float16 on CUDA (tensor cores, half the
    memory traffic; uint8 values are exact in it and the error stays below the uint8 rounding of the CPU paths).

    Crops are padded to the largest in their group, so one 2000-px photo among 300-px ones would inflate the whole
    batch: images are grouped by crop size, each group holding at most ``max_cells`` padded pixels (a lone crop
    larger than that is a group of its own). Typical ImageNet-sized batches of 256 make two or three groups.
    """
    n, device = len(images), images[0].device
    if compute_dtype is None:
        compute_dtype = torch.float16 if device.type == "cuda" else torch.float32
    boxes = boxes.cpu()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    result = torch.empty((n, 3, size, size), dtype=out_dtype, device=device, memory_format=fmt)
    if normalize:
        scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32).view(1, 3, 1, 1).to(device)
        shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=torch.float32).view(1, 3, 1, 1).to(device)
    groups = _groups_by_crop_size(boxes, max_cells)
    for members in groups:
        sub_flip = None if flip is None else flip[members]
        out = _resized_crops(
            [images[i] for i in members.tolist()], boxes[members], size, sub_flip, compute_dtype)
        target = result if len(groups) == 1 else torch.empty_like(result[:len(members)], memory_format=fmt)
        if normalize:
            torch.addcmul(shift, out, scale, out=target)
        else:
            target.copy_(out)
        if len(groups) > 1:
            result.index_copy_(0, members.to(device, non_blocking=True), target)
    return result


def _groups_by_crop_size(boxes: torch.Tensor, max_cells: int) -> list[torch.Tensor]:
    order = torch.argsort(boxes[:, 2] * boxes[:, 3]).tolist()
    groups, current, max_h, max_w = [], [], 0, 0
    for i in order:
        h, w = int(boxes[i, 2]), int(boxes[i, 3])
        grown_h, grown_w = max(max_h, h), max(max_w, w)
        if current and (len(current) + 1) * grown_h * grown_w > max_cells:
            groups.append(current)
            current, grown_h, grown_w = [], h, w
        current.append(i)
        max_h, max_w = grown_h, grown_w
    groups.append(current)
    if len(groups) == 1:
        return [torch.arange(len(order))]  # keep the caller's order: no scatter needed
    return [torch.tensor(g, dtype=torch.int64) for g in groups]


def _resized_crops(images: Sequence[torch.Tensor], boxes: torch.Tensor, size: int, flip: torch.Tensor | None,
                   compute_dtype: torch.dtype) -> torch.Tensor:
    """The resampled crops, 0-255 scale, as a B x 3 x size x size view of a rows-channels-columns buffer."""
    n, device = len(images), images[0].device
    crops = gather_crops(images, boxes)  # B x Hc x 3 x Wc
    hc, wc = crops.shape[1], crops.shape[3]
    crop_hw = boxes[:, 2:4].to(device, non_blocking=True)
    wy = antialias_weights(crop_hw[:, 0], size, hc, dtype=compute_dtype)
    wx = antialias_weights(crop_hw[:, 1], size, wc, dtype=compute_dtype, flip=flip)
    rows = torch.bmm(wy, crops.to(compute_dtype).view(n, hc, 3 * wc))  # B x size x (3 * Wc)
    out = torch.bmm(rows.view(n, size * 3, wc), wx.transpose(1, 2))  # B x (size * 3) x size: rows, channels, columns
    return out.view(n, size, 3, size).permute(0, 2, 1, 3)


# ---- the pipeline ----------------------------------------------------------------------------------------------------


class BatchedDecodePipeline:
    """Byte-reading DataLoader + batched decode and augmentation on ``device``, one batch ahead in a thread.

    The protocol of every pipeline in ``trainer/data.py``: iterating yields ``(images, labels)`` on the device
    (float32, normalized, channels_last when configured; int64); ``len()`` is batches per epoch on this rank;
    ``set_epoch``; ``close``. On CUDA the work runs on a side stream and the consumer's stream waits on an event,
    so training kernels and the next batch's decode overlap. On a CPU device the same code decodes with
    libjpeg-turbo (used by the tests and the benchmark's smoke run; ``GpuDecodePipeline`` is what training uses).
    """

    def __init__(self, cfg: TrainConfig, samples: Sequence[tuple[str, int]], *, rank: int, world_size: int,
                 device: torch.device | str, ahead: int = 1):
        self.device = torch.device(device)
        self.cfg = cfg
        batch = cfg.training.batch_size
        if len(samples) < batch * world_size:
            raise ConfigError([f"{len(samples)} training images cannot fill one batch of {batch} on each of "
                               f"{world_size} ranks: lower training.batch_size or add images"])
        self.dataset = JpegBytesDataset(samples)
        self.sampler = DistributedSampler(self.dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                          seed=cfg.training.seed, drop_last=True)
        ld = cfg.loader
        self.loader = DataLoader(
            self.dataset, batch_size=batch, sampler=self.sampler, collate_fn=collate_bytes, drop_last=True,
            num_workers=ld.num_workers, prefetch_factor=ld.prefetch_factor if ld.num_workers > 0 else None,
            pin_memory=ld.pin_memory and self.device.type == "cuda",
            persistent_workers=ld.persistent_workers and ld.num_workers > 0)
        self.rank, self.ahead, self.epoch = rank, ahead, 0
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._producer: _Producer | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._producer is not None:  # an earlier iteration the consumer left unfinished
            self._producer.stop()
        # Crops and flips derive from (seed, epoch, rank): a resumed run replays its epoch's augmentation.
        generator = torch.Generator().manual_seed(
            (self.cfg.training.seed * 100_003 + self.epoch) * 4_099 + self.rank)
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

    def prepare(self, buf: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed batch from the loader -> ``(images, labels)`` on the device (on the current stream)."""
        d = self.cfg.data
        images = decode_batch(unpack_bytes(buf, lengths), self.device)
        heights = torch.tensor([im.shape[-2] for im in images])
        widths = torch.tensor([im.shape[-1] for im in images])
        boxes = sample_crop_boxes(heights, widths, scale=d.crop_scale, ratio=d.crop_ratio, generator=generator)
        flip = torch.rand(len(images), generator=generator) < 0.5 if d.hflip else None
        out = batched_resized_crop(images, boxes, d.image_size, flip=flip,
                                   channels_last=self.cfg.training.channels_last)
        return out, labels.to(self.device, non_blocking=True)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.stop()
            self._producer = None
        iterator = getattr(self.loader, "_iterator", None)  # persistent workers live here between epochs
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


class GpuDecodePipeline(BatchedDecodePipeline):
    """``data.decode: nvjpeg-gpu`` — needs a CUDA device."""

    def __init__(self, cfg: TrainConfig, samples: Sequence[tuple[str, int]], *, rank: int, world_size: int,
                 device: torch.device | str, ahead: int = 1):
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(["data.decode=nvjpeg-gpu needs a CUDA GPU: use torchvision-cpu or pil on this machine"])
        super().__init__(cfg, samples, rank=rank, world_size=world_size, device=device, ahead=ahead)


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
                for buf, lengths, labels in self.batches:
                    if self.stopping.is_set():
                        return
                    if p.stream is not None:
                        # nvJPEG writes its outputs from its own stream; memory this stream freed (the last batch's
                        # temporaries) may be handed to those outputs only once this stream's reads of it are done.
                        p.stream.synchronize()
                    images, labels = p.prepare(buf, lengths, labels, self.generator)
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

