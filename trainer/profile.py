"""One short profile of the training step, after the measured windows (``measure.profile_steps``): where a step's
time goes, in six parts, each a share of the profiled steps' time.

- ``data``: waiting for the next batch (the host inside the loop's ``next``; on a GPU, the device idle while the host
  waits there, and the kernels the input side launches itself);
- ``copy``: host-to-device copies (GPU only: on CPU ranks there is no device to copy to);
- ``compute``: forward and backward, and whatever else of the step's own work no other part holds;
- ``optimizer``: the optimizer's step (its own ``Optimizer.step#...`` ranges, which torch records for every
  optimizer);
- ``communication``: the collectives' time the step is exposed to: the part of their time no work of the step
  overlaps (DDP all-reduces gradients while backward runs; only what backward does not hide costs the step);
- ``launch``: the device idle inside the step while the host is not waiting for data: the host's kernel launches and
  its Python between them not keeping up (GPU only: it needs a device timeline; None on CPU ranks, not measured).

On a GPU every part is a share of the device's timeline, each moment counted once (the step's work, then copies,
then exposed communication, then idle: waiting for data or the host's launch gaps), so the parts add up to the
span. On CPU ranks the parts are the rank's main thread's timeline: what is left over (``zero_grad``, the loop's own
Python between the phases) is in no part, so the shares add up to at most 1.

The profile runs after the measurement, so its overhead touches no measured window.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

PARTS = ("data", "copy", "compute", "optimizer", "communication", "launch")
"""The parts of a step, in the order they are said."""

STEP = "ddp_autotune:step"
DATA = "ddp_autotune:data"
"""The ranges a profiled step is marked with: the step itself, and each wait for its batches."""

OPTIMIZER = "Optimizer.step#"
COLLECTIVES = ("nccl", "gloo:", "mpi:", "ucc:")
"""Names that start an optimizer's step range, and that mark a collective (a process group's operation on the host,
an NCCL kernel on the device)."""

COPY = "Memcpy HtoD"

Span = list[tuple[float, float]]


class StepProfile:
    """A profile of ``steps`` steps: ``start`` before the first, ``step`` after each (True once the last has run),
    then ``stop`` for the split. The loop's waits for data are marked while it runs (``waiting``). For a loop that
    is the profile's to run (the built-in job: ``profile_steps``) and one that only reports its steps (a user's
    script, ``trainer.runtime``) alike."""

    def __init__(self, device: torch.device, steps: int):
        self.device, self.steps, self.ran = device, steps, 0
        self._prof: profile | None = None
        self._range: record_function | None = None
        self._t0 = 0.0
        self._error: str | None = None
        """Why the profile has no split (its profiler failed), said in the split instead."""

    def start(self) -> None:
        _sync(self.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        # The trial is measured already: a profiler that cannot start (another one running, no CUPTI) costs its
        # split, never the trial, and the ranks still meet in ``stop``.
        try:
            prof = profile(activities=activities)
            prof.__enter__()
            self._prof = prof
        except Exception as e:  # any profiler failure is the split's, said in it
            self._error = _said(e)
        _MARKING.on = True
        self._t0 = time.perf_counter()
        self._open()

    def step(self) -> bool:
        """A step ended; whether it was the last."""
        self._close()
        self.ran += 1
        if self.ran >= self.steps:
            return True
        self._open()
        return False

    def stop(self) -> dict[str, Any]:
        """The split of the steps that ran (a step begun and not ended is left out): the rank the others wait for
        (``choose``). Collective: every rank calls it."""
        self._close()
        _sync(self.device)
        seconds = time.perf_counter() - self._t0
        _MARKING.on = False
        parts: dict[str, Any] = dict.fromkeys(PARTS)
        if self._prof is not None:
            try:
                self._prof.__exit__(None, None, None)
                events = list(self._prof.events())
                parts = device_split(events) if self.device.type == "cuda" else host_split(events)
            except Exception as e:  # as in ``start``: the split's failure, not the trial's
                self._error = _said(e)
            self._prof = None
        failed = {"error": self._error} if self._error else {}
        return choose({**parts, **failed, "steps": self.ran, "seconds": round(seconds, 4)})

    def _open(self) -> None:
        self._range = record_function(STEP)
        self._range.__enter__()

    def _close(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None


class _Marking:
    on = False
    """A profile runs in this process: the loop's waits for data are marked (``waiting``)."""


