"""The climb: after the candidates, each end-to-end trial is a neighbour of the climb's point — one searched knob
moved one step along its order — taking first the knobs that what limits the job points to.

The point starts at the fastest end-to-end configuration the stages found. A move whose interval lies above the
point's becomes the point; a move that ties it and is cheaper (fewer loader workers, a smaller batch, ...) becomes the
point too, where it also ties the fastest configuration; any other finished move — slower, pruned, failed — closes
its direction, and a direction the climb came from is closed as well. The climb ends when every direction is closed
or at the end of its range; the sampler draws only then (``_refine``).

What limits the job orders the knobs (``limit``): where the input pipeline bounds it (its supply, or its decode's
share of the GPUs beside the model, below the ceiling), or the point runs well below the ceiling with nothing
measured to explain it, the pipeline's knobs come first, loader workers first of all (they compete with the rank's
own processes for cores); where the model's compute bounds it, the model's (batch, accumulation, layout, DDP); where
a profile split the best's step (``_profile``), the knobs that address its largest cost before all others. The
pipeline family, the precision and torch.compile are the stages' to decide (candidates, ties, the one-off cost) and
are held; a compiled point also holds what its graph is keyed by, since each change of it is a new compile.

Every move is derived from the trials' attrs (``climb_from``, ``climb_knob``, ``climb_dir``), so a resumed search or
another search worker goes on from the same point.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import WAIT, Ask, Request, Wait
from autotune.search.stages._ranking import complete
from autotune.space import Param
from autotune.study.measured import STEP_PARTS, Point, StepPart, cores_full, largest_cost, profiled, waits
from autotune.study.view import Outcome, Stage, TrialView
from trainer.knobs import table

STEP_SHARE = 0.25
"""An integer range's step: this share of the value (at least the range's own step), so that a move of the loader
workers from 16 cores is 4 and from 4 is 1: steps scale with the value, as the cost of one more worker does."""

GAP = 0.9
"""A point below this share of the ceiling's interval, with no measured part explaining it, is treated as limited by
its input side: the usual cause there is the loader's workers contending with the rank's own processes for cores."""

LAUNCH_BUSY = 60.0
"""The model alone keeping the GPUs busy less of the time than this (NVML, %) is bound by the host's kernel launches
(as ``_limiting.LAUNCH_BOUND``): a larger batch amortizes them, so the model's knobs come first."""


def _cheaper_down() -> frozenset[str]:
    """Knobs whose smaller values cost less: the per-rank micro-batch (device memory) and the pipeline's counts —
    loader workers and threads (cores), batches in flight (host memory). A tie with the point moves to the smaller."""
    counted = [k for k in table().entries if k.scope == "pipeline" and k.space is not None and k.space.choices is None]
    return frozenset(k.path for k in table().entries if k.batch == "micro" or k in counted)


class Limit(str, Enum):
    """What bounds the climb's point, as far as the measured parts say."""

    INPUT = "input"
    COMPUTE = "compute"
    LAUNCH = "launch"

    def __str__(self) -> str:
        return self.value


FIRST = {Limit.INPUT: ("pipeline", "model", "process"), Limit.COMPUTE: ("model", "pipeline", "process"),
         Limit.LAUNCH: ("model", "pipeline", "process")}
"""The knobs' scopes in the order each limit takes them (``trainer.knobs.Scope``)."""

WORDS = {Limit.INPUT: "the input pipeline limits it: the loader's and the pipeline's knobs first, workers first",
         Limit.COMPUTE: "the model's compute limits it: batch, accumulation, layout and DDP first",
         Limit.LAUNCH: "the host's kernel launches limit the model: batch and accumulation first"}


@dataclass(frozen=True)
class Move:
    knob: str
    direction: str
    """``down`` (towards the start of the knob's order: fewer, smaller) or ``up``."""

    value: Any


