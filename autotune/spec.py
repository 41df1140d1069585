"""StudySpec: what a study tunes and how — one YAML file.

A spec names a *base* TrainConfig (a partial mapping, as in a ``python -m trainer`` YAML), the world size, the
search space (knobs named by TrainConfig dotted path, each with choices or a range, optionally conditional), the
baseline that becomes trial 0, the objective, the budget, the sampler and the pruner. Example (see
``studies/resnet50.yaml`` for every section, commented)::

    name: my-study
    base:
      model: {name: resnet50}
      data: {kind: imagefolder, path: /data/imagenet}
    space:                                   # overrides the built-in image-model space, knob by knob
      training.batch_size: {choices: [64, 128, 256]}
      loader.num_workers: {low: 2, high: auto}
      nccl.algo: null                        # null: not searched (the base value is used)
    baseline: {training.batch_size: 64, loader.num_workers: 4}
    starts:                                  # trials 1.., after the baseline: partial, the rest drawn
      - {data.decode: nvjpeg-gpu, training.precision: fp16}
    budget: {trials: 20, trial_timeout_s: 300}

Validation collects every problem before raising one SpecError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from autotune.exceptions import SpecError
from autotune.ranges import space_problems
from trainer.config import ConfigError, TrainConfig, build_dataclass, drop_retired, load_yaml_mapping
from trainer.knobs import Range


@dataclass(kw_only=True)
class DataSource:
    generate: dict[str, Any] | None = None
    """When ``base.data`` is an imagefolder without ``path``: a JPEG set made once with
    ``trainer.datagen.make_image_folder(root, **generate)`` (e.g. ``{images: 20000, classes: 100}``) and cached."""

    cache_dir: str | None = None
    """Where generated sets live; default ``$AUTOTUNE_CACHE`` or ``~/.cache/ddp-autotune/data``."""


@dataclass(kw_only=True)
class World:
    nproc_per_node: int | None = None
    """Ranks per node; ``null``: every visible GPU (2 gloo ranks when there is none)."""

    torchrun_args: list[str] = field(default_factory=list)
    """Extra torchrun arguments passed through as they are (multi-node: ``--nnodes``, ``--rdzv-endpoint`` ...)."""


@dataclass(kw_only=True)
class ObjectiveSpec:
    kind: Literal["throughput", "pareto", "weighted"] = "throughput"
    """``throughput``: maximize global imgs/s (median over windows). ``pareto``: maximize (imgs/s, NVML util)
    jointly. ``weighted``: maximize ``imgs_per_s**w.throughput * (util/100)**w.util * power_w**(-w.power)``."""

    weights: dict[str, float] = field(default_factory=lambda: {"throughput": 1.0, "util": 0.5, "power": 0.0})
    """Exponents of the ``weighted`` score. Scale-free: ``{throughput: 1, power: 1}`` is images per joule;
    ``{throughput: 1, util: 0.5}`` trades a little speed for a busier GPU."""


@dataclass(kw_only=True)
class Budget:
    trials: int = 20
    """Trials one ``autotune search`` call runs (a second call adds as many to the same study)."""

    timeout_s: float | None = None
    """No new trial starts after this many seconds."""

    trial_timeout_s: float = 300.0
    """A trial with no new measurement window for this long is killed and recorded as ``hang``."""


@dataclass(kw_only=True)
class SamplerSpec:
    kind: Literal["tpe", "random"] = "tpe"
    seed: int | None = None
    """The seed of the worker that creates the study (its trials are reproducible); a worker that resumes or joins
    the study derives its own from it, the trial count, host and PID, so it does not draw the same start-up trials."""

    n_startup_trials: int = 8
    """Random trials before TPE models the space (the baseline counts)."""

    multivariate: bool = True
    """Multivariate TPE with group decomposition (the space is conditional)."""

    constant_liar: bool = True
    """Parallel search workers avoid suggesting what a running trial already tries."""


RETIRED = {"pruner": ("tolerance", "min_windows")}
"""Spec settings earlier versions wrote that no longer mean anything (a stored study's spec still loads)."""


@dataclass(kw_only=True)
class PrunerSpec:
    kind: Literal["best", "none"] = "best"
    """``best``: stop an end-to-end trial as soon as its figure's interval lies below the best configuration's (racing:
    it is measurably slower); a draw whose measured ceiling or supply reaches no higher than the bottom of the
    best's interval is not launched. Infeasible, failed and pruned trials never set the bar, and stage measurements,
    the baseline and confirmations are never pruned (``autotune.study.pruning``). ``none``: every trial measures to
    its end."""


@dataclass(kw_only=True)
class StagesSpec:
    enabled: bool = True
    """Measure the bottleneck before searching (``autotune.search.stages``): the model's compute ceiling (synthetic
    data on the GPUs) and each input pipeline's supply (the loader alone), the likeliest fastest first, an end-to-end
    trial as soon as one of each is known, and then only what can still raise the bound, within half of the search's
    budget; the sampler refines from the end-to-end trials. A budget too small for that runs a smaller plan and says
    which. ``false``: the sampler alone, from the baseline."""

    ceiling_window_s: float = 1.0
    """Window length of the ceiling measurements (synthetic data on the device is steady: short windows agree)."""

    candidates: int = 3
    """End-to-end trials started from the stages' ranking: one per input pipeline family (the best of each, ties
    broken by measured headroom), the best bound first; a candidate whose trials all fail is replaced by the next."""


@dataclass(kw_only=True)
class StudySpec:
    name: str
    """Study name (default storage: ``sqlite:///studies/autotune.db``; trial logs under ``studies/<name>/``)."""

    description: str = ""
    base: dict[str, Any] = field(default_factory=dict)
    """A partial TrainConfig mapping every trial starts from."""

    data: DataSource = field(default_factory=DataSource)
    world: World = field(default_factory=World)
    default_space: bool = True
    """Start from the built-in image-model space (``autotune.ranges.default_space``); ``space`` overrides it."""

    space: dict[str, Range | None] = field(default_factory=dict)
    """Knobs by TrainConfig dotted path, each with its range; ``null`` removes a default knob."""

    fixed_global_batch: int | None = None
    """Keep micro-batch x accum x world = G: ``training.accum_steps`` is derived, batch choices that do not divide
    G are dropped."""

    baseline: dict[str, Any] = field(default_factory=dict)
    """Trial 0: searched knobs set by dotted path (the rest take the base value)."""

    starts: list[dict[str, Any]] = field(default_factory=list)
    """Trials 1.. of a new study, after the baseline: partial settings by dotted path (e.g. one per input
    pipeline), the knobs they leave out drawn by the sampler. A short search then starts from every region a
    careful human would try instead of from random draws alone; the sampler refines from there."""

    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    budget: Budget = field(default_factory=Budget)
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    pruner: PrunerSpec = field(default_factory=PrunerSpec)
    stages: StagesSpec = field(default_factory=StagesSpec)
    export: dict[str, Any] = field(default_factory=lambda: {"training.mode": "train", "training.epochs": 1})
    """Dotted overrides ``autotune export`` applies to the best trial's config (a train run instead of a
    measurement)."""

    source: str = field(default="spec", repr=False, init=False)

    # ---- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str = "spec") -> StudySpec:
        problems: list[str] = []
        if not isinstance(data, dict):
            raise SpecError([f"expected a mapping at the top level, got {type(data).__name__}"], source)
        if "name" not in data:
            problems.append("name: missing (a study name, e.g. name: my-study)")
        data = drop_retired(data, RETIRED, "the pruner races intervals: a trial stops once its interval lies below "
                                           "the best's")
        spec = _build(cls, {"name": "?", **data}, "", problems)
        spec.source = source
        # Badly typed fields were left at their defaults, so the cross-field pass can run too: all problems at once.
        problems.extend(spec.problems())
        if problems:
            raise SpecError(problems, source)
        return spec

    @classmethod
    def from_yaml(cls, path: str | Path) -> StudySpec:
        try:
            data = load_yaml_mapping(path)
        except ConfigError as e:
            raise SpecError([x.split(": ", 1)[-1] for x in e.problems], str(path)) from None
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return json.loads(json.dumps(d))

    def fingerprint(self, nproc: int) -> str:
        """Hash of what makes trials comparable (not budget, sampler or pruner): a study that exists with another
        fingerprint was made by a different spec."""
        d = self.to_dict()
        keep = {k: d[k] for k in ("base", "default_space", "space", "fixed_global_batch", "baseline", "objective",
                                  "stages")}
        keep["nproc_per_node"] = nproc
        keep["torchrun_args"] = d["world"]["torchrun_args"]
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

    # ---- validation --------------------------------------------------------------------------------------------

    def base_config(self, data_path: str | None = None) -> TrainConfig:
        """The base TrainConfig; ``data_path`` fills ``data.path`` (a generated or ``--data`` folder)."""
        base = json.loads(json.dumps(self.base))
        if data_path is not None:
            if not isinstance(base.get("data"), dict):
                base["data"] = {}
            base["data"]["path"] = data_path
        return TrainConfig.from_dict(base)

    @property
    def generates_data(self) -> bool:
        data = self.base.get("data") if isinstance(self.base.get("data"), dict) else {}
        return data.get("kind") == "imagefolder" and not data.get("path") and self.data.generate is not None

    def problems(self) -> list[str]:
        p: list[str] = []
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name):
            p.append(f"name={self.name!r}: use letters, digits, '-', '_' or '.' (it names files)")
        try:
            self.base_config("<generated>" if self.generates_data else None)
        except ConfigError as e:
            p.extend(f"base.{x}" for x in e.problems)
        p.extend(space_problems(self))
        if self.world.nproc_per_node is not None and self.world.nproc_per_node < 1:
            p.append(f"world.nproc_per_node={self.world.nproc_per_node}: must be >= 1 (or null for all GPUs)")
        if self.fixed_global_batch is not None and self.fixed_global_batch < 1:
            p.append(f"fixed_global_batch={self.fixed_global_batch}: must be >= 1")
        unknown_w = set(self.objective.weights) - {"throughput", "util", "power"}
        if unknown_w:
            p.append(f"objective.weights: unknown {sorted(unknown_w)}; use throughput, util, power")
        if self.objective.kind == "weighted" and self.objective.weights.get("throughput", 0) <= 0:
            p.append("objective.weights.throughput must be > 0 for the weighted objective")
        b = self.budget
        if b.trials < 1:
            p.append(f"budget.trials={b.trials}: must be >= 1")
        if b.timeout_s is not None and b.timeout_s <= 0:
            p.append(f"budget.timeout_s={b.timeout_s}: must be > 0 (or null)")
        if b.trial_timeout_s <= 0:
            p.append(f"budget.trial_timeout_s={b.trial_timeout_s}: must be > 0")
        if self.sampler.n_startup_trials < 0:
            p.append("sampler.n_startup_trials must be >= 0")
        if self.stages.ceiling_window_s <= 0 or self.stages.candidates < 1:
            p.append("stages.ceiling_window_s must be > 0 and stages.candidates >= 1")
        if self.data.generate is not None:
            unknown = set(self.data.generate) - {"images", "classes", "val_fraction", "seed"}
            if unknown:
                p.append(f"data.generate: unknown {sorted(unknown)}; use images, classes, val_fraction, seed")
            for k in ("images", "classes"):
                v = self.data.generate.get(k)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    p.append(f"data.generate.{k}={v!r}: an integer >= 1 is required")
        try:
            TrainConfig().with_overrides(dict(self.export))
        except ConfigError as e:
            p.extend(f"export: {x}" for x in e.problems)
        return p


