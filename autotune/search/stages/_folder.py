"""A script's own image loader against the project's: where a user's script reads an image folder of JPEGs through a
DataLoader of its own (``run.loader`` of a torchvision ``ImageFolder``: its probe said so, ``Probe.image_folder``)
and that loader's supply is what bounds the job (below the ceiling), one measurement of the project's fastest
pipeline on this machine alone on the same folder: the built-in job in loader mode, as the built-in search's supply
stage measures a pipeline (the same batch and workers as the script's own supply). Not a pipeline the script's
trials can run: a figure for ``autotune show`` to put beside the script's own, with the change that gets it
(``autotune.overview.image_loader_line``). Never for a dataset that is not an image folder, and never where the
script's own loader feeds as much as the model takes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from autotune.search.bounds import Snapshot
from autotune.search.stages._ask import Ask, Request, Wait
from autotune.search.stages._measure import supply_overrides
from autotune.space import get_path, machine_choices
from autotune.study.measured import supply_knob
from autotune.study.view import Stage, own_loader


@dataclass
class ImageFolder:
    """The measurement of the project's pipeline on a script's image folder, where its own loader is the limit."""

    ask: Ask

    def next(self, snap: Snapshot) -> Request | Wait | None:
        m = self.ask.scope
        found = getattr(m.plan, "script", None)
        folder = getattr(found, "image_folder", None) or {}
        if not folder.get("path") or not (m.supplies and m.ceilings) or not own_loader(m.base):
            return None
        pipes, best = snap.pipes, snap.best
        if not pipes or best is None or max(p.upper for p in pipes) >= best.interval.low:
            return None  # the script's own loader feeds what the model takes: nothing to gain from another
        return self.ask.part(snap, Stage.IMAGE_LOADER, self.overrides(snap, folder))

    def overrides(self, snap: Snapshot, folder: dict[str, Any]) -> dict[str, Any]:
        """The built-in job in loader mode on ``folder``, decoding with the fastest pipeline this machine runs, at
        the batch and workers of the script's own supply measurement."""
        m = self.ask.scope
        decode = fastest_decode(on_gpu=m.on_gpu)
        o = {**supply_overrides(snap, decode, None), "data.decode": decode, "data.kind": "imagefolder",
             "data.path": folder["path"],
             "data.image_size": folder.get("image_size") or get_path(m.base, "data.image_size"),
             "script.path": None, "script.entry": None, "script.args": [], "script.applies": []}
        if decode == "dali":  # DALI's own threads, at their most (the loader's workers are not its)
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            o["data.dali_threads"] = max(1, cores // max(1, m.plan.nproc))
        return o


def fastest_decode(*, on_gpu: bool) -> str:
    """The pipeline the built-in search measures first on this machine: the likeliest fastest it can run."""
    knob = supply_knob()
    return knob.order(machine_choices(knob.path, cpu_only=not on_gpu), on_gpu)[0]