_MARKING = _Marking()


def waiting() -> contextlib.AbstractContextManager:
    """What a wait for the loop's next batch runs inside (``trainer.meter.timed_batches``): the ``DATA`` range while
    a profile runs, nothing otherwise, so a measured step pays nothing for it."""
    return record_function(DATA) if _MARKING.on else contextlib.nullcontext()


def profile_steps(step: Callable[[], Any], steps: int, device: torch.device) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under ``torch.profiler`` and return the split (``StepProfile``); a ``step`` that
    raises StopIteration (its batches ran out) ends it early. Collective: every rank calls it."""
    p = StepProfile(device, steps)
    p.start()
    try:
        while True:
            step()
            if p.step():
                break
    except StopIteration:
        pass
    return p.stop()


def choose(mine: dict[str, Any]) -> dict[str, Any]:
    """The split of the rank the others wait for: DDP's ranks meet at every step's all-reduce, so a rank held back
    by its own work (its data, its compute) is exposed to the least communication, while the others' waiting for it
    shows as theirs. Its split says what holds the job back; ``rank`` names it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {**mine, "rank": 0}
    every: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    # A rank whose profiler failed has no split to give: another's stands for the job.
    usable = [r for r in range(len(every)) if not every[r].get("error")] or list(range(len(every)))
    rank = min(usable, key=lambda r: (every[r].get("communication") or 0.0, r))
    return {**every[rank], "rank": rank}


def host_split(events: list) -> dict[str, float | None]:
    """The parts on CPU ranks, from the rank's main thread (the one that ran the marked steps)."""
    steps = [e for e in events if e.name == STEP]
    if not steps:
        return dict.fromkeys(PARTS)
    main = steps[0].thread
    span = _union(_range(e) for e in steps)
    on_main = [e for e in events if e.thread == main and e.device_type == _CPU]
    data = _clip(_union(_range(e) for e in on_main if e.name == DATA), span)
    optimizer = _minus(_clip(_union(_range(e) for e in on_main if e.name.startswith(OPTIMIZER)), span), data)
    # The main thread's own work: every op it ran (the steps' and waits' ranges excepted). Time a collective runs
    # that no such op covers is the step waiting for it.
    work = _union(_range(e) for e in on_main if e.name not in (STEP, DATA) and not _collective(e.name))
    collectives = _union(_range(e) for e in events if _collective(e.name))
    comm = _minus(_minus(_minus(_clip(collectives, span), data), optimizer), work)
    total = _length(span)
    rest = _length(span) - _length(data) - _length(optimizer) - _length(comm)
    return _shares(total, data=_length(data), copy=None, compute=max(rest, 0.0), optimizer=_length(optimizer),
                   communication=_length(comm), launch=None)