# ---- finding specs -----------------------------------------------------------------------------------------------


def builtin_names() -> list[str]:
    """Specs shipped with the package (``studies/*.yaml``, also installed as ``autotune/studies``)."""
    try:
        return sorted(p.name[:-5] for p in resources.files("autotune").joinpath("studies").iterdir()
                      if p.name.endswith(".yaml"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def find_spec(name_or_path: str) -> Path:
    """A spec by path, else by name: ``./studies/NAME.yaml``, else the copy shipped in the package."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    name = p.name[:-5] if p.name.endswith(".yaml") else p.name
    if p.parent == Path("."):
        local = Path("studies") / f"{name}.yaml"
        if local.is_file():
            return local
        packaged = resources.files("autotune").joinpath("studies", f"{name}.yaml")
        if packaged.is_file():
            with resources.as_file(packaged) as path:
                return Path(path)
    known = ", ".join(builtin_names()) or "none"
    raise SpecError([f"no such spec file or built-in spec (built-in: {known}); pass a path to a YAML file"],
                    name_or_path)


def load_spec(name_or_path: str) -> StudySpec:
    return StudySpec.from_yaml(find_spec(name_or_path))


# ---- mapping -> StudySpec: trainer.config's builder, with the spec's own fields taken over ---------------------------


def _build(cls, data: Any, prefix: str, problems: list[str]):
    def convert(owner, key, value):
        if owner is StudySpec and key == "space":
            return _build_space(value, problems)
        if owner is StudySpec and key in ("baseline", "export", "base") and value is None:
            return {}
        return NotImplemented

    return build_dataclass(cls, data, prefix, problems, convert=convert,
                           empty=(lambda: StudySpec(name="?")) if cls is StudySpec else None)


def _build_space(value: Any, problems: list[str]) -> dict[str, Range | None]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"space: expected a mapping of dotted paths to knobs, got {type(value).__name__}")
        return {}
    out: dict[str, Range | None] = {}
    for path, knob in value.items():
        if knob is None or knob is False:
            out[str(path)] = None
        elif isinstance(knob, list):  # shorthand: a list is the choices
            out[str(path)] = Range(choices=knob)
        else:
            out[str(path)] = _build(Range, knob, f"space.{path}.", problems)
    return out


