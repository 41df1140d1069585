"""One measured run of a TrainConfig — a search trial, a benchmark row, an export's re-measure — and what happened.

The job's JSON-lines stream is read while it runs (that is what makes pruning possible). A watchdog ends the run when
no measurement window arrives within the trial timeout (``stopped: hang``); pruning and Ctrl-C end it too. What the
run's end means (its failure class) is ``autotune.verdict``'s to say: this module collects. Every run has
the NVLink-multicast safety variables set, and a config or an inherited environment that would turn NVLS on or
force LL128 is refused before anything starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.runner.process import LineReader, ProcessTree
from autotune.runner.torchrun import Torchrun, program, run_env
from trainer.config import TrainConfig, process_settings
from trainer.protocol import Kind, StrEnum

POLL_S = 0.1

SCRIPT_EXIT_GRACE_S = 20.0
"""A user's script told its trial is measured gets this long to end by itself (it may save a checkpoint, or run
validation) before it is stopped; its figures stand either way."""

ERROR_GRACE_S = 30.0
"""After a rank reported an error, the others get this long to exit before the tree is killed."""

class Stopped(StrEnum):
    """Why the launcher ended a run before it ended by itself (``TrialRun.stopped``)."""

    HANG = "hang"
    """No measurement window within the trial timeout."""

    ERROR = "error"
    """A rank reported an error and its peers did not exit."""

    PRUNED = "pruned"
    """The search asked for it (``on_record`` returned True): pruned, or a measurement of a part that said enough."""

    INTERRUPTED = "interrupted"
    """Ctrl-C."""

    MEASURED = "measured"
    """A user's script that went on after its summary."""


@dataclass(kw_only=True)
class TrialJob:
    """One run: what to run, where its files go, and on which GPUs."""

    config: TrainConfig
    trial_dir: Path
    nproc_per_node: int
    gpus: list[str] | None = None
    """``CUDA_VISIBLE_DEVICES`` entries (UUIDs preferably); ``None`` inherits the environment's."""

    torchrun_args: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    """End the run when no window arrives for this long (from launch, then from the previous window)."""

    extra_env: dict[str, str] = field(default_factory=dict)
    cores: int | None = None
    """CPU cores shared by the ranks (OMP_NUM_THREADS = cores // ranks); default: this process's affinity."""

    def process_key(self, *, script: bool = True) -> str:
        """Equal for two jobs that can share one live process (``trainer.config.process_settings``, the world, the
        GPUs and the environment); without ``script``: whatever user's function the process serves."""
        settings = process_settings(self.config)
        if not script:
            settings.pop("script")
        return repr((settings, self.nproc_per_node, self.gpus, list(self.torchrun_args),
                     sorted(self.extra_env.items()), self.cores))

    def runs_on(self, key: str, key_any_script: str) -> bool:
        """Whether this job can run on a live process made for a job of these keys (``process_key``): one of the
        same key, or, for the built-in job, one of a user's function with the same settings otherwise (the worker
        runs the built-in job as well; a measurement of the project's pipeline in a search of that function then
        costs no worker of its own, nor the function's worker made anew after it)."""
        if key == self.process_key():
            return True
        return not self.config.script.given and key_any_script == self.process_key(script=False)

    def differs_from(self, other: TrialJob) -> list[str]:
        """What keeps this job off a live process made for ``other`` (``process_key``): the settings, by name."""
        mine, theirs = process_settings(self.config), process_settings(other.config)
        names = [k for k in mine if mine[k] != theirs[k]]
        for name, a, b in (("ranks", self.nproc_per_node, other.nproc_per_node), ("GPUs", self.gpus, other.gpus),
                           ("torchrun arguments", self.torchrun_args, other.torchrun_args),
                           ("environment", self.extra_env, other.extra_env), ("CPU cores", self.cores, other.cores)):
            if a != b:
                names.append(name)
        return names

    def env(self) -> tuple[dict[str, str], dict[str, str]]:
        return run_env(nccl=self.config.nccl.to_env(), nproc=self.nproc_per_node, gpus=self.gpus,
                       extra=self.extra_env, cores=self.cores)


