"""Infeasible combinations become constraints, not dead points.

A trial that fails because of its configuration (``trainer.protocol.CONFIG_FAILURES``) is told to Optuna as
infeasible — a constraint above zero, so the sampler learns the combination fails — and, when the failure belongs to
a knob combination that has a repair, its draw is run once more with that combination repaired, so the rest of the
draw is not lost: an OOM at batch B runs again at the next smaller batch, a combination the config refuses by a
knob's name runs again at the knob's repair value (``trainer.knobs.Knob.repair``: DDP's static graph under
accumulation, without it). A measurement of the model alone moves down batch by batch until it fits.

Learned before launch: a batch that ran out of memory is not tried again at a larger size with the same
memory-relevant settings (``autotune.space.predicted_oom``); such a draw is infeasible at once, and repaired.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune.space import SearchSpace
from trainer.knobs import table
from trainer.protocol import Failure


@dataclass(frozen=True, kw_only=True)
class Repair:
    changes: dict[str, Any]
    """Dotted settings that replace the failed combination."""

    why: str


def repair_for(failure: Failure, message: str | None, config: dict[str, Any] | None, *, batches: list[int],
               fits: Callable[[int], bool] = lambda batch: True) -> Repair | None:
    """The repair of a configuration failure, or None when the failure has none. ``batches``: the batch sizes the
    trial may use; ``fits(batch)``: False where an OOM is already known (the repair skips those)."""
    text = message or ""
    if failure == Failure.CONFIG:
        for k in table().repairs:  # a knob whose combination the config refuses, by name (``Knob.repair``)
            if k.path in text:
                value, why = k.repair
                return Repair(changes={k.path: value}, why=why)
    if failure == Failure.OOM and config is not None:
        batch = config["training"]["batch_size"]
        lower = [b for b in sorted(batches, reverse=True) if b < batch and fits(b)]
        if lower:
            return Repair(changes={"training.batch_size": lower[0]},
                          why=f"out of memory at batch {batch}: the largest smaller batch not known to run out")
    return None


def batch_choices(space: SearchSpace, base_batch: int) -> list[int]:
    p = space.by_path().get("training.batch_size")
    if p is None:
        return [base_batch]
    if p.kind == "categorical":
        return sorted(c for c in p.choices if isinstance(c, int))
    return sorted({int(p.low), int(p.high), *(int(p.high) >> k for k in range(1, 12) if int(p.high) >> k >= p.low)})
