"""The ``dali`` input pipeline: NVIDIA DALI reads, decodes and augments each batch
(``pip install 'ddp-autotune[dali]'``).

What MLPerf's ResNet-50 submissions feed NVIDIA GPUs with: a JPEG decode on the ``mixed`` device shared between the
GPU's hardware JPEG engines and CUDA (``hw_decoder_load``: the engines' share), resize and crop-mirror-normalize on
the GPU, all prefetched on DALI's own stream (``prefetch_queue_depth``) and handed to torch on the training stream.
The graph's shape is the run's to choose (``data.dali_crop``, ``dali_half_out``, ``dali_antialias``): decode and
random crop fused in one operator (``fn.decoders.image_random_crop``: only the crop's part of each JPEG is decoded)
or the whole image decoded and cropped after, as MLPerf's pipeline does; float32 or float16 out.

The files are read by DALI's own file reader, sharded by rank and reshuffled every epoch as DistributedSampler does
(its own permutation of the same seed, not the other pipelines' order). No Python runs per batch but the hand-over:
files fed from Python threads through an external source leave the device idle for a large share of a step, DALI's
reader for much less (docs/benchmarks.md). Validation images go through the same pipeline without augmentation
(resize, centre crop).

On a CPU device the same graph runs on DALI's CPU operators (``device='cpu'``): the tests check shapes, labels,
sharding and the close there; the mixed device needs a GPU.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from trainer.config import ConfigError, TrainConfig
from trainer.data.cpu import IMAGENET_MEAN, IMAGENET_STD, UnreadableImage
from trainer.knobs import DALI_INSTALL

READER = "reader"
"""The name of the pipeline's file reader."""

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


def decoder_args(cfg: TrainConfig, *, on_gpu: bool) -> dict:
    """The JPEG decoder's arguments: on a GPU the ``mixed`` device, the hardware engines' share and where the rest is
    Huffman-decoded (threshold 0: every image above it, all of them, with the GPU's help; DALI's default sends images
    under a megapixel to its CPU threads); else DALI's CPU decoder."""
    d = cfg.data
    if not on_gpu:
        return {"device": "cpu"}
    return {"device": "mixed", "hw_decoder_load": d.dali_hw_decoder_load,
            **({"hybrid_huffman_threshold": 0} if d.dali_gpu_huffman else {})}


def half_out(cfg: TrainConfig) -> bool:
    """Whether the pipeline emits float16 images: asked for (``data.dali_half_out``) and the run computes in fp16 or
    bf16 (autocast casts them on; an fp32 model's first layer takes float32 only)."""
    return cfg.data.dali_half_out and cfg.training.precision != "fp32"


def _graph(dali, files: list[str], cfg: TrainConfig, *, train: bool, on_gpu: bool, rank: int, world_size: int):
    """The pipeline's operators: DALI's file reader over this rank's shard (each sample's label is its index into
    ``files``), decode (training: of the random crop alone, or of the whole image cropped after:
    ``data.dali_crop``), resize, crop-mirror-normalize to the run's layout and dtype; the indices beside."""
    fn, types = dali.fn, dali.types
    d = cfg.data
    size = d.image_size
    # Every epoch is the whole set reshuffled (the first by the pre-shuffled list, the next ones by DALI) and split
    # into contiguous shards, as DistributedSampler does; a shard's last batch is padded, so no batch straddles two
    # epochs (DaliPipeline drops it, as drop_last does). Validation reads its own shard in order, once per pass.
    encoded, index = fn.readers.file(files=files, labels=list(range(len(files))), shard_id=rank,
                                     num_shards=world_size, random_shuffle=False, shuffle_after_epoch=train,
                                     stick_to_shard=not train, pad_last_batch=True, seed=cfg.training.seed,
                                     name=READER)
    decoder = decoder_args(cfg, on_gpu=on_gpu)
    resize = {"interp_type": types.INTERP_LINEAR, "antialias": d.dali_antialias}
    crop = {"random_area": list(d.crop_scale), "random_aspect_ratio": list(d.crop_ratio), "num_attempts": 10}
    if train and d.dali_crop == "roi":
        images = fn.decoders.image_random_crop(encoded, output_type=types.RGB, **crop, **decoder)
        images = fn.resize(images, resize_x=size, resize_y=size, **resize)
    elif train:
        images = fn.decoders.image(encoded, output_type=types.RGB, **decoder)
        images = fn.random_resized_crop(images, size=[size, size], **crop, **resize)
    else:
        images = fn.decoders.image(encoded, output_type=types.RGB, **decoder)
        images = fn.resize(images, resize_shorter=round(size / VAL_RESIZE), **resize)
    mirror = fn.random.coin_flip(probability=0.5) if train and d.hflip else 0
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16 if half_out(cfg) else types.FLOAT,
                                      crop=(size, size), mirror=mirror,
                                      output_layout="HWC" if cfg.training.channels_last else "CHW",
                                      mean=[255 * m for m in IMAGENET_MEAN], std=[255 * s for s in IMAGENET_STD])
    return images, index.gpu() if on_gpu else index


