"""The budget: what this search may still spend on measurements of parts, and what each kind of trial costs here."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.search.bounds import Scope, Snapshot
from autotune.search.stages._notes import Notes
from autotune.study.view import Stage, TrialView
from trainer.compile_costs import Paid

PARTS_SHARE = 0.5
"""Measurements of parts spend at most this share of a search's trials and time; the rest is end to end."""


@dataclass(kw_only=True)
class Budget:
    """What this search may still spend, as the planner sees it before a trial."""

    trials: int
    """Trials this search runs in all (``--trials``)."""

    left: int
    """Trials it still runs, the next one included."""

    seconds: float | None = None
    """Its time budget (``--timeout``), if any."""

    left_s: float | None = None
    parts_run: int = 0
    """Measurements of parts this search has run."""

    parts_s: float = 0.0
    """Seconds they took."""


@dataclass
class Spend:
    """Whether the budget (a snapshot's: the latest the planner was given) pays for a step; said when not."""

    scope: Scope
    notes: Notes

    def core(self) -> list[Stage]:
        """The smallest staged plan: what it measures before the first end-to-end candidate."""
        steps = []
        if self.scope.ceilings:
            steps.append(Stage.CEILING)
        if self.scope.supplies:
            steps.append(Stage.SUPPLY)
        return steps

    def describe_core(self) -> str:
        return ", ".join({Stage.CEILING: "the model alone", Stage.SUPPLY: "a pipeline alone"}[s] for s in self.core())

    def core_fits(self, budget: Budget, extra: int = 0, vs: list[TrialView] | None = None) -> bool:
        """Whether the smallest staged plan (and ``extra`` measurements more) fits: in trials, and — once a trial's
        time is known — in the time left, with one end-to-end trial after it."""
        n = len(self.core()) + extra
        if budget.left < n + 1:
            return False
        if budget.left_s is None or vs is None:
            return True
        part, e2e = self.cost(vs, part=True), self.cost(vs, part=False)
        return part is None or e2e is None or n * part + e2e <= budget.left_s

    def compare_first(self, budget: Budget, vs: list[TrialView] | None = None) -> bool:
        """Whether the first ceiling is measured with and without cuDNN's algorithm search (GPU; the budget)."""
        return self.scope.on_gpu and self.core_fits(budget, extra=1, vs=vs)

    def cost(self, vs: list[TrialView], part: bool) -> float | None:
        """Median seconds of a trial of that kind in this study (the other kind's, else None). Trial 0 says nothing
        of either: it runs in a fresh process (torchrun's start, import torch, the CUDA context) and may measure
        for twice as long, several times a trial on a live worker; counted, it would make a short search skip every
        stage."""
        for kind in (part, not part):
            walls = [float(v.attrs["wall_s"]) for v in vs if v.attrs.get("wall_s") is not None
                     and v.stage != Stage.BASELINE and v.stage.measures_part == kind]
            if walls:
                return statistics.median(walls)
        return None

    def affords_part(self, snap: Snapshot) -> bool:
        """Whether one more measurement of a part fits: at least one end-to-end trial after it, and parts within
        ``PARTS_SHARE`` of this search's trials and time."""
        b = snap.budget
        if b is None:
            return True
        if b.left < 2:
            return False  # the search's last trial is end to end
        ok = b.parts_run + 1 <= PARTS_SHARE * b.trials
        cost = self.cost(snap.views, part=True)
        if ok and b.seconds is not None and cost is not None:
            e2e = self.cost(snap.views, part=False) or cost
            ok = b.parts_s + cost <= PARTS_SHARE * b.seconds and (b.left_s is None or b.left_s - cost >= e2e)
        if not ok:
            used = f"{b.parts_run} of {b.trials} trials" + (f", {b.parts_s:.0f} of {b.seconds:.0f} s" if b.seconds
                                                              else "")
            self.notes.note("budget", f"stages: no further measurement of parts: they have had their share of this "
                                      f"search's budget ({used}); end to end from here")
        return ok

    def affords_one_off(self, snap: Snapshot, dim, order: list[Any], k: int, here: Sequence[Paid] = ()) -> bool:
        """Whether the budget pays for measuring ``order[k]`` of a dimension with a one-off cost (priced by
        ``one_off_price``; ``here``: what this machine paid for the measurement's graph before): the measurement with
        its cost inside the trial timeout, within the parts' share of the time, and two end-to-end trials after it in
        the time left (the candidate it makes, and one more). Said when not, and when the machine's records made
        it affordable."""
        price = one_off_price(snap.views, dim, here)
        once, part = price.seconds, self.cost(snap.views, part=True) or 0.0
        e2e = self.cost(snap.views, part=False) or part
        timeout, b = self.scope.plan.trial_timeout_s, snap.budget
        costs = f"its first run costs about {once:.0f} s more ({price.why})"
        why = None
        if timeout and once + part > 0.8 * timeout:  # a run killed at the timeout is a hang: a margin for noise
            why = "timeout", (f"a run with it would take about {once + part:.0f} s ({price.why}), too near the trial "
                              f"timeout ({timeout:.0f} s; --trial-timeout raises it)")
        elif b is not None and b.left_s is not None and b.left_s < once + part + 2 * e2e:
            why = "left", f"{costs}, and the {b.left_s:.0f} s left cannot pay for it and two end-to-end trials after it"
        elif b is not None and b.seconds is not None and b.parts_s + part + once > PARTS_SHARE * b.seconds:
            why = "share", (f"{costs}, over the measurements' share of this search's time ({b.parts_s:.0f} of "
                            f"{b.seconds:.0f} s spent)")
        if why:
            self.notes.note(f"one-off:{dim.path}:{why[0]}", f"stages: {dim.value_label(order[k])} not measured: "
                                                            f"{why[1]}; {dim.value_label(order[0])} stays")
        elif price.here:
            self.notes.note(f"one-off:{dim.path}:here", f"stages: {dim.value_label(order[k])} measured: {costs}")
        return why is None


@dataclass(frozen=True)
class Price:
    """What the first run at a costly value is expected to pay once, and why."""

    seconds: float
    why: str
    here: bool
    """Priced by what this machine paid for the same graph."""


def one_off_price(vs: list[TrialView], dim, here: Sequence[Paid] = ()) -> Price:
    """Seconds the first run at a costly value of ``dim`` pays once (a compile), cheapest evidence first: what loading
    the measurement's graph from this machine's caches cost (``here``: the job's records, ``trainer.compile_costs``);
    where only a cold compile of it is recorded, the caches hold it: that compile's ``one_off_cached_share``; else the
    most any run of this search recorded (``dim.one_off_attr``); else the dimension's prior."""
    cached = [p.seconds for p in here if p.from_caches]
    if cached and dim.one_off_cached_share is not None:
        return Price(max(cached), "its graph loads from this machine's compile caches: at most "
                                  f"{max(cached):.0f} s when it did", True)
    if here and dim.one_off_cached_share is not None:
        cold = max(p.seconds for p in here)
        return Price(cold * dim.one_off_cached_share, f"its graph is in this machine's compile caches, compiled in "
                     f"{cold:.0f} s; loading it is priced at {dim.one_off_cached_share:.0%} of that until a run says",
                     True)
    paid = [float(v.attrs[dim.one_off_attr]) for v in vs if v.attrs.get(dim.one_off_attr) is not None]
    if paid:
        return Price(max(paid), "as it cost in this search", False)
    return Price(float(dim.one_off_s), "a prior: no compile of its graph is recorded on this machine"
                 if dim.one_off_cached_share is not None else "a prior", False)
