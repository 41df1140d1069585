"""The one contract between the job and the tuner: the records the job streams, the failure classes, and the safety
environment every process of a run must have.

The job writes JSON lines (rank 0 for progress, any rank for its own error) to a result file the tuner tails while
the run goes on. A run's stream is: ``start``, ``ready`` (data, model and DDP built), ``first_step``,
``warmup_done``, one ``window`` per timed window, then ``summary`` — or an ``error`` with its failure class, after
which the process exits non-zero. Train runs add ``progress``, ``epoch``, ``val``, ``checkpoint`` and ``resume``.
A live trial worker (``python -m trainer --serve``) writes the same stream into each trial's own result file.
"""

from __future__ import annotations

import enum
import json
import os
import re
import time
import traceback
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypedDict


class StrEnum(str, enum.Enum):
    """A ``str`` enum that compares equal to, formats as and serializes as its plain string (``enum.StrEnum`` needs
    Python 3.11): a record's ``kind`` read back, or a word a study stores, equals its member as it is."""

    def __str__(self) -> str:
        return self.value  # not the member's name (``Kind.SUMMARY``), as Enum's own would be


class Kind(StrEnum):
    """``record["kind"]``."""

    START = "start"
    READY = "ready"
    FIRST_STEP = "first_step"
    WARMUP_DONE = "warmup_done"
    WINDOW = "window"
    SUMMARY = "summary"
    ERROR = "error"
    PROGRESS = "progress"
    EPOCH = "epoch"
    VAL = "val"
    CHECKPOINT = "checkpoint"
    RESUME = "resume"
    SETTINGS = "settings"
    """A user's script's settings as its first step ran them (``trainer.runtime``): what it applies, its unit; where
    its own Dataset is an image folder of JPEGs, that folder and its crop (``image_folder``); whether its training
    loader resumed the workers an earlier trial on the live worker kept (``loader_kept``)."""
    STEPS = "steps"
    """Rank 0's steps so far, written by the meter when no other record went out for ``STEPS_EVERY_S``: the tuner
    tells a run too slow for a window in its timeout (still stepping) from a stuck one."""


STEPS_EVERY_S = 2.0
"""Longest silence of a stepping run's record stream (``Kind.STEPS``): a run quiet for longer has stopped stepping."""


class Failure(StrEnum):
    """Why a run ended without a result. Recorded on the trial; each class says whether the config caused it (the
    sampler must learn that combination fails) or the environment did (it says nothing about the config)."""

    OOM = "oom"
    CONFIG = "config"
    DIVERGED = "diverged"
    LOADER = "loader"
    NCCL = "nccl"
    HANG = "hang"
    SLOW = "slow"
    """Still stepping when the trial timeout ended it, but too slowly for a measurement window in the time given:
    not stuck (``hang``), and nothing is known about its figure."""
    CRASH = "crash"
    INTERRUPTED = "interrupted"
    STALE = "stale"
    SEARCH = "search"
    """The search itself failed around the trial (a bug, the storage gone): nothing is known about the config."""

    @property
    def caused_by_config(self) -> bool:
        return self in CONFIG_FAILURES


CONFIG_FAILURES = frozenset({Failure.OOM, Failure.CONFIG, Failure.DIVERGED})
"""Failures of the configuration itself: an infeasible trial (the sampler learns the boundary). Every other class is
an environment failure: FAIL, and the sampler learns nothing from it."""

ROOT_CAUSE_ORDER = (Failure.OOM, Failure.CONFIG, Failure.DIVERGED, Failure.LOADER, Failure.CRASH, Failure.NCCL,
                    Failure.HANG, Failure.SLOW)
"""When ranks disagree, the root cause wins: a rank that ran out of memory makes its peers' collectives fail, so an
``oom`` record outranks the ``nccl`` records that follow it."""


