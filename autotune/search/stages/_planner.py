"""The planner: the stages' order (``STAGES``, the one table of it), the plan in a line, and the only place a stage's
request is enqueued. Before each trial it reads both studies once (``autotune.search.bounds.Snapshot``), records
cuDNN's decisions, and asks each stage in the table's order for its next request: the first that asks for something
has it enqueued; one that waits on another worker's measurement stops the round."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autotune.formatting import per_second
from autotune.search.bounds import Scope, Snapshot
from autotune.search.stages._ask import WAIT, Ask, Request, Step
from autotune.search.stages._baseline import BaselineAgain
from autotune.search.stages._batches import Batches
from autotune.search.stages._budget import PARTS_SHARE, Budget, Spend
from autotune.search.stages._candidates import Candidates
from autotune.search.stages._ceiling import FirstCeiling
from autotune.search.stages._climb import Climb
from autotune.search.stages._confirm import Confirm
from autotune.search.stages._cudnn import CudnnEvidence, decide
from autotune.search.stages._folder import ImageFolder
from autotune.search.stages._hold import HoldOneOff
from autotune.search.stages._limiting import Limiting
from autotune.search.stages._notes import Notes
from autotune.search.stages._profile import Profile
from autotune.search.stages._refine import Refine
from autotune.search.stages._supply import FirstSupply
from autotune.search.stages._uncertain import Uncertain
from autotune.study.measured import CUDNN_ATTR, Point, cudnn_by_point, cudnn_record, grid
from autotune.study.view import OWN_LOADER, Stage, own_loader, views

STAGES: tuple[tuple[str, type[Step]], ...] = (
    ("first ceiling", FirstCeiling),
    ("first supply", FirstSupply),
    ("candidates", Candidates),
    ("trial 0 again", BaselineAgain),
    ("confirm", Confirm),
    ("cudnn", CudnnEvidence),
    ("image folder", ImageFolder),
    ("limiting", Limiting),
    ("batches", Batches),
    ("uncertain", Uncertain),
    ("profile", Profile),
    ("climb", Climb),
    ("refine", Refine),
    ("hold one-off", HoldOneOff),
)
"""The stages in the order they are asked (the package's docstring and docs/search.md show this table). Confirming
the leaders comes before any further exploration: it runs only where the budget left pays for no more than their
runs again."""


@dataclass
class StagePlanner:
    """Decides, before each trial is asked for, what the stages want run next, and enqueues it (parts into the parts
    study, end-to-end trials into the main one)."""

    plan: Any
    study: Any
    parts: Any
    scope: Scope = field(init=False)
    """What the plan lets the stages measure."""

    notes: Notes = field(init=False)
    spend: Spend = field(init=False)
    steps: dict[str, Step] = field(init=False)
    """Each stage of ``STAGES``, by its name."""

    def __post_init__(self):
        self.scope = Scope(self.plan)
        self.notes = Notes()
        self.spend = Spend(self.scope, self.notes)
        ask = Ask(self.scope, self.spend, self.notes)
        self.steps = {name: make(ask) for name, make in STAGES}

    @property
    def enabled(self) -> bool:
        """Whether the stages run: the spec asks for them, and the job can measure a part."""
        return self.plan.spec.stages.enabled and (self.scope.ceilings or self.scope.supplies)

    def snapshot(self, budget: Budget | None = None, views_read: list | None = None) -> Snapshot:
        """Both studies as one decision reads them (``views_read``: the trials, read here where not given)."""
        attrs = self.study.user_attrs
        read = views_read if views_read is not None else views(self.study, self.parts)
        return Snapshot(scope=self.scope, views=read, budget=budget, cudnn=cudnn_by_point(attrs, self.scope.points()),
                        per=per_second(attrs.get("unit")))

    def outline(self, budget: Budget) -> str:
        """The stage plan for this budget, in a line (``budget.left``: the trials after the ones already enqueued,
        such as trial 0)."""
        m, spend = self.scope, self.spend
        if not self.plan.spec.stages.enabled:
            return "stages: off (the spec's stages.enabled); the sampler alone, from the baseline"
        if not self.enabled:
            self.notes.said_elsewhere("none")
            return ("stages: not run: this job can measure neither the model alone (a synthetic batch) nor its input "
                    "pipeline alone (its DataLoader); the climb from the baseline, then the sampler")
        snap = self.snapshot(budget)
        share = f"{PARTS_SHARE:.0%} of this search's trials" + (" and time" if budget.seconds else "")
        if snap.started:
            n = sum(1 for v in snap.views if v.part)
            return (f"stages: resumed from {n} measurement(s) of parts; further ones only while they can raise the "
                    f"bound, within {share}; then end to end, the sampler refining from the end-to-end trials")
        if not spend.core_fits(budget):
            need = len(spend.core()) + 1
            self.notes.said_elsewhere("small")
            return (f"stages: not run: {budget.left} trial(s) left for them, fewer than the {need} the smallest staged "
                    f"plan needs ({spend.describe_core()}, one end-to-end trial); the climb from the baseline, then "
                    f"the sampler (--trials {budget.trials - budget.left + need} or more runs them)")
        first = m.points()[0]
        parts = []
        if m.ceilings:
            cudnn = (" without and with cuDNN's algorithm search" if spend.compare_first(budget) else
                     " (cuDNN's algorithm search not compared: too few trials; cuDNN's default stays)"
                     if m.on_gpu else "")
            parts.append(f"the model alone at {first.label} batch {m.ceiling_batch()}{cudnn}")
        if m.supplies:
            parts.append(f"the {m.decodes()[0]} pipeline alone" if not own_loader(m.base) else f"{OWN_LOADER} alone")
        orders = [(d, d.order(m.choices(d.path), m.on_gpu)) for d in grid() if d.one_off_s is not None]
        costly = "".join(f"; {d.value_label(o[-1])} against {d.value_label(o[0])} last, where the budget pays for its "
                         "one-off cost" for d, o in orders if len(o) > 1)
        return (f"stages: first the likeliest fastest — {', then '.join(parts)} — then end to end; further "
                f"precisions, layouts, pipelines and batches only while they can raise the bound, within {share}"
                f"{costly}; the sampler refines from the end-to-end trials")

    def take_notes(self) -> list[str]:
        """What the planner decided to leave out since last asked, one line each."""
        return self.notes.take()

    def enqueue_next(self, budget: Budget | None = None) -> Stage | None:
        """Enqueue the next stage trial unless one is already waiting; returns the stage enqueued (None: the sampler
        draws the next trial freely)."""
        if not self.plan.spec.stages.enabled:
            return None
        budget = budget or Budget(trials=10 ** 6, left=10 ** 6)
        snap = self.snapshot(budget)
        if snap.waiting:
            return None
        if not self.enabled:
            self.notes.note("none", "stages: not run: this job can measure neither the model alone nor its input "
                                    "pipeline alone; the climb from the baseline, then the sampler")
            return self.without_stages(snap)
        decided = decide(snap)
        if decided != snap.cudnn:
            self.study.set_user_attr(CUDNN_ATTR, cudnn_record(decided))
            snap = dataclasses.replace(snap, cudnn=decided)
        if not snap.started and not self.spend.core_fits(budget, vs=snap.views):
            left = f"{budget.left} trial(s)" + (f" and {budget.left_s:.0f} s" if budget.left_s is not None else "")
            self.notes.note("small", f"stages: not run: {left} left, too little for the smallest staged plan "
                                     f"({self.spend.describe_core()}, one end-to-end trial); the climb from the "
                                     "baseline, then the sampler")
            return self.without_stages(snap)
        for step in self.steps.values():
            asked = step.next(snap)
            if asked is WAIT:
                return None
            if asked:
                return self.enqueue(asked)
        return None

    def without_stages(self, snap: Snapshot) -> Stage | None:
        """Where no part is measured: the climb from the fastest configuration so far (trial 0 at first), each trial
        one knob one step from it; once it has no move left, the sampler's draws (a one-off cost held)."""
        asked = self.steps["climb"].next(snap)
        if asked is WAIT:
            return None
        return self.enqueue(asked or self.steps["hold one-off"].next(snap))

    def enqueue(self, request: Request | None) -> Stage | None:
        """Enqueue ``request`` in the study it belongs to; its stage."""
        if request is None:
            return None
        (self.parts if request.part else self.study).enqueue_trial(request.params, user_attrs=request.attrs,
                                                                   skip_if_exists=False)
        return request.stage

    def request_key(self, stage_name: Stage, overrides: dict[str, Any]) -> tuple:
        """What makes two requests the same measurement (``Scope.request_key``)."""
        return self.scope.request_key(stage_name, overrides)

    def cudnn_for(self, config: dict[str, Any]) -> bool | None:
        """cuDNN's algorithm search for a config's precision and layout, where the stages decided it."""
        decided = cudnn_by_point(self.study.user_attrs, self.scope.points())
        return Snapshot(scope=self.scope, views=[], cudnn=decided).cudnn_decision(Point.of_config(config))

    def bound(self, config: dict[str, Any]) -> tuple[float, str] | None:
        """What the stages measured bounds an end-to-end run of ``config`` at (``Snapshot.bound_of``)."""
        return self.snapshot().bound_of(config)
