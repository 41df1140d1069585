"""Stage 10, refine: the sampler draws the other knobs with the defining settings of the best end-to-end trials
held, round-robin over those within ``REACH`` of the best; and what a draw the stages leave to the sampler holds (a
dimension with a one-off cost, at the baseline's value)."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import grid
from autotune.search.stages._ask import REACH, Ask
from autotune.space import get_path
from autotune.study.view import Stage, TrialView, feasible
from trainer.knobs import table


@dataclass
class Refine:
    """The draws after the stages: what each holds."""

    ask: Ask

    def refine(self, vs: list[TrialView]) -> Stage | None:
        good = [v for v in feasible(vs) if not v.part]
        if not good:
            return None
        best = max(v.imgs_per_s for v in good)
        refined: dict[tuple, int] = {}
        leaders: dict[tuple, TrialView] = {}
        for v in sorted(good, key=lambda v: -v.imgs_per_s):
            if v.imgs_per_s >= REACH * best:
                refined.setdefault(self.defining_params(v), 0)
                leaders.setdefault(self.defining_params(v), v)
        for v in vs:
            if v.stage == Stage.REFINE and self.defining_params(v) in refined:
                refined[self.defining_params(v)] += 1
        least = min(refined, key=lambda k: refined[k])  # round-robin: the least refined so far
        fixed = dict(least)
        if fixed.get("training.compile"):
            lead = leaders[least]
            graph = table().graph_settings
            fixed.update({k: x for k, x in lead.params.items() if k in graph})
            self.ask.notes.note("graph", "stages: refining a compiled trial holds its batch, accumulation and DDP "
                                         "settings (each change is a new compile) and searches its input side")
        self.ask.trial(fixed, {"stage": Stage.REFINE})
        return Stage.REFINE

    def defining_params(self, v: TrialView) -> tuple:
        """``v``'s searched values of the defining settings (``trainer.knobs.Table.defining_settings``), as (path,
        value) pairs: what a refine trial of it holds."""
        space = self.ask.measured.space
        return tuple((k, v.params[k]) for k in table().defining_settings if k in space and k in v.params)

    def hold_one_off(self) -> Stage | None:
        """A draw the stages leave to the sampler holds each searched dimension with a one-off cost at the
        baseline's value: only a measurement says a compile pays for itself, and a free draw of it would spend a
        minute of the budget on a coin toss."""
        m = self.ask.measured
        held = {d.path: m.plan.baseline.get(d.path, get_path(m.base, d.path)) for d in grid()
                if d.one_off_s is not None and d.path in m.space}
        held = {k: x for k, x in held.items() if m.space[k].contains(x)}
        if not held:
            return None
        labels = ", ".join(d.value_label(held[d.path]) for d in grid() if d.path in held)
        self.ask.notes.note("hold-one-off", f"stages: draws left to the sampler run {labels}: what a compile buys is "
                                            "not measured, and the first run would pay for it")
        self.ask.trial(held, {"stage": Stage.SEARCH})
        return Stage.SEARCH
