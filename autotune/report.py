"""The study as one self-contained HTML page: plotly figures (plotly.js inlined, so it opens offline) of what the
search found and why.

The first screen says what to do: the tuned configuration, what limits the job, the configuration's settings, the
commands that export and run it, and how sure its figure is (``autotune.overview.conclusions``); then the study's
summary. Sections: optimization history (best so far), parameter importances, parallel coordinates, throughput versus
NVML utilization (coloured by precision, symbol by decode path: where users see that utilization alone misleads), each
trial's figure with its 95 % interval as an error bar (how sure each measurement is, and which ones tie), failure
counts by class, and the Pareto front when the study is multi-objective. Optuna's own figures are used wherever
Optuna has one. A section without data says why (a CPU study has no utilization) instead of failing the whole
report.

The trials are read from their user attrs (what ``autotune search`` records); Optuna's plots are drawn from an
in-memory copy of the study whose trials carry the search's feasibility as Optuna constraints, so infeasible trials
(OOM, invalid config: value 0) are greyed out whichever sampler produced them, and importances and parallel
coordinates are computed over the feasible trials only — a zero from an OOM says nothing about a knob's effect on
speed.
"""

from __future__ import annotations

import html
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.formatting import fmt_interval, fmt_ips, fmt_loss, no_interval, plural
from autotune.outputs import write_atomic
from autotune.overview import conclusions, describe_loss, headline
from autotune.study import view
from autotune.study.found import found
from autotune.study.view import Outcome, Stage, finite

PRECISION_COLORS = {"fp32": "#1f77b4", "bf16": "#d62728", "fp16": "#2ca02c"}
DECODE_SYMBOLS = {"pil": "circle", "torchvision-cpu": "square", "nvjpeg-gpu": "diamond", "hybrid": "triangle-up",
                  "dali": "hexagon"}
FAILURE_COLORS = {Outcome.INFEASIBLE: "#ff7f0e", Outcome.FAIL: "#d62728", Outcome.PRUNED: "#7f7f7f"}

UTIL_CAPTION = (
    "Why the objective is throughput and not utilization: NVML utilization is the share of time in which some kernel "
    "runs, not how much work the GPU does, so slow kernels (fp32, small batches, an input-bound loop that launches "
    "small work) can look busier than fast ones, and the fastest configuration is often not the busiest "
    "(docs/benchmarks.md). Read this plot by its vertical axis; the horizontal one explains, it does not rank."
)

SECTIONS = ("bottleneck", "history", "importances", "parallel", "util", "intervals", "failures", "pareto")
"""Section ids, in page order; each figure's div is ``plot-<id>``."""


@dataclass(kw_only=True)
class TrialRow:
    """What the report needs of one trial, from its state, params and user attrs."""

    number: int
    part: bool = False
    """A measurement of a part (the parts study: its numbers are its own)."""

    outcome: Outcome
    stage: Stage = Stage.SEARCH
    precise: bool | None = None
    """Its interval came within the precision asked (False: it reached its time cap first; None: not said)."""

    channels_last: bool = False

    imgs_per_s: float | None = None
    windows: list[float] = field(default_factory=list)
    half_width: float | None = None
    """Its figure's 95 % interval as a share of it."""

    no_interval: str | None = None
    """Why its figure has no interval (``autotune.formatting.no_interval``; None where it has one)."""

    util: float | None = None
    precision: str = "?"
    decode: str = "?"
    batch_size: Any = None
    failure_class: str | None = None
    failure_message: str | None = None
    log_path: str | None = None
    baseline: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    loss: str = "-"
    """The loss over the measured windows, start -> end, or "diverged" (``autotune show``'s column)."""

    not_launched: bool = False
    """A pruned draw that never ran: the bound the stages measured for it was below the best."""

    @property
    def label(self) -> str:
        return f"p{self.number}" if self.part else str(self.number)


