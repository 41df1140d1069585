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
import datetime
import gc
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import ConfigError, DataConfig, LoaderConfig, TrainConfig, TrainingConfig
from trainer.job import Dist, apply_env, count_nonfinite, prefetched_batches, start_record, summary_record
from trainer.knobs import table
from trainer.loop import AUTOCAST_DTYPES
from trainer.meter import ThroughputMeter, sync
from trainer.optim import init_momentum_buffers
from trainer.protocol import Kind, ResultWriter, error_record
from trainer.runtime import _request
from trainer.runtime._batches import Batches

# Which helper applies which setting is the knob table's (``trainer.knobs.Knob.applied_by``).
LOADER = table().applied_by("loader")
"""The settings ``Run.loader`` applies (DataLoader arguments)."""

MODEL = table().applied_by("model")
"""The settings ``Run.model`` applies (layout, the DDP wrapper, torch.compile)."""

STEP = table().applied_by("step")
"""The settings ``Run.step`` applies (autocast and the GradScaler, gradient accumulation)."""

IMAGES = table().applied_by("image_loader")
"""The settings ``Run.image_loader`` applies on top of the loader's (the input pipeline of ``trainer.data``)."""

_UNSET = object()

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
    active = _request.active()
    request = active.request if active else _request.current()
    return Run(request, defaults, unit=unit, writer=active.writer if active else None,
               env=active.env if active else None)


