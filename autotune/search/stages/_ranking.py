"""Which end-to-end trials the measurements of parts call for, and how each went: the pipelines within ``REACH`` of
the best bound, what a candidate of one fixes, and whether its trials ran. Not a stage: the candidates and the
uncertain pipelines share it."""

from __future__ import annotations

import enum
import math
from typing import Any

from autotune.search.bounds import Scope, Snapshot
from autotune.search.stages._ask import REACH
from autotune.search.stages._measure import cores, persist_own_workers, pipeline_settings
from autotune.space import Param, get_path
from autotune.study.measured import Pipe, Point, grid
from autotune.study.view import Outcome
from autotune.verdict import NOT_ITS_FAULT
from trainer.knobs import table


class Tried(enum.Enum):
    """How the end-to-end trials at a candidate's defining settings went (``tried``)."""

    UNTRIED = "untried"
    PENDING = "pending"
    ALIVE = "alive"
    """One trained: measured or pruned."""

    DEAD = "dead"
    """Every one failed."""


def ranking(snap: Snapshot) -> tuple[list[Pipe], list[Pipe], float] | None:
    """(the best pipeline of each family within REACH of the best bound (``Pipe.with_model``: beside the model,
    a decode on the GPUs charged its device time), best first; the families only an imprecise supply keeps out of
    it, the top of its interval within reach; the ceiling they are capped at) — None before both are known."""
    m = snap.scope
    best = snap.best if m.ceilings else None
    if m.ceilings and best is None:
        return None
    ceiling = best.value if best else math.inf
    pipes = snap.pipes if m.supplies else [Pipe(settings={}, point=math.inf, upper=math.inf, precise=True)]
    if not pipes:
        return None
    top = max(p.with_model(ceiling) for p in pipes)
    by_family: dict[str, Pipe] = {}
    for p in sorted(pipes, key=lambda p: (-p.with_model(ceiling), -p.point)):  # ties: the most headroom
        by_family.setdefault(p.family, p)
    sure = [p for p in by_family.values() if p.with_model(ceiling) >= REACH * top]
    unsure = [p for p in by_family.values() if p not in sure and not p.precise
              and p.with_model(ceiling, reach=True) >= REACH * top]
    return sure, unsure, ceiling


def defining_values(m: Scope, fixed: dict[str, Any]) -> tuple:
    """The values of the defining settings (``trainer.knobs.Table.defining_settings``: what the refine stage
    holds) of the trial ``fixed`` would enqueue: its settings, else what it inherits."""
    params = complete(m, fixed)
    return tuple(params[k] if k in params else get_path(m.base, k) for k in table().defining_settings)


def tried(snap: Snapshot, values: tuple) -> Tried:
    """How the end-to-end trials at these ``defining_values`` went."""
    mine = [v for v in snap.views if v.end_to_end and not v.baseline and not v.part
            and tuple(v.setting(k) for k in table().defining_settings) == values
            and v.failure_class not in NOT_ITS_FAULT]
    if not mine:
        return Tried.UNTRIED
    if any(v.outcome in (Outcome.MEASURED, Outcome.PRUNED) for v in mine):
        return Tried.ALIVE
    if any(v.outcome in (Outcome.RUNNING, Outcome.WAITING) for v in mine):
        return Tried.PENDING
    return Tried.DEAD


def settings(snap: Snapshot, pipe: Pipe, point: Point | None = None) -> dict[str, Any]:
    """What a candidate of ``pipe`` fixes: the ceiling's choice at ``point`` (default: the best), the pipeline,
    its threads' share beside the model and the most loader workers, the least accumulation."""
    m = snap.scope
    point = point if point is not None else snap.best.point if snap.best is not None else None
    if point is not None:
        chosen = snap.ceiling_choice(point)
        fixed = {k: v for k, v in chosen.items() if k != "imgs_per_s"}
    else:  # no ceiling: the baseline's precision, layout and batch
        fixed = {d.path: m.plan.baseline.get(d.path, get_path(m.base, d.path)) for d in grid()}
    fixed.update(pipe.settings)
    fixed.update(pipeline_settings(m, fixed.get("data.decode"), end_to_end=True))
    if "loader.num_workers" in m.space:
        fixed["loader.num_workers"] = cores(m, "loader.num_workers", end_to_end=True)
    if persist_own_workers(m):
        fixed["loader.persistent_workers"] = True
    if "training.accum_steps" in m.space:
        fixed["training.accum_steps"] = min(m.choices("training.accum_steps"))
    return fixed


def complete(m: Scope, fixed: dict[str, Any]) -> dict[str, Any]:
    """Optuna params for every active knob: ``fixed`` where given, else the baseline's value (the library
    defaults a tutorial uses), else the base's nearest value."""
    plan, base = m.plan, m.base
    params: dict[str, Any] = {}
    for p in plan.space.params:
        if not plan.space.active(p, params, base):
            continue
        params[p.path] = _value(p, fixed, plan.baseline, base)
    return params


def _value(p: Param, fixed: dict[str, Any], baseline: dict[str, Any], base: dict[str, Any]) -> Any:
    for source in (fixed, baseline):
        if p.path in source and p.contains(source[p.path]):
            value = source[p.path]
            return p.match(value) if p.kind == "categorical" else value
    return p.nearest(get_path(base, p.path))
