"""Uncertain pipelines: one dropped on a supply whose interval stayed wide, but whose top reaches the band, gets an
end-to-end trial."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.formatting import fmt_ips
from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request
from autotune.search.stages._ranking import Tried, complete, defining_values, ranking, settings, tried
from autotune.study.view import Stage


@dataclass
class Uncertain:
    ask: Ask

    def next(self, snap: Snapshot) -> Request | None:
        m = self.ask.scope
        ranked = ranking(snap)
        if ranked is None or snap.budget.left < 2:
            return None
        for pipe in ranked[1]:
            fixed = settings(snap, pipe)
            if tried(snap, defining_values(m, fixed)) == Tried.UNTRIED:
                self.ask.notes.note(f"uncertain:{pipe.family}", f"stages: {m.pipe_name(pipe.family)}'s supply is "
                                    f"uncertain ({fmt_ips(pipe.point)} {snap.per}, up to {fmt_ips(pipe.upper)}): run "
                                    "end to end as well")
                return self.ask.trial(complete(m, fixed), {"stage": Stage.CANDIDATE, "uncertain": True})
        return None
