"""A Lightning script tuned by ``autotune search --script`` without rewriting its loop: three wrapped objects.

    from trainer.runtime import lightning as tuned

    run = tuned.setup(unit="images")                    # as trainer.runtime.setup
    data = run.datamodule(MyDataModule())               # its train loader with the run's loader settings
    model = run.module(MyModule())                      # channels_last, torch.compile
    trainer = run.trainer(max_epochs=10, precision="16-mixed")   # L.Trainer(...) with the run's settings
    trainer.fit(model, datamodule=data)

The trial's settings reach the ``Trainer`` (``precision``: ``32-true``/``bf16-mixed``/``16-mixed``;
``accumulate_grad_batches``; a ``DDPStrategy`` with the bucket size, gradient-as-bucket-view and static graph, on the
process group the run started, gloo on the CPU), the train loader (batch size, workers, prefetch, pinned and
persistent workers; or, for an ImageFolder, the project's input pipelines: ``datamodule(dm, image_folder=...)``) and
the module; the script's own values are the defaults, so outside a search the Trainer is the one the script asked
for (DDP at every world size, as ``Run.model``). The train loader, once Lightning has sharded it, is the run's
batches (``trainer.runtime._loaders.Batches``, as ``run.loader``'s): on the device, channels_last when the run asks, and
in a stage's measurement the loader alone (``supply``: the trial ends inside the fit's first fetch, its model
unused) or its first batch replayed through the fit (``ceiling``). A callback reports every training batch into the
run's meter and stops the fit once the trial is measured (``trainer.should_stop``; a fit that will not stop, under
``min_epochs``, ends at the next batch). In a search a trial skips validation (its windows time training), runs
epochs until it is measured, saves no checkpoint and keeps Lightning's default log folder in the trial's own; outside
a search, logging, checkpoints and validation are the script's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from trainer.apply import prepare_optimizer
from trainer.exit_signals import rearm
from trainer.runtime._base import LOADER, ScriptError
from trainer.runtime._batches import first_length
from trainer.runtime._frameworks import PRECISIONS, FrameworkRun, missing
from trainer.runtime._loaders import Batches
from trainer.runtime._run import setup as _setup

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
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

    def datamodule(self, data, *, image_folder: str | None = None, image_size: int = 224):
        """A LightningDataModule (or a LightningModule with its own ``train_dataloader``) whose train loader is
        rebuilt with the run's loader settings; its other loaders stay the script's.

        ``image_folder``: its train loader is ``run.image_loader(image_folder, image_size=image_size)`` instead, with
        its DataLoader's batch size, workers, prefetch and pinning as the defaults: the project's input pipelines
        (PIL, libjpeg-turbo, nvJPEG, a split of each batch, DALI: the ``decode`` setting) with their random-resized
        crop, flip and ImageNet normalization, sharded over the ranks by the run (Lightning shards only a
        DataLoader, so it leaves these alone), on the device. For a DataModule whose training transform is that
        recipe; its own dataset then goes unread for training."""
        own = data.train_dataloader
        if image_folder is None:
            data.train_dataloader = lambda: self.loader(own())
        else:
            data.train_dataloader = lambda: self._images(own(), str(image_folder), image_size)
        return data

    def _images(self, loader: Any, folder: str, image_size: int) -> Batches:
        """``run.image_loader`` with the script's DataLoader's settings as its defaults."""
        given = {name: getattr(loader, name, None) for name in LOADER} if isinstance(loader, DataLoader) else {}
        return self.image_loader(folder, image_size=image_size, **{k: v for k, v in given.items() if v is not None})

    def module(self, module: pl.LightningModule):
        """The LightningModule in channels_last when the run asks (its training batches are the run's, in the same
        layout) and under torch.compile when the run asks; Lightning unwraps a compiled module and compiles it
        again inside its strategy."""
        return self.compiled(self.layout(module)[0])

    def trainer(self, *, samples: Callable[[Any], int] | None = None, **kwargs: Any) -> pl.Trainer:
        """``lightning.pytorch.Trainer(**kwargs)`` with the run's settings (``trainer_args``); the train loader it
        iterates is the run's batches. ``samples(batch)``: what a batch holds in the run's unit (default: its first
        tensor's length)."""
        trainer = pl.Trainer(**self.trainer_args(samples=samples, **kwargs))
        # The strategy's hook for what it makes of each loader, after Lightning sharded it (its DistributedSampler).
        own = trainer.strategy.process_dataloader
        trainer.strategy.process_dataloader = lambda loader: self._train_loader(trainer, own(loader), samples)
        return trainer

    def _train_loader(self, trainer: pl.Trainer, loader: Any, samples: Callable[[Any], int] | None) -> Any:
        """The fit's train loader as the run's batches; validation's, test's and prediction's stay the script's.
        Batches that never end an epoch (the ceiling's, a search's image pipeline) go without a length: Lightning
        runs them as one epoch until the trial is measured."""
        if not trainer.training:
            return loader
        batches = self.batches(loader, samples)
        return _Endless(batches) if batches.endless else batches

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
        args.update(self._ranks(args))
        if cuda and "cudnn_benchmark" in self.run.request.settings:
            args["benchmark"] = self.applied("cudnn_benchmark")
        callbacks = args.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if self.run.in_search:
            # A trial's windows time training alone, over as many epochs as it takes to settle (run.epochs' rule);
            # what it leaves is the trial's: no checkpoint, Lightning's default logs in the trial's folder.
            args.update(max_epochs=-1, max_steps=-1, max_time=None, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_checkpointing=False)
            callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
            if self.run.request.result:
                args["default_root_dir"] = str(Path(self.run.request.result).resolve().parent)
            args.setdefault("enable_progress_bar", False)
            args.setdefault("enable_model_summary", False)
        args["callbacks"] = [*callbacks, Report(self, samples)]
        return args

    def _ranks(self, args: dict[str, Any]) -> dict[str, Any]:
        """``devices`` and ``num_nodes``: one device per process of the group that exists (the run's or torchrun's).
        In a run the tool started (a search's trial, ``autotune train``) it chose those processes, so they stand
        whatever the script passed (``"auto"`` counts one CPU device, and Lightning refuses a world of two); run on
        its own, the script's values stand. A difference is said in one line of the run's log."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        ranks = {"devices": local, "num_nodes": max(1, self.run.world_size // local)}
        if not self.run.request.measured:
            return {k: args.get(k, v) for k, v in ranks.items()}
        differ = {k: args[k] for k in ranks if k in args and args[k] != ranks[k]}
        if differ and self.run.rank == 0:
            given = ", ".join(f"{k}={v!r}" for k, v in differ.items())
            print(f"autotune: the run has {self.run.world_size} rank(s) (devices={ranks['devices']}, "
                  f"num_nodes={ranks['num_nodes']}): the script's {given} stands when it runs on its own",
                  file=sys.stderr, flush=True)
        return ranks

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


class _Endless:
    """Batches that never end an epoch, as Lightning is handed them: iterable, without a length."""

    def __init__(self, batches: Batches):
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


class Report(pl.Callback):
    """Every training batch into the run's meter; the fit stops once the trial is measured."""

    def __init__(self, run: LightningRun, samples: Callable[[Any], int] | None = None):
        self.run, self.samples = run, samples or first_length

    def on_train_start(self, trainer: pl.Trainer, pl_module) -> None:
        # Lightning's SIGTERM handler, installed as the fit began, replaced the rank's stack printer: a hang's report
        # stands on the stacks, and Lightning's handler still runs after them.
        rearm()
        # Fused SGD's momentum buffers before its first step (trainer.apply.prepare_optimizer).
        for optimizer in trainer.optimizers:
            prepare_optimizer(optimizer)
        if trainer.num_training_batches == 0:
            raise ScriptError([f"the train loader gave no batch (batch_size={self.run.applied('batch_size')} "
                               f"on {self.run.world_size} rank(s) is more than the data holds)"])
        self.run.ready()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module) -> None:
        # The epoch's shuffle and augmentation (an image pipeline's derive from it); Lightning sets a sampler's
        # epoch itself, not a pipeline's. Each epoch after the first iterates after this.
        batches = self.run.training_loader
        if batches is not None and not batches.endless:
            batches.set_epoch(trainer.current_epoch)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # Lightning steps every accumulate_grad_batches and at an epoch's last batch.
        accumulating = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
        final = not accumulating() if accumulating is not None else None
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and pl_module.automatic_optimization:
            # Lightning hands on the loss it backpropagates: the step's own divided by accumulate_grad_batches.
            loss = loss * trainer.accumulate_grad_batches
        if self.run.report(self.samples(batch), loss, final=final):
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module) -> None:
        self.run.run.epochs_done += 1