def nonfinite_reason(summary: dict[str, Any]) -> str:
    """Why a summary's ``loss_finite`` is False (its figure does not stand), in words: the summary's own
    ``loss_reason`` (``trainer.learning.check_loss``); a summary written before it had one was judged on NaN/inf
    alone."""
    if summary.get("loss_reason"):
        return summary["loss_reason"]
    inside = summary.get("loss_nonfinite_in_windows") or 0
    if inside:
        return f"loss NaN/inf in {inside} step(s) of the measured windows"
    return f"loss NaN/inf for the last {summary.get('loss_nonfinite_run')} steps"


def root_cause_rank(cls: str | None) -> int:
    """Position of a failure class in ``ROOT_CAUSE_ORDER`` (an unknown class counts as ``crash``)."""
    try:
        return ROOT_CAUSE_ORDER.index(Failure(cls))
    except ValueError:
        return ROOT_CAUSE_ORDER.index(Failure.CRASH)


# ---- how a failure shows ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """How one failure class shows, in an exception raised inside the job (``classify``) and in a run's log when no
    rank could write its error record (the tuner reads the log's end with the same table)."""

    failure: Failure
    phrases: tuple[str, ...]
    """Regular expressions that are evidence of the failure in a log line (case as written) and in an exception's
    ``Type: message`` (any case). An exception type's name is one: the log's traceback line names it too."""

    exception_only: tuple[str, ...] = ()
    """Evidence in an exception's text only: an exception raised with these words is the failure, while a log says
    them in passing (every ``NCCL INFO`` line under ``NCCL_DEBUG=INFO`` names nccl)."""

    @cached_property
    def _in_log(self) -> re.Pattern:
        return re.compile("|".join(self.phrases))

    @cached_property
    def _in_exception(self) -> re.Pattern:
        return re.compile("|".join(self.phrases + self.exception_only), re.IGNORECASE)

    def in_log(self, line: str) -> bool:
        return self._in_log.search(line) is not None

    def in_exception(self, text: str) -> bool:
        """``text``: the exception as ``Type: message``."""
        return self._in_exception.search(text) is not None


SIGNATURES = (
    Signature(Failure.OOM, ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                            "CUDNN_STATUS_ALLOC_FAILED"),
              exception_only=("out of memory",)),
    Signature(Failure.LOADER, (r"DataLoader worker \(pid", "is killed by signal", "Bus error",
                               r"unable to (?:open|write to) (?:shared memory|file </torch_)",
                               "No space left on device.*shm", "/dev/shm"),
              exception_only=("dataloader worker", "shared memory", "shm")),
    Signature(Failure.NCCL, ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "NCCL error",
                             r"nccl\w*Error", "ProcessGroupNCCL", "Watchdog caught collective", "NCCL WARN",
                             r"\[gloo", "Gloo", "Connection closed by peer", "Connection reset by peer",
                             "Socket Timeout"),
              exception_only=("nccl", "watchdog")),
)
"""The failures recognized by what they say, in the order they are looked for: an out-of-memory error brings down
the loader and the collectives after it, so its words win over theirs. Every other exception is a ``crash``."""


# ---- the records ---------------------------------------------------------------------------------------------------


class WindowRecord(TypedDict):
    """One timed window (``trainer.meter``), written by rank 0 as it closes."""

    kind: str
    window: int
    t0: float
    """Wall-clock start (``time.time()``), the earliest over the ranks: the tuner clips GPU samples to [t0, t1]."""

    t1: float
    steps: int
    images: int
    """Images of all ranks."""

    seconds: float
    """Duration on the slowest rank, pauses left out."""

    imgs_per_s: float
    loss_start: float | None
    loss_end: float | None
    """Mean over the ranks of the loss before the window's first step and after its last (None: no model)."""

    loss_nonfinite: int
    """Steps of the window whose loss was NaN or inf on the worst rank."""

    paused_s: float
    """Time inside the window spent paused (validation, a checkpoint): not in ``seconds``."""

    turn: bool
    """It holds an epoch's turn of a script's own loader (its last partial round, its workers started anew, its
    first round), charged once per real epoch rather than taken as a pace."""

    wait_s: float | None
    """Seconds of the window the host waited for the next batch, on the rank that waited longest (None: the loop's
    waits are not timed, as the loader alone's are not)."""

    estimate: dict[str, float] | None
    """The figure so far (``imgs_per_s``), its interval's relative half-width (``half_width``) and the steady span's
    first window (``start``); None while the windows are too few for one (and in a train run)."""


