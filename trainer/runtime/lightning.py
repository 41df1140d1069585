"""A Lightning script tuned by ``autotune search --script`` without rewriting its loop: three wrapped objects.

    from trainer.runtime import lightning as tuned

    run = tuned.setup(unit="images")                    # as trainer.runtime.setup
    data = run.datamodule(MyDataModule())               # its train loader with the run's loader settings
    model = run.module(MyModule())                      # channels_last (model and inputs), torch.compile
    trainer = run.trainer(max_epochs=10, precision="16-mixed")   # L.Trainer(...) with the run's settings
    trainer.fit(model, datamodule=data)

The trial's settings reach the ``Trainer`` (``precision``: ``32-true``/``bf16-mixed``/``16-mixed``;
``accumulate_grad_batches``; a ``DDPStrategy`` with the bucket size, gradient-as-bucket-view and static graph, on the
process group the run started, gloo on the CPU), the train loader (batch size, workers, prefetch, pinned and
persistent workers) and the module; the script's own values are the defaults, so outside a search the Trainer is
the one the script asked for (DDP at every world size, as ``Run.model``). A callback reports every training batch
into the run's meter and stops the fit once the trial is measured (``trainer.should_stop``; a fit that will not
stop, under ``min_epochs``, ends at the next batch). Lightning's logging and checkpointing are the script's; a
search's trial only skips validation (its windows time training) and runs epochs until it is measured.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from trainer.apply import prepare_optimizer
from trainer.runtime._batches import first_length, to_device
from trainer.runtime._frameworks import PRECISIONS, FrameworkRun, missing
from trainer.runtime._run import ScriptError
from trainer.runtime._run import setup as _setup

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as e:  # the one line a search prints; trainer.runtime itself never needs Lightning
    raise missing("lightning", e) from None

PRECISION = dict(zip(PRECISIONS, ("32-true", "bf16-mixed", "16-mixed"), strict=True))
"""The run's precision as Lightning spells it."""

_FROM_LIGHTNING = {"32": "fp32", "32-true": "fp32", "bf16": "bf16", "bf16-mixed": "bf16", "16": "fp16",
                   "16-mixed": "fp16"}
# Precisions a search can change; any other (64-true, transformer-engine, ...) stays the script's, unsearched.

_DDP = ("ddp", "auto", "ddp_find_unused_parameters_true")


def setup(*, unit: str = "samples", **defaults: Any) -> LightningRun:
    """The run of this process (``trainer.runtime.setup``) with Lightning's adapters."""
    return LightningRun(_setup(unit=unit, **defaults))


class LightningRun(FrameworkRun):
    """The run's settings as a Lightning ``Trainer``, DataModule and LightningModule take them."""

    def datamodule(self, data):
        """A LightningDataModule (or a LightningModule with its own ``train_dataloader``) whose train loader is
        rebuilt with the run's loader settings; its other loaders stay the script's."""
        own = data.train_dataloader
        data.train_dataloader = lambda: self.loader(own())
        return data

    def module(self, module: pl.LightningModule):
        """The LightningModule in channels_last (its 4-D float inputs too, after Lightning moved them) and under
        torch.compile when the run asks; Lightning unwraps a compiled module and compiles it again inside its
        strategy."""
        module, channels_last = self.layout(module)
        if channels_last:
            own = module.on_after_batch_transfer
            device = self.run.device
            module.on_after_batch_transfer = lambda batch, i: to_device(own(batch, i), device, True)
        return self.compiled(module)

    def trainer(self, *, samples: Callable[[Any], int] | None = None, **kwargs: Any) -> pl.Trainer:
        """``lightning.pytorch.Trainer(**kwargs)`` with the run's settings (``trainer_args``). ``samples(batch)``:
        what a batch holds in the run's unit (default: its first tensor's length)."""
        return pl.Trainer(**self.trainer_args(samples=samples, **kwargs))

    def trainer_args(self, *, samples: Callable[[Any], int] | None = None, **kwargs: Any) -> dict[str, Any]:
        """The Trainer's keyword arguments: the script's, with the run's precision, accumulation, DDP strategy and
        devices, and the callback that reports every training batch."""
        args = dict(kwargs)
        precision = _FROM_LIGHTNING.get(str(args.get("precision", "32-true")))
        if precision is not None:
            args["precision"] = PRECISION[self.apply("precision", precision)]
        args["accumulate_grad_batches"] = int(self.apply("accum_steps", int(args.get("accumulate_grad_batches", 1))))
        args["strategy"] = self._strategy(args.get("strategy", "auto"))
        cuda = self.run.device.type == "cuda"
        args.setdefault("accelerator", "gpu" if cuda else "cpu")
        # The process group exists (the run's or torchrun's world): one device per process of it.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        args.setdefault("devices", local)
        args.setdefault("num_nodes", max(1, self.run.world_size // local))
        if cuda and "cudnn_benchmark" in self.run.request.settings:
            args["benchmark"] = self.run._applied["cudnn_benchmark"]
        callbacks = args.get("callbacks") or []
        args["callbacks"] = [*(callbacks if isinstance(callbacks, list) else [callbacks]), Report(self, samples)]
        if self.run.in_search:
            # A trial's windows time training alone, over as many epochs as it takes to settle (run.epochs' rule).
            args.update(max_epochs=-1, max_steps=-1, max_time=None, limit_val_batches=0, num_sanity_val_steps=0)
            args.setdefault("enable_progress_bar", False)
        return args

    def _strategy(self, strategy):
        """A DDPStrategy with the run's DDP settings on the existing process group; the script's own DDPStrategy
        keeps its other arguments. Any other strategy (FSDP, DeepSpeed) stays the script's, its DDP settings
        unsearched."""
        if isinstance(strategy, str) and strategy in _DDP:
            given = {"find_unused_parameters": True} if strategy.endswith("_true") else {}
            return DDPStrategy(process_group_backend=dist.get_backend(), **self.ddp_kwargs(given))
        if type(strategy) is DDPStrategy:
            strategy._ddp_kwargs = self.ddp_kwargs(dict(strategy._ddp_kwargs))
        return strategy


class Report(pl.Callback):
    """Every training batch into the run's meter; the fit stops once the trial is measured."""

    def __init__(self, run: LightningRun, samples: Callable[[Any], int] | None = None):
        self.run, self.samples = run, samples or first_length

    def on_train_start(self, trainer: pl.Trainer, pl_module) -> None:
        # Fused SGD's momentum buffers before its first step (trainer.apply.prepare_optimizer).
        for optimizer in trainer.optimizers:
            prepare_optimizer(optimizer)
        if trainer.num_training_batches == 0:
            raise ScriptError([f"the train loader gave no batch (batch_size={self.run.run._applied.get('batch_size')} "
                               f"on {self.run.world_size} rank(s) is more than the data holds)"])
        self.run.run._mark_ready()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # Lightning steps every accumulate_grad_batches and at an epoch's last batch.
        accumulating = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
        final = not accumulating() if accumulating is not None else None
        if self.run.report(self.samples(batch), outputs, final=final):
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module) -> None:
        self.run.run.epochs_done += 1
