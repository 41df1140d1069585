"""A run's loaders: a script's Dataset or DataLoader through ``run.loader``, an image folder through the project's
pipelines (``run.image_loader``), and ``Batches``: the batches a loader hands the script, as the trial wants them (on
the run's device, the loader alone, or one batch replayed), each epoch's turn marked for the meter."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.apply import DATALOADER_PREFETCH, applied_here, data_loader, loader_settings
from trainer.config import ConfigError, DataConfig, TrainConfig, TrainingConfig
from trainer.runtime._base import _END, _UNSET, IMAGES, LOADER, ScriptError, TrialDone
from trainer.runtime._batches import first_length, prefetched, samples_per_rank, to_device, touch
from trainer.runtime._folder import image_folder


class Loaders:
    """The loader helpers of a run, and which loader is its training loader."""

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
        nothing unless the steps report on its batches (``_use_as_training_loader`` at the first report)."""
        batches.applied, batches.image_folder = applied, folder
        self._closables.append(batches.close)
        if self._loader is None:
            self._use_as_training_loader(batches)
        else:
            self._applied = before
        return batches

    def _use_as_training_loader(self, batches: Batches) -> None:
        """``batches`` is the training loader: its settings are the ones the run records."""
        for name in self._loader.applied if self._loader is not None else ():
            self._applied.pop(name, None)
        self._loader = batches
        self._applied.update(batches.applied)
        self._image_folder = batches.image_folder

    def _is_other_loader(self, batches: Batches) -> bool:
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


class Batches:
    """The batches a script's loader hands it, as the run wants them: on the run's device, and in a stage's modes
    the loader alone (``supply``) or its first batch replayed on the device (``ceiling``). Iterating yields them;
    ``len()``, ``set_epoch`` and any other attribute are the loader's (its ``sampler``, ``dataset``).

    Both stage modes need nothing more of a script than that its loader goes through ``run.loader`` or
    ``run.image_loader``: the supply is its input pipeline without the model (how much it can feed), the ceiling its
    model without the input pipeline (a batch that is already on the device costs nothing to fetch) — the two
    numbers the search's stages weigh for the built-in job too."""

    def __init__(self, run: Loaders, loader, *, samples: Callable[[Any], int] | None = None, buffered: int = 0,
                 stream: bool = False):
        # ``run`` is the whole run (``trainer.runtime._run.Run``): its loaders, and what it reports.
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
        it (``trainer.worker.leftovers``): left open, a script's persistent loader workers would cost every next
        trial a fresh worker."""
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
        if mode == "ceiling" and not run._is_other_loader(self):
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
        """One pass over the loader. Where its batches come in rounds of its workers (``Run._epoch_shape``), each
        turn, from its last whole round to the next epoch's first, is marked for the meter (``Run._turn``); the
        first epoch's start is timed alone (``Run._first_start``)."""
        run = self._run
        if run._is_other_loader(self):  # a validation loader, once the steps report on another: no part of training
            with run.meter.paused():
                yield from self._iter()
            return
        with run._first_start():
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
            batch = next(it, _END)

    def _supply(self) -> None:
        """The loader alone, no model: batches to the device as fast as it delivers them, until the meter has its
        figure; then the summary, and the trial ends. The loader the script iterates first is its training loader."""
        run = self._run
        if run._loader is not self:
            run._use_as_training_loader(self)
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