@dataclass(kw_only=True)
class TrialRun:
    """What happened: the job's records, how it ended, and where the evidence is. Collected, not judged: its
    failure class, if any, is ``autotune.verdict``'s to decide (``judge``)."""

    records: list[dict] = field(default_factory=list)
    returncode: int | None = None
    """The process's exit code; None for a trial of a worker that lives on."""

    stopped: Stopped | None = None
    """Why the launcher ended the run (``Stopped``); None: it ended by itself."""

    leftover_pids: list[int] = field(default_factory=list)
    """Processes of the run still alive after the kill (should always be empty)."""

    pgids: list[int] = field(default_factory=list)
    log_path: Path | None = None
    result_path: Path | None = None
    config_path: Path | None = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """The variables the launcher set on top of the inherited environment."""

    t_launch: float = 0.0
    """When the run was asked for: the process launch, or for a worker's trial the request."""

    t_end: float = 0.0
    t_stopped: float | None = None
    """When the launcher decided to stop the run (wall clock): what the run said last is read against it."""

    n_before_stop: int | None = None
    """Records received before the launcher decided to stop the run: what the kill itself provokes (peers
    reporting a closed connection) must not be mistaken for the run's own failure."""

    worker: str | None = None
    """The live worker that ran it (None: a process of its own)."""

    fresh: str | None = None
    """Why it ran in a process started for it, in words (None: on a worker that was already live)."""

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    @property
    def windows(self) -> list[dict]:
        return self.of_kind(Kind.WINDOW)

    @property
    def summary(self) -> dict | None:
        s = self.of_kind(Kind.SUMMARY)
        return s[-1] if s else None

    @property
    def steady_windows(self) -> list[dict]:
        return steady_windows(self.windows, self.summary)

    def timing(self) -> dict[str, Any]:
        """launch_s: asked for → the job's start record (a fresh process: torchrun, import torch, the process group);
        setup_s: start → ready (data, model, DDP); first_step_s: ready → the first step done, with its parts
        first_batch_s (loader start-up) and first_compute_s (cuDNN's algorithm search, the first all-reduce);
        warmup_s: start → warm-up done; measure_s: first window start → last window end; wall_s: asked → done."""
        first = lambda kind: next((r for r in self.records if r.get("kind") == kind), None)
        start, ready, step, warm = first(Kind.START), first(Kind.READY), first(Kind.FIRST_STEP), first(Kind.WARMUP_DONE)
        t = {k: float(r["t"]) if r else None for k, r in (("start", start), ("ready", ready), ("step", step),
                                                          ("warm", warm))}
        win = self.windows
        span = lambda a, b: round(t[b] - t[a], 3) if t[a] and t[b] else None
        return {
            "launch_s": round(t["start"] - self.t_launch, 3) if t["start"] else None,
            "setup_s": span("start", "ready"), "first_step_s": span("ready", "step"), "warmup_s": span("start", "warm"),
            "first_batch_s": step.get("first_batch_s") if step else None,
            "first_compute_s": step.get("first_compute_s") if step else None,
            "nccl_init_s": start.get("init_s") if start and not start.get("worker_trial") else None,
            "measure_s": round(float(win[-1]["t1"]) - float(win[0]["t0"]), 3) if win else None,
            "wall_s": round(self.t_end - self.t_launch, 3),
        }


def steady_windows(windows: list[dict], summary: dict | None) -> list[dict]:
    """The windows the job's result stands on (its summary's ``windows_used``): utilization and CPU load are averaged
    over these, not over the windows the job discarded as warm-up. Without a summary (pruned or killed), all."""
    used = set((summary or {}).get("windows_used") or [])
    return [w for w in windows if w.get("window") in used] or windows


# ---- following a run -----------------------------------------------------------------------------------------------


