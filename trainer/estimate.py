"""What a measurement's windows say about a pace, and how sure they are.

A measurement is a stream of timed windows: the samples of all ranks and the seconds of the slowest rank. Its figure
is the ratio of their totals over the steady span, which is what a run at that pace pays, and its interval comes
from batch means, the simulation literature's method for autocorrelated output: consecutive windows are grouped into
batches long enough that the batches' figures are nearly uncorrelated, and the spread of those figures says how far
the ratio can be off. A loader's bursts, a slow round of its workers, a clock that wanders make neighbouring windows
alike; batches chosen from the data absorb that where fixed windows agree or disagree by chance. Where the warm-up
ends is found from the data too (MSER: the truncation that minimizes the marginal standard error of what remains),
never past the first half of the windows.

A script's own DataLoader pays a turn at each epoch's end: its last partial round, its workers joined and started
again, its first round. Windows marked ``turn`` hold those; their cost beyond the steady pace is charged at the rate
it recurs over the script's real epoch (``epoch_images``), so a span that holds more or fewer turns than a real run
does still reads what a real run pays.

Pure Python on numbers the ranks agree on (each window is all-reduced as it closes): every rank reaches the same
decision, and the tuner's racing and ties use the same ``Interval``.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

CONFIDENCE = 0.95
"""The confidence of every interval the tool states."""

MIN_BATCHES = 8
"""Fewest batches an interval stands on: fewer leave the variance of their mean to a handful of figures."""

MAX_BATCHES = 30
"""Most batches: beyond this, longer batches buy more independence than more of them buy precision."""

LAG1_Z = statistics.NormalDist().inv_cdf(0.95)
"""The batches are long enough once their figures' lag-1 autocorrelation is below what independent figures exceed
in one case in twenty (``LAG1_Z / sqrt(batches)``): a neighbouring batch then says little about the next, and the
variance of their mean is not understated."""

_Z = statistics.NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
"""The normal quantile of ``CONFIDENCE``: Student's t as the batches grow without end."""

UNKNOWN_SHARE = 0.5
"""The standard error of a cost observed once (one epoch turn, or the first epoch's start measured alone), as a
share of it: one figure says nothing of its own spread, so the interval allows for it costing from nothing to twice
as much."""


class Timed(Protocol):
    """A closed window: what the estimator reads of it."""

    images: float
    """Samples of all ranks."""

    seconds: float
    """Seconds of the slowest rank."""

    turn: bool
    """It holds an epoch's turn of a loader restarted every epoch, and nothing else."""


@dataclass(frozen=True)
class Interval:
    """A figure and its confidence interval, as a relative half-width: ``value ± half_width`` (``0.012``: ±1.2 %)."""

    value: float
    half_width: float

    @property
    def low(self) -> float:
        return self.value * (1 - self.half_width)

    @property
    def high(self) -> float:
        return self.value * (1 + self.half_width)

    @property
    def known(self) -> bool:
        """It has an interval: one window alone gives a figure whose half-width is unbounded."""
        return math.isfinite(self.half_width)

    def below(self, other: Interval) -> bool:
        """Measurably slower than ``other``: the whole interval lies under the other's."""
        return self.high < other.low

    def ties(self, other: Interval) -> bool:
        """The two intervals overlap: the figures cannot be told apart."""
        return not (self.below(other) or other.below(self))

    def a_tie(self, other: Interval) -> bool:
        """A tie as a line may name one: both intervals known, and overlapping. A figure without an interval
        overlaps every other; that says nothing of the two, so it is never called a tie."""
        return self.known and other.known and self.ties(other)

    def over(self, other: Interval) -> Interval:
        """The ratio of two independent figures, its half-width from both (the delta method)."""
        return Interval(self.value / other.value, math.hypot(self.half_width, other.half_width))

    def __str__(self) -> str:
        return f"{self.value:.4g} ± {self.half_width:.1%}"