def trial_rows(study) -> list[TrialRow]:
    rows = []
    for v in view.views(study):
        outcome = v.outcome
        cls = v.failure_class or ("unknown" if outcome in (Outcome.INFEASIBLE, Outcome.FAIL) else None)
        a = v.attrs
        rows.append(TrialRow(
            number=v.number, part=v.part, outcome=outcome, stage=v.stage, imgs_per_s=v.imgs_per_s,
            windows=[x for x in map(finite, a.get("imgs_per_s_windows") or []) if x is not None],
            half_width=v.half_width, no_interval=no_interval(a) if v.half_width is None else None,
            # Pruned, or wide only by a loader turn seen once (``trainer.estimate.stop``): no time cap to mark.
            util=v.util, precise=None if v.outcome == Outcome.PRUNED or a.get("ended") == "turn" else v.precise,
            # The trial's config says what ran, searched or not (a knob the spec fixed, a stage's setting).
            precision=str(v.setting("training.precision", "?")), decode=str(v.setting("data.decode", "?")),
            batch_size=v.setting("training.batch_size"), channels_last=bool(v.setting("training.channels_last")),
            failure_class=cls if outcome in (Outcome.INFEASIBLE, Outcome.FAIL) else None,
            failure_message=a.get("failure_message"), log_path=a.get("log_path"),
            baseline=v.baseline, params=dict(v.params), loss=fmt_loss(a),
            not_launched=bool(a.get("pruned_before_launch")),
        ))
    return rows


# ---- the study copy Optuna's plots are drawn from -----------------------------------------------------------------


def plot_study(study, rows: list[TrialRow], *, feasible_only: bool):
    """An in-memory copy of the study's trials (only the feasible completed ones with ``feasible_only``) with the
    search's feasibility as Optuna constraints."""
    import optuna
    from optuna.trial import TrialState, create_trial

    by_number = {r.number: r for r in rows if not r.part}
    copy = optuna.create_study(directions=study.directions, study_name=study.study_name)
    trials = []
    for t in study.get_trials(deepcopy=False):
        outcome = by_number[t.number].outcome
        if feasible_only and outcome != Outcome.MEASURED:
            continue
        system_attrs = {k: v for k, v in t.system_attrs.items() if not k.startswith("constraints")}
        system_attrs["constraints"] = [1.0 if outcome == Outcome.INFEASIBLE else 0.0]
        # A stage measurement is not a training configuration: copied without values (as unfinished trials are),
        # so that the copy's trial numbers stay the study's.
        shown = t.state if outcome != Outcome.PART else TrialState.FAIL
        keeps = shown not in (TrialState.WAITING, TrialState.FAIL) or outcome != Outcome.PART
        trials.append(create_trial(state=shown, values=t.values if shown == TrialState.COMPLETE else None,
                                   params=t.params if keeps and shown != TrialState.WAITING else {},
                                   distributions=t.distributions if keeps and shown != TrialState.WAITING else {},
                                   user_attrs=t.user_attrs, system_attrs=system_attrs,
                                   intermediate_values=t.intermediate_values if keeps else {}))
    copy.add_trials(trials)
    return copy


def objective_label(study) -> tuple[str, list[str]]:
    """(objective kind, a name per objective value)."""
    kind = study.user_attrs.get("objective") or ("pareto" if len(study.directions) > 1 else "throughput")
    per = view.rate(study)
    if len(study.directions) > 1:
        return kind, [f"{per} (global)", "NVML utilization %"]
    return kind, [f"{per} (global)" if kind == "throughput" else f"{kind} score"]


# ---- sections -----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Section:
    id: str
    title: str
    figure: Any = None
    """A plotly Figure, or None when there is nothing to draw (``note`` says why)."""

    note: str | None = None
    caption: str | None = None
    extra_html: str = ""


