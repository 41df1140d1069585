"""A run's measurement: the meter its steps feed (``trainer.meter``, the same the built-in job uses), the moment the
run was ready, each epoch's turn of the script's own DataLoader marked as a window of its own, and the summary."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainer.meter import ThroughputMeter, allreduce, sync
from trainer.protocol import Kind, ResultWriter
from trainer.records import Dist, summary_record
from trainer.runtime._base import SCRIPT_LOSS_HINT
from trainer.runtime._settings import Settings


class Training(Protocol):
    """What the measurement reads of the training loader (``trainer.runtime._loaders.Batches``); any other attribute
    (``num_workers``) is its loader's."""

    buffered: int

    @property
    def source(self) -> Any: ...


class Measurement:
    """The measurement part of a run (``trainer.runtime._run.Run``): the meter, made at the first report (the loader
    alone: as it starts), the optimizer steps it was fed, whether the trial is measured (``done``), and the records
    of its start and its end."""

    def __init__(self, settings: Settings, env: Dist, writer: ResultWriter, *, unit: str):
        self.request = settings.request
        self._settings, self._env, self._writer, self.unit = settings, env, writer, unit
        self.meter: ThroughputMeter | None = None
        self.steps = 0
        """Optimizer steps measured (the loader alone: its batches)."""
        self.epochs_done = 0
        """Epochs of ``run.epochs()`` (or of a framework's loop) run to their end."""
        self.done = False
        """The trial is measured and its summary written (or, for a plain script, its failure recorded)."""
        self._t_ready: float | None = None
        self._epoch0_start_s: float | None = None
        self._turns: tuple[int, int] | None = None
        """(tail, lead) of the epoch turns of the script's own DataLoader while measuring (``_epoch_shape``)."""
        self._turns_of: Training | None = None
        """The loader they are of (another one, a validation loader, turns nothing)."""

    def ready(self) -> float:
        """The moment (``time.perf_counter``) the run was first ready to step: its first batch handed out or its
        first step begun. The first call writes the ``ready`` record."""
        if self._t_ready is None:
            self._t_ready = time.perf_counter()
            self._writer.write({"kind": Kind.READY, "t": time.time()})
        return self._t_ready

    def start(self, training: Training | None, *, continuous: bool) -> ThroughputMeter:
        """The meter of the steps on ``training``'s batches (None: a loop of the script's own), as the built-in job's:
        its prefetched batches discarded, each epoch's turn a window of its own (``_epoch_shape``)."""
        accum = self._settings.accum
        # What the loader was built with (a script's own DataLoader is taken as it is).
        own = getattr(training.source, "num_workers", None) if training is not None else None
        workers = own if own is not None else self._settings.applied("num_workers", 0) if training else 0
        cancel = self.request.cancel
        shape = None if continuous else self._epoch_shape(training)
        length, rounds_of = shape or (0, 1)
        self._turns = (length % rounds_of, rounds_of) if shape and length // rounds_of >= 2 else None
        self._turns_of = training
        # Each epoch's turn is charged once per real epoch of optimizer steps (the loader alone steps per batch).
        per_epoch = length // (1 if self.request.mode == "supply" else accum) if self._turns else None
        first_turn = self._epoch0_start_s if shape and getattr(training, "num_workers", 0) else None
        buffered = training.buffered if training is not None else 0
        self.meter = ThroughputMeter(
            self.request.measure, images_per_step=0, device=self._env.device, emit=self._writer.write,
            continuous=continuous, prefetched_steps=math.ceil(buffered / accum),
            span_steps=math.ceil((workers or 1) / accum), epoch_steps=per_epoch,
            stop_requested=(lambda: os.path.exists(cancel)) if cancel else None,
            first_turn_s=first_turn if per_epoch else None)
        return self.meter

    def _epoch_shape(self, training: Training | None) -> tuple[int, int] | None:
        """The epochs of the script's own DataLoader: ``(length, workers)``, in batches. Its workers all start
        together at an epoch's start, one batch each, so its batches come in rounds of one per worker, and an epoch's
        turn (``self._turns``: ``(tail, lead)``) runs from the end of its last whole round (``tail`` batches before
        its end: the partial round) through the workers joined and started anew to the end of the next epoch's first
        round (``lead`` batches): the meter measures it as a window of its own and charges it once per real epoch.
        None where the ranks' epochs are not all as long (their turns would fall on different steps): each epoch's
        end then falls inside the windows as it comes. Collective: every rank calls it as its meter is made."""
        from torch.utils.data import DataLoader

        loader = training.source if training is not None else None
        if not isinstance(loader, DataLoader):
            return None
        try:
            length = len(loader)
        except TypeError:  # an iterable dataset: no epoch length
            return None
        shortest, longest = allreduce([-length, length], dist.ReduceOp.MAX, self._env.device)
        if -shortest != longest or not length:
            return None
        return length, max(1, loader.num_workers)

    def turns_of(self, batches: Training) -> tuple[int, int] | None:
        """``(tail, lead)`` of each epoch's turn where ``batches`` are the ones measured in turns, else None (known
        once the meter is made, at the first step)."""
        return self._turns if self._turns_of is batches else None

    def turn(self, *, begin: bool) -> None:
        """An epoch's turn of the measured loader begins (its last whole round of batches was handed out) or ends
        (the next epoch's first round was)."""
        if self.meter is not None and self._turns is not None:
            (self.meter.turn_begins if begin else self.meter.turn_ends)()

    @contextlib.contextmanager
    def first_start(self, training: Training | None) -> Iterator[None]:
        """The first epoch's start of the script's own loader, before any step (its workers spawned for the first
        time, their first batches made): timed alone, as what an epoch's start costs where no turn is measured.
        ``training``: the training loader (a start of one without workers costs no turn)."""
        if (self.meter is not None and self.meter.steps_total) or not self.request.measured \
                or self._epoch0_start_s is not None:
            yield
            return
        sync(self._env.device)
        start = time.perf_counter()
        yield
        sync(self._env.device)
        self._epoch0_start_s = time.perf_counter() - start
        if self.meter is not None and self.meter.epoch_steps:  # the loader alone: its meter is made before it starts
            self.meter.first_turn_s = self._epoch0_start_s if getattr(training, "num_workers", 0) else None

    def step(self, images: int, loss: torch.Tensor | None = None) -> None:
        """An optimizer step (the loader alone: a batch) of ``images`` samples into the meter, with its loss."""
        self.steps += 1
        self.meter.step(loss, images=images)

    def release(self) -> None:
        """The meter let go (the run ended), and the loader it measured in turns."""
        self.meter = self._turns_of = None

    def finish(self, loss: torch.Tensor, nonfinite: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The summary record, once: the meter's figures and the loss check (``nonfinite``: the steps' counters of
        ``trainer.records.count_nonfinite``; None where no step gave a loss, ``loss`` then being the loader alone's
        checksum)."""
        if self.done:
            return
        batch = self._settings.applied("batch_size")
        accum = int(self._settings.applied("accum_steps", 1))
        mode = {"supply": "loader", "ceiling": "measure"}.get(self.request.mode, self.request.mode)
        self._writer.write(summary_record(self.meter, self._env, mode=mode, loss=loss, nonfinite=nonfinite,
                                          steps_run=self.steps, steps=self.steps, epochs=self.epochs_done,
                                          unit=self.unit, loss_hint=SCRIPT_LOSS_HINT,
                                          global_batch=batch * accum * self._env.world_size if batch else None))
        self.done = True
