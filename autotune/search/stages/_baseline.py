"""Trial 0 again: measured again in a fresh process where its interval was still wider than the precision asked at
its time cap; every gain is a ratio to it."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request
from autotune.study.view import Outcome, Stage


@dataclass
class BaselineAgain:
    ask: Ask

    def next(self, snap: Snapshot) -> Request | None:
        runs = [v for v in snap.views if v.baseline and not v.part]
        if (not runs or any(v.outcome in (Outcome.RUNNING, Outcome.WAITING) for v in runs)
                or any(v.attrs.get("remeasure_of") is not None for v in runs)):
            return None
        first = runs[0]
        if first.outcome != Outcome.MEASURED or first.precise is not False or snap.budget.left < 2:
            return None
        target = self.ask.scope.plan.base.measure.precision
        self.ask.notes.note("baseline", f"stages: trial {first.label}'s interval was still wider than ±{target:.0%} "
                                        f"at its time cap (± {first.half_width:.1%}): measured again in a fresh "
                                        "process; the baseline combines the two runs")
        return self.ask.trial(dict(first.params), {"stage": Stage.BASELINE, "remeasure_of": first.number})
