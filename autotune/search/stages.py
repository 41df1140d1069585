"""The stages of a search: measure the bottleneck before searching — the likeliest fastest first, an end-to-end answer
within the first trials, and then only what can still raise the bound.

A trainer is as fast as the slower of two things: what the GPUs can compute (the *ceiling*) and what the input
pipeline can feed them (its *supply*). Both are cheap to measure on their own, and together they bound every
end-to-end run (at most the smaller of the two), so they say where to look. Before each trial the planner looks at
what is known and enqueues the next thing worth running, in this order (``StagePlanner.enqueue_next``):

1. **first ceiling** — the model alone on synthetic data at the largest batch (lower after an OOM), for the precision
   and layout the ceiling's grid (``bounds.grid``) ranks likeliest fastest. On a GPU it is measured without and with
   cuDNN's per-shape algorithm search, each on shapes its worker has not run (``autotune.search.evaluate`` starts a
   fresh worker where it has): cuDNN's plan cache is keyed without the search flag, so a second run in the same worker
   would reuse the first's plans and show no difference.
2. **first supply** — the input pipeline likeliest fastest alone (``training.mode: loader``, no model) at that batch
   with the most loader workers.
3. **candidates** — end-to-end trials at the ceiling's precision, layout and batch for the pipelines whose bound
   (min(supply, ceiling)) is within ``REACH`` of the best: one per decode family, the best of each (ties broken by
   measured headroom), the best bound first; and one at each precision and layout the ceiling cannot tell from the
   fastest (within the spread target: the end-to-end runs tell them apart, and the stages go on from the one that did
   best). The first runs as soon as one ceiling and one supply are known. A candidate whose every trial fails (OOM at
   its batch and at the repair's, an invalid combination) is replaced by the next; a precision whose end-to-end trials
   diverge and never train is dropped for the next-fastest one.
4. **trial 0 again** — when its windows never agreed, in a fresh process: the gain over trial 0 is the headline.
5. **cuDNN per precision and layout** — for every precision and layout a candidate runs at, the measurement without
   the algorithm search beside the one with it; the search stays on for that pair only where it buys ``CUDNN_KEEP``.
6. **what limits the bound** — while the input pipelines bound every run below the ceiling, the next pipeline's
   supply; otherwise the ceiling's grid, one dimension at a time from the fastest pair, along the dimension's order
   until a step is clearly slower (the rest of that direction is then taken as dominated: the order is the prior, the
   measurement confirms it), a dimension with a one-off cost (torch.compile: a compile per graph) last and only
   where the budget left pays for that cost and end-to-end trials after it (``affords_once``); then the pipelines
   not measured yet (they can only tie, and ties are run end to end).
   A supply stops early, in-band, once its latest full windows are all above the ceiling or all clearly out of reach
   (``stop_when``).
7. **smaller batches** of the fastest pair, halving, while they keep ``PLATEAU`` of its pace: the smallest on the
   plateau becomes the candidates' batch, and a batch below it bounds what a trial there can reach. On CPU ranks,
   where the ceiling starts at the baseline's batch, then **larger ones** while the largest measured is clearly the
   fastest.
8. **uncertain pipelines** — one dropped on a supply whose windows never agreed, but whose fastest steady window
   reaches the band, gets an end-to-end trial.
9. **refine** — the sampler draws the other knobs (batch, accumulation, loader, DDP, the hybrid share, ...) with the
   pipeline, precision, layout and compile of the best end-to-end trials held, round-robin over those within
   ``REACH`` of the best; a compiled one also holds what its graph is keyed by (``Table.graph_settings``: each
   change is a new compile) and searches the input side around it. Draws the stages do not
   make (no stages, nothing measured yet) hold compile at the baseline's (``_hold_once``). A draw whose measured
   ceiling (its precision, layout and batch) or supply is already below the best is not
   launched (``bound``): it is told to Optuna as pruned, so the sampler learns it, and costs no trial of the budget.

**The budget.** Measurements of parts spend at most ``PARTS_SHARE`` of this search's trials and of its time (the
first ceiling and supply excepted): the rest is end to end. A budget too small for the first ceiling, the first
supply and one end-to-end trial runs no stages, and one too small for the cuDNN comparison leaves cuDNN at its
default; either is said (``outline``, ``take_notes``), never skipped silently.

**What a job can measure.** A job measures its ceiling only if it can make a synthetic batch, its supply only if the
runtime gets its DataLoader (``Plan.measures_ceiling`` / ``Plan.measures_supply``, both true for the built-in job);
with neither, the search runs the sampler alone and says so.

Every measurement of a part is a trial of the parts study (``autotune.study.view``): dashboard, show, report, resume
and many workers work as for any trial, while Optuna's own view of the main study holds end-to-end trials only.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from optuna.trial import TrialState

from autotune.search.bounds import NOT_ITS_FAULT, PLATEAU, Measured, Pipe, grid, pair_label
from autotune.space import Param, get_path
from autotune.study.view import OWN_LOADER, TrialView, feasible, own_loader, views
from trainer.knobs import table

CUDNN_KEEP = 0.99
"""cuDNN's algorithm search stays on only when it is worth more than 1 % of the steady pace (it makes the first step
of every new shape seconds long)."""

REACH = 0.90
"""Candidates and refinement cover what is within this share of the best bound / the best trial."""

PARTS_SHARE = 0.5
"""Measurements of parts spend at most this share of a search's trials and time; the rest is end to end."""

