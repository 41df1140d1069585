"""A study in words: the three numbers a user wants first — what the GPUs (or CPU ranks) can do (the ceiling), what
each input pipeline can feed (its supply), how close the tuned configuration gets — then every trial as a table, where
a trial's time goes, and what pruning saved. ``autotune show`` prints it; the report and the search's last line use
its parts.
"""

from __future__ import annotations

import statistics

from autotune.search.progress import fmt_duration, fmt_ips, fmt_params
from autotune.search.stages import shown_settings
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


def headline(trials: list[TrialView], devices: str = "GPUs") -> list[str]:
    """Ceiling, supplies, and the tuned configuration against both (lines; fewer when a stage has not run)."""
    lines = []
    top = view.ceiling(trials)
    if top is not None:
        lines.append(f"what the {devices} can do (ceiling, the model on synthetic data): "
                     f"{fmt_ips(top.imgs_per_s)} imgs/s — {top.setting('training.precision')}, "
                     f"{'channels_last' if top.setting('training.channels_last') else 'NCHW'}, batch "
                     f"{top.setting('training.batch_size')} (trial {top.label})")
    feeds = view.supplies(trials)
    if feeds:
        parts = sorted(feeds.items(), key=lambda kv: -kv[1].imgs_per_s)
        lines.append("what each input pipeline can feed (supply, the loader alone): " + " · ".join(
            f"{decode} {fmt_ips(v.imgs_per_s)}" for decode, v in parts) + " imgs/s")
    best, base = view.fastest(trials), view.baseline(trials)
    if best is not None:
        share = f" = {best.imgs_per_s / top.imgs_per_s:.0%} of the ceiling" if top else ""
        gain = f", {best.imgs_per_s / base.imgs_per_s:.2f}x trial {base.label} (the baseline, " \
               f"{fmt_ips(base.imgs_per_s)})" if base and base.imgs_per_s else ""
        lines.append(f"the tuned configuration: trial {best.label}, {fmt_ips(best.imgs_per_s)} imgs/s{share}{gain}")
    return lines


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


def table(study, sort: str = "number", top: int | None = None) -> str:
    trials = view.views(study)
    best, base = view.fastest(trials), view.baseline(trials)
    counts = {o: sum(1 for v in trials if v.outcome == o) for o in ("measured", "part", "infeasible", "fail",
                                                                    "pruned", "running", "waiting")}
    summary = f"study {study.study_name}: {len(trials)} trials (" + ", ".join(
        f"{n} {LABELS[o]}" for o, n in counts.items() if n) + ")"
    shown = sorted(trials, key=lambda v: -(v.imgs_per_s or -1)) if sort == "imgs" or top else trials
    rows = [("#", "stage", "outcome", "imgs/s", "vs #0", "spread", "loss", "util", "wall", "settings / why")]
    for v in shown[:top] if top else shown:
        a = v.attrs
        gain = f"{v.imgs_per_s / base.imgs_per_s:.2f}x" if v.feasible and base else ""
        spread = f"{v.spread:.1%}" + ("!" if a.get("settled") is False else "") if v.spread is not None else "-"
        note = fmt_params(v.params, 90) or fmt_params(shown_settings(a.get("overrides") or {}), 90)
        if v.failure_class and v.outcome != "pruned":
            note = f"{v.failure_class}: {(v.failure_message or '')[:80]}  [{note}]"
        rows.append((f"{v.label}{'*' if v is best else ''}", v.stage,
                     v.outcome, fmt_ips(v.imgs_per_s) if v.imgs_per_s is not None else "-", gain, spread,
                     fmt_loss(a), f"{v.util:.0f}%" if v.util is not None else "n/a",
                     fmt_duration(a.get("wall_s")) if a.get("wall_s") is not None else "-", note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.rjust(w) if i in (3, 4, 5, 7, 8) else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r[:-1], widths, strict=True))) + "  " + r[-1] for r in rows]
    notes = []
    if any(v.attrs.get("settled") is False for v in trials):
        notes.append("! the trial's windows never agreed within the spread target: its figure is the median of its "
                      "latest windows, and less certain")
    return "\n".join([summary, *headline(trials, view.devices(study)), *cudnn_lines(study), *lines, *notes,
                      *trial_time(trials), *pruning(trials)])


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
    pruned = [v for v in trials if v.outcome == "pruned"]
    if not pruned:
        return []
    best = view.fastest(trials)
    full = [float(v.attrs["measure_s"]) for v in trials if v.feasible and v.attrs.get("measure_s")]
    typical = statistics.median(full) if full else None
    saved = sum(max(0.0, typical - float(v.attrs.get("measure_s") or 0)) for v in pruned) if typical else None
    lost = [v for v in pruned if best is not None and (v.attrs.get("imgs_per_s_windows") or [0])[-1]
            > best.imgs_per_s]
    text = f"pruning: {len(pruned)} trial(s) stopped early"
    if saved is not None:
        text += f", about {saved:.0f} s of windows saved"
    text += ("; none had a last window above the best feasible trial" if not lost else
             f"; {len(lost)} had a last window above the best feasible trial: {[v.number for v in lost]}")
    return [text]
