"""The search space as declared: the built-in ranges (``trainer.knobs``), a spec's own, and what is wrong with them.

A range is a ``trainer.knobs.Range`` under a TrainConfig dotted path; conditions (``when``) read another setting.
Both the study spec (its validation) and the space (its resolution for a machine) read this module, which needs
neither of them.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import typing
from dataclasses import dataclass
from typing import Any, Protocol

import yaml

from autotune.policy import policy
from trainer.config import ConfigError, TrainConfig, removed_problem
from trainer.knobs import AUTO, Range, knob, table

DEFAULT_CHOICE = "default"
"""In ``choices``, ``default`` means ``null``: leave the setting to the library (e.g. NCCL picks its algorithm)."""


class Declares(Protocol):
    """What a study spec declares of its space (``autotune.spec.StudySpec``)."""

    space: dict[str, Range | None]
    default_space: bool
    fixed_global_batch: int | None
    baseline: dict[str, Any]
    starts: list[dict[str, Any]]


def default_space() -> dict[str, Range]:
    """The image-model defaults: the knobs of the table whose policy marks them ``default_space`` (``autotune.policy``;
    ``training.compile`` on GPU machines only: the stages weigh its compile, ``autotune.search.stages``). Not in it:
    the compile mode (minutes of compile per graph for CUDA graphs or autotuning), cuDNN's algorithm search (the
    ceiling stage decides it), and NCCL's variables (debugging variables that no measurement here has shown to matter;
    each change takes a new process). A spec adds any of them, e.g. ``nccl.algo: [default, Ring, Tree]``."""
    out = {}
    for k in table().entries:
        if policy(k.path).default_space and k.space is not None:
            r = k.space
            out[k.path] = dataclasses.replace(r, choices=list(r.choices) if r.choices is not None else None)
    return out


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


def base_kind(tp) -> tuple[type | None, bool]:
    """(int|float|other, optional?) of an annotation like ``int | None``."""
    args = typing.get_args(tp)
    optional = type(None) in args
    core = [a for a in args if a is not type(None)] if args and typing.get_origin(tp) is not typing.Literal else [tp]
    for t in (int, float):
        if t in core:
            return t, optional
    return None, optional


def norm_choice(v: Any) -> Any:
    return None if isinstance(v, str) and v == DEFAULT_CHOICE else v


# ---- what a spec declares ----------------------------------------------------------------------------------------


def effective(spec: Declares) -> dict[str, Range]:
    """The ranges a spec searches: the built-in space (unless ``default_space: false``) with its own over it; the
    accumulation knob is derived, not searched, under ``fixed_global_batch``."""
    ranges: dict[str, Range] = default_space() if spec.default_space else {}
    for path, r in spec.space.items():
        if r is None:
            ranges.pop(path, None)
        else:
            ranges[path] = r
    if spec.fixed_global_batch:
        for path in [p for p in ranges if knob(p).batch == "accum"]:
            ranges.pop(path)
    return ranges


def declared(spec: Declares, path: str, value: Any) -> bool:
    """Whether ``value`` is in the knob as the spec declares it (a choice, or inside a range whose ``auto`` end is
    this machine's cores): it was left out here for the machine or the data, not by the spec."""
    r = effective(spec).get(path)
    if r is None:
        return False
    if r.choices is not None:
        return value in [norm_choice(c) for c in r.choices]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or AUTO not in (r.low, r.high):
        return False
    return (r.low == AUTO or value >= r.low) and (r.high == AUTO or value <= r.high)


def space_problems(spec: Declares) -> list[str]:
    """Every problem of the space section, without knowing the machine (``auto`` is checked at resolution)."""
    p: list[str] = []
    ranges = effective(spec)
    if not ranges:
        p.append("space: no knob left to search; add one (or set default_space: true)")
    for path, r in ranges.items():
        p += _range_problems(spec, path, r)
    for key in spec.baseline:
        if key not in ranges:
            p.append(f"baseline.{key}: not a searched knob (searched: {', '.join(ranges) or 'none'}); "
                     "set it in base instead")
    for i, start in enumerate(spec.starts):
        for key in start:
            if key not in ranges:
                p.append(f"starts[{i}].{key}: not a searched knob (searched: {', '.join(ranges) or 'none'}); "
                         "name searched knobs only")
    micro = table().batch("micro")
    if spec.fixed_global_batch and micro in ranges and ranges[micro].choices is None:
        p.append(f"space.{micro}: fixed_global_batch needs batch choices (not a range)")
    return p


def _range_problems(spec: Declares, path: str, r: Range) -> list[str]:
    where = f"space.{path}"
    tp = field_type(path)
    if tp is None:
        gone = removed_problem(path)
        return [f"space.{gone}" if gone else f"{where}: no such TrainConfig setting (use a dotted path like "
                "training.batch_size)"]
    p = []
    if knob(path).batch == "accum" and spec.fixed_global_batch:
        p.append(f"{where}: derived in fixed_global_batch mode; remove it")
    has_range = r.low is not None or r.high is not None
    if r.choices is not None and has_range:
        return [*p, f"{where}: give either choices or low/high, not both"]
    if r.choices is None and not has_range:
        return [*p, f"{where}: give choices: [...] or low: and high:"]
    under: dict[str, Any] = {}  # what the condition holds the config at, where it names one value
    if r.when is not None:
        try:
            c = Condition.parse(r.when)
            if field_type(c.path) is None:
                p.append(f"{where}.when: {c.path}: no such TrainConfig setting")
            elif c.path == path:
                p.append(f"{where}.when: a knob cannot depend on itself")
            elif c.op == "==":
                under = {c.path: c.value}
        except ValueError as e:
            p.append(f"{where}.when: {e}")
    return p + (_choice_problems(where, path, r.choices, under) if r.choices is not None else
                _bound_problems(where, path, r, tp))


def _choice_problems(where: str, path: str, choices: list[Any], under: dict[str, Any]) -> list[str]:
    """Each choice checked as a config would hold it, with ``under`` (the knob's condition, where it names one
    value: CUDA graphs are a compile mode, and checked against an eager default each would be refused)."""
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
            TrainConfig().with_overrides({**under, path: norm_choice(c)})
        except ConfigError as e:
            p.extend(f"{where}: choice {c!r}: {x}" for x in e.problems)
    return p


def _bound_problems(where: str, path: str, r: Range, tp) -> list[str]:
    kind, _ = base_kind(tp)
    if kind is None:
        return [f"{where}: a range needs a numeric setting; use choices"]
    if r.low is None or r.high is None:
        return [f"{where}: a range needs both low and high"]
    p = []
    for name, v in (("low", r.low), ("high", r.high)):
        if v == AUTO:
            if knob(path).auto is None:
                takes = ", ".join(k.path for k in table().entries if k.auto) or "no setting"
                p.append(f"{where}.{name}: auto is only defined for {takes}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            p.append(f"{where}.{name}={v!r}: expected {'an integer' if kind is int else 'a number'}")
        else:  # an end the config itself refuses (loader.num_workers: -1) would fail every trial that draws it
            try:
                TrainConfig().with_overrides({path: v})
            except ConfigError as e:
                p.extend(f"{where}.{name}: {x}" for x in e.problems if x.startswith(f"{path}="))
    nums = [v for v in (r.low, r.high) if v != AUTO]
    if len(nums) == 2 and all(isinstance(v, (int, float)) for v in nums) and r.low > r.high:
        p.append(f"{where}: low={r.low} > high={r.high}")
    if r.log and any(isinstance(v, (int, float)) and v <= 0 for v in nums):
        p.append(f"{where}: log scale needs low > 0")
    if r.log and r.step is not None:
        p.append(f"{where}: log and step cannot be combined")
    return p
