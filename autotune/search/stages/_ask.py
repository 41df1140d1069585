"""What every stage is given and what it answers: the search's scope, the budget and the notes (``Ask``), and a
``Request`` — a measurement of a part or an end-to-end trial, with its attrs — or ``WAIT``, or None. The planner
alone enqueues what a stage asks for (``_planner``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from autotune.search.bounds import Scope, Snapshot, Status
from autotune.search.stages._budget import Spend
from autotune.search.stages._notes import Notes
from autotune.study.view import Stage

REACH = 0.90
"""Candidates and refinement cover what is within this share of the best bound / the best trial."""


class Wait(enum.Enum):
    """A stage's answer when what it needs runs elsewhere (``WAIT``)."""

    WAIT = "wait"


WAIT = Wait.WAIT
"""A stage waits for a measurement another search worker is running: nothing is enqueued before it ends."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """What a stage asks to run: a measurement of a part (into the parts study) or an end-to-end trial (into the
    main one), with the Optuna params it fixes and its user attrs."""

    part: bool
    params: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any]

    @property
    def stage(self) -> Stage:
        return Stage(self.attrs["stage"])


class Step(Protocol):
    """A stage: what it wants run next, read from the snapshot of one decision."""

    def next(self, snap: Snapshot) -> Request | Wait | None:
        """A request to enqueue, ``WAIT`` (another worker runs what it needs first), or None (nothing to ask)."""
        ...


@dataclass
class Ask:
    """A stage's view of the search beside the snapshot: what it may measure, what the budget pays for, what is
    said; and how a request is made."""

    scope: Scope
    spend: Spend
    notes: Notes

    def part(self, snap: Snapshot, stage_name: Stage, overrides: dict[str, Any], *, part_budget: bool = True,
             attrs: dict[str, Any] | None = None) -> Request | Wait | None:
        """The measurement, unless it exists (None), runs elsewhere (``WAIT``) or the budget says no (None,
        noted)."""
        status = snap.status(stage_name, self.scope.request_key(stage_name, overrides))
        if status == Status.PENDING:
            return WAIT
        if status in (Status.DONE, Status.GIVEN_UP):
            return None
        if part_budget and not self.spend.affords_part(snap):
            return None
        return Request(part=True, attrs={"stage": stage_name, "overrides": overrides, **(attrs or {})})

    @staticmethod
    def trial(params: dict[str, Any], attrs: dict[str, Any]) -> Request:
        """An end-to-end trial of ``params`` (the sampler draws what they leave out)."""
        return Request(part=False, params=params, attrs=attrs)
