"""How a measurement of a part is asked for, whichever stage asks: the settings of the model alone at a point of the
grid, and of a pipeline alone; the next pipeline not measured yet; when a supply may stop early. Not a stage: the
stages that measure parts share it."""

from __future__ import annotations

from typing import Any

from autotune.search.bounds import Scope, Snapshot, Status
from autotune.search.stages._ask import REACH, WAIT, Ask, Request, Wait
from autotune.space import get_path
from autotune.study.measured import Point, grid
from autotune.study.view import Stage, own_loader
from trainer.knobs import UNSET, table

CEILING_DATA = {"data.kind": "synthetic"}
"""What makes a measurement the model alone: one batch made on the device and replayed (the knobs it fixes besides:
``trainer.knobs.Table.ceiling_fixed``)."""


def ceiling_overrides(m: Scope, point: Point, batch: int, cudnn: bool | None) -> dict[str, Any]:
    """The settings of a measurement of the model alone at ``point`` and ``batch`` (cuDNN's search as given)."""
    # The model's head as the trials have it: the data's classes (synthetic data would make 1000), or the base's
    # where the study's data is synthetic already (a different head is another model, and another compile).
    classes = {"data.num_classes": m.plan.data.classes} if m.plan.data else {}
    o = {**CEILING_DATA, **table().ceiling_fixed, **dict(zip((d.path for d in grid()), point.values, strict=True)),
         "training.batch_size": batch, **classes,
         "measure.window_s": min(m.plan.spec.stages.ceiling_window_s, m.measure.window_s)}
    if cudnn is not None:
        o["training.cudnn_benchmark"] = cudnn
    return o


def pipeline_settings(m: Scope, decode: str | None, *, end_to_end: bool = False) -> dict[str, Any]:
    """A pipeline's own settings where the space searches them under ``decode`` (DALI's): its CPU threads at their
    most alone, as the loader's workers are (what it can feed, before the sampler weighs the cores against the rest),
    end to end their share beside the model (``Policy.first_share``), and each knob's measured likeliest fastest value
    (``Policy.first``, ``autotune.policy``) where it has one."""
    own = [p for p in m.space.values() if p.when is not None and p.when.path == "data.decode" and p.when.holds(decode)]
    return {**{p.path: cores(m, p.path, end_to_end=end_to_end) for p in own if p.knob.auto == "cores"},
            **{p.path: p.policy.first for p in own if p.policy.first is not UNSET and p.contains(p.policy.first)}}


def cores(m: Scope, path: str, *, end_to_end: bool) -> int:
    """A knob counted in cores (loader workers, DALI's threads) where the stages first run it: its most alone (what
    the pipeline can feed with no model beside it), end to end its share of that (``Policy.first_share``): the rank's
    own processes need cores too, and the climb settles the count."""
    most = max(m.choices(path))
    share = m.space[path].policy.first_share if end_to_end and path in m.space else None
    return most if share is None else max(min(m.choices(path)), round(most * share))


def persist_own_workers(m: Scope) -> bool:
    """Whether the stages keep loader workers alive between epochs: for a script's own loader, which spawns them anew
    every epoch otherwise (a restart every epoch costs a short epoch much of its pace, docs/benchmarks.md), where the
    space holds the choice. The built-in job's and
    ``run.image_loader``'s pipelines read one endless stream while measured: no restart to save."""
    return (own_loader(m.base) and "loader.persistent_workers" in m.space and "loader.num_workers" in m.space
            and max(m.choices("loader.num_workers")) > 0)


def supply_overrides(snap: Snapshot, decode: str, fraction: float | None) -> dict[str, Any]:
    """The settings of a measurement of the pipeline (``decode``, hybrid share ``fraction``) alone: at the ceiling's
    batch and layout, with the most loader workers."""
    m = snap.scope
    chosen = snap.ceiling_choice() or {}
    o = {"training.mode": "loader", **({} if own_loader(m.base) else {"data.decode": decode}),
         "training.batch_size": chosen.get("training.batch_size", get_path(m.base, "training.batch_size")),
         "training.channels_last": chosen.get("training.channels_last",
                                              get_path(m.base, "training.channels_last")),
         "loader.num_workers": max(m.choices("loader.num_workers")),
         "loader.persistent_workers": persist_own_workers(m), "loader.prefetch_factor": None}
    if fraction is not None:
        o["data.hybrid_cpu_fraction"] = fraction
    return {**o, **pipeline_settings(m, decode)}


def stop_when(snap: Snapshot) -> dict[str, Any]:
    """When a supply measurement may stop before its interval is tight (``autotune.search.evaluate.Watch``):
    its interval above the ceiling's (it feeds more than the model takes: the ceiling bounds it), or below what
    could still come within ``REACH`` of the best bound."""
    ceiling = snap.best.interval if snap.best else None
    bounds = [p.with_model(ceiling.value) if ceiling else p.point for p in snap.pipes]
    out: dict[str, Any] = {}
    if ceiling is not None:
        out["above"] = round(ceiling.high, 3)
    if bounds:
        out["below"] = round(REACH * max(bounds), 3)
    return out


def supply_requests(m: Scope) -> list[tuple[str, float | None]]:
    """The pipelines to measure alone, in measuring order: (decode, hybrid share)."""
    out: list[tuple[str, float | None]] = []
    for d in m.decodes():
        out += [(d, f) for f in m.choices("data.hybrid_cpu_fraction")] if d == "hybrid" else [(d, None)]
    return out


def next_supply(ask: Ask, snap: Snapshot, *, part_budget: bool = True,
                only_first: bool = False) -> Request | Wait | None:
    """The next pipeline in measuring order not measured yet (only the first: ``only_first``)."""
    m = ask.scope
    if not m.supplies:
        return None
    for decode, fraction in supply_requests(m)[:1] if only_first else supply_requests(m):
        status = snap.status(Stage.SUPPLY, (decode, fraction))
        if status == Status.PENDING:
            return WAIT
        if status in (Status.DONE, Status.GIVEN_UP):
            continue
        return ask.part(snap, Stage.SUPPLY, supply_overrides(snap, decode, fraction), part_budget=part_budget,
                        attrs={"stop_when": stop_when(snap)})
    return None
