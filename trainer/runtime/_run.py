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
import math
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer.apply import (
    DATALOADER_PREFETCH,
    applied_here,
    autocast,
    compile_script_model,
    cudnn_benchmark,
    data_loader,
    grad_scaler,
    grad_sync,
    loader_settings,
    place,
    prepare_optimizer,
    script_distributed,
    takes_layout,
    wrap_ddp,
)
from trainer.config import ConfigError, DataConfig, DDPConfig, TrainConfig, TrainingConfig
from trainer.knobs import table
from trainer.lifeline import die_with_parent, stacks_on_sigterm
from trainer.meter import ThroughputMeter, allreduce, short_epochs, sync
from trainer.protocol import Kind, ResultWriter, error_record
from trainer.records import Dist, count_nonfinite, start_record, summary_record
from trainer.runtime._batches import first_length, prefetched, samples_per_rank, to_device, touch
from trainer.runtime._folder import image_folder
from trainer.runtime.request import Request, active, current, last_run, set_run

# Which helper applies which setting is the knob table's (``trainer.knobs.Knob.applied_by``).
LOADER = table().applied_by("loader")
"""The settings ``Run.loader`` applies (DataLoader arguments)."""

MODEL = table().applied_by("model")
"""The settings ``Run.model`` applies (layout, the DDP wrapper, torch.compile)."""

STEP = table().applied_by("step")
"""The settings ``Run.step`` applies (autocast and the GradScaler, gradient accumulation)."""

IMAGES = table().applied_by("image_loader")
"""The settings ``Run.image_loader`` applies on top of the loader's (the input pipeline of ``trainer.data``)."""

DDP_WRAPPER = tuple(name for name in MODEL if table().by_runtime_name[name].path.startswith("ddp."))
"""The settings of ``MODEL`` that are DistributedDataParallel's arguments: each a ``trainer.config.DDPConfig``
field, by its knob's path."""

_UNSET = object()
_END = object()

SCRIPT_LOSS_HINT = ("learning rate too high for this model, optimizer and batch: the script owns its optimizer, "
                    "so lower its learning rate there (or scale it with the batch size)")


class TrialDone(SystemExit):
    """Raised by ``report()`` when a script goes on after its trial was measured: a plain script ends there (exit 0,
    the records complete); a live worker takes it as the trial's normal end."""

    def __init__(self):
        super().__init__(0)


class ScriptError(ConfigError):
    """A script that cannot be measured as written (a setting it declares and never reads, a DataLoader built with a
    fixed value the run sets, no step reported): a config failure, with the fix."""


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


