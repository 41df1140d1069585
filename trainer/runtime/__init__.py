"""The runtime a user's own training script imports to be tuned by ``autotune search --script``.

A script opts into what it wants tuned; everything else stays its own. About a dozen lines::

    from trainer import runtime

    run = runtime.setup(unit="images", precision="fp16")     # the script's defaults; a trial's values in a search
    loader = run.loader(dataset, batch_size=64, num_workers=4, sampler=sampler, drop_last=True)
    model = run.model(resnet50())                             # device, channels_last, DDP, torch.compile
    for epoch in run.epochs(90):
        sampler.set_epoch(epoch)
        for images, labels in loader:                         # on the run's device
            with run.step(optimizer):                         # autocast, no_sync, GradScaler, optimizer step
                loss = criterion(model(images), labels)
                run.backward(loss)
            if run.report(len(images), loss):                 # the measurement: True when the trial is measured
                break

The usual idioms have a helper each: ``run.clip_grad_norm_(max_norm)`` after ``run.backward`` (unscaled under fp16,
on the micro-step that steps only), ``run.step(optimizer, scheduler)`` (the scheduler once per optimizer step;
``run.stepped`` says whether one happened), ``run.module`` (the script's own module inside DDP and compile: its
parameter names for optimizer groups, its ``state_dict``), ``run.model(torch.compile(net))`` (compiled once, as the
run says). A framework adapter (Lightning, Accelerate, the Hugging Face Trainer) is a thin layer over the same calls.

Under plain ``torchrun`` (no search) every value is the script's default and nothing is measured. Under
``autotune search`` the run hands the script each trial's settings and measures the steps it reports with the
built-in job's meter; under ``autotune train --config best.yaml`` (or ``AUTOTUNE_CONFIG=best.yaml torchrun ...``)
the exported ones. Importing this module loads torch, not the tuner (no Optuna, SQLAlchemy or plotly).

The settings a script can take are the knobs of ``trainer.knobs`` that have a runtime name (``Knob.runtime``), each
applied by the helper its entry names (``Knob.applied_by``); NCCL's variables are set by the launcher before the
process group exists.

A Lightning, Accelerate or Hugging Face Trainer script keeps its framework's loop: ``trainer.runtime.lightning``,
``trainer.runtime.accelerate`` and ``trainer.runtime.transformers`` (each needs its framework; this package does not)
make the ``Trainer``, the ``Accelerator`` or the ``TrainingArguments`` with the trial's settings through the same
helpers and report its batches into the same meter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["Run", "ScriptError", "TrialDone", "setup"]

if TYPE_CHECKING:
    from trainer.runtime._base import ScriptError, TrialDone
    from trainer.runtime._run import Run, setup


def __getattr__(name: str):
    # Loaded on first use: the tuner reads this package's request format (``trainer.runtime.request``) without
    # importing torch.
    if name in ("ScriptError", "TrialDone"):
        from trainer.runtime import _base

        return getattr(_base, name)
    if name in __all__:
        from trainer.runtime import _run

        return getattr(_run, name)
    raise AttributeError(f"module 'trainer.runtime' has no attribute {name!r}")
