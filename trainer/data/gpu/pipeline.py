"""The GPU-decode pipelines: a DataLoader whose workers read bytes (``datasets``), then decode (``decode``) and
batched augmentation (``crop``) on the device.

Decode and augment run one batch ahead in a background thread (``_Producer``) on a high-priority side CUDA stream,
handed over with an event: decoding synchronously on the training stream would add the decode's time to every step
(docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence

import torch

from trainer.apply import data_loader
from trainer.config import ConfigError, TrainConfig
from trainer.data.cpu import cpu_transforms
from trainer.data.gpu.crop import batched_resized_crop, normalize_into, sample_crop_boxes
from trainer.data.gpu.datasets import HybridCollate, HybridDataset, JpegBytesDataset, collate_bytes, unpack_bytes
from trainer.data.gpu.decode import decode_batch
from trainer.data.sampling import epoch_seed, train_sampler


class BatchedDecodePipeline:
    """Byte-reading DataLoader + batched decode and augmentation on ``device``, one batch ahead in a thread.

    A ``trainer.data.Pipeline``: iterating yields ``(images, labels)`` on the device (float32, normalized,
    channels_last when configured; int64); ``len()`` is batches per epoch on this rank; ``set_epoch``; ``close``.
    On CUDA the work runs on a side stream and the consumer's stream waits on an event, so training kernels and the
    next batch's decode overlap. The side stream has high priority (``stream_priority``, lower is higher): its
    kernels are small and many, and at equal priority each one queues behind the training kernels that fill the GPU,
    which stretches the next batch's preparation well past its own GPU time. On a CPU device the same code decodes
    with libjpeg-turbo (used by the tests and the benchmark's smoke run; ``GpuDecodePipeline`` is what training
    uses).
    """

    def __init__(self, cfg: TrainConfig, samples: Sequence[tuple[str, int]], *, rank: int, world_size: int,
                 device: torch.device | str, ahead: int = 1, stream_priority: int = -1):
        self.device = torch.device(device)
        self.cfg = cfg
        batch = cfg.training.batch_size
        if len(samples) < batch * world_size:
            raise ConfigError([(f"{len(samples)} training images cannot fill one batch of {batch} on each of "
                                f"{world_size} ranks: lower training.batch_size or add images")])
        self.rank = rank
        self.dataset, collate = self._dataset(samples)
        self.sampler = train_sampler(self.dataset, cfg, rank=rank, world_size=world_size)
        self.loader = data_loader(self.dataset, cfg.loader, self.device, batch_size=batch, sampler=self.sampler,
                                  collate_fn=collate, drop_last=True, **self._loader_seeding())
        self.ahead, self.epoch = ahead, 0
        self.stream = (torch.cuda.Stream(self.device, priority=stream_priority) if self.device.type == "cuda"
                       else None)
        self._producer: _Producer | None = None

    def _dataset(self, samples):
        return JpegBytesDataset(samples), collate_bytes

    def _loader_seeding(self) -> dict:
        return {}

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.dataset.set_epoch(epoch)
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._producer is not None:  # an earlier iteration the consumer left unfinished
            self._producer.stop()
        # Crops and flips derive from (seed, epoch, rank): a resumed run replays its epoch's augmentation.
        generator = torch.Generator().manual_seed(epoch_seed(self.cfg.training.seed, self.epoch, self.rank))
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
        images = decode_batch(unpack_bytes(buf, lengths), self.device)
        heights = torch.tensor([im.shape[-2] for im in images])
        widths = torch.tensor([im.shape[-1] for im in images])
        boxes = sample_crop_boxes(heights, widths, scale=d.crop_scale, ratio=d.crop_ratio, generator=generator)
        flip = torch.rand(len(images), generator=generator) < 0.5 if d.hflip else None
        return batched_resized_crop(images, boxes, d.image_size, flip=flip,
                                    channels_last=self.cfg.training.channels_last, out=out)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.stop()
            self._producer = None
        iterator = getattr(self.loader, "_iterator", None)  # persistent workers live here between epochs
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


class GpuDecodePipeline(BatchedDecodePipeline):
    """``data.decode: nvjpeg-gpu`` — needs a CUDA device (checked here, before the workers start, so a machine
    without one gets a config error and not a crash mid-run)."""

    def __init__(self, cfg: TrainConfig, samples: Sequence[tuple[str, int]], *, rank: int, world_size: int,
                 device: torch.device | str, ahead: int = 1, stream_priority: int = -1):
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(["data.decode=nvjpeg-gpu needs a CUDA GPU: use torchvision-cpu or pil on this machine"])
        super().__init__(cfg, samples, rank=rank, world_size=world_size, device=device, ahead=ahead,
                         stream_priority=stream_priority)


class HybridDecodePipeline(BatchedDecodePipeline):
    """``data.decode: hybrid`` — ``data.hybrid_cpu_fraction`` of every batch is decoded and augmented by the loader
    workers (``HybridDataset``), the rest by nvJPEG's CUDA decoder (as ``nvjpeg-gpu``). The output is the CPU share
    (normalized on the device), then the CUDA share, labels alike. The fraction trades CPU cores for SM time, which
    is what the tuner balances. Works on a CPU device too: both shares then decode with libjpeg-turbo."""

    def _dataset(self, samples):
        transform = cpu_transforms(self.cfg, train=True, decode="torchvision-cpu")
        return (HybridDataset(samples, transform, self.cfg.data.hybrid_cpu_fraction,
                              seed=self.cfg.training.seed * 4_099 + self.rank),
                HybridCollate(self.cfg.data.image_size))

    def _loader_seeding(self) -> dict:
        # The CPU share's transforms draw from each worker's torch RNG, which the dataset reseeds from (seed, rank,
        # epoch, worker) at each epoch's first image (as the torchvision-cpu path does); the generator keeps the
        # workers' start off the run's own RNG.
        return {"generator": torch.Generator().manual_seed(self.cfg.training.seed)}

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
        except BaseException as e:
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
