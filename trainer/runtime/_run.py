"""A user's script's side of a tuned run: its settings, the helpers that apply them, and the steps it reports.

The script owns its loop; the run owns the measurement. ``setup()`` names the settings the script reads itself
(with the script's own defaults); the helpers (``loader``, ``image_loader``, ``model``, ``step``/``backward``)
apply the ones they handle; ``report()`` after each step feeds the trainer's meter — the same ``ThroughputMeter``
the built-in job uses — which decides when a trial is measured, and tells the script to stop. Outside a search
every value is the script's own default, nothing is measured, and the helpers do what the script's plain torch code
did (the library defaults of ``trainer.knobs``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.apply import script_distributed
from trainer.exit_signals import die_with_parent, stacks_on_sigterm
from trainer.knobs import table
from trainer.meter import ThroughputMeter
from trainer.protocol import ResultWriter, error_record
from trainer.records import Dist, start_record
from trainer.runtime._base import ScriptError
from trainer.runtime._loaders import Batches, Loaders
from trainer.runtime._measure import Measurement
from trainer.runtime._reports import Reports
from trainer.runtime._settings import Settings
from trainer.runtime._steps import Steps
from trainer.runtime.request import Request, active, current, last_run, set_run


def setup(*, unit: str = "samples", **defaults: Any) -> Run:
    """The run of this process. ``defaults``: the settings the script reads itself (``run.batch_size``), each with
    the script's own default, by the names of ``trainer.knobs`` (``batch_size``, ``precision``, ...); ``unit``: what
    ``report()`` counts (images, tokens, samples). Starts the process group when there is none (as torchrun's
    environment says, NCCL on GPUs, gloo on the CPU), so a script need not."""
    names = table().by_runtime_name
    unknown = [k for k in defaults if k not in names]
    if unknown:
        raise TypeError(f"runtime.setup(): unknown setting {unknown[0]!r}; the settings are {', '.join(names)}")
    live = active()
    request = live.request if live else current()
    return Run(request, defaults, unit=unit, writer=live.writer if live else None, env=live.env if live else None)


@dataclass(frozen=True, kw_only=True)
class Parts:
    """A run's parts, as a framework adapter drives them (``trainer.runtime._frameworks``): the settings it applies
    to the framework's objects, the moment the run is ready, the training loader the framework iterates, the layout
    and compile of its module."""

    settings: Settings
    measure: Measurement
    loaders: Loaders
    steps: Steps
    on_close: Callable[[Callable[[], None]], None]
    """Registers what the run undoes when it closes (a framework method the adapter patched, ...)."""


def _answered_by(method: Callable) -> Callable[[Callable], Callable]:
    """A call of the script's that a part's ``method`` answers: its docstring is that method's."""

    def answered(call: Callable) -> Callable:
        call.__doc__ = method.__doc__
        return call

    return answered


