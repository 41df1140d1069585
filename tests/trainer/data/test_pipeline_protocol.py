"""Every input pipeline meets ``trainer.data.Pipeline``, the contract the training loop relies on: the protocol's
methods with its signatures, and (for each pipeline a CPU can build) what iterating yields and that ``close`` leaves
no worker or thread behind, so the next pipeline starts clean."""

from __future__ import annotations

import inspect
import multiprocessing
import threading

import pytest
import torch

from tests.trainer.data.common import config, samples_of
from trainer.data import Pipeline, build_pipeline
from trainer.data.cpu import LoaderPipeline
from trainer.data.gpu import BatchedDecodePipeline, GpuDecodePipeline, HybridDecodePipeline
from trainer.data.synthetic import SyntheticPipeline

PIPELINE_CLASSES = [LoaderPipeline, SyntheticPipeline, BatchedDecodePipeline, GpuDecodePipeline, HybridDecodePipeline]


def protocol_methods() -> dict[str, inspect.Signature]:
    # The methods declared in the protocol's own body (typing adds others to the class, e.g. __init__).
    return {name: inspect.signature(value) for name, value in vars(Pipeline).items()
            if inspect.isfunction(value) and value.__qualname__.startswith("Pipeline.")}


def test_the_protocol_is_the_loops_four_methods():
    assert sorted(protocol_methods()) == ["__iter__", "__len__", "close", "set_epoch"]


@pytest.mark.parametrize("cls", PIPELINE_CLASSES, ids=lambda cls: cls.__name__)
def test_every_pipeline_class_defines_the_protocol_methods(cls):
    # On the class: GpuDecodePipeline refuses to be built without CUDA. Parameter names must match too: the loop
    # may call set_epoch(epoch=...).
    for name, expected in protocol_methods().items():
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__}.{name} is missing"
        assert list(inspect.signature(method).parameters) == list(expected.parameters), f"{cls.__name__}.{name}"


def build_on_cpu(kind: str, folder):
    cpu = torch.device("cpu")
    files = {"data.path": str(folder), "loader.num_workers": 1, "loader.persistent_workers": True}
    if kind == "synthetic":
        return build_pipeline(config(**{"data.kind": "synthetic"}), rank=0, world_size=1, device=cpu)
    if kind in ("pil", "torchvision-cpu"):
        return build_pipeline(config(**files, **{"data.decode": kind}), rank=0, world_size=1, device=cpu)
    if kind == "hybrid":
        cfg = config(**files, **{"data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.5})
        return HybridDecodePipeline(cfg, samples_of(folder), rank=0, world_size=1, device=cpu)
    return BatchedDecodePipeline(config(**files), samples_of(folder), rank=0, world_size=1, device=cpu)


@pytest.mark.parametrize("kind", ["synthetic", "pil", "torchvision-cpu", "batched", "hybrid"])
def test_every_pipeline_yields_the_contract_and_closes_clean(folder, kind):
    for _ in range(2):  # closed, then built again in the same process
        pipe = build_on_cpu(kind, folder)
        assert isinstance(pipe, Pipeline)
        assert len(pipe) == (1000 if kind == "synthetic" else 72 // 8)
        pipe.set_epoch(1)
        images, labels = next(iter(pipe))  # left mid-epoch, as a measure run leaves it
        assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32 and images.device.type == "cpu"
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert labels.shape == (8,) and labels.dtype == torch.int64
        if kind != "synthetic":  # normalized: 0-255 pixels would average far above this
            assert torch.isfinite(images).all() and -3 < images.mean() < 3
        pipe.close()
        assert multiprocessing.active_children() == []
        assert not any(t.name == "gpu-decode" for t in threading.enumerate())
