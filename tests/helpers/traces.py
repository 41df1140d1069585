"""Synthetic step-time traces of known mean, fed to the real meter on a clock of their own (no sleeping).

Each trace says how long its steps take: a pace drawn around a mean that the trace knows step by step, so the true
figure over whatever span the meter stands on is known exactly. ``bursty`` is a script's own DataLoader restarted
every epoch: its workers all start together at each epoch's start and hand over their batches a round at a time,
rounds of varying length, the model taking a fixed time per step, and each epoch's end joins the workers and spawns
them again; its true figure is its long-run pace, epoch turns included, from a run a thousand epochs long.

The figures are inputs of tests, not measurements of anything.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field

import torch

from trainer.config import MeasureConfig
from trainer.meter import ThroughputMeter

IMAGES = 8
"""Samples per step."""


@dataclass
class Clock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Trace:
    """Step times around a known mean (``mean_s(i)`` of step ``i``), with ``noise`` (a share, normal)."""

    kind: str
    seed: int
    base_s: float = 0.05
    noise: float = 0.05
    rng: random.Random = field(init=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)

    def mean_s(self, i: int) -> float:
        if self.kind == "warmup":  # twice as slow at first, settling over ~40 steps
            return self.base_s * (1 + math.exp(-i / 40))
        if self.kind == "trend":  # slower and slower: 20 % over 1,000 steps
            return self.base_s * (1 + 0.2 * i / 1000)
        return self.base_s

    def step_s(self, i: int) -> float:
        return max(1e-4, self.mean_s(i) * (1 + self.noise * self.rng.gauss(0, 1)))


@dataclass
class Bursty:
    """A script's own loader ahead of a model: ``workers`` workers, each round's batches ready together after
    ``round_s`` times a factor drawn from [1 - ``swing``, 1 + ``swing``]; ``compute_s`` a step; each epoch of
    ``length`` batches ends with ``join_s`` and the next starts after ``spawn_s``, its workers all started then."""

    seed: int
    workers: int = 8
    length: int = 100
    round_s: float = 0.6
    swing: float = 0.3
    compute_s: float = 0.04
    join_s: float = 0.1
    spawn_s: float = 0.4
    rng: random.Random = field(init=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)

    def epochs(self):
        """Per step: (seconds, turn edge), the edge ``begin`` or ``end`` where the runtime marks the turn (from
        the last whole round's end to the end of the next epoch's first round)."""
        tail, now, last = self.length % self.workers, 0.0, 0.0
        while True:
            start = now + self.spawn_s
            ready = start
            rounds = []
            for _ in range(math.ceil(self.length / self.workers)):
                ready += self.round_s * (1 + self.swing * (2 * self.rng.random() - 1))
                rounds.append(ready)
            for i in range(self.length):
                done = max(now, rounds[i // self.workers]) + self.compute_s
                edge = "end" if i + 1 == self.workers else "begin" if i + 1 == self.length - tail else None
                yield done - last, edge
                now = last = done
            now += self.join_s  # the epoch's end: its workers joined (the next spawn is the next epoch's start)

    def true_rate(self) -> float:
        return _long_run(self.workers, self.length, self.round_s, self.swing, self.compute_s, self.join_s,
                         self.spawn_s)


@functools.cache
def _long_run(*shape, epochs: int = 1000) -> float:
    """The long-run figure of a ``Bursty`` loader of this shape: samples over seconds of a thousand epochs."""
    steps = epochs * shape[1]
    seconds = sum(s for _, (s, _) in zip(range(steps), Bursty(-1, *shape).epochs(), strict=False))
    return steps * IMAGES / seconds


@dataclass
class Measured:
    meter: ThroughputMeter
    true_rate: float
    """The trace's true figure over the span the meter's estimate stands on."""

    seconds: float
    """Seconds of windows measured."""


def measure(trace: Trace | Bursty, *, precision: float = 0.02, max_s: float = 30.0, window_s: float = 0.25,
            warmup_min_steps: int = 10) -> Measured:
    """The meter driven by ``trace`` until it ends, and the truth over the span its figure stands on."""
    clock = Clock()
    cfg = MeasureConfig(warmup_min_steps=warmup_min_steps, window_s=window_s, precision=precision, max_s=max_s)
    bursty = isinstance(trace, Bursty)
    meter = ThroughputMeter(cfg, images_per_step=IMAGES, device=torch.device("cpu"), emit=lambda r: None,
                            clock=clock, span_steps=trace.workers if bursty else 1,
                            epoch_steps=trace.length if bursty else None)
    steps = trace.epochs() if bursty else ((trace.step_s(i), None) for i in range(10**7))
    means: list[float] = []
    for i, (seconds, edge) in enumerate(steps):
        if meter.done:
            break
        clock.t += seconds
        means.append(seconds if bursty else trace.mean_s(i))
        meter.step()
        if edge == "begin":
            meter.turn_begins()
        elif edge == "end":
            meter.turn_ends()
    est = meter.estimate(final=True)
    if bursty:
        truth = trace.true_rate()
    else:  # the known mean over the span's steps
        first = meter.warmup_steps + sum(w.steps for w in meter.windows[:est.start])
        span = means[first:first + sum(w.steps for w in meter.windows[est.start:])]
        truth = len(span) * IMAGES / sum(span)
    return Measured(meter=meter, true_rate=truth, seconds=sum(w.seconds for w in meter.windows))
