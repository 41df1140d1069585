"""Profile: where the best end-to-end configuration reaches well below what its parts allow together (its parts do
not explain it: ``Snapshot.unexplained``), it runs once more with a few steps profiled after its windows
(``measure.profile_steps``, ``trainer.profile``): its step split into waiting for data, the host-to-device copy,
forward and backward, the optimizer, DDP's communication and the host's launch gaps. The largest part names the knobs
the climb takes first (``autotune.study.measured.STEP_PARTS``); ``show`` and the report say the split. Once per
search. The run is one more run of the best configuration: its windows are measured before the profile and combine
with the best's."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request
from autotune.study.view import Stage, configurations

PROFILE_STEPS = 10
"""Steps profiled: enough for every part of a step to show (a loader's workers hand over their batches in rounds),
few enough that the trace stays small and the run ends soon after its windows."""


@dataclass
class Profile:
    ask: Ask

    def next(self, snap: Snapshot) -> Request | None:
        if snap.budget is None or snap.budget.left < 2:
            return None
        if any(v.stage == Stage.PROFILE for v in snap.views if not v.part):
            return None  # once: its split stands for the search
        best = max(configurations(snap.views), key=lambda v: v.imgs_per_s, default=None)
        if best is None or best.baseline or not snap.unexplained(best):
            return None
        self.ask.notes.note("profile", f"stages: trial {best.number} reaches well below what its parts allow, and "
                                       "they do not say why: it runs once more with its step profiled after its "
                                       "windows; the climb starts from the largest part of the step")
        return self.ask.trial(dict(best.params), {"stage": Stage.PROFILE, "profile_of": best.number,
                                                  "profile_steps": PROFILE_STEPS})