def bottleneck_section(rows: list[TrialRow], devices: str = "GPUs", per: str = "imgs/s") -> Section:
    """The stages' measurements side by side: the model alone (ceiling), each pipeline alone (supply), and the
    end-to-end trials as lines — where the time goes, at a glance."""
    import plotly.graph_objects as go

    s = Section(id="bottleneck", title="Ceiling, supply and end to end")
    parts = [r for r in rows if r.outcome == Outcome.PART and r.imgs_per_s is not None]
    if not parts:
        s.note = ("No stage measurement in this study (stages disabled, or not reached yet): the ceiling and the "
                  "supplies are measured by the first trials of a staged search.")
        return s
    fig = go.Figure()
    for stage_name, color in ((Stage.CEILING, "#1f77b4"), (Stage.SUPPLY, "#ff7f0e")):
        rs = [r for r in parts if r.stage == stage_name]
        if rs:
            labels = [f"#{r.label} " + (f"{r.precision}{' CL' if r.channels_last else ''} bs {r.batch_size}"
                                         if stage_name == Stage.CEILING else f"{r.decode} bs {r.batch_size}")
                      for r in rs]
            fig.add_trace(go.Bar(x=labels, y=[r.imgs_per_s for r in rs], name=str(stage_name), marker_color=color,
                                 error_y=_error_bars(rs)))
    best = max((r for r in rows if r.outcome == Outcome.MEASURED and r.imgs_per_s), key=lambda r: r.imgs_per_s,
               default=None)
    if best is not None:
        fig.add_hline(y=best.imgs_per_s, line_dash="dot", line_color="#2ca02c",
                      annotation_text=f"best end to end: trial {best.number}, {fmt_ips(best.imgs_per_s)} {per}")
    fig.update_layout(title="The model alone on synthetic data (ceiling) and each input pipeline alone (supply)",
                      yaxis_title=f"{per} (global)", xaxis_title="stage measurement", barmode="group")
    s.figure = fig
    s.caption = (f"An end-to-end run is at most the smaller of what the {devices} compute (the ceiling) and what its "
                 "input pipeline feeds (its supply). The search measures both first and starts its end-to-end trials "
                 "where the supply meets the ceiling; the dotted line is how close the tuned configuration gets.")
    return s


def history_section(study, rows, names) -> Section:
    import plotly.graph_objects as go
    from optuna.visualization import plot_optimization_history

    s = Section(id="history", title="Optimization history (best so far)")
    done = [r for r in rows if r.outcome in (Outcome.MEASURED, Outcome.INFEASIBLE)]
    if not done:
        s.note = "No trial has completed yet."
        return s
    copy = plot_study(study, rows, feasible_only=False)
    multi = len(study.directions) > 1
    fig = plot_optimization_history(copy, target=(lambda t: t.values[0]) if multi else None, target_name=names[0])
    if multi:
        # Optuna draws no best-so-far line for a chosen target of a multi-objective study; throughput is maximized.
        best, xs, ys = -math.inf, [], []
        for r in sorted((r for r in rows if not r.part), key=lambda r: r.number):
            if r.outcome == Outcome.MEASURED and r.imgs_per_s is not None:
                best = max(best, r.imgs_per_s)
            if best > -math.inf:
                xs.append(r.number)
                ys.append(best)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"Best {view.rate(study)} so far",
                                 line={"shape": "hv"}))
    fig.update_layout(title=f"Optimization history: {names[0]} per trial, best so far", yaxis_title=names[0])
    if len(rows) <= 30:
        fig.update_xaxes(dtick=1)  # trial numbers are integers; plotly would tick 0.5 steps on a short study
    measured = view.baseline(view.views(study))
    base = next((r for r in rows if measured is not None and not r.part and r.number == measured.number), None)
    if base is not None:
        fig.add_hline(y=base.imgs_per_s, line_dash="dot", line_color="#555",
                      annotation_text=f"trial {base.number} (baseline): {fmt_ips(base.imgs_per_s)} "
                                      f"{view.rate(study)}")
    s.figure = fig
    s.caption = ("Each point is a trial's value; infeasible trials (OOM, invalid config) are recorded with value 0 "
                 "and drawn grey. The line is the best feasible value so far; the dotted line is the baseline (trial "
                 "0, with its re-measure in a fresh process where its interval stayed wide).")
    return s


