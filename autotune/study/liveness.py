"""Trials whose search is gone.

Optuna's own heartbeat only covers ``study.optimize``, not ask/tell, so a search records who runs each trial (host,
PID, the PID's start time, boot and PID namespace) and refreshes a ``heartbeat`` user attr every ``HEARTBEAT_S``
while the trial runs. A search that starts finds RUNNING trials whose owner is gone — on this machine: the PID is
dead or now someone else's; elsewhere: no heartbeat for ``stale_after_s`` — marks them FAIL (``stale``, with the
reason) and enqueues their parameters again, once.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from autotune import verdict
from autotune.study.storage import trial_attrs

HEARTBEAT_S = 10.0
"""How often a running trial's ``heartbeat`` user attr is refreshed."""

STALE_AFTER_S = 180.0
"""A trial owned by another machine whose heartbeat is older than this is stale (18 missed beats: a slow database
or a busy host does not get a live trial reclaimed)."""


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, /proc/PID/stat field 22); None when there is no such live
    process (a zombie is dead). With the PID it names one process for the life of the machine: PIDs are reused,
    start times on one boot are not."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def owner() -> dict[str, Any]:
    """Who runs a trial: enough to tell, later and from anywhere, whether that process still exists."""
    return {"owner_host": socket.gethostname(), "owner_pid": os.getpid(), "owner_start": process_start(os.getpid()),
            "owner_boot": _read("/proc/sys/kernel/random/boot_id"), "owner_pidns": _pid_namespace()}


class Heartbeat:
    """Refreshes the trial's ``heartbeat`` user attr (wall time) at most every ``interval`` s; call ``beat()`` as
    often as convenient (the launcher calls it on every poll). A storage hiccup must not kill a running trial: a
    failed beat is counted and the next one tries again."""

    def __init__(self, trial, interval: float = HEARTBEAT_S):
        self.trial, self.interval, self.last, self.failures = trial, interval, float("-inf"), 0

    def beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        try:
            self.trial.set_user_attr("heartbeat", time.time())
        except Exception:
            self.failures += 1


def _same_machine(a: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the owner's PID can be checked here: same host name, same boot, same PID namespace (a container
    sharing the host's name must not have its PIDs looked up in ours)."""
    return all(a.get(k) is not None and a.get(k) == me.get(k) for k in ("owner_host", "owner_boot", "owner_pidns"))


def stale_reason(t, *, stale_after_s: float = STALE_AFTER_S, now: float | None = None,
                 me: dict[str, Any] | None = None) -> str | None:
    """Why the RUNNING trial ``t`` (a FrozenTrial) has no live owner, or None when it may still be running."""
    now = time.time() if now is None else now
    me = owner() if me is None else me
    a = trial_attrs(t)
    started = t.datetime_start.timestamp() if t.datetime_start else None
    pid, host = a.get("owner_pid"), a.get("owner_host", "?")
    if pid is None:
        age = now - started if started is not None else None
        if age is not None and age > stale_after_s:
            return f"no owner recorded, started {age:.0f} s ago"
        return None
    if _same_machine(a, me):
        start = process_start(int(pid))
        if start is None:
            return f"its search (pid {pid} on {host}) is gone"
        if a.get("owner_start") is not None and start != a["owner_start"]:
            return f"its search (pid {pid} on {host}) is gone; the pid now belongs to another process"
        return None  # alive, even if slow: only its owner may finish it
    seen = a.get("heartbeat", started)
    if seen is None:
        return None
    age = now - float(seen)
    if age > stale_after_s:
        return f"no heartbeat from its search (pid {pid} on {host}) for {age:.0f} s (limit {stale_after_s:.0f} s)"
    return None


def reclaim_stale(study, storage, *, stale_after_s: float = STALE_AFTER_S, prefix: str = "") -> list[str]:
    """Mark every RUNNING trial whose owner is gone FAIL (``failure_class: stale``, the reason in
    ``failure_message``) and enqueue its parameters again, once (the new trial carries ``retry_of``; a retry that
    goes stale is not retried). Returns one line per trial, to print. Safe with several searches doing it at once:
    the database lets one of them finish the trial, and only that one enqueues. ``prefix``: how lines name the
    study's trials (``p`` for the parts study: ``trial p3``)."""
    import optuna
    from optuna.trial import TrialState

    from autotune.study.view import REQUEST_ATTRS

    me = owner()
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    lines = []
    study_id = None
    for t in running:
        reason = stale_reason(t, stale_after_s=stale_after_s, me=me)
        if reason is None:
            continue
        if study_id is None:
            study_id = storage.get_study_id_from_name(study.study_name)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            for key, value in verdict.stale(reason).attrs().items():
                storage.set_trial_user_attr(trial_id, key, value)
            storage.set_trial_user_attr(trial_id, "reclaimed_by", f"{me['owner_host']}:{me['owner_pid']}")
            if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # finished meanwhile, by its owner or by another search reclaiming it
        line = f"trial {prefix}{t.number}: stale ({reason}): marked FAIL"
        retried = {u.user_attrs.get("retry_of") for u in study.get_trials(deepcopy=False)}
        if t.user_attrs.get("retry_of") is not None:
            line += f"; not run again (it was already the re-run of trial {prefix}{t.user_attrs['retry_of']})"
        elif not t.params and not t.user_attrs.get("overrides"):
            line += "; nothing to run again (no parameter had been chosen)"
        elif t.number in retried:
            line += "; already enqueued again"
        else:
            # What the trial was (its stage, a stage measurement's settings) goes with its parameters.
            same = {k: t.user_attrs[k] for k in REQUEST_ATTRS if k in t.user_attrs}
            study.enqueue_trial(dict(t.params), user_attrs={**same, "retry_of": t.number})
            line += "; its parameters run again as a new trial"
        lines.append(line)
    return lines


