"""A study in words: what a user wants first — what limits the job, the tuned configuration and the commands that
export and run it, how sure its figure is; the three numbers behind that (what the GPUs or CPU ranks can do, the
ceiling; what each input pipeline can feed, its supply; how close the tuned configuration gets) — then every trial as
a table, where a trial's time goes, and what pruning saved. ``autotune show`` prints it; the report and the search's
last line use its parts.
"""

from __future__ import annotations

import statistics

from autotune.formatting import (
    LOSS_WARNING,
    STILL,
    fmt_duration,
    fmt_interval,
    fmt_ips,
    fmt_loss,
    fmt_params,
    fmt_pm,
    no_interval,
    plural,
)
from autotune.study import view
from autotune.study.found import found
from autotune.study.measured import (
    DATA_WAIT_SAID,
    STEP_PARTS,
    UNEXPLAINED,
    Pipe,
    Point,
    ceiling_share,
    cudnn_decided,
    data_fix,
    largest_cost,
    pipe_for,
    profiled,
    trainable_ceiling,
)
from autotune.study.view import Outcome, Stage, TrialView
from trainer.knobs import DALI_INSTALL


def why_failed(cls: str | None, message: str | None) -> str:
    """A failure as ``class: reason``, the class said once: a reason that already opens with its class
    ("interrupted (Ctrl-C)") or closes with it ("... (diverged)", as older records do) is not prefixed again."""
    msg = (message or "").strip()
    if not cls:
        return msg
    tail = f" ({cls})"
    if msg.endswith(tail):
        msg = msg[:-len(tail)]
    return msg if msg.split(" ", 1)[0].rstrip(":") == cls else f"{cls}: {msg}"


def describe_loss(attrs: dict) -> str:
    """The loss over the measured windows (``fmt_loss``), with a word when it rose: a fast figure of a run whose loss
    went up is a figure of a run that may not be learning."""
    text = fmt_loss(attrs)
    start, end = attrs.get("loss_start"), attrs.get("loss_end")
    if attrs.get("loss_finite") is not False and start is not None and end is not None and end > start:
        text += (" — it rose over the measured windows: a few steps can be noise, but a run that does not learn is "
                 "not fast; check its loss over a longer run (`autotune train`)")
    return text


def headline(trials: list[TrialView], devices: str = "GPUs",
             remeasured: dict[int, dict] | None = None, per: str = "imgs/s") -> list[str]:
    """Ceiling, supplies, and the tuned configuration against both (lines; fewer when a stage has not run)."""
    lines = []
    top = trainable_ceiling(trials)
    if top is not None:
        lines.append(f"what the {devices} can do (ceiling, the model on synthetic data): "
                     f"{fmt_ips(top.imgs_per_s)} {per} — {Point.of(top).label.replace(' ', ', ')}, batch "
                     f"{top.setting('training.batch_size')} (trial {top.label})")
    feeds = view.supplies(trials)
    if feeds:
        parts = sorted(feeds.items(), key=lambda kv: -kv[1].imgs_per_s)
        lines.append("what each input pipeline can feed (supply, the loader alone): " + " · ".join(
            f"{decode} {fmt_ips(v.imgs_per_s)}" for decode, v in parts) + f" {per}")
    best = view.fastest(trials)
    if best is not None:
        share, of = "", ceiling_share(best.interval, top.interval) if top else None
        if of is not None:
            share = f" = {of:.0%} of the ceiling"
        elif top:  # a share above the whole says the measurement is no bound for this run, not that it beat one
            share = (f", above the ceiling measured (trial {top.label}, {fmt_ips(top.imgs_per_s)} at batch "
                     f"{top.setting('training.batch_size')}): the model alone bounds nothing at this run's settings")
        again = (remeasured or {}).get(best.number)
        fresh = ""
        if again and again.get("imgs_per_s") is not None:
            fresh = f"; re-measured in a fresh process: {fmt_ips(again['imgs_per_s'])}"
            if again.get("below_baseline"):
                fresh += f" {BELOW} below trial {again['below_baseline']['trial']}"
        lines.append(f"the tuned configuration: {found(trials, per, share=share)}{fresh}")
    return lines


