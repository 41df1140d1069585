"""The first ceiling: the model alone at the likeliest fastest point of the grid at its first batch (the next point
where one cannot run at any batch); on a GPU without and with cuDNN's algorithm search, each on shapes its worker has
not run."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import Snapshot, Status
from autotune.search.stages._ask import WAIT, Ask, Request, Wait
from autotune.search.stages._measure import ceiling_overrides
from autotune.study.measured import Point
from autotune.study.view import Stage


@dataclass
class FirstCeiling:
    ask: Ask

    def next(self, snap: Snapshot) -> Request | Wait | None:
        m, ask = self.ask.scope, self.ask
        if not m.ceilings:
            return None
        for point in m.points():
            state, request = snap.point_state(point)
            if state == Status.PENDING:
                return WAIT
            if state == Status.IMPOSSIBLE or snap.dead(point):
                continue
            if state == Status.RETRY:
                return ask.part(snap, Stage.CEILING, request, part_budget=False,
                                attrs={"cudnn_evidence": True} if m.on_gpu else None)
            top = m.ceiling_batch()
            evidence = any(v.attrs.get("cudnn_evidence") for v in snap.views
                           if v.stage == Stage.CEILING and Point.of(v) == point)
            compare = m.on_gpu and (evidence or ask.spend.compare_first(snap.budget, snap.views))
            if m.on_gpu and not compare:
                ask.notes.note("cudnn", "stages: cuDNN's algorithm search is not compared (too little budget left): "
                                        "it stays at cuDNN's default (on)")
            if compare:  # without first: the measurement with it then gets a fresh worker, which lives on
                asked = ask.part(snap, Stage.CEILING, ceiling_overrides(m, point, top, False), part_budget=False,
                                 attrs={"cudnn_evidence": True})
                if asked:
                    return asked
            return ask.part(snap, Stage.CEILING, ceiling_overrides(m, point, top, True if m.on_gpu else None),
                            part_budget=False, attrs={"cudnn_evidence": True} if compare else None)
        return None
