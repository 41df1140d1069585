"""Stages 3 and 4: the candidates — end-to-end trials at the ceiling's precision, layout and batch for the pipelines
whose bound is within ``REACH`` of the best, and at each precision and layout the ceiling cannot tell from the
fastest — and trial 0 again, where its interval stayed wider than the precision asked."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autotune.search.bounds import NOT_ITS_FAULT, Pipe, grid, pair_label
from autotune.search.stages._ask import REACH, Ask
from autotune.search.stages._first import cores, persist_own_workers, pipeline_settings
from autotune.space import Param, get_path
from autotune.study.view import Outcome, Stage, TrialView
from trainer.knobs import table


@dataclass
class Candidates:
    """Which end-to-end trials the measurements of parts call for, and whether each ran."""

    ask: Ask

    def ranking(self, vs: list[TrialView]) -> tuple[list[Pipe], list[Pipe], float] | None:
        """(the best pipeline of each family within REACH of the best bound (``Pipe.with_model``: beside the model,
        a decode on the GPUs charged its device time), best first; the families only an imprecise supply keeps out of
        it, the top of its interval within reach; the ceiling they are capped at) — None before both are known."""
        m = self.ask.measured
        best = m.best_pair(vs) if m.ceilings else None
        if m.ceilings and best is None:
            return None
        ceiling = best[1] if best else math.inf
        pipes = m.pipes(vs) if m.supplies else [Pipe(settings={}, point=math.inf, upper=math.inf, precise=True)]
        if not pipes:
            return None
        top = max(p.with_model(ceiling) for p in pipes)
        by_family: dict[str, Pipe] = {}
        for p in sorted(pipes, key=lambda p: (-p.with_model(ceiling), -p.point)):  # ties: the most headroom
            by_family.setdefault(p.family, p)
        sure = [p for p in by_family.values() if p.with_model(ceiling) >= REACH * top]
        unsure = [p for p in by_family.values() if p not in sure and not p.precise
                  and p.with_model(ceiling, reach=True) >= REACH * top]
        return sure, unsure, ceiling

    def defining_values(self, fixed: dict[str, Any]) -> tuple:
        """The values of the defining settings (``trainer.knobs.Table.defining_settings``: what the refine stage
        holds) of the trial ``fixed`` would enqueue: its settings, else what it inherits."""
        params = self.complete(fixed)
        return tuple(params[k] if k in params else get_path(self.ask.measured.base, k)
                     for k in table().defining_settings)

    def state_of(self, vs: list[TrialView], values: tuple) -> str:
        """How the end-to-end trials at these ``defining_values`` went: ``untried``, ``pending``, ``alive`` (one
        trained: measured or pruned) or ``dead`` (every one failed)."""
        mine = [v for v in vs if v.end_to_end and not v.baseline and not v.part
                and tuple(v.setting(k) for k in table().defining_settings) == values
                and v.failure_class not in NOT_ITS_FAULT]
        if not mine:
            return "untried"
        if any(v.outcome in (Outcome.MEASURED, Outcome.PRUNED) for v in mine):
            return "alive"
        if any(v.outcome in (Outcome.RUNNING, Outcome.WAITING) for v in mine):
            return "pending"
        return "dead"

    def settings(self, vs: list[TrialView], pipe: Pipe, pair: tuple | None = None) -> dict[str, Any]:
        """What a candidate of ``pipe`` fixes: the ceiling's choice at ``pair`` (default: the best), the pipeline,
        its threads' share beside the model and the most loader workers, the least accumulation."""
        m = self.ask.measured
        best = (pair, None) if pair is not None else m.best_pair(vs)
        if best is not None:
            chosen = m.ceiling_choice(vs, best[0])
            fixed = {k: v for k, v in chosen.items() if k != "imgs_per_s"}
        else:  # no ceiling: the baseline's precision, layout and batch
            fixed = {d.path: m.plan.baseline.get(d.path, get_path(m.base, d.path)) for d in grid()}
        fixed.update(pipe.settings)
        fixed.update(pipeline_settings(m, fixed.get("data.decode"), end_to_end=True))
        if "loader.num_workers" in m.space:
            fixed["loader.num_workers"] = cores(m, "loader.num_workers", end_to_end=True)
        if persist_own_workers(m):
            fixed["loader.persistent_workers"] = True
        if "training.accum_steps" in m.space:
            fixed["training.accum_steps"] = min(m.choices("training.accum_steps"))
        return fixed

    def candidates(self, vs: list[TrialView]) -> Stage | None:
        m = self.ask.measured
        ranked = self.ranking(vs)
        if ranked is None:
            return None
        sure, _, _ = ranked
        running = 0
        for pipe in sure:
            fixed = self.settings(vs, pipe)
            state = self.state_of(vs, self.defining_values(fixed))
            if state == "dead":
                continue  # replaced by the next (it does not count against the cap)
            running += 1
            if running > m.plan.spec.stages.candidates:
                break
            if state == "untried":
                self.enqueue(fixed, {"stage": Stage.CANDIDATE})
                return Stage.CANDIDATE
        # Pairs the ceiling cannot tell from the best: broken by running the best pipeline at each.
        best = m.best_pair(vs)
        for pair, _ in m.tied_pairs(vs) if sure and best is not None else []:
            tried = any(v.end_to_end and not v.baseline and m.pair_of(v) == pair
                        and v.failure_class not in NOT_ITS_FAULT for v in vs)
            if pair != best[0] and not tried:
                self.enqueue(self.settings(vs, sure[0], pair),
                             {"stage": Stage.CANDIDATE, "tie_of": pair_label(best[0])})
                return Stage.CANDIDATE
        return None

    def enqueue(self, fixed: dict[str, Any], attrs: dict[str, Any]) -> None:
        self.ask.trial(self.complete(fixed), attrs)

    def complete(self, fixed: dict[str, Any]) -> dict[str, Any]:
        return complete(self.ask.measured.plan, self.ask.measured.base, fixed)

    def baseline_again(self, vs: list[TrialView]) -> Stage | None:
        """Trial 0 measured again in a fresh process, where its interval was still wider than the precision asked
        at its time cap: every gain is a ratio to it."""
        runs = [v for v in vs if v.baseline and not v.part]
        if (not runs or any(v.outcome in (Outcome.RUNNING, Outcome.WAITING) for v in runs)
                or any(v.attrs.get("remeasure_of") is not None for v in runs)):
            return None
        first = runs[0]
        if first.outcome != Outcome.MEASURED or first.precise is not False or self.ask.spend.budget.left < 2:
            return None
        target = self.ask.measured.plan.base.measure.precision
        self.ask.notes.note("baseline", f"stages: trial {first.label}'s interval was still wider than ±{target:.0%} "
                                        f"at its time cap (± {first.half_width:.1%}): measured again in a fresh "
                                        "process; the baseline combines the two runs")
        self.ask.trial(dict(first.params), {"stage": Stage.BASELINE, "remeasure_of": first.number})
        return Stage.BASELINE


def complete(plan, base: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """Optuna params for every active knob: ``fixed`` where given, else the baseline's value (the library defaults a
    tutorial uses), else the base's nearest value."""
    params: dict[str, Any] = {}
    for p in plan.space.params:
        if not plan.space.active(p, params, base):
            continue
        params[p.path] = _value(p, fixed, plan.baseline, base)
    return params


def _value(p: Param, fixed: dict[str, Any], baseline: dict[str, Any], base: dict[str, Any]) -> Any:
    for source in (fixed, baseline):
        if p.path in source and p.contains(source[p.path]):
            value = source[p.path]
            return p.match(value) if p.kind == "categorical" else value
    return p.nearest(get_path(base, p.path))
