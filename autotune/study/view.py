"""One reading of a study's trials for search, show, export and report: what each trial is (its stage), how it ended,
what it measured, and which trials count — feasible, the best, the baseline, the ceiling, the supplies.

A trial's stage (``Stage``) says what it measured, its outcome (``Outcome``) how it ended. ``ceiling`` (the model
on synthetic data), ``supply`` (an input pipeline alone, no model) and ``image_loader`` (the project's pipeline on a
user's script's image folder) are measurements of the parts, not training configurations: they never count as one.
They live in a companion Optuna study of the same storage, ``<study>.parts`` (``parts_name``), so that
everything that reads the main study with Optuna's own tools — optuna-dashboard's best, history and importances,
``optuna best-trial``, the sampler — sees end-to-end trials only. ``views(study)`` merges both, in the order they ran:
a part is labelled ``p<N>`` (its number in the parts study), an end-to-end trial by its number. Every other stage
(``baseline``, ``start``, ``candidate``, ``climb``, ``refine``, ``retry``, ``search``, ``confirm``) is an end-to-end
training run.

(Studies made before the parts study held their stage measurements in the main study; they read the same.)

A configuration run more than once (``confirm``: the search's last trials run its leaders again) counts once
(``configurations``): its figure combines its runs (``combined``), and the best is picked among configurations, not
single runs. Every figure is an estimate with its 95 % interval (``trainer.estimate``): ``TrialView.interval``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.formatting import fmt_interval, per_second
from autotune.study.storage import CONFIG_KEY, parts_name, trial_attrs
from trainer.estimate import Interval
from trainer.knobs import table
from trainer.protocol import Failure, StrEnum


class Stage(StrEnum):
    """What a trial measured: its ``stage`` user attr."""

    BASELINE = "baseline"
    """Trial 0, the configuration the search starts from, or it again in a fresh process."""

    START = "start"
    """A starting point the spec asked for."""

    CANDIDATE = "candidate"
    """An end-to-end trial the measurements of parts call for."""

    REFINE = "refine"
    """A draw of the sampler with the best end-to-end trials' key settings held."""

    CLIMB = "climb"
    """A neighbour of the climb's point: one knob moved one step (``autotune.search.stages._climb``)."""

    RETRY = "retry"
    """A trial's parameters run again (repaired, or after its search vanished), where its attrs name no stage."""

    SEARCH = "search"
    """A draw of the sampler."""

    CONFIRM = "confirm"
    """A leader run once more, where the best's interval overlaps other configurations'."""

    PROFILE = "profile"
    """The best run once more with its step profiled after its windows, where its parts do not explain it
    (``autotune.search.stages._profile``)."""

    CEILING = "ceiling"
    """The model alone on synthetic data."""

    SUPPLY = "supply"
    """An input pipeline alone, no model."""

    IMAGE_LOADER = "image_loader"
    """The project's fastest input pipeline (``run.image_loader``'s) alone on the image folder a user's script reads
    through a loader of its own (``autotune.search.stages._folder``): a figure beside the script's own supply, never
    a pipeline its trials run."""

    @property
    def measures_part(self) -> bool:
        """A measurement of a part of the job (``MEASUREMENT_STAGES``), not an end-to-end configuration."""
        return self in MEASUREMENT_STAGES


MEASUREMENT_STAGES = frozenset({Stage.CEILING, Stage.SUPPLY, Stage.IMAGE_LOADER})
"""Stages that measure a part of the job (not an end-to-end configuration): trials of the parts study."""


class Outcome(StrEnum):
    """How a trial ended, as a reader sorts it (``TrialView.outcome``)."""

    MEASURED = "measured"
    """A complete end-to-end trial."""

    PART = "part"
    """A complete stage measurement."""

    INFEASIBLE = "infeasible"
    """The configuration failed (OOM, invalid, diverged)."""

    FAIL = "fail"
    """The environment failed."""

    PRUNED = "pruned"
    RUNNING = "running"
    WAITING = "waiting"

    @classmethod
    def ended(cls, failure: Failure | str | None, *, pruned: bool = False, part: bool = False) -> Outcome:
        """How a run ends, as the search tells the study: ``pruned``, else by its failure class (None: success; a
        ``part``: a measurement of a part)."""
        if pruned:
            return cls.PRUNED
        if failure is None:
            return cls.PART if part else cls.MEASURED
        return cls.INFEASIBLE if Failure(failure).caused_by_config else cls.FAIL

    @property
    def state(self) -> TrialState:
        """The Optuna state a trial of this outcome has: a configuration failure is COMPLETE (infeasible through its
        constraint), so the sampler learns the combination fails."""
        return _STATES[self]

    @property
    def constrained(self) -> bool:
        """Told with the ``failed`` constraint (``FAILED_CONSTRAINT``): 1.0 when infeasible, 0.0 when measured."""
        return self.state == TrialState.COMPLETE