def above(top: TrialView) -> str:
    """Why a ceiling is no bound on a run faster than it: where it was measured."""
    return f"the model alone, measured at batch {top.setting('training.batch_size')}, bounds nothing at its settings"


BELOW = "↓"
"""Marks a trial whose fresh-process re-measure (``autotune export``) fell below trial 0's figure."""


def imprecise(v: TrialView) -> bool:
    """The trial ran its measurement to its time cap with its interval still wider than the precision asked. A
    pruned trial was stopped before the end: its interval says only that it was clearly slower."""
    return v.precise is False and v.outcome != Outcome.PRUNED and not turn_bound(v)


def turn_bound(v: TrialView) -> bool:
    """Its windows came within the precision asked, but a turn of its loader seen once keeps its interval wider, which
    no more windows narrow (``trainer.estimate.stop``: ``turn``)."""
    return v.attrs.get("ended") == "turn"


TURN_BOUND = ("its windows came within the precision asked; its loader's epoch turn, seen only at its first epoch's "
              "start (charged per epoch, its cost known to within half of it), keeps the interval wider, and more "
              "windows would not narrow it")


def image_loader_line(trials: list[TrialView], per: str = "imgs/s") -> str | None:
    """Where a user's script's own image loader bounds its job (its supply below the ceiling) and the project's
    pipeline, measured alone on the same folder (the ``image_loader`` stage), would feed more: both figures and the
    change to make, in one line; else None."""
    own = view.supplies(trials).get(view.OWN_LOADER)
    theirs = max(view.measurements(trials, Stage.IMAGE_LOADER), key=lambda v: v.imgs_per_s, default=None)
    top = trainable_ceiling(trials)
    if own is None or theirs is None or top is None or own.imgs_per_s >= top.imgs_per_s \
            or theirs.imgs_per_s <= own.imgs_per_s:
        return None
    call = f'run.image_loader("{theirs.setting("data.path")}", image_size={theirs.setting("data.image_size")})'
    return (f"the script's own loader feeds {fmt_ips(own.imgs_per_s)} {per} (trial {own.label}); {call} would feed "
            f"{fmt_ips(theirs.imgs_per_s)} ({theirs.setting('data.decode')}, trial {theirs.label}) on the same files: "
            "build its loader with that instead of run.loader(dataset, ...) (docs/scripts.md: the fix, not only the "
            "limit)")


