"""Confirm: where the leaders tie, the budget's last trials run them again, so that the configuration named
best stands on more than one run.

Configurations whose intervals overlap cannot be told apart by one run each, and the fastest of them is the top of
that draw: a fresh run of it falls back towards the others. Where the best configuration's interval overlaps
another's (``view.tied``), each tied leader, at most ``CONFIRM_TOP`` of them, runs once more when the budget left pays
for no more than those runs; their runs are combined (``view.combined``), and leaders that still tie are named a
tie. Where the best stands clear of the rest, nothing is run again: its interval already says it is the fastest.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request
from autotune.study.view import RUNS, Stage, TrialView, tied

CONFIRM_TOP = 3
"""Leaders confirmed at most: each costs one end-to-end trial of the budget's last ones."""


@dataclass
class Confirm:
    """The tied leaders run again at the end of the budget."""

    ask: Ask

    @staticmethod
    def leaders(vs: list[TrialView]) -> list[TrialView]:
        """The configurations tied with the best (their intervals overlap its), the best among them, fastest first, at
        most ``CONFIRM_TOP``; none where the best has no tie (the baseline never counts: it has its own re-measure)."""
        leaders = [a for a in tied(vs) if not a.baseline]
        return leaders[:CONFIRM_TOP] if len(leaders) > 1 else []

    def next(self, snap: Snapshot) -> Request | None:
        tried = {v.attrs.get("confirm_of") for v in snap.views if v.stage == Stage.CONFIRM}
        pending = [a for a in self.leaders(snap.views) if len(a.attrs.get(RUNS) or []) < 2 and a.number not in tried]
        b = snap.budget
        if not pending or b is None:
            return None
        cost = self.ask.spend.cost(snap.views, part=False)
        time_up = b.left_s is not None and cost is not None and b.left_s <= len(pending) * cost
        if b.left > len(pending) and not time_up:
            return None
        lead = pending[0]
        self.ask.notes.note("confirm", f"stages: the last trials run the leaders whose intervals overlap the best's "
                                       f"once more (at most {CONFIRM_TOP}): the best is named by its runs combined, "
                                       "not by one run's luck, and leaders that still overlap are a tie")
        return self.ask.trial(dict(lead.params), {"stage": Stage.CONFIRM, "confirm_of": lead.number})
