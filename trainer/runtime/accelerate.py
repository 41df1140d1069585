"""An Accelerate script tuned by ``autotune search --script`` without rewriting its loop: its ``Accelerator`` made
by the run, and a report after each micro-batch.

    from trainer.runtime import accelerate as tuned

    run = tuned.setup(unit="tokens")                          # as trainer.runtime.setup
    accelerator = run.accelerator(mixed_precision="bf16")     # Accelerator(...) with the run's settings
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in run.epochs(10):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = ...
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if run.report(len(batch), loss):                  # True once the trial is measured
                break

The trial's settings reach the ``Accelerator`` (``mixed_precision``, ``gradient_accumulation_steps``, a
``DistributedDataParallelKwargs`` with the bucket size, gradient-as-bucket-view and static graph) and what its
``prepare`` is handed: a DataLoader is rebuilt with the run's batch size and loader settings before Accelerate
shards it, a model goes channels_last and is compiled (after Accelerate's DDP wrapper, as ``Run.model``), an
optimizer gets its first-step state. The loader ``prepare`` returns is the run's batches
(``trainer.runtime._loaders.Batches``, as ``run.loader``'s; ``len()``, ``set_epoch`` and every other attribute are
Accelerate's loader's): on the device, 4-D float inputs in channels_last when the run asks, and in a stage's
measurement the loader alone (``supply``: the trial ends inside the loop's first fetch) or its first batch replayed
(``ceiling``). ``run.accelerator(samples=...)`` says what a batch holds in the run's unit when it is not its first
tensor's length (tokens: ``lambda batch: batch[:, 1:].numel()``), so that the loader alone is measured in the unit
the loop reports. The script's own arguments are the defaults; outside a search the Accelerator is the one the
script asked for. Accelerate joins the process group the run started (gloo on CPUs, where it is told
``cpu=True``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer.apply import prepare_optimizer
from trainer.runtime._frameworks import PRECISIONS, FrameworkRun, missing
from trainer.runtime._run import setup as _setup

try:
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.state import AcceleratorState, GradientState
except ImportError as e:  # the one line a search prints; trainer.runtime itself never needs Accelerate
    raise missing("accelerate", e) from None

PRECISION = dict(zip(PRECISIONS, ("no", "bf16", "fp16"), strict=True))
"""The run's precision as Accelerate spells it (``mixed_precision``)."""

_FROM_ACCELERATE = {v: k for k, v in PRECISION.items()}


def setup(*, unit: str = "samples", **defaults: Any) -> AccelerateRun:
    """The run of this process (``trainer.runtime.setup``) with Accelerate's adapter."""
    return AccelerateRun(_setup(unit=unit, **defaults))


class AccelerateRun(FrameworkRun):
    """The run's settings as an ``Accelerator`` and its ``prepare`` take them."""

    def accelerator(self, *, samples: Callable[[Any], int] | None = None, **kwargs: Any) -> Accelerator:
        """``accelerate.Accelerator(**kwargs)`` with the run's settings (``accelerator_args``); its ``prepare``
        applies the run's loader, layout, compile and optimizer settings to what it is handed, and returns a
        loader as the run's batches. ``samples(batch)``: what a batch holds in the run's unit (default: its first
        tensor's length)."""
        # Accelerate keeps one state per process: a live worker's next trial may run another precision.
        AcceleratorState._reset_state()
        GradientState._reset_state()
        accelerator = self._accelerator = Accelerator(**self.accelerator_args(**kwargs))
        own = accelerator.prepare
        accelerator.prepare = lambda *objects, **kw: self._prepared(own, objects, kw, samples)
        return accelerator

    def accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The Accelerator's keyword arguments: the script's, with the run's mixed precision, accumulation and
        DDP arguments."""
        args = dict(kwargs)
        if self.run.device.type == "cpu":
            args.setdefault("cpu", True)  # Accelerate joins a CPU process group (gloo) only when told it is on CPUs
        precision = _FROM_ACCELERATE.get(str(args.get("mixed_precision") or "no"))
        if precision is not None:
            args["mixed_precision"] = PRECISION[self.apply("precision", precision)]
        args["gradient_accumulation_steps"] = int(self.apply("accum_steps",
                                                             int(args.get("gradient_accumulation_steps", 1))))
        handlers = list(args.get("kwargs_handlers") or [])
        own = next((h for h in handlers if isinstance(h, DistributedDataParallelKwargs)), None)
        given = own.to_kwargs() if own is not None else {}
        fields = {f.name for f in dataclasses.fields(DistributedDataParallelKwargs)}
        ddp = {k: v for k, v in self.ddp_kwargs(given).items() if k in fields}
        args["kwargs_handlers"] = [*(h for h in handlers if h is not own), DistributedDataParallelKwargs(**ddp)]
        return args

    def report(self, samples: int, loss: Any = None) -> bool:
        """After each micro-batch (the ``accumulate`` block): its samples and loss into the run's meter; True once
        the trial is measured. Accelerate says whether it stepped the optimizer (``sync_gradients``: every
        ``gradient_accumulation_steps``, and at the loader's end)."""
        accelerator = getattr(self, "_accelerator", None)
        return super().report(samples, loss, final=accelerator.sync_gradients if accelerator is not None else None)

    def _prepared(self, prepare, objects: tuple, kwargs: dict[str, Any], samples: Callable[[Any], int] | None):
        """Accelerate's ``prepare`` of the objects as the run wants them: the train loader rebuilt and models laid
        out before; models compiled, optimizers readied and the train loader made the run's batches after. The
        train loader is the first DataLoader prepared (Accelerate's convention: ``prepare(model, optimizer,
        train_loader, eval_loader)``); any later one (evaluation's) stays the script's."""
        train = next((o for o in objects if isinstance(o, DataLoader)), None) if self.training_loader is None else None
        before = [self.loader(o) if train is not None and o is train else
                  self.layout(o)[0] if isinstance(o, torch.nn.Module) else o for o in objects]
        out = prepare(*before, **kwargs)
        many = out if isinstance(out, tuple) else (out,)
        after = []
        for given, made in zip(objects, many, strict=True):
            if isinstance(given, torch.nn.Module):
                made = self.compiled(made)
            elif isinstance(given, torch.optim.Optimizer):
                prepare_optimizer(getattr(made, "optimizer", made))
            elif train is not None and given is train:
                made = self.batches(made, samples)
            after.append(made)
        return tuple(after) if isinstance(out, tuple) else after[0]