def conclusions(study, trials: list[TrialView] | None = None, *, storage: str | None = None) -> list[tuple[str, str]]:
    """What a reader should learn first, as (topic, sentence): what limits the job, where its step goes (where a
    profile split it and what limits it does not say it), the tuned configuration's settings, the commands that
    export and run it, how sure its figure is. ``storage``: the ``--storage`` the
    commands need (None: the default one finds the study)."""
    from autotune.export import remeasures

    trials = view.views(study) if trials is None else trials
    devices, per = view.devices(study), view.rate(study)
    best, top = view.fastest(trials), trainable_ceiling(trials)
    out: list[tuple[str, str]] = []
    synthetic = best is not None and best.setting("data.kind") == "synthetic"
    decode = view.pipeline(best) if best is not None and not synthetic else None
    feed = feed_of(trials, best) if decode is not None else None
    if synthetic:
        out.append(("what limits it", f"the model's compute on the {devices}: the data is synthetic (made on the "
                                      "device), so no input pipeline takes part"))
    elif top is not None and feed is not None:
        out.append(("what limits it", describe_limit(best, top, feed, decode, devices, per, profile=profiled(trials))))
    elif top is not None:
        share = ceiling_share(best.interval, top.interval) if best is not None else None
        reach = ("" if best is None else f"; the tuned configuration reaches {share:.0%} of it" if share is not None
                 else f"; the tuned configuration runs above it ({above(top)})")
        out.append(("what limits it", f"the {devices} run the model alone at {fmt_ips(top.imgs_per_s)} {per} (the "
                                      "ceiling); "
                    + (f"its input pipeline ({decode}) was not measured alone" if decode else
                       "no input pipeline was measured alone") + reach))
    else:
        out.append(("what limits it", "not measured: this study has no stage measurements (the model alone, each "
                                      "pipeline alone), so it says how fast, not what limits"))
    profile = profiled(trials)
    split = split_line(profile) if profile is not None else None
    if split and not any(split in text for _, text in out):  # what limits it did not say it
        out.append(("where its step goes", split))
    change = image_loader_line(trials, per)
    if change:
        out.append(("the change to make", change))
    if best is None:
        out.append(("its settings", "none yet: no end-to-end trial has completed; run `autotune search`"))
        return out
    settings = fmt_params(best.shown(view.searched(trials)))
    waits = waits_for_data(best) if not synthetic else None
    if waits and any(waits in text for _, text in out):  # what limits it said it already
        waits = None
    out.append(("its settings", f"trial {best.number}: {settings}" + (" (the baseline's own)" if best.baseline
                                                                     else "") + (f"; {waits}" if waits else "")))
    where = f" --study {study.study_name}" + (f" --storage {storage}" if storage else "")
    out.append(("run it", f"`autotune export best.yaml{where}` (measures it again in a fresh process), then "
                          "`autotune train --config best.yaml`"))
    sure = describe_certainty(best, per)
    again = remeasures(study).get(best.number)
    if again and again.get("imgs_per_s") is not None:
        sure += (f"; in a fresh process it measured {fmt_interval(again['imgs_per_s'], again.get('ci_half_width'))}"
                 f" ({again['ratio']:.0%} of it" + ("" if again.get("agrees", True) else
                                                   ", further off than both intervals allow") + ")")
        if again.get("below_baseline"):
            b = again["below_baseline"]
            sure += (f", measurably below trial {b['trial']}'s {fmt_ips(b['imgs_per_s'])}: here it is not faster "
                     "than the baseline")
    else:
        sure += "; not yet measured again in a fresh process (`autotune export` does)"
    if best.attrs.get(LOSS_WARNING):
        sure += f"; WARNING: {best.attrs[LOSS_WARNING]}"
    out.append(("how sure", sure))
    return out


DECODE_SHARE_SAID = 0.05
"""A decode on the GPUs taking at least this share of each sample's time beside the model is named as the limit."""


def feed_of(trials: list[TrialView], best: TrialView) -> Pipe | None:
    """What ``best``'s input pipeline feeds alone, as the supplies measured it (a hybrid: derived from its ends where
    it was not measured itself; a script's own loader: its own supply)."""
    decode = view.pipeline(best)
    if decode == view.OWN_LOADER:
        v = view.supplies(trials).get(decode)
        return None if v is None else Pipe(settings={}, point=v.imgs_per_s, upper=v.interval.high,
                                           precise=v.precise is not False)
    return pipe_for(trials, decode, best.setting("data.hybrid_cpu_fraction") if decode == "hybrid" else None)


