"""What the measurements of parts say for one decision of the search: ``Snapshot``, read once from both studies (the
main one and its parts study) before the stage planner (``autotune.search.stages``) decides what to run next, or
before the evaluator decides whether a draw is worth launching; and ``Scope``, what the search's plan lets it measure
(its grid, its pipelines, what makes two requests the same measurement). Reading only: it enqueues nothing.

The readings a reader of a finished study needs too (``Point``, ``Pipe``, the bound of a pipeline beside the model,
cuDNN's recorded decisions) are ``autotune.study.measured``'s; a snapshot adds what the search decides from them:
each measurement's status (``Status``), the live and tied points, the best one with its interval, the budget left.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import product
from typing import Any

from autotune.formatting import fmt_ips, per_second
from autotune.policy import Searched
from autotune.search.compile_cache import paid_here
from autotune.space import get_path
from autotune.study.measured import (
    UNEXPLAINED,
    Pipe,
    Point,
    derived,
    grid,
    measured_pipes,
    point_dead,
    supply_knob,
    untrainable,
)
from autotune.study.view import OWN_LOADER, Outcome, Stage, TrialView, feasible, own_loader
from autotune.verdict import NOT_ITS_FAULT
from trainer.compile_costs import Paid
from trainer.config import ConfigError
from trainer.estimate import Interval

PLATEAU = 0.98
"""A smaller batch keeps the ceiling's pace when it reaches this share of the best: it is then preferred (less
memory, and fewer images per step for the input pipeline to deliver in one go)."""

ENV_RETRIES = 1
"""A measurement that failed for the environment (hang, crash, NCCL, loader) is run again this many times; one that
was interrupted or whose search vanished (``autotune.verdict.NOT_ITS_FAULT``) is always run again: it says nothing
about the measurement."""


class Status(enum.Enum):
    """Where a requested measurement stands (``Snapshot.status``), or a point of the grid (``Snapshot.point_state``)."""

    UNASKED = "unasked"
    """Never asked for."""

    PENDING = "pending"
    """Waiting or running."""

    DONE = "done"
    """Measured, or failed for its configuration (a point: measured at some batch)."""

    RETRY = "retry"
    """Failed for the environment, or was interrupted: to run again."""

    GIVEN_UP = "given_up"
    """Failed for the environment more than ``ENV_RETRIES`` times."""

    IMPOSSIBLE = "impossible"
    """A point that failed at the smallest batch it was tried at: its repairs ran out."""


class Scope:
    """What a search's plan lets the stages measure (its space, its base config, GPUs or CPU ranks, its measurement
    protocol): the grid's points, the pipelines, and what makes two requests the same measurement."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.space = plan.space.by_path()
        self.base = plan.probe.to_dict()
        self.on_gpu = bool(plan.entries)
        self.measure = plan.probe.measure

    @property
    def ceilings(self) -> bool:
        return self.plan.measures_ceiling

    @property
    def supplies(self) -> bool:
        """Whether pipelines are measured: the job hands its loader over, and there is real data to read."""
        return self.plan.measures_supply and self.plan.probe.data.kind != "synthetic"

    def choices(self, path: str) -> list[Any]:
        """The values a knob may take here: its choices or range ends, else the base value alone."""
        p = self.space.get(path)
        if p is None:
            return [get_path(self.base, path)]
        return list(p.choices) if p.kind == "categorical" else sorted({p.low, p.high})

    def points(self) -> list[Point]:
        """The ceiling's grid, the likeliest fastest first; every point without a one-off cost (``one_off_s``: eager)
        before any with one."""
        orders = [d.order(self.choices(d.path), self.on_gpu) for d in grid()]
        costly = [i for i, d in enumerate(grid()) if d.one_off_s is not None]
        return [Point(p) for p in sorted(product(*orders), key=lambda p: [orders[i].index(p[i]) for i in costly])]

    def plain(self, point: Point) -> Point:
        """``point`` at the first value of each dimension with a one-off cost: eager for compiled."""
        return Point(tuple(d.order(self.choices(d.path), self.on_gpu)[0] if d.one_off_s is not None else x
                           for d, x in zip(grid(), point.values, strict=True)))

    def has_one_off(self, point: Point) -> bool:
        """Whether ``point`` is at a value with a one-off cost (compiled)."""
        return self.plain(point) != point

    def paid_here(self, dim: Searched, overrides: dict[str, Any]) -> list[Paid]:
        """What this machine paid before for the one-off cost of a measurement with ``overrides`` at a value of
        ``dim`` (a compile of its graph: ``autotune.search.compile_cache``); nothing for a dimension without one."""
        if dim.one_off_cached_share is None or self.plan.base is None:
            return []
        classes = self.plan.data.classes if self.plan.data else None
        try:
            cfg = self.plan.base.with_overrides(overrides)
        except ConfigError:  # the measurement itself will say so
            return []
        return paid_here(cfg, classes, self.plan.world)

    def pipe_name(self, decode: str) -> str:
        """How a pipeline reads in lines: its decode path, or a script's own loader (``view.own_loader``)."""
        return OWN_LOADER if own_loader(self.base) else decode

    def decodes(self) -> list[str]:
        """Pipelines measured alone, in measuring order; hybrid only where its two ends are not both measured (its
        shares decode side by side, so its supply follows from theirs)."""
        supply = supply_knob()
        decodes = supply.order(self.choices(supply.path), self.on_gpu)
        if "hybrid" in decodes and {"torchvision-cpu", "nvjpeg-gpu"} <= set(decodes):
            decodes.remove("hybrid")
        return decodes

    def request_key(self, stage_name: Stage, o: dict[str, Any]) -> tuple:
        """What makes two requests the same measurement: a pipeline (whatever batch it was fed at), or a point of
        the ceiling's grid at a batch, with or without cuDNN's search. A point a request leaves out is the base's
        (a study's earlier requests may predate a dimension)."""
        if stage_name == Stage.SUPPLY:
            return (o.get("data.decode", get_path(self.base, "data.decode")), o.get("data.hybrid_cpu_fraction"))
        if stage_name == Stage.IMAGE_LOADER:  # a pipeline on a folder
            return (o.get("data.decode"), o.get("data.path"))
        return (*(o.get(d.path, get_path(self.base, d.path)) for d in grid()), o.get("training.batch_size"),
                o.get("training.cudnn_benchmark"))

    def top_batch(self) -> int:
        return max(self.choices("training.batch_size"))

    def ceiling_batch(self) -> int:
        """The batch the model alone is first measured at, per point of the grid: on GPUs the largest (a smaller
        batch is not faster there); on CPU ranks, where a small batch stays in the caches and can run faster per
        image, the baseline's, so the ceiling bounds the configuration the search starts from and the candidates
        run at it (the smaller batches follow, ``autotune.search.stages._batches``)."""
        own = self.plan.baseline.get("training.batch_size")
        if self.on_gpu or own is None or own not in self.choices("training.batch_size"):
            return self.top_batch()
        return own