def importances_section(study, rows, names) -> Section:
    from optuna.visualization import plot_param_importances

    s = Section(id="importances", title="Parameter importances")
    feasible = [r for r in rows if r.outcome == Outcome.MEASURED]
    if len(feasible) < 3:
        s.note = (f"Too few feasible completed trials for importances ({len(feasible)}; at least 3 needed) — "
                  "run more trials with `autotune search`.")
        return s
    copy = plot_study(study, rows, feasible_only=True)
    varied = [p for p in {k for r in feasible for k in r.params}
              if len({repr(r.params.get(p)) for r in feasible if p in r.params}) > 1]
    if not varied:
        s.note = "Every feasible trial used the same parameter values; nothing to attribute."
        return s
    evaluator, how = _importance_evaluator()
    multi = len(study.directions) > 1
    try:
        with _quiet_optuna(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PED-ANOVA warns on sparse regimes; the caption says they are rough
            fig = plot_param_importances(copy, evaluator=evaluator, target=(lambda t: t.values[0]) if multi else None,
                                         target_name=names[0])
    except Exception as e:
        s.note = f"Importances could not be computed from {len(feasible)} feasible trials ({type(e).__name__}: {e})."
        return s
    fig.update_layout(title=f"Parameter importances for {names[0]} ({how}, {len(feasible)} feasible trials)")
    s.figure = fig
    s.caption = (f"How much of the variation in {names[0]} each knob explains ({how}), over feasible trials only. "
                 "With few trials these are rough; they sharpen as the study grows.")
    return s


def _importance_evaluator():
    """fANOVA (Optuna's default) needs scikit-learn; PED-ANOVA does not and is meant for HPO-sized studies."""
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator

    try:
        import sklearn  # noqa: F401
    except ImportError:
        return PedAnovaImportanceEvaluator(), "PED-ANOVA"
    return FanovaImportanceEvaluator(seed=0), "fANOVA"


class _quiet_optuna:
    """Optuna warns (e.g. PED-ANOVA on few trials) through its logger; the report's note says it instead."""

    def __enter__(self):
        import optuna

        self.level = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.ERROR)

    def __exit__(self, *exc):
        import optuna

        optuna.logging.set_verbosity(self.level)


def parallel_section(study, rows, names) -> Section:
    from optuna.visualization import plot_parallel_coordinate

    s = Section(id="parallel", title="Parallel coordinates")
    feasible = [r for r in rows if r.outcome == Outcome.MEASURED]
    if len(feasible) < 2 or not any(r.params for r in feasible):
        s.note = f"Needs at least 2 feasible completed trials with parameters (have {len(feasible)})."
        return s
    copy = plot_study(study, rows, feasible_only=True)
    multi = len(study.directions) > 1
    fig = plot_parallel_coordinate(copy, target=(lambda t: t.values[0]) if multi else None, target_name=names[0])
    fig.update_layout(title=f"Parallel coordinates: each line a feasible trial, coloured by {names[0]}")
    s.figure = fig
    s.caption = "Drag along an axis to select a range; the lines of the fastest trials show which settings they share."
    return s


def util_section(rows, per: str = "imgs/s") -> Section:
    import plotly.graph_objects as go

    s = Section(id="util", title="Throughput versus GPU utilization", caption=UTIL_CAPTION)
    pts = [r for r in rows if r.outcome == Outcome.MEASURED and r.imgs_per_s is not None and r.util is not None]
    if not pts:
        measured = sum(1 for r in rows if r.outcome == Outcome.MEASURED)
        s.note = (f"No trial has an NVML utilization figure ({measured} completed trial(s), none with "
                  "util_mean): the study ran without NVML (a CPU study, or no NVML device), and utilization is "
                  "recorded as unavailable rather than estimated.")
        return s
    fig = go.Figure()
    groups: dict[tuple[str, str], list[TrialRow]] = {}
    for r in pts:
        groups.setdefault((r.precision, r.decode), []).append(r)
    for (prec, dec), rs in sorted(groups.items()):
        fig.add_trace(go.Scatter(
            x=[r.util for r in rs], y=[r.imgs_per_s for r in rs], mode="markers+text",
            name=f"{prec} · {dec}", legendgroup=prec,
            marker={"color": PRECISION_COLORS.get(prec, "#8c564b"), "symbol": DECODE_SYMBOLS.get(dec, "x"),
                    "size": 12, "line": {"width": 1, "color": "#222"}},
            text=[f"#{r.number}" + (" (baseline)" if r.baseline else "") for r in rs], textposition="top center",
            hovertext=[f"trial {r.number}: {fmt_ips(r.imgs_per_s)} {per} at {r.util:.0f} % util, loss {r.loss}<br>"
                       f"{prec}, {dec}, batch {r.batch_size}" for r in rs], hoverinfo="text"))
    fig.update_layout(title=f"{per} versus NVML utilization (colour: precision, symbol: decode path)",
                      xaxis_title="NVML utilization, mean over the trial's GPUs inside the timed windows (%)",
                      yaxis_title=f"{per} (global)", legend_title="precision · decode")
    s.figure = fig
    return s


