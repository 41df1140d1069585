"""A run's loaders: a script's Dataset or DataLoader through ``run.loader``, an image folder through the project's
pipelines (``run.image_loader``), and ``Batches``: the batches a loader hands the script, as the trial wants them (on
the run's device, the loader alone, or one batch replayed), each epoch's turn marked for the meter. A trial notes
every DataLoader its script iterates until its first step is checked (``watch_iterations``)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.apply import DATALOADER_PREFETCH, applied_here, data_loader, loader_settings
from trainer.config import ConfigError, DataConfig, TrainConfig, TrainingConfig
from trainer.meter import timed_batches
from trainer.records import Dist
from trainer.runtime import kept
from trainer.runtime._base import _END, _UNSET, IMAGES, LOADER, ScriptError, TrialDone
from trainer.runtime._batches import first_length, prefetched, samples_per_rank, to_device, touch
from trainer.runtime._folder import image_folder
from trainer.runtime._measure import Measurement
from trainer.runtime._settings import Settings
from trainer.runtime.request import worker_trial

_WATCHING: list[weakref.WeakSet] = []
"""The DataLoaders each trial in progress has seen iterated (``watch_iterations``)."""

_ORIGINAL: dict[str, Callable] = {}
"""Torch's own ``DataLoader.__iter__`` while it is wrapped, and the wrapper."""


def watch_iterations(seen: weakref.WeakSet) -> Callable[[], None]:
    """Note in ``seen`` every DataLoader iterated from now until the returned function is called. DataLoader has no
    hook for it: its ``__iter__`` is wrapped while any trial watches, and is torch's own again once none does."""
    from torch.utils.data import DataLoader

    if not _WATCHING:
        original = DataLoader.__iter__

        def __iter__(loader):
            for watching in _WATCHING:
                watching.add(loader)
            return original(loader)

        _ORIGINAL.update(original=original, wrapper=__iter__)
        DataLoader.__iter__ = __iter__
    _WATCHING.append(seen)

    def stop() -> None:
        # By identity: WeakSets compare by their contents.
        _WATCHING[:] = [watching for watching in _WATCHING if watching is not seen]
        if not _WATCHING and _ORIGINAL and DataLoader.__dict__.get("__iter__") is _ORIGINAL["wrapper"]:
            DataLoader.__iter__ = _ORIGINAL.pop("original")  # a wrapper of someone else's on top stays theirs
            _ORIGINAL.clear()

    return stop


