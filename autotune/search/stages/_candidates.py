"""The candidates: end-to-end trials at the ceiling's precision, layout and batch for the pipelines whose bound is
within ``REACH`` of the best (``_ranking``), and at each point of the grid the ceiling cannot tell from the
fastest."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request
from autotune.search.stages._ranking import Tried, complete, defining_values, ranking, settings, tried
from autotune.study.measured import Point
from autotune.study.view import Stage
from autotune.verdict import NOT_ITS_FAULT


@dataclass
class Candidates:
    ask: Ask

    def next(self, snap: Snapshot) -> Request | None:
        m = self.ask.scope
        ranked = ranking(snap)
        if ranked is None:
            return None
        sure, _, _ = ranked
        running = 0
        for pipe in sure:
            fixed = settings(snap, pipe)
            state = tried(snap, defining_values(m, fixed))
            if state == Tried.DEAD:
                continue  # replaced by the next (it does not count against the cap)
            running += 1
            if running > m.plan.spec.stages.candidates:
                break
            if state == Tried.UNTRIED:
                return self.ask.trial(complete(m, fixed), {"stage": Stage.CANDIDATE})
        # Points the ceiling cannot tell from the best: broken by running the best pipeline at each.
        best = snap.best
        for point, _ in snap.tied if sure and best is not None else []:
            ran = any(v.end_to_end and not v.baseline and Point.of(v) == point
                      and v.failure_class not in NOT_ITS_FAULT for v in snap.views)
            if point != best.point and not ran:
                return self.ask.trial(complete(m, settings(snap, sure[0], point)),
                                      {"stage": Stage.CANDIDATE, "tie_of": best.point.label})
        return None
