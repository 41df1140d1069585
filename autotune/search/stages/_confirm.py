"""Stage 11, confirm: the budget's last trials run the leaders again, so that the configuration named best stands on
more than one run.

Near-identical configurations measured once each differ by their noise, and the fastest of them (picked from two or
more) is the top of that draw: on 1xH200 four runs of one DALI configuration (hw share 0.5) ran 6,401-6,848 imgs/s,
the fastest was named the best, and its fresh-process re-measure ran 6,627 (3.2 % below), the four runs' mean within
0.1 %. Each leader within
``CONFIRM_BAND`` of the best answer (``view.answers``: a configuration run more than once at the mean of its runs),
at most ``CONFIRM_TOP`` of them, runs once more when the budget left pays for no more than those runs; a leader whose
mean falls gives way, and the next one within the band is run again while the budget lasts.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.stages._ask import Ask
from autotune.study.view import RUNS, TrialView, answers

CONFIRM_BAND = 0.03
"""Leaders within this share of the best answer are confirmed: the spread target of one trial's windows, and what
a fresh re-measure may differ from the search's figure before ``autotune export`` warns."""

CONFIRM_TOP = 3
"""Leaders confirmed at most: each costs one end-to-end trial of the budget's last ones."""


@dataclass
class Confirm:
    """The leaders run again at the end of the budget."""

    ask: Ask

    def leaders(self, vs: list[TrialView]) -> list[TrialView]:
        """Answers within ``CONFIRM_BAND`` of the best (not trial 0: it has its own re-measure), fastest first, at
        most ``CONFIRM_TOP``. None while the best has had no competitor (another answer, or a trial pruned against
        it): a run picked from one is no draw's top (a measurement in whole epochs of a script's own loader took
        171 s on 1xH200, and confirming the one configuration measured was all that search did after it)."""
        tops = sorted((a for a in answers(vs) if not a.baseline), key=lambda a: -a.imgs_per_s)
        pruned = [v for v in vs if v.end_to_end and not v.baseline and v.outcome == "pruned"]
        if not tops or len(tops) + len(pruned) < 2:
            return []
        return [a for a in tops if a.imgs_per_s >= (1 - CONFIRM_BAND) * tops[0].imgs_per_s][:CONFIRM_TOP]

    def confirm(self, vs: list[TrialView]) -> str | None:
        tried = {v.attrs.get("confirm_of") for v in vs if v.stage == "confirm"}
        pending = [a for a in self.leaders(vs) if len(a.attrs.get(RUNS) or []) < 2 and a.number not in tried]
        b = self.ask.spend.budget
        if not pending or b is None:
            return None
        cost = self.ask.spend.cost(vs, part=False)
        time_up = b.left_s is not None and cost is not None and b.left_s <= len(pending) * cost
        if b.left > len(pending) and not time_up:
            return None
        lead = pending[0]
        self.ask.notes.note("confirm", f"stages: the last trials run the leaders within {CONFIRM_BAND:.0%} of the best "
                                       f"once more (at most {CONFIRM_TOP}): the best is named by the mean of its runs, "
                                       "not by one run's luck")
        self.ask.trial(dict(lead.params), {"stage": "confirm", "confirm_of": lead.number})
        return "confirm"
