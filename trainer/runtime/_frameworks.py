"""What the framework adapters (``trainer.runtime.lightning``, ``.accelerate``, ``.transformers``) share: a run
that a framework drives instead of the script's own loop. The settings are still applied by ``trainer.apply``'s helpers
(the DataLoader's arguments, the DDP wrapper's, layout and compile, the optimizer's first step); this module only
hands each helper the run's values, with the framework object's own as the script's defaults. The train loader the
framework iterates is the run's ``Batches`` (``batches``), as ``run.loader``'s is: on the device, in channels_last
when the run asks, and in a stage's modes the loader alone or its first batch replayed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from trainer.apply import data_loader, ddp_args, loader_settings
from trainer.config import DDPConfig
from trainer.knobs import table
from trainer.runtime._base import _UNSET, DDP_WRAPPER, LOADER, ScriptError
from trainer.runtime._loaders import Batches
from trainer.runtime._run import Run

PRECISIONS = ("fp32", "bf16", "fp16")
"""The run's precision values, each with a name in every framework (``trainer.knobs``' precision choices)."""

# The DataLoader arguments a rebuilt loader keeps from the script's own (the run's settings replace the rest).
_KEPT = ("collate_fn", "drop_last", "timeout", "worker_init_fn", "multiprocessing_context", "generator", "in_order")


def missing(framework: str, error: ImportError) -> ScriptError:
    """The framework a script's adapter needs is not installed: the one line naming the install."""
    return ScriptError([f"{framework} is not installed ({error}): pip install 'ddp-autotune[{framework}]'"])


class FrameworkRun:
    """A ``trainer.runtime.Run`` that a framework's loop drives: its settings and reports, with the framework's
    arguments translated by the adapter, through the run's parts (``Run.parts``). Any other attribute is the run's
    (``rank``, ``in_search``, ``epochs``, ``close``, a declared setting)."""

    def __init__(self, run: Run):
        self.run = run
        self._parts = run.parts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run, name)

    def apply(self, name: str, default: Any = _UNSET) -> Any:
        """The run's value of a setting (else ``default``, the framework object's own), recorded as applied: a
        setting the adapter applies is one the search may change."""
        return self._parts.settings.apply(name, default)

    def applied(self, name: str, default: Any = None) -> Any:
        """The value of a setting as applied (by the adapter or the run), else ``default``."""
        return self._parts.settings.applied(name, default)

    def record(self, name: str, value: Any) -> None:
        """Record ``value`` as the setting the framework really runs (its own default where the run gave none)."""
        self._parts.settings.record(name, value)

    def ready(self) -> None:
        """The run is ready to step (the framework's fit starts): the ``ready`` record, once."""
        self._parts.measure.ready()

    def on_close(self, release: Callable[[], None]) -> None:
        """``release`` runs when the run closes: what the adapter patched for the trial is put back."""
        self._parts.on_close(release)

    @property
    def training_loader(self) -> Batches | None:
        """The batches the framework iterates for training (``batches``), once it was handed them."""
        return self._parts.loaders.training

    def loader(self, loader: DataLoader) -> DataLoader:
        """The script's DataLoader rebuilt with the run's batch size and loader settings (its own values are the
        script's defaults) through ``trainer.apply.data_loader``; its dataset, sampler, collate function and the
        rest stay the script's."""
        if not isinstance(loader, DataLoader):
            return loader  # an iterable of the script's own: nothing of it the run could set
        if loader.batch_size is None:
            raise ScriptError(["the script's DataLoader has its own batch_sampler, so the run cannot set its batch "
                               "size: give it batch_size= (and sampler=) instead"])
        args = {name: self.apply(name, getattr(loader, name)) for name in LOADER}
        batch_size = args.pop("batch_size")
        kept = {k: getattr(loader, k) for k in _KEPT if hasattr(loader, k)}
        if not isinstance(loader.dataset, IterableDataset):
            kept["sampler"] = loader.sampler
        rebuilt = data_loader(loader.dataset, loader_settings(**args), self.run.device, batch_size=batch_size, **kept)
        self._parts.settings.record("prefetch_factor", rebuilt.prefetch_factor)
        return rebuilt

    def batches(self, loader: Any, samples: Callable[[Any], int] | None = None) -> Batches:
        """The loader the framework iterates for training (after the framework sharded it over the ranks) as the
        run's batches: what ``run.loader`` hands a script of its own loop. ``samples(batch)``: what a batch holds in
        the run's unit (default: its first tensor's length)."""
        if isinstance(loader, Batches):
            return loader  # run.image_loader's: the run's already
        return self._parts.loaders.adopt(loader, samples)

    def layout(self, module: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
        """The module on the run's device, in channels_last when the run asks (only a model with image-shaped
        weights applies a layout); returns it and whether its inputs go channels_last too."""
        return self._parts.steps.layout(module)

    def compiled(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` under torch.compile when the run asks, with its mode."""
        return self._parts.steps.compiled(module)

    def ddp_kwargs(self, given: dict[str, Any]) -> dict[str, Any]:
        """DistributedDataParallel's arguments: the run's wrapper settings (``given``'s values, the script's, as
        their defaults) through ``trainer.apply.ddp_args``; the script's other DDP arguments win, as in
        ``Run.model``."""
        fields = {name: table().by_runtime_name[name].path.partition(".")[2] for name in DDP_WRAPPER}
        wrapper = {f: self.apply(name, given.get(f, _UNSET)) for name, f in fields.items()}
        return {**ddp_args(DDPConfig(**wrapper)), **{k: v for k, v in given.items() if k not in wrapper}}

    def report(self, samples: int, loss: Any = None, *, final: bool | None = None) -> bool:
        """After each micro-batch the framework ran (forward and backward; the framework steps the optimizer every
        ``accum_steps``): its samples and loss into the run's meter. True once the trial is measured. ``final``:
        whether the framework stepped the optimizer after it (both frameworks also step at an epoch's last batch,
        where a group of micro-batches is cut short); None: every ``accum_steps``-th."""
        self.ready()
        self.run.micro_step(stepped=final)
        if isinstance(loss, dict):
            loss = loss.get("loss")
        return self.run.report(samples, loss)