def device_split(events: list) -> dict[str, float | None]:
    """The parts on a GPU, from the device's timeline within the marked steps' span (host and device events share
    the profiler's clock)."""
    steps = [e for e in events if e.name == STEP and e.device_type == _CPU]
    if not steps:
        return dict.fromkeys(PARTS)
    span = _union(_range(e) for e in steps)
    by_id = {e.id: e for e in events if e.device_type == _CPU and e.id}
    # A range marked on the host (the step, an optimizer's step) is mirrored on the device's timeline as a span over
    # its kernels (a user annotation, under the host range's name): it is no work of its own.
    marked = {e.name for e in events if e.device_type == _CPU}
    kernels = [e for e in events if e.device_type != _CPU and e.name not in marked
               and getattr(e, "activity_type", None) not in ("gpu_user_annotation", "overhead")]
    comm_k = [e for e in kernels if _collective(e.name.lower())]
    copy_k = [e for e in kernels if e.name.startswith(COPY) and not _collective(e.name.lower())]
    work_k = [e for e in kernels if not _collective(e.name.lower()) and not e.name.startswith(COPY)]
    # A kernel's launch (a runtime call inside the op that made it) is linked by its correlation id; 0 links none.
    launched = {id(e): _launched_in(by_id.get(getattr(e, "linked_correlation_id", 0) or None)) for e in work_k}
    work = _clip(_union(_range(e) for e in work_k), span)
    optimizer = _clip(_union(_range(e) for e in work_k if launched[id(e)] == OPTIMIZER), span)
    data_work = _minus(_clip(_union(_range(e) for e in work_k if launched[id(e)] == DATA), span), optimizer)
    copy = _minus(_clip(_union(_range(e) for e in copy_k), span), work)
    comm = _minus(_minus(_clip(_union(_range(e) for e in comm_k), span), work), copy)
    busy = _union([*work, *copy, *comm])
    idle = _minus(span, busy)
    waits = _clip(_union(_range(e) for e in events if e.name == DATA and e.device_type == _CPU), idle)
    compute = _length(work) - _length(optimizer) - _length(data_work)
    return _shares(_length(span), data=_length(waits) + _length(data_work), copy=_length(copy),
                   compute=max(compute, 0.0), optimizer=_length(optimizer), communication=_length(comm),
                   launch=_length(idle) - _length(waits))


def largest(split: dict[str, Any] | None) -> tuple[str, float] | None:
    """The split's largest part and its share; None where nothing was measured."""
    measured = [(p, split[p]) for p in PARTS if split and split.get(p) is not None]
    return max(measured, key=lambda ps: ps[1]) if measured else None


# ---- the timeline ---------------------------------------------------------------------------------------------------

_CPU = torch.autograd.DeviceType.CPU


def _launched_in(event) -> str | None:
    """Which marked range launched a kernel: ``OPTIMIZER``, ``DATA`` or None (the step's own compute)."""
    while event is not None:
        if event.name.startswith(OPTIMIZER):
            return OPTIMIZER
        if event.name == DATA:
            return DATA
        event = event.cpu_parent
    return None


def _collective(name: str) -> bool:
    return name.startswith(COLLECTIVES) or "nccl" in name


def _range(e) -> tuple[float, float]:
    return float(e.time_range.start), float(e.time_range.end)


def _union(ranges) -> Span:
    out: Span = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _clip(ranges: Span, within: Span) -> Span:
    """``ranges`` inside ``within`` (both merged)."""
    out: Span = []
    i = j = 0
    while i < len(ranges) and j < len(within):
        a, b = max(ranges[i][0], within[j][0]), min(ranges[i][1], within[j][1])
        if b > a:
            out.append((a, b))
        if ranges[i][1] < within[j][1]:
            i += 1
        else:
            j += 1
    return out


def _minus(ranges: Span, taken: Span) -> Span:
    """``ranges`` outside ``taken`` (both merged, so one pass over each: a trace holds thousands of kernels)."""
    out: Span = []
    j = 0
    for a, b in ranges:
        while j < len(taken) and taken[j][1] <= a:
            j += 1
        k = j
        while k < len(taken) and taken[k][0] < b:
            c, d = taken[k]
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if d >= b:
                break
            k += 1
        if b > a:
            out.append((a, b))
    return out


def _length(ranges: Span) -> float:
    return sum(b - a for a, b in ranges)


def _shares(total: float, **parts: float | None) -> dict[str, float | None]:
    if total <= 0:
        return dict.fromkeys(PARTS)
    return {p: None if parts[p] is None else round(min(1.0, max(parts[p], 0.0) / total), 4) for p in PARTS}


def _said(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