@dataclass(frozen=True, kw_only=True)
class Estimate(Interval):
    """An interval with what it stands on."""

    start: int
    """The first window of the steady span: the ones before it were warm-up (MSER)."""

    batches: int
    """Batches the interval stands on."""

    batch_windows: int
    """Windows per batch."""

    lag1: float
    """Lag-1 autocorrelation of the batches' figures."""

    steady: float
    """The figure of the steady windows alone, before epoch turns are charged."""

    turns: int = 0
    """Epoch turns measured in the span and charged (``turn_s``); 0 with ``turn_s`` set: the charge is the first
    epoch's start, measured alone."""

    turn_s: float = 0.0
    """Seconds an epoch's turn costs beyond the steady pace (mean of those measured), charged once per epoch."""

    windows_half_width: float = math.inf
    """The half-width without the spread of the first epoch's start charged per epoch (``floor``): what more windows
    narrow."""

    floor: float = 0.0
    """The half-width no number of windows narrows: where no turn was measured in the span, the first epoch's start
    charged per epoch, its spread ``UNKNOWN_SHARE`` of it, at the normal quantile (``stop``)."""

    def record(self) -> dict[str, float | int | None]:
        """Its fields as a summary record or a trial's attrs hold them (``ci_`` for the interval's; None where one
        window gave no interval at all)."""
        known = math.isfinite(self.half_width)
        out: dict[str, float | int | None] = {
            "ci_low": round(self.low, 3) if known else None, "ci_high": round(self.high, 3) if known else None,
            "ci_half_width": round(self.half_width, 5) if known else None,
            "ci_batches": self.batches, "ci_batch_windows": self.batch_windows, "ci_lag1": round(self.lag1, 3),
            "steady_start": self.start, "imgs_per_s_steady": round(self.steady, 3),
            "epoch_turns": self.turns, "epoch_turn_s": round(self.turn_s, 4)}
        return out


MSER_BATCH = 5
"""Windows MSER weighs together (MSER-5): a truncation point is a multiple of this, so that one window that happens
to stand out is not cut for it (cutting it would understate the spread of what remains)."""