def follow(tree: ProcessTree, reader: LineReader, run: TrialRun, *, timeout_s: float | None,
           on_record: Callable[[dict], bool | None] | None = None, on_poll: Callable[[], None] | None = None,
           complete: Callable[[dict], bool] | None = None, cancel: Callable[[], None] | None = None) -> None:
    """Read the run's records as they arrive, until its process exits or:

    - ``complete(record)`` is true (a worker's trial: its summary; the process lives on);
    - ``on_record(record)`` returns True: the run is to stop (``pruned``). With ``cancel``, the job is asked to
      stop at its next window and followed to its summary; without, following ends at once (the caller kills);
    - no window for ``timeout_s`` (``hang``), or a rank reported an error and its peers did not exit within
      ``ERROR_GRACE_S`` (``error``).

    ``on_poll`` runs every poll (the trial's heartbeat rate-limits itself). KeyboardInterrupt propagates."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    error_deadline = None
    while True:
        tree.scan()
        if on_poll is not None:
            on_poll()
        for rec in reader.read():
            run.records.append(rec)
            kind = rec.get("kind")
            if kind == Kind.WINDOW and timeout_s:
                deadline = time.monotonic() + timeout_s
            if kind == Kind.ERROR and error_deadline is None:
                error_deadline = time.monotonic() + ERROR_GRACE_S
            if on_record is not None and on_record(rec) and run.stopped is None:
                run.stopped, run.n_before_stop = Stopped.PRUNED, len(run.records)
                if cancel is None:
                    return
                cancel()
            if complete is not None and complete(rec):
                return
        if tree.poll() is not None:
            return
        now = time.monotonic()
        for why, limit in ((Stopped.HANG, deadline), (Stopped.ERROR, error_deadline)):
            if limit is not None and now > limit:
                run.stopped, run.n_before_stop, run.t_stopped = why, len(run.records), time.time()
                return
        time.sleep(POLL_S)


# ---- a run in a process of its own -------------------------------------------------------------------------------


def prepare(job: TrialJob) -> TrialRun:
    """The run's folder, config file and (fresh) result file."""
    d = Path(job.trial_dir)
    d.mkdir(parents=True, exist_ok=True)
    run = TrialRun(log_path=d / "log.txt", result_path=d / "result.jsonl", config_path=d / "config.yaml")
    run.result_path.unlink(missing_ok=True)  # the job appends: a rerun must not read an older run's records
    job.config.to_yaml(run.config_path)
    return run


def run_trial(job: TrialJob, on_record: Callable[[dict], bool | None] | None = None,
              on_poll: Callable[[], None] | None = None) -> TrialRun:
    """Launch ``job`` in a process of its own, stream, watch, clean up. ``on_record`` sees each record as it arrives;
    returning True stops the run (recorded as ``pruned``). KeyboardInterrupt kills the run, then propagates."""
    run = prepare(job)
    env, run.env = job.env()
    words, extra = program(job.config, run.config_path, run.result_path)
    env.update(extra)
    run.env.update(extra)
    run.argv = Torchrun.parse(job.torchrun_args).argv(job.nproc_per_node, words)
    script = bool(job.config.script.path)
    with open(run.log_path, "wb") as log:
        log.write(("$ " + " ".join(run.argv) + "\n").encode())
        log.flush()
        tree = ProcessTree(run.argv, env=env, log=log)
        run.t_launch = tree.t_launch
        reader = LineReader(run.result_path)
        try:
            # A user's script is done with the trial once it has written its summary, whatever it does after.
            follow(tree, reader, run, timeout_s=job.timeout_s, on_record=on_record, on_poll=on_poll,
                   complete=(lambda rec: rec.get("kind") == Kind.SUMMARY) if script else None)
            if script and run.summary is not None and not linger(tree, SCRIPT_EXIT_GRACE_S):
                run.stopped, run.n_before_stop = Stopped.MEASURED, len(run.records)
        except KeyboardInterrupt:
            run.stopped, run.n_before_stop = Stopped.INTERRUPTED, len(run.records)
            raise
        finally:
            ended_by_itself = not run.stopped and tree.poll() is not None
            run.leftover_pids = tree.finish() if ended_by_itself else tree.kill()
            end(run, tree, reader)
    return run


def linger(tree: ProcessTree, grace_s: float) -> bool:
    """Wait up to ``grace_s`` for the tree to exit by itself; whether it did."""
    deadline = time.monotonic() + grace_s
    while tree.poll() is None and time.monotonic() < deadline:
        tree.scan()
        time.sleep(POLL_S)
    return tree.poll() is not None


def end(run: TrialRun, tree: ProcessTree, reader: LineReader, *, alive: bool = False) -> None:
    """Close the books of a run: the last records, the exit code, the process groups (``autotune.verdict`` judges
    it)."""
    run.returncode = None if alive else tree.returncode
    run.t_end = time.time()
    run.pgids = sorted(tree.groups)
    run.records.extend(reader.read(final=not alive))
