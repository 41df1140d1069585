"""The planner: the stages' order, and the plan in a line; each step is its own object (``_first``,
``_candidates``, ``_cudnn``, ``_limits``, ``_refine``), given the measured view, the budget and the notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from optuna.trial import TrialState

from autotune.search.bounds import Measured, grid, pair_label
from autotune.search.stages._ask import BLOCKED, Ask
from autotune.search.stages._budget import PARTS_SHARE, Budget, Spend
from autotune.search.stages._candidates import Candidates
from autotune.search.stages._climb import Climb
from autotune.search.stages._confirm import Confirm
from autotune.search.stages._cudnn import Cudnn
from autotune.search.stages._first import First
from autotune.search.stages._folder import Folder
from autotune.search.stages._limits import Limits
from autotune.search.stages._notes import Notes
from autotune.search.stages._refine import Refine
from autotune.study.view import OWN_LOADER, Stage, TrialView, own_loader, views


@dataclass
class StagePlanner:
    """Decides, before each trial is asked for, what the stages want run next, and enqueues it (parts into the parts
    study, end-to-end trials into the main one)."""

    plan: Any
    study: Any
    parts: Any
    measured: Measured = field(init=False)
    """What the measurements of parts say (``autotune.search.bounds``), read for this plan."""

    notes: Notes = field(init=False)
    spend: Spend = field(init=False)
    """The budget the planner was last given, and what it pays for."""

    first: First = field(init=False)
    candidates: Candidates = field(init=False)
    cudnn: Cudnn = field(init=False)
    limits: Limits = field(init=False)
    folder: Folder = field(init=False)
    climb: Climb = field(init=False)
    refine: Refine = field(init=False)
    confirm: Confirm = field(init=False)

    def __post_init__(self):
        self.measured = Measured(self.plan)
        self.notes = Notes()
        self.spend = Spend(self.measured, self.notes)
        ask = Ask(self.measured, self.spend, self.notes, self.study, self.parts)
        self.first = First(ask)
        self.candidates = Candidates(ask)
        self.cudnn = Cudnn(ask)
        self.limits = Limits(ask, self.first, self.candidates, self.cudnn)
        self.folder = Folder(ask, self.first)
        self.climb = Climb(ask)
        self.refine = Refine(ask)
        self.confirm = Confirm(ask)

    @property
    def enabled(self) -> bool:
        """Whether the stages run: the spec asks for them, and the job can measure a part."""
        return self.plan.spec.stages.enabled and (self.measured.ceilings or self.measured.supplies)

    def outline(self, budget: Budget) -> str:
        """The stage plan for this budget, in a line (``budget.left``: the trials after the ones already enqueued,
        such as trial 0)."""
        m, spend = self.measured, self.spend
        if not self.plan.spec.stages.enabled:
            return "stages: off (the spec's stages.enabled); the sampler alone, from the baseline"
        if not self.enabled:
            self.notes.said_elsewhere("none")
            return ("stages: not run: this job can measure neither the model alone (a synthetic batch) nor its input "
                    "pipeline alone (its DataLoader); the sampler alone, from the baseline")
        vs = views(self.study, self.parts)
        share = f"{PARTS_SHARE:.0%} of this search's trials" + (" and time" if budget.seconds else "")
        if started(vs):
            n = sum(1 for v in vs if v.part)
            return (f"stages: resumed from {n} measurement(s) of parts; further ones only while they can raise the "
                    f"bound, within {share}; then end to end, the sampler refining from the end-to-end trials")
        if not spend.core_fits(budget):
            need = len(spend.core()) + 1
            self.notes.said_elsewhere("small")
            return (f"stages: not run: {budget.left} trial(s) left for them, fewer than the {need} the smallest staged "
                    f"plan needs ({spend.describe_core()}, one end-to-end trial); the sampler alone, from the baseline "
                    f"(--trials {budget.trials - budget.left + need} or more runs them)")
        first = m.pairs()[0]
        parts = []
        if m.ceilings:
            cudnn = (" without and with cuDNN's algorithm search" if self.first.compare_first(budget) else
                     " (cuDNN's algorithm search not compared: too few trials; cuDNN's default stays)"
                     if m.on_gpu else "")
            parts.append(f"the model alone at {pair_label(first)} batch {m.ceiling_batch()}{cudnn}")
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
        if not self.enabled:
            if self.plan.spec.stages.enabled:
                self.notes.note("none", "stages: not run: this job can measure neither the model alone nor its input "
                                        "pipeline alone; the sampler alone, from the baseline")
                return self.refine.hold_one_off()
            return None
        self.spend.budget = budget = budget or Budget(trials=10 ** 6, left=10 ** 6)
        if any(s.get_trials(deepcopy=False, states=(TrialState.WAITING,)) for s in (self.study, self.parts)):
            return None
        vs = views(self.study, self.parts)
        self.cudnn.decide(vs)
        if not started(vs) and not self.spend.core_fits(budget, vs=vs):
            left = f"{budget.left} trial(s)" + (f" and {budget.left_s:.0f} s" if budget.left_s is not None else "")
            self.notes.note("small", f"stages: not run: {left} left, too little for the smallest staged plan "
                                     f"({self.spend.describe_core()}, one end-to-end trial); the sampler alone")
            return self.refine.hold_one_off()
        # Confirming the leaders comes before any further exploration: it runs only where the budget left pays for
        # no more than their runs again.
        for step in (self.first.ceiling, self.first.supply, self.candidates.candidates,
                     self.candidates.baseline_again, self.confirm.confirm, self.cudnn.evidence,
                     self.folder.image_loader, self.limits.limiting, self.limits.batches,
                     self.limits.uncertain, self.climb.climb, self.refine.refine):
            name = step(vs)
            if name == BLOCKED:
                return None
            if name:
                return name
        return self.refine.hold_one_off()

    def request_key(self, stage_name: Stage, overrides: dict[str, Any]) -> tuple:
        """What makes two requests the same measurement (``Measured.request_key``)."""
        return self.measured.request_key(stage_name, overrides)

    def cudnn_for(self, config: dict[str, Any]) -> bool | None:
        """cuDNN's algorithm search for a config's precision and layout, where the stages decided it."""
        return self.cudnn.cudnn_for(config)

    def bound(self, config: dict[str, Any]) -> tuple[float, str] | None:
        """What the stages measured bounds an end-to-end run of ``config`` at (``Measured.bound_of``)."""
        return self.measured.bound_of(views(self.study, self.parts), config)


def started(vs: list[TrialView]) -> bool:
    """Whether the stages have begun: a measurement of a part exists."""
    return any(v.stage in (Stage.CEILING, Stage.SUPPLY) for v in vs)
