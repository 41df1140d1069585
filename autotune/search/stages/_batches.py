"""Smaller batches of the best point, halving, while they keep ``PLATEAU`` of its pace: the smallest on the plateau
becomes the candidates' batch, and a batch below it bounds what a trial there can reach. On CPU ranks, where the
ceiling starts at the baseline's batch, then larger ones while the largest measured is measurably the fastest."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import PLATEAU, Snapshot
from autotune.search.stages._ask import Ask, Request, Wait
from autotune.search.stages._measure import ceiling_overrides
from autotune.study.view import Stage


@dataclass
class Batches:
    ask: Ask

    def next(self, snap: Snapshot) -> Request | Wait | None:
        m = self.ask.scope
        best = snap.best if m.ceilings else None
        if best is None:
            return None
        if m.has_one_off(best.point):
            return None  # a ladder of compiled points is a compile at every batch, and compiled refinement holds it
        point, top = best.point, best.value
        by_batch: dict[int, float] = {}
        intervals = {}
        for v in snap.ceilings_of(point):
            b = v.setting("training.batch_size")
            if v.imgs_per_s > by_batch.get(b, 0.0):
                by_batch[b], intervals[b] = v.imgs_per_s, v.interval
        smallest, largest = min(by_batch), max(by_batch)
        choices = m.choices("training.batch_size")
        lower = [b for b in choices if b <= smallest // 2] if by_batch[smallest] >= PLATEAU * top else []
        flag = snap.cudnn_decision(point)
        if lower:
            return self.ask.part(snap, Stage.CEILING, ceiling_overrides(
                m, point, max(lower), (True if flag is None else flag) if m.on_gpu else None))
        # CPU ranks start from the baseline's batch (``ceiling_batch``), and a larger one can be faster there too:
        # up the choices while the largest measured is measurably the fastest.
        below = [intervals[b] for b in by_batch if b < largest]
        higher = [b for b in choices if b > largest]
        if m.on_gpu or not higher or by_batch[largest] < top or \
                (below and not max(below, key=lambda i: i.value).below(intervals[largest])):
            return None
        return self.ask.part(snap, Stage.CEILING, ceiling_overrides(m, point, min(higher), None))
