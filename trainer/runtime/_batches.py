"""The batches a script's loader hands it, as the run wants them: on the run's device, and in a stage's modes the
loader alone (``supply``) or its first batch replayed on the device (``ceiling``).

Both stage modes need nothing more of a script than that its loader goes through ``run.loader`` or
``run.image_loader``: the supply is its input pipeline without the model (how much it can feed), the ceiling its
model without the input pipeline (a batch that is already on the device costs nothing to fetch) — the two numbers
the search's stages weigh for the built-in job too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.runtime._run import Run


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


class Batches:
    """Iterating yields the loader's batches on the run's device; ``len()``, ``set_epoch`` and any other attribute
    are the loader's (its ``sampler``, ``dataset``)."""

    def __init__(self, run: Run, loader, *, samples: Callable[[Any], int] | None = None, buffered: int = 0):
        self._run, self._loader, self._samples = run, loader, samples or first_length
        self.buffered = buffered
        """Batches the loader's workers have ready before the first step: the meter discards at least these."""

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def samples_per_rank(self) -> int | None:
        """How many samples of its data this rank sees per epoch (the largest batch it can fill), when the loader
        can tell: its sampler's length (a DistributedSampler's is per rank), else its dataset's over the ranks."""
        for get in (lambda: len(self._loader.sampler), lambda: len(self._loader.dataset) // self._run.world_size):
            try:
                return int(get())
            except (AttributeError, TypeError):
                continue
        return None

    def set_epoch(self, epoch: int) -> None:
        target = getattr(self._loader, "set_epoch", None) or getattr(getattr(self._loader, "sampler", None),
                                                                      "set_epoch", None)
        if target is not None:
            target(epoch)

    def __iter__(self) -> Iterator[Any]:
        run = self._run
        mode = run.request.mode
        if mode == "supply":
            self._supply()  # ends the run (TrialDone)
        run._mark_ready()
        channels_last = bool(run._value("channels_last"))
        if mode == "ceiling":
            first = to_device(next(iter(self._loader)), run.device, channels_last)
            while True:
                yield first
        for batch in self._loader:
            yield to_device(batch, run.device, channels_last)

    def _supply(self) -> None:
        """The loader alone, no model: batches to the device as fast as it delivers them, until the meter's windows
        agree; then the summary, and the trial ends."""
        from trainer.runtime._run import TrialDone

        run = self._run
        run._mark_ready()
        meter = run.meter = run._meter(continuous=False, buffered=self.buffered)
        checksum = torch.zeros((), device=run.device)
        epoch = 0
        channels_last = bool(run._value("channels_last"))
        while not meter.done:
            self.set_epoch(epoch)
            for batch in self._loader:
                moved = to_device(batch, run.device, channels_last)
                checksum += touch(moved).to(run.device)
                meter.step(images=self._samples(batch))
                run.steps += 1
                if meter.done:
                    break
            epoch += 1
        run.loss = checksum
        run._finish(loss_known=False)
        raise TrialDone()
