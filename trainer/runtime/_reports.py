"""What a run reports: each step into the meter (``trainer.runtime._measure``), the epochs a trial runs until it is
measured, and the records a trial needs at its first step (its settings, what the first step took)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from trainer.meter import sync
from trainer.profile import StepProfile
from trainer.protocol import Kind, ResultWriter
from trainer.records import count_nonfinite
from trainer.runtime._base import ScriptError, TrialDone
from trainer.runtime._loaders import Loaders
from trainer.runtime._measure import Measurement
from trainer.runtime._settings import Settings
from trainer.runtime._steps import Steps


class Reports:
    """The reports part of a run (``trainer.runtime._run.Run``): ``run.report`` and ``run.epochs``; the first
    report checks that the script can be measured as written, and starts the meter."""

    def __init__(self, settings: Settings, measure: Measurement, loaders: Loaders, steps: Steps,
                 writer: ResultWriter, device: torch.device, world_size: int):
        self._settings, self._measure, self._loaders, self._steps = settings, measure, loaders, steps
        self._writer, self._device, self._world_size = writer, device, world_size
        self.reports = 0
        """Calls of ``report()``: the script's micro-steps."""
        self.loss = torch.zeros((), device=device)
        """The latest step's loss the script reported."""
        self._nonfinite = (torch.zeros((), dtype=torch.int64, device=device),
                           torch.zeros((), dtype=torch.int64, device=device))
        self._pending = 0
        self._last_log = 0.0
        self._profile: StepProfile | None = None
        """The steps after the windows, profiled (``measure.profile_steps``), while they run."""

    def epochs(self, n: int) -> Iterator[int]:
        """``range(n)``, but while a search measures the trial the epochs go on until it is measured (a short
        script would otherwise end before its windows agree)."""
        measure, in_search = self._measure, self._settings.in_search
        epoch = 0
        while epoch < n or (in_search and not measure.done):
            if measure.done:
                return
            before = self.reports
            yield epoch
            epoch += 1
            measure.epochs_done = epoch
            if self.reports == before and in_search:
                raise ScriptError([self._no_step(epoch - 1)])

    def _no_step(self, epoch: int) -> str:
        training = self._loaders.training
        if training is not None and len(training) == 0:
            return (f"epoch {epoch}: the loader gave no batch (batch_size={self._settings.applied('batch_size')} on "
                    f"{self._world_size} rank(s) is more than the data holds)")
        return f"epoch {epoch} reported no step: call run.report(samples, loss) after each step of the loop"

    def report(self, samples: int, loss: torch.Tensor | float | None = None) -> bool:
        """After each step: how many samples (the run's unit) this rank consumed in it, and its loss. Returns True
        when a search has measured this trial: the script should stop (a further report ends it). Cheap: no device
        sync except at the meter's window edges."""
        measure, request = self._measure, self._settings.request
        if measure.done:
            if self._settings.in_search:
                raise TrialDone()
            return True
        self.reports += 1
        if self.reports == 1:
            self._first_report(int(samples))
        if not request.measured:
            return False
        if loss is not None:
            self.loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._pending += int(samples)
        if self._steps.accumulating:
            return False  # mid-accumulation: the meter counts optimizer steps
        images, self._pending = self._pending, 0
        if self._profile is not None:  # the steps after the windows: not measured, profiled
            if self._profile.step():
                self.end_profile()
                return True
            return False
        self._nonfinite = count_nonfinite(self.loss.to(self._device), *self._nonfinite)
        measure.step(images, self.loss if loss is not None else None)
        if request.mode == "train" and time.monotonic() - self._last_log >= request.log_every_s:
            self._last_log = time.monotonic()
            self._progress()
        if measure.meter.done:
            steps = request.measure.profile_steps
            if steps and request.mode == "measure" and not measure.meter.cancelled:
                self._profile = StepProfile(self._device, steps)
                self._profile.start()
                return False
            self.finish()
            return True
        return False

    def end_profile(self) -> None:
        """The profile's split into the meter, and the summary (where the script ends before its profiled steps do:
        the steps it ran)."""
        if self._profile is None:
            return
        self._measure.meter.step_split = self._profile.stop()
        self._profile = None
        self.finish()

    def _first_report(self, samples: int) -> None:
        unread = self._settings.unread()
        if unread:
            raise ScriptError([f"runtime.setup() declares {', '.join(unread)} but the script never reads "
                               f"run.{unread[0]}: use the value where the script needs it, or leave it out of "
                               "setup()"])
        own = self._loaders.own_loader_problems()
        if own:
            raise ScriptError(own)
        self._loaders.settle()
        training, unit = self._loaders.training, self._measure.unit
        counted = getattr(training, "first_samples", None)
        if self._settings.in_search and counted is not None and counted != samples:
            # The loader alone (the supply) is measured in what the loader counts: it must be the report's unit.
            raise ScriptError([f"the first step reported {samples} {unit}, but the loader counts {counted} in "
                               "its first batch (its first tensor's length): give the loader samples=lambda batch: "
                               f"<its {unit}> (run.loader, run.trainer or run.accelerator), so that it is "
                               "measured in the unit the steps report"])
        ready = self._measure.ready()
        sync(self._device)
        now = time.time()
        folder = self._loaders.image_folder
        self._writer.write({"kind": Kind.SETTINGS, "t": now, "unit": unit, "applied": self._settings.settings(),
                            "loader": training is not None,
                            "samples_per_rank": training.samples_per_rank() if training is not None else None,
                            "loader_kept": bool(getattr(training, "resumed", False)),
                            **({"image_folder": folder} if folder else {})})
        self._writer.write({"kind": Kind.FIRST_STEP, "t": now, "first_batch_s": None,
                            "first_compute_s": round(time.perf_counter() - ready, 4),
                            "cudnn_benchmark": self._settings.applied("cudnn_benchmark")})
        if self._settings.request.measured:
            self._measure.start(training, continuous=self._settings.request.mode == "train")
            self._last_log = time.monotonic()

    def _progress(self) -> None:
        meter = self._measure.meter
        rate = meter.windows[-1].imgs_per_s if meter.windows else None
        self._writer.write({"kind": Kind.PROGRESS, "t": time.time(), "step": self._measure.steps, "epoch": None,
                            "total_steps": None, "loss": float(self.loss.float().item()), "lr": None,
                            "imgs_per_s": rate, "unit": self._measure.unit})

    def finish(self) -> None:
        """The summary of the steps reported (once): at the meter's end, or a full run's at its close."""
        self._measure.finish(self.loss, self._nonfinite)
