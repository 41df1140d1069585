"""The process torchrun starts: one run (``run``), or a trial worker, one process group and trial after trial
(``serve``). Either way a run is the built-in ``Job`` or a user's entry function (``run_job``), and every failure
ends in an error record (``run_recorded``).

``python -m trainer --config first.yaml --result first.jsonl --serve requests.jsonl`` runs the first config as a
fresh job does, then serves more: the tuner appends one JSON line per trial to the requests file,
``{"config": {...}, "result": "/abs/trial-7/result.jsonl", "cancel": "/abs/trial-7/cancel"}``, and
``{"stop": true}`` at the end (a trial ends early, at a window's end, once its ``cancel`` file exists). Each trial is a
``Job`` of its own (built, run, closed) streaming its records to its own result file, so the tuner reads a reused
trial exactly as a fresh one. What a trial needs from the process itself — the NCCL environment, the backend, the
process group's timeout, the user's function it serves (``trainer.config.process_settings``) — must equal the first
config's (the built-in job runs on a function's worker as well, ``trainer.config.serves``); the tuner starts a new
worker for anything else.

Launch, ``import torch``, the CUDA context and the communicators are paid once per worker instead of once per trial.
Isolation is kept by ending the worker at the first failure (an OOM, a NCCL error, a dead loader leave state nobody
should measure on) and whenever a closed trial leaves a loader process or a thread behind: the next trial then gets
a fresh worker.

Every rank reads the requests file itself: all see the same lines in the same order, and no collective waits for
the tuner (an idle worker would otherwise hit the process group's timeout between trials).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from trainer.apply import init_distributed, shutdown_distributed
from trainer.compiled import process_threads
from trainer.config import ConfigError, TrainConfig, process_settings, serves
from trainer.job import Job
from trainer.protocol import Failure, ResultWriter, error_record
from trainer.records import Dist, start_record
from trainer.runtime import kept
from trainer.runtime.entry import run_entry

REQUEST_POLL_S = 0.02
"""How often an idle worker looks for the next request: 20 ms is nothing next to a trial, and costs no CPU."""

LEAK_GRACE_S = 5.0
"""How long a closed trial's loader processes and threads get to go before the worker gives up on its process."""


def run(cfg: TrainConfig, result_path: str | None, *, cancel: str | None = None) -> int:
    """One run in a fresh process; returns the process exit code."""
    writer = ResultWriter(result_path, int(os.environ.get("RANK", 0)))

    def body() -> None:
        env = init_distributed(cfg)
        writer.rank = env.rank
        run_job(cfg, env, writer, cancel=cancel)
        shutdown_distributed()

    try:
        return run_recorded(writer, body)
    finally:
        writer.close()


def run_job(cfg: TrainConfig, env: Dist, writer: ResultWriter, *, worker_trial: int | None = None,
            cancel: str | None = None) -> None:
    """The ``start`` record, then the run: a user's training function (``script.entry``, through the runtime) or
    one built-in Job from build to close. The run ends early, at a window's end, once the file ``cancel`` exists."""
    writer.write(start_record(env, worker_trial))
    if cfg.script.given:  # a script file runs under torchrun itself, not here
        if cfg.script.path:
            raise ConfigError([f"script.path={cfg.script.path}: a script file runs as `torchrun ... "
                               f"{cfg.script.path}`, not through `python -m trainer`; use script.entry for a function"])
        run_entry(cfg, env, writer, cancel=cancel, worker_trial=worker_trial)
        return
    job = Job(cfg, env, writer, cancel=cancel)
    try:
        job.run()
    finally:
        job.close()


def run_recorded(writer: ResultWriter, body) -> int:
    """Run ``body()``; every failure ends in an error record (any rank), never in silence. Returns the exit code."""
    try:
        body()
        return 0
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        record = error_record(e)
        writer.write(record, any_rank=True)
        print(f"[rank {writer.rank}] {record['class']}: {record['message']}", file=sys.stderr)
        traceback.print_exc()
        return 3 if record["class"] == Failure.CONFIG else 1


def serve(first: TrainConfig, first_result: str | None, requests: str | Path, *, cancel: str | None = None) -> int:
    """Run ``first``, then every requested trial, until a stop request; returns the process exit code."""
    rank = int(os.environ.get("RANK", 0))
    settings = process_settings(first)
    baseline_threads = set(threading.enumerate())
    env = None
    for index, (cfg, result, cancel_file) in enumerate(_trials(first, first_result, Path(requests), cancel)):
        writer = ResultWriter(result, rank)

        def body(cfg=cfg, index=index, cancel_file=cancel_file, writer=writer) -> None:
            nonlocal env
            if not serves(settings, cfg):
                raise ConfigError([f"this worker runs with {settings}; the trial needs {process_settings(cfg)}: a "
                                   "process-scope setting changed, which takes a new worker"])
            if env is None:
                env = init_distributed(cfg)
            run_job(cfg, env, writer, worker_trial=index, cancel=cancel_file)

        try:
            code = run_recorded(writer, body)
        finally:
            writer.close()
        if code:
            return code
        baseline_threads |= lifetime_threads()
        leaks = leftovers(baseline_threads)
        if leaks:
            print(f"[rank {rank}] trial {index} left {leaks} behind: this worker stops, the next trial gets a fresh "
                  "one", file=sys.stderr)
            return 4
    kept.release()
    shutdown_distributed()
    return 0


def _trials(first: TrainConfig, first_result: str | None, requests: Path,
            first_cancel: str | None) -> Iterator[tuple[TrainConfig, str | None, str | None]]:
    yield first, first_result, first_cancel
    for request in read_requests(requests):
        if request.get("stop"):
            return
        yield TrainConfig.from_dict(request["config"]), request.get("result"), request.get("cancel")


def read_requests(path: Path, poll_s: float = REQUEST_POLL_S) -> Iterator[dict]:
    """The requests file's JSON lines as they are appended (a line counts once it ends in a newline)."""
    pos, buf = 0, b""
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
        except FileNotFoundError:
            data = b""
        pos += len(data)
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
        if not lines:
            time.sleep(poll_s)


def lifetime_threads() -> set[threading.Thread]:
    """Threads that live as long as the process by design, started by whichever trial came first: torch.compile's
    pools (``trainer.compiled.process_threads``) and tqdm's monitor (one per process, started by its first progress
    bar, a disabled one too, which never stops it)."""
    threads = process_threads()
    std = sys.modules.get("tqdm.std")
    monitor = getattr(getattr(std, "tqdm", None), "monitor", None)
    if isinstance(monitor, threading.Thread):
        threads.add(monitor)
    return threads


def leftovers(baseline_threads: set[threading.Thread], grace_s: float = LEAK_GRACE_S) -> str | None:
    """What a closed trial left running (loader processes, threads it started), after a grace period; None when
    nothing. Loader workers the worker keeps for the next trial (``trainer.runtime.kept``) are its own."""
    deadline = time.monotonic() + grace_s
    while True:
        own, own_threads = kept.processes(), kept.threads()
        children = [p for p in multiprocessing.active_children() if p.pid not in own]  # reaps the exited ones
        threads = [t for t in threading.enumerate()
                   if t not in baseline_threads and t not in own_threads and t.is_alive()]
        if not children and not threads:
            return None
        if time.monotonic() > deadline:
            parts = [f"{len(children)} process(es)"] if children else []
            parts += [f"thread {t.name!r}" for t in threads]
            return ", ".join(parts)
        time.sleep(0.05)