def truncation(windows: Sequence[Timed]) -> int:
    """MSER-5's truncation point: the first window of the tail whose marginal standard error is least, at a multiple
    of ``MSER_BATCH`` windows, over the first half of ``windows`` (each window weighted by its seconds: one cut short
    at a turn counts for less)."""
    n = len(windows)
    if n < 2 * MSER_BATCH:
        return 0
    # Suffix sums of images, seconds and images^2/seconds give each tail's weighted squared deviation in O(1):
    # sum T_i (r_i - R)^2 = sum I_i^2 / T_i - R sum I_i, with r_i = I_i / T_i and R the tail's ratio.
    images = seconds = squares = 0.0
    tails = []
    for w in reversed(windows):
        images += w.images
        seconds += w.seconds
        squares += w.images * w.images / w.seconds if w.seconds > 0 else 0.0
        tails.append((images, seconds, squares))
    tails.reverse()

    def mser(d: int) -> float:
        images, seconds, squares = tails[d]
        return (squares - images * images / seconds) / (seconds * seconds) if seconds > 0 else math.inf

    return min(range(0, n // 2 + 1, MSER_BATCH), key=mser)


def estimate(windows: Sequence[Timed], *, epoch_images: float | None = None, first_turn_s: float | None = None,
             truncate: bool = True, final: bool = False) -> Estimate | None:
    """The figure of ``windows`` and its interval; None while they are too few for one (``final``: as good as they
    allow; one window alone gives a figure with no interval, an infinite half-width).

    ``epoch_images``: the samples of all ranks in one of the script's real epochs, where the windows mark its turns
    (``Timed.turn``): each turn's cost beyond the steady pace is charged once per epoch, those measured in the span,
    else ``first_turn_s`` (the first epoch's start, measured alone). ``truncate``: the steady span found from the
    data (MSER), else every window (a train run: its figure is its whole pace)."""
    steady = [w for w in windows if not w.turn and w.seconds > 0]
    d = truncation(steady) if truncate else 0
    if d:  # the span starts at the first steady window MSER keeps; turns before it were warm-up too
        start = next(i for i, w in enumerate(windows) if w is steady[d])
        steady = steady[d:]
    else:
        start = 0
    turns = [w for w in windows[start:] if w.turn]
    images, seconds = sum(w.images for w in steady), sum(w.seconds for w in steady)
    if not steady or seconds <= 0 or images <= 0:
        return None
    rate = images / seconds
    batching = _batches(steady, final=final)
    if batching is None:
        return None
    b, batches, lag1 = batching
    k = len(batches)
    mean_t = statistics.fmean(t for _, t in batches)
    residual = sum((i - rate * t) ** 2 for i, t in batches) / (k - 1) if k > 1 else math.inf
    var_per_image = residual / k / mean_t**2 / rate**4  # the variance of 1 / rate, by the delta method
    per_image, turn_s, once = 1 / rate, 0.0, 0.0
    if epoch_images and (turns or first_turn_s):
        costs = [w.seconds - w.images / rate for w in turns] or [float(first_turn_s)]
        turn_s = max(0.0, statistics.fmean(costs))
        spread = statistics.variance(costs) / len(costs) if len(costs) > 1 else (UNKNOWN_SHARE * turn_s) ** 2
        per_image += turn_s / epoch_images
        var_per_image += spread / epoch_images**2
        # No turn in the span: the epoch is longer than the windows so far, and the next turn may lie past the cap.
        once = spread / epoch_images**2 if not turns else 0.0
    q = t_quantile(k - 1)
    half = q * math.sqrt(var_per_image) / per_image
    return Estimate(value=1 / per_image, half_width=half, start=start, batches=k, batch_windows=b, lag1=lag1,
                    steady=rate, turns=len(turns) if turn_s else 0, turn_s=turn_s,
                    windows_half_width=q * math.sqrt(max(0.0, var_per_image - once)) / per_image,
                    floor=_Z * math.sqrt(once) / per_image)


def _batches(windows: Sequence[Timed], *, final: bool) -> tuple[int, list[tuple[float, float]], float] | None:
    """(windows per batch, each batch's (images, seconds), their lag-1 autocorrelation): the shortest batches, of at
    most ``MAX_BATCHES``, whose figures are nearly uncorrelated, and at least ``MIN_BATCHES`` of them; None when no
    batching of these windows gives both (``final``: the longest batches that still make ``MIN_BATCHES``, or two)."""
    n = len(windows)
    size = max(1, math.ceil(n / MAX_BATCHES))
    fallback = None
    while n // size >= MIN_BATCHES:
        batches = _grouped(windows, size)
        lag1 = _lag1([i / t for i, t in batches])
        if lag1 <= LAG1_Z / math.sqrt(len(batches)):
            return size, batches, lag1
        fallback = (size, batches, lag1)
        size *= 2
    if not final:
        return None
    if fallback is None:
        size = max(1, n // MIN_BATCHES) if n >= MIN_BATCHES else 1
        batches = _grouped(windows, size)
        fallback = (size, batches, _lag1([i / t for i, t in batches]))
    return fallback


def _grouped(windows: Sequence[Timed], size: int) -> list[tuple[float, float]]:
    """Consecutive batches of ``size`` windows, the latest ones (a remainder at the span's start is left out)."""
    k = len(windows) // size
    tail = windows[len(windows) - k * size:]
    return [(sum(w.images for w in tail[j:j + size]), sum(w.seconds for w in tail[j:j + size]))
            for j in range(0, k * size, size)]


def _lag1(xs: Sequence[float]) -> float:
    if len(xs) < 3:
        return 0.0
    mean = statistics.fmean(xs)
    dev = [x - mean for x in xs]
    total = sum(x * x for x in dev)
    if total <= 0:
        return 0.0
    return sum(a * b for a, b in itertools.pairwise(dev)) / total


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """Student's t quantile for a two-sided ``confidence`` interval with ``df`` degrees of freedom (Cornish-Fisher
    expansion about the normal quantile from 3 degrees of freedom on, within 0.2 % of the exact value; exact below)."""
    p = 0.5 + confidence / 2
    if df <= 0:
        return math.inf
    if df == 1:  # exact: the Cauchy distribution
        return math.tan(math.pi * (p - 0.5))
    if df == 2:  # exact
        return (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))
    z = statistics.NormalDist().inv_cdf(p)
    v = float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def stop(est: Estimate | None, *, precision: float, elapsed_s: float, max_s: float) -> str | None:
    """Why a measurement ends here, or None: ``precise`` once its interval's half-width is at most ``precision``;
    ``turn`` once its windows' own part is, where the first epoch's start, seen once, keeps the interval wider than
    ``precision`` however many windows follow (``Estimate.floor``: a script's own loader on epochs longer than the
    trial, its interval then stands as it is); ``capped`` once it has measured for ``max_s`` seconds."""
    if est is not None and est.half_width <= precision:
        return "precise"
    if est is not None and est.floor > precision and est.windows_half_width <= precision:
        return "turn"
    if elapsed_s >= max_s:
        return "capped"
    return None
