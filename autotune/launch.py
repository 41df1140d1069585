"""Trial launch: a TrainConfig → ``torchrun ... -m trainer`` in its own process group, watched and cleaned up.

The job's JSON-lines stream is read while it runs (that is what makes pruning possible). A watchdog kills the whole
process tree when no measurement window arrives within the trial timeout (class ``hang``); pruning and Ctrl-C kill it
the same way. torchrun starts each rank in a session of its own, so "the process group" is the set of groups of
torchrun, its ranks and their DataLoader workers: all get SIGTERM, then SIGKILL, and the launcher checks that none
is left.

If the launcher itself dies (even by SIGKILL, which runs no clean-up), nothing of the trial outlives it: torchrun is
started with a parent-death signal (``prctl(PR_SET_PDEATHSIG)``), each rank sets one towards torchrun
(``trainer.lifeline``), and DataLoader workers exit when their rank is gone. No process left means no GPU memory held.

Every trial runs with the NVLink-multicast safety variables set, and a config or an inherited environment that would
turn NVLS on or force LL128 is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from autotune.exceptions import LaunchError

SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set on every trial: NVLink multicast can take a shared host's GPUs down for days."""

CLASS_PRIORITY = ("oom", "config", "loader", "crash", "nccl", "hang")
"""When ranks disagree, the root cause wins: a rank that ran out of memory makes its peers' collectives fail, so an
``oom`` record outranks the ``nccl`` records that follow it."""

POLL_S = 0.1
KILL_GRACE_S = 5.0
"""SIGTERM first (torchrun forwards it and ranks can flush their logs), SIGKILL after this."""

