"""What the measurements of parts say, read from a study's trials (``autotune.study.view``) and nothing else: the
points of the grid the model alone is measured over (``Point``), each input pipeline's supply (``Pipe``: measured, or
for hybrid derived from its ends), which values do not train the model, the fastest ceiling that trains it, and
cuDNN's decisions as the search recorded them. ``show``, the report and the search all read them here; the search
adds what it decides from them (``autotune.search.bounds``).

The bound: a pipeline that decodes on the CPU and the model run side by side, so an end-to-end run is at most the
smaller of the two (``min(supply, ceiling)``). A pipeline that decodes on the same GPUs (nvJPEG, the hybrid's GPU
share, DALI's CUDA share) takes the SMs the model needs: per sample, the run then pays the model's time and the
decode's device time (``Pipe.device_s``, the GPUs' busy share while the pipeline fed alone, over its rate). DALI's
hardware JPEG engines are no SMs: NVML's utilization does not count them, so only its CUDA share is charged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autotune import policy
from autotune.policy import Searched
from autotune.space import get_path
from autotune.study.view import Outcome, Stage, TrialView, measurements
from trainer.estimate import Interval
from trainer.profile import largest
from trainer.protocol import Failure

CUDNN_ATTR = "cudnn"
"""The study's user attr holding cuDNN's decisions: one entry per point of the grid, keyed by the point's settings
(``settings``); a study made before that keys each by the point's label, and reads the same."""


def grid() -> tuple[Searched, ...]:
    """The ceiling's grid: the settings the model alone is measured over, each with its measuring order (the
    likeliest fastest first), how its values read and whether one costs once (``trainer.knobs``: ``measured``;
    ``autotune.policy``)."""
    return policy.ceiling_grid()


def supply_knob() -> Searched:
    """The knob the pipelines' supplies are measured along, in its order: decode on the GPU first where there is one
    (it does not compete with the loader workers for cores), then decode to tensors on the CPU, then PIL."""
    return policy.supply()


DATA_WAIT_SAID = 0.1
"""A step that waits at least this share of its measured time for data is held back by its input side: a loader
that keeps up has the next batch ready when the step asks, and the step waits for little more than its hand-over."""


def waits(v: TrialView) -> bool | None:
    """Whether the trial's step waited for data (``DATA_WAIT_SAID``); None where its run did not time the waits."""
    share = v.attrs.get("data_wait_share")
    return None if share is None else share >= DATA_WAIT_SAID


CPU_FULL = 0.9
"""The trial's cores busy at least this share of its measured time (``autotune.hw.cpu``) are full: a step that waits
for data there gets no faster from more loader workers, which would take cores from the rank's own process."""


def cores_full(v: TrialView) -> bool | None:
    """Whether the trial's cores were full while it was measured (``CPU_FULL``); None where nobody read them."""
    busy = v.attrs.get("cpu_busy")
    return None if busy is None else busy >= CPU_FULL


def data_fix(v: TrialView) -> str:
    """What addresses a step that waits for data, as far as its run's cores say: fewer loader workers where they
    were full, more where they had room, either where nobody read them; or a pipeline that decodes less on the CPU."""
    busy, full = v.attrs.get("cpu_busy"), cores_full(v)
    if full is None:
        return STEP_PARTS["data"].fix
    if full:
        return (f"fewer loader workers (its cores were {100 * busy:.0f} % busy: more workers would crowd the rank's "
                "own process), or a pipeline that decodes less on the CPU")
    return (f"more loader workers or batches in flight (its cores were {100 * busy:.0f} % busy: they have room), or "
            "a pipeline that decodes less on the CPU")


UNEXPLAINED = 0.8
"""A tuned configuration below this share of the bound its parts put on it is not explained by them: said so, no
limit named from the parts, and its step profiled once (``autotune.search.stages._profile``)."""


@dataclass(frozen=True)
class StepPart:
    """A part of the step, as a profile splits it (``trainer.profile.PARTS``): how it is said, what addresses it, and
    where the climb starts when it is the largest."""

    name: str
    """The part in a few words."""

    said: str
    """What the step does that long, after "its step ..." ("waits {share} of its time for data")."""

    fix: str
    """The knobs that address it, in words."""

    limit: str
    """The knobs' scopes the climb takes first (``autotune.search.stages._climb.Limit``)."""

    knobs: tuple[str, ...]
    """The knobs the climb moves before any other, in this order (a section, ``ddp.``, names each knob of it, in the
    knob table's order)."""

    def rank(self, path: str) -> int:
        """Where the knob ``path`` comes among ``knobs`` (their number where it is none of them)."""
        return next((i for i, k in enumerate(self.knobs) if path == k or (k.endswith(".") and path.startswith(k))),
                    len(self.knobs))


