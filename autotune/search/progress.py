"""The live view of a search: the trial running now, and a line for each trial as it ends."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from autotune.formatting import fmt_duration, fmt_interval, fmt_ips, fmt_params, fmt_ratio
from autotune.study.view import Outcome
from trainer.estimate import Interval

PHASES = {"start": "set-up", "ready": "first step", "first_step": "warm-up", "warmup_done": "measuring",
          "summary": "done", "error": "failed"}
"""What a trial does after each record of the job (the phase shown until the next record)."""

TICK_S = 1.0

ENDED = {Outcome.MEASURED: "ok", Outcome.PART: "measured", Outcome.PRUNED: "pruned",
         Outcome.INFEASIBLE: "infeasible:{failure}", Outcome.FAIL: "FAIL:{failure}"}
"""How a trial's line says it ended (``{failure}``: its failure class)."""


class Progress:
    """Prints the search as it goes: a line per trial when it ends; while it runs, its phase (launch, set-up,
    warm-up, window k), its latest imgs/s and the best so far — on a terminal as one live line, elsewhere (a log
    file, CI) as plain lines at each phase change."""

    def __init__(self, *, total: int, timeout_s: float | None, out: TextIO = sys.stdout, per: str = "imgs/s"):
        self.total, self.timeout_s, self.out, self.per = total, timeout_s, out, per
        self.t0 = time.monotonic()
        self.walls: list[float] = []
        self.done = 0
        self.tty = out.isatty()
        self._status = False
        self._last_tick = 0.0
        self.best: tuple[int | str, Interval] | None = None
        self.current: dict[str, Any] = {}

    def say(self, text: str) -> None:
        self._clear()
        print(text, file=self.out, flush=True)

    # ---- while a trial runs -----------------------------------------------------------------------------------

    def begin(self, number: int, stage: str) -> None:
        self.current = {"number": number, "stage": stage, "phase": "launch", "ips": None, "half_width": None,
                        "window": 0}
        self._show(plain=False)

    def phase(self, number: int, stage: str, kind: str | None, rec: dict) -> None:
        phase = PHASES.get(str(kind))
        if phase is None or phase == self.current.get("phase"):
            return
        self.current["phase"] = phase
        if phase != "done":
            self._show(plain=phase in ("warm-up", "measuring"))

    def window(self, number: int, stage: str, k: int, ips: float, half_width: float | None = None) -> None:
        """Window ``k`` closed: the figure so far (its interval once the windows make one, else that window's)."""
        self.current.update(phase=f"window {k}", ips=ips, half_width=half_width, window=k)
        self._show(plain=True)

    def tick(self, number: int, stage: str, elapsed: float) -> None:
        """Called while waiting: refreshes the live line's clock (at most once a second)."""
        now = time.monotonic()
        if self.tty and now - self._last_tick >= TICK_S:
            self._last_tick = now
            self.current["elapsed"] = elapsed
            self._show(plain=False)

    def _show(self, *, plain: bool) -> None:
        c = self.current
        if not c:
            return
        best = f"best {fmt_ips(self.best[1].value)} (#{self.best[0]})" if self.best else "best -"
        ips = ""
        if c.get("ips") is not None:
            ips = f" {fmt_interval(c['ips'], c['half_width'])}" if c.get("half_width") is not None else \
                f" {fmt_ips(c['ips'])}"
            ips += f" {self.per}"
        clock = f" {fmt_duration(c['elapsed'])}" if c.get("elapsed") is not None else ""
        text = f"trial {c['number']} [{c['stage']}] {c['phase']}{ips}{clock} · {best}"
        if self.tty:
            self._clear()
            self.out.write(text[:150])
            self.out.flush()
            self._status = True
        elif plain:
            print(f"  {text}", file=self.out, flush=True)

    def _clear(self) -> None:
        if self._status:
            self.out.write("\r\033[K")
            self._status = False

    # ---- when a trial ends -------------------------------------------------------------------------------------

    def eta(self) -> float | None:
        if not self.walls:
            return None
        left = (self.total - self.done) * (sum(self.walls) / len(self.walls))
        if self.timeout_s is not None:
            left = min(left, max(0.0, self.timeout_s - (time.monotonic() - self.t0)))
        return left

    def trial_done(self, *, number: int | str, stage: str, params: dict[str, Any], outcome: Outcome,
                   failure: str | None = None, stopped_early: bool = False, ips: float | None,
                   half_width: float | None, util: float | None, best: tuple[int | str, Interval] | None,
                   baseline: Interval | None, wall: float, counted: bool = True) -> None:
        """``outcome``: how it ended, ``failure`` its failure class, ``stopped_early``: a measurement of a part whose
        windows said enough; ``counted``: the trial is one of the budget's (a draw pruned before launch is not)."""
        said = "measured (stopped early)" if stopped_early else ENDED[outcome].format(failure=failure)
        if counted:
            self.done += 1
            self.walls.append(wall)
        self.best, self.current = best, {}
        util_txt = "util n/a" if util is None else f"util {util:.0f}%"
        best_txt = "best -"
        if best is not None:
            # The baseline against itself is 1.00x exactly, whatever its interval.
            gain = (f" {fmt_ratio(best[1].over(baseline))}" if best[1] != baseline else " 1.00x") if baseline else ""
            best_txt = f"best {fmt_ips(best[1].value)} (#{best[0]}{gain})"
        ips_txt = f"{fmt_interval(ips, half_width)} {self.per}" if ips is not None else ""
        eta = fmt_duration(self.eta()) if self.done < self.total else "-"
        self.say(f"trial {number:>3} [{self.done}/{self.total}] {stage:<9} {said:<10} {ips_txt:>22}  "
                 f"{util_txt:<9} {best_txt}  {fmt_duration(wall)}, ETA {eta}\n      {fmt_params(params, 150)}")
