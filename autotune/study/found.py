"""What a study found, in the one sentence the search's last line, ``show`` and the report share: the fastest
configuration with its interval and its ratio to the baseline, said as the intervals allow (a gain inside the noise is
no gain, configurations whose intervals overlap are a tie, and a figure without an interval is said to have none,
never called a tie)."""

from __future__ import annotations

from autotune.formatting import fmt_interval, fmt_ratio, no_interval
from autotune.study import view
from autotune.study.view import TrialView


def found(trials: list[TrialView], per: str = "imgs/s", *, share: str = "") -> str:
    """What the search found, said as its intervals allow: the fastest with its interval (then ``share``: what it
    is of the ceiling, where that is known) and its ratio to the baseline; a gain inside the noise said to be none;
    the configurations it cannot be told from named."""
    best, base = view.fastest(trials), view.baseline(trials)
    if best is None:
        return "none yet"
    figure = f"{fmt_interval(best.imgs_per_s, best.half_width, per, why(best))}{view.describe_runs(best, per)}{share}"
    if base is not None and (best.baseline or best.interval.a_tie(base.interval)):
        if best.baseline:
            return ("no configuration measurably faster than the baseline on this machine: "
                    f"{describe_baseline(base, per)}")
        return (f"no configuration measurably faster than the baseline on this machine: the fastest, trial "
                f"{best.label} ({figure}), is a tie with {describe_baseline(base, per)}, their intervals overlapping")
    text = f"trial {best.label}, {figure}"
    if base is not None:
        text += f", {fmt_ratio(best.interval.over(base.interval))} {describe_baseline(base, per)}"
    others = view.tied(trials)[1:]  # the fastest first: the same configuration as ``best``, though another view
    if others:
        text += ("; a tie with " + ", ".join(f"trial {a.label} ({fmt_interval(a.imgs_per_s, a.half_width)})"
                                             for a in others)
                 + ": their intervals overlap, so either is as fast as far as measuring can tell")
    return text


def describe_baseline(base: TrialView, per: str = "imgs/s") -> str:
    """The baseline as a line names it, with its figure: trial 0, or trial 0 with its re-measures in fresh
    processes, combined (``trial 0 (the baseline, 1,000 ± 1.5 %)``)."""
    runs = view.describe_runs(base, per)
    return (f"trial {base.label}" + (" with its re-measure" if runs else "") + " (the baseline, "
            f"{fmt_interval(base.imgs_per_s, base.half_width, why=why(base))}"
            f"{runs.replace(' (', '; ', 1)[:-1] if runs else ''})")


def why(v: TrialView) -> str:
    """Why ``v``'s figure has no interval (``no_interval``), for a line that gives its figure."""
    return no_interval(v.attrs)