@dataclass(frozen=True)
class Best:
    """The point the stages go on from, with its ceiling's interval."""

    point: Point
    interval: Interval

    @property
    def value(self) -> float:
        return self.interval.value


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The trials of both studies as one decision reads them (read once: ``views``), indexed by point and by
    request, with the budget left and cuDNN's decisions. Figures read in ``per`` (the study's unit per second)."""

    scope: Scope
    views: list[TrialView]
    budget: Any = None
    """What the search may still spend (``autotune.search.stages.Budget``); None where no decision spends."""

    cudnn: dict[Point, dict[str, Any]] = field(default_factory=dict)
    """cuDNN's algorithm search, decided per point (``autotune.study.measured.cudnn_by_point``)."""

    per: str = per_second(None)

    @property
    def started(self) -> bool:
        """Whether the stages have begun: a measurement of a part exists."""
        return any(v.stage in (Stage.CEILING, Stage.SUPPLY) for v in self.views)

    @property
    def waiting(self) -> bool:
        """Whether a trial of either study waits to run: what was enqueued runs before anything more is."""
        return any(v.outcome == Outcome.WAITING for v in self.views)

    @cached_property
    def _requests(self) -> dict[tuple, list[TrialView]]:
        out: dict[tuple, list[TrialView]] = {}
        for v in self.views:
            if v.stage.measures_part:
                out.setdefault((v.stage, self.scope.request_key(v.stage, v.attrs.get("overrides") or {})), []).append(v)
        return out

    def status(self, stage_name: Stage, key: tuple) -> Status:
        """Where the measurement ``key`` (``Scope.request_key``) stands: ``PENDING``, ``DONE``, ``GIVEN_UP``,
        ``RETRY`` or ``UNASKED``."""
        mine = self._requests.get((stage_name, key), [])
        if any(v.outcome in (Outcome.RUNNING, Outcome.WAITING) for v in mine):
            return Status.PENDING
        if any(v.outcome in (Outcome.PART, Outcome.INFEASIBLE, Outcome.MEASURED) for v in mine):
            return Status.DONE
        env = [v for v in mine if v.failure_class not in NOT_ITS_FAULT]
        if len(env) > ENV_RETRIES:
            return Status.GIVEN_UP
        return Status.RETRY if mine else Status.UNASKED

    @cached_property
    def _by_point(self) -> dict[Point, list[TrialView]]:
        out: dict[Point, list[TrialView]] = {}
        for v in self.views:
            if v.stage == Stage.CEILING:
                out.setdefault(Point.of(v), []).append(v)
        return out

    def ceilings_of(self, point: Point) -> list[TrialView]:
        """The complete measurements of the model alone at ``point``."""
        return [v for v in self._by_point.get(point, []) if v.outcome == Outcome.PART and v.imgs_per_s is not None]

    def point_state(self, point: Point) -> tuple[Status, dict[str, Any] | None]:
        """(``DONE`` (measured), ``PENDING``, ``IMPOSSIBLE`` (failed at the smallest batch it was tried: its repairs
        ran out), ``RETRY`` with the request to run again, or ``UNASKED``; the request)."""
        if self.ceilings_of(point):
            return Status.DONE, None
        mine = self._by_point.get(point, [])
        if not mine:
            return Status.UNASKED, None
        if any(v.outcome in (Outcome.RUNNING, Outcome.WAITING) for v in mine):
            return Status.PENDING, None
        last = min(mine, key=lambda v: v.setting("training.batch_size") or 0)
        request = last.attrs.get("overrides") or {}
        status = self.status(Stage.CEILING, self.scope.request_key(Stage.CEILING, request))
        return (Status.RETRY, request) if status == Status.RETRY else (Status.IMPOSSIBLE, None)

    def interval(self, point: Point) -> Interval | None:
        """The fastest measurement of the model alone at ``point``, with its interval."""
        best = max(self.ceilings_of(point), key=lambda v: v.imgs_per_s, default=None)
        return best.interval if best is not None else None

    def without_one_off(self, point: Point) -> Point:
        """``Scope.plain(point)`` where that point is measured; else ``point``."""
        plain = self.scope.plain(point)
        return plain if self.interval(plain) is not None else point

    @cached_property
    def untrainable(self) -> set[tuple[str, Any]]:
        return untrainable(self.views)

    def dead(self, point: Point) -> bool:
        """Whether a value of ``point`` does not train this model, whatever its speed (``untrainable``)."""
        return point_dead(self.untrainable, point)

    @cached_property
    def live(self) -> list[tuple[Point, Interval]]:
        """Measured points whose end-to-end trials have not all diverged, fastest first."""
        out = [(p, self.interval(p)) for p in self.scope.points()]
        return sorted([(p, i) for p, i in out if i is not None and not self.dead(p)], key=lambda x: -x[1].value)

    @cached_property
    def tied(self) -> list[tuple[Point, Interval]]:
        """Live points whose ceiling's interval overlaps the fastest one's: measured, they cannot be told apart."""
        if not self.live:
            return []
        top = self.live[0][1]
        return [(p, i) for p, i in self.live if i.ties(top)]

    @cached_property
    def best(self) -> Best | None:
        """The point the stages go on from: the fastest live ceiling; among points tied with it, the one whose
        end-to-end trials did best (an end-to-end run is the stronger measurement: channels_last tied on CPU ranks
        and ran at half the pace end to end)."""
        if not self.tied:
            return None
        return Best(*max(self.tied, key=lambda pi: (self.best_e2e(pi[0]), pi[1].value)))

    def best_e2e(self, point: Point) -> float:
        return max((v.imgs_per_s for v in feasible(self.views) if not v.baseline and Point.of(v) == point),
                   default=-math.inf)

    def ceiling_choice(self, point: Point | None = None) -> dict[str, Any] | None:
        """The ceiling's settings for ``point`` (default: the best): its precision and layout, at the smallest batch
        that keeps PLATEAU of its pace."""
        if point is None:
            if self.best is None:
                return None
            point = self.best.point
        mine = self.ceilings_of(point)
        if not mine:
            return None
        top = max(v.imgs_per_s for v in mine)
        chosen = min((v for v in mine if v.imgs_per_s >= PLATEAU * top), key=lambda v: v.setting("training.batch_size"))
        return {**point.settings, "training.batch_size": chosen.setting("training.batch_size"), "imgs_per_s": top}

    def cudnn_decision(self, point: Point) -> bool | None:
        """cuDNN's algorithm search at ``point`` where decided. A compiled point takes its eager point's decision:
        compiled convolutions are cuDNN's too, and evidence on shapes new to a worker would be a compile in a fresh
        one."""
        d = self.cudnn.get(point) or self.cudnn.get(self.scope.plain(point))
        return d["benchmark"] if d else None

    @cached_property
    def pipes(self) -> list[Pipe]:
        """Every pipeline with a supply: measured, or hybrid at each of the space's shares derived from its two ends
        (``derived``)."""
        measured = measured_pipes(self.views)
        m = self.scope
        fractions = m.choices("data.hybrid_cpu_fraction") if "hybrid" in m.choices("data.decode") else []
        for f in fractions:
            if ("hybrid", f) not in measured and f is not None:
                made = derived(measured, f)
                if made is not None:
                    measured[("hybrid", f)] = made
        return list(measured.values())

    def pipe_of(self, config: dict[str, Any]) -> Pipe | None:
        """The pipeline ``config`` runs, as the supplies measured it (None: not measured)."""
        decode = get_path(config, "data.decode")
        fraction = get_path(config, "data.hybrid_cpu_fraction") if decode == "hybrid" else None
        return next((p for p in self.pipes if p.family == decode
                     and p.settings.get("data.hybrid_cpu_fraction") == fraction), None)

    def unexplained(self, v: TrialView) -> bool:
        """Whether the end-to-end ``v`` reaches below ``UNEXPLAINED`` of what its measured parts allow together (its
        point's ceiling, beside its pipeline's supply where that was measured): the parts do not explain it. False
        where no ceiling was measured at its point."""
        ceiling = self.interval(Point.of(v)) if self.scope.ceilings else None
        if ceiling is None or v.imgs_per_s is None:
            return False
        pipe = self.pipe_of(v.config) if self.scope.supplies else None
        bound = pipe.with_model(ceiling.value) if pipe is not None else ceiling.value
        return v.imgs_per_s < UNEXPLAINED * bound

    def bound_of(self, config: dict[str, Any]) -> tuple[float, str] | None:
        """The most an end-to-end run of ``config`` can reach by what the stages measured (the top of the bounding
        measurement's interval), and why; None when they measured nothing that bounds it. Its ceiling: the pace of
        its precision and layout at the smallest measured batch not below its images per step (on GPUs a smaller
        batch is not faster; on CPU ranks it can be, so only a measurement at its images per step bounds it); its
        supply: what its pipeline fed, with the most loader workers."""
        m, f, per = self.scope, fmt_ips, self.per
        out: list[tuple[float, str]] = []
        point = Point.of_config(config)
        per_step = int(get_path(config, "training.batch_size")) * int(get_path(config, "training.accum_steps") or 1)
        above = [v for v in self.ceilings_of(point) if v.setting("training.batch_size") >= per_step
                 and (m.on_gpu or v.setting("training.batch_size") == per_step)]
        pipe = self.pipe_of(config) if m.supplies else None
        if above:
            b = min(v.setting("training.batch_size") for v in above)
            top = max((v for v in above if v.setting("training.batch_size") == b), key=lambda v: v.imgs_per_s)
            if not self.refuted(point, b, top.interval):
                out.append((top.interval.high, f"the model alone at {point.label} batch {b} runs "
                                               f"{f(top.imgs_per_s)} {per} (at most {f(top.interval.high)})"))
                if pipe is not None and pipe.device_s:  # the GPUs' time per sample, the model's and the decode's
                    joint = 1.0 / (1.0 / top.interval.high + pipe.device_s)
                    out.append((joint, f"beside the model at {point.label} batch {b} "
                                       f"({f(top.imgs_per_s)} {per} alone), {m.pipe_name(pipe.family)}'s decode "
                                       f"on the GPUs takes {pipe.decode_share(top.imgs_per_s):.0%} of each sample's "
                                       f"time: at most {f(joint)} {per}"))
        if pipe is not None:
            out.append((pipe.upper, f"{m.pipe_name(pipe.family)} feeds {f(pipe.point)} {per} (at most "
                                    f"{f(pipe.upper)})"))
        return min(out, default=None)

    def refuted(self, point: Point, batch: int, ceiling: Interval) -> bool:
        """Whether an end-to-end run at ``point`` and ``batch`` images per step measured above the ceiling there
        (its interval above the ceiling's): the model alone is then no bound at that point (its synthetic replay
        costs what the job does not), and pruning against it would drop what runs faster."""
        return any(ceiling.below(v.interval) for v in feasible(self.views)
                   if not v.part and Point.of(v) == point
                   and v.setting("training.batch_size") * (v.setting("training.accum_steps") or 1) == batch)