def describe_limit(best: TrialView, top: TrialView, pipe: Pipe, decode: str, devices: str, per: str, *,
                   profile: TrialView | None = None) -> str:
    """What limits a job whose model alone (``top``, the ceiling) and input pipeline alone (``feed``, its supply)
    were measured, with the fix where there is one: the pipeline, when it feeds less than the model takes; the GPUs'
    time, when the pipeline decodes on them and its decode beside the model's steps takes a share of each sample
    (``Pipe.with_model``); the model's compute otherwise. Where the tuned configuration reaches well below what the
    parts allow, the parts do not explain it, and that is said instead of a limit, with where its step's time goes
    (``profile``: the trial whose step was profiled, if one was)."""
    ceiling, supply = top.imgs_per_s, pipe.point
    bound = pipe.with_model(ceiling)
    share = pipe.decode_share(ceiling)
    reach = best.imgs_per_s / bound
    if best.interval.low > pipe.with_model(top.interval.high, reach=True):  # above the most the parts allow
        return (f"not the parts as measured: the tuned configuration reaches {fmt_ips(best.imgs_per_s)} {per}, above "
                f"what they allow ({fmt_ips(bound)}: {decode} alone {fmt_ips(supply)}, the model alone "
                f"{fmt_ips(ceiling)}; {above(top)})")
    if reach < UNEXPLAINED:
        return (f"not explained by the parts: {decode} alone feeds {fmt_ips(supply)} {per} and the model alone runs "
                f"{fmt_ips(ceiling)} on the {devices}, together allowing {fmt_ips(bound)}, and the tuned "
                f"configuration reaches {fmt_ips(best.imgs_per_s)}, {reach:.0%} of that"
                f"{where_the_step_goes(best, profile)}")
    if share >= DECODE_SHARE_SAID and bound < min(supply, ceiling):
        fix = ("a larger share on DALI's hardware decoder (data.dali_hw_decoder_load) would free it"
               if decode == "dali" else f"NVIDIA DALI's hardware decoder ({DALI_INSTALL}) or a larger CPU share of "
                                        "the decode (data.decode: hybrid) would free it")
        alone = " (from its two ends' supplies)" if pipe.derived else ""
        return (f"the {devices}' time, shared by the model and the decode: {decode} alone feeds {fmt_ips(supply)} "
                f"{per}{alone} with the {devices} {100 * pipe.device_share:.0f} % busy decoding, and the model alone "
                f"runs {fmt_ips(ceiling)}; side by side, decode on the {devices} takes {share:.0%} of each sample's "
                f"time, which bounds a run at {fmt_ips(bound)}; the tuned configuration reaches "
                f"{fmt_ips(best.imgs_per_s)}, {reach:.0%} of that. {fix[0].upper()}{fix[1:]}")
    if supply < ceiling:
        return (f"the input pipeline: {decode} alone feeds {fmt_ips(supply)} {per}, less than the model alone "
                f"computes on the {devices} ({fmt_ips(ceiling)}); the tuned configuration reaches "
                f"{fmt_ips(best.imgs_per_s)}, {best.imgs_per_s / supply:.0%} of that")
    return (f"the model's compute on the {devices}: alone, on synthetic data, it runs at {fmt_ips(ceiling)} {per}, "
            f"less than {decode} alone feeds ({fmt_ips(supply)}); the tuned configuration reaches "
            f"{fmt_ips(best.imgs_per_s)}, {best.imgs_per_s / ceiling:.0%} of that")


def waits_for_data(v: TrialView) -> str | None:
    """The share of the trial's measured time its step waited for data (``trainer.meter.timed_batches``), in words;
    None where the trial has no record of it."""
    share = v.attrs.get("data_wait_share")
    if share is None:
        return None
    said = f"{100 * share:.0f} %" if share >= 0.005 else "less than 1 %"
    return f"its step waits {said} of its measured time for data"


def split_line(v: TrialView) -> str | None:
    """``v``'s profiled step (``step_split``) in words: its largest cost and what addresses it, then the others; None
    where it has no profile."""
    split, top = v.attrs.get("step_split"), largest_cost(v)
    if top is None:
        return f"trial {v.number}'s step could not be profiled ({split['error']})" if split.get("error") else None
    name, share = top
    part = STEP_PARTS[name]
    rest = [f"{STEP_PARTS[p].name} {_pct(split[p])}" for p in STEP_PARTS if p != name and split.get(p) is not None]
    unmeasured = [STEP_PARTS[p].name for p in STEP_PARTS if split.get(p) is None]
    steps = f" over {split['steps']} steps" if split.get("steps") else ""
    fix = data_fix(v) if name == "data" else part.fix  # its cores, where they were read, say which way
    text = (f"a profile of trial {v.number}'s step{steps}: it {part.said.format(share=_pct(share))}, the largest "
            f"cost: {fix}")
    if rest:
        text += f"; then {', '.join(rest)}"
    if unmeasured:
        text += f"; {' and '.join(unmeasured)} not measured (no device timeline)"
    return text


