"""A Hugging Face ``Trainer`` script tuned by ``autotune search --script`` without rewriting its loop: its
``TrainingArguments`` with the trial's settings, and a callback that reports each step.

    from trainer.runtime import transformers as tuned

    run = tuned.setup(unit="tokens")                                  # as trainer.runtime.setup
    args = run.training_args(TrainingArguments(per_device_train_batch_size=16, bf16=True, ...))
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                      callbacks=[run.callback()])                     # reports each step, stops once measured
    trainer.train()

The trial's settings reach the ``TrainingArguments`` the Trainer reads (``ARGUMENTS``: the batch per device,
gradient accumulation, ``bf16``/``fp16``, ``torch_compile`` and its mode, the DataLoader's workers, prefetch, pinned
and persistent workers, DDP's bucket size and static graph), each through the applier the built-in job and every
other adapter use; the script's own values are the defaults, so outside a search the arguments are the script's,
unchanged. Only what the Trainer takes from its arguments is applied, so only that is searched: the Trainer makes
its own DDP wrapper (no gradient-as-bucket-view), its own train loader (its supply and its first batch replayed are
not measured apart) and moves the model itself (no layout). Under DeepSpeed or FSDP its DDP settings stay unapplied.
The host's wait for each of the Trainer's batches is timed where its loop asks for it (``timed_loader``), so a
trial's step splits into its wait for data and the rest as a script's own loop does.

The callback reports every micro-batch the Trainer feeds its model: its samples (the collator's ``input_ids``: their
sequences, or their tokens under ``unit="tokens"``; or ``run.callback(samples=...)`` of the batch) and, at each
optimizer step, the step's loss as the Trainer logs it (the model's own loss over the step's micro-batches). It sets
``control.should_training_stop`` once the trial is measured. In a search a trial trains epochs until it is measured
(its learning-rate schedule as long as that), evaluates nothing, saves nothing and writes its output in the trial's
own folder; outside a search all of it is the script's.

The run starts the process group before the Trainer's arguments exist (gloo on CPUs, where the Trainer is told
``use_cpu``); in a run the tool started, its processes are that group whatever the script's ``use_cpu`` or
``ddp_backend``, and one line of the run's log says what the run overrode.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.apply import DATALOADER_PREFETCH, ddp_args, loader_args, loader_settings, prepare_optimizer
from trainer.config import DDPConfig
from trainer.knobs import table
from trainer.meter import timed_batches
from trainer.runtime._base import DDP_WRAPPER, LOADER, ScriptError
from trainer.runtime._batches import first_length
from trainer.runtime._frameworks import FrameworkRun, missing
from trainer.runtime._run import Run
from trainer.runtime._run import setup as _setup

try:
    from transformers import TrainerCallback, TrainingArguments
except ImportError as e:  # the one line a search prints; trainer.runtime itself never needs transformers
    raise missing("transformers", e) from None

ARGUMENTS = {"per_device_train_batch_size": "batch_size", "gradient_accumulation_steps": "accum_steps",
             "torch_compile": "compile", "torch_compile_mode": "compile_mode",
             "dataloader_num_workers": "num_workers", "dataloader_prefetch_factor": "prefetch_factor",
             "dataloader_pin_memory": "pin_memory", "dataloader_persistent_workers": "persistent_workers"}
"""The ``TrainingArguments`` a trial may set, by the setting (``trainer.knobs``) each carries; ``bf16``/``fp16`` carry
``precision``, and ``DDP_ARGUMENTS`` the DDP wrapper's. The Trainer's other arguments (``tf32``,
``ddp_find_unused_parameters``, ``ddp_broadcast_buffers``) have no setting and stay the script's."""

_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}
DDP_ARGUMENTS = {f"ddp_{field}": (name, field) for name, field in
                 ((n, table().by_runtime_name[n].path.partition(".")[2]) for n in DDP_WRAPPER)
                 if f"ddp_{field}" in _FIELDS}
