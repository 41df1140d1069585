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
import time
import traceback
from typing import Any, TypedDict


class _StrEnum(str, enum.Enum):
    """A ``str`` enum that compares equal to, formats as and serializes as its plain string (``enum.StrEnum`` needs
    Python 3.11)."""

    def __str__(self) -> str:
        return self.value


class Kind(_StrEnum):
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
    """A user's script's settings as its first step ran them (``trainer.runtime``): what it applies, its unit."""


class Failure(_StrEnum):
    """Why a run ended without a result. Recorded on the trial; each class says whether the config caused it (the
    sampler must learn that combination fails) or the environment did (it says nothing about the config)."""

    OOM = "oom"
    CONFIG = "config"
    DIVERGED = "diverged"
    LOADER = "loader"
    NCCL = "nccl"
    HANG = "hang"
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
                    Failure.HANG)
"""When ranks disagree, the root cause wins: a rank that ran out of memory makes its peers' collectives fail, so an
``oom`` record outranks the ``nccl`` records that follow it."""


def nonfinite_reason(summary: dict[str, Any]) -> str:
    """Why a summary's ``loss_finite`` is False (its figure does not stand), in words: the summary's own
    ``loss_reason`` (``trainer.learning.loss_verdict``); a summary written before it had one was judged on NaN/inf
    alone."""
    if summary.get("loss_reason"):
        return summary["loss_reason"]
    inside = summary.get("loss_nonfinite_in_windows") or 0
    if inside:
        return f"loss NaN/inf in {inside} step(s) of the measured windows"
    return f"loss NaN/inf for the last {summary.get('loss_nonfinite_run')} steps (diverged)"


def root_cause_rank(cls: str | None) -> int:
    """Position of a failure class in ``ROOT_CAUSE_ORDER`` (an unknown class counts as ``crash``)."""
    try:
        return ROOT_CAUSE_ORDER.index(Failure(cls))
    except ValueError:
        return ROOT_CAUSE_ORDER.index(Failure.CRASH)


# ---- the records ---------------------------------------------------------------------------------------------------


class WindowRecord(TypedDict):
    kind: str
    window: int
    t0: float
    """Wall-clock start (``time.time()``), the earliest over the ranks: the tuner clips GPU samples to [t0, t1]."""

    t1: float
    steps: int
    images: int
    """Images of all ranks."""

    seconds: float
    """Duration on the slowest rank."""

    imgs_per_s: float
    loss_start: float | None
    loss_end: float | None
    """Mean over the ranks of the loss before the window's first step and after its last (None: no model)."""


class SummaryRecord(TypedDict, total=False):
    kind: str
    imgs_per_s: float | None
    """Median of the windows the result stands on (``windows_used``)."""

    windows_used: list[int]
    spread: float
    settled: bool
    loss_finite: bool
    """The figure stands: the loss stayed finite and did not rise across the windows (the name is older than the
    rise rule; ``loss_reason`` says why not)."""

    loss_reason: str | None
    loss_start: float | None
    loss_end: float | None
    peak_mem_bytes: list[int]
    versions: dict[str, Any]


class ErrorRecord(TypedDict):
    kind: str
    t: float
    rank: int
    type: str
    message: str
    detail: str


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
    ``failure`` attribute (``ConfigError`` does); the rest is recognized by type name and message, so this module
    imports neither torch nor the job."""
    own = getattr(exc, "failure", None)
    if own is not None:
        return Failure(own)
    text = f"{type(exc).__name__}: {exc}".lower()
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text:
        return Failure.OOM
    if any(s in text for s in ("dataloader worker", "shared memory", "bus error", "shm")):
        return Failure.LOADER
    if type(exc).__name__ in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError") or any(
            s in text for s in ("nccl", "gloo", "connection closed by peer", "connection reset by peer", "watchdog")):
        return Failure.NCCL
    return Failure.CRASH


def error_record(exc: BaseException) -> dict[str, Any]:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = "".join(traceback.format_exception(exc)[-6:])
    return {"kind": Kind.ERROR, "t": time.time(), "class": classify(exc), "rank": int(os.environ.get("RANK", 0)),
            "type": type(exc).__name__, "message": message[:500], "detail": detail[-4000:]}