class Run:
    """The settings of this run and the helpers that apply them; ``run.NAME`` reads a declared setting. Made of
    parts, one module each, built in this order, each handed what it needs of the ones before: its settings
    (``_settings``), its measurement (``_measure``: the meter, the trial's counts, its summary), its loaders and
    their batches (``_loaders``), its model and steps (``_steps``), what it reports (``_reports``). Here what makes
    and ends it; the script's calls each go to the part that answers them."""

    def __init__(self, request: Request, declared: dict[str, Any], *, unit: str,
                 writer: ResultWriter | None, env: Dist | None):
        self.request, self.unit = request, unit
        self._owns_group = env is None and not dist.is_initialized()
        self.env = env or script_distributed()
        self.rank, self.world_size, self.device = self.env.rank, self.env.world_size, self.env.device
        self.local_rank = self.env.local_rank
        self._own_writer = writer is None
        self.writer = writer or ResultWriter(request.result, self.rank)
        self._closables: list[Callable[[], None]] = []
        self._closed = False
        on_close = self._closables.append
        # 1. The settings: the trial's, else a helper's argument, else the script's declared default.
        self._settings = Settings(request, declared)
        if self.device.type == "cuda":
            self._settings.apply_cudnn()
        # 2. The measurement: the meter the steps feed and the records of the trial's start and end.
        self._measure = Measurement(self._settings, self.env, self.writer, unit=unit)
        # 3. The loaders and their batches (in a trial, the DataLoaders the script iterates are noted from here).
        self._loaders = Loaders(self._settings, self._measure, self.env, on_close=on_close)
        # 4. The model and its steps.
        self._steps = Steps(self._settings, self._measure, self.device, on_close=on_close)
        # 5. The reports: each step into the meter, the epochs a trial runs.
        self._reports = Reports(self._settings, self._measure, self._loaders, self._steps, self.writer, self.device,
                                self.world_size)
        self.report_fix = "call run.report(samples, loss) after each step of its training loop"
        """What a script that reports no step is told to do (an adapter whose framework reports names its own)."""
        self.parts = Parts(settings=self._settings, measure=self._measure, loaders=self._loaders, steps=self._steps,
                           on_close=on_close)
        """What a framework adapter drives (``trainer.runtime._frameworks.FrameworkRun``)."""
        set_run(self)
        if request.measured and active() is None:  # a process of the script's own: its records are ours
            # As the built-in job's ranks do: die with torchrun, and say where the script was when stopped (a
            # hang's report stands on it).
            die_with_parent()
            stacks_on_sigterm()
            self.writer.write(start_record(self.env))
            atexit.register(self._at_exit)
            if not getattr(sys.excepthook, "autotune", False):
                sys.excepthook = _record_uncaught(sys.excepthook)

    # ---- the script's calls, each to its part -----------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._settings.read(name)

    def settings(self) -> dict[str, Any]:
        """What the script runs with: every setting it read or a helper applied, by name."""
        return self._settings.settings()

    @property
    def in_search(self) -> bool:
        """A search's trial (or a stage's measurement): ``report()`` may end the run."""
        return self._settings.in_search

    @_answered_by(Loaders.loader)
    def loader(self, data, *, samples: Callable[[Any], int] | None = None, **kwargs: Any) -> Batches:
        return self._loaders.loader(data, samples=samples, **kwargs)

    @_answered_by(Loaders.image_loader)
    def image_loader(self, path: str, *, image_size: int = 224, train: bool = True,
                     num_classes: int | None = None, **loader_args: Any) -> Batches:
        return self._loaders.image_loader(path, image_size=image_size, train=train, num_classes=num_classes,
                                          **loader_args)

    @_answered_by(Steps.model)
    def model(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        return self._steps.model(module, **ddp_kwargs)

    @property
    def module(self) -> torch.nn.Module | None:
        """The script's own module inside what ``run.model`` returned (no DDP wrapper, no compile): for its
        ``state_dict``, its parameters by their own names (optimizer groups), its attributes."""
        return self._steps.module

    @_answered_by(Steps.step)
    def step(self, optimizer: torch.optim.Optimizer, scheduler=None) -> contextlib.AbstractContextManager[None]:
        return self._steps.step(optimizer, scheduler)

    @_answered_by(Steps.backward)
    def backward(self, loss: torch.Tensor) -> None:
        self._steps.backward(loss)

    @_answered_by(Steps.clip_grad_norm_)
    def clip_grad_norm_(self, max_norm: float, parameters=None, **kwargs: Any) -> torch.Tensor | None:
        return self._steps.clip_grad_norm_(max_norm, parameters, **kwargs)

    @_answered_by(Steps.micro_step)
    def micro_step(self, *, stepped: bool | None = None) -> None:
        self._steps.micro_step(stepped=stepped)

    @property
    def final_micro_step(self) -> bool:
        """Inside ``run.step``: whether this micro-step ends an optimizer step (its gradients are then complete)."""
        return self._steps.final_micro_step

    @property
    def stepped(self) -> bool:
        """Whether the latest ``run.step`` ended with an optimizer step."""
        return self._steps.stepped

    @_answered_by(Reports.report)
    def report(self, samples: int, loss: torch.Tensor | float | None = None) -> bool:
        return self._reports.report(samples, loss)

    @_answered_by(Reports.epochs)
    def epochs(self, n: int) -> Iterator[int]:
        return self._reports.epochs(n)

    @property
    def reports(self) -> int:
        """Calls of ``report()`` so far."""
        return self._reports.reports

    @property
    def loss(self) -> torch.Tensor:
        """The latest loss reported."""
        return self._reports.loss

    @property
    def meter(self) -> ThroughputMeter | None:
        """The trial's meter (None before the first report, outside a search, and once the run is closed)."""
        return self._measure.meter

    @property
    def steps(self) -> int:
        """Optimizer steps measured."""
        return self._measure.steps

    @property
    def epochs_done(self) -> int:
        """Epochs of ``epochs()`` the script ran to their end (0 for a loop of its own)."""
        return self._measure.epochs_done

    @epochs_done.setter
    def epochs_done(self, value: int) -> None:  # a framework's loop counts its own epochs
        self._measure.epochs_done = value

    @property
    def done(self) -> bool:
        """Whether the trial is measured (its summary written), or a plain script's failure is recorded."""
        return self._measure.done

    @done.setter
    def done(self, value: bool) -> None:
        self._measure.done = value

    # ---- the end ---------------------------------------------------------------------------------------------

    def ended(self) -> str | None:
        """Why the script's run cannot stand as a trial now that it ended (None: it can): the records a trial
        needs are the tuner's only evidence."""
        if not self.request.measured or self.done:
            return None
        if self.reports == 0:
            return f"the script ended without reporting a step: {self.report_fix}"
        if self.request.mode == "train":
            return None
        return (f"the script ended after {self.steps} steps, before it was measured "
                f"({len(self.meter.windows) if self.meter else 0} windows): let it run longer (`for epoch in "
                "run.epochs(n)` keeps a trial's epochs going until it is measured)")

    def close(self) -> None:
        """The run's end: a full run's summary, what the helpers built released, the process group ended if this
        run started it. Called at exit; a script may call it itself."""
        if self._closed:
            return
        self._closed = True
        self._reports.end_profile()
        if self.request.mode == "train" and self.meter is not None and self.reports and not self.done:
            self._reports.finish()
        problem = self.ended()
        if problem is not None and active() is None:  # a live worker's trial: the worker records it
            self.writer.write(error_record(ScriptError([problem])), any_rank=True)
        for release in self._closables:
            release()
        self._closables.clear()
        for part in (self._steps, self._loaders, self._measure):
            part.release()  # what it holds of the script's (its model, optimizer, loaders) goes with the trial
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self._own_writer:
            self.writer.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):  # at exit, torch may be half gone: the records are what matters
            self.close()


def _record_uncaught(previous):
    """An exception that ends a plain script is recorded with its failure class (the tuner's verdict), then
    printed as before (its traceback goes to the trial's log)."""

    def hook(kind, value, tb):
        run = last_run()
        if run is not None and not run.done and not isinstance(value, SystemExit):
            run.writer.write(error_record(value), any_rank=True)
            run.done = True  # recorded: nothing more to say at exit
        previous(kind, value, tb)

    hook.autotune = True
    return hook
