"""The first supply: the input pipeline likeliest fastest alone (``training.mode: loader``, no model) at the first
ceiling's batch with the most loader workers."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request, Wait
from autotune.search.stages._measure import next_supply


@dataclass
class FirstSupply:
    ask: Ask

    def next(self, snap: Snapshot) -> Request | Wait | None:
        if snap.pipes:
            return None
        return next_supply(self.ask, snap, part_budget=False, only_first=True)