class Run:
    """The settings of this run and the helpers that apply them; ``run.NAME`` reads a declared setting."""

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
        """The training loader: the one the steps report on (``_adopt``); another (a validation loader) is passed
        out of the meter's windows and cuts no epoch."""

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

    # ---- settings ------------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in table().by_runtime_name:
            raise AttributeError(name)
        if name not in self._declared and name not in self.request.settings:
            raise AttributeError(f"run.{name}: not declared; pass {name}=<the script's default> to runtime.setup()")
        self._read.add(name)
        return self._value(name)

    def _value(self, name: str, default: Any = _UNSET) -> Any:
        """The run's value, else the helper's argument, else the script's declared default, else the library's."""
        if name in self.request.settings:
            return self.request.settings[name]
        if default is not _UNSET:
            return default
        if name in self._declared:
            return self._declared[name]
        return table().by_runtime_name[name].runtime_default

    def _apply(self, name: str, default: Any = _UNSET) -> Any:
        value = self._applied[name] = self._value(name, default)
        return value

    def settings(self) -> dict[str, Any]:
        """What the script runs with: every setting it read or a helper applied, by name."""
        return {**{n: self._value(n) for n in self._read}, **self._applied}

    @property
    def in_search(self) -> bool:
        """A search's trial (or a stage's measurement): ``report()`` may end the run."""
        return self.request.mode in ("measure", "supply", "ceiling")

    def _apply_cudnn(self) -> None:
        # Global to the process: set only when the run asks, else the script's (or torch's) own choice stands.
        self._applied["cudnn_benchmark"] = cudnn_benchmark(self.request.settings.get("cudnn_benchmark"))

    # ---- helpers ---------------------------------------------------------------------------------------------

    def loader(self, data, *, samples: Callable[[Any], int] | None = None, **kwargs: Any) -> Batches:
        """``torch.utils.data.DataLoader(data, **kwargs)`` with the run's batch size and loader settings (a value
        given here is the script's default); its batches come on the run's device (4-D float tensors in
        channels_last when the run asks). ``samples(batch)``: what a batch holds in the script's unit (default: its
        first tensor's length). An existing DataLoader is taken as it is, and refused if the run sets a loader
        setting to a value it was not built with (its trials would measure the same thing under other names)."""
        from torch.utils.data import DataLoader

        before = dict(self._applied)
        folder = image_folder(data.dataset if isinstance(data, DataLoader) else data)
        if isinstance(data, DataLoader):
            loader = self._check_loader(data)
        else:
            args = {name: self._apply(name, kwargs.pop(name, _UNSET)) for name in LOADER}
            batch_size = args.pop("batch_size")
            loader = data_loader(data, loader_settings(**args), self.device, batch_size=batch_size, **kwargs)
            # What the loader really uses: DataLoader fills in its own prefetch depth when given none.
            self._applied["prefetch_factor"] = loader.prefetch_factor
        batches = Batches(self, loader, samples=samples, buffered=prefetched(loader))
        wrote = () if isinstance(data, DataLoader) else (*LOADER, "prefetch_factor")
        return self._made(batches, before, {n: self._applied[n] for n in wrote if n in self._applied}, folder)

    def _made(self, batches: Batches, before: dict[str, Any], applied: dict[str, Any],
              folder: dict[str, Any] | None) -> Batches:
        """A loader the script made, with the settings it applied (``applied``; ``before``: the run's record as it
        was): the run's training loader if it is the first; another (a validation loader, most often) records
        nothing unless the steps report on its batches (``_adopt`` at the first report)."""
        batches.applied, batches.image_folder = applied, folder
        self._closables.append(batches.close)
        if self._loader is None:
            self._adopt(batches)
        else:
            self._applied = before
        return batches

    def _adopt(self, batches: Batches) -> None:
        """``batches`` is the training loader: its settings are the ones the run records."""
        for name in self._loader.applied if self._loader is not None else ():
            self._applied.pop(name, None)
        self._loader = batches
        self._applied.update(batches.applied)
        self._image_folder = batches.image_folder

    def _foreign(self, batches: Batches) -> bool:
        """Whether ``batches`` is a loader the steps do not report on (a validation loader), once that is known."""
        return self.meter is not None and self._loader is not batches

    def _check_loader(self, loader):
        """A DataLoader the script built itself: its settings are the script's, not searched; a setting the script
        declares (or the run sets) must be what the loader was built with."""
        wanted = {name: self.request.settings.get(name, self._declared.get(name, getattr(loader, name, None)))
                  for name in LOADER}
        wrong = [f"{name}={have} (the run sets {want})" for name, have, want in self._loader_mismatch(loader, wanted)]
        if wrong:
            raise ScriptError([f"the script's DataLoader was built with {', '.join(wrong)}: pass the dataset to "
                               "run.loader(dataset, ...) so the run's values apply, or build the DataLoader from "
                               "run.<setting>"])
        return loader

    def _loader_mismatch(self, loader, wanted: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """(setting, what ``loader`` was built with, what is wanted) for each of ``wanted`` that differs; what a
        DataLoader clears or ignores here is no difference (a prefetch depth without workers, pinning on the CPU)."""
        wrong = []
        for name, want in wanted.items():
            have = getattr(loader, name, None)
            if name == "prefetch_factor" and not loader.num_workers:
                continue
            if name == "pin_memory" and self.device.type != "cuda":
                continue
            if want != have:
                wrong.append((name, have, want))
        return wrong

    def _watch_loaders(self) -> None:
        """In a search, note every DataLoader the script iterates: one it built and iterates itself, beside
        ``run.loader``, must use the loader settings it reads from the run, or a knob is searched with no effect
        (checked at the first report, ``_own_loaders``)."""
        from torch.utils.data import DataLoader

        original = DataLoader.__iter__
        seen = self._iterated

        def __iter__(loader):
            seen.add(loader)
            return original(loader)

        DataLoader.__iter__ = __iter__
        self._closables.append(lambda: setattr(DataLoader, "__iter__", original))

    def _own_loaders(self) -> list[str]:
        """The loader settings the script read from the run but did not give a DataLoader it iterates."""
        read = [name for name in LOADER if name in self._read]
        problems = []
        for loader in list(self._iterated):
            if applied_here(loader) or loader is getattr(self._loader, "_loader", None) or not read:
                continue
            for name, have, want in self._loader_mismatch(loader, {n: self._value(n) for n in read}):
                if name == "batch_size" and have is None:  # batches of its own batch_sampler: not comparable
                    continue
                problems.append(f"the script reads run.{name} ({want}) but iterates a DataLoader built with "
                                f"{name}={have}, so the setting has no effect: pass {name}=run.{name} to its "
                                "DataLoader, or build it with run.loader(dataset, ...)")
        return problems

    def image_loader(self, path: str, *, image_size: int = 224, train: bool = True,
                     num_classes: int | None = None, **loader_args: Any) -> Batches:
        """An ImageFolder (one sub-folder per class, or a folder holding ``train/``) through the project's input
        pipelines (``trainer.data``): PIL, libjpeg-turbo in the workers, nvJPEG on the GPU, a split of each batch or
        NVIDIA DALI (the ``decode`` setting), with random-resized-crop and flip augmentation, normalized, on the
        run's device, sharded over the ranks (``set_epoch`` reshuffles). ``loader_args``: the script's defaults for
        the loader's settings (``batch_size``, ``num_workers``, ...). Its ``num_classes`` is the folder's."""
        from trainer.data import build_pipeline, prefetched_batches
        from trainer.data import num_classes as classes_of

        unknown = set(loader_args) - set(LOADER) - set(IMAGES)
        if unknown:
            raise TypeError(f"run.image_loader(): unknown argument {sorted(unknown)[0]!r}; it takes "
                            f"{', '.join((*LOADER, *IMAGES))}")
        before, wrote = dict(self._applied), []

        def given(name: str) -> Any:
            wrote.append(name)
            return self._apply(name, loader_args.get(name, _UNSET))

        decode = given("decode")
        data = DataConfig(kind="imagefolder", path=str(path), image_size=image_size, num_classes=num_classes,
                          decode=decode)
        if decode == "hybrid":
            data.hybrid_cpu_fraction = given("hybrid_cpu_fraction")
        if decode == "dali":
            for name in (n for n in IMAGES if n.startswith("dali_")):  # DALI's own settings (trainer.knobs)
                setattr(data, name, given(name))
        workers = given("num_workers")
        # Without workers a loader has no prefetch depth to apply (loader_settings clears it either way).
        loader = loader_settings(num_workers=workers, prefetch_factor=given("prefetch_factor") if workers else None,
                                 pin_memory=given("pin_memory"), persistent_workers=given("persistent_workers"))
        if workers:  # what the loader really uses (DataLoader's own depth when the script gave none)
            self._applied["prefetch_factor"] = loader.prefetch_factor or DATALOADER_PREFETCH
            wrote.append("prefetch_factor")
        # A trial reads one endless stream of epochs (no epoch boundary inside its windows), as the built-in job's
        # measurements do; a plain or full run has the epochs of the script's loop.
        cfg = TrainConfig(data=data, loader=loader, training=TrainingConfig(
            mode="measure" if self.in_search else "train", epochs=1, batch_size=given("batch_size"),
            channels_last=bool(self._value("channels_last"))))
        problems = cfg.problems()
        if problems:
            raise ConfigError(problems)
        pipeline = build_pipeline(cfg, rank=self.rank, world_size=self.world_size, device=self.device,
                                  split="train" if train else "val")
        self._closables.append(pipeline.close)
        batches = Batches(self, pipeline, buffered=prefetched_batches(cfg), stream=self.in_search)
        batches.num_classes = classes_of(cfg)
        return self._made(batches, before, {n: self._applied[n] for n in wrote}, None)

    def model(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """The module on the run's device, in channels_last when the run asks, wrapped in DistributedDataParallel
        with the run's bucket size, gradient-as-bucket-view and static-graph settings (a value given here is the
        script's default; other DDP arguments pass through), then torch.compile'd when the run asks. A module the
        script compiled itself (``torch.compile(net)``) is taken as the module inside, compile then the script's
        default; ``run.module`` is the script's module either way."""
        own_compile = _UNSET
        compiled = getattr(module, "_orig_mod", None)
        if isinstance(compiled, torch.nn.Module):
            # The script compiled its own module: the run compiles the DDP wrapper instead (its all-reduces then
            # overlap the backward, as the built-in job's do), with the script's choice as compile's default.
            module, own_compile = compiled, True
        self._module = module
        # A language model (no image-shaped weights) does not apply a layout, so its trials do not search it.
        module = place(module, self.device, channels_last=takes_layout(module) and bool(self._apply("channels_last")))
        wrapper = {table().by_runtime_name[name].path.partition(".")[2]: self._apply(name, ddp_kwargs.pop(name, _UNSET))
                   for name in DDP_WRAPPER}
        ddp = wrap_ddp(module, self.device, DDPConfig(**wrapper), **ddp_kwargs)
        self._model = ddp
        if self._apply("compile", own_compile):
            # Compile the DDP wrapper: Dynamo's DDPOptimizer splits the graph at bucket boundaries so the
            # all-reduces still overlap the backward pass (as the built-in job does).
            self._closables.append(torch._dynamo.reset)
            return compile_script_model(ddp, self._apply("compile_mode"))
        return ddp

    @property
    def module(self) -> torch.nn.Module | None:
        """The script's own module inside what ``run.model`` returned (no DDP wrapper, no compile): for its
        ``state_dict``, its parameters by their own names (optimizer groups), its attributes."""
        return self._module

    @contextlib.contextmanager
    def step(self, optimizer: torch.optim.Optimizer, scheduler=None) -> Iterator[None]:
        """One micro-step: its forward (and ``backward``) under autocast at the run's precision, inside DDP's
        ``no_sync()`` unless it is the last micro-step of an optimizer step (so gradients are all-reduced once per
        optimizer step); after the last: the optimizer step through the GradScaler (fp16), then ``zero_grad``, then
        ``scheduler.step()`` when given (once per optimizer step, whatever the accumulation). ``run.stepped`` says
        whether this micro-step ended with an optimizer step (for a scheduler or EMA of the script's own)."""
        accum = max(1, int(self._apply("accum_steps")))
        amp = autocast(self._apply("precision"), self.device)
        self._prepare(optimizer)
        self._mark_ready()
        final = self._micro % accum == accum - 1
        self._stepping, self._optimizer, self._unscaled, self.stepped = True, optimizer, False, False
        try:
            with grad_sync(self._model, final=final), amp:
                yield
        finally:
            self._stepping = False
        self.micro_step(stepped=final)
        if final:
            if self._scaler is not None:
                self._scaler.step(optimizer)
                self._scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None and not self._schedule_ended(scheduler):
                scheduler.step()
            self.stepped = True

    def _schedule_ended(self, scheduler) -> bool:
        """Whether a trial has run ``scheduler`` to its end: a schedule of a fixed length (OneCycleLR's
        ``total_steps``) built from the script's epochs ends before a trial that runs epochs until it is measured
        (``epochs``), and stepping it further raises. It then holds its last rate; outside a search the script's
        own schedule is left as it is."""
        total = getattr(scheduler, "total_steps", None)
        return self.in_search and isinstance(total, int) and scheduler.last_epoch >= total

    def micro_step(self, *, stepped: bool | None = None) -> None:
        """A micro-step (a forward and backward) has ended; ``stepped``: whether the optimizer stepped after it
        (None: every ``accum_steps``-th micro-step does). ``run.step`` calls it; a framework's loop, which steps
        on its own schedule (at an epoch's last batch too, cutting a group of micro-batches short), calls it before
        ``report()``, which counts an optimizer step where one ended."""
        accum = max(1, int(self._applied.get("accum_steps", 1)))
        # report() counts a step when the micro-steps are a multiple of accum: a step taken early jumps to the next.
        self._micro = (self._micro // accum + 1) * accum if stepped else self._micro + 1

    @property
    def final_micro_step(self) -> bool:
        """Inside ``run.step``: whether this micro-step ends an optimizer step (its gradients are then complete)."""
        accum = max(1, int(self._applied.get("accum_steps", 1)))
        return self._micro % accum == accum - 1

    def clip_grad_norm_(self, max_norm: float, parameters=None, **kwargs: Any) -> torch.Tensor | None:
        """``torch.nn.utils.clip_grad_norm_`` after ``run.backward`` inside ``run.step``, right under every
        precision and accumulation: on the last micro-step only (earlier ones hold part of the gradient), after the
        GradScaler's ``unscale_`` under fp16 (else the norm is of scaled gradients). ``parameters``: the
        optimizer's by default. Returns the total norm, None on a micro-step that does not step."""
        if not self._stepping:
            raise RuntimeError("run.clip_grad_norm_(...) belongs inside `with run.step(optimizer):`, after "
                               "run.backward(loss)")
        if not self.final_micro_step:
            return None
        if self._scaler is not None and not self._unscaled:
            self._scaler.unscale_(self._optimizer)
            self._unscaled = True
        if parameters is None:
            parameters = [p for group in self._optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for a micro-step inside ``step``: divided over the micro-steps, scaled under fp16,
        outside autocast (backward runs in the forward's types anyway)."""
        if not self._stepping:
            raise RuntimeError("run.backward(loss) belongs inside `with run.step(optimizer):`")
        loss = loss / max(1, int(self._applied.get("accum_steps", 1)))
        with torch.autocast(self.device.type, enabled=False):
            (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def _prepare(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._optimizers:
            return
        self._optimizers.add(id(optimizer))
        if self._scaler is None:
            self._scaler = grad_scaler(self._applied.get("precision"), self.device)
        # The fused SGD kernel leaves its momentum buffers uninitialized when the GradScaler skips the very first
        # step; zeros make its first update equal stock SGD's (trainer.apply.init_momentum_buffers).
        prepare_optimizer(optimizer)

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

    # ---- reporting -------------------------------------------------------------------------------------------

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
            self._adopt(self._feeding)  # the steps report on another loader than the first made
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
        meter = ThroughputMeter(self.request.measure, images_per_step=0, device=self.device, emit=self.writer.write,
                                continuous=continuous, prefetched_steps=math.ceil(buffered / accum),
                                span_steps=math.ceil((workers or 1) / accum),
                                stop_requested=(lambda: os.path.exists(cancel)) if cancel else None)
        shape = None if continuous else self._epoch_shape()
        length, rounds_of = shape or (0, 1)
        self._turns = (length % rounds_of, rounds_of) if shape and length // rounds_of >= 2 else None
        self._turns_of = self._loader
        meter.whole_rounds = self._turns is not None
        meter.epoch_windows = shape is not None and short_epochs(length, rounds_of)
        return meter

    def _epoch_shape(self) -> tuple[int, int] | None:
        """The epochs of the script's own DataLoader: ``(length, workers)``, in batches. Its workers all start
        together at an epoch's start, one batch each, so its batches come in rounds of one per worker. Where its
        epochs are short (``trainer.meter.short_epochs``) the windows are whole epochs; else an epoch's turn
        (``self._turns``: ``(tail, lead)``) runs from the end of its last whole round (``tail`` batches before its
        end: the partial round) through the workers joined and spawned anew to the end of the next epoch's first
        round (``lead`` batches), each end a round's end, and is kept out of windows of whole rounds. None where the
        ranks' epochs are not all as long (their cuts would fall on different steps): the boundaries alone are then
        kept out (``ThroughputMeter.epoch_boundary``). Collective: every rank calls it as its meter is made."""
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

    def _epoch_begins(self, batches: Batches) -> bool:
        """An epoch of ``batches`` begins: where the windows are whole epochs, the meter's cut, with the samples
        reported but not yet stepped (an accumulation over the epoch's end), which the ending epoch consumed.
        Returns whether the measurement ended there. A script's own loop learns it at its next ``report()``, as
        ever (raised here, it would break a framework's loop); the loader alone ends at once (``_supply``)."""
        meter = self.meter
        if meter is None or not meter.epoch_windows or self._turns_of is not batches:
            return False
        meter.epoch_begins(images=self._pending)
        self._pending = 0
        return meter.done

    def _turn(self, *, begin: bool) -> None:
        if self.meter is not None and self._turns is not None:
            (self.meter.turn_begins if begin else self.meter.turn_ends)()

    @contextlib.contextmanager
    def _boundary(self, *, end: bool = False) -> Iterator[None]:
        """An epoch boundary of the script's own loader (``Batches``): the first epoch's start, before any step, is
        timed alone (a one-off: loader workers spawned for the first time); every later one is the meter's
        (``ThroughputMeter.epoch_boundary``)."""
        if self.meter is not None and self.meter.steps_total:
            with self.meter.epoch_boundary(end=end):
                yield
            return
        if not self.request.measured or end:
            yield
            return
        sync(self.device)
        start = time.perf_counter()
        with self.meter.paused() if self.meter is not None else contextlib.nullcontext():
            yield
        sync(self.device)
        self._epoch0_start_s = time.perf_counter() - start

    def _charge_epochs(self) -> None:
        """The epoch boundaries of a loader the script iterates epoch by epoch (``run.loader``), charged to the
        figure over its real epoch (``len(loader)`` batches of its full data): those measured, else the first
        epoch's start, as each epoch pays it again: workers restarted every epoch spawn anew, and persistent ones
        still begin an epoch's batches only as it begins, all at once (the spawn, the one thing they spare, is the
        smaller part: on 1xH200 each epoch of 16 persistent PIL workers began with a 3.3-6.9 s wait for its first
        batch). Collective (the slowest rank's boundary); measurements only."""
        from torch.utils.data import DataLoader

        loader = getattr(self._loader, "_loader", None)
        if not isinstance(loader, DataLoader) or self.meter.continuous or self.meter.epoch_windows:
            return  # a train run's windows and windows of whole epochs hold the boundaries already
        if not self.meter.windows:
            return
        starts = self.meter.turn_costs() or list(self.meter.epoch_starts)
        measured = len(starts)
        if not starts and self._epoch0_start_s and loader.num_workers:
            starts = [self._epoch0_start_s]
        # A turn's cost is net of its steps' steady time: noise can make one a little below nothing.
        local = max(0.0, statistics.median(starts)) if starts else 0.0
        start_s = allreduce([local], dist.ReduceOp.MAX, self.device)[0]
        try:
            batches = len(loader)
        except TypeError:  # an iterable dataset: no epoch length to charge over
            return
        per_step = sum(w.images for w in self.meter.windows) / max(1, sum(w.steps for w in self.meter.windows))
        accum = 1 if self.request.mode == "supply" else max(1, int(self._applied.get("accum_steps", 1)))
        self.meter.charge_epochs(epoch_images=round(batches * per_step / accum), start_s=start_s, measured=measured)

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
        self._charge_epochs()
        self.writer.write(summary_record(self.meter, self.env, mode=mode, loss=self.loss,
                                         nonfinite=self._nonfinite if loss_known else None, steps_run=self.steps,
                                         steps=self.steps, epochs=self.epochs_done, unit=self.unit,
                                         loss_hint=SCRIPT_LOSS_HINT,
                                         global_batch=batch * accum * self.world_size if batch else None))
        self.done = True

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
        return (f"the script ended after {self.steps} steps, before its measurement settled "
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


# ---- the batches -----------------------------------------------------------------------------------------------


class Batches:
    """The batches a script's loader hands it, as the run wants them: on the run's device, and in a stage's modes
    the loader alone (``supply``) or its first batch replayed on the device (``ceiling``). Iterating yields them;
    ``len()``, ``set_epoch`` and any other attribute are the loader's (its ``sampler``, ``dataset``).

    Both stage modes need nothing more of a script than that its loader goes through ``run.loader`` or
    ``run.image_loader``: the supply is its input pipeline without the model (how much it can feed), the ceiling its
    model without the input pipeline (a batch that is already on the device costs nothing to fetch) — the two
    numbers the search's stages weigh for the built-in job too."""

    def __init__(self, run: Run, loader, *, samples: Callable[[Any], int] | None = None, buffered: int = 0,
                 stream: bool = False):
        self._run, self._loader, self._samples = run, loader, samples or first_length
        self.buffered = buffered
        """Batches the loader's workers have ready before the first step: the meter discards at least these."""
        self._stream = stream
        self.applied: dict[str, Any] = {}
        """The settings this loader's helper applied (``Run._made``): the run's record while it is the training
        loader."""

        self.image_folder: dict[str, Any] | None = None
        self._iterators: list[weakref.ref] = []
        """The loader's iterators this run started (an epoch's, the ceiling's first batch), whose workers ``close``
        joins: one the trial ended inside lives on in the traceback that ended it."""

        self.first_samples: int | None = None
        """What the first batch it handed out holds, as it counts (``samples``): the steps must report the same."""

    @property
    def endless(self) -> bool:
        """Whether iterating it never ends an epoch: the ceiling's replayed batch, or a loader that streams epochs
        without end (an image pipeline built for a search's measurement, as the built-in job's): ``len()`` is then
        no epoch of these batches."""
        return self._stream or self._run.request.mode == "ceiling"

    def close(self) -> None:
        """Its loader closed (an image pipeline's ``close``), or its DataLoader's workers joined: persistent ones
        live as long as the loader, which the script's frames or a framework's objects may keep past the run, and an
        epoch's as long as its iterator. A worker process still running after a trial ends the live worker that ran
        it (``trainer.worker.leftovers``): on 1xH200 every trial of a script with 16 persistent loader workers cost
        the next one a fresh worker."""
        own = getattr(self._loader, "close", None)
        if callable(own):
            own()
            return
        iterators = [ref() for ref in self._iterators] + [getattr(self._loader, "_iterator", None)]
        self._iterators.clear()
        for iterator in iterators:
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        if getattr(self._loader, "_iterator", None) is not None:
            self._loader._iterator = None  # a later epoch of the loader starts its workers anew

    def _iter(self) -> Iterator[Any]:
        """``iter`` of the loader, remembered for ``close``."""
        it = iter(self._loader)
        self._iterators = [ref for ref in self._iterators if ref() is not None]  # a run of many epochs
        with contextlib.suppress(TypeError):  # an iterator that takes no weak reference ends with its loader
            self._iterators.append(weakref.ref(it))
        return it

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def samples_per_rank(self) -> int | None:
        """How many samples of its data this rank sees per epoch, when the loader can tell
        (``trainer.runtime._batches.samples_per_rank``)."""
        return samples_per_rank(self._loader, self._run.world_size)

    def set_epoch(self, epoch: int) -> None:
        target = getattr(self._loader, "set_epoch", None) or getattr(getattr(self._loader, "sampler", None),
                                                                      "set_epoch", None)
        if target is not None:
            target(epoch)

    def __iter__(self) -> Iterator[Any]:
        run = self._run
        mode = run.request.mode
        if mode == "supply":
            self._supply()  # ends the run (TrialDone)
        run._mark_ready()
        channels_last = bool(run._value("channels_last"))
        if mode == "ceiling" and not run._foreign(self):
            first = self._counted(to_device(next(self._iter()), run.device, channels_last))
            while True:
                run._feeding = self
                yield first
        for batch in self._epoch():
            run._feeding = self
            yield self._counted(to_device(batch, run.device, channels_last))

    def _counted(self, batch: Any) -> Any:
        if self.first_samples is None:
            self.first_samples = self._samples(batch)
        return batch

    def _epoch(self) -> Iterator[Any]:
        """One pass over the loader, its start (``iter`` and the first batch: workers spawned, batches prefetched)
        and its end (the call that finds it exhausted: workers joined) inside the run's epoch boundary
        (``Run._boundary``), kept out of the steady windows and charged over the epoch; where the loader's batches
        come in rounds of its workers' (``Run._epoch_shape``), inside the epoch's whole turn, from its last round to
        the next epoch's first; where its epochs are short, the windows are whole epochs, cut at each one's start.
        The loader alone gives no batch once measured at an epoch's start."""
        run = self._run
        if run._foreign(self):  # a validation loader, once the steps report on another: no part of training
            with run.meter.paused():
                yield from self._iter()
            return
        if run._epoch_begins(self) and run.request.mode == "supply":
            return
        with run._boundary():
            it = self._iter()
            batch = next(it, _END)
        try:
            # A stream of epochs without end crosses no boundary its consumer waits at.
            length = None if self.endless else len(self._loader)
        except TypeError:
            length = None
        given = 0
        while batch is not _END:
            yield batch
            given += 1
            turns = run._turns if run._turns_of is self else None  # known once the meter is made, at the first step
            if turns and given == turns[1]:
                run._turn(begin=False)
            if turns and given == length - turns[0]:
                run._turn(begin=True)
            if given == length:
                with run._boundary(end=True):
                    batch = next(it, _END)
            else:
                batch = next(it, _END)

    def _supply(self) -> None:
        """The loader alone, no model: batches to the device as fast as it delivers them, until the meter's windows
        agree; then the summary, and the trial ends. The loader the script iterates first is its training loader."""
        run = self._run
        if run._loader is not self:
            run._adopt(self)
        run._mark_ready()
        meter = run.meter = run._meter(continuous=False, buffered=self.buffered)
        checksum = torch.zeros((), device=run.device)
        epoch = 0
        channels_last = bool(run._value("channels_last"))
        while not meter.done:
            self.set_epoch(epoch)
            for batch in self._epoch():
                moved = to_device(batch, run.device, channels_last)
                checksum += touch(moved).to(run.device)
                meter.step(images=self._samples(batch))
                run.steps += 1
                if meter.done:
                    break
            epoch += 1
        run.loss = checksum
        run._finish(loss_known=False)
        raise TrialDone()
