"""The stages of a search: measure the bottleneck before searching.

A trainer is as fast as the slower of two things: what the GPUs can compute (the *ceiling*) and what the input
pipeline can feed them (its *supply*). Both are cheap to measure on their own, and together they say where to look:

1. **ceiling** — the model alone, on synthetic data made on the devices, for each precision and layout in the space
   at the largest batch (lower on an OOM), then at smaller batches for the fastest pair while it keeps its pace. On a
   GPU the first of these runs twice, with and without cuDNN's per-shape algorithm search, and the search keeps the
   search off for every later trial when it buys nothing (it makes a trial's first step seconds long).
2. **supply** — each input pipeline alone (``training.mode: loader``, no model) at the ceiling's batch with the most
   loader workers. A hybrid pipeline decodes its two shares side by side, so its supply follows from its ends'.
3. **candidates** — end-to-end trials at the ceiling's precision, layout and batch for the pipelines whose supply
   best meets the ceiling (an end-to-end run is at most the smaller of the two); the other knobs at the baseline's
   values.
4. **refine** — the sampler draws everything else (batch, accumulation, loader, DDP, ...) with the pipeline,
   precision and layout of the best end-to-end trials held, round-robin over those within reach of the best.

Every stage trial is a trial of the study (dashboard, report, resume and many workers work as for any trial). The
measurements of stages 1 and 2 carry their settings in ``user_attrs["overrides"]`` and no Optuna parameters, so the
sampler learns nothing from them about end-to-end settings (``autotune.study.view``).
"""

from __future__ import annotations

from typing import Any

from optuna.trial import TrialState

from autotune.space import Param, get_path
from autotune.study.view import TrialView, ceiling, feasible, stage, supplies

PLATEAU = 0.98
"""A smaller batch keeps the ceiling's pace when it reaches this share of the best: it is then preferred (less
memory, and fewer images per step for the input pipeline to deliver in one go)."""

CUDNN_KEEP = 0.99
"""cuDNN's algorithm search stays on only when it is worth more than 1 % of the steady pace."""

REACH = 0.90
"""Candidates and refinement cover what is within this share of the best bound / the best trial."""

END_TO_END_RESERVE = 2
"""End-to-end trials a search's budget keeps for after the measurements of parts (or all it has, if fewer)."""

SUPPLY_MAX_WINDOWS = 5
"""Windows of a supply measurement at most (a loader alone delivers in bursts: its windows rarely agree)."""

IDENTITY = ("data.decode", "data.hybrid_cpu_fraction", "training.precision", "training.channels_last")
"""What the refine stage holds of a good end-to-end trial: its pipeline, precision and layout."""

SHOWN = ("training.mode", "data.decode", "data.hybrid_cpu_fraction", "training.precision", "training.channels_last",
         "training.batch_size", "loader.num_workers", "training.cudnn_benchmark")
"""What tells one stage measurement from another (the rest of its settings are the same for all)."""

CEILING_FIXED = {"data.kind": "synthetic", "training.accum_steps": 1, "loader.num_workers": 0,
                 "loader.prefetch_factor": None, "loader.persistent_workers": False}