STEP_PARTS: dict[str, StepPart] = {
    "data": StepPart("waiting for data", "waits {share} of its time for data",
                     "more loader workers where the CPU has cores to spare, fewer where they crowd the rank's own "
                     "process, more batches in flight, or a pipeline that decodes less on the CPU",
                     "input", ("loader.num_workers", "loader.prefetch_factor", "data.hybrid_cpu_fraction")),
    "copy": StepPart("the host-to-device copy", "copies its batches to the GPUs {share} of its time",
                     "pinned host memory (loader.pin_memory) and more batches in flight",
                     "input", ("loader.pin_memory", "loader.prefetch_factor")),
    "compute": StepPart("forward and backward", "spends {share} of its time in forward and backward",
                        "the batch, the memory layout (channels_last) and the precision",
                        "compute", ("training.batch_size", "training.channels_last")),
    "optimizer": StepPart("the optimizer", "spends {share} of its time in the optimizer's step",
                          "a larger batch or more accumulation (fewer optimizer steps per sample)",
                          "compute", ("training.batch_size", "training.accum_steps")),
    "communication": StepPart("DDP's communication", "waits {share} of its time for DDP's communication",
                              "DDP's gradient buckets and flags (ddp.*), or more accumulation (fewer all-reduces per "
                              "sample)", "compute", ("ddp.", "training.accum_steps")),
    "launch": StepPart("the host's launch gaps",
                       "leaves the GPUs idle {share} of its time between the host's kernel launches",
                       "a larger batch or more accumulation (fewer launches per sample), or torch.compile",
                       "launch", ("training.batch_size", "training.accum_steps")),
}
"""Each part of a profiled step (``trainer.profile.PARTS``, in its order): the one table ``show``, the report and the
climb read what a part means and what addresses it from."""


def profiled(vs: list[TrialView]) -> TrialView | None:
    """The latest end-to-end trial whose run profiled its step (``step_split``)."""
    return max((v for v in vs if not v.part and v.attrs.get("step_split")), key=lambda v: v.number, default=None)


def largest_cost(v: TrialView | None) -> tuple[str, float] | None:
    """What ``v``'s profiled step spends most on beyond the model's own forward and backward, and its share: the
    cost a knob can take away. Forward and backward are the cost only where every other part is below
    ``DATA_WAIT_SAID`` (the step is its own work): the model's compute was measured alone already (the ceiling), and
    a step that reaches well below it is held back by what lies around it, however large its compute's share. None
    where ``v`` has no profile."""
    split = v.attrs.get("step_split") if v is not None else None
    top = largest(split)
    if top is None:
        return None
    around = largest({p: x for p, x in split.items() if p != "compute"})
    return around if around is not None and around[1] >= DATA_WAIT_SAID else top


@dataclass(frozen=True)
class Point:
    """A point of the ceiling's grid: one value of each of its dimensions (``grid()``), in the grid's order."""

    values: tuple[Any, ...]

    @classmethod
    def of(cls, v: TrialView) -> Point:
        """A trial's point."""
        return cls(tuple(v.setting(d.path) for d in grid()))

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> Point:
        """A config's point (a nested or a flat dict)."""
        return cls(tuple(get_path(config, d.path) for d in grid()))

    @classmethod
    def of_settings(cls, settings: dict[str, Any]) -> Point:
        """The point ``settings`` (path: value, as ``settings`` writes them) name."""
        return cls(tuple(settings.get(d.path) for d in grid()))

    def __getitem__(self, i: int) -> Any:
        return self.values[i]

    def at(self, i: int, value: Any) -> Point:
        """This point with dimension ``i`` at ``value``."""
        return Point((*self.values[:i], value, *self.values[i + 1:]))

    @property
    def settings(self) -> dict[str, Any]:
        """The point as settings (path: value)."""
        return dict(zip((d.path for d in grid()), self.values, strict=True))

    @property
    def label(self) -> str:
        """The point as a person reads it: ``fp16 channels_last``, ``fp32 NCHW compiled``."""
        return " ".join(d.value_label(v) for d, v in zip(grid(), self.values, strict=True) if not d.is_omitted(v))