_STATES = {Outcome.MEASURED: TrialState.COMPLETE, Outcome.PART: TrialState.COMPLETE,
           Outcome.INFEASIBLE: TrialState.COMPLETE, Outcome.FAIL: TrialState.FAIL, Outcome.PRUNED: TrialState.PRUNED,
           Outcome.RUNNING: TrialState.RUNNING, Outcome.WAITING: TrialState.WAITING}


REQUEST_ATTRS = ("stage", "overrides", "start", "baseline", "remeasure_of", "cudnn_evidence", "stop_when",
                 "uncertain", "confirm_of", "climb_from", "climb_knob", "climb_dir", "profile_of", "profile_steps")
"""The user attrs that say what a trial was asked to be (a stage, a measurement's settings, how it may stop): a
trial run again (repaired, or after its search vanished) carries them over."""

FAILED_CONSTRAINT = "failed"
"""The Optuna constraint (1.0) of a trial whose configuration failed (OOM, invalid, diverged)."""


@dataclass(frozen=True, kw_only=True)
class TrialView:
    number: int
    """The trial's number in its own study (the main one, or the parts study for a measurement of a part)."""

    state: TrialState
    stage: Stage
    outcome: Outcome

    imgs_per_s: float | None = None
    util: float | None = None
    half_width: float | None = None
    """Its figure's 95 % interval, as a share of it (None: not measured, as in a study made before intervals)."""

    value: float | None = None
    failure_class: str | None = None
    failure_message: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    """The trial's full TrainConfig as a mapping ({} for a trial that never built one)."""

    part: bool = False
    """A trial of the parts study (``parts_name``)."""

    def __post_init__(self):
        # A view made with plain strings (a copy with another stage) reads them as the words they are.
        object.__setattr__(self, "stage", Stage(self.stage))
        object.__setattr__(self, "outcome", Outcome(self.outcome))

    @classmethod
    def of(cls, t: FrozenTrial, *, part: bool = False) -> TrialView:
        a = trial_attrs(t)
        stage = stage_of(a)
        return cls(number=t.number, state=t.state, stage=stage, outcome=_outcome(t, stage),
                   imgs_per_s=finite(a.get("imgs_per_s")), util=finite(a.get("util_mean")),
                   half_width=finite(a.get("ci_half_width")),
                   value=t.values[0] if t.values else None, failure_class=a.get("failure_class"),
                   failure_message=a.get("failure_message"), params=dict(t.params), attrs=dict(a),
                   config=t.system_attrs.get(CONFIG_KEY) or a.get("config") or {}, part=part)

    @property
    def label(self) -> str:
        """How lines and tables name the trial: its number, ``p<N>`` for a trial of the parts study."""
        return f"p{self.number}" if self.part else str(self.number)

    @property
    def interval(self) -> Interval | None:
        """Its figure with its interval. A figure of too few windows for an interval (``precise`` false, no
        half-width) could be anything: its interval is unbounded; one of a study made before intervals reads as
        exact."""
        if self.imgs_per_s is None:
            return None
        half = self.half_width if self.half_width is not None else math.inf if self.precise is False else 0.0
        return Interval(self.imgs_per_s, half)

    @property
    def precise(self) -> bool | None:
        """Whether its interval came within the measurement's precision before the time cap (None: not said)."""
        return self.attrs.get("precise")

    @property
    def end_to_end(self) -> bool:
        return not self.stage.measures_part

    @property
    def feasible(self) -> bool:
        """A complete end-to-end measurement: a configuration that may be the best."""
        return self.outcome == Outcome.MEASURED and self.imgs_per_s is not None

    @property
    def baseline(self) -> bool:
        return self.stage == Stage.BASELINE

    def setting(self, dotted: str, default: Any = None) -> Any:
        """A setting of the trial's config (searched or not), by dotted path."""
        found = _at(self.config, dotted)
        return self.params.get(dotted, default) if found is _MISSING else found

    def settings(self, paths: Iterable[str]) -> dict[str, Any]:
        """Its searched settings as a person reads them (``settings``)."""
        return settings(self.params, self.config, paths)

    def shown(self, paths: Iterable[str]) -> dict[str, Any]:
        """Its settings as its live line and ``show``'s row give them: a stage measurement's own words (what tells it
        from the other parts, ``part_settings``; its whole config would call a ceiling on synthetic data 'pil'), an
        end-to-end trial's searched settings among ``paths``, or its overrides' words where it ran none of them."""
        own = part_settings(self.attrs.get("overrides") or {})
        return own if self.part else (self.settings(paths) or own)