class DaliPipeline:
    """A ``trainer.data.Pipeline`` over DALI: iterating yields ``(images, labels)`` on the device (float32, or
    float16 under ``half_out``; normalized, channels_last when configured; int64); ``len()``, ``set_epoch``, ``close``.

    Training: each epoch this rank's shard of the reshuffled set, ``len()`` full batches (the same count on every
    rank, as DistributedSampler's ``drop_last``); a measure or loader run (``training.mode`` other than ``train``)
    reads one endless stream of epochs, as ``StreamingSampler`` does for the other pipelines.
    ``train=False``: validation, this rank's contiguous shard of the files in order (disjoint, unpadded, the last
    batch partial), no augmentation."""

    def __init__(self, cfg: TrainConfig, samples: Sequence[tuple[str, int]], *, train: bool, rank: int,
                 world_size: int, device: torch.device | str):
        dali = import_dali()
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        batch = cfg.training.batch_size
        if train and len(samples) < batch * world_size:
            raise ConfigError([(f"{len(samples)} training images cannot fill one batch of {batch} on each of "
                                f"{world_size} ranks: lower training.batch_size or add images")])
        self.train, self.batch = train, batch
        self.endless = train and cfg.training.mode != "train"
        self.channels_last = cfg.training.channels_last
        if train:
            # The reader's shards move round the ranks from epoch to epoch, so all are made the same size: the few
            # images beyond a multiple of the world size (fewer than one per rank), drawn by the run's seed, are left
            # out.
            order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.training.seed)).tolist()
            samples = [samples[i] for i in order[:len(samples) - len(samples) % world_size]]
        self.samples = samples
        self._labels = torch.tensor([label for _, label in samples], dtype=torch.int64, device=self.device)
        # DALI's shards: [floor(r * n / w), floor((r + 1) * n / w)).
        n = len(samples)
        self.shard = range(rank * n // world_size, (rank + 1) * n // world_size)
        per_epoch = -(-len(self.shard) // batch)  # batches DALI yields per epoch, the last padded
        self._len = len(self.shard) // batch if train else per_epoch
        self._skip = per_epoch - self._len  # a training epoch's padded last batch: run and dropped (drop_last)
        self._pos = 0  # batches taken in DALI's current epoch
        index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.on_gpu else None)
        # Each rank's augmentation differs (its seed), and repeats run to run, as the other pipelines' do.
        self.pipe = dali.Pipeline(batch_size=batch, num_threads=cfg.data.dali_threads, device_id=index,
                                  seed=cfg.training.seed * 1_000 + rank, prefetch_queue_depth=cfg.data.dali_prefetch,
                                  exec_async=True, exec_pipelined=True)
        with self.pipe:
            self.pipe.set_outputs(*_graph(dali, [path for path, _ in samples], cfg, train=train, on_gpu=self.on_gpu,
                                          rank=rank, world_size=world_size))
        self.pipe.build()
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        self._feed, self._torch_type = feed_ndarray, to_torch_type

    def __len__(self) -> int:
        return self._len

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do: DALI's reader reshuffles the set after each epoch it reads, from the run's seed."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.train:
            yield from self._validation()
            return
        taken = 0
        while self.endless or taken < self._len:
            if self._pos == self._len:  # the epoch's padded tail, beyond what every rank takes: dropped
                for _ in range(self._skip):
                    self._run()
                self._pos = 0
            self._pos += 1
            taken += 1
            yield self._run()

    def _validation(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        left = len(self.shard)
        for _ in range(self._len):
            images, labels = self._run()
            if left < self.batch:  # the padded last batch: its real samples only
                images, labels = images[:left], labels[:left]
            left -= len(labels)
            yield images, labels

    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        stream = torch.cuda.current_stream(self.device) if self.on_gpu else None
        try:
            images, index = self.pipe.run(stream) if stream is not None else self.pipe.run()
        except RuntimeError as e:
            raise self._unreadable(e) from None
        return self._torch(images, stream), self._labels[self._torch(index, stream).view(-1).long()]

    def _torch(self, batch, stream) -> torch.Tensor:
        dense = batch.as_tensor()
        out = torch.empty(dense.shape(), dtype=self._torch_type[dense.dtype], device=self.device)
        self._feed(dense, out, cuda_stream=stream)
        if self.channels_last and out.dim() == 4:
            return out.permute(0, 3, 1, 2)  # NHWC in memory: NCHW in shape, channels_last in strides
        return out

    def _unreadable(self, error: RuntimeError) -> Exception:
        """A decode that failed, as the file that fails it (DALI's message names no file, and its reader's order is
        its own): the first of this rank's files that PIL cannot read, checked on a thread pool (decoding at an
        eighth of the size, which still reads every byte of the entropy-coded data); else DALI's own error."""
        from PIL import Image

        def bad(path: str) -> str | None:
            try:
                with Image.open(path) as im:
                    im.draft("RGB", (im.width // 8 or 1, im.height // 8 or 1))
                    im.load()
            except (OSError, ValueError) as e:
                return f"cannot decode {path}: {type(e).__name__}: {e}; remove or replace the file"
            return None

        paths = [path for path, _ in self.samples] if self.train else [self.samples[i][0] for i in self.shard]
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            for found in pool.map(bad, paths):
                if found is not None:
                    return UnreadableImage(found)
        return error

    def close(self) -> None:
        """DALI's threads stopped (``Pipeline._shutdown``: what its own finalizer calls, the one way to stop them
        before the object is collected)."""
        pipe, self.pipe = getattr(self, "pipe", None), None
        if pipe is not None:
            pipe._shutdown()
