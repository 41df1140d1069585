"""A study in words: what a user wants first — what limits the job, the tuned configuration and the commands that
export and run it, how sure its figure is; the three numbers behind that (what the GPUs or CPU ranks can do, the
ceiling; what each input pipeline can feed, its supply; how close the tuned configuration gets) — then every trial as
a table, where a trial's time goes, and what pruning saved. ``autotune show`` prints it; the report and the search's
last line use its parts.
"""

from __future__ import annotations

import statistics

from autotune.search.bounds import ceiling_share, pair_label, point_of, trainable_ceiling
from autotune.search.progress import fmt_duration, fmt_ips, fmt_params
from autotune.study import view
from autotune.study.view import TrialView


def fmt_loss(attrs: dict) -> str:
    """The loss over the measured windows, start -> end; "diverged" when it did not stay finite: a figure without
    its loss says nothing about training."""
    if attrs.get("loss_finite") is False:
        return "diverged"
    start, end = attrs.get("loss_start"), attrs.get("loss_end")
    if end is None:
        return "-"
    return f"{start:.3g}->{end:.3g}" if start is not None else f"{end:.3g}"


def plural(n: int, word: str) -> str:
    """``1 trial``, ``2 trials``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


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


def loss_words(attrs: dict) -> str:
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
                     f"{fmt_ips(top.imgs_per_s)} {per} — {pair_label(point_of(top)).replace(' ', ', ')}, batch "
                     f"{top.setting('training.batch_size')} (trial {top.label})")
    feeds = view.supplies(trials)
    if feeds:
        parts = sorted(feeds.items(), key=lambda kv: -kv[1].imgs_per_s)
        lines.append("what each input pipeline can feed (supply, the loader alone): " + " · ".join(
            f"{decode} {fmt_ips(v.imgs_per_s)}" for decode, v in parts) + f" {per}")
    best, base = view.fastest(trials), view.baseline(trials)
    if best is not None:
        share, of = "", ceiling_share(best.imgs_per_s, top.imgs_per_s) if top else None
        if of is not None:
            share = f" = {of:.0%} of the ceiling"
        elif top:  # a share above the whole says the measurement is no bound for this run, not that it beat one
            share = (f", above the ceiling measured (trial {top.label}, {fmt_ips(top.imgs_per_s)} at batch "
                     f"{top.setting('training.batch_size')}): the model alone bounds nothing at this run's settings")
        gain = f", {best.imgs_per_s / base.imgs_per_s:.2f}x trial {base.label} ({baseline_words(base)}, " \
               f"{fmt_ips(base.imgs_per_s)})" if base and base.imgs_per_s else ""
        again = (remeasured or {}).get(best.number)
        fresh = ""
        if again and again.get("imgs_per_s") is not None:
            fresh = f"; re-measured in a fresh process: {fmt_ips(again['imgs_per_s'])}"
            if again.get("below_baseline"):
                fresh += f" {BELOW} below trial {again['below_baseline']['trial']}"
        lines.append(f"the tuned configuration: trial {best.label}, {fmt_ips(best.imgs_per_s)} {per}"
                     f"{view.runs_words(best, per)}{share}{gain}{fresh}")
    return lines


def above(top: TrialView) -> str:
    """Why a ceiling is no bound on a run faster than it: where it was measured."""
    return f"the model alone, measured at batch {top.setting('training.batch_size')}, bounds nothing at its settings"


def baseline_words(base: TrialView) -> str:
    """What the baseline trial is, for a line that names it: trial 0, or its re-measure in a fresh process."""
    again = base.attrs.get("remeasure_of")
    return "the baseline" + (f": trial {again} measured again in a fresh process" if again is not None else "")


BELOW = "↓"
"""Marks a trial whose fresh-process re-measure (``autotune export``) fell below trial 0's figure."""


def unsettled(v: TrialView) -> bool:
    """The trial ran its measurement to the end and its windows never settled. A pruned trial was stopped before
    the end: that it did not settle says nothing."""
    return v.attrs.get("settled") is False and v.outcome != "pruned"


def image_loader_line(trials: list[TrialView], per: str = "imgs/s") -> str | None:
    """Where a user's script's own image loader bounds its job (its supply below the ceiling) and the project's
    pipeline, measured alone on the same folder (the ``image_loader`` stage), would feed more: both figures and the
    change to make, in one line; else None."""
    own = view.supplies(trials).get(view.OWN_LOADER)
    theirs = max(view.stage(trials, view.IMAGE_LOADER), key=lambda v: v.imgs_per_s, default=None)
    top = trainable_ceiling(trials)
    if own is None or theirs is None or top is None or own.imgs_per_s >= top.imgs_per_s \
            or theirs.imgs_per_s <= own.imgs_per_s:
        return None
    call = f'run.image_loader("{theirs.setting("data.path")}", image_size={theirs.setting("data.image_size")})'
    return (f"the script's own loader feeds {fmt_ips(own.imgs_per_s)} {per} (trial {own.label}); {call} would feed "
            f"{fmt_ips(theirs.imgs_per_s)} ({theirs.setting('data.decode')}, trial {theirs.label}) on the same files: "
            "build its loader with that instead of run.loader(dataset, ...) (README: Tune your own script)")