INTERVAL_OUTCOMES = (Outcome.MEASURED, Outcome.PRUNED)
"""The trials the interval plot draws: end-to-end runs with a figure (a stage measurement's is a part's)."""


def _error_bars(rows: list[TrialRow]) -> dict[str, Any]:
    """Plotly's symmetric error bars for ``rows``: each figure's interval, in its own unit."""
    return {"type": "data", "array": [(r.half_width or 0.0) * (r.imgs_per_s or 0.0) for r in rows], "visible": True}


def _label(r: TrialRow) -> str:
    """A trial on the interval plot's axis; ``~`` marks one that reached its time cap with its interval wide."""
    return f"#{r.label}{'~' if r.precise is False else ''}"


def intervals_section(rows, per: str = "imgs/s") -> Section:
    import plotly.graph_objects as go

    s = Section(id="intervals", title="Each trial's figure and its interval")
    drawn = [r for r in rows if r.outcome in INTERVAL_OUTCOMES and r.imgs_per_s is not None and not r.part]
    if not drawn:
        s.note = "No end-to-end trial has a figure yet."
        return s
    fig = go.Figure()
    for outcome in INTERVAL_OUTCOMES:
        rs = [r for r in drawn if r.outcome == outcome]
        if not rs:
            continue
        hover = [f"trial {r.label}: {fmt_interval(r.imgs_per_s, r.half_width, per, r.no_interval)}; loss {r.loss}"
                 + ("; it reached its time cap with its interval wider than the precision asked"
                    if r.precise is False else "") for r in rs]
        fig.add_trace(go.Scatter(x=[_label(r) for r in rs], y=[r.imgs_per_s for r in rs], mode="markers",
                                 name=str(outcome), error_y=_error_bars(rs),
                                 hovertext=hover, hoverinfo="text",
                                 marker={"color": FAILURE_COLORS.get(outcome, "#1f77b4"), "size": 9}))
    best = max((r for r in drawn if r.outcome == Outcome.MEASURED), key=lambda r: r.imgs_per_s, default=None)
    if best is not None and best.half_width is not None:
        fig.add_hrect(y0=best.imgs_per_s * (1 - best.half_width), y1=best.imgs_per_s * (1 + best.half_width),
                      fillcolor="#2ca02c", opacity=0.12, line_width=0)
    fig.update_layout(title=f"{per} of each end-to-end trial with its 95 % interval",
                      xaxis_title="trial", yaxis_title=f"{per} (global)",
                      xaxis={"categoryorder": "array", "categoryarray": [_label(r) for r in drawn]})
    s.figure = fig
    widest = max((r for r in drawn if r.half_width is not None), key=lambda r: r.half_width, default=None)
    s.caption = ("A trial's figure is its samples over the slowest rank's seconds across its steady windows; the bar "
                 "is its 95 % interval. The green band is the fastest trial's interval: a trial whose bar reaches "
                 "into it is a tie, and a trial whose whole bar lies below it is measurably slower (the pruner stops "
                 "a trial as soon as that is known). ~ marks a trial that reached its time cap with its interval "
                 "wider than the precision asked." + (f" Widest: trial {widest.label}, ± {widest.half_width:.1%}."
                                                        if widest else ""))
    return s