"""The DDP wrapper's settings the Trainer takes as ``ddp_<DDPConfig field>`` (the others it never passes to DDP), by
their setting and their field."""

NO_CALLBACK = "pass callbacks=[run.callback()] to its Trainer (Trainer(..., callbacks=[run.callback()]))"

TRIAL_EPOCHS = 1_000_000
"""A search's trial trains until it is measured (``run.epochs``' rule): epochs without a practical end."""


def setup(*, unit: str = "samples", **defaults: Any) -> TransformersRun:
    """The run of this process (``trainer.runtime.setup``) with the Trainer's adapter."""
    return TransformersRun(_setup(unit=unit, **defaults))


class TransformersRun(FrameworkRun):
    """The run's settings as a Hugging Face ``Trainer`` takes them: its ``TrainingArguments`` and a callback."""

    def __init__(self, run: Run):
        super().__init__(run)
        run.report_fix = NO_CALLBACK  # a Trainer without the run's callback reports nothing: the fix is the callback

    def training_args(self, args: TrainingArguments) -> TrainingArguments:
        """The script's ``TrainingArguments`` with the run's settings; outside a run the tool started, the same
        object. A trial's values are validated by ``TrainingArguments`` itself (a copy made with them)."""
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"run.training_args() takes the script's TrainingArguments, not {type(args).__name__}")
        if args.auto_find_batch_size and self.run.request.measured:
            raise ScriptError(["TrainingArguments(auto_find_batch_size=True) lets the Trainer pick its own batch, so "
                               "the run cannot set per_device_train_batch_size: leave auto_find_batch_size out (a "
                               "search finds the batch that fits)"])
        changes = self._settings(args)
        if not self.run.request.measured:
            return args
        changes.update(self._ranks(args))
        self._guard()
        if self.run.in_search:
            # A trial's windows time training alone, over as many epochs as it takes to settle; what it leaves is
            # the trial's: no checkpoint, no evaluation, its output in the trial's folder.
            changes.update(num_train_epochs=TRIAL_EPOCHS, max_steps=-1, eval_strategy="no", eval_on_start=False,
                           save_strategy="no", load_best_model_at_end=False, push_to_hub=False, report_to="none",
                           disable_tqdm=True)
            if self.run.request.result:
                changes["output_dir"] = str(Path(self.run.request.result).resolve().parent / "trainer_output")
        changes = {k: v for k, v in changes.items() if getattr(args, k) != v}
        return dataclasses.replace(args, **changes) if changes else args

    def _guard(self) -> None:
        """A Trainer that trains without the run's callback is refused as its training starts: it would report
        nothing, and in a search train without end."""
        from transformers import Trainer

        own = Trainer.train
        if getattr(own, "autotune", False):
            return

        @functools.wraps(own)
        def train(trainer, *args, **kwargs):
            if not any(isinstance(c, Report) for c in trainer.callback_handler.callbacks):
                raise ScriptError([f"the Trainer trains without the run's callback: {NO_CALLBACK}"])
            return own(trainer, *args, **kwargs)

        train.autotune = True
        Trainer.train = train
        self.on_close(lambda: setattr(Trainer, "train", own))

    def _settings(self, args: TrainingArguments) -> dict[str, Any]:
        """The arguments that carry a setting, each the run's value (the script's own as its default), through the
        appliers of ``trainer.apply``."""
        own = {name: getattr(args, arg) for arg, name in ARGUMENTS.items()}
        precision = self.apply("precision", "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")
        compiled = own["compile"] or own["compile_mode"] is not None
        run: dict[str, Any] = {"batch_size": int(self.apply("batch_size", own["batch_size"])),
                               "accum_steps": int(self.apply("accum_steps", own["accum_steps"])),
                               "compile": bool(self.apply("compile", compiled))}
        # A mode turns compile on (TrainingArguments' own rule): it is a setting only where compile is.
        run["compile_mode"] = self.apply("compile_mode", own["compile_mode"]) if run["compile"] else None
        loader = loader_settings(**{name: self.apply(name, own[name]) for name in LOADER if name != "batch_size"})
        run.update(loader_args(loader, self.run.device))
        if run["num_workers"]:  # what the DataLoader really uses: its own depth where the script gave none
            self.record("prefetch_factor", run["prefetch_factor"] or DATALOADER_PREFETCH)
        out: dict[str, Any] = {"bf16": precision == "bf16", "fp16": precision == "fp16",
                               **{arg: run[name] for arg, name in ARGUMENTS.items()}}
        if not (args.deepspeed or args.fsdp):  # the Trainer's DDP arguments apply to its DDP wrapper only
            library = DDPConfig()
            given = {arg: getattr(args, arg) for arg in DDP_ARGUMENTS}
            wrapper = {field: self.apply(name, getattr(library, field) if given[arg] is None else given[arg])
                       for arg, (name, field) in DDP_ARGUMENTS.items()}
            ddp = ddp_args(DDPConfig(**wrapper))
            for arg, (_, field) in DDP_ARGUMENTS.items():
                # Left unset where the script left it and the run keeps DDP's own default.
                unset = given[arg] is None and ddp[field] == getattr(library, field)
                out[arg] = None if unset else ddp[field]
        return out

    def _ranks(self, args: TrainingArguments) -> dict[str, Any]:
        """The process group the run started, as the Trainer is told of it: ``use_cpu`` on CPUs (without it the
        Trainer's Accelerate state trains each CPU process alone) and the group's backend. The script's own values
        stand when it runs on its own; a difference is said in one line of the run's log."""
        ranks = {"use_cpu": self.run.device.type == "cpu"}
        if dist.is_initialized():
            ranks["ddp_backend"] = dist.get_backend()
        differ = {k: getattr(args, k) for k, v in ranks.items()
                  if getattr(args, k) != v and not (k == "ddp_backend" and args.ddp_backend is None)}
        if differ and self.run.rank == 0:
            given = ", ".join(f"{k}={v!r}" for k, v in differ.items())
            told = ", ".join(f"{k}={v!r}" for k, v in ranks.items() if k in differ)
            print(f"autotune: the run has {self.run.world_size} rank(s) on {self.run.device.type} ({told}): the "
                  f"script's {given} stands when it runs on its own", file=sys.stderr, flush=True)
        return ranks

    def callback(self, *, samples: Callable[[Mapping[str, Any]], int] | None = None) -> Report:
        """The ``TrainerCallback`` that reports each step of the Trainer into the run's meter and stops the
        training once the trial is measured. ``samples(batch)``: what a batch the Trainer feeds (the collator's
        mapping) holds in the run's unit (default: its ``input_ids``' sequences, or their tokens under
        ``unit="tokens"``)."""
        return Report(self, samples)

    def count(self, batch: Mapping[str, Any]) -> int:
        """What a batch holds in the run's unit, by default: its ``input_ids``' tokens or sequences, else its first
        tensor's length."""
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if isinstance(ids, torch.Tensor):
            return int(ids.numel()) if self.run.unit == "tokens" else int(ids.shape[0])
        return first_length(batch)


