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
    a decode on the GPUs charged its device time, a decode on the CPU the cores the rank's own processes take from
    the loader's workers, ``worker_share``), best first; the families only an imprecise supply keeps out of
    it, the top of its interval within reach; the ceiling they are capped at) — None before both are known."""
    m = snap.scope
    best = snap.best if m.ceilings else None
    if m.ceilings and best is None:
        return None
    ceiling = best.value if best else math.inf
    share = worker_share(m)
    pipes = [p.with_cores(share) for p in snap.pipes] if m.supplies else \
        [Pipe(settings={}, point=math.inf, upper=math.inf, precise=True)]
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
    its threads' share beside the model, the loader workers its CPU part needs (``workers_for``), the least
    accumulation."""
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
        fixed["loader.num_workers"] = workers_for(snap, pipe)
    if persist_own_workers(m):
        fixed["loader.persistent_workers"] = True
    if "training.accum_steps" in m.space:
        fixed["training.accum_steps"] = min(m.choices("training.accum_steps"))
    return fixed


OWN_CORES = 2
"""Cores a rank's own processes take on a GPU machine beside its loader workers: the training loop, which launches
the GPUs' work, and the thread that pins each batch. The loader's workers end to end have the rest."""

MARGIN = 1.1
"""Workers a candidate runs beyond what its pipeline's CPU part needs to feed its bound: a pool at full load feeds
unevenly."""


def worker_share(m: Scope) -> float:
    """The share of the cores a pipeline's CPU decode had alone (every core per rank as loader workers) that it has
    end to end on GPUs (``OWN_CORES`` fewer). On CPU ranks the model itself computes on the cores, and the stages
    bound the job by the two parts as measured."""
    if not m.on_gpu or "loader.num_workers" not in m.space:
        return 1.0
    most = max(m.choices("loader.num_workers"))
    return max(1, most - OWN_CORES) / most if most else 1.0


def workers_for(snap: Snapshot, pipe: Pipe) -> int:
    """A candidate's loader workers: on GPUs, as many as its pipeline's CPU part needs to feed the bound it is ranked
    at (``Pipe.cpu_s``: the workers' seconds per sample alone), with a ``MARGIN``, and at least the share of the
    cores the knob's policy starts from (workers that only read files need few; the climb settles the count), at
    most all but ``OWN_CORES``; on CPU ranks the policy's share."""
    m = snap.scope
    start = cores(m, "loader.num_workers", end_to_end=True)
    if not m.on_gpu:
        return start
    most = max(m.choices("loader.num_workers"))
    top = max(min(m.choices("loader.num_workers")), most - OWN_CORES)
    ceiling = snap.best.value if snap.best is not None else math.inf
    target = pipe.with_cores(worker_share(m)).with_model(ceiling)
    needed = math.ceil(most * pipe.cpu_s * target * MARGIN) if math.isfinite(target) else most
    return min(top, max(min(start, top), needed))


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
