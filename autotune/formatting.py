"""How every line and table of the tool writes settings and figures: a throughput, its interval, a ratio with its
uncertainty, a duration. One module, so that a figure reads the same in the search's lines, ``show``, ``export``,
``train`` and the report."""

from __future__ import annotations

import math
from typing import Any

from trainer.estimate import Interval
from trainer.knobs import knob


def fmt_ips(x: float | None) -> str:
    """A throughput: a decimal below 100, none above."""
    return "-" if x is None else f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def known(half_width: float | None) -> bool:
    """A half-width that is an interval: not missing, not unbounded (one window alone)."""
    return half_width is not None and math.isfinite(half_width)


def fmt_pm(half_width: float | None, why: str | None = None) -> str:
    """An interval's relative half-width: ``± 1.2 %``; ``± ?`` where none was measured, with ``why`` where given
    (``no_interval``): every line that gives a half-width goes through here, so a missing one reads the same
    everywhere and never stops a line from being written."""
    if known(half_width):
        return f"± {100 * half_width:.1f} %"
    return "± ?" + (f" (no interval: {why})" if why else "")


def no_interval(attrs: dict) -> str:
    """Why a trial's figure has no interval, from its attrs: the windows it stands on were too few for one (one
    window gives a figure and no spread), or it was measured before the tool gave intervals."""
    n, seconds = attrs.get("windows"), attrs.get("measured_s")
    if n is None and attrs.get("precise") is None:
        return "measured before intervals were"
    what = plural(n, "window") if n is not None else "its windows"
    return what + (f" in {seconds:.1f} s" if seconds is not None else "") + ", too few for one"


def fmt_interval(x: float | None, half_width: float | None, per: str | None = None, why: str | None = None) -> str:
    """A figure with its 95 % interval: ``1,234 ± 1.2 % imgs/s`` (``why``: see ``fmt_pm``)."""
    if x is None:
        return "-"
    return f"{fmt_ips(x)} {fmt_pm(half_width)}" + (f" {per}" if per else "") + \
        (f" (no interval: {why})" if why and not known(half_width) else "")


def per_second(unit: str | None) -> str:
    """The label of a rate in a job's unit: ``imgs/s`` for the built-in job's images, ``tokens/s`` for a script that
    counts tokens."""
    return "imgs/s" if unit in (None, "images") else f"{unit}/s"


def fmt_ratio(r: Interval) -> str:
    """A ratio of two figures with its uncertainty: ``2.31x ± 2.6 %``."""
    return f"{r.value:.2f}x {fmt_pm(r.half_width)}"


def describe_gain(best: Interval, base: Interval) -> str:
    """What a ratio to the baseline says, honestly: the ratio with its uncertainty, and where the intervals overlap,
    that the two are a tie (no gain the noise does not explain)."""
    ratio = best.over(base)
    if best.a_tie(base):
        return f"{fmt_ratio(ratio)}: a tie with the baseline (their intervals overlap)"
    return f"{fmt_ratio(ratio)} the baseline"


LOSS_WARNING = "loss_warning"
"""The trial attr of what makes its figure doubtful though it stands (``autotune.verdict.still_loss``)."""

STILL = "!"
"""Marks a loss that never moved across a trial's windows (``LOSS_WARNING``)."""


def fmt_loss(attrs: dict) -> str:
    """A trial's loss over its measured windows, start -> end; "diverged" when it did not stay finite: a figure
    without its loss says nothing about training; ``!`` after one that never moved (``LOSS_WARNING``)."""
    if attrs.get("loss_finite") is False:
        return "diverged"
    start, end = attrs.get("loss_start"), attrs.get("loss_end")
    if end is None:
        return "-"
    text = f"{start:.3g}->{end:.3g}" if start is not None else f"{end:.3g}"
    return text + (STILL if attrs.get(LOSS_WARNING) else "")


def fmt_value(v: Any) -> str:
    if v is None:
        return "default"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def fmt_params(params: dict[str, Any], limit: int | None = None) -> str:
    """Settings in a line, each by its knob's short label (``trainer.knobs``); an empty label shows the value alone
    (``bf16``, ``nvjpeg-gpu`` speak for themselves), as does a stage measurement's mode (``loader``)."""
    parts = []
    for path, v in params.items():
        k = knob(path)
        label = "" if path == "training.mode" else k.label
        if isinstance(v, bool) and label:
            if v:
                parts.append(label)
            continue
        if k.is_omitted(v):
            continue  # e.g. NCCL's own choice: nothing to say
        parts.append(f"{label}={fmt_value(v)}" if label else fmt_value(v))
    text = " ".join(parts)
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def plural(n: int, word: str) -> str:
    """``1 trial``, ``2 trials``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "?"
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
