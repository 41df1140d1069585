"""The host's CPU in the parent: how busy a trial's cores were while its windows were timed.

A rank's own process, its loader's workers, a GPU decode's host work and the pinning thread all take cores; whether
the cores were full while the step waited for data says which way the loader's workers should move (fewer, when
they crowd the rank's own process; more, when cores sit idle). The kernel's cumulative CPU times (``/proc/stat``) of
the cores this process may run on (the trial's, as its ranks inherit the affinity) are read on a sampler thread,
timestamped; the busy share is the difference between the first and the last reading inside the measured windows,
so warm-up, compilation and the launch do not count. Elsewhere than Linux there is no ``/proc/stat``: the share is
unavailable, never estimated.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SAMPLE_INTERVAL_S = 0.25
"""The readings' spacing: the share is a difference of cumulative counters, so its precision comes from the span
between the first and last reading inside the windows, not from sampling often."""

STAT = Path("/proc/stat")


@dataclass(frozen=True)
class Reading:
    t: float
    """Wall time (``time.time()``), the clock the job stamps its windows with."""

    busy: int
    """Clock ticks the cores spent on anything but idling and waiting for I/O, since boot."""

    total: int


def read(cores: set[int], stat: Path = STAT) -> Reading | None:
    """The cumulative ticks of ``cores`` now; None where the kernel does not say (no ``/proc/stat``)."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        # user nice system idle iowait irq softirq steal (guest time is inside user's)
        ticks = [int(x) for x in fields[:8]]
        idle = ticks[3] + ticks[4]
        total += sum(ticks)
        busy += sum(ticks) - idle
    return Reading(t=time.time(), busy=busy, total=total) if total else None


class CpuSampler:
    """Reads the cores' ticks every ``interval`` seconds on a daemon thread between ``start()`` and ``stop()``."""

    def __init__(self, cores: set[int] | None = None, interval: float = SAMPLE_INTERVAL_S, stat: Path = STAT):
        self.cores = cores if cores is not None else _affinity()
        self.interval, self.stat = interval, stat
        self.readings: list[Reading] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            r = read(self.cores, self.stat)
            if r is None:
                return
            self.readings.append(r)
            self._stop.wait(self.interval)

    def start(self) -> CpuSampler:
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Reading]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.readings


def busy_share(readings: list[Reading], windows: list[dict]) -> float | None:
    """The share of the cores' time spent busy between the first and the last reading inside the windows' span
    (``t0`` of the first to ``t1`` of the last); None where fewer than two readings fall inside it."""
    spans = [(float(w["t0"]), float(w["t1"])) for w in windows if "t0" in w and "t1" in w]
    if not spans:
        return None
    t0, t1 = min(a for a, _ in spans), max(b for _, b in spans)
    inside = [r for r in readings if t0 <= r.t <= t1]
    if len(inside) < 2 or inside[-1].total <= inside[0].total:
        return None
    first, last = inside[0], inside[-1]
    return round(min(1.0, (last.busy - first.busy) / (last.total - first.total)), 4)


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))
