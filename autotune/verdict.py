"""A run's outcome, decided in one place: whether it failed, the failure's class, why in one line, and the fix to
name where one is known.

Every run the tuner launches — a search trial, a measurement of a part, an export's re-measure, a full run — is
judged here, and every failure a search records without a finished run (an invalid combination, an OOM already
seen, a trial whose search is gone, Ctrl-C) is made here too, so ``failure_class`` and ``failure_message`` mean the
same wherever they are read. The launcher only collects (``autotune.runner.trial``); this module reads what it
collected:

1. ``ending``: the run's own account. The error records its ranks wrote (when ranks disagree the root cause wins,
   ``trainer.protocol.ROOT_CAUSE_ORDER``: an OOM outranks the NCCL errors it makes its peers raise), then why the
   launcher stopped it, then its exit code and the end of its log, read with the signatures the job classifies its
   own exceptions by (``trainer.protocol.SIGNATURES``).
2. ``figure``: whether the figure it reported stands: a loss that did not hold is a divergence, no figure a crash;
   and what makes a figure that stands doubtful (``still_loss``: a loss that never moved), said beside it.

``judge`` is both, for a run whose figure is wanted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from autotune.runner.process import STACKS_MARK, log_tail
from autotune.runner.trial import Stopped
from trainer.learning import window_losses
from trainer.protocol import SIGNATURES, STEPS_EVERY_S, Failure, Kind, nonfinite_reason, root_cause_rank

FIXES: dict[Failure, str] = {
    Failure.OOM: "a smaller per-GPU batch (training.batch_size; training.accum_steps keeps the global batch)",
    Failure.DIVERGED: "lower optimizer.lr or use bf16/fp32",
    Failure.LOADER: "fewer loader.num_workers, or more shared memory for the workers (/dev/shm; a container's "
                    "--shm-size)",
    Failure.NCCL: "NCCL_DEBUG=WARN in the environment names the collective that failed and why",
    Failure.HANG: "a longer --trial-timeout when the job is slow to its first window rather than stuck",
    Failure.SLOW: "a longer --trial-timeout: the run was stepping, too slowly for its windows in the time given",
    Failure.INTERRUPTED: "run the same command again to resume the study",
}
"""The change to make for a failure of each class, where one is known. A ``config`` failure's message names its own
fix (every ``ConfigError`` problem does); a crash's is in its log."""

SCRIPT_FIXES: dict[Failure, str] = {
    Failure.DIVERGED: "lower the learning rate of the script's own optimizer (or run it at fp32/bf16); every trial "
                      "would diverge the same",
    Failure.OOM: "a smaller batch in the script (its batch_size default, or run.batch_size's)",
}
"""Where a user's script owns what ``FIXES`` names (its optimizer, its batch), the change to make in it."""

NOT_ITS_FAULT = (str(Failure.INTERRUPTED), str(Failure.STALE), str(Failure.SEARCH))
"""Classes of a trial ended from outside (Ctrl-C, its search gone, the search's own error): they say nothing about
its configuration nor about the machine, so such a trial is run again and counted in no conclusion about the study."""

