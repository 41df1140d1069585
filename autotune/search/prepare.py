"""Everything a search decides before it touches the study: the spec (or a model and a data folder given on the
command line), the GPUs and ranks, the data, the search space for this machine and this data, trial 0, and every
check that would otherwise fail trial after trial. A mistake costs one line and leaves no trace in any study."""

from __future__ import annotations

import difflib
import importlib
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.exceptions import AutotuneError, DataError, SpecError
from autotune.hw.nvml import Gpu, Nvml
from autotune.hw.placement import gpu_count, parse_gpu_list, place, to_nvml, visible_entries
from autotune.objective import Objective
from autotune.runner.torchrun import Torchrun
from autotune.space import SearchSpace, resolve
from autotune.spec import StudySpec, load_spec
from autotune.study.liveness import HEARTBEAT_S
from autotune.study.storage import default_storage
from trainer.config import ConfigError, TrainConfig
from trainer.data.files import resolve_splits
from trainer.datagen import make_image_folder
from trainer.model import classification_models


@dataclass(kw_only=True)
class SearchOptions:
    """``autotune search``'s options; every field ``None`` means: the spec's (or the machine's) default."""

    spec: str | None = None
    """A spec YAML path or a built-in name; default: resnet50 when GPUs are visible, else cpu-demo."""

    model: str | None = None
    """Tune this model instead of the spec's: a torchvision classifier name or ``package.module:factory``."""

    data: str | None = None
    """Use this ImageFolder instead of the spec's data."""

    image_size: int | None = None
    trials: int | None = None
    timeout_s: float | None = None
    trial_timeout_s: float | None = None
    storage: str | None = None
    study: str | None = None
    nproc: int | None = None
    gpus: str | None = None
    objective: str | None = None
    seed: int | None = None
    stale_after_s: float | None = None


@dataclass(kw_only=True)
class DataSummary:
    path: str
    train: int
    val: int
    classes: int
    mean_size: tuple[float, float] | None = None
    """Mean width x height of a sample of the training images."""

    def line(self) -> str:
        size = f", about {self.mean_size[0]:.0f}x{self.mean_size[1]:.0f} px" if self.mean_size else ""
        val = f" + {self.val} for validation" if self.val else ""
        return f"{self.train} training images{val} in {self.classes} classes{size} at {self.path}"


@dataclass(kw_only=True)
class Plan:
    """What a search runs, decided before the study is opened."""

    options: SearchOptions
    spec: StudySpec
    name: str
    objective: Objective
    nproc: int
    torchrun: Torchrun
    entries: list[str] | None
    """``CUDA_VISIBLE_DEVICES`` entries of the trials' GPUs; None on a machine without GPUs."""

    gpus: list[Gpu]
    nvml: Nvml
    util_reason: str | None
    """Why NVML utilization is unavailable (None: it is available)."""

    space: SearchSpace
    base: TrainConfig | None
    """The base config with its data path; None while the spec's data is still to be generated."""

    probe: TrainConfig
    """The base config, with a stand-in for data still to be generated (what the checks run on)."""

    baseline: dict[str, Any]
    starts: list[dict[str, Any]]
    data: DataSummary | None
    storage_url: str
    trials: int
    timeout_s: float | None
    trial_timeout_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.nproc * self.torchrun.nnodes

    @property
    def util_available(self) -> bool:
        return self.util_reason is None


def prepare(o: SearchOptions, say=print) -> Plan:
    check_options(o)
    nvml = Nvml()
    visible = visible_entries(gpu_count(nvml))
    spec = with_command_line(load_spec(choose_spec(o.spec, len(visible), say)), o)
    entries, nproc = placement(o, spec, visible)
    gpus = to_nvml(nvml, entries) if entries else []
    torchrun = Torchrun.parse(spec.world.torchrun_args)
    world = nproc * torchrun.nnodes
    objective = Objective(kind=o.objective or spec.objective.kind, weights=spec.objective.weights)
    util_reason = None if nvml.available and gpus else ("no GPU" if not entries else
                                                        nvml.reason or "no NVML device for the selected GPUs")
    objective.check(util_reason is None, util_reason or "")
    base = given_data(spec, o.data)
    data = summarize_data(base) if base is not None and base.data.kind == "imagefolder" else None
    probe = base or spec.base_config("<generated>")
    space = resolve(spec, world_size=world, nproc_per_node=nproc, cpu_only=not entries,
                    max_batch=images_per_rank(spec, data, world),
                    synthetic=probe.data.kind == "synthetic")
    baseline = space.baseline_params(spec, probe.to_dict())
    starts = space.start_params(spec)
    preflight(spec, probe, space, baseline, world)
    name = o.study or study_name(spec, o)
    return Plan(options=o, spec=spec, name=name, objective=objective, nproc=nproc, torchrun=torchrun,
                entries=entries, gpus=gpus, nvml=nvml, util_reason=util_reason, space=space, base=base, probe=probe,
                baseline=baseline, starts=starts, data=data, storage_url=o.storage or default_storage(name),
                trials=o.trials or spec.budget.trials,
                timeout_s=o.timeout_s if o.timeout_s is not None else spec.budget.timeout_s,
                trial_timeout_s=o.trial_timeout_s or spec.budget.trial_timeout_s)


