"""The GPU-decode pipelines on a CPU device (decoding with libjpeg-turbo): one batch ahead in a thread, epochs,
labels, determinism, clean stops, the hybrid CPU/GPU split, and the hybrid path through the real 2-rank gloo job.
Of nvjpeg-gpu, what a CPU machine can check: its config error and its validation split."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from tests.jobutil import kinds, run_job, tiny_config
from tests.trainer.data.common import config, samples_of
from trainer.config import ConfigError
from trainer.data import build_pipeline
from trainer.data.cpu import DeviceNormalize, LoaderPipeline, TensorJPEGDataset, cpu_transforms
from trainer.data.gpu.datasets import JpegBytesDataset, collate_bytes
from trainer.data.gpu.pipeline import BatchedDecodePipeline, GpuDecodePipeline, HybridDecodePipeline


def test_gpu_pipeline_refuses_a_cpu_device(folder):
    with pytest.raises(ConfigError) as e:
        GpuDecodePipeline(config(), samples_of(folder), rank=0, world_size=1, device="cpu")
    assert e.value.problems == ["data.decode=nvjpeg-gpu needs a CUDA GPU: use torchvision-cpu or pil on this machine"]


def test_nvjpeg_gpu_trains_on_the_gpu_and_validates_with_torchvision_cpu(folder):
    cfg = config(**{"data.decode": "nvjpeg-gpu", "data.path": str(folder), "data.val_fraction": 0.25,
                    "loader.num_workers": 0})
    with pytest.raises(ConfigError, match=r"data\.decode=nvjpeg-gpu needs a CUDA GPU"):
        build_pipeline(cfg, rank=0, world_size=1, device=torch.device("cpu"))
    val = build_pipeline(cfg, rank=0, world_size=1, device=torch.device("cpu"), split="val")
    assert isinstance(val, LoaderPipeline) and isinstance(val.loader.dataset, TensorJPEGDataset)
    images, labels = next(iter(val))
    assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32 and labels.dtype == torch.int64
    val.close()


def test_pipeline_epochs_labels_and_determinism(folder):
    samples = samples_of(folder)
    pipe = BatchedDecodePipeline(config(), samples, rank=1, world_size=2, device="cpu")
    assert len(pipe) == (72 // 2) // 8 == 4
    pipe.set_epoch(3)
    first = list(pipe)
    assert len(first) == 4
    for images, labels in first:
        assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32
        assert images.is_contiguous(memory_format=torch.channels_last) and labels.dtype == torch.int64
        assert torch.isfinite(images).all() and -3 < images.mean() < 3
    # Rank 1's share of DistributedSampler(seed, epoch 3), in batches: the labels say the order is the sampler's.
    order = list(pipe.sampler)
    assert torch.cat([lb for _, lb in first]).tolist() == [samples[i][1] for i in order[:32]]
    again = list(pipe)  # same epoch: the same files, crops and flips
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    pipe.set_epoch(4)
    other = list(pipe)
    assert not torch.equal(first[0][0], other[0][0])
    assert multiprocessing.active_children() == []  # each finished epoch shut its workers down
    pipe.close()


def test_pipeline_stops_cleanly_when_the_consumer_leaves_early(folder):
    pipe = BatchedDecodePipeline(config(**{"loader.persistent_workers": True}), samples_of(folder), rank=0,
                                 world_size=1, device="cpu")
    batches = iter(pipe)
    next(batches)  # the consumer holds the generator and walks away mid-epoch
    assert len(multiprocessing.active_children()) == 2
    assert any(t.name == "gpu-decode" for t in threading.enumerate())
    again = next(iter(pipe))  # a new epoch's iterator stops the abandoned one first
    assert again[0].shape == (8, 3, 48, 48)
    pipe.close()
    assert not any(t.name == "gpu-decode" for t in threading.enumerate())
    assert multiprocessing.active_children() == []


def test_pipeline_reraises_a_loader_error(folder, tmp_path):
    samples = [(str(tmp_path / "missing.jpg"), 0)] * 16
    pipe = BatchedDecodePipeline(config(), samples, rank=0, world_size=1, device="cpu")
    with pytest.raises(FileNotFoundError, match=r"missing\.jpg"):
        for _ in pipe:
            pass
    pipe.close()
    assert multiprocessing.active_children() == []
    with pytest.raises(ConfigError, match="cannot fill one batch"):
        BatchedDecodePipeline(config(), samples[:7], rank=0, world_size=1, device="cpu")


# ---- hybrid ----------------------------------------------------------------------------------------------------------


def test_hybrid_batch_is_the_cpu_share_then_the_gpu_share(folder):
    samples = samples_of(folder)
    cfg = config(**{"data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.25, "loader.num_workers": 0})
    pipe = HybridDecodePipeline(cfg, samples, rank=1, world_size=2, device="cpu")
    pipe.set_epoch(2)
    torch.manual_seed(5)  # no workers: the CPU share draws from this process's RNG
    images, labels = next(iter(pipe))
    pipe.close()
    batch = list(pipe.sampler)[:8]
    assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert labels.tolist() == [samples[i][1] for i in batch]

    torch.manual_seed(5)
    transform = cpu_transforms(cfg, train=True, decode="torchvision-cpu")
    cpu_part = torch.stack([TensorJPEGDataset(samples, transform)[i][0] for i in batch[:2]])
    normalize = DeviceNormalize(torch.device("cpu"), channels_last=True)
    torch.testing.assert_close(images[:2], normalize(cpu_part), atol=1e-5, rtol=1e-5)
    buf, lengths, _ = collate_bytes([JpegBytesDataset(samples)[i] for i in batch[2:]])
    generator = torch.Generator().manual_seed((cfg.training.seed * 100_003 + 2) * 4_099 + 1)
    torch.testing.assert_close(images[2:], pipe.decode_and_crop(buf, lengths, generator), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_hybrid_extremes_and_determinism(folder, fraction):
    pipe = HybridDecodePipeline(config(**{"data.decode": "hybrid", "data.hybrid_cpu_fraction": fraction}),
                                samples_of(folder), rank=0, world_size=2, device="cpu")
    pipe.set_epoch(1)
    first = list(pipe)
    assert len(first) == 4 and all(x.shape == (8, 3, 48, 48) and torch.isfinite(x).all() for x, _ in first)
    again = list(pipe)  # workers reseeded from (seed, epoch, rank): the same crops
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    pipe.set_epoch(2)
    assert not torch.equal(first[0][0], next(iter(pipe))[0])
    pipe.close()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_hybrid_runs_in_the_real_job(tiny_jpegs, tmp_path):
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(tiny_jpegs), "data.decode": "hybrid",
                         "data.hybrid_cpu_fraction": 0.5})
    code, records, log = run_job(cfg, tmp_path)
    assert code == 0, log
    windows, (summary,) = kinds(records, "window"), kinds(records, "summary")
    assert len(windows) >= 3 and all(w["images"] == w["steps"] * 4 * 2 for w in windows)
    assert summary["loss_finite"] and summary["imgs_per_s"] > 0
