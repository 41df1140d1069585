"""The live view of a search: one line per trial (number, key params, imgs/s, util, best so far, ETA), and the
study table of ``autotune show``."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

SHORT = {
    "training.batch_size": "bs", "training.accum_steps": "acc", "training.precision": "", "training.channels_last": "cl",
    "training.compile": "compile", "loader.num_workers": "wk", "loader.prefetch_factor": "pf",
    "loader.pin_memory": "pin", "loader.persistent_workers": "pers", "data.decode": "", "ddp.bucket_cap_mb": "bkt",
    "ddp.gradient_as_bucket_view": "gbv", "ddp.static_graph": "static", "nccl.algo": "algo", "nccl.proto": "proto",
    "nccl.min_ctas": "minc", "nccl.max_ctas": "maxc", "nccl.buffsize": "buf",
}
"""Short labels; an empty label shows the value alone (``bf16``, ``nvjpeg-gpu`` speak for themselves)."""


def fmt_value(v: Any) -> str:
    if v is None:
        return "default"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def fmt_params(params: dict[str, Any], limit: int | None = None) -> str:
    parts = []
    for path, v in params.items():
        label = SHORT.get(path, path.rsplit(".", 1)[-1])
        if isinstance(v, bool) and label:
            if v:
                parts.append(label)
            continue
        if v is None and label in ("algo", "proto", "minc", "maxc", "buf"):
            continue  # NCCL's own choice: nothing to say
        parts.append(f"{label}={fmt_value(v)}" if label else fmt_value(v))
    text = " ".join(parts)
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def fmt_ips(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


class Progress:
    """Prints the search as it goes. On a terminal a transient status line shows the running trial's windows."""

    def __init__(self, *, total: int, timeout_s: float | None, out: TextIO = sys.stdout):
        self.total, self.timeout_s, self.out = total, timeout_s, out
        self.t0 = time.monotonic()
        self.walls: list[float] = []
        self.done = 0
        self.tty = out.isatty()
        self._status = False

    def say(self, text: str) -> None:
        self._clear()
        print(text, file=self.out, flush=True)

    def status(self, text: str) -> None:
        if self.tty:
            self._clear()
            self.out.write(text[:150])
            self.out.flush()
            self._status = True

    def _clear(self) -> None:
        if self._status:
            self.out.write("\r\033[K")
            self._status = False

    def eta(self) -> float | None:
        if not self.walls:
            return None
        left = (self.total - self.done) * (sum(self.walls) / len(self.walls))
        if self.timeout_s is not None:
            left = min(left, max(0.0, self.timeout_s - (time.monotonic() - self.t0)))
        return left

    def trial_done(self, *, number: int, params: dict[str, Any], outcome: str, ips: float | None,
                   util: float | None, best: tuple[int, float] | None, baseline: float | None, wall: float) -> None:
        self.done += 1
        self.walls.append(wall)
        util_txt = "util n/a" if util is None else f"util {util:.0f}%"
        best_txt = "best -"
        if best is not None:
            gain = f" {best[1] / baseline:.2f}x" if baseline else ""
            best_txt = f"best {fmt_ips(best[1])} (#{best[0]}{gain})"
        ips_txt = f"{fmt_ips(ips)} imgs/s" if ips is not None else ""
        self.say(f"trial {number:>3} [{self.done}/{self.total}] {outcome:<10} {ips_txt:>14}  {util_txt:<9} "
                 f"{best_txt}  {fmt_duration(wall)}, ETA {fmt_duration(self.eta()) if self.done < self.total else '-'}"
                 f"\n      {fmt_params(params, 150)}")