def _pct(share: float) -> str:
    return f"{100 * share:.0f} %" if share >= 0.005 else "less than 1 %"


def where_the_step_goes(best: TrialView, profile: TrialView | None = None) -> str:
    """What holds back a configuration the parts do not explain: its step as a profile split it (``profile``, the
    trial whose step was profiled), else as its run split it in two: waiting for data (the input side), or the step
    itself (forward, backward, optimizer, communication and the host's launch gaps, measured as one share), with what
    addresses each; said after "... of that"."""
    profiled_step = split_line(profile) if profile is not None and largest_cost(profile) else None
    if profiled_step:
        return f"; {profiled_step}"
    waits = waits_for_data(best)
    if waits is None:
        return (": something else holds it back (the loader and the job contending for the CPU, a slow step the parts "
                "do not run); bench/profile_step.py shows where a step's time goes")
    if best.attrs["data_wait_share"] >= DATA_WAIT_SAID:
        return f"; {waits}: the input side holds it back — {data_fix(best)}"
    return (f"; {waits}: the step itself runs slower than the model alone (its compute, communication and the host's "
            "launch gaps, measured as one share) — the loader's workers contending with the rank's own process for "
            "the CPU (fewer free it), or work the model alone does not do")


def describe_certainty(v: TrialView, per: str = "imgs/s") -> str:
    """How sure a figure is: its interval and what it stands on."""
    if v.half_width is None:
        return f"its figure has no interval ({no_interval(v.attrs)})"
    a = v.attrs
    text = f"{fmt_pm(v.half_width)} (95 % interval"
    if a.get("ci_batches"):
        text += f", from {a['ci_batches']} batches of {plural(a.get('ci_batch_windows', 1), 'window')}"
    if a.get("steady_start"):
        text += f", the first {a['steady_start']} windows left out as warm-up"
    text += ")"
    if len(a.get(view.RUNS) or []) > 1:
        text += "; its runs combined" + view.describe_runs(v, per)
    if imprecise(v):
        text += "; wider than the precision asked: it reached its time cap (measure.max_s) first"
    if turn_bound(v):
        text += f"; wider than the precision asked: {TURN_BOUND}"
    return text


def cudnn_lines(study, per: str = "imgs/s") -> list[str]:
    """cuDNN's algorithm search as the stages decided it, per precision and layout, with the two measurements each
    decision stands on (steady pace, and the first step, where the search spends its time)."""
    def one(e: dict) -> str:
        first = f", first step {e['first_step_s']:.1f} s" if e.get("first_step_s") is not None else ""
        return f"{fmt_ips(e.get('imgs_per_s'))} {per} (trial {e.get('trial')}{first})"

    out = []
    for label, d in sorted(cudnn_decided(study).items()):
        out.append(f"cuDNN's algorithm search, {label}: {'on' if d.get('benchmark') else 'off'} — with it "
                   f"{one(d.get('with_search') or {})}, without {one(d.get('without_search') or {})}, batch "
                   f"{d.get('batch')}")
    return out