def stage_of(attrs: dict[str, Any]) -> Stage:
    """A trial's stage from its attrs: the one it was asked as (the search writes it when it asks for the trial), or
    for a trial whose attrs name none (a sampler's draw not asked yet, a study made before stages were recorded) what
    its other attrs say it is."""
    return Stage(attrs.get("stage") or (Stage.BASELINE if attrs.get("baseline") else Stage.START
                                        if attrs.get("start") is not None else Stage.RETRY
                                        if attrs.get("retry_of") is not None else Stage.SEARCH))


_MISSING = object()


def _at(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def settings(params: dict[str, Any], config: dict[str, Any], paths: Iterable[str]) -> dict[str, Any]:
    """A trial's searched settings as a person reads them: each of ``paths`` (the knobs searched), its param where
    the sampler drew one, else what its config ran (trial 0 of a script runs its own batch and workers, which the
    space may not hold: no param); none where it ran without (an inactive knob)."""
    out = {}
    for path in paths:
        value = params[path] if path in params else _at(config, path)
        if value is not None and value is not _MISSING:
            out[path] = value
    return out


def part_settings(overrides: dict[str, Any]) -> dict[str, Any]:
    """A stage measurement's settings as a person reads them: the ones that tell it from the others (its mode, then
    the knobs a stage line shows, ``trainer.knobs.Table.shown``)."""
    return {k: overrides[k] for k in ("training.mode", *table().shown) if k in overrides}


def _outcome(t: FrozenTrial, stage: Stage) -> Outcome:
    cls = t.user_attrs.get("failure_class")
    if t.state == TrialState.COMPLETE:
        if cls is not None and _caused_by_config(cls):
            return Outcome.INFEASIBLE
        return Outcome.PART if stage.measures_part else Outcome.MEASURED
    return {TrialState.PRUNED: Outcome.PRUNED, TrialState.FAIL: Outcome.FAIL, TrialState.RUNNING: Outcome.RUNNING,
            TrialState.WAITING: Outcome.WAITING}[t.state]


def _caused_by_config(cls: str) -> bool:
    try:
        return Failure(cls).caused_by_config
    except ValueError:
        return False


def finite(x) -> float | None:
    """``x`` as a float when it is a finite number, else None (attrs hold what JSON held: NaN, strings, null)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v and v not in (float("inf"), float("-inf")) else None


def parts_of(study):
    """The parts study of ``study`` (same storage), or None when it has none."""
    import optuna

    try:
        return optuna.load_study(study_name=parts_name(study.study_name), storage=study._storage)
    except KeyError:
        return None


def views(study, parts=None) -> list[TrialView]:
    """Every trial of ``study`` and of its parts study (``parts``; found in the storage when not given), in the
    order they started (waiting ones last, in the order they were enqueued)."""
    parts = parts if parts is not None else parts_of(study)
    both = [(t, False) for t in study.get_trials(deepcopy=False)]
    if parts is not None:
        both += [(t, True) for t in parts.get_trials(deepcopy=False)]
    both.sort(key=lambda tp: (tp[0].datetime_start is None, tp[0].datetime_start or 0, tp[0]._trial_id))
    return [TrialView.of(t, part=p) for t, p in both]


def feasible(trials: list[TrialView]) -> list[TrialView]:
    return [v for v in trials if v.feasible]


def fastest(trials: list[TrialView]) -> TrialView | None:
    """The fastest configuration (``configurations``): one run more than once stands at the figure of its runs."""
    return max(configurations(trials), key=lambda v: v.imgs_per_s, default=None)


def tied(trials: list[TrialView]) -> list[TrialView]:
    """The configurations that tie with the fastest (their intervals overlap its), the fastest first; the baseline never
    counts as one, nor does a figure without an interval (``Interval.a_tie``)."""
    configs = configurations(trials)  # once: a configuration run more than once is a new view at each call
    best = max(configs, key=lambda v: v.imgs_per_s, default=None)
    if best is None:
        return []
    return sorted((c for c in configs if c is best or (not c.baseline and c.interval.a_tie(best.interval))),
                  key=lambda c: (c is not best, -c.imgs_per_s))


RUNS = "runs"
"""The attr of a configuration run more than once (``configurations``): each run's trial number, figure and interval
([number, imgs/s, half-width]), in the order they ran."""

FLOOR = 0.002
"""The least relative half-width a run is weighted by: no run of a real machine is exact."""


def combined(runs: list[TrialView]) -> Interval:
    """The figure of several runs of one configuration: their mean weighted by the inverse of each interval's
    (relative) variance, so a run measured more precisely counts for more, and equally precise runs count alike; its
    interval the narrower that weighting gives, or, where the runs disagree by more than that, half their range: runs
    in fresh processes differ by more than the noise inside one (where the process lands, its clocks), and that
    difference is the honest uncertainty then."""
    values = [v.imgs_per_s for v in runs]
    weights = _weights(runs)
    if not sum(weights):  # no run had an interval: their mean, which could be anything
        return Interval(statistics.fmean(values), math.inf)
    value = _weighted(values, weights)
    within = 1 / sum(weights) ** 0.5
    return Interval(value, max(within, (max(values) - min(values)) / 2 / value))


def _weights(runs: list[TrialView]) -> list[float]:
    """Each run's weight in ``combined``: the inverse of its interval's relative variance (0 for a run without one)."""
    halves = [v.interval.half_width for v in runs]
    return [1 / max(h, FLOOR) ** 2 if math.isfinite(h) else 0.0 for h in halves]


def _weighted(xs: list[float], weights: list[float]) -> float:
    return sum(w * x for w, x in zip(weights, xs, strict=True)) / sum(weights) if sum(weights) else \
        statistics.fmean(xs)


def configurations(trials: list[TrialView]) -> list[TrialView]:
    """The feasible end-to-end trials, one per configuration: a configuration run more than once (``_same_config``)
    is its first trial with its runs ``combined`` as its figure (``imgs_per_s``, ``half_width``, ``value``, ``util``;
    ``attrs[RUNS]`` lists them). The fastest of several near-identical single runs is the top of a noisy draw, so a
    figure that picks the best combines runs where there are several. Trial 0 and its re-measures in fresh
    processes are one configuration too, ``baseline``: the figure every gain is a ratio to."""
    groups: dict[str, list[TrialView]] = {}
    for v in feasible(trials):
        if v.end_to_end:
            groups.setdefault(Stage.BASELINE if v.baseline else _same_config(v), []).append(v)
    return [_as_one(runs) for runs in groups.values()]


def _as_one(runs: list[TrialView]) -> TrialView:
    first = runs[0]
    if len(runs) == 1:
        return first
    both = combined(runs)
    # The objective's value weighs the runs as the figure does (throughput's value is the figure).
    weights = _weights(runs)
    valued = [(v.value, w) for v, w in zip(runs, weights, strict=True) if v.value is not None]
    value = _weighted([x for x, _ in valued], [w for _, w in valued]) if valued else first.value
    utils = [v.util for v in runs if v.util is not None]
    util = statistics.fmean(utils) if utils else first.util
    half = both.half_width if both.known else None  # runs none of which had an interval: still none
    attrs = {**first.attrs, "imgs_per_s": both.value, "ci_half_width": half, "util_mean": util,
             RUNS: [[v.number, v.imgs_per_s, v.half_width] for v in runs]}
    return dataclasses.replace(first, imgs_per_s=both.value, half_width=half, util=util, value=value,
                               attrs=attrs)


SAME_CONFIG_IGNORES = ("name", "output_dir")
"""What differs between two runs of one configuration: where each ran (its trial's name and folder)."""

PROFILE_SETTING = ("measure", "profile_steps")
"""A profile after the windows (``measure.profile_steps``) changes nothing they measure: a run with it is one more run
of the same configuration."""


def _same_config(v: TrialView) -> str:
    """What makes two end-to-end trials the same configuration: their whole config but where each ran (the params
    where no config was recorded)."""
    if not v.config:
        return json.dumps({"params": v.params}, sort_keys=True, default=repr)
    config = {k: x for k, x in v.config.items() if k not in SAME_CONFIG_IGNORES}
    section, key = PROFILE_SETTING
    if isinstance(config.get(section), dict):
        config[section] = {k: x for k, x in config[section].items() if k != key}
    return json.dumps(config, sort_keys=True, default=repr)


def searched(trials: list[TrialView]) -> list[str]:
    """The knobs a study's trials drew, in the knob table's order (the order a search's lines give them)."""
    drawn = {path for v in trials for path in v.params}
    return [path for path in table().knobs if path in drawn]


def describe_runs(v: TrialView, per: str = "imgs/s") -> str:
    """What a configuration run more than once stands on, for the line that gives its figure (``" (trials 3 and 5:
    1,250 ± 1.1 % / 1,210 ± 1.4 % imgs/s)"``); "" for a single run."""
    runs = v.attrs.get(RUNS) or []
    if len(runs) < 2:
        return ""
    names = ", ".join(str(r[0]) for r in runs[:-1]) + f" and {runs[-1][0]}"
    figures = " / ".join(fmt_interval(r[1], r[2] if len(r) > 2 else None) for r in runs)
    return f" (trials {names}: {figures} {per})"


def baseline(trials: list[TrialView]) -> TrialView | None:
    """Trial 0 as measured (None until it is): trial 0, or with its re-measures in fresh processes (where its
    interval stayed wider than the target), their runs ``combined``."""
    runs = [v for v in feasible(trials) if v.baseline]
    return _as_one(runs) if runs else None


def measurements(trials: list[TrialView], stage: Stage) -> list[TrialView]:
    """The complete measurements of a stage that measures a part (``MEASUREMENT_STAGES``)."""
    return [v for v in trials if v.stage == stage and v.outcome == Outcome.PART and v.imgs_per_s is not None]


def rate(study) -> str:
    """The label of the study's figures (its job's unit per second, ``imgs/s`` unless a script said otherwise)."""
    return per_second(study.user_attrs.get("unit"))


def devices(study) -> str:
    """What the ranks run on, as the study's lines name it: "GPUs", or "CPU ranks" (gloo on a GPU-less machine)."""
    fp = study.user_attrs.get("fingerprint")
    return "GPUs" if not isinstance(fp, dict) or fp.get("gpu_count") else "CPU ranks"


def ceiling(trials: list[TrialView]) -> TrialView | None:
    """The fastest measurement of the model alone: what the devices can do."""
    return max(measurements(trials, Stage.CEILING), key=lambda v: v.imgs_per_s, default=None)


OWN_LOADER = "its own loader"
"""The input pipeline of a user's script that builds its own Dataset (it does not apply ``data.decode``)."""


def own_loader(config: dict[str, Any] | None) -> bool:
    """Whether ``config`` is a user's script whose input pipeline is its own: ``data.decode`` names nothing it
    runs (only ``run.image_loader`` applies it)."""
    script = (config or {}).get("script") or {}
    decode = table().supply
    return bool(script.get("path") or script.get("entry")) and (decode is None or
                                                                 decode.runtime not in (script.get("applies") or []))


def pipeline(v: TrialView) -> str | None:
    """A trial's input pipeline as a person reads it: its decode path, or a script's own loader."""
    return OWN_LOADER if own_loader(v.config) else v.setting("data.decode")


def supplies(trials: list[TrialView]) -> dict[str, TrialView]:
    """Per input pipeline (``pipeline``: its decode path), its best supply measurement: what it can feed."""
    out: dict[str, TrialView] = {}
    for v in measurements(trials, Stage.SUPPLY):
        decode = pipeline(v)
        if decode not in out or v.imgs_per_s > out[decode].imgs_per_s:
            out[decode] = v
    return out