ERROR_GRACE_S = 30.0
"""After a rank reported an error, the others get this long to exit before the tree is killed."""

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_LOG_PATTERNS = [
    ("oom", re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED")),
    ("loader", re.compile(r"DataLoader worker \(pid|is killed by signal|Bus error|unable to (?:open|write to) "
                          r"(?:shared memory|file </torch_)|No space left on device.*shm|/dev/shm")),
    ("nccl", re.compile(r"NCCL error|nccl\w*Error|ProcessGroupNCCL|Watchdog caught collective|NCCL WARN|"
                        r"\[gloo|Gloo|Connection closed by peer|Connection reset by peer|DistNetworkError|"
                        r"DistStoreError|Socket Timeout")),
]


@dataclass(kw_only=True)
class TrialJob:
    """One launch: what to run and where its files go."""

    config: Any
    """The trial's TrainConfig."""

    trial_dir: Path
    nproc_per_node: int
    gpus: list[str] | None = None
    """``CUDA_VISIBLE_DEVICES`` entries (UUIDs preferably); ``None`` inherits the environment's."""

    torchrun_args: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    """Kill the job when no window arrives for this long (from launch, then from the previous window)."""

    extra_env: dict[str, str] = field(default_factory=dict)
    cores: int | None = None
    """CPU cores shared by the ranks (OMP_NUM_THREADS = cores // ranks); default: this process's affinity."""


@dataclass(kw_only=True)
class TrialRun:
    """What happened: the job's records, how it ended, and where the evidence is."""

    records: list[dict] = field(default_factory=list)
    returncode: int | None = None
    failure_class: str | None = None
    failure_message: str | None = None
    stopped: str | None = None
    """Why the launcher killed the job: ``hang``, ``pruned``, ``interrupted``, ``error`` (peers did not exit)."""

    leftover_pids: list[int] = field(default_factory=list)
    """Processes of the trial still alive after the kill (should always be empty)."""

    pgids: list[int] = field(default_factory=list)
    """Process groups the trial's processes were in (torchrun's, each rank's)."""

    log_path: Path | None = None
    result_path: Path | None = None
    config_path: Path | None = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """The variables this launcher set on top of the inherited environment."""

    t_launch: float = 0.0
    t_end: float = 0.0
    n_before_stop: int | None = None
    """Records received before the launcher decided to stop the job: what the kill itself provokes (peers
    reporting a closed connection) must not be mistaken for the trial's own failure."""

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    @property
    def windows(self) -> list[dict]:
        return self.of_kind("window")

    @property
    def summary(self) -> dict | None:
        s = self.of_kind("summary")
        return s[-1] if s else None

    @property
    def steady_windows(self) -> list[dict]:
        return steady_windows(self.windows, self.summary)

    @property
    def ok(self) -> bool:
        return self.failure_class is None and self.summary is not None

    def timing(self) -> dict[str, float | None]:
        """launch_s: Popen → the job's start record (torchrun, import torch, process group); warmup_s: start →
        warm-up done, split into setup_s (start → ready: data, model, DDP), first_step_s (ready → the first step
        done, as rank 0 saw it: loader start-up, cudnn autotuning, communicators) and the steps discarded after it;
        measure_s: first window start → last window end; wall_s: Popen → exit."""
        start, warm, win = self.of_kind("start"), self.of_kind("warmup_done"), self.windows
        t_start = min((float(r["t"]) for r in start), default=None)
        ready = max((float(r["t"]) for r in self.of_kind("ready")), default=None)
        first = max((float(r["t"]) for r in self.of_kind("first_step")), default=None)
        return {
            "launch_s": round(t_start - self.t_launch, 3) if t_start else None,
            "setup_s": round(ready - t_start, 3) if ready and t_start else None,
            "first_step_s": round(first - ready, 3) if first and ready else None,
            "warmup_s": round(float(warm[0]["t"]) - t_start, 3) if warm and t_start else None,
            "measure_s": round(float(win[-1]["t1"]) - float(win[0]["t0"]), 3) if win else None,
            "wall_s": round(self.t_end - self.t_launch, 3),
        }


def steady_windows(windows: list[dict], summary: dict | None) -> list[dict]:
    """The windows the job's result stands on (its summary's ``windows_used``): utilization and CPU load are averaged
    over these, not over the windows the job discarded as warm-up. Without a summary (pruned or killed), all."""
    used = set((summary or {}).get("windows_used") or [])
    return [w for w in windows if w.get("window") in used] or windows


# ---- environment and argv ----------------------------------------------------------------------------------------


def trial_env(job: TrialJob, base: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(full environment, the part this launcher set). Raises LaunchError for an unsafe NCCL/NVLS setting."""
    from trainer.config import nccl_env_problems

    base = dict(os.environ if base is None else base)
    nccl = job.config.nccl.to_env()
    inherited = {k: v for k, v in base.items() if k.startswith("NCCL_") and k not in nccl}
    problems = [f"{p} (inherited from the environment)" for p in nccl_env_problems(inherited)]
    problems += nccl_env_problems(nccl)
    for key in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        if key in base and base[key].strip() != "1":
            problems.append(f"{key}={base[key]} in the environment: NVLink multicast must stay off; unset it")
    if problems:
        raise LaunchError("unsafe trial environment: " + "; ".join(problems))
    cores = job.cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    ours = {
        **nccl,
        "OMP_NUM_THREADS": str(max(1, cores // max(1, job.nproc_per_node))),
        "PYTHONUNBUFFERED": "1",
        **job.extra_env,
        **SAFETY_ENV,
    }
    if job.gpus is not None:
        ours["CUDA_VISIBLE_DEVICES"] = ",".join(job.gpus)
    return {**base, **ours}, ours


def torchrun_argv(nproc: int, torchrun_args: list[str], config_path: Path, result_path: Path) -> list[str]:
    args = list(torchrun_args)
    if any(a.split("=")[0] in ("--nproc-per-node", "--nproc_per_node") for a in args):
        raise LaunchError("world.torchrun_args: set the ranks per node with nproc_per_node (--nproc-per-node), "
                          "not in torchrun_args")
    multi_node = any(a.split("=")[0] in ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                                         "--master_addr") for a in args)
    # sys.executable: the trial runs in the same environment (venv) as the tuner.
    return [sys.executable, "-m", "torch.distributed.run", *([] if multi_node else ["--standalone"]),
            "--nproc-per-node", str(nproc), *args, "-m", "trainer", "--config", str(config_path),
            "--result", str(result_path)]


def nnodes_of(torchrun_args: list[str]) -> int:
    """Nodes from ``--nnodes N`` / ``--nnodes=MIN:MAX`` (the max) in torchrun arguments; 1 without."""
    for i, a in enumerate(torchrun_args):
        key, _, val = a.partition("=")
        if key == "--nnodes":
            val = val or (torchrun_args[i + 1] if i + 1 < len(torchrun_args) else "1")
            try:
                return int(val.split(":")[-1])
            except ValueError:
                return 1
    return 1


# ---- running -----------------------------------------------------------------------------------------------------


def run_trial(job: TrialJob, on_record: Callable[[dict], bool | None] | None = None,
              on_poll: Callable[[], None] | None = None) -> TrialRun:
    """Launch, stream, watch, clean up. ``on_record`` sees each record as it arrives; returning True stops the job
    (recorded as ``pruned``). ``on_poll`` runs on every poll (every ``POLL_S``; the trial's heartbeat rate-limits
    itself). KeyboardInterrupt kills the job, then propagates."""
    d = Path(job.trial_dir)
    d.mkdir(parents=True, exist_ok=True)
    run = TrialRun(log_path=d / "log.txt", result_path=d / "result.jsonl", config_path=d / "config.yaml")
    run.result_path.unlink(missing_ok=True)  # the job appends: a rerun must not read an older trial's records
    job.config.to_yaml(run.config_path)
    env, run.env = trial_env(job)
    run.argv = torchrun_argv(job.nproc_per_node, job.torchrun_args, run.config_path, run.result_path)

    with open(run.log_path, "wb") as log:
        log.write(("$ " + " ".join(run.argv) + "\n").encode())
        log.flush()
        run.t_launch = time.time()
        proc = subprocess.Popen(run.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=die_with_parent_preexec())
        groups: set[int] = {proc.pid}
        reader = LineReader(run.result_path)
        deadline = time.monotonic() + job.timeout_s
        error_deadline = None
        try:
            while True:
                groups |= groups_of_tree(proc.pid)
                if on_poll is not None:
                    on_poll()
                for rec in reader.read():
                    run.records.append(rec)
                    kind = rec.get("kind")
                    if kind == "window":
                        deadline = time.monotonic() + job.timeout_s
                    if kind == "error" and error_deadline is None:
                        error_deadline = time.monotonic() + ERROR_GRACE_S
                    if on_record is not None and on_record(rec) and run.stopped is None:
                        run.stopped = "pruned"
                if run.stopped or proc.poll() is not None:
                    if run.stopped:
                        run.n_before_stop = len(run.records)
                    break
                now = time.monotonic()
                if now > deadline:
                    run.stopped, run.n_before_stop = "hang", len(run.records)
                    break
                if error_deadline is not None and now > error_deadline:
                    run.stopped, run.n_before_stop = "error", len(run.records)
                    break
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            run.stopped, run.n_before_stop = "interrupted", len(run.records)
            run.leftover_pids = kill_tree(proc, groups)
            raise
        finally:
            if run.stopped and run.stopped != "interrupted":
                run.leftover_pids = kill_tree(proc, groups)
            elif proc.poll() is None and run.stopped != "interrupted":
                run.leftover_pids = kill_tree(proc, groups)
            else:
                proc.wait()
                # A rank that exited can leave loader workers behind; they are part of the trial too.
                run.leftover_pids = kill_tree(proc, groups) if _alive_in(groups) else []
            run.returncode = proc.returncode
            run.t_end = time.time()
            run.pgids = sorted(groups)
            run.records.extend(reader.read(final=True))
    run.failure_class, run.failure_message = classify(run)
    return run


def classify(run: TrialRun) -> tuple[str | None, str | None]:
    """(failure class, one-line message) of a finished run; (None, None) for a success or a pruned run."""
    considered = run.records if run.n_before_stop is None else run.records[:run.n_before_stop]
    errors = [r for r in considered if r.get("kind") == "error"]
    if run.stopped == "pruned":
        return None, None
    if errors:
        best = min(errors, key=lambda r: (_prio(r.get("class")), float(r.get("t", 0))))
        cls = best.get("class") if best.get("class") in CLASS_PRIORITY else "crash"
        return cls, f"rank {best.get('rank', '?')}: {best.get('message', '')}".strip()
    if run.stopped == "hang":
        last = "a window" if run.windows else "the first window"
        return "hang", f"no measurement window for {_timeout_text(run)}; waiting for {last}; process tree killed"
    if run.stopped == "interrupted":
        return "crash", "interrupted (Ctrl-C)"
    if run.returncode == 0 and run.summary is not None:
        return None, None
    tail = _tail(run.log_path)
    for cls, pattern in _LOG_PATTERNS:
        for line in reversed(tail):
            if pattern.search(line):
                return cls, line.strip()[:300]
    if run.returncode == 0:
        return "crash", "the job exited without a summary record"
    meaningful = [ln for ln in tail if re.search(r"Error|error|Exception|exitcode|Signal", ln)]
    return "crash", (meaningful[-1] if meaningful else (tail[-1] if tail else f"exit code {run.returncode}"))[:300]


def _timeout_text(run: TrialRun) -> str:
    return f"{round(run.t_end - run.t_launch)} s (trial timeout)"


def _prio(cls: str | None) -> int:
    return CLASS_PRIORITY.index(cls) if cls in CLASS_PRIORITY else CLASS_PRIORITY.index("crash")


def _tail(path: Path | None, max_bytes: int = 16384) -> list[str]:
    if path is None or not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - max_bytes))
        return [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]


class LineReader:
    """Tails a JSON-lines file that may not exist yet; returns only complete lines (a partial one waits)."""

    def __init__(self, path: Path):
        self.path, self.pos, self.buf = path, 0, b""

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


# ---- process tree ------------------------------------------------------------------------------------------------


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


def _alive_in(groups: set[int]) -> bool:
    return bool(processes_in(groups))


def kill_tree(proc: subprocess.Popen, groups: set[int], grace: float = KILL_GRACE_S) -> list[int]:
    """SIGTERM every group of the trial, SIGKILL what is left after ``grace``; returns processes still alive."""
    if proc.poll() is None:
        groups |= groups_of_tree(proc.pid)
    groups.discard(os.getpgrp())
    _signal_groups(groups, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if proc.poll() is not None and not _alive_in(groups):
            break
        time.sleep(0.05)
    if proc.poll() is None:
        groups |= groups_of_tree(proc.pid)
    _signal_groups(groups, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    end = time.monotonic() + 5
    while time.monotonic() < end and _alive_in(groups):  # orphans are reaped by init, which takes a moment
        time.sleep(0.05)
    return processes_in(groups)


def _signal_groups(groups: set[int], sig: int) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass


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