def table(study, sort: str = "number", top: int | None = None, *, storage: str | None = None) -> str:
    from autotune.export import remeasures

    trials = view.views(study)
    best, base = view.fastest(trials), view.baseline(trials)
    again = remeasures(study)
    per = view.rate(study)
    below = {n for n, r in again.items() if r.get("below_baseline")}
    counts = {o: sum(1 for v in trials if v.outcome == o) for o in Outcome}
    summary = f"study {study.study_name}: {plural(len(trials), 'trial')} (" + ", ".join(
        f"{n} {LABELS[o]}" for o, n in counts.items() if n) + ")"
    shown = sorted(trials, key=lambda v: -(v.imgs_per_s or -1)) if sort == "imgs" or top else trials
    searched = view.searched(trials)
    # The gain column names the runs its baseline stands on: trial 0, with its re-measures where it has any.
    against = "+".join(str(r[0]) for r in base.attrs.get(view.RUNS) or [[base.label]]) if base else "0"
    rows = [("#", "stage", "outcome", per, "±", f"vs #{against}", "loss", "util", "wall", "settings / why")]
    for v in shown[:top] if top else shown:
        a = v.attrs
        gain = ""
        if v.feasible and base:
            ratio = v.interval.over(base.interval)
            gain = f"{ratio.value:.2f}x" + ("=" if v.interval.a_tie(base.interval) and v is not base else "")
        pm = (f"{100 * v.half_width:.1f}%" if v.half_width is not None else "?" if v.precise is False else "-") \
            + ("~" if imprecise(v) else "^" if turn_bound(v) else "")
        note = fmt_params(v.shown(searched), 90)
        if v.failure_class and v.outcome != Outcome.PRUNED:
            note = f"{why_failed(v.failure_class, v.failure_message)[:100]}  [{note}]"
        if a.get("fresh_process") and a.get("worker"):  # a function's trial off the live worker: why
            note = f"[fresh process: {a['fresh_process']}]  {note}"
        # The best is a configuration (``view.configurations``): one run more than once is a new view of its first run.
        starred = best is not None and not v.part and v.number == best.number
        mark = ("*" if starred else "") + (BELOW if not v.part and v.number in below else "")
        rows.append((f"{v.label}{mark}", v.stage,
                     v.outcome, fmt_ips(v.imgs_per_s) if v.imgs_per_s is not None else "-", pm, gain,
                     fmt_loss(a), f"{v.util:.0f}%" if v.util is not None else "n/a",
                     fmt_duration(a.get("wall_s")) if a.get("wall_s") is not None else "-", note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.rjust(w) if i in (3, 4, 5, 7, 8) else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r[:-1], widths, strict=True))) + "  " + r[-1] for r in rows]
    notes = []
    notes.append("± the half-width of each figure's 95 % interval; = a ratio whose intervals overlap: a tie with the "
                 "baseline, no measurable gain")
    if any(turn_bound(v) for v in trials):
        notes.append(f"^ {TURN_BOUND}")
    if any(imprecise(v) for v in trials):
        notes.append("~ the trial reached its time cap (measure.max_s) with its interval wider than the precision "
                     "asked (measure.precision): its figure is less certain, as the interval says")
    for v in trials:
        if v.imgs_per_s is not None and v.half_width is None and v.precise is False and v.outcome != Outcome.PRUNED:
            notes.append(f"? trial {v.label}'s interval is unknown: {no_interval(v.attrs)}; its figure is neither a "
                         "tie with another nor measurably apart from it")
    for v in trials:
        if v.attrs.get(LOSS_WARNING):
            notes.append(f"{STILL} trial {v.label}: {v.attrs[LOSS_WARNING]}; its figure stands, but says nothing of "
                         "training until the loss moves")
    for n in sorted(below):
        r = again[n]
        notes.append(f"{BELOW} trial {n} re-measured in a fresh process (`autotune export`) at "
                     f"{fmt_interval(r['imgs_per_s'], r.get('ci_half_width'), per)}, measurably below trial "
                     f"{r['below_baseline']['trial']}'s "
                     f"{fmt_ips(r['below_baseline']['imgs_per_s'])}: its search figure does not hold here")
    first = [f"{topic}: {text}" for topic, text in conclusions(study, trials, storage=storage)]
    return "\n".join([summary, *headline(trials, view.devices(study), again, per), *first, *cudnn_lines(study, per),
                      *lines, *notes, *trial_time(trials), *pruning(trials)])