def failures_section(rows) -> Section:
    import plotly.graph_objects as go

    s = Section(id="failures", title="Failures by class")
    failed = [r for r in rows if r.outcome in (Outcome.INFEASIBLE, Outcome.FAIL)]
    pruned = sum(1 for r in rows if r.outcome == Outcome.PRUNED and not r.not_launched)
    skipped = sum(1 for r in rows if r.not_launched)
    if not failed:
        s.note = (f"No trial failed ({plural(len(rows), 'trial')}; {pruned} pruned — stopped early because their "
                  "windows were clearly below the best, not a failure"
                  + (f"; {plural(skipped, 'draw')} not launched, its measured bound below the best" if skipped
                     else "") + ").")
        return s
    counts: dict[tuple[str, str], int] = {}
    for r in failed:
        counts[(r.outcome, r.failure_class)] = counts.get((r.outcome, r.failure_class), 0) + 1
    fig = go.Figure()
    for outcome, label in ((Outcome.INFEASIBLE, "infeasible (config: OOM, invalid)"),
                           (Outcome.FAIL, "failed (environment)")):
        items = sorted((cls, n) for (o, cls), n in counts.items() if o == outcome)
        if items:
            fig.add_trace(go.Bar(x=[c for c, _ in items], y=[n for _, n in items], name=label,
                                 marker_color=FAILURE_COLORS[outcome], text=[n for _, n in items],
                                 textposition="outside"))
    fig.update_layout(title=f"Failed trials by class ({len(failed)} of {len(rows)}; {pruned} pruned)",
                      xaxis_title="failure class", yaxis_title="trials", barmode="stack")
    s.figure = fig
    s.caption = ("oom and config are properties of the configuration: recorded as completed but infeasible, so the "
                 "sampler learns the boundary. nccl, hang, loader and crash come from the environment: recorded as "
                 "failed, and the sampler learns nothing from them.")
    s.extra_html = _table(["trial", "class", "message", "log"],
                          [[str(r.number), r.failure_class or "", (r.failure_message or "")[:300], r.log_path or ""]
                           for r in failed])
    return s


def pareto_section(study, rows, names) -> Section:
    from optuna.visualization import plot_pareto_front

    s = Section(id="pareto", title="Pareto front")
    if len(study.directions) < 2:
        kind, _ = objective_label(study)
        s.note = (f"This is a single-objective study (objective: {kind}); there is no Pareto front. "
                  "`autotune search --objective pareto` maximizes throughput and utilization jointly.")
        return s
    feasible = [r for r in rows if r.outcome == Outcome.MEASURED]
    if not feasible:
        s.note = "No feasible completed trial yet."
        return s
    copy = plot_study(study, rows, feasible_only=False)
    from optuna.trial import FrozenTrial

    # Optuna 5 reads the copy's constraints itself (and deprecates constraints_func); Optuna 4 needs the function.
    legacy = {} if hasattr(FrozenTrial, "constraints") else {
        "constraints_func": lambda t: t.system_attrs.get("constraints", [0.0])}
    fig = plot_pareto_front(copy, target_names=names, **legacy)
    fig.update_layout(title=f"Pareto front: {view.rate(study)} and NVML utilization (red: on the front; grey: "
                            "infeasible)")
    s.figure = fig
    s.caption = ("Trials no other trial beats on both throughput and utilization. `autotune export --pick` chooses "
                 "from this front.")
    return s


# ---- the page -----------------------------------------------------------------------------------------------------


def build_sections(study) -> tuple[list[TrialRow], list[Section]]:
    rows = trial_rows(study)
    _, names = objective_label(study)
    per = view.rate(study)
    builders = [lambda: bottleneck_section(rows, view.devices(study), per),
                lambda: history_section(study, rows, names), lambda: importances_section(study, rows, names),
                lambda: parallel_section(study, rows, names), lambda: util_section(rows, per),
                lambda: intervals_section(rows, per), lambda: failures_section(rows),
                lambda: pareto_section(study, rows, names)]
    sections = []
    for sid, build in zip(SECTIONS, builders, strict=True):
        try:
            sections.append(build())
        except Exception as e:
            sections.append(Section(id=sid, title=sid, note=f"This section could not be drawn: "
                                                            f"{type(e).__name__}: {e}"))
    return rows, sections


