"""What every step is given: the measured view, the budget, the notes, and the two studies it asks its trials of
(measurements of parts into the parts study, end-to-end trials into the main one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.search.bounds import Measured
from autotune.search.stages._budget import Spend
from autotune.search.stages._notes import Notes
from autotune.study.view import Stage, TrialView

REACH = 0.90
"""Candidates and refinement cover what is within this share of the best bound / the best trial."""

BLOCKED = "blocked"
"""A step waits for a measurement another search worker is running."""


@dataclass
class Ask:
    """A step's view of the search: what is measured, what the budget pays for, what is said, and where a trial is
    asked for."""

    measured: Measured
    spend: Spend
    notes: Notes
    study: Any
    parts: Any

    def part(self, vs: list[TrialView], stage_name: Stage, overrides: dict[str, Any], *, part_budget: bool = True,
             attrs: dict[str, Any] | None = None) -> Stage | str | None:
        """Enqueue the measurement unless it exists (None), runs elsewhere (BLOCKED) or the budget says no (None,
        noted)."""
        m = self.measured
        status = m.status(vs, stage_name, m.request_key(stage_name, overrides))
        if status == "pending":
            return BLOCKED
        if status in ("done", "given_up"):
            return None
        if part_budget and not self.spend.affords_part(vs):
            return None
        self.parts.enqueue_trial({}, user_attrs={"stage": stage_name, "overrides": overrides, **(attrs or {})},
                                 skip_if_exists=False)
        return stage_name

    def trial(self, params: dict[str, Any], attrs: dict[str, Any]) -> None:
        """Enqueue an end-to-end trial of ``params`` (the sampler draws what they leave out)."""
        self.study.enqueue_trial(params, user_attrs=attrs, skip_if_exists=False)