def conclusions(study, trials: list[TrialView] | None = None, *, storage: str | None = None) -> list[tuple[str, str]]:
    """What a reader should learn first, as (topic, sentence): what limits the job, the tuned configuration's
    settings, the commands that export and run it, how sure its figure is. ``storage``: the ``--storage`` the
    commands need (None: the default one finds the study)."""
    from autotune.export import remeasures

    trials = view.views(study) if trials is None else trials
    devices, per = view.devices(study), view.rate(study)
    best, top, feeds = view.fastest(trials), trainable_ceiling(trials), view.supplies(trials)
    out: list[tuple[str, str]] = []
    synthetic = best is not None and best.setting("data.kind") == "synthetic"
    decode = view.pipeline(best) if best is not None and not synthetic else None
    feed = feeds.get(decode) if decode is not None else None
    if synthetic:
        out.append(("what limits it", f"the model's compute on the {devices}: the data is synthetic (made on the "
                                      "device), so no input pipeline takes part"))
    elif top is not None and feed is not None:
        limit, other = ((f"the input pipeline: {decode} alone feeds {fmt_ips(feed.imgs_per_s)} {per}, less than "
                         f"the model alone computes on the {devices} ({fmt_ips(top.imgs_per_s)})", feed)
                        if feed.imgs_per_s < top.imgs_per_s else
                        (f"the model's compute on the {devices}: alone, on synthetic data, it runs at "
                         f"{fmt_ips(top.imgs_per_s)} {per}, less than {decode} alone feeds "
                         f"({fmt_ips(feed.imgs_per_s)})", top))
        if other is top and ceiling_share(best.imgs_per_s, top.imgs_per_s) is None:
            out.append(("what limits it", f"not the model's compute as measured: the tuned configuration reaches "
                                          f"{fmt_ips(best.imgs_per_s)} {per}, above it ({above(top)}); "
                                          f"{decode} alone feeds {fmt_ips(feed.imgs_per_s)}"))
        else:
            out.append(("what limits it", f"{limit}; the tuned configuration reaches {fmt_ips(best.imgs_per_s)}, "
                                          f"{best.imgs_per_s / other.imgs_per_s:.0%} of that"))
    elif top is not None:
        share = ceiling_share(best.imgs_per_s, top.imgs_per_s) if best is not None else None
        reach = ("" if best is None else f"; the tuned configuration reaches {share:.0%} of it" if share is not None
                 else f"; the tuned configuration runs above it ({above(top)})")
        out.append(("what limits it", f"the {devices} run the model alone at {fmt_ips(top.imgs_per_s)} {per} (the "
                                      "ceiling); "
                    + (f"its input pipeline ({decode}) was not measured alone" if decode else
                       "no input pipeline was measured alone") + reach))
    else:
        out.append(("what limits it", "not measured: this study has no stage measurements (the model alone, each "
                                      "pipeline alone), so it says how fast, not what limits"))
    change = image_loader_line(trials, per)
    if change:
        out.append(("the change to make", change))
    if best is None:
        out.append(("its settings", "none yet: no end-to-end trial has completed; run `autotune search`"))
        return out
    settings = fmt_params(best.shown(view.searched(trials)))
    out.append(("its settings", f"trial {best.number}: {settings}" + (" (the baseline's own)" if best.baseline
                                                                     else "")))
    where = f" --study {study.study_name}" + (f" --storage {storage}" if storage else "")
    out.append(("run it", f"`autotune export best.yaml{where}` (measures it again in a fresh process), then "
                          "`autotune train --config best.yaml`"))
    windows = len(best.attrs.get("imgs_per_s_windows") or [])
    spread = f"spread {best.spread:.1%}" if best.spread is not None else "spread not recorded"
    sure = (f"the median of its latest windows ({windows} measured), {spread}"
            + ("; its windows never settled within the spread target, so the figure is less certain"
               if unsettled(best) else "; its windows settled within the spread target" if best.attrs.get("settled")
               else ""))
    again = remeasures(study).get(best.number)
    if again and again.get("imgs_per_s") is not None:
        sure += f"; in a fresh process it measured {fmt_ips(again['imgs_per_s'])} ({again['ratio']:.0%} of it)"
        if again.get("below_baseline"):
            b = again["below_baseline"]
            sure += (f", below trial {b['trial']}'s {fmt_ips(b['imgs_per_s'])}: here it is not faster than the "
                     "baseline")
    else:
        sure += "; not yet measured again in a fresh process (`autotune export` does)"
    out.append(("how sure", sure))
    return out


