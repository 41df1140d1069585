"""Process trees: a launched command in a session of its own that dies with this process, whose process groups are
tracked so that all of it can be killed, and the JSON-lines stream it writes, tailed while it runs.

torchrun starts each rank in a session of its own, so "the process" of a run is the set of groups of torchrun, its
ranks and their DataLoader workers: all get SIGTERM, then SIGKILL, and the launcher checks that none is left. If the
launcher itself dies (even by SIGKILL, which runs no clean-up), nothing of the run outlives it: the command is started
with a parent-death signal (``prctl(PR_SET_PDEATHSIG)``), each rank sets one towards torchrun
(``trainer.exit_signals``), and DataLoader workers exit when their rank is gone. No process left means no GPU memory
held.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

KILL_GRACE_S = 5.0
"""SIGTERM first (torchrun forwards it and ranks can flush their logs), SIGKILL after this."""

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

STACKS_ENV = "TRAINER_STACKS_DIR"
"""The folder where each rank of the job writes its threads' stacks when it is stopped (``trainer.__main__``)."""


STACKS_FILE = re.compile(r"rank(?P<rank>\d+)(?P<worker>-worker)?-pid(?P<pid>\d+)\.txt")
"""A stopped process's stacks file in that folder (``trainer.exit_signals.stacks_on_sigterm``): a rank's, or one of
its loader workers'."""

STACKS_MARK = "was stopped; its threads were here"
"""The heading of a rank's stacks in a log: a report may say the stacks are in the log only where it finds one."""


class ProcessTree:
    """``argv`` running in a new session, its output to ``log``; dies with this process.

    Ranks stopped by a signal print their threads' stacks into files of their own, appended to ``log`` once the tree
    is gone: ranks stopped together, writing into one log, would interleave their stacks fragment by fragment."""

    def __init__(self, argv: list[str], *, env: dict[str, str], log: BinaryIO):
        self.argv, self.log = argv, log
        name = getattr(log, "name", None)  # beside the log: a launcher killed outright leaves its folder there
        folder = Path(name).parent if isinstance(name, str) else None
        self.stacks = Path(tempfile.mkdtemp(prefix=".stacks-", dir=folder))
        self.t_launch = time.time()
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**env, STACKS_ENV: str(self.stacks)}, start_new_session=True,
                                     preexec_fn=die_with_parent_preexec())
        self.groups: set[int] = {self.proc.pid}

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def scan(self) -> None:
        """Record the process groups of the tree as it is now (ranks and loader workers start after launch)."""
        self.groups |= groups_of_tree(self.proc.pid)

    def finish(self) -> list[int]:
        """The tree after its command exited by itself: a rank that exited can leave loader workers behind; they
        belong to the run too. Returns processes still alive afterwards (should be none)."""
        self.proc.wait()
        if processes_in(self.groups):
            return self.kill()
        self._append_stacks()
        return []

    def kill(self, grace: float = KILL_GRACE_S) -> list[int]:
        """SIGTERM every group of the tree, SIGKILL what is left after ``grace``; returns processes still alive."""
        left = kill_tree(self.proc, self.groups, grace)
        self._append_stacks()
        return left

    def _append_stacks(self) -> None:
        """The stacks of the ranks that were stopped by a signal (by this launcher, or by torchrun when a peer
        failed), rank by rank, at the end of the log."""
        if not self.stacks.is_dir():
            return
        named = [(m, f) for f in self.stacks.glob("rank*.txt") if (m := STACKS_FILE.fullmatch(f.name))]
        named.sort(key=lambda mf: (int(mf[0]["rank"]), bool(mf[0]["worker"]), int(mf[0]["pid"])))
        with contextlib.suppress(ValueError, OSError):  # a log closed by its owner gets nothing
            for m, f in named:
                text = f.read_bytes()
                if text.strip():
                    who = f"rank {m['rank']}" + ("'s loader worker" if m["worker"] else "")
                    self.log.write(f"---- {who} (pid {m['pid']}) {STACKS_MARK} ----\n".encode() + text)
            self.log.flush()
        shutil.rmtree(self.stacks, ignore_errors=True)


class LineReader:
    """Tails a JSON-lines file that may not exist yet; returns only complete lines (a partial one waits)."""

    def __init__(self, path: Path, pos: int = 0):
        self.path, self.pos, self.buf = path, pos, b""

    def read(self, final: bool = False) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
                self.pos += len(data)
        except FileNotFoundError:
            return []
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        if final and self.buf.strip():
            lines.append(self.buf)
            self.buf = b""
        out = []
        for ln in lines:
            if not ln.strip():
                continue
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue  # a line torn by a rank killed mid-write carries nothing usable
            if isinstance(rec, dict):
                out.append(rec)
        return out


def log_tail(path: Path | None, lines: int | None = None, *, max_bytes: int = 16384) -> list[str]:
    """The non-blank lines at the end of a log file (its last ``lines`` of them when given); none where it cannot be
    read."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            tail = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:  # no log (the job never started), or one that cannot be read
        return []
    return tail[-lines:] if lines else tail


def proc_table() -> dict[int, tuple[int, int, str]]:
    """pid → (ppid, pgid, state) from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def groups_of_tree(root: int) -> set[int]:
    """Process groups of ``root`` and its descendants, except this process's own."""
    table = proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    own = os.getpgrp()
    groups, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid in table and table[pid][1] != own:
            groups.add(table[pid][1])
        stack.extend(children.get(pid, []))
    return groups


def processes_in(groups: set[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of ``groups``."""
    return sorted(pid for pid, (_, pgid, state) in proc_table().items() if pgid in groups and state != "Z")


def kill_tree(proc: subprocess.Popen, groups: set[int], grace: float = KILL_GRACE_S) -> list[int]:
    """SIGTERM the launched command (torchrun, which passes it on to its ranks and waits for them), then every group
    still alive; SIGKILL what is left after ``grace``. Returns processes still alive.

    A rank gets one SIGTERM, not one from here and one from torchrun: the second, arriving while the first's handler
    prints the rank's stacks, ends the rank half-way through them."""
    if proc.poll() is None:
        groups |= groups_of_tree(proc.pid)
    groups.discard(os.getpgrp())
    end = time.monotonic() + grace
    _signal_groups({proc.pid} & groups, signal.SIGTERM)  # started in a session of its own: its group is its pid
    while proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    _signal_groups(groups, signal.SIGTERM)  # what outlived it: loader workers, a rank it gave up on
    end = max(end, time.monotonic() + 1.0)
    while time.monotonic() < end:
        if proc.poll() is not None and not processes_in(groups):
            break
        time.sleep(0.05)
    if proc.poll() is None:
        groups |= groups_of_tree(proc.pid)
    _signal_groups(groups, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    end = time.monotonic() + 5
    while time.monotonic() < end and processes_in(groups):  # orphans are reaped by init, which takes a moment
        time.sleep(0.05)
    return processes_in(groups)


def _signal_groups(groups: set[int], sig: int) -> None:
    for g in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, sig)


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of ``root``, whatever their process group or session."""
    table = proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if table[pid][2] != "Z":
            out.append(pid)
        stack.extend(children.get(pid, []))
    return sorted(out)


# ---- dying with the parent -----------------------------------------------------------------------------------------


def die_with_parent_preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``sig`` when this process dies, or None off Linux.

    The kernel ties the signal to the *thread* that forked the child, so launch from a thread that lives as long as
    the job (the main thread). ``prctl`` is looked up here, in the parent: the child, forked from a process that may
    run threads (the NVML sampler), must do no more than call it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died between fork and prctl: nobody would signal us
            os._exit(1)

    return preexec
