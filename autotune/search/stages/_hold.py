"""Draws the stages leave to the sampler (no stages, nothing measured yet, nothing left to ask) hold each searched
dimension with a one-off cost at the baseline's value: only a measurement says a compile pays for itself, and a free
draw of it would spend a minute of the budget on a coin toss."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request
from autotune.space import get_path
from autotune.study.measured import grid
from autotune.study.view import Stage


@dataclass
class HoldOneOff:
    ask: Ask

    def next(self, snap: Snapshot | None = None) -> Request | None:
        m = self.ask.scope
        held = {d.path: m.plan.baseline.get(d.path, get_path(m.base, d.path)) for d in grid()
                if d.one_off_s is not None and d.path in m.space}
        held = {k: x for k, x in held.items() if m.space[k].contains(x)}
        if not held:
            return None
        labels = ", ".join(d.value_label(held[d.path]) for d in grid() if d.path in held)
        self.ask.notes.note("hold-one-off", f"stages: draws left to the sampler run {labels}: what a compile buys is "
                                            "not measured, and the first run would pay for it")
        return self.ask.trial(held, {"stage": Stage.SEARCH})
