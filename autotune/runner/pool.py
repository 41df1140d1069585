"""Live trial workers: one ``torchrun -m trainer --serve`` process tree runs trial after trial.

A fresh trial pays torchrun's start, ``import torch``, the CUDA context and the communicators (a sizeable share of a
short trial; docs/benchmarks.md) before its first step; a worker pays them once. The pool keeps one worker alive and
hands it each trial whose process-scope settings (``TrialJob.process_key``: NCCL environment, backend, world, GPUs)
match its own (``TrialJob.runs_on``: the built-in job also runs on a user's function's worker); anything else, and a
trial that must be measured in a fresh process (the baseline), gets a new worker.

Isolation: a trial that fails in any way (OOM, NCCL error, hang, dead loader, interrupted) costs its worker: the
worker exits by itself on an error, or is killed, and the next trial gets a fresh one. A pruned trial is cancelled
in-band (the job stops at its next window's end) and the worker lives on.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from autotune.runner.process import LineReader, ProcessTree
from autotune.runner.torchrun import Torchrun, trainer_args
from autotune.runner.trial import Stopped, TrialJob, TrialRun, end, follow, prepare, run_trial
from trainer.protocol import Kind

STOP_GRACE_S = 20.0
"""A worker asked to stop (end of the search, a new process scope) gets this long to leave its process group."""


class Worker:
    """One live worker: launched with its first trial, then fed through its requests file."""

    def __init__(self, job: TrialJob, run: TrialRun, folder: Path, name: str):
        self.name, self.key, self.key_any_script = name, job.process_key(), job.process_key(script=False)
        self.job = job
        """The job it was launched with: what a job it cannot serve differs from (``TrialJob.differs_from``)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.requests, self.log_path = folder / "requests.jsonl", folder / "log.txt"
        self.requests.write_bytes(b"")
        env, self.env = job.env()
        self.argv = Torchrun.parse(job.torchrun_args).argv(
            job.nproc_per_node, trainer_args(run.config_path, run.result_path, cancel=cancel_path(run),
                                             serve=self.requests))
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - open for the worker's whole life; closed in stop()
        self.log.write(("$ " + " ".join(self.argv) + "\n").encode())
        self.log.flush()
        self.tree = ProcessTree(self.argv, env=env, log=self.log)
        self.trials = 1

    def alive(self) -> bool:
        return self.tree.poll() is None

    def submit(self, run: TrialRun, job: TrialJob) -> float:
        """Append the trial's request; returns when it was made."""
        line = json.dumps({"config": job.config.to_dict(), "result": str(run.result_path),
                           "cancel": str(cancel_path(run))})
        with open(self.requests, "ab") as f:
            f.write((line + "\n").encode())  # one write of one whole line: the ranks never read half a request
        self.trials += 1
        return time.time()

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[int]:
        """Ask the worker to finish (it leaves its process group cleanly), kill it if it does not; returns processes
        still alive afterwards (should be none)."""
        if self.alive():
            with open(self.requests, "ab") as f:
                f.write(b'{"stop": true}\n')
            deadline = time.monotonic() + grace_s
            while self.alive() and time.monotonic() < deadline:
                self.tree.scan()
                time.sleep(0.05)
        leftover = self.tree.kill() if self.alive() else self.tree.finish()
        self.log.close()
        return leftover

    def kill(self) -> list[int]:
        leftover = self.tree.kill()
        self.log.close()
        return leftover


class WorkerPool:
    """At most one live worker at a time (a search runs one trial at a time on its GPUs)."""

    def __init__(self, root: Path):
        # A folder of the pool's own: search workers sharing a study share its logs folder, and a worker runs every
        # request appended to its requests file (two pools on one file ran each other's trials).
        Path(root).mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix=f"{socket.gethostname()}-{os.getpid()}-", dir=root))
        self.worker: Worker | None = None
        self.launched = 0
        self.gone: str | None = None
        """Why there is no live worker, once there was one."""

    def run(self, job: TrialJob, *, fresh: bool | str = False, on_record: Callable[[dict], bool | None] | None = None,
            on_poll: Callable[[], None] | None = None) -> TrialRun:
        """Run ``job`` on the live worker, or on a new one when ``fresh`` (True, or why in words), when there is
        none or when its process scope differs; the run says why it got a new one (``TrialRun.fresh``). A worker
        that turns out to have exited before starting the trial is replaced, once. A user's script file cannot serve
        trials: it runs in a process of its own, always."""
        if job.config.script.path:
            self.close()
            run = run_trial(job, on_record=on_record, on_poll=on_poll)
            run.fresh = "a script file runs each trial in a process of its own"
            return run
        run, reused = self._run_once(job, fresh=fresh, on_record=on_record, on_poll=on_poll)
        if reused and not run.of_kind(Kind.START) and not run.stopped:
            run, _ = self._run_once(job, fresh="the live worker had exited", on_record=on_record, on_poll=on_poll)
        return run

    def why_new(self, job: TrialJob, fresh: bool | str = False) -> str | None:
        """Why ``job`` needs a new worker, in words; None: the live one serves it."""
        w = self.worker
        if fresh:
            return fresh if isinstance(fresh, str) else "a fresh process was asked for"
        if w is None:
            return self.gone or "no live worker yet"
        if not w.alive():
            return "the live worker had exited"
        if not job.runs_on(w.key, w.key_any_script):
            return f"{', '.join(job.differs_from(w.job)) or 'its process scope'}: a live process cannot change it"
        return None

    def _run_once(self, job: TrialJob, *, fresh: bool | str, on_record, on_poll) -> tuple[TrialRun, bool]:
        run = prepare(job)
        cancel_path(run).unlink(missing_ok=True)
        w = self.worker
        run.fresh = self.why_new(job, fresh)
        reused = run.fresh is None
        if not reused:
            self.close()
            self.launched += 1
            w = self.worker = Worker(job, run, self.root / f"worker-{self.launched}", f"worker-{self.launched}")
            run.t_launch = w.tree.t_launch
        else:
            run.t_launch = w.submit(run, job)
        run.worker, run.log_path, run.argv, run.env = w.name, w.log_path, w.argv, w.env
        reader = LineReader(run.result_path)
        try:
            follow(w.tree, reader, run, timeout_s=job.timeout_s, on_record=on_record, on_poll=on_poll,
                   complete=lambda rec: rec.get("kind") == Kind.SUMMARY,
                   cancel=lambda: cancel_path(run).touch())
        except KeyboardInterrupt:
            run.stopped, run.n_before_stop = Stopped.INTERRUPTED, len(run.records)
            self._retire(run, reader)
            raise
        if run.stopped in (Stopped.HANG, Stopped.ERROR) or not w.alive() or run.summary is None:
            self._retire(run, reader)
        else:
            end(run, w.tree, reader, alive=True)
        return run, reused

    def _retire(self, run: TrialRun, reader: LineReader) -> None:
        """The trial failed: its worker goes (killed if it has not exited by itself) and the books are closed."""
        w, self.worker = self.worker, None
        self.gone = "the last worker ended with its trial (a failure costs the worker)"
        exited = not w.alive()
        run.leftover_pids = w.tree.finish() if exited else w.kill()
        if exited:
            w.log.close()
        end(run, w.tree, reader)

    def close(self) -> list[int]:
        """Stop the live worker, if any; returns processes left (should be none)."""
        w, self.worker = self.worker, None
        return w.stop() if w is not None else []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self.worker is not None:  # an interrupted search: no grace for the worker
            w, self.worker = self.worker, None
            w.kill()


def cancel_path(run: TrialRun) -> Path:
    return run.result_path.with_name("cancel")
