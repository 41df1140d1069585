"""What the measurements of parts say: the ceiling at each point of the grid the model alone is measured over, each
input pipeline's supply (measured, or for hybrid derived from its ends), which points are still live (a precision
that diverged end to end is not), and the bound all this puts on an end-to-end configuration.

The bound: a pipeline that decodes on the CPU and the model run side by side, so an end-to-end run is at most the
smaller of the two (``min(supply, ceiling)``). A pipeline that decodes on the same GPUs (nvJPEG, the hybrid's GPU
share, DALI's CUDA share) takes the SMs the model needs: per sample, the run then pays the model's time and the
decode's device time (``Pipe.device_s``, the GPUs' busy share while the pipeline fed alone, over its rate). DALI's
hardware JPEG engines are no SMs: NVML's utilization does not count them, so only its CUDA share is charged.

A reading of the trials (``autotune.study.view``) for the stage planner (``autotune.search.stages``, which decides
what to run) and for the evaluator (which does not launch what is bounded below the best): it enqueues nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Any

from autotune import policy
from autotune.policy import Searched
from autotune.search.compile_cache import paid_here
from autotune.space import get_path
from autotune.study.view import OWN_LOADER, Outcome, Stage, TrialView, feasible, measurements, own_loader
from autotune.verdict import NOT_ITS_FAULT
from trainer.compile_costs import Paid
from trainer.config import ConfigError
from trainer.estimate import Interval
from trainer.protocol import Failure

PLATEAU = 0.98
"""A smaller batch keeps the ceiling's pace when it reaches this share of the best: it is then preferred (less
memory, and fewer images per step for the input pipeline to deliver in one go)."""

ENV_RETRIES = 1
"""A measurement that failed for the environment (hang, crash, NCCL, loader) is run again this many times; one that
was interrupted or whose search vanished (``autotune.verdict.NOT_ITS_FAULT``) is always run again: it says nothing
about the measurement."""


def grid() -> tuple[Searched, ...]:
    """The ceiling's grid: the settings the model alone is measured over, each with its measuring order (the
    likeliest fastest first), how its values read and whether one costs once (``trainer.knobs``: ``measured``;
    ``autotune.policy``)."""
    return policy.ceiling_grid()


def supply_knob() -> Searched:
    """The knob the pipelines' supplies are measured along, in its order: decode on the GPU first where there is one
    (it does not compete with the loader workers for cores), then decode to tensors on the CPU, then PIL."""
    return policy.supply()


@dataclass(frozen=True, kw_only=True)
class Pipe:
    """An input pipeline as the supplies measured it."""

    settings: dict[str, Any]
    """``data.decode`` (and ``data.hybrid_cpu_fraction``)."""

    point: float
    """Its supply (imgs/s, all ranks): measured, or for hybrid derived from its ends."""

    upper: float
    """The top of its interval: what it may reach."""

    precise: bool
    """Its interval came within the measurement's precision (a hybrid: both its ends')."""

    device_s: float = 0.0
    """Seconds of the GPUs' time each sample's decode takes (all ranks' samples): their busy share while it fed
    alone, over its rate. 0 for a pipeline that decodes on the CPU, or where the GPUs' utilization is unknown."""

    derived: bool = False
    """Not measured alone: a hybrid's figures derived from its two ends' supplies."""

    @property
    def family(self) -> str:
        return self.settings.get("data.decode", "")

    @property
    def device_share(self) -> float:
        """The GPUs' busy share while it fed alone."""
        return self.device_s * self.point

    def with_model(self, ceiling: float, *, reach: bool = False) -> float:
        """What an end-to-end run of this pipeline can reach beside a model that alone runs ``ceiling``: the smaller
        of the two; for a pipeline that decodes on the GPUs, per sample the model's time plus its decode's.
        ``reach``: with the top of its supply's interval (what it may reach) rather than its figure."""
        time = 1.0 / ceiling + self.device_s if ceiling > 0 else math.inf
        return min(self.upper if reach else self.point, 1.0 / time if time > 0 else math.inf)

    def decode_share(self, ceiling: float) -> float:
        """The share of a sample's time beside the model (``with_model``) that its decode takes on the GPUs."""
        return self.device_s / (1.0 / ceiling + self.device_s) if ceiling > 0 else 0.0


class Measured:
    """The reading for a search's plan (its space, its base config, GPUs or CPU ranks, its measurement protocol),
    over the trials of both studies (``autotune.study.view.views``) given to each method."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.space = plan.space.by_path()
        self.base = plan.probe.to_dict()
        self.on_gpu = bool(plan.entries)
        self.measure = plan.probe.measure

    @property
    def ceilings(self) -> bool:
        return self.plan.measures_ceiling

    @property
    def supplies(self) -> bool:
        """Whether pipelines are measured: the job hands its loader over, and there is real data to read."""
        return self.plan.measures_supply and self.plan.probe.data.kind != "synthetic"

    def choices(self, path: str) -> list[Any]:
        """The values a knob may take here: its choices or range ends, else the base value alone."""
        p = self.space.get(path)
        if p is None:
            return [get_path(self.base, path)]
        return list(p.choices) if p.kind == "categorical" else sorted({p.low, p.high})

    def pairs(self) -> list[tuple]:
        """The ceiling's grid, the likeliest fastest first; every point without a one-off cost (``one_off_s``: eager)
        before any with one."""
        orders = [d.order(self.choices(d.path), self.on_gpu) for d in grid()]
        costly = [i for i, d in enumerate(grid()) if d.one_off_s is not None]
        return sorted(product(*orders), key=lambda p: [orders[i].index(p[i]) for i in costly])

    def plain(self, pair: tuple) -> tuple:
        """``pair`` at the first value of each dimension with a one-off cost: eager for compiled."""
        return tuple(d.order(self.choices(d.path), self.on_gpu)[0] if d.one_off_s is not None else x
                     for d, x in zip(grid(), pair, strict=True))

    def without_one_off(self, vs: list[TrialView], pair: tuple) -> tuple:
        """``plain(pair)`` where that point is measured; else ``pair``."""
        plain = self.plain(pair)
        return plain if self.pair_ceiling(vs, plain) is not None else pair

    def paid_here(self, dim: Searched, overrides: dict[str, Any]) -> list[Paid]:
        """What this machine paid before for the one-off cost of a measurement with ``overrides`` at a value of
        ``dim`` (a compile of its graph: ``autotune.search.compile_cache``); nothing for a dimension without one."""
        if dim.one_off_cached_share is None or self.plan.base is None:
            return []
        classes = self.plan.data.classes if self.plan.data else None
        try:
            cfg = self.plan.base.with_overrides(overrides)
        except ConfigError:  # the measurement itself will say so
            return []
        return paid_here(cfg, classes, self.plan.world)

    def pipe_name(self, decode: str) -> str:
        """How a pipeline reads in lines: its decode path, or a script's own loader (``view.own_loader``)."""
        return OWN_LOADER if own_loader(self.base) else decode

    def decodes(self) -> list[str]:
        """Pipelines measured alone, in measuring order; hybrid only where its two ends are not both measured (its
        shares decode side by side, so its supply follows from theirs)."""
        supply = supply_knob()
        decodes = supply.order(self.choices(supply.path), self.on_gpu)
        if "hybrid" in decodes and {"torchvision-cpu", "nvjpeg-gpu"} <= set(decodes):
            decodes.remove("hybrid")
        return decodes

    def status(self, vs: list[TrialView], stage_name: Stage, key: tuple) -> str | None:
        """``pending`` (waiting or running), ``done`` (measured, or failed for its configuration), ``given_up``
        (failed for the environment more than ``ENV_RETRIES`` times), ``retry``, or None (never asked)."""
        mine = [v for v in vs if v.stage == stage_name
                and self.request_key(stage_name, v.attrs.get("overrides") or {}) == key]
        if any(v.outcome in (Outcome.RUNNING, Outcome.WAITING) for v in mine):
            return "pending"
        if any(v.outcome in (Outcome.PART, Outcome.INFEASIBLE, Outcome.MEASURED) for v in mine):
            return "done"
        env = [v for v in mine if v.failure_class not in NOT_ITS_FAULT]
        if len(env) > ENV_RETRIES:
            return "given_up"
        return "retry" if mine else None

    def request_key(self, stage_name: Stage, o: dict[str, Any]) -> tuple:
        """What makes two requests the same measurement: a pipeline (whatever batch it was fed at), or a point of
        the ceiling's grid at a batch, with or without cuDNN's search. A point a request leaves out is the base's
        (a study's earlier requests may predate a dimension)."""
        if stage_name == Stage.SUPPLY:
            return (o.get("data.decode", get_path(self.base, "data.decode")), o.get("data.hybrid_cpu_fraction"))
        if stage_name == Stage.IMAGE_LOADER:  # a pipeline on a folder
            return (o.get("data.decode"), o.get("data.path"))
        return (*(o.get(d.path, get_path(self.base, d.path)) for d in grid()), o.get("training.batch_size"),
                o.get("training.cudnn_benchmark"))

    def top_batch(self) -> int:
        return max(self.choices("training.batch_size"))

    def ceiling_batch(self) -> int:
        """The batch the model alone is first measured at, per point of the grid: on GPUs the largest (a smaller
        batch is not faster there); on CPU ranks, where a small batch stays in the caches and can run faster per
        image, the baseline's, so the ceiling bounds the configuration the search starts from and the candidates
        run at it (the smaller batches follow, ``autotune.search.stages._limits.Limits.batches``)."""
        own = self.plan.baseline.get("training.batch_size")
        if self.on_gpu or own is None or own not in self.choices("training.batch_size"):
            return self.top_batch()
        return own

    def pair_of(self, v: TrialView) -> tuple:
        return point_of(v)

    def ceilings_of(self, vs: list[TrialView], pair: tuple) -> list[TrialView]:
        return [v for v in vs if v.stage == Stage.CEILING and v.outcome == Outcome.PART and v.imgs_per_s is not None
                and self.pair_of(v) == pair]

    def pair_state(self, vs: list[TrialView], pair: tuple) -> tuple[str | None, dict[str, Any] | None]:
        """(``measured``, ``pending``, ``impossible`` (failed at the smallest batch it was tried: its repairs ran
        out), ``retry`` with the request to run again, or None (never asked); the request)."""
        if self.ceilings_of(vs, pair):
            return "measured", None
        mine = [v for v in vs if v.stage == Stage.CEILING and self.pair_of(v) == pair]
        if not mine:
            return None, None
        if any(v.outcome in (Outcome.RUNNING, Outcome.WAITING) for v in mine):
            return "pending", None
        last = min(mine, key=lambda v: v.setting("training.batch_size") or 0)
        request = last.attrs.get("overrides") or {}
        status = self.status(vs, Stage.CEILING, self.request_key(Stage.CEILING, request))
        return ("retry", request) if status == "retry" else ("impossible", None)

    def pair_ceiling(self, vs: list[TrialView], pair: tuple) -> float | None:
        found = self.pair_interval(vs, pair)
        return found.value if found is not None else None

    def pair_interval(self, vs: list[TrialView], pair: tuple) -> Interval | None:
        """The fastest measurement of the model alone at ``pair``, with its interval."""
        best = max(self.ceilings_of(vs, pair), key=lambda v: v.imgs_per_s, default=None)
        return best.interval if best is not None else None

    def live_pairs(self, vs: list[TrialView]) -> list[tuple[tuple, float]]:
        """Measured pairs whose end-to-end trials have not all diverged, fastest first."""
        out = [(p, self.pair_ceiling(vs, p)) for p in self.pairs()]
        return sorted([(p, c) for p, c in out if c is not None and not self.pair_dead(vs, p)], key=lambda x: -x[1])

    def tied_pairs(self, vs: list[TrialView]) -> list[tuple[tuple, float]]:
        """Live pairs whose ceiling's interval overlaps the fastest one's: measured, they cannot be told apart."""
        live = self.live_pairs(vs)
        if not live:
            return []
        top = self.pair_interval(vs, live[0][0])
        return [(p, c) for p, c in live if self.pair_interval(vs, p).ties(top)]

    def best_pair(self, vs: list[TrialView]) -> tuple[tuple, float] | None:
        """The pair the stages go on from: the fastest live ceiling; among pairs tied with it, the one whose
        end-to-end trials did best (an end-to-end run is the stronger measurement: channels_last tied on CPU ranks
        and ran at half the pace end to end)."""
        tied = self.tied_pairs(vs)
        if not tied:
            return None
        return max(tied, key=lambda pc: (self.pair_best_e2e(vs, pc[0]), pc[1]))

    def pair_best_e2e(self, vs: list[TrialView], pair: tuple) -> float:
        return max((v.imgs_per_s for v in feasible(vs) if not v.baseline and self.pair_of(v) == pair),
                   default=-math.inf)

    def pair_dead(self, vs: list[TrialView], pair: tuple) -> bool:
        """Whether a value of ``pair`` does not train this model, whatever its speed (``untrainable``)."""
        return point_dead(untrainable(vs), pair)

    def ceiling_choice(self, vs: list[TrialView], pair: tuple | None = None) -> dict[str, Any] | None:
        """The ceiling's settings for ``pair`` (default: the fastest live one): its precision and layout, at the
        smallest batch that keeps PLATEAU of its pace."""
        if pair is None:
            best = self.best_pair(vs)
            if best is None:
                return None
            pair = best[0]
        mine = self.ceilings_of(vs, pair)
        if not mine:
            return None
        top = max(v.imgs_per_s for v in mine)
        chosen = min((v for v in mine if v.imgs_per_s >= PLATEAU * top), key=lambda v: v.setting("training.batch_size"))
        return {**dict(zip((d.path for d in grid()), pair, strict=True)),
                "training.batch_size": chosen.setting("training.batch_size"), "imgs_per_s": top}

    def pipes(self, vs: list[TrialView]) -> list[Pipe]:
        """Every pipeline with a supply: measured, or hybrid at each of the space's shares derived from its two ends
        (``derived``)."""
        measured = measured_pipes(vs)
        fractions = self.choices("data.hybrid_cpu_fraction") if "hybrid" in self.choices("data.decode") else []
        for f in fractions:
            if ("hybrid", f) not in measured and f is not None:
                made = derived(measured, f)
                if made is not None:
                    measured[("hybrid", f)] = made
        return list(measured.values())

    def pipe_of(self, vs: list[TrialView], config: dict[str, Any]) -> Pipe | None:
        """The pipeline ``config`` runs, as the supplies measured it (None: not measured)."""
        decode = get_path(config, "data.decode")
        fraction = get_path(config, "data.hybrid_cpu_fraction") if decode == "hybrid" else None
        return next((p for p in self.pipes(vs) if p.family == decode
                     and p.settings.get("data.hybrid_cpu_fraction") == fraction), None)

    def supply_of(self, vs: list[TrialView], decode: str, fraction: float | None) -> float | None:
        """imgs/s the pipeline can feed (all ranks), measured or derived; None when unknown."""
        for p in self.pipes(vs):
            if p.family == decode and (decode != "hybrid" or p.settings.get("data.hybrid_cpu_fraction") == fraction):
                return p.point
        return None

    def bound_of(self, vs: list[TrialView], config: dict[str, Any]) -> tuple[float, str] | None:
        """The most an end-to-end run of ``config`` can reach by what the stages measured (the top of the bounding
        measurement's interval), and why; None when they measured nothing that bounds it. Its ceiling: the pace of
        its precision and layout at the smallest measured batch not below its images per step (on GPUs a smaller
        batch is not faster; on CPU ranks it can be, so only a measurement at its images per step bounds it); its
        supply: what its pipeline fed, with the most loader workers."""
        out: list[tuple[float, str]] = []
        pair = tuple(get_path(config, d.path) for d in grid())
        per_step = int(get_path(config, "training.batch_size")) * int(get_path(config, "training.accum_steps") or 1)
        above = [v for v in self.ceilings_of(vs, pair) if v.setting("training.batch_size") >= per_step
                 and (self.on_gpu or v.setting("training.batch_size") == per_step)]
        pipe = self.pipe_of(vs, config) if self.supplies else None
        if above:
            b = min(v.setting("training.batch_size") for v in above)
            top = max((v for v in above if v.setting("training.batch_size") == b), key=lambda v: v.imgs_per_s)
            if not self.refuted(vs, pair, b, top.interval):
                out.append((top.interval.high, f"the model alone at {pair_label(pair)} batch {b} runs "
                                               f"{top.imgs_per_s:,.0f} imgs/s (at most {top.interval.high:,.0f})"))
                if pipe is not None and pipe.device_s:  # the GPUs' time per sample, the model's and the decode's
                    joint = 1.0 / (1.0 / top.interval.high + pipe.device_s)
                    out.append((joint, f"beside the model at {pair_label(pair)} batch {b} "
                                       f"({top.imgs_per_s:,.0f} imgs/s alone), {self.pipe_name(pipe.family)}'s decode "
                                       f"on the GPUs takes {pipe.decode_share(top.imgs_per_s):.0%} of each sample's "
                                       f"time: at most {joint:,.0f} imgs/s"))
        if pipe is not None:
            out.append((pipe.upper, f"{self.pipe_name(pipe.family)} feeds {pipe.point:,.0f} imgs/s (at most "
                                    f"{pipe.upper:,.0f})"))
        return min(out, default=None)

    def refuted(self, vs: list[TrialView], pair: tuple, batch: int, ceiling: Interval) -> bool:
        """Whether an end-to-end run at ``pair`` and ``batch`` images per step measured above the ceiling there
        (its interval above the ceiling's): the model alone is then no bound at that point (its synthetic replay
        costs what the job does not), and pruning against it would drop what runs faster."""
        return any(ceiling.below(v.interval) for v in feasible(vs)
                   if not v.part and self.pair_of(v) == pair
                   and v.setting("training.batch_size") * (v.setting("training.accum_steps") or 1) == batch)


def ceiling_share(run: Interval, ceiling: Interval) -> float | None:
    """A run's figure as a share of the ceiling, or None where the ceiling did not bound it: the run's interval
    lies above the ceiling's (on CPU ranks a small batch can run faster per image than the one the model alone ran
    at). A run inside the ceiling's noise is a share of it, even a share a little above one."""
    if not ceiling.value or ceiling.below(run):
        return None
    return run.value / ceiling.value


def measured_pipes(vs: list[TrialView]) -> dict[tuple, Pipe]:
    """Each pipeline's supply measurement as a ``Pipe``, the fastest where one ran more than once, by (decode,
    hybrid share)."""
    measured: dict[tuple, Pipe] = {}
    for v in vs:
        if v.stage != Stage.SUPPLY or v.outcome != Outcome.PART or v.imgs_per_s is None:
            continue
        decode = v.setting("data.decode")
        fraction = v.setting("data.hybrid_cpu_fraction") if decode == "hybrid" else None
        pipe = Pipe(settings={"data.decode": decode, **({"data.hybrid_cpu_fraction": fraction}
                                                       if fraction is not None else {})},
                    point=v.imgs_per_s, upper=v.interval.high, precise=v.precise is not False,
                    device_s=device_seconds(v))
        key = (decode, fraction)
        if key not in measured or pipe.point > measured[key].point:
            measured[key] = pipe
    return measured


def derived(measured: dict[tuple, Pipe], f: float) -> Pipe | None:
    """The hybrid at CPU share ``f`` from its two ends' supplies (None without both): its CPU and GPU shares decode
    at once, each at its own rate, so a batch takes the longer of the two; its GPU share decodes (1 - f) of every
    batch on the device, at nvJPEG's device time per sample."""
    cpu, gpu = measured.get(("torchvision-cpu", None)), measured.get(("nvjpeg-gpu", None))
    if cpu is None or gpu is None:
        return None

    def mix(a: float, b: float) -> float:
        return 1.0 / max(f / a, (1.0 - f) / b)

    return Pipe(settings={"data.decode": "hybrid", "data.hybrid_cpu_fraction": f}, point=mix(cpu.point, gpu.point),
                upper=mix(cpu.upper, gpu.upper), precise=cpu.precise and gpu.precise, device_s=(1 - f) * gpu.device_s,
                derived=True)


def pipe_for(vs: list[TrialView], decode: str, fraction: float | None) -> Pipe | None:
    """The pipeline (``decode``, hybrid share ``fraction``) as the supplies measured it, or derived (a hybrid)."""
    measured = measured_pipes(vs)
    found = measured.get((decode, fraction if decode == "hybrid" else None))
    return found or (derived(measured, fraction) if decode == "hybrid" and fraction is not None else None)


def device_seconds(v: TrialView) -> float:
    """A supply measurement's seconds of the GPUs' time per sample: their busy share while it fed alone (NVML,
    inside its windows) over its rate, for a pipeline that decodes on the GPUs (``trainer.knobs``: the decode
    choices that need one); 0 otherwise, or where the utilization is unknown (no NVML, the CPU)."""
    decode = v.setting("data.decode")
    if v.util is None or not v.imgs_per_s or decode not in supply_knob().gpu_values:
        return 0.0
    return (v.util / 100.0) / v.imgs_per_s


def untrainable(vs: list[TrialView]) -> set[tuple[str, Any]]:
    """(path, value) of each value of a dimension that decides training (``Policy.trains``: the precision) whose
    end-to-end trials diverged — the loss left the finite numbers — while none at that value trained."""
    out = set()
    for dim in grid():
        if not dim.trains:
            continue
        by_value: dict[Any, list[TrialView]] = {}
        for v in vs:
            if v.end_to_end and not v.baseline:
                by_value.setdefault(v.setting(dim.path), []).append(v)
        for value, e2e in by_value.items():
            alive = any(v.outcome in (Outcome.MEASURED, Outcome.PRUNED, Outcome.RUNNING, Outcome.WAITING) for v in e2e)
            if not alive and any(v.failure_class == str(Failure.DIVERGED) for v in e2e):
                out.add((dim.path, value))
    return out


def point_dead(dead: set[tuple[str, Any]], pair: tuple) -> bool:
    return any((d.path, x) in dead for d, x in zip(grid(), pair, strict=True))


def point_of(v: TrialView) -> tuple:
    """A trial's point of the ceiling's grid."""
    return tuple(v.setting(d.path) for d in grid())


def trainable_ceiling(vs: list[TrialView]) -> TrialView | None:
    """The fastest measurement of the model alone at a point that trains it: what a tuned run can approach (a
    precision whose end-to-end runs all diverged is fast on synthetic data and reaches nothing)."""
    dead = untrainable(vs)
    return max((v for v in measurements(vs, Stage.CEILING) if not point_dead(dead, point_of(v))),
               key=lambda v: v.imgs_per_s, default=None)


def pair_label(pair: tuple) -> str:
    """A point of the ceiling's grid as a person reads it: ``fp16 channels_last``, ``fp32 NCHW compiled``."""
    return " ".join(d.value_label(v) for d, v in zip(grid(), pair, strict=True)
                    if not d.is_omitted(v))