class Report(TrainerCallback):
    """Each micro-batch the Trainer feeds its model into the run's meter, a step's loss where it steps; the training
    stops once the trial is measured. The batch and the loss are read where the model takes and returns them (a
    forward hook on the Trainer's model, in training only): the Trainer hands a callback neither."""

    def __init__(self, run: TransformersRun, samples: Callable[[Mapping[str, Any]], int] | None = None):
        self.run, self.samples = run, samples or run.count
        self._hook = None
        self._fed: list[tuple[int, torch.Tensor | None, bool]] = []
        """(samples, the model's loss, whether it is a share of the step's) of the micro-batches since the last
        report."""
        self._losses: list[tuple[torch.Tensor, bool]] = []
        """The model's losses of the optimizer step under way."""
        self._over_ranks = 1
        self._timed: Callable[[], None] | None = None
        """Undoes the timing of the Trainer's train loader (``timed_loader``)."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None,
                       **kwargs) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._timed = timed_loader(train_dataloader, self._waited)
        self._hook = model.register_forward_hook(self._forward, with_kwargs=True)
        # The loss the Trainer logs of a share (a sum over the step's tokens of all ranks) is scaled by the ranks.
        self._over_ranks = self.run.world_size if args.average_tokens_across_devices else 1
        if optimizer is not None:  # fused SGD's momentum buffers before its first step (trainer.apply)
            prepare_optimizer(getattr(optimizer, "optimizer", optimizer))
        self.run.ready()

    def _forward(self, module, args, kwargs, output) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation's, or a generation's
        batch = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) \
                and output[0].ndim == 0:
            loss = output[0]
        # With the step's token count (num_items_in_batch) the model returns its share of the step's loss. A copy:
        # the Trainer scales the tensor itself in place (by the ranks) once the model returned it.
        self._fed.append((self.samples(batch), loss.detach().clone() if loss is not None else None,
                          kwargs.get("num_items_in_batch") is not None))

    def on_substep_end(self, args, state, control, **kwargs) -> None:
        self._report(control, final=False)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._report(control, final=True)

    def _report(self, control, *, final: bool) -> None:
        if self.run.done:
            return
        fed, self._fed = self._fed, []
        if not fed:
            raise ScriptError(["the Trainer stepped without a training forward of the model the callback was handed "
                               "(its model in training mode): pass the Trainer the model it trains"])
        self._losses += [(loss, share) for _, loss, share in fed if loss is not None]
        loss = None
        if final:
            loss, self._losses = self._step_loss(), []
        for i, (n, _, _) in enumerate(fed):
            last = i == len(fed) - 1
            if self.run.report(n, loss if last else None, final=final and last):
                control.should_training_stop = True
                return

    def _step_loss(self) -> torch.Tensor | None:
        """The step's loss as the Trainer logs it: the sum of its micro-batches' shares (times the ranks, where the
        share is of all ranks' tokens), else the mean of their own losses."""
        if not self._losses:
            return None
        losses = torch.stack([loss.float() for loss, _ in self._losses])
        if all(share for _, share in self._losses):
            return losses.sum() * self._over_ranks
        return losses.mean()

    def on_epoch_end(self, args, state, control, **kwargs) -> None:
        self.run.run.epochs_done += 1

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._timed is not None:
            self._timed()
            self._timed = None

    def _waited(self, seconds: float) -> None:
        """The Trainer's loop waited ``seconds`` for a batch: into the meter's open window."""
        meter = self.run.run.meter
        if meter is not None:
            meter.waited(seconds)


def timed_loader(loader: Any, waited: Callable[[float], None]) -> Callable[[], None] | None:
    """``loader``'s batches timed from the Trainer's ask to its hand-over (``trainer.meter.timed_batches``: the host's
    wait for data, the copy to the device the Trainer's prepared loader makes included); returns what undoes it, or
    None where it cannot be timed. The Trainer keeps the loader in a local variable of its loop, so the object itself
    becomes a subclass of its own class whose ``__iter__`` times each ``next``: everything else of it, its type
    included (``isinstance`` checks, ``len``, ``set_epoch``), is as it was."""
    cls = type(loader)
    if loader is None or not isinstance(getattr(cls, "__iter__", None), Callable):
        return None

    def __iter__(self):
        return timed_batches(cls.__iter__(self), waited)

    timed = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__})
    try:
        _SET_CLASS(loader, timed)
    except TypeError:  # a class whose instances cannot change their class (a C type's): no split
        return None
    return lambda: _SET_CLASS(loader, cls)


_SET_CLASS = object.__dict__["__class__"].__set__
"""Sets an object's class. Accelerate's prepared loader answers ``__class__`` with its inner DataLoader's class (a
read-only property), so the assignment goes through ``object``'s own descriptor."""
