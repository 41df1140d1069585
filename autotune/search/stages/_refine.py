"""Refine: the sampler draws the other knobs with the defining settings of the best end-to-end trials held,
round-robin over those within ``REACH`` of the best."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import REACH, Ask, Request
from autotune.study.view import Stage, TrialView, feasible
from trainer.knobs import table


@dataclass
class Refine:
    """The draws after the stages: what each holds."""

    ask: Ask

    def next(self, snap: Snapshot) -> Request | None:
        good = [v for v in feasible(snap.views) if not v.part]
        if not good:
            return None
        best = max(v.imgs_per_s for v in good)
        refined: dict[tuple, int] = {}
        leaders: dict[tuple, TrialView] = {}
        for v in sorted(good, key=lambda v: -v.imgs_per_s):
            if v.imgs_per_s >= REACH * best:
                refined.setdefault(self.defining_params(v), 0)
                leaders.setdefault(self.defining_params(v), v)
        for v in snap.views:
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
        return self.ask.trial(fixed, {"stage": Stage.REFINE})

    def defining_params(self, v: TrialView) -> tuple:
        """``v``'s searched values of the defining settings (``trainer.knobs.Table.defining_settings``), as (path,
        value) pairs: what a refine trial of it holds."""
        space = self.ask.scope.space
        return tuple((k, v.params[k]) for k in table().defining_settings if k in space and k in v.params)