@dataclass(frozen=True, kw_only=True)
class Pipe:
    """An input pipeline as the supplies measured it."""

    settings: dict[str, Any]
    """``data.decode`` (and ``data.hybrid_cpu_fraction``)."""

    point: float
    """Its supply (the job's unit per second, all ranks): measured, or for hybrid derived from its ends."""

    upper: float
    """The top of its interval: what it may reach."""

    precise: bool
    """Its interval came within the measurement's precision (a hybrid: both its ends')."""

    device_s: float = 0.0
    """Seconds of the GPUs' time each sample's decode takes (all ranks' samples): their busy share while it fed
    alone, over its rate. 0 for a pipeline that decodes on the CPU, or where the GPUs' utilization is unknown."""

    derived: bool = False
    """Not measured alone: a hybrid's figures derived from its two ends' supplies."""

    cpu_s: float = 0.0
    """Seconds of the loader workers' time per sample, all of them together at the count it fed with alone: its
    rate's inverse for a pipeline that decodes on the CPU, its CPU share's for a hybrid; 0 where the workers only
    read the files (a decode on the GPUs)."""

    rest_s: float = 0.0
    """Seconds per sample of what else bounds its supply alone (a hybrid's GPU share; for a hybrid measured alone,
    its own rate, since how it splits is not known); 0 where its CPU part alone does."""

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

    def with_cores(self, share: float) -> Pipe:
        """What it feeds where its CPU part has ``share`` of the cores it had alone (end to end the rank's own
        processes take some): its CPU part's rate scales with them; a decode on the GPUs is not slowed."""
        if not self.cpu_s or share >= 1.0:
            return self
        scale = 1.0 / max(self.cpu_s / share, self.rest_s) / self.point
        return dataclasses.replace(self, point=self.point * scale, upper=self.upper * scale)

    def decode_share(self, ceiling: float) -> float:
        """The share of a sample's time beside the model (``with_model``) that its decode takes on the GPUs."""
        return self.device_s / (1.0 / ceiling + self.device_s) if ceiling > 0 else 0.0


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
        on_cpu = 1.0 if decode not in supply_knob().gpu_values else fraction or 0.0
        pipe = Pipe(settings={"data.decode": decode, **({"data.hybrid_cpu_fraction": fraction}
                                                       if fraction is not None else {})},
                    point=v.imgs_per_s, upper=v.interval.high, precise=v.precise is not False,
                    device_s=device_seconds(v), cpu_s=on_cpu / v.imgs_per_s,
                    rest_s=1.0 / v.imgs_per_s if 0.0 < on_cpu < 1.0 else 0.0)
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
                derived=True, cpu_s=f / cpu.point, rest_s=(1.0 - f) / gpu.point)


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


def point_dead(dead: set[tuple[str, Any]], point: Point) -> bool:
    """Whether a value of ``point`` is among ``dead`` (``untrainable``)."""
    return any((d.path, x) in dead for d, x in zip(grid(), point.values, strict=True))


def trainable_ceiling(vs: list[TrialView]) -> TrialView | None:
    """The fastest measurement of the model alone at a point that trains it: what a tuned run can approach (a
    precision whose end-to-end runs all diverged is fast on synthetic data and reaches nothing)."""
    dead = untrainable(vs)
    return max((v for v in measurements(vs, Stage.CEILING) if not point_dead(dead, Point.of(v))),
               key=lambda v: v.imgs_per_s, default=None)


def cudnn_entries(attrs: dict[str, Any]) -> list[tuple[str, Point | None, dict[str, Any]]]:
    """cuDNN's decisions as a study's user attrs (``attrs``) record them (``CUDNN_ATTR``): (the point's label, the
    point (None where a study made before keys by the label alone), the decision: ``benchmark``, ``batch`` and the
    two measurements it stands on)."""
    stored = attrs.get(CUDNN_ATTR) or []
    if isinstance(stored, dict):  # keyed by the point's label
        return [(label, None, dict(d)) for label, d in stored.items()]
    out = []
    for e in stored:
        point = Point.of_settings(e.get("settings") or {})
        out.append((point.label, point, {k: x for k, x in e.items() if k != "settings"}))
    return out


def cudnn_decided(study) -> dict[str, dict[str, Any]]:
    """cuDNN's decisions by the label of their point (precision and layout), as a reader names them."""
    return {label: d for label, _, d in cudnn_entries(study.user_attrs)}


def cudnn_by_point(attrs: dict[str, Any], points: list[Point]) -> dict[Point, dict[str, Any]]:
    """cuDNN's decisions by point; one keyed by a label (an older study) goes to the point of ``points`` it names."""
    labels = {p.label: p for p in points}
    out = {}
    for label, point, d in cudnn_entries(attrs):
        point = point or labels.get(label)
        if point is not None:
            out[point] = d
    return out


def cudnn_record(decisions: dict[Point, dict[str, Any]]) -> list[dict[str, Any]]:
    """``decisions`` as the study stores them (``CUDNN_ATTR``)."""
    return [{"settings": p.settings, **d} for p, d in decisions.items()]