class SummaryRecord(TypedDict, total=False):
    """The end of a run: the meter's result (``ThroughputMeter.summary``) and what the job adds."""

    kind: str
    t: float
    mode: str
    world_size: int
    unit: str
    """What the figures count: images for the built-in job, a user's script's own unit otherwise."""

    imgs_per_s: float | None
    """The estimate (``trainer.estimate``): the samples of the steady span's windows over the slowest rank's
    seconds, an epoch's turns charged once per real epoch; in ``unit`` per second."""

    ci_low: float
    ci_high: float
    ci_half_width: float
    """The 95 % interval, and its half-width as a share of the figure."""

    ci_batches: int
    ci_batch_windows: int
    ci_lag1: float
    """The batch means the interval stands on: how many, of how many windows each, their lag-1 autocorrelation."""

    steady_start: int
    """The steady span's first window (MSER): the windows before it were warm-up."""

    imgs_per_s_steady: float
    """The steady windows' own figure, before epoch turns are charged."""

    epoch_turns: int
    epoch_turn_s: float
    """Epoch turns measured in the span and what one costs beyond the steady pace (charged once per real epoch);
    ``epoch_turns`` 0: the charge is the first epoch's start, measured alone."""

    precise: bool
    """The interval's half-width is within ``measure.precision``."""

    ended: str | None
    """``precise``, ``turn`` (its windows precise, a turn seen once keeping its interval wider:
    ``trainer.estimate.stop``), ``capped`` (``measure.max_s`` reached), ``cancelled``, or ``run`` (a train run's
    end)."""

    imgs_per_s_windows: list[float]
    turn_windows: list[int]
    windows_used: list[int]
    windows: int
    measured_s: float
    warmup_steps: int
    warmup_capped: bool
    cancelled: bool
    step_time_s: float
    loss_start: float | None
    loss_end: float | None
    loss_nonfinite_in_windows: int
    data_wait_share: float | None
    """The step's split: the share of the steady windows' time the host waited for the next batch, on the rank that
    waited longest (``trainer.meter.timed_batches``); the rest is the step's own work, forward, backward, optimizer,
    communication and the host's launch gaps, as one share. None where the waits are not timed (the loader alone, a
    script whose loop reads data of its own)."""

    step_split: dict[str, Any] | None
    """The profile of ``measure.profile_steps`` steps after the windows (``trainer.profile``): each part's share of
    the profiled steps' time (``data``, ``copy``, ``compute``, ``optimizer``, ``communication``, ``launch``; a part
    None where it is not measured: ``copy`` and ``launch`` on CPU ranks), the profiled ``steps`` and their
    ``seconds``, and the ``rank`` whose split it is. None where no profile ran."""

    steps: int
    epochs: int
    loss: float
    """The last step's loss."""

    loss_finite: bool
    """The figure stands: the loss stayed finite and did not rise across the windows (``loss_reason`` says why
    not)."""

    loss_reason: str | None

    loss_nonfinite_steps: int
    loss_nonfinite_run: int
    peak_mem_bytes: list[int]
    """Per rank: peak device memory, or the process's peak RSS on the CPU (``peak_mem_kind``)."""

    peak_mem_kind: str
    global_batch: int | None
    versions: dict[str, Any]
    compile_s: float
    """torch.compile runs only (``COMPILED_ONLY``): seconds spent compiling in the run, its compile count, whether
    its graph was reused, whether the on-disk caches served every graph it compiled."""

    compiles: int
    compile_reused: bool
    compile_from_caches: bool


