"""Throughput measurement: a few steps discarded, then timed windows of global imgs/s until the latest agree.

All ranks run the same state machine and agree on every decision through small all-reduces, so they always close a
window on the same step. A window's throughput is the images of all ranks over the wall time of the *slowest* rank.
Device synchronization happens only at window boundaries (and on every discarded warm-up step), so the measured steps
keep their normal host/device overlap. Step time has settled when the latest ``windows`` windows and the one before
them agree within ``spread_target``; the result is those ``windows``, and every window before them was warm-up (a
loader catching up, a late recompile), so settling costs one window beyond the result's. A script's own loader,
restarted every epoch, is measured in windows of whole worker rounds with each epoch's turn charged beside them, or,
where its epochs are short (``short_epochs``), in windows of whole epochs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import MeasureConfig
from trainer.protocol import STEPS_EVERY_S, Kind

# Warm-up steps whose median sizes the first window: few enough to reflect the pace after the prefetch buffer.
STEP_TIME_STEPS = 5

MIN_ROUNDS = 4
"""Fewest loader rounds in a window of whole rounds (``ThroughputMeter.whole_rounds``). A window ends with its last
round, early or late, and the next window moves the other way. On 1xH200 the rounds of a script's 10-16 PIL workers
ahead of ResNet-50 took 1.9-3.5 s in one run: windows of two rounds varied 2.6-19 % (coefficient of variation), of
four rounds 1.9-10 % (bench/results/2026-12-03-h200-s14-call1-rounds.json); in two searches of that script, one
of the nine trials after trial 0 settled within the 5 % spread target with windows of two rounds."""

TURN_ROUNDS = 4
"""Fewest whole rounds between two epoch turns for windows of whole rounds (``short_epochs``)."""


def short_epochs(length: int, workers: int) -> bool:
    """Whether the epochs of a loader restarted every epoch (``length`` batches from ``workers`` workers) are
    measured in windows of whole epochs (``ThroughputMeter.epoch_windows``) rather than of whole rounds: where the
    rounds between two turns (``length // workers - 1``: the turn takes the last, partial round and the next epoch's
    first) are fewer than ``TURN_ROUNDS``. The steady part between two turns is then shorter than one window, and
    the turn, a third of the epoch or more, is charged from as few samples: on 1xH200 (62 steps from 16 workers) such
    windows varied 17 % from epoch to epoch and never settled. A whole epoch holds every cost a real run pays for it,
    and is at most ``TURN_ROUNDS + 1`` rounds, so the rule itself bounds a window's time; longer epochs keep windows of
    whole rounds, a window running across a turn where it must (the turn is kept out of it and charged)."""
    return length // max(1, workers) - 1 < TURN_ROUNDS


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

    epochs: int = 0
    """Whole epochs it holds (``ThroughputMeter.epoch_windows``); 0: it was cut at steps."""

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
    """Train mode: keep measuring windows for the whole run instead of finishing after the protocol."""

    prefetched_steps: int = 0
    """Steps the input pipeline can serve from batches prefetched before training started; always discarded."""

    span_steps: int = 1
    """Fewest steps in a window: one batch from every loader worker, so a window sees each worker's rhythm."""

    stop_requested: Callable[[], bool] | None = None
    """Asked at every window's end (on every rank; any rank's yes ends the run there): the tuner cancels a pruned
    trial of a live worker this way, without killing the worker."""

    cancelled: bool = False

    epoch_starts: list[float] = field(default_factory=list)
    """Seconds of each epoch boundary of a script's own loader met while measuring (``epoch_boundary``): its workers
    joined and spawned anew, its first batches prefetched. Kept out of the windows, charged by ``charge_epochs``."""

    whole_rounds: bool = False
    """Windows of whole loader rounds (``span_steps`` steps, at least ``MIN_ROUNDS`` of them), opened at a round's
    end. A loader whose workers all start together (at each epoch's start) hands over its batches in bursts, one
    round at a time: a window that ends inside a burst reads its steps as free or as a whole round's wait, a window
    of whole rounds reads their pace whatever the bursts. Set with ``turn_begins``/``turn_ends`` (the runtime)."""

    epoch_windows: bool = False
    """Windows of whole epochs of a script's own loader (``short_epochs``), cut at each epoch's start
    (``epoch_begins``: before its loader's workers spawn), as many epochs as ``window_s`` asks, one at least: an
    epoch's end, restart and first round fall inside, so a window's figure is what a run pays per epoch and nothing
    is charged beside it. The warm-up ends at an epoch's start; one that outlasts ``warmup_max_s`` there says the
    epochs are too long to be windows, and the meter goes on as without (``whole_rounds``, ``epoch_boundary``).
    Set by the runtime where every rank's epoch has as many batches, so they all cut on the same step."""

    epochs_per_window: int = 1

    epoch_turns: list[dict[str, float]] = field(default_factory=list)
    """Each epoch's turn measured inside the windows (``turn_begins`` to ``turn_ends``): its ``seconds``, and the
    ``steps`` and this rank's ``images`` it served. Kept out of the windows, charged net of what those steps take at
    the steady pace (``turn_costs``)."""

    steps_total: int = 0
    """Every ``step()`` so far, warm-up included."""

    state: str = "warmup"
    warmup_steps: int = 0
    warmup_capped: bool = False
    step_time_s: float = 0.0
    steps_per_window: int = 1
    windows: list[Window] = field(default_factory=list)
    _step_times: list[float] = field(default_factory=list)
    _t_start: float = field(default_factory=time.perf_counter)
    _t_last: float = field(default_factory=time.perf_counter)
    _win_steps: int = 0
    _win_images: int = 0
    _win_t0_wall: float = 0.0
    _win_t0: float = 0.0
    _win_paused: float = 0.0
    _loss: torch.Tensor | None = None
    _loss_at_open: torch.Tensor | None = None
    _win_nonfinite: torch.Tensor | None = None
    _t_said: float = field(default_factory=time.monotonic)
    _t_step: float = field(default_factory=time.monotonic)
    _charge: dict[str, Any] | None = None
    _epoch_end_s: float = 0.0
    _turn: dict[str, Any] | None = None
    _round_pos: int = 0
    """Steps since the last round's end that the windows know of: the start, or the end of an epoch's turn."""
    _win_epochs: int = 0
    _t_epoch: float = field(default_factory=time.perf_counter)

    @property
    def in_rounds(self) -> bool:
        """Whether the batches come in rounds of the loader's workers: windows of whole rounds (a script's own
        loader restarted every epoch), or a buffer the workers filled (they make the batches: all started together,
        they hand them over a round at a time, one burst per round)."""
        return self.whole_rounds or self.prefetched_steps >= self.span_steps > 1

    @property
    def pace_steps(self) -> int:
        """The steps whose pace sizes the first window: a whole round where batches come in rounds (inside one,
        a burst makes single steps free or slow), else the last few."""
        return max(1, self.span_steps) if self.in_rounds else STEP_TIME_STEPS

    @property
    def min_steps(self) -> int:
        """Steps discarded at least: the warm-up minimum, and the prefetch buffer plus the steps whose pace sizes
        the first window. A loader serves buffered steps at once: a first window sized on them would be aimed at
        ten times the steps a loader-bound run makes in ``window_s``."""
        buffered = self.prefetched_steps + max(STEP_TIME_STEPS, self.pace_steps) if self.prefetched_steps else 0
        return max(self.cfg.warmup_min_steps, buffered)

    @property
    def done(self) -> bool:
        return self.state == "done"

    def step(self, loss: torch.Tensor | None = None, images: int | None = None) -> None:
        """Call after every optimizer step (every batch in loader mode) with the step's loss (a device tensor; read
        only at window boundaries, where the device is synchronized anyway) and, when it is not ``images_per_step``,
        how many images (samples, tokens) this rank consumed in it."""
        if loss is not None:
            self._loss = loss
        self.steps_total += 1
        images = self.images_per_step if images is None else int(images)
        if self.state == "measure" and loss is not None:  # counted on the device (no sync), read at the window's end
            bad = (~torch.isfinite(loss.detach())).any().to(torch.int32)
            self._win_nonfinite = bad if self._win_nonfinite is None else self._win_nonfinite + bad
        if self._turn is not None:  # an epoch's turn: neither a warm-up step nor a window's
            self._turn["steps"] += 1
            self._turn["images"] += images
        elif self.state == "warmup":
            self._round_pos += 1
            self._warmup_step()
        elif self.state == "measure":
            self._round_pos += 1
            self._win_steps += 1
            self._win_images += images
            if self._win_steps >= self.steps_per_window and not self.epoch_windows:
                self._close_window()
        now, self._t_step = self._t_step, time.monotonic()
        if self.state != "done" and self._t_step - self._t_said >= STEPS_EVERY_S:
            self._say({"kind": Kind.STEPS, "t": time.time(), "steps": self.steps_total, "state": self.state,
                       "step_s": round(self._t_step - now, 4)})

    def _say(self, record: dict[str, Any]) -> None:
        self._t_said = time.monotonic()
        self.emit(record)

    @contextlib.contextmanager
    def paused(self):
        """Validation or a checkpoint runs inside: that time is not training. A warm-up step's clock skips it; an
        open window leaves it out of its seconds (``paused_s``), so windows run across epoch boundaries: a train
        run's windows measure its whole pace, an epoch's loader restart included, even when epochs are short."""
        sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            seconds = time.perf_counter() - start
            if self._turn is not None:  # the turn's clock skips it too: it is no part of the epoch's turn
                self._turn["t0"] += seconds
            if self.state == "warmup":
                self._t_last += seconds
            elif self.state == "measure":
                self._win_paused += seconds

    @contextlib.contextmanager
    def epoch_boundary(self, *, end: bool = False):
        """An epoch's end (``end``: its loader's workers joined) or the next one's start (workers spawned, first
        batches prefetched) inside a measurement: paused like validation (the windows stay steady whatever an
        epoch's length), and its seconds kept, an end's added to the start after it (``epoch_starts``), to charge
        over a real epoch (``charge_epochs``). In a train run's continuous windows it is part of the pace: nothing
        is paused."""
        # A turn holds it already; a window of whole epochs holds it too.
        if self.continuous or self.epoch_windows or self.state == "done" or self._turn is not None:
            yield
            return
        start = time.perf_counter()
        with self.paused():
            yield
        seconds = time.perf_counter() - start
        if end:
            self._epoch_end_s = seconds
        else:
            self.epoch_starts.append(seconds + self._epoch_end_s)
            self._epoch_end_s = 0.0

    def turn_begins(self) -> None:
        """An epoch's turn begins: its loader is about to serve the epoch's last, partial round of worker batches
        (or, with a whole last round, to find the epoch over), then joins its workers and starts the next epoch's.
        Until ``turn_ends`` every step is kept out of the windows (their clock stops, their steps and images are not
        counted) and out of warm-up; the turn's own seconds, steps and images are kept (``epoch_turns``). Begun and
        ended on the same steps on every rank (the runtime checks that every rank's epoch has as many batches), so
        the ranks' windows still close on the same step. In a train run's continuous windows it is part of the pace:
        nothing is kept out; nor in windows of whole epochs, which hold their turns."""
        if self.continuous or self.epoch_windows or self.state == "done" or self._turn is not None:
            return
        sync(self.device)
        self._turn = {"t0": time.perf_counter(), "steps": 0, "images": 0, "state": self.state}

    def turn_ends(self) -> None:
        """The epoch's turn ends: the new epoch's first round of worker batches (one per worker, all started
        together) has been served, and its loader is back at a round's end: windows of whole rounds go on from
        here. A turn that began and ended while measuring is kept for the charge."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        sync(self.device)
        now = time.perf_counter()
        self._round_pos = 0
        if self.state == "warmup":
            self._t_last = now  # no warm-up step's time
        elif self.state == "measure":
            self._win_paused += now - max(turn["t0"], self._win_t0)
            if turn["state"] == "measure":
                self.epoch_turns.append({"seconds": now - turn["t0"], "steps": turn["steps"],
                                         "images": turn["images"]})

    def epoch_begins(self, images: int = 0) -> None:
        """An epoch of the script's own loader begins (before its ``iter``), on the same step on every rank; windows
        of whole epochs (``epoch_windows``) are cut here. ``images``: what this rank's steps consumed before it but
        have not yet counted (an accumulation that runs over the epoch's end): the ending epoch's. The first
        epoch's start, before any step, and the warm-up's are not a window's: the first epoch spawns its workers
        cold, so the first window is the epoch after the warm-up's last."""
        if not self.epoch_windows or self.state == "done" or not self.steps_total:
            return
        if self.state == "warmup":
            sync(self.device)
            now = time.perf_counter()
            epoch_s, self._t_epoch = now - self._t_epoch, now
            not_done = allreduce([float(self.warmup_steps < max(1, self.min_steps))], dist.ReduceOp.MAX,
                                 self.device)[0]
            if not not_done:
                self._measure_from(now, capped=False, epoch_s=epoch_s)
            return
        self._win_images += images
        self._win_epochs += 1
        if self._win_epochs >= self.epochs_per_window:
            self._close_window()

    def turn_costs(self) -> list[float]:
        """What each epoch turn cost this rank beyond the steady pace: its seconds less the seconds its steps take
        at the steady windows' pace (this rank's share of it). A turn starts at a round's end and ends at one, so
        this is what an epoch of the loader pays for its end and its start: the partial last round, the workers
        joined and spawned anew, their first batches made before any arrives (empty without a steady figure)."""
        rates = [w.imgs_per_s for w in self.steady()]
        steady = statistics.median(rates) / _world() if rates else 0.0
        if steady <= 0:
            return []
        return [t["seconds"] - t["images"] / steady for t in self.epoch_turns]

    def charge_epochs(self, *, epoch_images: int | None, start_s: float | None, measured: int | None = None) -> None:
        """What a real run pays per epoch, charged to the figure: ``start_s`` seconds of boundary (the slowest
        rank's) once every ``epoch_images`` images (all ranks'), on top of the steady windows' pace. The summary's
        ``imgs_per_s`` is then the charged figure; ``imgs_per_s_steady`` the windows' own. ``measured``: how many
        epoch boundaries ``start_s`` stands on (default: those this meter met). Windows of whole epochs hold their
        boundaries already: nothing is charged."""
        if epoch_images and start_s and not self.epoch_windows:
            met = len(self.epoch_turns) or len(self.epoch_starts)
            self._charge = {"epoch_images": int(epoch_images), "epoch_start_s": round(start_s, 6),
                            "epoch_starts": met if measured is None else measured}
            if self.epoch_turns:  # this rank's, each net of its steps at the steady pace
                self._charge["epoch_turns_s"] = [round(c, 4) for c in self.turn_costs()]

    # ---- warm-up -----------------------------------------------------------------------------------------------

    def _warmup_step(self) -> None:
        sync(self.device)
        now = time.perf_counter()
        self._step_times.append(now - self._t_last)
        self._t_last = now
        self.warmup_steps += 1
        # Steps served from the loader's prefetch buffer are fast and say nothing about the steady state, and the
        # first step carries cudnn autotuning and the communicators' set-up: at least one step is always discarded.
        done = self.warmup_steps >= max(1, self.min_steps)
        if self.whole_rounds:  # the first window opens at a round's end
            done = done and self._round_pos % max(1, self.span_steps) == 0
        if self.epoch_windows:  # ... or at an epoch's start (epoch_begins)
            done = False
        capped = now - self._t_start >= self.cfg.warmup_max_s
        # Every rank must leave warm-up on the same step: when all are done, or any has hit the time cap.
        not_done, any_capped = allreduce([float(not done), float(capped)], dist.ReduceOp.MAX, self.device)
        if not_done and not any_capped:
            return
        # Windows of whole epochs leave warm-up here only when capped before an epoch's start: an epoch longer than
        # the warm-up may take is too long to be a window.
        self.epoch_windows = False
        self._measure_from(now, capped=bool(not_done))

    def _measure_from(self, now: float, *, capped: bool, epoch_s: float = 0.0) -> None:
        """The warm-up's end (on the same step on every rank): the first window aimed at ``window_s`` from the
        slowest rank's pace, in steps, or in epochs from its last epoch's seconds (``epoch_s``)."""
        if self.in_rounds:  # the last round's pace
            recent = self._step_times[-self.pace_steps:]
            local = sum(recent) / len(recent)
        else:
            local = statistics.median(self._step_times[-STEP_TIME_STEPS:])
        self.step_time_s, epoch_s = allreduce([local, epoch_s], dist.ReduceOp.MAX, self.device)
        self.warmup_capped = capped
        self.steps_per_window = self._fit(round(self.cfg.window_s / max(self.step_time_s, 1e-9)))
        if self.epoch_windows:
            self.epochs_per_window = max(1, round(self.cfg.window_s / max(epoch_s, 1e-9)))
        self._say({"kind": "warmup_done", "t": time.time(), "steps": self.warmup_steps,
                   "seconds": round(now - self._t_start, 4), "step_time_s": self.step_time_s,
                   "capped": self.warmup_capped, "steps_per_window": self.steps_per_window,
                   **({"epochs_per_window": self.epochs_per_window} if self.epoch_windows else {})})
        self.state = "measure"
        self._open_window()

    # ---- windows -----------------------------------------------------------------------------------------------

    def _open_window(self) -> None:
        # A copy, queued on the device: the training loop may reuse the tensor it handed over.
        self._loss_at_open = self._loss.detach().clone() if self._loss is not None else None
        sync(self.device)
        self._win_t0_wall, self._win_t0, self._win_steps, self._win_paused = time.time(), time.perf_counter(), 0, 0.0
        self._win_images = self._win_epochs = 0
        self._win_nonfinite = None

    def _reaim(self, count: int, seconds: float) -> int:
        """How many of a window's ``count`` units (steps or epochs), which took ``seconds``, fill ``window_s``: at
        most 2x either way."""
        aim = round(count * self.cfg.window_s / max(seconds, 1e-9))
        return min(2 * count, max(count // 2, aim))

    def _close_window(self) -> None:
        sync(self.device)
        seconds = time.perf_counter() - self._win_t0 - self._win_paused
        t1_wall = time.time()
        # Slowest rank's duration; earliest start and latest end, so the tuner clips GPU samples to the true span.
        stop = float(bool(self.stop_requested and self.stop_requested()))
        bad = float(self._win_nonfinite.item()) if self._win_nonfinite is not None else 0.0
        # Non-finite steps: the worst rank's count, in the same collective as the slowest rank's duration.
        slowest, neg_t0, t1, stop, bad = allreduce([seconds, -self._win_t0_wall, t1_wall, stop, bad],
                                                    dist.ReduceOp.MAX, self.device)
        losses = [float(x.float().item()) if x is not None else 0.0 for x in (self._loss_at_open, self._loss)]
        images, *loss_sums = allreduce([float(self._win_images), *losses], dist.ReduceOp.SUM, self.device)
        start, end = ((x / _world() for x in loss_sums) if self._loss is not None else (None, None))
        w = Window(index=len(self.windows), t0=-neg_t0, t1=t1, steps=self._win_steps, images=int(images),
                   seconds=slowest, loss_start=start if self._loss_at_open is not None else None, loss_end=end,
                   loss_nonfinite=int(bad), epochs=self._win_epochs if self.epoch_windows else 0)
        self.windows.append(w)
        self._say({"kind": "window", "window": w.index, "t0": w.t0, "t1": w.t1, "steps": w.steps, "images": w.images,
                   "seconds": round(w.seconds, 6), "imgs_per_s": round(w.imgs_per_s, 3),
                   "loss_start": _round(w.loss_start), "loss_end": _round(w.loss_end),
                   "loss_nonfinite": w.loss_nonfinite, "paused_s": round(self._win_paused, 6),
                   "epochs": w.epochs})
        # Re-aim the next window at window_s from what this one really took (every rank computes the same number),
        # by at most 2x either way: one burst of buffered batches must not make the next window ten times too long.
        self.steps_per_window = self._fit(self._reaim(w.steps, w.seconds))
        if w.epochs:  # the same in whole epochs, one at least
            self.epochs_per_window = max(1, self._reaim(w.epochs, w.seconds))
        self.cancelled = bool(stop)
        if self.cancelled or (not self.continuous and self._protocol_complete()):
            self.state = "done"
            return
        self._open_window()

    def _fit(self, steps: int) -> int:
        """A window's steps: at least one batch from every loader worker; whole rounds of them where the loader's
        batches come in rounds (``whole_rounds``)."""
        span = max(1, self.span_steps)
        if not self.whole_rounds:
            return max(span, steps)
        return max(MIN_ROUNDS, round(steps / span)) * span

    def _protocol_complete(self) -> bool:
        return len(self.windows) >= self.cfg.max_windows or self.settled

    @property
    def settled(self) -> bool:
        """The latest ``windows`` windows and the one before them agree within the spread target, and each is a real
        window: at least half of ``window_s`` (the first ones are aimed from warm-up steps and can be short). The
        window before is the evidence that the pace had already settled when the result's windows began, and is
        not part of the result: without it, a slow ramp (loader workers, caches, clocks warming up) reads as steady
        while it lasts (on the CPU demo, one re-measure 6 % below a long reference run)."""
        tail = self.windows[-(self.cfg.windows + 1):]
        return (len(tail) == self.cfg.windows + 1 and self.spread(tail) <= self.cfg.spread_target
                and all(w.seconds >= self.cfg.window_s / 2 for w in tail))

    def steady(self) -> list[Window]:
        """The windows the result stands on: the latest ``windows`` of them once they agree (earlier ones were still
        warming up), else the latest half (at least ``windows``): the earlier half is presumed warm-up. A train run
        stands on all of them: its figure is the whole run's pace, epoch boundaries and all."""
        if self.continuous:
            return list(self.windows)
        if self.settled:
            return self.windows[-self.cfg.windows:]
        return self.windows[-max(self.cfg.windows, len(self.windows) // 2):]

    @staticmethod
    def spread(windows: list[Window]) -> float:
        rates = [w.imgs_per_s for w in windows]
        if len(rates) < 2:
            return 0.0
        med = statistics.median(rates)
        return (max(rates) - min(rates)) / med if med > 0 else float("inf")

    def summary(self) -> dict[str, Any]:
        used = self.steady()
        rates = [w.imgs_per_s for w in used]
        steady = statistics.median(rates) if rates else None
        charged = {}
        if self._charge and steady:
            # An epoch's images at the steady pace, plus its boundary: the rate a real run of such epochs sees.
            epoch_s = self._charge["epoch_images"] / steady + self._charge["epoch_start_s"]
            charged = {**self._charge, "imgs_per_s_steady": round(steady, 3)}
            steady = self._charge["epoch_images"] / epoch_s
        return {
            "imgs_per_s": round(steady, 3) if steady else None,
            **charged,
            "imgs_per_s_windows": [round(w.imgs_per_s, 3) for w in self.windows],
            "windows_used": [w.index for w in used],
            "imgs_per_s_min": round(min(rates), 3) if rates else None,
            "imgs_per_s_max": round(max(rates), 3) if rates else None,
            "spread": round(self.spread(used), 5),
            "windows": len(self.windows),
            # Windows of whole epochs (each window's record says how many): their figure is a run's, nothing charged.
            "epoch_windows": self.epoch_windows,
            "warmup_steps": self.warmup_steps,
            "warmup_capped": self.warmup_capped,
            "settled": self.settled,
            "cancelled": self.cancelled,
            "step_time_s": self.step_time_s,
            # The loss over the windows the figure stands on: a figure is only worth something if the run learns.
            "loss_start": _round(used[0].loss_start) if used else None,
            "loss_end": _round(used[-1].loss_end) if used else None,
            "loss_nonfinite_in_windows": sum(w.loss_nonfinite for w in used),
        }


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
