"""The search space: StudySpec knobs → Optuna ``trial.suggest_*`` calls → TrainConfig overrides.

Parameters are named by their TrainConfig dotted path, so a trial's params *are* its overrides (plus derived values:
``training.accum_steps`` in fixed-global-batch mode). Conditional knobs (``when``) are suggested only when their
condition holds, so e.g. ``loader.prefetch_factor`` never appears on a trial with ``loader.num_workers: 0``.

A batch size that ran out of memory is not tried again at a larger size with the same memory-relevant settings
(``MEMORY_KEYS``): such a suggestion is recorded as infeasible without launching anything.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import re
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from autotune.exceptions import SpecError
from trainer.config import ConfigError, TrainConfig
from trainer.knobs import AUTO, KNOBS, MEMORY_SETTINGS

if TYPE_CHECKING:
    from autotune.spec import StudySpec

DEFAULT_CHOICE = "default"
"""In ``choices``, ``default`` means ``null``: leave the setting to the library (e.g. NCCL picks its algorithm)."""


@dataclass(kw_only=True)
class Knob:
    """One searchable setting. Either ``choices`` (categorical) or ``low``/``high`` (int or float range)."""

    choices: list[Any] | None = None
    """Values to pick from; ``default`` stands for null (the library's own choice)."""

    low: Any = None
    """Range start (inclusive). ``auto`` where supported (``loader.num_workers``: 0)."""

    high: Any = None
    """Range end (inclusive). ``auto`` for ``loader.num_workers`` is the CPU cores per rank."""

    log: bool = False
    """Sample the range on a log scale."""

    step: float | int | None = None
    """Range step (ints: default 1)."""

    when: str | None = None
    """Condition on another setting, ``"PATH OP VALUE"`` with OP one of == != > >= < <= in; the knob is only
    suggested when it holds (evaluated on the trial's config so far: searched values, else the base)."""


def _default_space() -> dict[str, Knob]:
    return {k.path: Knob(choices=list(k.choices) if k.choices is not None else None, low=k.low, high=k.high,
                         log=k.log, when=k.when)
            for k in KNOBS.values() if k.default_space}


DEFAULT_SPACE: dict[str, Knob] = _default_space()
"""The image-model defaults: the knobs of ``trainer.knobs.KNOBS`` marked ``default_space`` (``training.compile`` on
GPU machines only: the stages weigh its compile, ``autotune.search.stages``). Not in it: the compile mode (minutes
of compile per graph for CUDA graphs or autotuning), cuDNN's algorithm search (the ceiling stage decides it), and
NCCL's variables (debugging variables that no measurement here has shown to matter; each change
takes a new process). A spec adds any of them, e.g. ``nccl.algo: [default, Ring, Tree]``."""

MEMORY_KEYS = MEMORY_SETTINGS
"""Settings that change a micro-batch's device memory enough that an OOM at batch B says nothing about batch B'
under different values (``ddp.bucket_cap_mb`` moves memory by at most a few buckets: not included)."""

_OPS = {"==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le, ">": operator.gt,
        "<": operator.lt, "in": lambda a, b: a in b}
_COND = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(==|!=|>=|<=|>|<|\bin\b)\s*(.+?)\s*$")


@dataclass(frozen=True, kw_only=True)
class Condition:
    path: str
    op: str
    value: Any

    @classmethod
    def parse(cls, text: str) -> Condition:
        m = _COND.match(text)
        if not m:
            raise ValueError(f"cannot parse {text!r}: write PATH OP VALUE, e.g. 'loader.num_workers > 0'")
        try:
            value = yaml.safe_load(m.group(3))
        except yaml.YAMLError:
            raise ValueError(f"cannot parse the value in {text!r}: write PATH OP VALUE, e.g. "
                             "'loader.num_workers > 0'") from None
        if m.group(2) == "in" and not isinstance(value, list):
            raise ValueError(f"{text!r}: 'in' needs a list, e.g. 'data.decode in [pil, torchvision-cpu]'")
        return cls(path=m.group(1), op=m.group(2), value=value)

    def holds(self, current: Any) -> bool:
        try:
            return bool(_OPS[self.op](current, self.value))
        except TypeError:  # e.g. None > 0
            return False


@dataclass(frozen=True, kw_only=True)
class Param:
    """A resolved knob: a fixed Optuna distribution under the dotted path's name."""

    path: str
    kind: str
    """``categorical``, ``int`` or ``float``."""

    choices: tuple = ()
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    when: Condition | None = None

    def suggest(self, trial) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.path, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.path, self.low, self.high, step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.path, self.low, self.high, step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        if self.kind == "categorical":
            return self.match(value) is not _MISSING
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not float(value).is_integer():
            return False
        return self.low <= value <= self.high

    def match(self, value: Any) -> Any:
        """The choice equal to ``value`` (25 matches 25.0, but True never matches 1), else ``_MISSING``."""
        for c in self.choices:
            if value == c and isinstance(value, bool) == isinstance(c, bool) and (value is None) == (c is None):
                return c
        return _MISSING

    def nearest(self, value: Any) -> Any:
        """The value of this knob closest to ``value``: a range's end, the nearest numeric choice, else the first."""
        if self.kind != "categorical":
            number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else self.low
            return min(max(number, self.low), self.high)
        numeric = [c for c in self.choices if isinstance(c, (int, float)) and not isinstance(c, bool)]
        if numeric and isinstance(value, (int, float)) and not isinstance(value, bool):
            return min(numeric, key=lambda c: (abs(c - value), c))
        return self.choices[0]

    def describe(self) -> str:
        if self.kind == "categorical":
            return "{" + ", ".join(_show(c) for c in self.choices) + "}"
        return f"[{self.low} .. {self.high}{' log' if self.log else ''}]"


_MISSING = object()


def _show(v: Any) -> str:
    return DEFAULT_CHOICE if v is None else str(v).lower() if isinstance(v, bool) else str(v)


@dataclass(kw_only=True)
class SearchSpace:
    params: list[Param]
    """In suggestion order (a conditional knob after the knobs its condition reads)."""

    fixed_global_batch: int | None = None
    world_size: int = 1
    notes: list[str] = dataclasses.field(default_factory=list)
    """What resolution changed (e.g. choices dropped on a CPU-only machine): printed once by ``autotune search``."""

    def by_path(self) -> dict[str, Param]:
        return {p.path: p for p in self.params}

    def suggest(self, trial, base: dict[str, Any], only: set[str] | None = None) -> dict[str, Any]:
        """Suggest every active knob on ``trial`` (``only``: just these); returns the overrides (suggested plus
        derived values)."""
        overrides: dict[str, Any] = {}
        for p in self.params:
            if only is not None and p.path not in only:
                continue
            if p.when is not None:
                current = overrides[p.when.path] if p.when.path in overrides else get_path(base, p.when.path)
                if not p.when.holds(current):
                    continue
            overrides[p.path] = p.suggest(trial)
        return self.derive(overrides, base)

    def derive(self, overrides: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        if self.fixed_global_batch:
            bs = overrides.get("training.batch_size", get_path(base, "training.batch_size"))
            overrides = {**overrides, "training.accum_steps": self.fixed_global_batch // (bs * self.world_size)}
        return overrides

    def baseline_params(self, spec: StudySpec, base: dict[str, Any]) -> dict[str, Any]:
        """The Optuna params of trial 0: ``spec.baseline`` where given, else the base config's value. A value the
        spec's baseline names must be in the space; a base value that is not (a minimal spec whose base never
        mentions the knob: torch's default of 4 loader workers on a machine that allows 1) is moved to the nearest
        value that is, with a note."""
        # Baseline keys whose knob this machine does not search (NCCL on a CPU) are simply not part of trial 0;
        # keys outside the spec's space at all were refused by knob_problems.
        problems, out = [], {}
        for p in self.params:
            explicit = p.path in spec.baseline
            value = spec.baseline[p.path] if explicit else get_path(base, p.path)
            if isinstance(value, str) and value == DEFAULT_CHOICE:
                value = None
            if p.when is not None:
                cond_value = out[p.when.path] if p.when.path in out else get_path(base, p.when.path)
                if not p.when.holds(cond_value):
                    continue
            if not p.contains(value):
                if explicit and not _declared(spec, p.path, value):
                    problems.append(f"baseline.{p.path}={_show(value)}: outside the searched {p.describe()}; "
                                    f"set baseline.{p.path} to one of those")
                    continue
                near = p.nearest(value)
                whose = "the spec's baseline" if explicit else "the base's"
                self.notes.append(f"baseline: {p.path}={_show(near)} ({whose} {_show(value)} is not searched on "
                                  f"this machine and data: {p.describe()})")
                value = near
            out[p.path] = p.match(value) if p.kind == "categorical" else value
        if problems:
            raise SpecError(problems, spec.source)
        return out


    def start_params(self, spec: StudySpec) -> list[dict[str, Any]]:
        """The Optuna params of ``spec.starts`` (partial: the sampler draws the rest). Knobs this machine does not
        search are ignored; a start needing a value this machine does not offer (nvjpeg-gpu on a CPU) is left out
        with a note; a value outside the space is an error."""
        problems, out = [], []
        by, declared = self.by_path(), effective_knobs(spec)
        for i, start in enumerate(spec.starts):
            params: dict[str, Any] = {}
            dropped = None
            for path, value in start.items():
                p = by.get(path)
                if isinstance(value, str) and value == DEFAULT_CHOICE:
                    value = None
                if p is None:
                    continue  # a knob this machine does not search (NCCL on a CPU): as for the baseline
                if not p.contains(value):
                    k = declared.get(path)
                    if k is not None and k.choices is not None and value in [_norm_choice(c) for c in k.choices]:
                        dropped = dropped or f"{path}={_show(value)} is not searched on this machine"
                    else:
                        problems.append(f"starts[{i}].{path}={_show(value)}: outside the searched {p.describe()}")
                else:
                    params[path] = p.match(value) if p.kind == "categorical" else value
            if dropped:
                self.notes.append(f"start {i} left out: {dropped}")
            elif params:
                out.append(params)
        if problems:
            raise SpecError(problems, spec.source)
        return out


# ---- TrainConfig introspection -----------------------------------------------------------------------------------


def field_type(path: str):
    """The annotated type of a TrainConfig leaf, or None when there is no such setting."""
    tp = TrainConfig
    for part in path.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return None if dataclasses.is_dataclass(tp) else tp


def _base_kind(tp) -> tuple[type | None, bool]:
    """(int|float|other, optional?) of an annotation like ``int | None``."""
    args = typing.get_args(tp)
    optional = type(None) in args
    core = [a for a in args if a is not type(None)] if args and typing.get_origin(tp) is not typing.Literal else [tp]
    for t in (int, float):
        if t in core:
            return t, optional
    return None, optional


def get_path(d: dict[str, Any], path: str) -> Any:
    node: Any = d
    for part in path.split("."):
        node = node[part]
    return node


# ---- validation and resolution -----------------------------------------------------------------------------------


def effective_knobs(spec: StudySpec) -> dict[str, Knob]:
    knobs: dict[str, Knob] = dict(DEFAULT_SPACE) if spec.default_space else {}
    for path, knob in spec.space.items():
        if knob is None:
            knobs.pop(path, None)
        else:
            knobs[path] = knob
    if spec.fixed_global_batch:
        knobs.pop("training.accum_steps", None)
    return knobs


def _declared(spec: StudySpec, path: str, value: Any) -> bool:
    """Whether ``value`` is in the knob as the spec declares it (a choice, or inside a range whose ``auto`` end is
    this machine's cores): it was left out here for the machine or the data, not by the spec."""
    k = effective_knobs(spec).get(path)
    if k is None:
        return False
    if k.choices is not None:
        return value in [_norm_choice(c) for c in k.choices]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or AUTO not in (k.low, k.high):
        return False
    return (k.low == AUTO or value >= k.low) and (k.high == AUTO or value <= k.high)


def _norm_choice(v: Any) -> Any:
    return None if isinstance(v, str) and v == DEFAULT_CHOICE else v


def knob_problems(spec: StudySpec) -> list[str]:
    """Every problem of the space section, without knowing the machine (``auto`` is checked at resolution)."""
    p: list[str] = []
    knobs = effective_knobs(spec)
    if not knobs:
        p.append("space: no knob left to search; add one (or set default_space: true)")
    for path, k in knobs.items():
        p += _knob_problems(spec, path, k)
    for key in spec.baseline:
        if key not in knobs:
            p.append(f"baseline.{key}: not a searched knob (searched: {', '.join(knobs) or 'none'}); "
                     "set it in base instead")
    for i, start in enumerate(spec.starts):
        for key in start:
            if key not in knobs:
                p.append(f"starts[{i}].{key}: not a searched knob (searched: {', '.join(knobs) or 'none'}); "
                         "name searched knobs only")
    if spec.fixed_global_batch and "training.batch_size" in knobs and knobs["training.batch_size"].choices is None:
        p.append("space.training.batch_size: fixed_global_batch needs batch choices (not a range)")
    return p


def _knob_problems(spec: StudySpec, path: str, k: Knob) -> list[str]:
    where = f"space.{path}"
    tp = field_type(path)
    if tp is None:
        return [f"{where}: no such TrainConfig setting (use a dotted path like training.batch_size)"]
    p = []
    if path == "training.accum_steps" and spec.fixed_global_batch:
        p.append(f"{where}: derived in fixed_global_batch mode; remove it")
    has_range = k.low is not None or k.high is not None
    if k.choices is not None and has_range:
        return [*p, f"{where}: give either choices or low/high, not both"]
    if k.choices is None and not has_range:
        return [*p, f"{where}: give choices: [...] or low: and high:"]
    p += _choice_problems(where, path, k.choices) if k.choices is not None else _range_problems(where, path, k, tp)
    if k.when is not None:
        try:
            c = Condition.parse(k.when)
            if field_type(c.path) is None:
                p.append(f"{where}.when: {c.path}: no such TrainConfig setting")
            elif c.path == path:
                p.append(f"{where}.when: a knob cannot depend on itself")
        except ValueError as e:
            p.append(f"{where}.when: {e}")
    return p


def _choice_problems(where: str, path: str, choices: list[Any]) -> list[str]:
    p = []
    if not choices:
        p.append(f"{where}: choices is empty")
    if len({repr(c) for c in choices}) != len(choices):
        p.append(f"{where}: a choice is listed twice")
    for c in choices:
        if isinstance(c, (list, dict)):
            p.append(f"{where}: choice {c!r} is not a plain value")
            continue
        try:
            TrainConfig().with_overrides({path: _norm_choice(c)})
        except ConfigError as e:
            p.extend(f"{where}: choice {c!r}: {x}" for x in e.problems)
    return p


def _range_problems(where: str, path: str, k: Knob, tp) -> list[str]:
    kind, _ = _base_kind(tp)
    if kind is None:
        return [f"{where}: a range needs a numeric setting; use choices"]
    if k.low is None or k.high is None:
        return [f"{where}: a range needs both low and high"]
    p = []
    for name, v in (("low", k.low), ("high", k.high)):
        if v == AUTO:
            if path != "loader.num_workers":
                p.append(f"{where}.{name}: auto is only defined for loader.num_workers")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            p.append(f"{where}.{name}={v!r}: expected {'an integer' if kind is int else 'a number'}")
        else:  # an end the config itself refuses (loader.num_workers: -1) would fail every trial that draws it
            try:
                TrainConfig().with_overrides({path: v})
            except ConfigError as e:
                p.extend(f"{where}.{name}: {x}" for x in e.problems if x.startswith(f"{path}="))
    nums = [v for v in (k.low, k.high) if v != AUTO]
    if len(nums) == 2 and all(isinstance(v, (int, float)) for v in nums) and k.low > k.high:
        p.append(f"{where}: low={k.low} > high={k.high}")
    if k.log and any(isinstance(v, (int, float)) and v <= 0 for v in nums):
        p.append(f"{where}: log scale needs low > 0")
    if k.log and k.step is not None:
        p.append(f"{where}: log and step cannot be combined")
    return p


def resolve(spec: StudySpec, *, world_size: int, nproc_per_node: int, cpu_only: bool,
            cores: int | None = None, max_batch: int | None = None, synthetic: bool = False,
            applies: set[str] | None = None) -> SearchSpace:
    """The spec's space for this machine and data: ``auto`` bounds filled in, GPU-only choices dropped on a CPU
    machine, batch sizes the data cannot fill dropped (``max_batch``: training images per rank), fixed-global-batch
    filtering, knobs ordered so conditions read already-suggested values. On ``synthetic`` data there is no input
    pipeline: the default space's pipeline knobs are not searched (a spec that names one keeps it). ``applies``: a
    user's script's settings (``trainer.knobs`` runtime names): only those knobs are searched."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_rank = max(1, cores // max(1, nproc_per_node))
    problems: list[str] = []
    notes: list[str] = []
    params: list[Param] = []
    for path, k in effective_knobs(spec).items():
        if applies is not None and path in KNOBS and KNOBS[path].runtime not in applies:
            continue  # a knob the script does not apply: trials would measure the same thing under other names
        if synthetic and path.split(".", 1)[0] in ("data", "loader") and path not in spec.space:
            notes.append(f"{path}: not searched (synthetic data: no input pipeline)")
            continue
        if cpu_only and path.startswith("nccl."):
            notes.append(f"{path}: not searched (no GPU: gloo does not read NCCL settings)")
            continue
        if cpu_only and path not in spec.space and path in KNOBS and KNOBS[path].default_space == "gpu":
            continue  # the default space's GPU-only knobs (compile: minutes of C++ compile on CPU ranks)
        when = Condition.parse(k.when) if k.when else None
        if k.choices is not None:
            choices = _machine_choices(path, [_norm_choice(c) for c in k.choices], cpu_only, notes)
            if path == "training.batch_size":
                choices = _batch_choices(spec, choices, world_size, max_batch, notes, problems)
            if choices:
                if len(choices) == 1:
                    notes.append(f"{path}: one choice left ({_show(choices[0])}), not searched")
                params.append(Param(path=path, kind="categorical", choices=tuple(choices), when=when))
            continue
        kind, _ = _base_kind(field_type(path))
        low = 0 if k.low == AUTO else k.low
        high = per_rank if k.high == AUTO else k.high
        if low > high:
            problems.append(f"space.{path}: low={low} > high={high} on this machine ({cores} cores, "
                            f"{nproc_per_node} ranks)")
        elif kind is int:
            params.append(Param(path=path, kind="int", low=int(low), high=int(high), log=k.log,
                                step=int(k.step) if k.step else None, when=when))
        else:
            params.append(Param(path=path, kind="float", low=float(low), high=float(high), log=k.log,
                                step=k.step, when=when))
    if problems:
        raise SpecError(problems, spec.source)
    return SearchSpace(params=_order(params, spec.source), fixed_global_batch=spec.fixed_global_batch,
                       world_size=world_size, notes=notes)


def _machine_choices(path: str, choices: list[Any], cpu_only: bool, notes: list[str]) -> list[Any]:
    """The choices this machine can run: without a GPU, no GPU decode and no fp16 (CPU autocast is bf16)."""
    if not cpu_only:
        return choices
    if path == "data.decode":
        for gpu_decode in ("nvjpeg-gpu", "nvjpeg-hw"):
            if gpu_decode in choices:
                choices.remove(gpu_decode)
                notes.append(f"data.decode: {gpu_decode} dropped (no GPU)")
        if "hybrid" in choices:
            choices.remove("hybrid")
            notes.append("data.decode: hybrid dropped (no GPU: both of its shares would decode on the CPU)")
    if path == "training.precision" and "fp16" in choices and len(choices) > 1:
        choices.remove("fp16")
        notes.append("training.precision: fp16 dropped (no GPU: CPU autocast is bf16)")
    return choices


def _batch_choices(spec: StudySpec, choices: list[Any], world_size: int, max_batch: int | None, notes: list[str],
                   problems: list[str]) -> list[Any]:
    """Batch sizes the data can fill (one batch per rank at least), and that divide a fixed global batch."""
    if max_batch is not None:
        kept = [b for b in choices if not isinstance(b, int) or b <= max_batch]
        if len(kept) < len(choices):
            dropped = ", ".join(str(b) for b in choices if b not in kept)
            notes.append(f"training.batch_size: {dropped} dropped (the data holds {max_batch} training images per "
                         "rank: not one batch)")
        if not kept:
            problems.append(f"training.batch_size: every choice is larger than the {max_batch} training images per "
                            "rank; add images or smaller batch choices")
        choices = kept
    if spec.fixed_global_batch:
        g = spec.fixed_global_batch
        kept = [b for b in choices if isinstance(b, int) and g % (b * world_size) == 0]
        if len(kept) < len(choices):
            notes.append(f"training.batch_size: fixed global batch {g} over {world_size} ranks keeps "
                         f"{kept or 'nothing'}")
        if not kept:
            problems.append(f"fixed_global_batch={g}: no batch choice divides it over {world_size} ranks; use a "
                            f"multiple of {world_size} x a batch choice")
        choices = kept
    return choices


def _order(params: list[Param], source: str) -> list[Param]:
    """Stable topological order: a conditional knob after the knob its condition reads."""
    by_path = {p.path: p for p in params}
    out: list[Param] = []
    state: dict[str, int] = {}

    def visit(p: Param, chain: list[str]):
        if state.get(p.path) == 2:
            return
        if state.get(p.path) == 1:
            raise SpecError([f"space: conditions form a cycle: {' -> '.join([*chain, p.path])}"], source)
        state[p.path] = 1
        if p.when is not None and p.when.path in by_path:
            visit(by_path[p.when.path], [*chain, p.path])
        state[p.path] = 2
        out.append(p)

    for p in params:
        visit(p, [])
    return out


# ---- known OOM --------------------------------------------------------------------------------------------------


def memory_signature(config: dict[str, Any]) -> str:
    return json.dumps({k: get_path(config, k) for k in MEMORY_KEYS}, sort_keys=True, default=str)


def predicted_oom(config: dict[str, Any], oom_trials: list[tuple[int, dict[str, Any]]]) -> int | None:
    """The number of an earlier trial that ran out of memory at a batch <= this one's with the same memory-relevant
    settings, or None."""
    sig, bs = memory_signature(config), get_path(config, "training.batch_size")
    for number, other in oom_trials:
        if memory_signature(other) == sig and get_path(other, "training.batch_size") <= bs:
            return number
    return None