COMPILED_ONLY = frozenset({"compile_s", "compiles", "compile_reused", "compile_from_caches"})
"""Summary fields only a run with ``training.compile`` writes."""


ErrorRecord = TypedDict("ErrorRecord", {
    "kind": str,
    "t": float,
    "class": str,  # a Failure; ``class`` is a keyword, hence the functional form
    "rank": int,
    "type": str,
    "message": str,
    "detail": str,
})
"""Written by any rank that fails, before its process exits non-zero: its failure class, the exception's type, its
message's first line and the end of its traceback."""


# ---- safety --------------------------------------------------------------------------------------------------------

SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set for every process of every run: NVLink multicast (NVLS) can take a shared host's GPUs down for days."""


def nccl_env_problems(env: dict[str, str]) -> list[str]:
    """Safety rules for NCCL variables, each problem with its fix: NVLS stays off, LL128 is never forced. The job
    checks its config and its environment; the tuner checks what it is about to launch."""
    p = []
    for key, value in env.items():
        text = str(value).strip().upper()
        if not key.startswith("NCCL_"):
            p.append(f"nccl.extra[{key}]: only NCCL_* variables may be set here")
        if key == "NCCL_NVLS_ENABLE" and text != "0":
            p.append(f"{key}={value}: NVLink multicast must stay off (NCCL_NVLS_ENABLE=0); remove it")
        if key == "NCCL_PROTO" and "LL128" in text.replace("^LL128", ""):
            p.append(f"{key}={value}: LL128 may not be forced; use Simple or LL")
        if key == "NCCL_ALGO" and "NVLS" in text.replace("^NVLS", ""):
            p.append(f"{key}={value}: NVLS algorithms may not be used; use Ring or Tree")
    return p


# ---- writing -------------------------------------------------------------------------------------------------------


class ResultWriter:
    """A run's JSON-lines stream. Rank 0 writes progress; any rank writes its own error record.

    Each record is one ``write`` of one line to a file opened with O_APPEND, so records of several ranks never
    interleave, and it is flushed at once: the tuner tails this file while the job runs.
    """

    def __init__(self, path: str | None, rank: int):
        self.rank, self.path = rank, path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None

    def write(self, record: dict[str, Any], *, any_rank: bool = False) -> None:
        if self.fd is None or (self.rank != 0 and not any_rank):
            return
        os.write(self.fd, (json.dumps(record, default=str) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def classify(exc: BaseException) -> Failure:
    """The failure class of an exception raised inside the job. An exception type may name its own class in a
    ``failure`` attribute (``ConfigError`` does); the rest is recognized by ``SIGNATURES``, so this module imports
    neither torch nor the job."""
    own = getattr(exc, "failure", None)
    if own is not None:
        return Failure(own)
    text = f"{type(exc).__name__}: {exc}"
    return next((s.failure for s in SIGNATURES if s.in_exception(text)), Failure.CRASH)


def error_message(exc: BaseException) -> str:
    """The exception's message in one line. One raised in a DataLoader worker arrives wrapped, its first line
    ("Caught X in DataLoader worker process 0.") saying nothing of what went wrong: the worker's own last line
    does."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].startswith("Caught ") and len(lines) > 1 and lines[1].startswith("Original Traceback"):
        return f"{lines[-1]} (in a DataLoader worker)"
    return lines[0]


def error_record(exc: BaseException) -> ErrorRecord:
    detail = "".join(traceback.format_exception(exc)[-6:])
    return {"kind": Kind.ERROR, "t": time.time(), "class": classify(exc), "rank": int(os.environ.get("RANK", 0)),
            "type": type(exc).__name__, "message": error_message(exc)[:500], "detail": detail[-4000:]}
