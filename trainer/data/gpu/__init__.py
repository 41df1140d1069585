"""The ``nvjpeg-gpu`` and ``hybrid`` input pipelines: loader workers read bytes; the rank's GPU
decodes and augments.

One CPU core decodes and crops a small fraction of the JPEGs one GPU trains ResNet-50 on, so on a GPU machine the CPU
paths cannot keep up however many workers they get (docs/benchmarks.md). nvJPEG keeps up when it decodes whole
batches; what remains is to keep everything after the decode batched too, and cheap in both device time and host
(GIL) time, because it shares the GPU and the process with training. Each module states why its choices are the fast
ones (``bench/pipeline_gpu.py`` times every stage; docs/benchmarks.md has the figures):

- ``datasets``: the worker side: one batch crosses the worker queue as a few tensors; ``hybrid``'s share is decoded
  in the workers.
- ``decode``: nvJPEG's CUDA decoder through torchvision.
- ``crop``: RandomResizedCrop, flip and normalization of a whole batch in a few batched kernels.
- ``pipeline``: the pipelines, which decode and augment one batch ahead in a thread, on a side CUDA stream.
"""

from __future__ import annotations

from trainer.data.gpu.pipeline import BatchedDecodePipeline, GpuDecodePipeline, HybridDecodePipeline

__all__ = ["BatchedDecodePipeline", "GpuDecodePipeline", "HybridDecodePipeline"]