def render_html(study, *, storage_url: str | None = None, storage_arg: str | None = None) -> str:
    """The page. ``storage_url``: shown in the summary (no password); ``storage_arg``: the ``--storage`` the page's
    commands need (None: the default storage finds the study)."""
    from plotly.offline import get_plotlyjs

    rows, sections = build_sections(study)
    body = [_first_screen(study, storage_arg), _header(study, rows, storage_url)]
    for s in sections:
        body.append(f'<section id="section-{s.id}"><h2>{html.escape(s.title)}</h2>')
        if s.caption:
            body.append(f'<p class="caption">{html.escape(s.caption)}</p>')
        if s.figure is not None:
            s.figure.update_layout(template="plotly_white", height=520, margin={"t": 60})
            body.append(s.figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{s.id}",
                                         config={"displaylogo": False, "responsive": True}))
        else:
            body.append(f'<p class="empty" id="empty-{s.id}">{html.escape(s.note or "No data.")}</p>')
        body.append(s.extra_html)
        body.append("</section>")
    title = f"autotune report: {study.study_name}"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style>\n<script type=\"text/javascript\">{get_plotlyjs()}</script>\n</head>"
            f"<body><h1>{html.escape(title)}</h1>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(study, out: str | Path, *, storage_url: str | None = None, storage_arg: str | None = None) -> Path:
    out = Path(out)
    # A browser tab being refreshed never sees half a page.
    write_atomic(out, render_html(study, storage_url=storage_url, storage_arg=storage_arg))
    return out


def _first_screen(study, storage_arg: str | None) -> str:
    """What a reader should learn before scrolling: the tuned configuration, what limits the job, what to run, how
    sure the figure is."""
    from autotune.export import remeasures

    trials = view.views(study)
    lines = headline(trials, view.devices(study), remeasures(study), view.rate(study))
    tuned = [tuple(line.split(": ", 1)) for line in lines if line.startswith("the tuned configuration: ")]
    items = "".join(f"<li><b>{html.escape(topic)}:</b> {_code(text)}</li>"
                    for topic, text in [*tuned, *conclusions(study, trials, storage=storage_arg)])
    return f'<section id="conclusions"><ul class="conclusions">{items}</ul></section>'


def _code(text: str) -> str:
    """``text`` escaped, its `backticked` commands set as code a reader can copy."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def _header(study, rows: list[TrialRow], storage_url: str | None) -> str:
    kind, _ = objective_label(study)
    counts = {word: sum(1 for r in rows if r.outcome == o) for o, word in COUNTED.items()}
    feasible = [r for r in rows if r.outcome == Outcome.MEASURED and r.imgs_per_s is not None]
    trials = view.views(study)
    best = view.fastest(trials)
    fp = study.user_attrs.get("fingerprint") or {}
    from autotune.export import remeasures

    items = [(line.split(" (", 1)[0].split(":", 1)[0], line.split(": ", 1)[-1] if ": " in line else line)
             for line in headline(trials, view.devices(study), remeasures(study), view.rate(study))]
    items += [("study", study.study_name), ("storage", storage_url or ""), ("objective", kind),
              ("trials", ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "none")]
    if best is not None:
        util = f"; {best.util:.0f} % util" if best.util is not None else ""
        items.append(("fastest", f"{found(trials, view.rate(study))}{util}; loss over its windows "
                                 f"{describe_loss(best.attrs)}"))
    where = (f"{fp.get('gpu_count')} × {fp.get('gpu_model')}" if fp.get("gpu_count") else
             f"CPU ({study.user_attrs.get('nproc_per_node', '?')} gloo ranks)")
    if fp.get("driver"):
        where += f", driver {fp['driver']}"
    items.append(("hardware", where))
    items.append(("generated", time.strftime("%Y-%m-%d %H:%M:%S %Z")))
    med = [r.half_width for r in feasible if r.half_width is not None]
    if med:
        items.append(("median interval", f"± {statistics.median(med):.1%} (95 %)"))
    return "<table class=\"summary\">" + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in items if v != "") + "</table>"


COUNTED = {Outcome.MEASURED: "complete", Outcome.PART: "part", Outcome.INFEASIBLE: "infeasible", Outcome.FAIL: "fail",
           Outcome.PRUNED: "pruned", Outcome.RUNNING: "running"}
"""The outcomes the summary counts, each by the word it prints."""


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="failures"><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>'


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1300px;color:#222}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:4px}
p.caption{color:#444;max-width:1000px}p.empty{color:#777;font-style:italic;padding:1em;background:#f6f6f6}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left}
table.summary th{background:#f3f3f3}table.failures td:nth-child(3){max-width:600px}
ul.conclusions{font-size:1.1em;line-height:1.5;padding-left:1.2em;max-width:1200px}
ul.conclusions code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
"""