class Run:
    """The settings of this run and the helpers that apply them; ``run.NAME`` reads a declared setting."""

    def __init__(self, request: _request.Request, declared: dict[str, Any], *, unit: str,
                 writer: ResultWriter | None, env: Dist | None):
        self.request, self.unit = request, unit
        self._declared = dict(declared)
        self._read: set[str] = set()
        self._applied: dict[str, Any] = {}
        self._owns_group = env is None and not dist.is_initialized()
        self.env = env or _init_distributed()
        self.rank, self.world_size, self.device = self.env.rank, self.env.world_size, self.env.device
        self.local_rank = self.env.local_rank
        self._own_writer = writer is None
        self.writer = writer or ResultWriter(request.result, self.rank)
        self._model: torch.nn.Module | None = None
        self._optimizers: set[int] = set()
        self._scaler: torch.amp.GradScaler | None = None
        self._stepping = False
        self._micro = 0
        self._pending = 0
        self._closables: list[Callable[[], None]] = []
        self._loader: Batches | None = None
        self.meter: ThroughputMeter | None = None
        self.reports = self.steps = 0
        self.epochs_done = 0
        """Epochs of ``epochs()`` the script ran to their end (0 for a loop of its own)."""
        self.done = self._closed = False
        self._t_ready: float | None = None
        self.loss = torch.zeros((), device=self.device)
        self._nonfinite = (torch.zeros((), dtype=torch.int64, device=self.device),
                           torch.zeros((), dtype=torch.int64, device=self.device))
        if self.device.type == "cuda":
            self._apply_cudnn()
        _request.set_run(self)
        if request.measured and _request.active() is None:  # a process of the script's own: its records are ours
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
        if "cudnn_benchmark" in self.request.settings:
            torch.backends.cudnn.benchmark = bool(self.request.settings["cudnn_benchmark"])
        self._applied["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)

    # ---- helpers ---------------------------------------------------------------------------------------------

    def loader(self, data, *, samples: Callable[[Any], int] | None = None, **kwargs: Any) -> Batches:
        """``torch.utils.data.DataLoader(data, **kwargs)`` with the run's batch size and loader settings (a value
        given here is the script's default); its batches come on the run's device (4-D float tensors in
        channels_last when the run asks). ``samples(batch)``: what a batch holds in the script's unit (default: its
        first tensor's length). An existing DataLoader is taken as it is, and refused if the run sets a loader
        setting to a value it was not built with (its trials would measure the same thing under other names)."""
        from torch.utils.data import DataLoader

        if isinstance(data, DataLoader):
            loader = self._check_loader(data)
        else:
            args = {name: self._apply(name, kwargs.pop(name, _UNSET)) for name in LOADER}
            if not args["num_workers"]:  # DataLoader refuses both without workers
                args["prefetch_factor"] = None
                args["persistent_workers"] = False
            args["pin_memory"] = bool(args["pin_memory"]) and self.device.type == "cuda"
            loader = DataLoader(data, **args, **kwargs)
            # What the loader really uses: DataLoader fills in its own prefetch depth when given none.
            self._applied["prefetch_factor"] = loader.prefetch_factor
        workers = loader.num_workers
        buffered = workers * (loader.prefetch_factor or 2) if workers else 0
        self._loader = Batches(self, loader, samples=samples, buffered=buffered)
        return self._loader

    def _check_loader(self, loader):
        """A DataLoader the script built itself: its settings are the script's, not searched; a setting the script
        declares (or the run sets) must be what the loader was built with."""
        wrong = []
        for name in LOADER:
            have = getattr(loader, name, None)
            want = self.request.settings.get(name, self._declared.get(name, have))
            if name == "prefetch_factor" and not loader.num_workers:
                continue
            if name == "pin_memory" and self.device.type != "cuda":
                continue
            if want != have:
                wrong.append(f"{name}={have} (the run sets {want})")
        if wrong:
            raise ScriptError([f"the script's DataLoader was built with {', '.join(wrong)}: pass the dataset to "
                               "run.loader(dataset, ...) so the run's values apply, or build the DataLoader from "
                               "run.<setting>"])
        return loader

    def image_loader(self, path: str, *, image_size: int = 224, train: bool = True,
                     num_classes: int | None = None, **loader_args: Any) -> Batches:
        """An ImageFolder (one sub-folder per class, or a folder holding ``train/``) through the project's input
        pipelines (``trainer.data``): PIL, libjpeg-turbo in the workers, nvJPEG on the GPU or a split of each batch
        (the ``decode`` setting), with random-resized-crop and flip augmentation, normalized, on the run's device,
        sharded over the ranks (``set_epoch`` reshuffles). ``loader_args``: the script's defaults for the loader's
        settings (``batch_size``, ``num_workers``, ...). Its ``num_classes`` is the folder's."""
        from trainer.data import build_pipeline
        from trainer.data import num_classes as classes_of

        unknown = set(loader_args) - set(LOADER) - set(IMAGES)
        if unknown:
            raise TypeError(f"run.image_loader(): unknown argument {sorted(unknown)[0]!r}; it takes "
                            f"{', '.join((*LOADER, *IMAGES))}")
        given = lambda name: self._apply(name, loader_args.get(name, _UNSET))
        decode = given("decode")
        data = DataConfig(kind="imagefolder", path=str(path), image_size=image_size, num_classes=num_classes,
                          decode=decode)
        if decode == "hybrid":
            data.hybrid_cpu_fraction = given("hybrid_cpu_fraction")
        workers = given("num_workers")
        loader = LoaderConfig(num_workers=workers, prefetch_factor=given("prefetch_factor") if workers else None,
                              pin_memory=given("pin_memory"),
                              persistent_workers=bool(given("persistent_workers")) and workers > 0)
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
        batches = Batches(self, pipeline, buffered=prefetched_batches(cfg))
        batches.num_classes = classes_of(cfg)
        self._loader = batches
        return batches

    def model(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """The module on the run's device, in channels_last when the run asks, wrapped in DistributedDataParallel
        with the run's bucket size, gradient-as-bucket-view and static-graph settings (a value given here is the
        script's default; other DDP arguments pass through), then torch.compile'd when the run asks."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = module.to(self.device)
        # A layout only means something to a model with image-shaped (4-D) weights: a language model does not
        # apply it, so its trials do not search it.
        if any(p.ndim == 4 for p in module.parameters()) and self._apply("channels_last"):
            module = module.to(memory_format=torch.channels_last)
        ddp = DDP(module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  bucket_cap_mb=self._apply("bucket_cap_mb", ddp_kwargs.pop("bucket_cap_mb", _UNSET)),
                  gradient_as_bucket_view=self._apply("gradient_as_bucket_view",
                                                      ddp_kwargs.pop("gradient_as_bucket_view", _UNSET)),
                  static_graph=self._apply("static_graph", ddp_kwargs.pop("static_graph", _UNSET)), **ddp_kwargs)
        self._model = ddp
        if self._apply("compile"):
            # Compile the DDP wrapper: Dynamo's DDPOptimizer splits the graph at bucket boundaries so the
            # all-reduces still overlap the backward pass (as the built-in job does).
            self._closables.append(torch._dynamo.reset)
            return torch.compile(ddp, mode=self._apply("compile_mode"))
        return ddp

    @contextlib.contextmanager
    def step(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """One micro-step: its forward (and ``backward``) under autocast at the run's precision, inside DDP's
        ``no_sync()`` unless it is the last micro-step of an optimizer step (so gradients are all-reduced once per
        optimizer step); after the last: the optimizer step through the GradScaler (fp16), then ``zero_grad``."""
        accum = max(1, int(self._apply("accum_steps")))
        dtype = AUTOCAST_DTYPES.get(self._apply("precision"))
        self._prepare(optimizer)
        self._mark_ready()
        final = self._micro % accum == accum - 1
        model = self._model
        no_sync = model.no_sync() if not final and model is not None and hasattr(model, "no_sync") else None
        amp = torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        self._stepping = True
        try:
            with no_sync or contextlib.nullcontext(), amp:
                yield
        finally:
            self._stepping = False
        self._micro += 1
        if final:
            if self._scaler is not None:
                self._scaler.step(optimizer)
                self._scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

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
        if self._applied.get("precision") == "fp16" and self._scaler is None:
            self._scaler = torch.amp.GradScaler(self.device.type)
        # The fused SGD kernel leaves its momentum buffers uninitialized when the GradScaler skips the very first
        # step; zeros make its first update equal stock SGD's (trainer.optim.init_momentum_buffers).
        if isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("fused") and \
                optimizer.defaults.get("dampening", 0) == 0:
            init_momentum_buffers(optimizer)

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
            self._first_report()
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

    def _first_report(self) -> None:
        unread = [n for n in self._declared if n not in self._read and n not in self._applied]
        if unread:
            raise ScriptError([f"runtime.setup() declares {', '.join(unread)} but the script never reads "
                               f"run.{unread[0]}: use the value where the script needs it, or leave it out of "
                               "setup()"])
        self._mark_ready()
        sync(self.device)
        now = time.time()
        self.writer.write({"kind": Kind.SETTINGS, "t": now, "unit": self.unit, "applied": self.settings(),
                           "loader": self._loader is not None,
                           "samples_per_rank": self._loader.samples_per_rank() if self._loader else None})
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
        if workers is None:
            workers = self._applied.get("num_workers", 0) if self._loader else 0
        cancel = self.request.cancel
        return ThroughputMeter(self.request.measure, images_per_step=0, device=self.device, emit=self.writer.write,
                               continuous=continuous, prefetched_steps=math.ceil(buffered / accum),
                               span_steps=math.ceil((workers or 1) / accum),
                               stop_requested=(lambda: os.path.exists(cancel)) if cancel else None)

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
        if problem is not None and _request.active() is None:  # a live worker's trial: the worker records it
            self.writer.write(error_record(ScriptError([problem])), any_rank=True)
        for release in self._closables:
            release()
        self._closables.clear()
        self._model = self._loader = self.meter = None
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


def _init_distributed() -> Dist:
    """This process's place in the run; the process group started (as the built-in job does) when the script did
    not start one."""
    apply_env_for_script()
    if "RANK" not in os.environ:  # `python train.py` without torchrun: a world of one
        from trainer.job import _free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300),
                                device_id=device if cuda else None)
    return Dist(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=device,
                backend=dist.get_backend(), init_s=round(time.perf_counter() - t0, 4))


def apply_env_for_script() -> None:
    """The safety variables (NVLink multicast off) for a script started by hand as well as by the tuner."""
    apply_env(TrainConfig())


def _record_uncaught(previous):
    """An exception that ends a plain script is recorded with its failure class (the tuner's verdict), then
    printed as before (its traceback goes to the trial's log)."""

    def hook(kind, value, tb):
        run = _request.last_run()
        if run is not None and not run.done and not isinstance(value, SystemExit):
            run.writer.write(error_record(value), any_rank=True)
            run.done = True  # recorded: nothing more to say at exit
        previous(kind, value, tb)

    hook.autotune = True
    return hook