class Loaders:
    """The loaders part of a run (``trainer.runtime._run.Run``): ``run.loader`` and ``run.image_loader``, which of
    them is the training loader (the one the steps report on), and in a trial the DataLoaders the script iterates."""

    def __init__(self, settings: Settings, measure: Measurement, env: Dist,
                 *, on_close: Callable[[Callable[[], None]], None]):
        self._settings, self._measure, self._on_close = settings, measure, on_close
        self.device, self.rank, self.world_size = env.device, env.rank, env.world_size
        self._training: Batches | None = None
        """The training loader: the one the steps report on (``_use``); another (a validation loader) is passed
        out of the meter's windows and cuts no epoch."""

        self._feeding: Batches | None = None
        """The loader that handed out the latest batch: at the first report, the training loader."""

        self.image_folder: dict[str, Any] | None = None
        """The image folder the script's own Dataset reads (``_folder.image_folder``), for its settings record."""

        self._iterated: weakref.WeakSet = weakref.WeakSet()
        self._unwatch: Callable[[], None] | None = None
        if settings.request.measured:
            # In a trial, every DataLoader the script iterates: one it built and iterates itself, beside
            # ``run.loader``, must use the loader settings it reads from the run, or a knob is searched with no effect
            # (checked at the first report, ``own_loader_problems``).
            self._unwatch = watch_iterations(self._iterated)
            on_close(self._stop_watching)

    @property
    def training(self) -> Batches | None:
        """The training loader (None before the script made one, or where a loop of its own reads its data)."""
        return self._training

    @property
    def channels_last(self) -> bool:
        """Whether the batches' 4-D float tensors go channels_last."""
        return bool(self._settings.value("channels_last"))

    def loader(self, data, *, samples: Callable[[Any], int] | None = None, **kwargs: Any) -> Batches:
        """``torch.utils.data.DataLoader(data, **kwargs)`` with the run's batch size and loader settings (a value
        given here is the script's default); its batches come on the run's device (4-D float tensors in
        channels_last when the run asks). ``samples(batch)``: what a batch holds in the script's unit (default: its
        first tensor's length). An existing DataLoader is taken as it is, and refused if the run sets a loader
        setting to a value it was not built with (its trials would measure the same thing under other names)."""
        from torch.utils.data import DataLoader

        folder = image_folder(data.dataset if isinstance(data, DataLoader) else data)
        applied: dict[str, Any] = {}
        if isinstance(data, DataLoader):
            loader = self._check_loader(data)
        else:
            args = {name: self._settings.value(name, kwargs.pop(name, _UNSET)) for name in LOADER}
            applied.update(args)
            batch_size = args.pop("batch_size")
            loader = data_loader(data, loader_settings(**args), self.device, batch_size=batch_size, **kwargs)
            # What the loader really uses: DataLoader fills in its own prefetch depth when given none.
            applied["prefetch_factor"] = loader.prefetch_factor
        batches = Batches(self, self._measure, loader, samples=samples, buffered=prefetched(loader))
        return self._made(batches, applied, folder)

    def _made(self, batches: Batches, applied: dict[str, Any], folder: dict[str, Any] | None) -> Batches:
        """A loader the script made, with the settings it applied: the run's training loader if it is the first;
        another (a validation loader, most often) records nothing unless the steps report on its batches (``settle``
        at the first report)."""
        batches.applied, batches.image_folder = applied, folder
        self._on_close(batches.close)
        if self._training is None:
            self._use(batches)
        return batches

    def _use(self, batches: Batches) -> None:
        """``batches`` is the training loader: its settings are the ones the run records."""
        self._settings.replace(self._training.applied if self._training is not None else (), batches.applied)
        self._training = batches
        self.image_folder = batches.image_folder

    def adopt(self, loader: Any, samples: Callable[[Any], int] | None = None) -> Batches:
        """The loader a framework iterates for training (after the framework sharded it over the ranks) as the
        training loader's batches; its settings are the ones the framework's adapter applied."""
        batches = self._training = Batches(self, self._measure, loader, samples=samples, buffered=prefetched(loader))
        self._on_close(batches.close)
        return batches

    def handed(self, batches: Batches) -> None:
        """``batches`` handed out the latest batch."""
        self._feeding = batches

    def settle(self) -> None:
        """At the first report: the loader that handed out its batch is the training loader (the steps report on
        another loader than the first made)."""
        if self._feeding is not None and self._feeding is not self._training:
            self._use(self._feeding)

    def supplies(self, batches: Batches) -> None:
        """``batches`` are measured alone (the supply): the loader the script iterates first is its training loader."""
        if self._training is not batches:
            self._use(batches)

    def is_other(self, batches: Batches) -> bool:
        """Whether ``batches`` is a loader the steps do not report on (a validation loader), once that is known."""
        return self._measure.meter is not None and self._training is not batches

    def release(self) -> None:
        """The loaders let go (the run ended; their workers are joined by each one's ``close``)."""
        self._training = self._feeding = None

    def _check_loader(self, loader):
        """A DataLoader the script built itself: its settings are the script's, not searched; a setting the script
        declares (or the run sets) must be what the loader was built with."""
        wanted = {name: self._settings.value(name) if self._settings.has(name) else getattr(loader, name, None)
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

    def _stop_watching(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def own_loader_problems(self) -> list[str]:
        """At the first report: the loader settings the script read from the run but did not give a DataLoader it
        iterates. The watch of the DataLoaders it iterates ends here (nothing later reads it)."""
        self._stop_watching()
        read = [name for name in LOADER if self._settings.was_read(name)]
        problems = []
        for loader in list(self._iterated):
            if applied_here(loader) or loader is getattr(self._training, "source", None) or not read:
                continue
            for name, have, want in self._loader_mismatch(loader, {n: self._settings.value(n) for n in read}):
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
        applied: dict[str, Any] = {}

        def given(name: str) -> Any:
            value = applied[name] = self._settings.value(name, loader_args.get(name, _UNSET))
            return value

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
            applied["prefetch_factor"] = loader.prefetch_factor or DATALOADER_PREFETCH
        # A trial reads one endless stream of epochs (no epoch boundary inside its windows), as the built-in job's
        # measurements do; a plain or full run has the epochs of the script's loop.
        in_search = self._settings.in_search
        cfg = TrainConfig(data=data, loader=loader, training=TrainingConfig(
            mode="measure" if in_search else "train", epochs=1, batch_size=given("batch_size"),
            channels_last=self.channels_last))
        problems = cfg.problems()
        if problems:
            raise ConfigError(problems)
        pipeline = build_pipeline(cfg, rank=self.rank, world_size=self.world_size, device=self.device,
                                  split="train" if train else "val")
        self._on_close(pipeline.close)
        batches = Batches(self, self._measure, pipeline, buffered=prefetched_batches(cfg), stream=in_search)
        batches.num_classes = classes_of(cfg)
        return self._made(batches, applied, None)


class Batches:
    """The batches a script's loader hands it, as the run wants them: on the run's device, and in a stage's modes
    the loader alone (``supply``) or its first batch replayed on the device (``ceiling``). Iterating yields them;
    ``len()``, ``set_epoch`` and any other attribute are the loader's (its ``sampler``, ``dataset``).

    Both stage modes need nothing more of a script than that its loader goes through ``run.loader`` or
    ``run.image_loader``: the supply is its input pipeline without the model (how much it can feed), the ceiling its
    model without the input pipeline (a batch that is already on the device costs nothing to fetch) — the two
    numbers the search's stages weigh for the built-in job too."""

    def __init__(self, loaders: Loaders, measure: Measurement, loader, *, samples: Callable[[Any], int] | None = None,
                 buffered: int = 0, stream: bool = False):
        # ``loaders``: the run's loaders part, which of them is the training loader; ``measure``: the trial's meter.
        self._loaders, self._measure, self._loader, self._samples = loaders, measure, loader, samples or first_length
        self.buffered = buffered
        """Batches the loader's workers have ready before the first step: the meter discards at least these."""
        self._stream = stream
        self.applied: dict[str, Any] = {}
        """The settings this loader's helper applied (``run.loader``, ``run.image_loader``): the run's record while it
        is the training loader."""

        self.image_folder: dict[str, Any] | None = None
        self._iterators: list[weakref.ref] = []
        """The loader's iterators this run started (an epoch's, the ceiling's first batch), whose workers ``close``
        joins: one the trial ended inside lives on in the traceback that ended it."""

        self.first_samples: int | None = None
        """What the first batch it handed out holds, as it counts (``samples``): the steps must report the same."""

        self._kept: bytes | None = None
        """On a live worker, the digest under which its persistent workers are kept for the next trial
        (``trainer.runtime.kept``); None: they end with the run."""

        self.resumed = False
        """Its workers are the ones an earlier trial kept (``trainer.runtime.kept``): they started no process here."""

    @property
    def endless(self) -> bool:
        """Whether iterating it never ends an epoch: the ceiling's replayed batch, or a loader that streams epochs
        without end (an image pipeline built for a search's measurement, as the built-in job's): ``len()`` is then
        no epoch of these batches."""
        return self._stream or self._measure.request.mode == "ceiling"

    @property
    def source(self) -> Any:
        """The loader these batches are of (the script's DataLoader, a framework's, or an image pipeline)."""
        return self._loader

    def close(self) -> None:
        """Its loader closed (an image pipeline's ``close``), or its DataLoader's workers joined: persistent ones
        live as long as the loader, which the script's frames or a framework's objects may keep past the run, and an
        epoch's as long as its iterator. A worker process still running after a trial ends the live worker that ran
        it (``trainer.worker.leftovers``): left open, a script's persistent loader workers would cost every next
        trial a fresh worker."""
        own = getattr(self._loader, "close", None)
        if callable(own):
            own()
            return
        keeping = getattr(self._loader, "_iterator", None) if self._kept is not None else None
        if keeping is not None and kept.keep(self._kept, keeping):
            self._loader._iterator = None  # the workers are the live worker's now
        iterators = [ref() for ref in self._iterators] + [getattr(self._loader, "_iterator", None)]
        self._iterators.clear()
        for iterator in iterators:
            if iterator is not None and iterator is not keeping and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        if getattr(self._loader, "_iterator", None) is not None:
            self._loader._iterator = None  # a later epoch of the loader starts its workers anew

    def _iter(self) -> Iterator[Any]:
        """``iter`` of the loader, remembered for ``close``. On a live worker, a loader whose workers start here
        resumes the ones a previous trial kept where they hold the same data (``trainer.runtime.kept``)."""
        resumed = False
        if getattr(self._loader, "_iterator", False) is None:  # a DataLoader whose workers start here
            self._kept = kept.key(self._loader) if worker_trial() is not None else None
            resumed = kept.resume(self._loader, self._kept)
            self.resumed = self.resumed or resumed
        try:
            it = iter(self._loader)
        except Exception:
            if not resumed:
                raise
            # A kept worker that no longer answers: this trial starts its own.
            kept.end(self._loader._iterator)
            self._loader._iterator = None
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
        return samples_per_rank(self._loader, self._loaders.world_size)

    def set_epoch(self, epoch: int) -> None:
        target = getattr(self._loader, "set_epoch", None) or getattr(getattr(self._loader, "sampler", None),
                                                                      "set_epoch", None)
        if target is not None:
            target(epoch)

    def __iter__(self) -> Iterator[Any]:
        loaders, mode = self._loaders, self._measure.request.mode
        if mode == "supply":
            self._supply()  # ends the run (TrialDone)
        self._measure.ready()
        device, channels_last = loaders.device, loaders.channels_last
        if mode == "ceiling" and not loaders.is_other(self):
            first = self._counted(to_device(next(self._iter()), device, channels_last))
            while True:
                loaders.handed(self)
                yield first
        # Each batch timed from the script's ask to its hand-over, the copy to the device included (as the built-in
        # job's pipelines copy inside theirs): the step's wait for data (``trainer.meter.timed_batches``).
        moved = (to_device(batch, device, channels_last) for batch in self._epoch())
        for batch in timed_batches(moved, self._waited):
            loaders.handed(self)
            yield self._counted(batch)

    def _waited(self, seconds: float) -> None:
        """The script waited ``seconds`` for a batch: the training loader's wait goes into the meter's windows
        (another loader's, a validation loader's, is no part of training)."""
        if self._measure.meter is not None and not self._loaders.is_other(self):
            self._measure.meter.waited(seconds)

    def _counted(self, batch: Any) -> Any:
        if self.first_samples is None:
            self.first_samples = self._samples(batch)
        return batch

    def _epoch(self) -> Iterator[Any]:
        """One pass over the loader. Where its batches come in rounds of its workers (``Measurement._epoch_shape``),
        each turn, from its last whole round to the next epoch's first, is marked for the meter
        (``Measurement.turn``); the first epoch's start is timed alone (``Measurement.first_start``)."""
        measure = self._measure
        if self._loaders.is_other(self):  # a validation loader, once the steps report on another: no part of training
            with measure.meter.paused():
                yield from self._iter()
            return
        with measure.first_start(self._loaders.training):
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
            turns = measure.turns_of(self)  # known once the meter is made, at the first step
            if turns and given == turns[1]:
                measure.turn(begin=False)
            if turns and given == length - turns[0]:
                measure.turn(begin=True)
            batch = next(it, _END)

    def _supply(self) -> None:
        """The loader alone, no model: batches to the device as fast as it delivers them, until the meter has its
        figure; then the summary, and the trial ends. The loader the script iterates first is its training loader."""
        measure, device, channels_last = self._measure, self._loaders.device, self._loaders.channels_last
        self._loaders.supplies(self)
        measure.ready()
        meter = measure.start(self, continuous=False)
        checksum = torch.zeros((), device=device)
        epoch = 0
        while not meter.done:
            self.set_epoch(epoch)
            for batch in self._epoch():
                moved = to_device(batch, device, channels_last)
                checksum += touch(moved).to(device)
                measure.step(self._samples(batch))
                if meter.done:
                    break
            epoch += 1
        measure.finish(checksum, None)
        raise TrialDone()