def check_options(o: SearchOptions) -> None:
    for flag, value in (("--trials", o.trials), ("--timeout", o.timeout_s), ("--trial-timeout", o.trial_timeout_s),
                        ("--stale-after", o.stale_after_s), ("--image-size", o.image_size)):
        if value is not None and value <= 0:
            raise AutotuneError(f"{flag} {value:g}: must be > 0")
    if o.stale_after_s is not None and o.stale_after_s < 3 * HEARTBEAT_S:
        raise AutotuneError(f"--stale-after {o.stale_after_s:g}: must be >= {3 * HEARTBEAT_S:g} s (three "
                            "heartbeats), or a live trial on another machine could be taken for stale")


def choose_spec(spec: str | None, n_visible: int, say) -> str:
    if spec:
        return spec
    if n_visible:
        say(f"autotune: {n_visible} GPU(s) visible: running the built-in resnet50 study (ResNet-50, generated "
            "ImageNet-like JPEGs) on them; --spec picks another")
        return "resnet50"
    say("autotune: no GPU visible: running the built-in cpu-demo study (2 gloo ranks, small model and images); "
        "on a GPU machine the same command tunes ResNet-50")
    return "cpu-demo"


def with_command_line(spec: StudySpec, o: SearchOptions) -> StudySpec:
    """The spec with ``--model`` and ``--image-size`` in its base (checked as any spec is)."""
    if o.model is None and o.image_size is None:
        return spec
    data = spec.to_dict()
    base = data["base"]
    if o.model is not None:
        base["model"] = {"name": o.model}
    if o.image_size is not None:
        base.setdefault("data", {})["image_size"] = o.image_size
    data["name"] = spec.name
    return StudySpec.from_dict(data, source=f"{spec.source} with --model/--image-size")


def study_name(spec: StudySpec, o: SearchOptions) -> str:
    """The spec's name, with the model and data folder given on the command line: another model or data is another
    study (its trials would not compare with the spec's)."""
    parts = [spec.name]
    if o.model:
        parts.append(o.model.rsplit(":", 1)[-1].rsplit(".", 1)[-1])
    if o.data:
        parts.append(Path(o.data).expanduser().resolve().name)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(parts)).strip("-.") or spec.name


def placement(o: SearchOptions, spec: StudySpec, visible: list[str]) -> tuple[list[str] | None, int]:
    """(the trials' GPU entries or None without GPUs, ranks per node)."""
    nproc, entries = place(visible, parse_gpu_list(o.gpus), o.nproc if o.nproc is not None
                           else spec.world.nproc_per_node)
    return entries, nproc


# ---- data ---------------------------------------------------------------------------------------------------------


def data_cache_root(spec: StudySpec) -> Path:
    if spec.data.cache_dir:
        return Path(spec.data.cache_dir).expanduser()
    if os.environ.get("AUTOTUNE_CACHE"):
        return Path(os.environ["AUTOTUNE_CACHE"]) / "data"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "ddp-autotune" / "data"


def given_data(spec: StudySpec, data_arg: str | None) -> TrainConfig | None:
    """The base config when its data already exists (``--data``, the spec's path, synthetic), checked: the folder
    exists and holds images. None when the spec's data is to be generated (``generate_data``)."""
    if data_arg:
        path = Path(data_arg).expanduser().resolve()
        if not path.is_dir():
            raise DataError(f"--data {data_arg}: no such folder; make one with `autotune make-data {data_arg} "
                            "--images 1000 --classes 10`, or point --data at an ImageFolder (one sub-folder per "
                            "class)")
        base = spec.base_config(str(path)).with_overrides({"data.kind": "imagefolder"})
        return _check_images(base, "--data")
    if spec.generates_data:
        return None
    base = spec.base_config()
    if base.data.kind == "imagefolder":
        path = Path(base.data.path).expanduser()
        if not path.is_dir():
            raise DataError(f"base.data.path {path}: no such folder; fix the spec or pass --data DIR")
        base = base.with_overrides({"data.path": str(path.resolve())})
        return _check_images(base, "base.data.path")
    return base


def _check_images(base: TrainConfig, where: str) -> TrainConfig:
    """An ImageFolder with no image (or a validation split that does not match) fails every trial: say so now."""
    try:
        resolve_splits(base)
    except ConfigError as e:
        raise DataError(f"{where}: {'; '.join(e.problems)}; it needs one folder per class with JPEG/PNG files in "
                        "them (`autotune make-data DIR --images N --classes C` makes one)") from None
    return base