def cudnn_lines(study) -> list[str]:
    """cuDNN's algorithm search as the stages decided it, per precision and layout, with the two measurements each
    decision stands on (steady pace, and the first step, where the search spends its time)."""
    def one(e: dict) -> str:
        first = f", first step {e['first_step_s']:.1f} s" if e.get("first_step_s") is not None else ""
        return f"{fmt_ips(e.get('imgs_per_s'))} imgs/s (trial {e.get('trial')}{first})"

    out = []
    for pair, d in sorted((study.user_attrs.get("cudnn") or {}).items()):
        out.append(f"cuDNN's algorithm search, {pair}: {'on' if d.get('benchmark') else 'off'} — with it "
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
    counts = {o: sum(1 for v in trials if v.outcome == o) for o in ("measured", "part", "infeasible", "fail",
                                                                    "pruned", "running", "waiting")}
    summary = f"study {study.study_name}: {plural(len(trials), 'trial')} (" + ", ".join(
        f"{n} {LABELS[o]}" for o, n in counts.items() if n) + ")"
    shown = sorted(trials, key=lambda v: -(v.imgs_per_s or -1)) if sort == "imgs" or top else trials
    searched = view.searched(trials)
    rows = [("#", "stage", "outcome", per, f"vs #{base.label if base else 0}", "spread", "loss", "util", "wall",
             "settings / why")]
    for v in shown[:top] if top else shown:
        a = v.attrs
        gain = f"{v.imgs_per_s / base.imgs_per_s:.2f}x" if v.feasible and base else ""
        spread = f"{v.spread:.1%}" + ("!" if unsettled(v) else "") if v.spread is not None else "-"
        note = fmt_params(v.shown(searched), 90)
        if v.failure_class and v.outcome != "pruned":
            note = f"{why_failed(v.failure_class, v.failure_message)[:100]}  [{note}]"
        # The best is an answer (``view.answers``): a configuration run more than once is a new view of its first run.
        starred = best is not None and not v.part and v.number == best.number
        mark = ("*" if starred else "") + (BELOW if not v.part and v.number in below else "")
        rows.append((f"{v.label}{mark}", v.stage,
                     v.outcome, fmt_ips(v.imgs_per_s) if v.imgs_per_s is not None else "-", gain, spread,
                     fmt_loss(a), f"{v.util:.0f}%" if v.util is not None else "n/a",
                     fmt_duration(a.get("wall_s")) if a.get("wall_s") is not None else "-", note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.rjust(w) if i in (3, 4, 5, 7, 8) else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r[:-1], widths, strict=True))) + "  " + r[-1] for r in rows]
    notes = []
    if any(unsettled(v) for v in trials):
        notes.append("! the trial's windows never settled: before its window limit, its latest windows and the one "
                     "before them never agreed within the spread target (that window shows the pace had stopped "
                     "changing); its figure is the median of its latest windows, and less certain")
    for n in sorted(below):
        r = again[n]
        notes.append(f"{BELOW} trial {n} re-measured in a fresh process (`autotune export`) at "
                     f"{fmt_ips(r['imgs_per_s'])} {per}, below trial {r['below_baseline']['trial']}'s "
                     f"{fmt_ips(r['below_baseline']['imgs_per_s'])}: its search figure does not hold here")
    first = [f"{topic}: {text}" for topic, text in conclusions(study, trials, storage=storage)]
    return "\n".join([summary, *headline(trials, view.devices(study), again, per), *first, *cudnn_lines(study), *lines,
                      *notes, *trial_time(trials), *pruning(trials)])


LABELS = {"measured": "measured end to end", "part": "stage measurements", "infeasible": "infeasible",
          "fail": "failed", "pruned": "pruned", "running": "running", "waiting": "waiting"}

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
    reused = sum(1 for a in launched if (a.get("launch_s") or 0) < 2.0 and a.get("worker"))
    return [f"median trial ({len(launched)} launched, {reused} on a live worker): {wall:.1f} s; medians of its "
            f"parts: {', '.join(parts)}"]


def pruning(trials: list[TrialView]) -> list[str]:
    """What pruning saved (window time not measured) and what it cost: pruned trials whose last window beat the
    best feasible trial (there should be none)."""
    # A draw dropped before launch (its measured bound below the best) was never stopped: it never ran.
    skipped = [v for v in trials if v.outcome == "pruned" and v.attrs.get("pruned_before_launch")]
    pruned = [v for v in trials if v.outcome == "pruned" and not v.attrs.get("pruned_before_launch")]
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
    lost = [v for v in pruned if best is not None and (v.attrs.get("imgs_per_s_windows") or [0])[-1]
            > best.imgs_per_s]
    text = f"pruning: {plural(len(pruned), 'trial')} stopped early"
    if saved is not None:
        text += f", about {saved:.0f} s of windows saved"
    text += ("; none had a last window above the best feasible trial" if not lost else
             f"; {len(lost)} had a last window above the best feasible trial: {[v.number for v in lost]}")
    return [text + (f"; {not_launched}" if not_launched else "")]
