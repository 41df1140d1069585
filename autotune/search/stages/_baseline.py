"""Trial 0 again: measured again in a fresh process where at its time cap its interval was still wider than the
baseline's precision (``autotune.search.evaluate.baseline_precision``), or its windows too few for one; every gain is a
ratio to it."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.formatting import fmt_pm, known, no_interval
from autotune.search.bounds import Snapshot
from autotune.search.evaluate import baseline_precision
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
        # One rule for every job: trial 0 is measured to the baseline's precision, whatever its own run asked.
        target = baseline_precision(self.ask.scope.plan.base.measure)
        within = known(first.half_width) and first.half_width <= target
        # A run whose windows came within the precision, wider only by its loader's turn seen once ("turn"), would
        # be measured again for what its windows already hold.
        if first.outcome != Outcome.MEASURED or first.precise is not False or within or snap.budget.left < 2 \
                or first.attrs.get("ended") == "turn":
            return None
        wide = (f"trial {first.label}'s interval was still wider than ±{target:.0%} (the baseline's precision) at "
                f"its time cap ({fmt_pm(first.half_width)})" if known(first.half_width) else
                f"trial {first.label} has no interval ({no_interval(first.attrs)}) at its time cap")
        self.ask.notes.note("baseline", f"stages: {wide}: measured again in a fresh process; the baseline combines "
                                        "the two runs")
        return self.ask.trial(dict(first.params), {"stage": Stage.BASELINE, "remeasure_of": first.number})
