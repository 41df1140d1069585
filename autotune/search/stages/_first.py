"""Stages 1 and 2, the first measurements: the model alone at the likeliest fastest point of the ceiling's grid (on a
GPU without and with cuDNN's algorithm search), then the likeliest fastest pipeline alone; and how any measurement of
either is asked for (the later stages ask for theirs the same way)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.search.bounds import Measured, grid
from autotune.search.stages._ask import BLOCKED, REACH, Ask
from autotune.search.stages._budget import Budget
from autotune.space import get_path
from autotune.study.view import Stage, TrialView, own_loader
from trainer.knobs import UNSET, table

CEILING_DATA = {"data.kind": "synthetic"}
"""What makes a measurement the model alone: one batch made on the device and replayed (the knobs it fixes besides:
``trainer.knobs.Table.ceiling_fixed``)."""


def ceiling_overrides(m: Measured, pair: tuple, batch: int, cudnn: bool | None) -> dict[str, Any]:
    """The settings of a measurement of the model alone at ``pair`` and ``batch`` (cuDNN's search as given)."""
    # The model's head as the trials have it: the data's classes (synthetic data would make 1000), or the base's
    # where the study's data is synthetic already (a different head is another model, and another compile).
    classes = {"data.num_classes": m.plan.data.classes} if m.plan.data else {}
    o = {**CEILING_DATA, **table().ceiling_fixed, **dict(zip((d.path for d in grid()), pair, strict=True)),
         "training.batch_size": batch, **classes,
         "measure.window_s": min(m.plan.spec.stages.ceiling_window_s, m.measure.window_s)}
    if cudnn is not None:
        o["training.cudnn_benchmark"] = cudnn
    return o


def pipeline_settings(m: Measured, decode: str | None, *, end_to_end: bool = False) -> dict[str, Any]:
    """A pipeline's own settings where the space searches them under ``decode`` (DALI's): its CPU threads at their
    most alone, as the loader's workers are (what it can feed, before the sampler weighs the cores against the rest),
    end to end their share beside the model (``Policy.first_share``), and each knob's measured likeliest fastest value
    (``Policy.first``, ``autotune.policy``) where it has one."""
    own = [p for p in m.space.values() if p.when is not None and p.when.path == "data.decode" and p.when.holds(decode)]
    return {**{p.path: cores(m, p.path, end_to_end=end_to_end) for p in own if p.knob.auto == "cores"},
            **{p.path: p.policy.first for p in own if p.policy.first is not UNSET and p.contains(p.policy.first)}}


def cores(m: Measured, path: str, *, end_to_end: bool) -> int:
    """A knob counted in cores (loader workers, DALI's threads) where the stages first run it: its most alone (what
    the pipeline can feed with no model beside it), end to end its share of that (``Policy.first_share``): the rank's
    own processes need cores too, and the climb settles the count."""
    most = max(m.choices(path))
    share = m.space[path].policy.first_share if end_to_end and path in m.space else None
    return most if share is None else max(min(m.choices(path)), round(most * share))


@dataclass
class First:
    """The first ceiling and the first supply, and the supplies after them."""

    ask: Ask

    def compare_first(self, budget: Budget, vs: list[TrialView] | None = None) -> bool:
        """Whether the first ceiling is measured with and without cuDNN's algorithm search (GPU; the budget)."""
        return self.ask.measured.on_gpu and self.ask.spend.core_fits(budget, extra=1, vs=vs)

    def ceiling(self, vs: list[TrialView]) -> Stage | str | None:
        """The likeliest fastest pair at its first batch (the next pair where one cannot run at any batch)."""
        m, ask = self.ask.measured, self.ask
        if not m.ceilings:
            return None
        for pair in m.pairs():
            state, request = m.pair_state(vs, pair)
            if state == "pending":
                return BLOCKED
            if state == "impossible" or m.pair_dead(vs, pair):
                continue
            if state == "retry":
                return ask.part(vs, Stage.CEILING, request, part_budget=False,
                                attrs={"cudnn_evidence": True} if m.on_gpu else None)
            top = m.ceiling_batch()
            evidence = any(v.attrs.get("cudnn_evidence") for v in vs
                           if v.stage == Stage.CEILING and m.pair_of(v) == pair)
            compare = m.on_gpu and (evidence or self.compare_first(ask.spend.budget, vs))
            if m.on_gpu and not compare:
                ask.notes.note("cudnn", "stages: cuDNN's algorithm search is not compared (too little budget left): "
                                        "it stays at cuDNN's default (on)")
            if compare:  # without first: the measurement with it then gets a fresh worker, which lives on
                name = ask.part(vs, Stage.CEILING, ceiling_overrides(m, pair, top, False), part_budget=False,
                                attrs={"cudnn_evidence": True})
                if name:
                    return name
            return ask.part(vs, Stage.CEILING, ceiling_overrides(m, pair, top, True if m.on_gpu else None),
                            part_budget=False, attrs={"cudnn_evidence": True} if compare else None)
        return None

    def supply(self, vs: list[TrialView]) -> Stage | str | None:
        if self.ask.measured.pipes(vs):
            return None
        return self.next_supply(vs, part_budget=False, only_first=True)

    def supply_overrides(self, vs: list[TrialView], decode: str, fraction: float | None) -> dict[str, Any]:
        m = self.ask.measured
        chosen = m.ceiling_choice(vs) or {}
        o = {"training.mode": "loader", **({} if own_loader(m.base) else {"data.decode": decode}),
             "training.batch_size": chosen.get("training.batch_size", get_path(m.base, "training.batch_size")),
             "training.channels_last": chosen.get("training.channels_last",
                                                  get_path(m.base, "training.channels_last")),
             "loader.num_workers": max(m.choices("loader.num_workers")),
             "loader.persistent_workers": persist_own_workers(m), "loader.prefetch_factor": None}
        if fraction is not None:
            o["data.hybrid_cpu_fraction"] = fraction
        return {**o, **pipeline_settings(m, decode)}

    def stop_when(self, vs: list[TrialView]) -> dict[str, Any]:
        """When a supply measurement may stop before its interval is tight (``autotune.search.evaluate.Watch``):
        its interval above the ceiling's (it feeds more than the model takes: the ceiling bounds it), or below what
        could still come within ``REACH`` of the best bound."""
        m = self.ask.measured
        best = m.best_pair(vs)
        ceiling = m.pair_interval(vs, best[0]) if best else None
        bounds = [p.with_model(ceiling.value) if ceiling else p.point for p in m.pipes(vs)]
        out: dict[str, Any] = {}
        if ceiling is not None:
            out["above"] = round(ceiling.high, 3)
        if bounds:
            out["below"] = round(REACH * max(bounds), 3)
        return out

    def supply_requests(self) -> list[tuple[str, float | None]]:
        m = self.ask.measured
        out: list[tuple[str, float | None]] = []
        for d in m.decodes():
            out += [(d, f) for f in m.choices("data.hybrid_cpu_fraction")] if d == "hybrid" else [(d, None)]
        return out

    def next_supply(self, vs: list[TrialView], *, part_budget: bool = True,
                    only_first: bool = False) -> Stage | str | None:
        """The next pipeline in measuring order not measured yet (only the first: ``only_first``)."""
        m = self.ask.measured
        if not m.supplies:
            return None
        for decode, fraction in self.supply_requests()[:1] if only_first else self.supply_requests():
            status = m.status(vs, Stage.SUPPLY, (decode, fraction))
            if status == "pending":
                return BLOCKED
            if status in ("done", "given_up"):
                continue
            return self.ask.part(vs, Stage.SUPPLY, self.supply_overrides(vs, decode, fraction), part_budget=part_budget,
                                 attrs={"stop_when": self.stop_when(vs)})
        return None


def persist_own_workers(m: Measured) -> bool:
    """Whether the stages keep loader workers alive between epochs: for a script's own loader, which spawns them anew
    every epoch otherwise (a restart every epoch costs a short epoch much of its pace, docs/benchmarks.md), where the
    space holds the choice. The built-in job's and
    ``run.image_loader``'s pipelines read one endless stream while measured: no restart to save."""
    return (own_loader(m.base) and "loader.persistent_workers" in m.space and "loader.num_workers" in m.space
            and max(m.choices("loader.num_workers")) > 0)