class StagePlanner:
    """Decides, before each trial is asked for, what the stages want run next, and enqueues it."""

    def __init__(self, plan, study):
        self.plan, self.study = plan, study
        self.space = plan.space.by_path()
        self.base = plan.probe.to_dict()
        self.on_gpu = bool(plan.entries)
        self.left: int | None = None

    def enqueue_next(self, left: int | None = None) -> str | None:
        """Enqueue the next stage trial(s) unless one is already waiting; returns the stage enqueued (None: the
        sampler draws the next trial freely). ``left``: trials this search still runs, this one included: a
        measurement of a part is started only while it leaves room for end-to-end trials."""
        if not self.plan.spec.stages.enabled:
            return None
        self.left = left
        trials = self.study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials):
            return None
        vs = [TrialView.of(t) for t in trials]
        for step in (self._ceiling, self._supply, self._candidates, self._refine):
            name = step(vs)
            if name:
                return name
        return None

    # ---- what is searched ---------------------------------------------------------------------------------------

    def choices(self, path: str) -> list[Any]:
        """The values a knob may take here: its choices or range ends, else the base value alone."""
        p = self.space.get(path)
        if p is None:
            return [get_path(self.base, path)]
        return list(p.choices) if p.kind == "categorical" else sorted({p.low, p.high})

    def decided(self) -> dict[str, Any]:
        """Settings the stages decided for every later trial (cuDNN's algorithm search)."""
        return dict(self.study.user_attrs.get("decided") or {})

    def affords(self, n: int) -> bool:
        """Whether ``n`` more measurements of parts leave room for end-to-end trials in this search's budget: a
        small budget spent on measurements alone would end where it began, at the baseline."""
        return self.left is None or self.left - n >= min(END_TO_END_RESERVE, self.plan.spec.stages.candidates)

    def _enqueue(self, stage_name: str, *, params: dict[str, Any] | None = None,
                 overrides: dict[str, Any] | None = None) -> None:
        attrs: dict[str, Any] = {"stage": stage_name}
        if overrides is not None:
            attrs["overrides"] = overrides
        self.study.enqueue_trial(params or {}, user_attrs=attrs, skip_if_exists=False)

    # ---- 1. ceiling ---------------------------------------------------------------------------------------------

    def _ceiling(self, vs: list[TrialView]) -> str | None:
        mine = [v for v in vs if v.stage == "ceiling"]
        if any(v.outcome in ("running", "waiting") for v in mine):
            return "ceiling"  # the rest depends on these (another search worker runs them)
        grid = [(p, cl) for p in self.choices("training.precision") for cl in self.choices("training.channels_last")]
        top = max(self.choices("training.batch_size"))
        if not mine:
            if not self.affords(len(grid) + self.on_gpu):
                return None  # too few trials left for the grid: the sampler alone, from the baseline
            first = self._ceiling_overrides(*grid[0], top)
            if self.on_gpu:  # the cuDNN decision: the same measurement with and without the algorithm search
                self._enqueue("ceiling", overrides={**first, "training.cudnn_benchmark": True})
                self._enqueue("ceiling", overrides={**first, "training.cudnn_benchmark": False})
            else:
                self._enqueue("ceiling", overrides=first)
            return "ceiling"
        if self.on_gpu and "decided" not in self.study.user_attrs:
            self._decide_cudnn(mine)
        measured = {(v.setting("training.precision"), v.setting("training.channels_last")) for v in mine}
        todo = [pair for pair in grid if pair not in measured]
        if todo:
            for pair in todo:
                self._enqueue("ceiling", overrides=self._ceiling_overrides(*pair, top))
            return "ceiling"
        return self._ceiling_batches(vs)

    def _ceiling_overrides(self, precision, channels_last, batch) -> dict[str, Any]:
        return {**CEILING_FIXED, **self.decided(), "training.precision": precision,
                "training.channels_last": channels_last, "training.batch_size": batch,
                "data.num_classes": self.plan.data.classes if self.plan.data else None,
                "measure.window_s": min(self.plan.spec.stages.ceiling_window_s, self.plan.probe.measure.window_s)}

    def _decide_cudnn(self, mine: list[TrialView]) -> None:
        """Keep cuDNN's algorithm search only when the measurement with it beat the one without by more than 1 %."""
        pair: dict[bool, TrialView] = {}
        for v in mine:
            setting = (v.attrs.get("overrides") or {}).get("training.cudnn_benchmark")
            if setting is not None and v.outcome == "part" and v.imgs_per_s is not None:
                pair.setdefault(setting, v)
        on, off = pair.get(True), pair.get(False)
        decision = True if on is None or off is None else off.imgs_per_s < CUDNN_KEEP * on.imgs_per_s
        evidence = {k: {"trial": v.number, "imgs_per_s": v.imgs_per_s, "first_step_s": v.attrs.get("first_step_s")}
                    for k, v in (("with_search", on), ("without_search", off)) if v is not None}
        self.study.set_user_attr("decided", {"training.cudnn_benchmark": decision})
        self.study.set_user_attr("cudnn_decision", evidence)

    def _ceiling_batches(self, vs: list[TrialView]) -> str | None:
        """Smaller batches for the fastest precision and layout, halving, while they keep the pace."""
        best = ceiling(vs)
        if best is None:
            return None
        p, cl = best.setting("training.precision"), best.setting("training.channels_last")
        same = [v for v in stage(vs, "ceiling") if (v.setting("training.precision"),
                                                     v.setting("training.channels_last")) == (p, cl)]
        smallest = min(same, key=lambda v: v.setting("training.batch_size"))
        if smallest.imgs_per_s < PLATEAU * best.imgs_per_s:
            return None
        lower = [b for b in self.choices("training.batch_size") if b <= smallest.setting("training.batch_size") // 2]
        tried = {v.setting("training.batch_size") for v in vs if v.stage == "ceiling"
                 and (v.setting("training.precision"), v.setting("training.channels_last")) == (p, cl)}
        if not lower or max(lower) in tried or not self.affords(1):
            return None
        self._enqueue("ceiling", overrides=self._ceiling_overrides(p, cl, max(lower)))
        return "ceiling"

    def ceiling_choice(self, vs: list[TrialView]) -> dict[str, Any] | None:
        """The ceiling's settings for the rest of the search: the fastest precision and layout, at the smallest
        batch that keeps PLATEAU of their pace."""
        best = ceiling(vs)
        if best is None:
            return None
        p, cl = best.setting("training.precision"), best.setting("training.channels_last")
        plateau = [v for v in stage(vs, "ceiling") if (v.setting("training.precision"),
                                                        v.setting("training.channels_last")) == (p, cl)
                   and v.imgs_per_s >= PLATEAU * best.imgs_per_s]
        chosen = min(plateau, key=lambda v: v.setting("training.batch_size"))
        return {"training.precision": p, "training.channels_last": cl,
                "training.batch_size": chosen.setting("training.batch_size"), "imgs_per_s": best.imgs_per_s}

    # ---- 2. supply ------------------------------------------------------------------------------------------------

    def _supply(self, vs: list[TrialView]) -> str | None:
        if self.plan.probe.data.kind == "synthetic":
            return None
        mine = [v for v in vs if v.stage == "supply"]
        if any(v.outcome in ("running", "waiting") for v in mine):
            return "supply"
        decodes = self._measured_decodes()
        n = sum(len(self.choices("data.hybrid_cpu_fraction")) if d == "hybrid" else 1 for d in decodes)
        if mine or not self.affords(n):
            return None
        chosen = self.ceiling_choice(vs) or {}
        batch = chosen.get("training.batch_size", get_path(self.base, "training.batch_size"))
        layout = chosen.get("training.channels_last", get_path(self.base, "training.channels_last"))
        workers = max(self.choices("loader.num_workers"))
        for decode in decodes:
            # A supply ranks pipelines against the ceiling: five bursty windows say enough, eight cost a minute.
            overrides = {"training.mode": "loader", "data.decode": decode, "training.batch_size": batch,
                         "training.channels_last": layout, "loader.num_workers": workers,
                         "loader.persistent_workers": False, "loader.prefetch_factor": None,
                         "measure.max_windows": min(SUPPLY_MAX_WINDOWS, self.plan.probe.measure.max_windows)}
            if decode == "hybrid":  # measured directly only when its two ends are not
                for f in self.choices("data.hybrid_cpu_fraction"):
                    self._enqueue("supply", overrides={**overrides, "data.hybrid_cpu_fraction": f})
            else:
                self._enqueue("supply", overrides=overrides)
        return "supply"

    def _measured_decodes(self) -> list[str]:
        decodes = self.choices("data.decode")
        ends = {"torchvision-cpu", "nvjpeg-gpu"}
        if "hybrid" in decodes and ends <= set(decodes):
            decodes = [d for d in decodes if d != "hybrid"]
        return decodes

    def supply_of(self, vs: list[TrialView], decode: str, fraction: float | None) -> float | None:
        """imgs/s the pipeline can feed (all ranks): measured, or for hybrid, from its ends: its CPU and GPU shares
        decode at once, each at its own rate, so a batch takes the longer of the two."""
        measured = supplies(vs)
        if decode != "hybrid":
            v = measured.get(decode)
            return v.imgs_per_s if v else None
        direct = [v for v in stage(vs, "supply") if v.setting("data.decode") == "hybrid"
                  and v.setting("data.hybrid_cpu_fraction") == fraction]
        if direct:
            return direct[0].imgs_per_s
        cpu, gpu = measured.get("torchvision-cpu"), measured.get("nvjpeg-gpu")
        if cpu is None or gpu is None or fraction is None:
            return None
        return 1.0 / max(fraction / cpu.imgs_per_s, (1.0 - fraction) / gpu.imgs_per_s)

    # ---- 3. candidates ----------------------------------------------------------------------------------------------

    def _candidates(self, vs: list[TrialView]) -> str | None:
        if any(v.stage == "candidate" for v in vs):
            return None
        chosen = self.ceiling_choice(vs)
        if chosen is None:
            return None
        bounds = self.bounds(vs, chosen["imgs_per_s"])
        if not bounds:
            pipelines = [{}]  # synthetic data (or nothing measured): one candidate at the ceiling's settings
        else:
            top = max(b for _, b in bounds)
            ranked = sorted(bounds, key=lambda x: -x[1])
            pipelines = [pipe for pipe, b in ranked if b >= REACH * top][:self.plan.spec.stages.candidates]
        for pipe in pipelines:
            fixed = {k: v for k, v in chosen.items() if k != "imgs_per_s"}
            fixed.update(pipe)
            if "loader.num_workers" in self.space:
                fixed["loader.num_workers"] = max(self.choices("loader.num_workers"))
            if "training.accum_steps" in self.space:
                fixed["training.accum_steps"] = min(self.choices("training.accum_steps"))
            self._enqueue("candidate", params=self.complete(fixed))
        return "candidate"

    def bounds(self, vs: list[TrialView], ceiling_ips: float) -> list[tuple[dict[str, Any], float]]:
        """(pipeline settings, the most an end-to-end run with it can reach) for each pipeline with a supply."""
        out = []
        for decode in self.choices("data.decode") if "data.decode" in self.space else []:
            fractions = self.choices("data.hybrid_cpu_fraction") if decode == "hybrid" else [None]
            for f in fractions:
                supply = self.supply_of(vs, decode, f)
                if supply is not None:
                    pipe = {"data.decode": decode, **({"data.hybrid_cpu_fraction": f} if f is not None else {})}
                    out.append((pipe, min(supply, ceiling_ips)))
        return out

    def complete(self, fixed: dict[str, Any]) -> dict[str, Any]:
        """Optuna params for every active knob: ``fixed`` where given, else the baseline's value (the library
        defaults a tutorial uses), else the base's nearest value."""
        params: dict[str, Any] = {}
        for p in self.plan.space.params:
            if p.when is not None:
                current = params[p.when.path] if p.when.path in params else get_path(self.base, p.when.path)
                if not p.when.holds(current):
                    continue
            params[p.path] = _value(p, fixed, self.plan.baseline, self.base)
        return params

    # ---- 4. refine --------------------------------------------------------------------------------------------------

    def _refine(self, vs: list[TrialView]) -> str | None:
        good = feasible(vs)
        if not good:
            return None
        best = max(v.imgs_per_s for v in good)
        identities: dict[tuple, int] = {}
        for v in sorted(good, key=lambda v: -v.imgs_per_s):
            if v.imgs_per_s >= REACH * best:
                identities.setdefault(self.identity(v), 0)
        for v in vs:
            if v.stage == "refine" and self.identity(v) in identities:
                identities[self.identity(v)] += 1
        least = min(identities, key=lambda k: identities[k])  # round-robin: the least refined so far
        self._enqueue("refine", params=dict(least))
        return "refine"

    def identity(self, v: TrialView) -> tuple:
        return tuple((k, v.params[k]) for k in IDENTITY if k in self.space and k in v.params)


def _value(p: Param, fixed: dict[str, Any], baseline: dict[str, Any], base: dict[str, Any]) -> Any:
    for source in (fixed, baseline):
        if p.path in source and p.contains(source[p.path]):
            value = source[p.path]
            return p.match(value) if p.kind == "categorical" else value
    return p.nearest(get_path(base, p.path))


def shown_settings(overrides: dict[str, Any]) -> dict[str, Any]:
    """A stage measurement's settings as a person reads them: the ones that tell it from the others."""
    return {k: overrides[k] for k in SHOWN if k in overrides}