def generate_data(spec: StudySpec, say) -> TrainConfig:
    gen = spec.data.generate
    root = data_cache_root(spec) / "imagefolder-{images}x{classes}-seed{seed}".format(
        images=gen["images"], classes=gen["classes"], seed=gen.get("seed", 0))
    say(f"autotune: data: {gen['images']} generated JPEGs in {gen['classes']} classes at {root} (made once, then "
        "reused)")
    make_image_folder(root, images=gen["images"], classes=gen["classes"], val_fraction=gen.get("val_fraction", 0.0),
                      seed=gen.get("seed", 0), progress=sys.stderr.isatty())
    return spec.base_config(str(root.resolve()))


def summarize_data(base: TrainConfig, sample: int = 32) -> DataSummary:
    """What an ImageFolder holds: counts, classes and the size of a few images (read from their headers)."""
    from PIL import Image

    train, val = resolve_splits(base)
    step = max(1, len(train.samples) // sample)
    sizes = []
    for path, _ in train.samples[::step][:sample]:
        try:
            with Image.open(path) as im:
                sizes.append(im.size)
        except OSError:
            continue
    mean = (statistics.fmean(w for w, _ in sizes), statistics.fmean(h for _, h in sizes)) if sizes else None
    return DataSummary(path=str(base.data.path), train=len(train.samples), val=len(val.samples) if val else 0,
                       classes=len(train.classes), mean_size=mean)


def images_per_rank(spec: StudySpec, data: DataSummary | None, world: int) -> int | None:
    """Training images each rank sees per epoch (the largest batch the data can fill), when known before any run."""
    if data is not None:
        return data.train // world
    gen = spec.data.generate if spec.generates_data else None
    if gen:
        val = max(1, int(gen["images"] * gen.get("val_fraction", 0.0))) if gen.get("val_fraction") else 0
        return (gen["images"] - val) // world
    return None


# ---- checks ---------------------------------------------------------------------------------------------------------


def preflight(spec: StudySpec, base: TrainConfig, space: SearchSpace, baseline: dict[str, Any], world: int) -> None:
    """What would otherwise fail trial after trial: model names that do not resolve, knob range ends outside what
    the config accepts, a baseline config that is invalid, less data than one global batch. One SpecError/DataError
    listing every problem."""
    problems = model_problems(space, baseline, base.model.name)
    for p in space.params:
        if p.kind == "categorical":
            continue  # choices were checked with the spec
        for end, value in (("low", p.low), ("high", p.high)):
            try:
                TrainConfig().with_overrides({p.path: value})
            except ConfigError as e:
                problems += [f"space.{p.path}.{end}: {x}" for x in e.problems if x.startswith(f"{p.path}=")]
    try:
        cfg = base.with_overrides(space.derive(dict(baseline), base.to_dict()))
    except ConfigError as e:
        problems += [f"baseline (trial 0): {x}" for x in e.problems]
        cfg = None
    if problems:
        raise SpecError(problems, spec.source)
    if cfg is not None and cfg.data.kind == "imagefolder" and cfg.data.path and Path(cfg.data.path).is_dir():
        n = len(resolve_splits(cfg)[0].samples)
        need = cfg.training.batch_size * world
        if n < need:
            raise DataError(f"data folder {cfg.data.path}: {n} training images, fewer than one batch of trial 0 on "
                            f"every rank ({need} = batch x {world} ranks); add images or lower the batch")


def model_problems(space: SearchSpace, baseline: dict[str, Any], base_model: str) -> list[str]:
    """Every model a trial may build must resolve: a torchvision classification model or an importable
    ``package.module:function``."""
    names = {base_model: "base.model.name"}
    param = space.by_path().get("model.name")
    for c in (param.choices if param is not None else ()):
        names.setdefault(c, "space.model.name")
    if "model.name" in baseline:
        names.setdefault(baseline["model.name"], "baseline.model.name")
    problems, known = [], None
    for name, where in names.items():
        if not isinstance(name, str):
            continue
        if ":" in name:
            problems += _factory_problems(name, where)
            continue
        known = known or classification_models()
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
            problems.append(f"{where}={name!r}: not a torchvision classification model ({hint}); or give a factory "
                            "as package.module:function")
    return problems


def _factory_problems(name: str, where: str) -> list[str]:
    module, _, fn = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module), fn, None)
    except Exception as e:
        return [f"{where}={name!r}: cannot import {module} ({type(e).__name__}: {e}); is it on PYTHONPATH?"]
    return [] if callable(obj) else [f"{where}={name!r}: {module} has no function {fn}"]


def describe_model(plan: Plan) -> str:
    """What is tuned: the model, the image size, and where each comes from."""
    cfg = plan.probe
    source = "--model" if plan.options.model else "the spec"
    size = "--image-size" if plan.options.image_size else "the spec"
    return (f"model {cfg.model.name} (from {source}) at {cfg.data.image_size} px (from {size}; --model and "
            "--image-size change them)")