_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]: )?[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b(?::|$)")
"""A traceback's last line: ``ImportError: no module named x`` (torchrun prefixes a rank's lines with
``[rankN]:``)."""

_FAILURE_NAMES = frozenset(f.value for f in Failure)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """How a run ended, for the study, the terminal and the export."""

    failure: Failure | None = None
    """None: no failure (measured, or stopped by the pruner)."""

    reason: str | None = None
    """What went wrong, in one line: a rank's own message, the log line that shows it, why the launcher stopped."""

    fix: str | None = None
    """The change to make, where one is known (``FIXES``)."""

    error: dict[str, Any] | None = None
    """The error record the class stands on (the root cause over the ranks), when a rank wrote one."""

    warning: str | None = None
    """What makes a figure that stands doubtful, said beside it (``still_loss``): no failure."""

    @property
    def ok(self) -> bool:
        return self.failure is None

    def attrs(self) -> dict[str, str]:
        """The trial attributes that record it: the same two keys wherever a trial is told ({} for no failure)."""
        if self.failure is None:
            return {}
        return {"failure_class": str(self.failure), "failure_message": self.reason}


OK = Verdict()


def script_fix(v: Verdict) -> str | None:
    """The change to make for ``v`` in a user's script (``SCRIPT_FIXES``, else the verdict's own)."""
    return SCRIPT_FIXES.get(v.failure, v.fix) if v.failure is not None else None


def failed(failure: Failure, reason: str, *, error: dict[str, Any] | None = None) -> Verdict:
    """A failure of ``failure``'s class, its fix from ``FIXES``."""
    return Verdict(failure=failure, reason=reason, fix=FIXES.get(failure), error=error)


class Finished(Protocol):
    """What the launcher collected of a finished run (``autotune.runner.trial.TrialRun``)."""

    records: list[dict]
    returncode: int | None
    stopped: Stopped | None
    n_before_stop: int | None
    log_path: Path | None
    t_launch: float
    t_end: float


# ---- a finished run --------------------------------------------------------------------------------------------------


def judge(run: Finished, *, pruned: bool = False, stopped_early: bool = False) -> Verdict:
    """A run whose figure is wanted: how it ended (``ending``), then whether its figure stands (``figure``), unless
    the search stopped it on purpose: ``pruned`` (its figure is the pruner's, not a summary's), or ``stopped_early``
    without a summary (a measurement of a part whose windows already said enough, ended at once where the job
    cannot be asked to stop at its next window — a user's script in a process of its own: its figure is those
    windows)."""
    v = ending(run)
    if v.failure is not None or pruned:
        return v
    summary = _last(run.records, Kind.SUMMARY)
    if stopped_early and summary is None:
        return v
    v = figure(summary)
    warning = still_loss(run.records) if v.ok else None
    return Verdict(warning=warning) if warning else v


def ending(run: Finished) -> Verdict:
    """What the run says of itself: its ranks' error records (those written before the launcher decided to stop it:
    the kill makes peers report closed connections), why the launcher stopped it, its exit code and its log."""
    if run.stopped in (Stopped.PRUNED, Stopped.MEASURED):
        return OK
    considered = run.records if run.n_before_stop is None else run.records[:run.n_before_stop]
    errors = [r for r in considered if r.get("kind") == Kind.ERROR]
    if errors:
        v = root_cause(errors)
        return stalled_loader(v, run.log_path) if v.failure == Failure.NCCL else v
    if run.stopped == Stopped.HANG:
        return timed_out(run, considered)
    if run.stopped == Stopped.INTERRUPTED:
        return failed(Failure.INTERRUPTED, "interrupted (Ctrl-C)")
    if _last(run.records, Kind.SUMMARY) is not None and run.returncode in (0, None):
        return OK
    tail = log_tail(run.log_path)
    found = from_log(tail)
    if found is not None:
        return found
    if run.returncode == 0:
        return failed(Failure.CRASH, "the job exited without a summary record")
    return failed(Failure.CRASH, crash_line(tail, run.returncode))


def timed_out(run: Finished, considered: Sequence[dict]) -> Verdict:
    """A run the trial timeout ended: ``slow`` while it was still stepping (its latest step records came at the pace
    of its steps), else ``hang``; where it waited is in the log when its ranks' stacks reached it."""
    waited = round((getattr(run, "t_stopped", None) or run.t_end) - run.t_launch)
    last = "a window" if any(r.get("kind") == Kind.WINDOW for r in considered) else "the first window"
    pace = stepping(considered, getattr(run, "t_stopped", None) or run.t_end)
    if pace is not None:
        steps, seconds = pace
        return failed(Failure.SLOW, f"not stuck, but too slow for its timeout: still stepping when the trial "
                                    f"timeout ({waited} s) ended it, waiting for {last}; {steps} steps reported, the "
                                    f"latest took {seconds:.3g} s")
    where = "each rank's stack is in the log" if _has_stacks(run.log_path) else "the ranks left no stack in the log"
    began = any(r.get("kind") in (Kind.FIRST_STEP, Kind.WINDOW) for r in considered)
    return failed(Failure.HANG, f"no measurement window for {waited} s (trial timeout); waiting for {last}"
                                f"{'' if began else ' (no step reported)'}; process tree killed, {where}")


def stepping(records: Sequence[dict], t_stop: float) -> tuple[int, float] | None:
    """(steps reported, seconds its latest step took) of a run still stepping at ``t_stop``: its latest step record
    (``Kind.STEPS``, written at most ``STEPS_EVERY_S`` apart while it steps) came within two of its steps (or two
    such intervals) of the stop; None for a run that stopped stepping, or never said."""
    beat = next((r for r in reversed(records) if r.get("kind") == Kind.STEPS and "t" in r), None)
    if beat is None:
        return None
    step_s = float(beat.get("step_s") or 0.0)
    if t_stop - float(beat["t"]) > 2 * max(step_s, STEPS_EVERY_S):
        return None
    return int(beat.get("steps", 0)), step_s


STALL_FIX = ("its loader workers' stacks in the log show where they wait: a dataset that blocks (a lock, a read that "
             "never returns) or a worker stuck from its start; fewer loader.num_workers, or persistent_workers, start "
             "fewer of them")

_WAITS_FOR_BATCH = re.compile(r'torch/utils/data/dataloader\.py", line \d+,? in _try_get_data$', re.M)
"""A frame of a process waiting for its DataLoader's next batch, as faulthandler prints it (``line N in``) and as a
traceback does (``line N, in``: a framework's own SIGTERM handler raising over the wait)."""

STALL_TAIL_BYTES = 1 << 16
"""How much of a log's end is looked through for a rank's traceback over its wait for a batch."""


def stalled_loader(v: Verdict, log: Path | None) -> Verdict:
    """A collective that timed out (``v``) because a peer never reached it: where a stopped rank's stack shows it
    waiting for its next batch from its DataLoader's workers, the workers stalled and the collective only says so
    later; the verdict names the rank and the workers (a hang of the input side), not the collective."""
    stacks = stopped_stacks(log)
    waiting = [who for who, stack in stacks if "loader worker" not in who and _WAITS_FOR_BATCH.search(stack)]
    if not waiting and _WAITS_FOR_BATCH.search("\n".join(log_tail(log, max_bytes=STALL_TAIL_BYTES))):
        waiting = ["a rank"]  # a framework's own SIGTERM handler replaced the stack printer: its traceback says it
    if not waiting:
        return v
    where = ("the ranks' and their loader workers' stacks are in the log" if stacks else
             "its traceback is in the log")
    return Verdict(failure=Failure.HANG, fix=STALL_FIX, error=v.error,
                   reason=f"{' and '.join(waiting)} waited for its next batch from its DataLoader's workers, which "
                          f"never delivered it, until a peer's collective timed out ({v.reason}); {where}")


def stopped_stacks(log: Path | None) -> list[tuple[str, str]]:
    """(who, stack) of each stopped process whose stack reached the log (``ProcessTree``): a rank, or a rank's loader
    worker."""
    try:
        text = log.read_text(errors="replace") if log is not None else ""
    except OSError:
        return []
    parts = re.split(rf"^---- (.+?) \(pid \d+\) {re.escape(STACKS_MARK)} ----$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _has_stacks(log: Path | None) -> bool:
    try:
        return STACKS_MARK.encode() in log.read_bytes() if log is not None else False
    except OSError:
        return False


def root_cause(errors: Sequence[dict]) -> Verdict:
    """The verdict of a run whose ranks wrote error records: the root cause's, the earliest of its class."""
    first = min(errors, key=lambda r: (root_cause_rank(r.get("class")), float(r.get("t", 0))))
    cls = Failure(first["class"]) if first.get("class") in _FAILURE_NAMES else Failure.CRASH
    return failed(cls, f"rank {first.get('rank', '?')}: {first.get('message', '')}".strip(), error=first)


def from_log(lines: Sequence[str]) -> Verdict | None:
    """The class a log's end shows (its latest line with a failure's signature, the classes in the order of
    ``SIGNATURES``), or None when no line has one."""
    for signature in SIGNATURES:
        for line in reversed(lines):
            if signature.in_log(line):
                return failed(signature.failure, line.strip()[:300])
    return None


def crash_line(tail: Sequence[str], returncode: int | None) -> str:
    """The line of a log that says what went wrong in a crash: a rank's own exception line (a user's script failing
    at import leaves no record), not the launcher's summary of the failure after it."""
    raised = [ln for ln in tail if _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln]
    meaningful = raised or [ln for ln in tail if re.search(r"Error|error|Exception|exitcode|Signal", ln)]
    return (meaningful[-1] if meaningful else (tail[-1] if tail else f"exit code {returncode}"))[:300].strip()


def figure(summary: dict[str, Any] | None) -> Verdict:
    """Whether a summary's figure stands: a run that does not learn is not fast (``loss_finite``), and a run that
    reported no figure measured nothing."""
    s = summary or {}
    if s.get("loss_finite") is False:
        return failed(Failure.DIVERGED, nonfinite_reason(s))
    if s.get("imgs_per_s") is None:
        return failed(Failure.CRASH, "the job reported no throughput")
    return OK


STILL_FIGURES = 3
"""Fewest loss figures (the first window's start, then each window's end: two windows) a loss that never moved is
judged on."""


def still_loss(records: Sequence[dict]) -> str | None:
    """Why a run's figure is doubtful though it stands: its loss is the same figure, to the last digit its windows
    record, across the windows its figure stands on (``0 -> 0``). The steps ran, so the figure stands; but a run
    whose loss never moves learns nothing from what it is fed: one class in its data, labels all alike, a loss
    detached from the model. Where a script's settings record names its ImageFolder, how many classes it holds."""
    summary = _last(records, Kind.SUMMARY) or {}
    used = set(summary.get("windows_used") or [])
    windows = [r for r in records if r.get("kind") == Kind.WINDOW and (not used or r.get("window") in used)]
    figures = [x for x in window_losses(windows) if x is not None]
    if len(figures) < STILL_FIGURES or any(x != figures[0] for x in figures):
        return None
    text = (f"its loss never moved ({figures[0]:.6g} at each of its {len(windows)} windows' ends): the run learns "
            "nothing from what it is fed")
    folder = (_last(records, Kind.SETTINGS) or {}).get("image_folder") or {}
    classes = folder.get("classes")
    if classes is None:
        return text + " (one class in its data, labels all alike, or a loss detached from the model?)"
    text += f"; its ImageFolder ({folder.get('path')}) holds {classes} class{'' if classes == 1 else 'es'}"
    return text + (": give it the folder whose subfolders are the classes" if classes < 2 else "")


def _last(records: Sequence[dict], kind: str) -> dict | None:
    return next((r for r in reversed(records) if r.get("kind") == kind), None)


# ---- a trial without a finished run ----------------------------------------------------------------------------------


def invalid(problems: Sequence[str]) -> Verdict:
    """A configuration the job refuses (``trainer.config.ConfigError``): each problem names its fix."""
    return failed(Failure.CONFIG, "; ".join(problems))


def predicted_oom(prior: int | str) -> Verdict:
    """Not launched: trial ``prior`` already ran out of memory at a batch <= this one's with the same
    memory-relevant settings."""
    return failed(Failure.OOM, f"trial {prior} ran out of memory at a batch <= this one with the same "
                               "memory-relevant settings; not launched")


def abandoned(exc: BaseException) -> Verdict:
    """A trial its search could not finish: Ctrl-C (or a signal that ends the search like it), or the search's own
    error (a bug, the storage gone)."""
    if isinstance(exc, KeyboardInterrupt):
        return failed(Failure.INTERRUPTED, str(exc) or "interrupted (Ctrl-C)")
    return failed(Failure.SEARCH, f"{type(exc).__name__}: {exc}"[:300])


def search_failure(why: str) -> Verdict:
    """A trial the search itself ended before it ran (two search workers took the same measurement)."""
    return failed(Failure.SEARCH, why)


def stale(reason: str) -> Verdict:
    """A RUNNING trial whose search is gone (``autotune.study.liveness``)."""
    return failed(Failure.STALE, reason)
