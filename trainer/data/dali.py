"""The ``dali`` input pipeline: NVIDIA DALI reads, decodes and augments each batch
(``pip install 'ddp-autotune[dali]'``).

What MLPerf's ResNet-50 feeds an H200 with: decode and random crop fused in one operator on the ``mixed`` device
(``fn.decoders.image_random_crop``: only the crop's part of each JPEG is decoded), the decode shared between the GPU's
hardware JPEG engines and CUDA (``hw_decoder_load``: the engines' share), resize and crop-mirror-normalize on the GPU,
all prefetched on DALI's own stream (``prefetch_queue_depth``) and handed to torch on the training stream.

The files are chosen by the project's own sampler (``trainer.data.sampling``), fed through an external source, so a
rank reads the same shard, epochs and shuffle as under the other pipelines; a small thread pool reads the files one
batch ahead. Validation images go through the same pipeline without augmentation (resize, centre crop).

On a CPU device the same graph runs on DALI's CPU operators (``device='cpu'``): the tests check shapes, labels,
sharding and the close there; the mixed device needs a GPU.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice

import torch

from trainer.config import ConfigError, TrainConfig
from trainer.data.cpu import IMAGENET_MEAN, IMAGENET_STD, UnreadableImage
from trainer.data.sampling import train_sampler
from trainer.knobs import DALI_INSTALL

VAL_RESIZE = 0.875
"""The crop's share of the resized short side in validation, as ``trainer.data.cpu``'s (224 of 256)."""


def import_dali():
    """``nvidia.dali`` with its torch plugin, or a ConfigError naming the extra that installs it."""
    try:
        dali = importlib.import_module("nvidia.dali")
        importlib.import_module("nvidia.dali.plugin.pytorch")
    except ImportError as e:
        if getattr(e, "name", None) and not str(e.name).startswith("nvidia"):
            problem = f"data.decode=dali: NVIDIA DALI does not load ({e}): reinstall it with {DALI_INSTALL}"
        else:
            problem = f"data.decode=dali needs NVIDIA DALI, which is not installed: {DALI_INSTALL}"
        raise ConfigError([problem]) from None
    except (OSError, RuntimeError) as e:  # a library of the wheel missing or the wrong CUDA
        raise ConfigError([f"data.decode=dali: NVIDIA DALI does not load ({e}): reinstall it with {DALI_INSTALL}"]) \
            from None
    return dali


class _Feeder:
    """DALI's external source: each call returns the next batch of the sampler's order as (encoded files, labels),
    read ``depth`` batches ahead by a thread pool (file reads release the GIL: the training thread only hands
    over). ``StopIteration`` at the end of an epoch (DALI's convention); the next call starts the next one."""

    def __init__(self, samples: Sequence[tuple[str, int]], order: Callable[[], Iterable[int]], *, batch: int,
                 drop_last: bool, threads: int, depth: int):
        import numpy as np

        self.np, self.samples, self.order = np, samples, order
        self.batch, self.drop_last, self.depth = batch, drop_last, depth
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="dali-read")
        self.pending: deque[tuple[list[int], Future]] = deque()
        self.handed: deque[list[int]] = deque(maxlen=depth + 2)
        """The samples of the batches last handed to DALI: where a decode error looks for its file."""
        self.indices: Iterator[int] | None = None

    def __call__(self):
        if self.indices is None:
            self.indices = iter(self.order())
        while len(self.pending) < self.depth and self._submit():
            pass
        if not self.pending:
            self.indices = None
            raise StopIteration
        batch, future = self.pending.popleft()
        self.handed.append(batch)
        return future.result()

    def _submit(self) -> bool:
        chosen = list(islice(self.indices, self.batch))
        if not chosen or (self.drop_last and len(chosen) < self.batch):
            return False
        self.pending.append((chosen, self.pool.submit(self._read, chosen)))
        return True

    def _read(self, chosen: list[int]):
        np = self.np
        files = []
        for i in chosen:
            path = self.samples[i][0]
            try:
                files.append(np.fromfile(path, dtype=np.uint8))
            except OSError as e:
                raise UnreadableImage(f"cannot read {path}: {e.strerror or e}; remove or replace the file") from None
        labels = np.array([[self.samples[i][1]] for i in chosen], dtype=np.int64)
        return files, labels

    def restart(self) -> None:
        """Forget the rest of the epoch in flight (its reads finish and are dropped)."""
        self.pending.clear()
        self.indices = None

    def close(self) -> None:
        self.restart()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _graph(dali, feeder: _Feeder, cfg: TrainConfig, *, train: bool, on_gpu: bool):
    """The pipeline's operators: decode (with the random crop when training), resize, crop-mirror-normalize to the
    run's layout; float32 out (``trainer.data.Pipeline``), labels beside."""
    fn, types = dali.fn, dali.types
    d = cfg.data
    size = d.image_size
    files, labels = fn.external_source(source=feeder, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64],
                                       no_copy=False)
    decoder = {"device": "mixed", "hw_decoder_load": d.dali_hw_decoder_load} if on_gpu else {"device": "cpu"}
    if train:
        images = fn.decoders.image_random_crop(files, output_type=types.RGB, random_area=list(d.crop_scale),
                                               random_aspect_ratio=list(d.crop_ratio), num_attempts=10, **decoder)
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=True)
        mirror = fn.random.coin_flip(probability=0.5) if d.hflip else 0
    else:
        images = fn.decoders.image(files, output_type=types.RGB, **decoder)
        images = fn.resize(images, resize_shorter=round(size / VAL_RESIZE), interp_type=types.INTERP_LINEAR,
                           antialias=True)
        mirror = 0
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, crop=(size, size), mirror=mirror,
                                      output_layout="HWC" if cfg.training.channels_last else "CHW",
                                      mean=[255 * m for m in IMAGENET_MEAN], std=[255 * s for s in IMAGENET_STD])
    return images, labels.gpu() if on_gpu else labels


