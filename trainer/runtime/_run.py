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
import weakref
from collections.abc import Callable
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


class Run(Settings, Loaders, Steps, Reports):
    """The settings of this run and the helpers that apply them; ``run.NAME`` reads a declared setting. Its parts,
    one module each: its settings (``_settings``), its loaders and their batches (``_loaders``), its model and steps
    (``_steps``), what it reports (``_reports``); here what makes and ends it."""

    def __init__(self, request: Request, declared: dict[str, Any], *, unit: str,
                 writer: ResultWriter | None, env: Dist | None):
        self.request, self.unit = request, unit
        self._declared = dict(declared)
        self._read: set[str] = set()
        self._applied: dict[str, Any] = {}
        self._owns_group = env is None and not dist.is_initialized()
        self.env = env or script_distributed()
        self.rank, self.world_size, self.device = self.env.rank, self.env.world_size, self.env.device
        self.local_rank = self.env.local_rank
        self._own_writer = writer is None
        self.writer = writer or ResultWriter(request.result, self.rank)
        self._model: torch.nn.Module | None = None
        self._optimizers: set[int] = set()
        self._scaler: torch.amp.GradScaler | None = None
        self._stepping = self._unscaled = False
        self.stepped = False
        """Whether the latest ``run.step`` ended with an optimizer step."""
        self._optimizer: torch.optim.Optimizer | None = None
        self._module: torch.nn.Module | None = None
        self._micro = 0
        self._pending = 0
        self._closables: list[Callable[[], None]] = []
        self._loader: Batches | None = None
        """The training loader: the one the steps report on (``_use_as_training_loader``); another (a validation
        loader) is passed out of the meter's windows and cuts no epoch."""

        self._feeding: Batches | None = None
        """The loader that handed out the latest batch: at the first report, the training loader."""

        self._image_folder: dict[str, Any] | None = None
        """The image folder the script's own Dataset reads (``_folder.image_folder``), for its settings record."""
        self._iterated: weakref.WeakSet = weakref.WeakSet()
        self.meter: ThroughputMeter | None = None
        self.reports = self.steps = 0
        self.epochs_done = 0
        """Epochs of ``epochs()`` the script ran to their end (0 for a loop of its own)."""
        self.done = self._closed = False
        self._t_ready: float | None = None
        self._epoch0_start_s: float | None = None
        self._turns: tuple[int, int] | None = None
        """(tail, lead) of the epoch turns of the script's own DataLoader while measuring (``_epoch_shape``)."""
        self._turns_of: Batches | None = None
        """The loader they are of (another one, a validation loader, turns nothing)."""
        self.loss = torch.zeros((), device=self.device)
        self._nonfinite = (torch.zeros((), dtype=torch.int64, device=self.device),
                           torch.zeros((), dtype=torch.int64, device=self.device))
        if self.device.type == "cuda":
            self._apply_cudnn()
        set_run(self)
        if request.measured:
            self._watch_loaders()
        if request.measured and active() is None:  # a process of the script's own: its records are ours
            # As the built-in job's ranks do: die with torchrun, and say where the script was when stopped (a
            # hang's report stands on it).
            die_with_parent()
            stacks_on_sigterm()
            self.writer.write(start_record(self.env))
            atexit.register(self._at_exit)
            if not getattr(sys.excepthook, "autotune", False):
                sys.excepthook = _record_uncaught(sys.excepthook)

    # ---- the end ---------------------------------------------------------------------------------------------

    def ended(self) -> str | None:
        """Why the script's run cannot stand as a trial now that it ended (None: it can): the records a trial
        needs are the tuner's only evidence."""
        if not self.request.measured or self.done:
            return None
        if self.reports == 0:
            return ("the script ended without reporting a step: call run.report(samples, loss) after each step of "
                    "its training loop")
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
        if self.request.mode == "train" and self.meter is not None and self.reports and not self.done:
            self._finish()
        problem = self.ended()
        if problem is not None and active() is None:  # a live worker's trial: the worker records it
            self.writer.write(error_record(ScriptError([problem])), any_rank=True)
        for release in self._closables:
            release()
        self._closables.clear()
        self._model = self._module = self._optimizer = self._loader = self.meter = None
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
