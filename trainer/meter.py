"""Throughput measurement: a few steps discarded, then short timed windows until the figure is known well enough.

All ranks run the same state machine and agree on every decision through small all-reduces, so they always close a
window on the same step. A window's figure is the samples of all ranks over the wall time of the *slowest* rank.
Devices synchronize only at window edges (and on every discarded warm-up step), so the measured steps keep their
normal host/device overlap. What the windows say, and when they say it well enough, is ``trainer.estimate``'s: the
figure over the steady span with its 95 % interval, the span's start found from the data; the measurement ends once
the interval's half-width is at most ``measure.precision``, or after ``measure.max_s`` with the interval as it is.
A train run measures to its end and stands on every window.

A script's own DataLoader, restarted at each epoch, turns at each epoch's end (``turn_begins`` to ``turn_ends``,
from the runtime): the turn is a window of its own, marked, and its cost is charged at the rate it recurs over the
real epoch (``epoch_steps``), one process with the steady windows beside it.

Where the loop's batches come through ``timed_batches``, each window also holds the time the host waited for them
(``Window.wait_s``), and the summary splits the measured time in two: waiting for data, and the rest, the step's own
(forward, backward, optimizer, communication and the host's launch gaps, as one share).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import MeasureConfig
from trainer.estimate import Estimate, estimate, stop
from trainer.profile import waiting
from trainer.protocol import STEPS_EVERY_S, Kind

PACE_STEPS = 5
"""Fewest warm-up steps whose mean pace sizes the first window (one from every loader worker at least: a loader's
workers hand over their batches in bursts, one per round)."""


@dataclass
class Window:
    index: int
    t0: float
    t1: float
    steps: int
    images: int
    seconds: float
    loss_start: float | None = None
    """Mean loss over the ranks of the last step before the window (None in loader mode: no loss)."""

    loss_end: float | None = None
    """Mean loss over the ranks of the window's last step."""

    loss_nonfinite: int = 0
    """Steps of the window whose loss was NaN or inf on some rank. The loss is computed before the GradScaler
    scales anything, so a healthy fp16 run has none: a non-finite loss is a forward pass that overflowed."""

    turn: bool = False
    """It holds an epoch's turn of the script's own loader, and only that (``ThroughputMeter.turn_begins``)."""

    wait_s: float = 0.0
    """Seconds of the window the host spent waiting for the next batch (``ThroughputMeter.waited``), on the rank
    that waited longest."""

    @property
    def imgs_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ThroughputMeter:
    cfg: MeasureConfig
    images_per_step: int
    """Images (the job's unit: images, tokens, samples) this rank consumes per ``step()`` call (batch x
    accumulation), unless a step says how many it consumed (a user's script may vary them)."""

    device: torch.device
    emit: Callable[[dict[str, Any]], None]
    continuous: bool = False
    """Train mode: keep measuring windows for the whole run instead of finishing once the figure is known."""

    prefetched_steps: int = 0
    """Steps the input pipeline can serve from batches prefetched before training started; always discarded."""

    span_steps: int = 1
    """Fewest steps in a window: one batch from every loader worker, so a window sees each worker's rhythm."""

    stop_requested: Callable[[], bool] | None = None
    """Asked at every window's end (on every rank; any rank's yes ends the run there): the tuner cancels a pruned
    trial of a live worker this way, without killing the worker."""

    epoch_steps: int | None = None
    """Steps in one real epoch of a loader whose turns are marked (``turn_begins``): each turn is charged once per
    that many steps' samples."""

    first_turn_s: float | None = None
    """The first epoch's start, measured alone before any step: charged per epoch where no turn is measured."""

    clock: Callable[[], float] = time.perf_counter
    """The timer of the windows (a test drives the meter on a clock of its own)."""

    waits_timed: bool = False
    """The loop's waits for its batches are told (``waited``): the summary holds the step's split."""

    step_split: dict[str, Any] | None = None
    """The profile of a few steps after the windows (``measure.profile_steps``, ``trainer.profile``); None where
    none ran."""

    cancelled: bool = False
    ended: str | None = None
    """Why the measurement ended: ``precise``, ``turn``, ``capped`` (``trainer.estimate.stop``) or ``cancelled``."""

    steps_total: int = 0
    """Every ``step()`` so far, warm-up included."""

    state: str = "warmup"
    warmup_steps: int = 0
    warmup_capped: bool = False
    step_time_s: float = 0.0
    steps_per_window: int = 1
    windows: list[Window] = field(default_factory=list)
    latest: Estimate | None = None
    """The estimate after the latest window (None while the windows are too few for one)."""

    _step_times: list[float] = field(default_factory=list)
    _t_start: float | None = None
    _t_last: float | None = None
    _t_measure: float = 0.0
    _win_steps: int = 0
    _win_images: int = 0
    _win_t0_wall: float = 0.0
    _win_t0: float = 0.0
    _win_paused: float = 0.0
    _win_wait: float = 0.0
    _in_turn: bool = False
    _loss: torch.Tensor | None = None
    _loss_at_open: torch.Tensor | None = None
    _win_nonfinite: torch.Tensor | None = None
    _t_said: float = field(default_factory=time.monotonic)
    _t_step: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._t_start = self._t_last = self.clock()

    @property
    def min_steps(self) -> int:
        """Steps discarded at least: the warm-up minimum, and the prefetch buffer plus the steps whose pace sizes
        the first window. A loader serves buffered steps at once: a first window sized on them would be aimed at
        ten times the steps a loader-bound run makes in ``window_s``."""
        buffered = self.prefetched_steps + self.pace_steps if self.prefetched_steps else 0
        return max(1, self.cfg.warmup_min_steps, buffered)

    @property
    def pace_steps(self) -> int:
        return max(PACE_STEPS, self.span_steps)

    @property
    def done(self) -> bool:
        return self.state == "done"

    def step(self, loss: torch.Tensor | None = None, images: int | None = None) -> None:
        """Call after every optimizer step (every batch in loader mode) with the step's loss (a device tensor; read
        only at window edges, where the device is synchronized anyway) and, when it is not ``images_per_step``,
        how many images (samples, tokens) this rank consumed in it."""
        if loss is not None:
            self._loss = loss
        self.steps_total += 1
        images = self.images_per_step if images is None else int(images)
        if self.state == "warmup":
            self._warmup_step()
        elif self.state == "measure":
            if loss is not None:  # counted on the device (no sync), read at the window's end
                bad = (~torch.isfinite(loss.detach())).any().to(torch.int32)
                self._win_nonfinite = bad if self._win_nonfinite is None else self._win_nonfinite + bad
            self._win_steps += 1
            self._win_images += images
            if not self._in_turn and self._win_steps >= self.steps_per_window:
                self._close_window()
        now, self._t_step = self._t_step, time.monotonic()
        if self.state != "done" and self._t_step - self._t_said >= STEPS_EVERY_S:
            self._say({"kind": Kind.STEPS, "t": time.time(), "steps": self.steps_total, "state": self.state,
                       "step_s": round(self._t_step - now, 4)})

    def waited(self, seconds: float) -> None:
        """The host waited ``seconds`` for the loop's next batch (``timed_batches``): counted into the open window
        (a warm-up step's wait is left out, as the warm-up is)."""
        self.waits_timed = True
        if self.state == "measure":
            self._win_wait += seconds

    def _say(self, record: dict[str, Any]) -> None:
        self._t_said = time.monotonic()
        self.emit(record)

    @contextlib.contextmanager
    def paused(self):
        """Validation or a checkpoint runs inside: that time is not training. A warm-up step's clock skips it; an
        open window leaves it out of its seconds (``paused_s``)."""
        sync(self.device)
        start = self.clock()
        try:
            yield
        finally:
            sync(self.device)
            seconds = self.clock() - start
            if self.state == "warmup":
                self._t_last += seconds
            elif self.state == "measure":
                self._win_paused += seconds

    def turn_begins(self) -> None:
        """An epoch's turn begins: the script's own loader is about to serve its epoch's last, partial round of
        worker batches, then joins its workers and starts the next epoch's. While measuring, the window open so far
        closes here and the turn is a window of its own, closed by ``turn_ends``. Called on the same step on every
        rank (the runtime checks that every rank's epoch has as many batches). A train run's windows hold their
        turns as they come: nothing is marked."""
        if self.continuous or self.state == "done" or self._in_turn:
            return
        self._in_turn = True
        if self.state == "measure" and self._win_steps:
            self._close_window()

    def turn_ends(self) -> None:
        """The turn ends: the new epoch's first round of worker batches (one per worker, all started together) has
        been served. Its window closes, marked."""
        if not self._in_turn:
            return
        if self.state == "measure" and self._win_steps:
            self._close_window(turn=True)
        self._in_turn = False
        if self.state == "warmup":
            self._t_last = self.clock()  # no warm-up step's pace

    # ---- warm-up -----------------------------------------------------------------------------------------------

    def _warmup_step(self) -> None:
        sync(self.device)
        now = self.clock()
        if not self._in_turn:
            self._step_times.append(now - self._t_last)
        self._t_last = now
        self.warmup_steps += 1
        # Steps served from the loader's prefetch buffer are fast and say nothing about the steady state, and the
        # first step carries cudnn autotuning and the communicators' set-up: at least one step is always discarded.
        # A turn in progress finishes first: the first window is a steady one.
        done = self.warmup_steps >= self.min_steps and not self._in_turn
        capped = now - self._t_start >= self.cfg.warmup_max_s
        # Every rank must leave warm-up on the same step: when all are done, or any has hit the time cap.
        not_done, any_capped = allreduce([float(not done), float(capped)], dist.ReduceOp.MAX, self.device)
        if not_done and not (any_capped and not self._in_turn):
            return
        self._measure_from(now, capped=bool(not_done))

    def _measure_from(self, now: float, *, capped: bool) -> None:
        """The warm-up's end (on the same step on every rank): the first window aimed at ``window_s`` from the
        slowest rank's pace over the last warm-up steps."""
        recent = self._step_times[-self.pace_steps:] or [now - self._t_start]
        self.step_time_s = allreduce([sum(recent) / len(recent)], dist.ReduceOp.MAX, self.device)[0]
        self.warmup_capped = capped
        self.steps_per_window = max(self.span_steps, round(self.cfg.window_s / max(self.step_time_s, 1e-9)))
        self._say({"kind": Kind.WARMUP_DONE, "t": time.time(), "steps": self.warmup_steps,
                   "seconds": round(now - self._t_start, 4), "step_time_s": self.step_time_s,
                   "capped": self.warmup_capped, "steps_per_window": self.steps_per_window})
        self.state = "measure"
        self._t_measure = now
        self._open_window()

    # ---- windows -----------------------------------------------------------------------------------------------

    def _open_window(self) -> None:
        # A copy, queued on the device: the training loop may reuse the tensor it handed over.
        self._loss_at_open = self._loss.detach().clone() if self._loss is not None else None
        sync(self.device)
        self._win_t0_wall, self._win_t0, self._win_steps, self._win_paused = time.time(), self.clock(), 0, 0.0
        self._win_images, self._win_wait = 0, 0.0
        self._win_nonfinite = None

    def _close_window(self, *, turn: bool = False) -> None:
        sync(self.device)
        now = self.clock()
        seconds = now - self._win_t0 - self._win_paused
        t1_wall = time.time()
        stop_asked = float(bool(self.stop_requested and self.stop_requested()))
        bad = float(self._win_nonfinite.item()) if self._win_nonfinite is not None else 0.0
        # The slowest rank's duration and time measured so far, the worst rank's non-finite steps, the earliest start
        # and latest end (the tuner clips GPU samples to the true span), the longest wait for data (a rank kept
        # waiting holds the others at the step's all-reduce): one collective, so every rank decides alike.
        slowest, elapsed, neg_t0, t1, stop_asked, bad, wait = allreduce(
            [seconds, now - self._t_measure, -self._win_t0_wall, t1_wall, stop_asked, bad, self._win_wait],
            dist.ReduceOp.MAX, self.device)
        losses = [float(x.float().item()) if x is not None else 0.0 for x in (self._loss_at_open, self._loss)]
        images, *loss_sums = allreduce([float(self._win_images), *losses], dist.ReduceOp.SUM, self.device)
        start, end = ((x / _world() for x in loss_sums) if self._loss is not None else (None, None))
        w = Window(index=len(self.windows), t0=-neg_t0, t1=t1, steps=self._win_steps, images=int(images),
                   seconds=slowest, loss_start=start if self._loss_at_open is not None else None, loss_end=end,
                   loss_nonfinite=int(bad), turn=turn, wait_s=wait)
        self.windows.append(w)
        self.latest = None if self.continuous else self.estimate()
        self._say({"kind": Kind.WINDOW, "window": w.index, "t0": w.t0, "t1": w.t1, "steps": w.steps,
                   "images": w.images, "seconds": round(w.seconds, 6), "imgs_per_s": round(w.imgs_per_s, 3),
                   "loss_start": _round(w.loss_start), "loss_end": _round(w.loss_end),
                   "loss_nonfinite": w.loss_nonfinite, "paused_s": round(self._win_paused, 6), "turn": turn,
                   "wait_s": round(w.wait_s, 6) if self.waits_timed else None,
                   "estimate": _estimate_record(self.latest)})
        if not turn:  # the next window aimed at window_s from this one's pace, by at most 2x either way
            aim = round(w.steps * self.cfg.window_s / max(w.seconds, 1e-9))
            spw = self.steps_per_window
            self.steps_per_window = max(self.span_steps, min(2 * spw, max(spw // 2, aim)))
        self.cancelled = bool(stop_asked)
        self.ended = "cancelled" if self.cancelled else None if self.continuous else stop(
            self.latest, precision=self.cfg.precision, elapsed_s=elapsed, max_s=self.cfg.max_s)
        if self.ended:
            self.state = "done"
            return
        self._open_window()

    # ---- the figure --------------------------------------------------------------------------------------------

    def epoch_images(self) -> float | None:
        """Samples of all ranks in one real epoch (``epoch_steps`` steps at the windows' samples per step)."""
        steps = sum(w.steps for w in self.windows)
        if not self.epoch_steps or not steps:
            return None
        return self.epoch_steps * sum(w.images for w in self.windows) / steps

    def estimate(self, *, final: bool = False) -> Estimate | None:
        """The figure of the windows so far and its interval (``trainer.estimate.estimate``): the steady span's,
        epoch turns charged; a train run's over every window."""
        return estimate(self.windows, epoch_images=self.epoch_images(), first_turn_s=self.first_turn_s,
                        truncate=not self.continuous, final=final)

    def used(self, est: Estimate | None) -> list[Window]:
        """The windows the figure stands on: from the steady span's start."""
        return self.windows[est.start:] if est is not None else list(self.windows)

    def summary(self) -> dict[str, Any]:
        est = self.estimate(final=True)
        used = self.used(est)
        return {
            "imgs_per_s": round(est.value, 3) if est else None,
            **(est.record() if est else {}),
            "precise": bool(est and est.half_width <= self.cfg.precision),
            "ended": self.ended or ("run" if self.continuous else None),
            "imgs_per_s_windows": [round(w.imgs_per_s, 3) for w in self.windows],
            "turn_windows": [w.index for w in self.windows if w.turn],
            "windows_used": [w.index for w in used],
            "windows": len(self.windows),
            "measured_s": round(sum(w.seconds for w in self.windows), 3),
            "warmup_steps": self.warmup_steps,
            "warmup_capped": self.warmup_capped,
            "cancelled": self.cancelled,
            "step_time_s": self.step_time_s,
            # The loss over the windows the figure stands on: a figure is only worth something if the run learns.
            "loss_start": _round(used[0].loss_start) if used else None,
            "loss_end": _round(used[-1].loss_end) if used else None,
            "loss_nonfinite_in_windows": sum(w.loss_nonfinite for w in used),
            "data_wait_share": data_wait_share(used) if self.waits_timed else None,
            "step_split": self.step_split,
        }


def data_wait_share(windows: list[Window]) -> float | None:
    """The share of the windows' time the host waited for data; the rest is the step's own. Over the steady
    windows, an epoch's turn left out: the turn is charged once per real epoch, not at the rate it was measured.
    None where no time was measured."""
    steady = [w for w in windows if not w.turn]
    seconds = sum(w.seconds for w in steady)
    return round(min(1.0, sum(w.wait_s for w in steady) / seconds), 4) if seconds > 0 else None


def timed_batches(batches: Iterator, waited: Callable[[float], None],
                  clock: Callable[[], float] = time.perf_counter) -> Iterator:
    """``batches``, each ``next`` timed and told to ``waited`` (``ThroughputMeter.waited``): how long the host
    waited for the batch.

    On a GPU this host time is the step's wait for data, not the device's: a step's kernels are launched
    asynchronously, so the host runs ahead of the device until something blocks it. Where the input keeps up, a
    batch is ready when asked for and the host blocks elsewhere (a full launch queue, a value read back from the
    device); where it does not, the host blocks here while the device drains its queue and then idles. A pipeline
    that decodes or copies on the device does its host part (launches, its own syncs) inside ``next``: the input
    side's share of the step, counted here too."""
    while True:
        t0 = clock()
        with waiting():  # marked for a profile of the step, where one runs
            try:
                batch = next(batches)
            except StopIteration:
                return
        waited(clock() - t0)
        yield batch


def _estimate_record(est: Estimate | None) -> dict[str, Any] | None:
    """The running estimate a window record carries (the tuner races trials on it)."""
    if est is None:
        return None
    return {"imgs_per_s": round(est.value, 3), "half_width": round(est.half_width, 5), "start": est.start}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round(x: float | None) -> float | None:
    """Six significant digits; NaN and inf stay as they are (json writes them as NaN / Infinity)."""
    return float(f"{x:.6g}") if x is not None else None


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def allreduce(values: list[float], op, device: torch.device) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()
