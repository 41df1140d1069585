"""What a run reports: each step into the meter (``trainer.meter``, the same the built-in job uses), the epochs a
trial runs until it is measured, the records a trial needs (settings, first step, summary), and each epoch's turn of
the script's own DataLoader marked as a window of its own."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from trainer.meter import ThroughputMeter, allreduce, sync
from trainer.protocol import Kind
from trainer.records import count_nonfinite, summary_record
from trainer.runtime._base import SCRIPT_LOSS_HINT, ScriptError, TrialDone


class Reports:
    """``run.report`` and ``run.epochs``, and the meter they feed."""

    def epochs(self, n: int) -> Iterator[int]:
        """``range(n)``, but while a search measures the trial the epochs go on until it is measured (a short
        script would otherwise end before its windows agree)."""
        epoch = 0
        while epoch < n or (self.in_search and not self.done):
            if self.done:
                return
            before = self.reports
            yield epoch
            epoch += 1
            self.epochs_done = epoch
            if self.reports == before and self.in_search:
                raise ScriptError([self._no_step(epoch - 1)])

    def _no_step(self, epoch: int) -> str:
        if self._loader is not None and len(self._loader) == 0:
            return (f"epoch {epoch}: the loader gave no batch (batch_size={self._applied.get('batch_size')} on "
                    f"{self.world_size} rank(s) is more than the data holds)")
        return f"epoch {epoch} reported no step: call run.report(samples, loss) after each step of the loop"


    def report(self, samples: int, loss: torch.Tensor | float | None = None) -> bool:
        """After each step: how many samples (the run's unit) this rank consumed in it, and its loss. Returns True
        when a search has measured this trial: the script should stop (a further report ends it). Cheap: no device
        sync except at the meter's window edges."""
        if self.done:
            if self.in_search:
                raise TrialDone()
            return True
        self.reports += 1
        if self.reports == 1:
            self._first_report(int(samples))
        if not self.request.measured:
            return False
        if loss is not None:
            self.loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._pending += int(samples)
        if "accum_steps" in self._applied and self._micro % max(1, int(self._applied["accum_steps"])):
            return False  # mid-accumulation: the meter counts optimizer steps
        images, self._pending = self._pending, 0
        self._nonfinite = count_nonfinite(self.loss.to(self.device), *self._nonfinite)
        self.steps += 1
        self.meter.step(self.loss if loss is not None else None, images=images)
        if self.request.mode == "train" and time.monotonic() - self._last_log >= self.request.log_every_s:
            self._last_log = time.monotonic()
            self._progress()
        if self.meter.done:
            self._finish()
            return True
        return False

    def _first_report(self, samples: int) -> None:
        unread = [n for n in self._declared if n not in self._read and n not in self._applied]
        if unread:
            raise ScriptError([f"runtime.setup() declares {', '.join(unread)} but the script never reads "
                               f"run.{unread[0]}: use the value where the script needs it, or leave it out of "
                               "setup()"])
        own = self._own_loaders()
        if own:
            raise ScriptError(own)
        if self._feeding is not None and self._feeding is not self._loader:
            self._use_as_training_loader(self._feeding)  # the steps report on another loader than the first made
        counted = getattr(self._loader, "first_samples", None)
        if self.in_search and counted is not None and counted != samples:
            # The loader alone (the supply) is measured in what the loader counts: it must be the report's unit.
            raise ScriptError([f"the first step reported {samples} {self.unit}, but the loader counts {counted} in "
                               "its first batch (its first tensor's length): give the loader samples=lambda batch: "
                               f"<its {self.unit}> (run.loader, run.trainer or run.accelerator), so that it is "
                               "measured in the unit the steps report"])
        self._mark_ready()
        sync(self.device)
        now = time.time()
        self.writer.write({"kind": Kind.SETTINGS, "t": now, "unit": self.unit, "applied": self.settings(),
                           "loader": self._loader is not None,
                           "samples_per_rank": self._loader.samples_per_rank() if self._loader else None,
                           **({"image_folder": self._image_folder} if self._image_folder else {})})
        self.writer.write({"kind": Kind.FIRST_STEP, "t": now, "first_batch_s": None,
                           "first_compute_s": round(time.perf_counter() - self._t_ready, 4),
                           "cudnn_benchmark": self._applied.get("cudnn_benchmark")})
        if self.request.measured:
            self.meter = self._meter(continuous=self.request.mode == "train",
                                     buffered=self._loader.buffered if self._loader else 0)
            self._last_log = time.monotonic()

    def _mark_ready(self) -> None:
        if self._t_ready is None:
            self._t_ready = time.perf_counter()
            self.writer.write({"kind": Kind.READY, "t": time.time()})

    def _meter(self, *, continuous: bool, buffered: int, workers: int | None = None) -> ThroughputMeter:
        accum = max(1, int(self._applied.get("accum_steps", 1)))
        if workers is None:  # what the loader was built with (a script's own DataLoader is taken as it is)
            own = getattr(getattr(self._loader, "_loader", None), "num_workers", None)
            applied = self._applied.get("num_workers", 0) if self._loader else 0
            workers = own if own is not None else applied
        cancel = self.request.cancel
        shape = None if continuous else self._epoch_shape()
        length, rounds_of = shape or (0, 1)
        self._turns = (length % rounds_of, rounds_of) if shape and length // rounds_of >= 2 else None
        self._turns_of = self._loader
        # Each epoch's turn is charged once per real epoch of optimizer steps (the loader alone steps per batch).
        per_epoch = length // (1 if self.request.mode == "supply" else accum) if self._turns else None
        first_turn = self._epoch0_start_s if shape and getattr(self._loader, "num_workers", 0) else None
        return ThroughputMeter(self.request.measure, images_per_step=0, device=self.device, emit=self.writer.write,
                               continuous=continuous, prefetched_steps=math.ceil(buffered / accum),
                               span_steps=math.ceil((workers or 1) / accum),
                               stop_requested=(lambda: os.path.exists(cancel)) if cancel else None,
                               epoch_steps=per_epoch, first_turn_s=first_turn if per_epoch else None)

    def _epoch_shape(self) -> tuple[int, int] | None:
        """The epochs of the script's own DataLoader: ``(length, workers)``, in batches. Its workers all start
        together at an epoch's start, one batch each, so its batches come in rounds of one per worker, and an epoch's
        turn (``self._turns``: ``(tail, lead)``) runs from the end of its last whole round (``tail`` batches before
        its end: the partial round) through the workers joined and started anew to the end of the next epoch's first
        round (``lead`` batches): the meter measures it as a window of its own and charges it once per real epoch.
        None where the ranks' epochs are not all as long (their turns would fall on different steps): each epoch's
        end then falls inside the windows as it comes. Collective: every rank calls it as its meter is made."""
        from torch.utils.data import DataLoader

        loader = getattr(self._loader, "_loader", None)
        if not isinstance(loader, DataLoader):
            return None
        try:
            length = len(loader)
        except TypeError:  # an iterable dataset: no epoch length
            return None
        shortest, longest = allreduce([-length, length], dist.ReduceOp.MAX, self.device)
        if -shortest != longest or not length:
            return None
        return length, max(1, loader.num_workers)

    def _turn(self, *, begin: bool) -> None:
        if self.meter is not None and self._turns is not None:
            (self.meter.turn_begins if begin else self.meter.turn_ends)()

    @contextlib.contextmanager
    def _first_start(self) -> Iterator[None]:
        """The first epoch's start of the script's own loader, before any step (its workers spawned for the first
        time, their first batches made): timed alone, as what an epoch's start costs where no turn is measured."""
        if (self.meter is not None and self.meter.steps_total) or not self.request.measured \
                or self._epoch0_start_s is not None:
            yield
            return
        sync(self.device)
        start = time.perf_counter()
        yield
        sync(self.device)
        self._epoch0_start_s = time.perf_counter() - start
        if self.meter is not None and self.meter.epoch_steps:  # the loader alone: its meter is made before it starts
            self.meter.first_turn_s = self._epoch0_start_s if getattr(self._loader, "num_workers", 0) else None

    def _progress(self) -> None:
        rate = self.meter.windows[-1].imgs_per_s if self.meter.windows else None
        self.writer.write({"kind": Kind.PROGRESS, "t": time.time(), "step": self.steps, "epoch": None,
                           "total_steps": None, "loss": float(self.loss.float().item()), "lr": None,
                           "imgs_per_s": rate, "unit": self.unit})

    def _finish(self, *, loss_known: bool = True) -> None:
        if self.done:
            return
        batch = self._applied.get("batch_size")
        accum = int(self._applied.get("accum_steps", 1))
        mode = {"supply": "loader", "ceiling": "measure"}.get(self.request.mode, self.request.mode)
        self.writer.write(summary_record(self.meter, self.env, mode=mode, loss=self.loss,
                                         nonfinite=self._nonfinite if loss_known else None, steps_run=self.steps,
                                         steps=self.steps, epochs=self.epochs_done, unit=self.unit,
                                         loss_hint=SCRIPT_LOSS_HINT,
                                         global_batch=batch * accum * self.world_size if batch else None))
        self.done = True
