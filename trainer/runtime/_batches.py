"""What the runtime does with one batch of a script's loader, whatever its structure (a tensor, or tuples, lists,
dicts and named tuples of them): move it to the run's device, count its samples, touch every tensor of it; and what
it reads of the loader itself: how much of the data one rank holds, how many batches its workers prefetch."""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device, channels_last: bool) -> Any:
    """Every tensor of a batch (a tensor, or tuples, lists and dicts of them) on ``device``; 4-D floating tensors
    (images) in channels_last when asked."""
    if isinstance(batch, torch.Tensor):
        t = batch.to(device, non_blocking=True)
        if channels_last and t.ndim == 4 and t.is_floating_point():
            t = t.contiguous(memory_format=torch.channels_last)
        return t
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device, channels_last) for b in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device, channels_last) for k, v in batch.items()}
    return batch


def first_length(batch: Any) -> int:
    """A batch's size: the length of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, (list, tuple)) and batch:
        return first_length(batch[0])
    if isinstance(batch, dict) and batch:
        return first_length(next(iter(batch.values())))
    raise TypeError("cannot tell how many samples a batch holds: pass run.loader(..., samples=lambda batch: N)")


def touch(batch: Any) -> torch.Tensor:
    """A device scalar that depends on every tensor of the batch, so that no lazy copy is skipped."""
    if isinstance(batch, torch.Tensor):
        return batch.reshape(-1)[:1].float().sum() if batch.numel() else torch.zeros((), device=batch.device)
    parts = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    return sum((touch(b) for b in parts), torch.zeros(()))


def samples_per_rank(loader: Any, world_size: int) -> int | None:
    """How many samples of its data one rank sees per epoch (the largest batch it can fill), when the loader can
    tell: a ``DistributedSampler``'s length (per rank), else its dataset's over the ranks. Any other sampler's
    length is not taken: a framework's shard (Accelerate's) keeps the whole dataset's sampler and shards the
    batches."""
    from torch.utils.data import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        return len(sampler)
    try:
        return len(loader.dataset) // world_size
    except (AttributeError, TypeError):  # no dataset, or an IterableDataset without a length
        return None


def prefetched(loader: Any) -> int:
    """Batches a DataLoader's workers have ready before the first step (the meter discards at least these)."""
    workers = getattr(loader, "num_workers", 0) or 0
    return workers * (getattr(loader, "prefetch_factor", None) or 2) if workers else 0