class DaliPipeline:
    """A ``trainer.data.Pipeline`` over DALI: iterating yields ``(images, labels)`` on the device (float32,
    normalized, channels_last when configured; int64); ``len()``, ``set_epoch``, ``close``.

    ``train=False``: validation, rank::world of the files in order (disjoint, unpadded, the last batch partial), no
    augmentation."""

    def __init__(self, cfg: TrainConfig, samples: Sequence[tuple[str, int]], *, train: bool, rank: int,
                 world_size: int, device: torch.device | str):
        dali = import_dali()
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        batch, d = cfg.training.batch_size, cfg.data
        if train and len(samples) < batch * world_size:
            raise ConfigError([(f"{len(samples)} training images cannot fill one batch of {batch} on each of "
                                f"{world_size} ranks: lower training.batch_size or add images")])
        self.samples, self.train, self.batch = samples, train, batch
        self.channels_last = cfg.training.channels_last
        self.sampler = train_sampler(samples, cfg, rank=rank, world_size=world_size) if train else None
        shard = range(rank, len(samples), world_size)
        self.feeder = _Feeder(samples, (lambda: self.sampler) if train else (lambda: shard), batch=batch,
                              drop_last=train, threads=d.dali_threads, depth=d.dali_prefetch + 1)
        self._len = (len(self.sampler) // batch) if train else -(-len(shard) // batch)
        index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.on_gpu else None)
        # Each rank's augmentation differs (its seed), and repeats run to run, as the other pipelines' do.
        self.pipe = dali.Pipeline(batch_size=batch, num_threads=d.dali_threads, device_id=index,
                                  seed=cfg.training.seed * 1_000 + rank, prefetch_queue_depth=d.dali_prefetch,
                                  exec_async=True, exec_pipelined=True)
        with self.pipe:
            self.pipe.set_outputs(*_graph(dali, self.feeder, cfg, train=train, on_gpu=self.on_gpu))
        self.pipe.build()
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        self._feed, self._torch_type = feed_ndarray, to_torch_type
        self._started = False

    def __len__(self) -> int:
        return self._len

    def set_epoch(self, epoch: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._started:
            # A new epoch: DALI starts over from the source (whose sampler set_epoch has moved on).
            self.feeder.restart()
            self.pipe.reset()
        self._started = True
        while True:
            try:
                images, labels = self._run()
            except StopIteration:
                return
            yield images, labels

    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        stream = torch.cuda.current_stream(self.device) if self.on_gpu else None
        try:
            images, labels = self.pipe.run(stream) if stream is not None else self.pipe.run()
        except RuntimeError as e:
            raise self._unreadable(e) from None
        return self._torch(images, stream), self._torch(labels, stream).view(-1)

    def _torch(self, batch, stream) -> torch.Tensor:
        dense = batch.as_tensor()
        out = torch.empty(dense.shape(), dtype=self._torch_type[dense.dtype], device=self.device)
        self._feed(dense, out, cuda_stream=stream)
        if self.channels_last and out.dim() == 4:
            return out.permute(0, 3, 1, 2)  # NHWC in memory: NCHW in shape, channels_last in strides
        return out

    def _unreadable(self, error: RuntimeError) -> Exception:
        """A decode that failed, as the file that fails it (DALI's message names no file): the first of the
        batches last handed over that PIL cannot read; else DALI's own error."""
        from PIL import Image

        for chosen in reversed(self.feeder.handed):
            for i in chosen:
                path = self.samples[i][0]
                try:
                    with Image.open(path) as im:
                        im.load()
                except (OSError, ValueError) as e:
                    return UnreadableImage(f"cannot decode {path}: {type(e).__name__}: {e}; remove or replace "
                                           "the file")
        return error

    def close(self) -> None:
        """DALI's threads stopped (``Pipeline._shutdown``: what its own finalizer calls, the one way to stop them
        before the object is collected), then the file readers."""
        pipe, self.pipe = getattr(self, "pipe", None), None
        if pipe is not None:
            pipe._shutdown()
        feeder = getattr(self, "feeder", None)
        if feeder is not None:
            feeder.close()