CEILING_DATA = {"data.kind": "synthetic"}
"""What makes a measurement the model alone: one batch made on the device and replayed (the knobs it fixes besides:
``trainer.knobs.Table.ceiling_fixed``)."""

BLOCKED = "blocked"
"""A step waits for a measurement another search worker is running."""


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
class StagePlanner(Measured):
    """Decides, before each trial is asked for, what the stages want run next, and enqueues it (parts into the parts
    study, end-to-end trials into the main one)."""

    plan: Any
    study: Any
    parts: Any
    notes: list[str] = field(default_factory=list)
    budget: Budget | None = None
    _noted: set[str] = field(default_factory=set)

    def __post_init__(self):
        self.read_plan(self.plan)

    # ---- what the job and the data allow ------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.plan.spec.stages.enabled and (self.ceilings or self.supplies)

    # ---- the plan -----------------------------------------------------------------------------------------------

    def core(self) -> list[str]:
        """The smallest staged plan: what it measures before the first end-to-end candidate."""
        steps = []
        if self.ceilings:
            steps.append("ceiling")
        if self.supplies:
            steps.append("supply")
        return steps

    def _core_fits(self, budget: Budget, extra: int = 0, vs: list[TrialView] | None = None) -> bool:
        """Whether the smallest staged plan (and ``extra`` measurements more) fits: in trials, and — once a trial's
        time is known — in the time left, with one end-to-end trial after it."""
        n = len(self.core()) + extra
        if budget.left < n + 1:
            return False
        if budget.left_s is None or vs is None:
            return True
        part, e2e = self.cost(vs, part=True), self.cost(vs, part=False)
        return part is None or e2e is None or n * part + e2e <= budget.left_s

    def outline(self, budget: Budget) -> str:
        """The stage plan for this budget, in a line (``budget.left``: the trials after the ones already enqueued,
        such as trial 0)."""
        if not self.plan.spec.stages.enabled:
            return "stages: off (the spec's stages.enabled); the sampler alone, from the baseline"
        if not self.enabled:
            self._noted.add("none")  # said here: the planner's own note would say it again
            return ("stages: not run: this job can measure neither the model alone (a synthetic batch) nor its input "
                    "pipeline alone (its DataLoader); the sampler alone, from the baseline")
        vs = views(self.study, self.parts)
        share = f"{PARTS_SHARE:.0%} of this search's trials" + (" and time" if budget.seconds else "")
        if self._started(vs):
            n = sum(1 for v in vs if v.part)
            return (f"stages: resumed from {n} measurement(s) of parts; further ones only while they can raise the "
                    f"bound, within {share}; then end to end, the sampler refining from the end-to-end trials")
        if not self._core_fits(budget):
            need = len(self.core()) + 1
            self._noted.add("small")  # said here: the planner's own note would say it again
            return (f"stages: not run: {budget.left} trial(s) left for them, fewer than the {need} the smallest staged "
                    f"plan needs ({self._core_words()}, one end-to-end trial); the sampler alone, from the baseline "
                    f"(--trials {budget.trials - budget.left + need} or more runs them)")
        first = self.pairs()[0]
        parts = []
        if self.ceilings:
            cudnn = (" without and with cuDNN's algorithm search" if self._compare_first(budget) else
                     " (cuDNN's algorithm search not compared: too few trials; cuDNN's default stays)"
                     if self.on_gpu else "")
            parts.append(f"the model alone at {pair_label(first)} batch {self.ceiling_batch()}"
                         f"{cudnn}")
        if self.supplies:
            parts.append(f"the {self.decodes()[0]} pipeline alone" if not own_loader(self.base) else
                         f"{OWN_LOADER} alone")
        orders = [(d, d.order(self.choices(d.path), self.on_gpu)) for d in grid() if d.once_s is not None]
        costly = "".join(f"; {d.word(o[-1])} against {d.word(o[0])} last, where the budget pays for its one-off cost"
                         for d, o in orders if len(o) > 1)
        return (f"stages: first the likeliest fastest — {', then '.join(parts)} — then end to end; further "
                f"precisions, layouts, pipelines and batches only while they can raise the bound, within {share}"
                f"{costly}; the sampler refines from the end-to-end trials")

    def _core_words(self) -> str:
        return ", ".join({"ceiling": "the model alone", "supply": "a pipeline alone"}[s] for s in self.core())

    def take_notes(self) -> list[str]:
        """What the planner decided to leave out since last asked, one line each."""
        out, self.notes = self.notes, []
        return out

    def note(self, key: str, text: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            self.notes.append(text)

    def enqueue_next(self, budget: Budget | None = None) -> str | None:
        """Enqueue the next stage trial unless one is already waiting; returns the stage enqueued (None: the sampler
        draws the next trial freely)."""
        if not self.enabled:
            if self.plan.spec.stages.enabled:
                self.note("none", "stages: not run: this job can measure neither the model alone nor its input "
                                  "pipeline alone; the sampler alone, from the baseline")
                return self._hold_once()
            return None
        self.budget = budget = budget or Budget(trials=10 ** 6, left=10 ** 6)
        if any(s.get_trials(deepcopy=False, states=(TrialState.WAITING,)) for s in (self.study, self.parts)):
            return None
        vs = views(self.study, self.parts)
        self._decide_cudnn(vs)
        if not self._started(vs) and not self._core_fits(budget, vs=vs):
            left = f"{budget.left} trial(s)" + (f" and {budget.left_s:.0f} s" if budget.left_s is not None else "")
            self.note("small", f"stages: not run: {left} left, too little for the smallest staged plan "
                               f"({self._core_words()}, one end-to-end trial); the sampler alone")
            return self._hold_once()
        for step in (self._first_ceiling, self._first_supply, self._candidates, self._baseline_again,
                     self._cudnn_evidence, self._limiting, self._batches, self._uncertain, self._refine):
            name = step(vs)
            if name == BLOCKED:
                return None
            if name:
                return name
        return self._hold_once()

    def _hold_once(self) -> str | None:
        """A draw the stages leave to the sampler holds each searched dimension with a one-off cost at the
        baseline's value: only a measurement says a compile pays for itself, and a free draw of it would spend a
        minute of the budget on a coin toss."""
        held = {d.path: self.plan.baseline.get(d.path, get_path(self.base, d.path)) for d in grid()
                if d.once_s is not None and d.path in self.space}
        held = {k: x for k, x in held.items() if self.space[k].contains(x)}
        if not held:
            return None
        words = ", ".join(d.word(held[d.path]) for d in grid() if d.path in held)
        self.note("hold-once", f"stages: draws left to the sampler run {words}: what a compile buys is not measured, "
                               "and the first run would pay for it")
        self.study.enqueue_trial(held, user_attrs={"stage": "search"}, skip_if_exists=False)
        return "search"

    def _started(self, vs: list[TrialView]) -> bool:
        return any(v.stage in ("ceiling", "supply") for v in vs)

    # ---- measurements: what exists of each, and asking for one -------------------------------------------------

    def _want(self, vs: list[TrialView], stage_name: str, overrides: dict[str, Any], *, part_budget: bool = True,
              attrs: dict[str, Any] | None = None) -> str | None:
        """Enqueue the measurement unless it exists (None), runs elsewhere (BLOCKED) or the budget says no (None,
        noted)."""
        status = self.status(vs, stage_name, self.request_key(stage_name, overrides))
        if status == "pending":
            return BLOCKED
        if status in ("done", "given_up"):
            return None
        if part_budget and not self.affords_part(vs):
            return None
        self.parts.enqueue_trial({}, user_attrs={"stage": stage_name, "overrides": overrides, **(attrs or {})},
                                 skip_if_exists=False)
        return stage_name

    # ---- the budget -----------------------------------------------------------------------------------------------

    def cost(self, vs: list[TrialView], part: bool) -> float | None:
        """Median seconds of a trial of that kind in this study (the other kind's, else None). Trial 0 says nothing
        of either: it runs in a fresh process (torchrun's start, import torch, the CUDA context) and may measure
        twice the windows (on 1xH200, 65 s against 7-23 s for the measurements after it on a live worker; counted, it
        made a 170 s search skip every stage)."""
        for kind in (part, not part):
            walls = [float(v.attrs["wall_s"]) for v in vs if v.attrs.get("wall_s") is not None
                     and v.stage != "baseline" and (v.stage in ("ceiling", "supply")) == kind]
            if walls:
                return statistics.median(walls)
        return None

    def affords_part(self, vs: list[TrialView]) -> bool:
        """Whether one more measurement of a part fits: at least one end-to-end trial after it, and parts within
        ``PARTS_SHARE`` of this search's trials and time."""
        b = self.budget
        if b is None:
            return True
        if b.left < 2:
            return False  # the search's last trial is end to end
        ok = b.parts_run + 1 <= PARTS_SHARE * b.trials
        cost = self.cost(vs, part=True)
        if ok and b.seconds is not None and cost is not None:
            e2e = self.cost(vs, part=False) or cost
            ok = b.parts_s + cost <= PARTS_SHARE * b.seconds and (b.left_s is None or b.left_s - cost >= e2e)
        if not ok:
            used = f"{b.parts_run} of {b.trials} trials" + (f", {b.parts_s:.0f} of {b.seconds:.0f} s" if b.seconds
                                                              else "")
            self.note("budget", f"stages: no further measurement of parts: they have had their share of this "
                                f"search's budget ({used}); end to end from here")
        return ok

    def once_cost(self, vs: list[TrialView], dim) -> float:
        """Seconds the first run at a costly value of ``dim`` pays once (a compile): the most any run recorded
        (``dim.once_attr``), else the dimension's prior."""
        paid = [float(v.attrs[dim.once_attr]) for v in vs if v.attrs.get(dim.once_attr) is not None]
        return max(paid) if paid else float(dim.once_s)

    def affords_once(self, vs: list[TrialView], dim, order: list[Any], k: int) -> bool:
        """Whether the budget pays for measuring ``order[k]`` of a dimension with a one-off cost: the measurement
        with its cost inside the trial timeout, within the parts' share of the time, and two end-to-end trials
        after it in the time left (the candidate it makes, and one more). Said when not."""
        once = self.once_cost(vs, dim)
        part = self.cost(vs, part=True) or 0.0
        e2e = self.cost(vs, part=False) or part
        timeout, b = self.plan.trial_timeout_s, self.budget
        why = None
        if timeout and once + part > 0.8 * timeout:  # a run killed at the timeout is a hang: a margin for noise
            why = "timeout", (f"a run with it would take about {once + part:.0f} s, too near the trial timeout "
                              f"({timeout:.0f} s; --trial-timeout raises it)")
        elif b is not None and b.left_s is not None and b.left_s < once + part + 2 * e2e:
            why = "left", (f"its first run costs about {once:.0f} s more, and the {b.left_s:.0f} s left cannot pay for "
                           "it and two end-to-end trials after it")
        elif b is not None and b.seconds is not None and b.parts_s + part + once > PARTS_SHARE * b.seconds:
            why = "share", (f"its first run costs about {once:.0f} s more, over the measurements' share of this "
                            f"search's time ({b.parts_s:.0f} of {b.seconds:.0f} s spent)")
        if why:
            self.note(f"once:{dim.path}:{why[0]}", f"stages: {dim.word(order[k])} not measured: {why[1]}; "
                                                   f"{dim.word(order[0])} stays")
        return why is None

    # ---- 1. the ceiling -------------------------------------------------------------------------------------------

    def ceiling_overrides(self, pair: tuple, batch: int, cudnn: bool | None) -> dict[str, Any]:
        # The model's head as the trials have it: the data's classes (synthetic data would make 1000), or the base's
        # where the study's data is synthetic already (a different head is another model, and another compile).
        classes = {"data.num_classes": self.plan.data.classes} if self.plan.data else {}
        o = {**CEILING_DATA, **table().ceiling_fixed, **dict(zip((d.path for d in grid()), pair, strict=True)),
             "training.batch_size": batch, **classes,
             "measure.window_s": min(self.plan.spec.stages.ceiling_window_s, self.measure.window_s)}
        if cudnn is not None:
            o["training.cudnn_benchmark"] = cudnn
        return o

    def _compare_first(self, budget: Budget, vs: list[TrialView] | None = None) -> bool:
        """Whether the first ceiling is measured with and without cuDNN's algorithm search (GPU; the budget)."""
        return self.on_gpu and self._core_fits(budget, extra=1, vs=vs)

    def _first_ceiling(self, vs: list[TrialView]) -> str | None:
        """The likeliest fastest pair at the largest batch (the next pair where one cannot run at any batch)."""
        if not self.ceilings:
            return None
        for pair in self.pairs():
            state, request = self.pair_state(vs, pair)
            if state == "pending":
                return BLOCKED
            if state == "impossible" or self.pair_dead(vs, pair):
                continue
            if state == "retry":
                return self._want(vs, "ceiling", request, part_budget=False,
                                  attrs={"cudnn_evidence": True} if self.on_gpu else None)
            top = self.ceiling_batch()
            evidence = any(v.attrs.get("cudnn_evidence") for v in vs
                           if v.stage == "ceiling" and self.pair_of(v) == pair)
            compare = self.on_gpu and (evidence or self._compare_first(self.budget, vs))
            if self.on_gpu and not compare:
                self.note("cudnn", "stages: cuDNN's algorithm search is not compared (too little budget left): it "
                                   "stays at cuDNN's default (on)")
            if compare:  # without first: the measurement with it then gets a fresh worker, which lives on
                name = self._want(vs, "ceiling", self.ceiling_overrides(pair, top, False), part_budget=False,
                                  attrs={"cudnn_evidence": True})
                if name:
                    return name
            return self._want(vs, "ceiling", self.ceiling_overrides(pair, top, True if self.on_gpu else None),
                              part_budget=False, attrs={"cudnn_evidence": True} if compare else None)
        return None

    # ---- 2. the supplies ------------------------------------------------------------------------------------------

    def supply_overrides(self, vs: list[TrialView], decode: str, fraction: float | None) -> dict[str, Any]:
        chosen = self.ceiling_choice(vs) or {}
        o = {"training.mode": "loader", **({} if own_loader(self.base) else {"data.decode": decode}),
             "training.batch_size": chosen.get("training.batch_size", get_path(self.base, "training.batch_size")),
             "training.channels_last": chosen.get("training.channels_last",
                                                  get_path(self.base, "training.channels_last")),
             "loader.num_workers": max(self.choices("loader.num_workers")), "loader.persistent_workers": False,
             "loader.prefetch_factor": None}
        if fraction is not None:
            o["data.hybrid_cpu_fraction"] = fraction
        return {**o, **self.threads_of(decode)}

    def threads_of(self, decode: str | None) -> dict[str, Any]:
        """A pipeline's own CPU threads at their most where the space searches them under ``decode`` (DALI's), as
        the loader's workers are: what it can feed, before the sampler weighs the cores against the rest."""
        return {p.path: max(self.choices(p.path)) for p in self.space.values()
                if p.knob.auto == "cores" and p.when is not None and p.when.path == "data.decode"
                and p.when.holds(decode)}

    def stop_when(self, vs: list[TrialView]) -> dict[str, Any]:
        """When a supply measurement may stop before it settles (``autotune.search.evaluate.Watch``): its latest
        ``windows`` full windows all above the ceiling (it feeds more than the model takes: the ceiling bounds it),
        or all below what could still come within ``REACH`` of the best bound."""
        best = self.best_pair(vs)
        ceiling = best[1] if best else None
        bounds = [min(p.point, ceiling or math.inf) for p in self.pipes(vs)]
        out: dict[str, Any] = {"windows": self.measure.windows}
        if ceiling is not None:
            out["above"] = round(ceiling * (1 + self.measure.spread_target), 3)
        if bounds:
            out["below"] = round(REACH * max(bounds) * (1 - self.measure.spread_target), 3)
        return out

    def _supply_requests(self) -> list[tuple[str, float | None]]:
        out: list[tuple[str, float | None]] = []
        for d in self.decodes():
            out += [(d, f) for f in self.choices("data.hybrid_cpu_fraction")] if d == "hybrid" else [(d, None)]
        return out

    def _next_supply(self, vs: list[TrialView], *, part_budget: bool = True, only_first: bool = False) -> str | None:
        if not self.supplies:
            return None
        for decode, fraction in self._supply_requests()[:1] if only_first else self._supply_requests():
            status = self.status(vs, "supply", (decode, fraction))
            if status == "pending":
                return BLOCKED
            if status in ("done", "given_up"):
                continue
            return self._want(vs, "supply", self.supply_overrides(vs, decode, fraction), part_budget=part_budget,
                              attrs={"stop_when": self.stop_when(vs)})
        return None

    def _first_supply(self, vs: list[TrialView]) -> str | None:
        if self.pipes(vs):
            return None
        return self._next_supply(vs, part_budget=False, only_first=True)

    # ---- 3. candidates --------------------------------------------------------------------------------------------

    def ranking(self, vs: list[TrialView]) -> tuple[list[Pipe], list[Pipe], float] | None:
        """(the best pipeline of each family within REACH of the best bound, best first; the families only an
        unsettled supply keeps out of it; the ceiling they are capped at) — None before both are known."""
        best = self.best_pair(vs) if self.ceilings else None
        if self.ceilings and best is None:
            return None
        ceiling = best[1] if best else math.inf
        pipes = self.pipes(vs) if self.supplies else [Pipe(settings={}, point=math.inf, upper=math.inf,
                                                           settled=True)]
        if not pipes:
            return None
        top = max(min(p.point, ceiling) for p in pipes)
        by_family: dict[str, Pipe] = {}
        for p in sorted(pipes, key=lambda p: (-min(p.point, ceiling), -p.point)):  # ties: the most headroom
            by_family.setdefault(p.family, p)
        sure = [p for p in by_family.values() if min(p.point, ceiling) >= REACH * top]
        unsure = [p for p in by_family.values() if p not in sure and not p.settled
                  and min(p.upper, ceiling) >= REACH * top]
        return sure, unsure, ceiling

    def identity_of(self, fixed: dict[str, Any]) -> tuple:
        """The identity (``trainer.knobs.Table.identity``: what the refine stage holds) of the trial ``fixed`` would
        enqueue: its settings, else what it inherits."""
        params = self.complete(fixed)
        return tuple(params[k] if k in params else get_path(self.base, k) for k in table().identity)

    def identity_state(self, vs: list[TrialView], ident: tuple) -> str:
        """``untried``, ``pending``, ``alive`` (it trained: measured or pruned) or ``dead`` (every trial failed)."""
        mine = [v for v in vs if v.end_to_end and not v.baseline and not v.part
                and tuple(v.setting(k) for k in table().identity) == ident and v.failure_class not in NOT_ITS_FAULT]
        if not mine:
            return "untried"
        if any(v.outcome in ("measured", "pruned") for v in mine):
            return "alive"
        if any(v.outcome in ("running", "waiting") for v in mine):
            return "pending"
        return "dead"

    def candidate_settings(self, vs: list[TrialView], pipe: Pipe, pair: tuple | None = None) -> dict[str, Any]:
        best = (pair, None) if pair is not None else self.best_pair(vs)
        if best is not None:
            chosen = self.ceiling_choice(vs, best[0])
            fixed = {k: v for k, v in chosen.items() if k != "imgs_per_s"}
        else:  # no ceiling: the baseline's precision, layout and batch
            fixed = {d.path: self.plan.baseline.get(d.path, get_path(self.base, d.path)) for d in grid()}
        fixed.update(pipe.settings)
        fixed.update(self.threads_of(fixed.get("data.decode")))
        if "loader.num_workers" in self.space:
            fixed["loader.num_workers"] = max(self.choices("loader.num_workers"))
        if "training.accum_steps" in self.space:
            fixed["training.accum_steps"] = min(self.choices("training.accum_steps"))
        return fixed

    def _candidates(self, vs: list[TrialView]) -> str | None:
        ranked = self.ranking(vs)
        if ranked is None:
            return None
        sure, _, _ = ranked
        running = 0
        for pipe in sure:
            fixed = self.candidate_settings(vs, pipe)
            state = self.identity_state(vs, self.identity_of(fixed))
            if state == "dead":
                continue  # replaced by the next (it does not count against the cap)
            running += 1
            if running > self.plan.spec.stages.candidates:
                break
            if state == "untried":
                self.main_enqueue(fixed, {"stage": "candidate"})
                return "candidate"
        # Pairs the ceiling cannot tell from the best: broken by running the best pipeline at each.
        best = self.best_pair(vs)
        for pair, _ in self.tied_pairs(vs) if sure and best is not None else []:
            tried = any(v.end_to_end and not v.baseline and self.pair_of(v) == pair
                        and v.failure_class not in NOT_ITS_FAULT for v in vs)
            if pair != best[0] and not tried:
                self.main_enqueue(self.candidate_settings(vs, sure[0], pair),
                                  {"stage": "candidate", "tie_of": pair_label(best[0])})
                return "candidate"
        return None

    def main_enqueue(self, fixed: dict[str, Any], attrs: dict[str, Any]) -> None:
        self.study.enqueue_trial(self.complete(fixed), user_attrs=attrs, skip_if_exists=False)

    def complete(self, fixed: dict[str, Any]) -> dict[str, Any]:
        """Optuna params for every active knob: ``fixed`` where given, else the baseline's value (the library
        defaults a tutorial uses), else the base's nearest value."""
        params: dict[str, Any] = {}
        for p in self.plan.space.params:
            if not self.plan.space.active(p, params, self.base):
                continue
            params[p.path] = _value(p, fixed, self.plan.baseline, self.base)
        return params

    # ---- 4. trial 0 again -----------------------------------------------------------------------------------------

    def _baseline_again(self, vs: list[TrialView]) -> str | None:
        runs = [v for v in vs if v.baseline and not v.part]
        if (not runs or any(v.outcome in ("running", "waiting") for v in runs)
                or any(v.attrs.get("remeasure_of") is not None for v in runs)):
            return None
        first = runs[0]
        if first.outcome != "measured" or first.attrs.get("settled") is not False or self.budget.left < 2:
            return None
        # Its latest windows' spread can be under the target while the one before them is not: no figure to give.
        target = self.plan.base.measure.spread_target
        self.note("baseline", f"stages: trial {first.label}'s windows never agreed within {target:.0%} before its "
                              "window limit: measured again in a fresh process; the baseline is the faster settled "
                              "figure (the faster of the two if neither settles)")
        self.study.enqueue_trial(dict(first.params), user_attrs={"stage": "baseline", "remeasure_of": first.number},
                                 skip_if_exists=False)
        return "baseline"

    # ---- 5. cuDNN per precision and layout -------------------------------------------------------------------------

    def _cudnn_evidence(self, vs: list[TrialView]) -> str | None:
        """The measurement without the algorithm search beside the one with it, for each pair a candidate uses."""
        if not (self.on_gpu and self.ceilings):
            return None
        decided = self.decisions()
        used = {self.pair_of(v) for v in vs if v.stage == "candidate" and not v.part}
        for pair in self.pairs():
            if pair not in used or pair_label(pair) in decided or self.once_of(pair):
                continue
            on = [v for v in self.ceilings_of(vs, pair) if v.setting("training.cudnn_benchmark") is True]
            if not on:
                continue
            batch = max(v.setting("training.batch_size") for v in on)
            name = self._want(vs, "ceiling", self.ceiling_overrides(pair, batch, False),
                              attrs={"cudnn_evidence": True})
            if name:
                return name
        return None

    def _decide_cudnn(self, vs: list[TrialView]) -> None:
        """Record the decision for every pair measured at one batch with and without the search."""
        if not self.on_gpu:
            return
        decided = self.decisions()
        changed = False
        for pair in self.pairs():
            label = pair_label(pair)
            if label in decided:
                continue
            by_batch: dict[int, dict[bool, TrialView]] = {}
            for v in self.ceilings_of(vs, pair):
                flag = (v.attrs.get("overrides") or {}).get("training.cudnn_benchmark")
                # Without the search, only a measurement made as evidence (on shapes new to its worker) counts.
                if flag is True or (flag is False and v.attrs.get("cudnn_evidence")):
                    slot = by_batch.setdefault(v.setting("training.batch_size"), {})
                    if flag not in slot or v.imgs_per_s > slot[flag].imgs_per_s:
                        slot[flag] = v
            for batch, slot in sorted(by_batch.items(), reverse=True):
                if True in slot and False in slot:
                    on, off = slot[True], slot[False]
                    decided[label] = {"benchmark": off.imgs_per_s < CUDNN_KEEP * on.imgs_per_s, "batch": batch,
                                      "with_search": evidence(on), "without_search": evidence(off)}
                    changed = True
                    break
        if changed:
            self.study.set_user_attr("cudnn", decided)

    def decisions(self) -> dict[str, Any]:
        """cuDNN's algorithm search, decided per precision and layout (``pair_label``): ``benchmark`` and the two
        measurements it stands on."""
        return dict(self.study.user_attrs.get("cudnn") or {})

    def decision(self, pair: tuple) -> bool | None:
        """A compiled point takes its eager point's decision: compiled convolutions are cuDNN's too, and evidence on
        shapes new to a worker would be a compile in a fresh one."""
        decided = self.decisions()
        d = decided.get(pair_label(pair)) or decided.get(pair_label(self.plain(pair)))
        return d["benchmark"] if d else None

    def once_of(self, pair: tuple) -> bool:
        """Whether ``pair`` is at a value with a one-off cost (compiled)."""
        return self.plain(pair) != tuple(pair)

    def cudnn_for(self, config: dict[str, Any]) -> bool | None:
        """cuDNN's algorithm search for a config's precision and layout, where the stages decided it."""
        return self.decision(tuple(get_path(config, dim.path) for dim in grid()))

    # ---- 6. what limits the bound -----------------------------------------------------------------------------------

    def _limiting(self, vs: list[TrialView]) -> str | None:
        best = self.best_pair(vs) if self.ceilings else None
        pipes = self.pipes(vs) if self.supplies else []
        if self.supplies and not pipes:
            return self._next_supply(vs)
        if best is not None and pipes and max(p.point for p in pipes) < best[1] * (1 - self.tolerance):
            name = self._next_supply(vs)
            if name:
                return name
            self.note("input-bound", f"stages: no other precision or layout is measured: the input pipelines (at "
                                     f"most {max(p.point for p in pipes):,.0f} imgs/s) bound every trial below the "
                                     f"ceiling ({best[1]:,.0f})")
            return None
        if best is not None:
            name = self._explore(vs, best[0])
            if name:
                return name
        return self._next_supply(vs)

    def _explore(self, vs: list[TrialView], best: tuple) -> str | None:
        """One dimension at a time from the fastest pair: each direction along the dimension's order until a step
        measures clearly slower."""
        for i, dim in enumerate(grid()):
            # The other dimensions are explored without the one-off cost (each compiled point is a compile); the
            # costly one last, from the best (the grid's order), where the budget pays for it.
            frm = best if dim.once_s is not None else self.without_once(vs, best)
            top_ips = self.pair_ceiling(vs, frm)
            order = dim.order(self.choices(dim.path), self.on_gpu)
            pos = order.index(frm[i])
            for step in (1, -1):
                k = pos + step
                while 0 <= k < len(order):
                    q = (*frm[:i], order[k], *frm[i + 1:])
                    state, request = self.pair_state(vs, q)
                    if state == "pending":
                        return BLOCKED
                    if state in (None, "retry"):
                        if dim.once_s is not None and k > 0 and not self.affords_once(vs, dim, order, k):
                            break
                        return self._want(vs, "ceiling", request or self.ceiling_overrides(
                            q, self.ceiling_batch(), True if self.on_gpu else None))
                    ips = self.pair_ceiling(vs, q)
                    if ips is not None and ips < top_ips * (1 - self.measure.spread_target):
                        rest = order[k + 1:] if step > 0 else order[:k][::-1]
                        if rest:
                            words = ", ".join(dim.word(x) for x in rest)
                            self.note(f"dominated:{dim.path}:{q}", f"stages: {words} not measured: "
                                      f"{dim.word(order[k])} already ran slower than {dim.word(frm[i])} at "
                                      f"{pair_label(frm)}'s other settings ({ips:,.0f} against {top_ips:,.0f} "
                                      f"imgs/s), and the order ranks {words} below it")
                        break
                    k += step
        return None

    # ---- 7. smaller batches -----------------------------------------------------------------------------------------

    def _batches(self, vs: list[TrialView]) -> str | None:
        best = self.best_pair(vs) if self.ceilings else None
        if best is None:
            return None
        if self.once_of(best[0]):
            return None  # a ladder of compiled points is a compile at every batch, and compiled refinement holds it
        pair, top = best
        by_batch: dict[int, float] = {}
        for v in self.ceilings_of(vs, pair):
            b = v.setting("training.batch_size")
            by_batch[b] = max(by_batch.get(b, 0.0), v.imgs_per_s)
        smallest, largest = min(by_batch), max(by_batch)
        choices = self.choices("training.batch_size")
        lower = [b for b in choices if b <= smallest // 2] if by_batch[smallest] >= PLATEAU * top else []
        flag = self.decision(pair)
        if lower:
            return self._want(vs, "ceiling", self.ceiling_overrides(
                pair, max(lower), (True if flag is None else flag) if self.on_gpu else None))
        # CPU ranks start from the baseline's batch (``ceiling_batch``), and a larger one can be faster there too:
        # up the choices while the largest measured is clearly the fastest.
        below = [x for b, x in by_batch.items() if b < largest]
        higher = [b for b in choices if b > largest]
        if self.on_gpu or not higher or by_batch[largest] < top or \
                (below and by_batch[largest] <= max(below) * (1 + self.measure.spread_target)):
            return None
        return self._want(vs, "ceiling", self.ceiling_overrides(pair, min(higher), None))

    # ---- 8. uncertain pipelines -------------------------------------------------------------------------------------

    def _uncertain(self, vs: list[TrialView]) -> str | None:
        ranked = self.ranking(vs)
        if ranked is None or self.budget.left < 2:
            return None
        for pipe in ranked[1]:
            fixed = self.candidate_settings(vs, pipe)
            if self.identity_state(vs, self.identity_of(fixed)) == "untried":
                self.note(f"uncertain:{pipe.family}", f"stages: {self.pipe_name(pipe.family)}'s supply never settled "
                          f"({pipe.point:,.0f} imgs/s, up to {pipe.upper:,.0f}): run end to end as well")
                self.main_enqueue(fixed, {"stage": "candidate", "uncertain": True})
                return "candidate"
        return None

    # ---- 9. refine --------------------------------------------------------------------------------------------------

    def _refine(self, vs: list[TrialView]) -> str | None:
        good = [v for v in feasible(vs) if not v.part]
        if not good:
            return None
        best = max(v.imgs_per_s for v in good)
        identities: dict[tuple, int] = {}
        leaders: dict[tuple, TrialView] = {}
        for v in sorted(good, key=lambda v: -v.imgs_per_s):
            if v.imgs_per_s >= REACH * best:
                identities.setdefault(self.identity(v), 0)
                leaders.setdefault(self.identity(v), v)
        for v in vs:
            if v.stage == "refine" and self.identity(v) in identities:
                identities[self.identity(v)] += 1
        least = min(identities, key=lambda k: identities[k])  # round-robin: the least refined so far
        fixed = dict(least)
        if fixed.get("training.compile"):
            lead = leaders[least]
            graph = table().graph_settings
            fixed.update({k: x for k, x in lead.params.items() if k in graph})
            self.note("graph", "stages: refining a compiled trial holds its batch, accumulation and DDP settings "
                               "(each change is a new compile) and searches its input side")
        self.study.enqueue_trial(fixed, user_attrs={"stage": "refine"}, skip_if_exists=False)
        return "refine"

    def identity(self, v: TrialView) -> tuple:
        return tuple((k, v.params[k]) for k in table().identity if k in self.space and k in v.params)

    # ---- what a draw can reach --------------------------------------------------------------------------------------

    def bound(self, config: dict[str, Any]) -> tuple[float, str] | None:
        """What the stages measured bounds an end-to-end run of ``config`` at (``Measured.bound_of``)."""
        return self.bound_of(views(self.study, self.parts), config)


def evidence(v: TrialView) -> dict[str, Any]:
    """A measurement a cuDNN decision stands on, as the study records it."""
    return {"trial": v.label, "imgs_per_s": v.imgs_per_s, "first_step_s": v.attrs.get("first_step_s"),
            "shapes_new_to_worker": v.attrs.get("shapes_new_to_worker")}


def _value(p: Param, fixed: dict[str, Any], baseline: dict[str, Any], base: dict[str, Any]) -> Any:
    for source in (fixed, baseline):
        if p.path in source and p.contains(source[p.path]):
            value = source[p.path]
            return p.match(value) if p.kind == "categorical" else value
    return p.nearest(get_path(base, p.path))


def shown_settings(overrides: dict[str, Any]) -> dict[str, Any]:
    """A stage measurement's settings as a person reads them: the ones that tell it from the others (its mode, then
    the knobs a stage line shows, ``trainer.knobs.Table.shown``)."""
    return {k: overrides[k] for k in ("training.mode", *table().shown) if k in overrides}