@dataclass
class Climb:
    """The climb's point and its next move, read from the trials."""

    ask: Ask

    def next(self, snap: Snapshot) -> Request | Wait | None:
        point, closed, pending = self.point(snap.views)
        if pending:
            return WAIT  # another search worker runs a move: its result decides the next
        if point is None:
            return None
        limit = self.limit(snap, point)
        part = largest_cost(profiled(snap.views))
        first = STEP_PARTS[part[0]] if part else None
        why = (f"its profiled step's largest cost is {first.name}; what addresses it first: {first.fix}" if first
               else WORDS[limit])
        tried = {_key(v.params) for v in snap.views if v.end_to_end and not v.part}
        for move in self.moves(point, limit, first):
            if (move.knob, move.direction) in closed:
                continue
            params = complete(self.ask.scope, {**point.params, move.knob: move.value})
            if params.get(move.knob) != move.value or _key(params) in tried:
                continue
            self.ask.notes.note(f"climb-{point.label}", f"stages: climbing from trial {point.label} ({why}): one "
                                                        "knob one step at a time")
            return self.ask.trial(params, {"stage": Stage.CLIMB, "climb_from": point.number,
                                           "climb_knob": move.knob, "climb_dir": move.direction})
        self.ask.notes.note("climb-done", f"stages: the climb ends at trial {point.label}: no knob moves it further "
                                          "one step either way; the sampler draws from here")
        return None

    def point(self, vs: list[TrialView]) -> tuple[TrialView | None, set[tuple[str, str]], bool]:
        """The climb's point (trial 0 until another configuration is measured), its closed directions
        (knob, direction), and whether a move from it still runs: replayed from the trials in the order they ran. A
        trial of another stage (a candidate, a draw of the sampler) that measures faster than the point starts the
        climb afresh from it."""
        point: TrialView | None = None
        best: TrialView | None = None
        closed: set[tuple[str, str]] = set()
        for v in sorted((v for v in vs if v.end_to_end and not v.part), key=lambda v: v.number):
            if v.baseline:  # where no other configuration ran (no stages), the climb starts from trial 0
                if point is None and v.feasible:
                    point, best = v, v
                continue
            if v.stage != Stage.CLIMB:
                if v.feasible and (point is None or point.baseline or point.interval.below(v.interval)):
                    point, best, closed = v, v, set()
                continue
            if point is None or v.attrs.get("climb_from") != point.number:
                continue
            if v.outcome in (Outcome.RUNNING, Outcome.WAITING):
                return point, closed, True
            knob, direction = v.attrs.get("climb_knob"), v.attrs.get("climb_dir")
            if self.accepted(v, point, best, knob):
                closed.add((knob, "up" if direction == "down" else "down"))  # where it came from
                point = v
                best = max(best, v, key=lambda t: t.interval.value)
            else:
                closed.add((knob, direction))
        return point, closed, False

    @staticmethod
    def accepted(v: TrialView, point: TrialView, best: TrialView, knob: str) -> bool:
        """A move is taken when measurably faster than the point, or tied with it (and with the fastest so far) and
        cheaper: a smaller value of the knob it moved."""
        if not v.feasible or not (v.interval.known and point.interval.known):
            return False  # a figure without an interval is neither faster nor a tie
        if point.interval.below(v.interval):
            return True
        old, new = point.params.get(knob), v.params.get(knob)
        cheaper = knob in _cheaper_down() and _number(new) and _number(old) and new < old
        return bool(cheaper) and v.interval.ties(point.interval) and v.interval.ties(best.interval)

    def limit(self, snap: Snapshot, point: TrialView) -> Limit:
        """What bounds ``point`` by the measured parts: its pipeline (the supply, or its decode beside the model,
        below the ceiling's interval), the host's launches (the model alone leaves the GPUs idle), the model's
        compute; a point well below its ceiling that the parts do not explain is taken as input-bound: its step
        waits for data (more workers), or its loader's workers take the cores its own processes need (fewer). Where a
        profile split the step (``_profile``), its largest cost says it instead: it measured what the parts only
        bound."""
        part = largest_cost(profiled(snap.views))
        if part is not None:
            return Limit(STEP_PARTS[part[0]].limit)
        m = self.ask.scope
        at = Point.of(point)
        ceiling = snap.interval(at) if m.ceilings else None
        pipe = snap.pipe_of(point.config) if m.supplies else None
        if ceiling is None:
            return Limit.INPUT if pipe is not None or waits(point) else Limit.COMPUTE
        if pipe is not None and pipe.with_model(ceiling.value) < ceiling.low:
            return Limit.INPUT
        busy = [v.util for v in snap.ceilings_of(at) if v.util is not None]
        if m.on_gpu and busy and max(busy) < LAUNCH_BUSY:
            return Limit.LAUNCH
        if point.interval.high < GAP * ceiling.low:
            return Limit.INPUT
        return Limit.COMPUTE

    def moves(self, point: TrialView, limit: Limit, first: StepPart | None = None) -> list[Move]:
        """Every move one step from ``point``: the knobs of ``first`` (the largest cost of a profiled step) before any
        other, in its order, then in the order ``limit`` takes the knobs (within a scope, the knob
        table's order), the cheaper direction first; where the point's step waits for data (its measured split) and
        its cores had room (``cores_full``), the pipeline's counts (workers, batches in flight) up first."""
        held = {*table().defining_settings} - {"training.channels_last"}
        if point.params.get("training.compile"):
            held |= set(table().graph_settings)
        params = [p for p in self.ask.scope.plan.space.params
                  if p.path in point.params and p.path not in held and p.policy.one_off_s is None
                  and p.path != "training.cudnn_benchmark"]
        order, entries = FIRST[limit], [k.path for k in table().entries]
        params.sort(key=lambda p: (first.rank(p.path) if first else 0, order.index(p.knob.scope),
                                   entries.index(p.path) if p.path in entries else len(entries)))
        out = []
        # A point whose cores were full gets nothing from more workers: the cheaper direction first, as elsewhere.
        more = waits(point) and limit == Limit.INPUT and not cores_full(point)
        for p in params:
            first_up = more and p.knob.scope == "pipeline" and p.path in _cheaper_down()
            for direction in ("up", "down") if first_up else ("down", "up"):
                value = step(p, point.params[p.path], direction)
                if value is not None:
                    out.append(Move(p.path, direction, value))
        return out


def step(p: Param, value: Any, direction: str) -> Any:
    """``value`` one step along ``p``'s order (its choices as listed, or its range): None at the end of it."""
    sign = -1 if direction == "down" else 1
    if p.kind == "categorical":
        match = p.match(value)
        index = next((i for i, c in enumerate(p.choices) if c is match), None)
        if index is None:
            return None
        j = index + sign
        return p.choices[j] if 0 <= j < len(p.choices) else None
    if not _number(value):
        return None
    if p.kind == "int":
        unit = int(p.step or 1)
        size = max(unit, unit * round(abs(value) * STEP_SHARE / unit))
        moved = min(max(int(value) + sign * size, p.low), p.high)
    elif p.log:
        moved = min(max(value * 2.0 ** sign, p.low), p.high)
    else:
        moved = min(max(value + sign * (p.high - p.low) * STEP_SHARE, p.low), p.high)
    return None if moved == value else moved


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _key(params: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))
