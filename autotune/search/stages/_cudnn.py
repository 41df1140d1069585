"""cuDNN per point of the grid: for every point a candidate runs at, the measurement without the algorithm search
beside the one with it (the stage), and the decision they make (``decide``: the planner records it on the study,
keyed by the point's settings, ``autotune.study.measured.CUDNN_ATTR``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request, Wait
from autotune.search.stages._measure import ceiling_overrides
from autotune.study.measured import Point
from autotune.study.view import Stage, TrialView

CUDNN_KEEP = 0.99
"""cuDNN's algorithm search stays on only when it is worth more than 1 % of the steady pace (it makes the first step
of every new shape seconds long)."""


@dataclass
class CudnnEvidence:
    """The measurement without the algorithm search beside the one with it, for each point a candidate uses."""

    ask: Ask

    def next(self, snap: Snapshot) -> Request | Wait | None:
        m = self.ask.scope
        if not (m.on_gpu and m.ceilings):
            return None
        used = {Point.of(v) for v in snap.views if v.stage == Stage.CANDIDATE and not v.part}
        for point in m.points():
            if point not in used or point in snap.cudnn or m.has_one_off(point):
                continue
            on = [v for v in snap.ceilings_of(point) if v.setting("training.cudnn_benchmark") is True]
            if not on:
                continue
            batch = max(v.setting("training.batch_size") for v in on)
            asked = self.ask.part(snap, Stage.CEILING, ceiling_overrides(m, point, batch, False),
                                  attrs={"cudnn_evidence": True})
            if asked:
                return asked
        return None


def decide(snap: Snapshot) -> dict[Point, dict[str, Any]]:
    """cuDNN's decisions: the snapshot's, and one for every point measured at one batch with and without the search
    that has none yet."""
    decided = dict(snap.cudnn)
    if not snap.scope.on_gpu:
        return decided
    for point in snap.scope.points():
        if point in decided:
            continue
        by_batch: dict[int, dict[bool, TrialView]] = {}
        for v in snap.ceilings_of(point):
            flag = (v.attrs.get("overrides") or {}).get("training.cudnn_benchmark")
            # Without the search, only a measurement made as evidence (on shapes new to its worker) counts.
            if flag is True or (flag is False and v.attrs.get("cudnn_evidence")):
                slot = by_batch.setdefault(v.setting("training.batch_size"), {})
                if flag not in slot or v.imgs_per_s > slot[flag].imgs_per_s:
                    slot[flag] = v
        for batch, slot in sorted(by_batch.items(), reverse=True):
            if True in slot and False in slot:
                on, off = slot[True], slot[False]
                decided[point] = {"benchmark": off.imgs_per_s < CUDNN_KEEP * on.imgs_per_s, "batch": batch,
                                  "with_search": evidence(on), "without_search": evidence(off)}
                break
    return decided


def evidence(v: TrialView) -> dict[str, Any]:
    """A measurement a cuDNN decision stands on, as the study records it."""
    return {"trial": v.label, "imgs_per_s": v.imgs_per_s, "first_step_s": v.attrs.get("first_step_s"),
            "shapes_new_to_worker": v.attrs.get("shapes_new_to_worker")}