LABELS = {Outcome.MEASURED: "measured end to end", Outcome.PART: "stage measurements",
          Outcome.INFEASIBLE: "infeasible", Outcome.FAIL: "failed", Outcome.PRUNED: "pruned",
          Outcome.RUNNING: "running", Outcome.WAITING: "waiting"}
"""How ``show``'s first line counts each outcome."""

TIME_PARTS = (("launch_s", "launch"), ("setup_s", "set-up"), ("first_step_s", "first step"),
              ("settle_s", "settling"), ("measure_s", "windows"))


def trial_time(trials: list[TrialView]) -> list[str]:
    """Where a launched trial's time goes, as medians: the lever for shorter trials (and so more of them)."""
    launched = [dict(v.attrs) for v in trials if v.attrs.get("launch_s") is not None]
    if not launched:
        return []
    for a in launched:  # the steps discarded after the first one
        if all(a.get(k) is not None for k in ("warmup_s", "setup_s", "first_step_s")):
            a["settle_s"] = a["warmup_s"] - a["setup_s"] - a["first_step_s"]
    parts = []
    for key, name in TIME_PARTS:
        values = [float(a[key]) for a in launched if a.get(key) is not None]
        if values:
            parts.append(f"{name} {statistics.median(values):.1f} s")
    wall = statistics.median(float(a["wall_s"]) for a in launched if a.get("wall_s") is not None)
    # A trial says why it got a process of its own (``fresh_process``); one of a study recorded before that, by how
    # long its start took.
    said = any(a.get("fresh_process") for a in launched)
    fresh = sum(1 for a in launched if a.get("fresh_process") or not a.get("worker")
                or (not said and (a.get("launch_s") or 0) >= 2.0))
    kept = sum(1 for a in launched if a.get("loader_kept"))
    live = f"{len(launched) - fresh} on a live worker" + (f", {kept} of them with the loader workers an earlier trial "
                                                          "kept" if kept else "")
    return [f"median trial ({fresh} launched, {live}): {wall:.1f} s; medians of its parts: {', '.join(parts)}"]


def pruning(trials: list[TrialView]) -> list[str]:
    """What pruning saved (window time not measured) and what it cost: pruned trials whose last window beat the
    best feasible trial (there should be none)."""
    # A draw dropped before launch (its measured bound below the best) was never stopped: it never ran.
    skipped = [v for v in trials if v.outcome == Outcome.PRUNED and v.attrs.get("pruned_before_launch")]
    pruned = [v for v in trials if v.outcome == Outcome.PRUNED and not v.attrs.get("pruned_before_launch")]
    if not pruned and not skipped:
        return []
    not_launched = (f"{plural(len(skipped), 'draw')} not launched (the bound the stages measured for it was below "
                    "the best)") if skipped else ""
    if not pruned:
        return [f"pruning: {not_launched}"]
    best = view.fastest(trials)
    full = [float(v.attrs["measure_s"]) for v in trials if v.feasible and v.attrs.get("measure_s")]
    typical = statistics.median(full) if full else None
    saved = sum(max(0.0, typical - float(v.attrs.get("measure_s") or 0)) for v in pruned) if typical else None
    lost = [v for v in pruned if best is not None and v.interval is not None and not v.interval.below(best.interval)]
    text = f"pruning: {plural(len(pruned), 'trial')} stopped once measurably slower than the best"
    if saved is not None:
        text += f", about {saved:.0f} s of windows saved"
    text += ("; each one's interval lies below the best's" if not lost else
             f"; {len(lost)} of them no longer measurably slower than the best found since: {[v.number for v in lost]}")
    return [text + (f"; {not_launched}" if not_launched else "")]
