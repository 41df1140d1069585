"""A run's outcome from its records and its log (``autotune.verdict``), on constructed runs: each class, the root
cause across ranks, the log read when no rank wrote a record (with the signatures the job classifies its own
exceptions by), a pruned or measured run being no failure, and the failures a search records without a run."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import optuna
import pytest

from autotune import fullrun, verdict
from autotune.commands.search import all_failed
from autotune.runner.trial import TrialRun
from trainer.protocol import SIGNATURES, Failure, classify

SUMMARY = {"kind": "summary", "imgs_per_s": 10.0, "loss_finite": True}


def run(tmp_path, records=(), log="", rc=1, stopped=None, n_before_stop=None, waited_s=300.0) -> TrialRun:
    (tmp_path / "log.txt").write_text(log)
    return TrialRun(records=list(records), returncode=rc, stopped=stopped, log_path=tmp_path / "log.txt",
                    n_before_stop=n_before_stop, t_launch=1000.0, t_end=1000.0 + waited_s)


def error(cls, rank=0, t=1.0, message="it failed"):
    return {"kind": "error", "class": cls, "rank": rank, "t": t, "message": message}


@pytest.mark.parametrize("cls", ["oom", "config", "diverged", "loader", "nccl", "crash"])
def test_a_ranks_error_record_gives_the_class_and_its_message(tmp_path, cls):
    v = verdict.judge(run(tmp_path, [error(cls, rank=1, message="what it said")]))
    assert (v.failure, v.reason) == (cls, "rank 1: what it said")
    assert v.fix == verdict.FIXES.get(Failure(cls)) and v.error["rank"] == 1
    assert v.attrs() == {"failure_class": cls, "failure_message": "rank 1: what it said"}


def test_an_unknown_class_in_a_record_is_a_crash(tmp_path):
    assert verdict.ending(run(tmp_path, [error("gremlins")])).failure == Failure.CRASH


def test_the_root_cause_wins_across_ranks(tmp_path):
    # Rank 1 ran out of memory; rank 0's collective failed first because of it: the OOM is the trial's class.
    recs = [error("nccl", rank=0, t=1.0, message="Connection closed by peer"),
            error("oom", rank=1, t=2.0, message="CUDA out of memory"),
            error("nccl", rank=1, t=3.0, message="peer gone")]
    v = verdict.ending(run(tmp_path, recs))
    assert (v.failure, v.reason, v.error["t"]) == ("oom", "rank 1: CUDA out of memory", 2.0)
    assert "smaller per-GPU batch" in v.fix
    # Among records of one class, the earliest.
    recs = [error("crash", rank=1, t=5.0, message="late"), error("crash", rank=0, t=4.0, message="early")]
    assert verdict.ending(run(tmp_path, recs)).reason == "rank 0: early"
    # A crash outranks the NCCL errors of its peers, not an OOM.
    recs = [error("nccl", t=1.0), error("crash", rank=1, t=2.0, message="ValueError: x")]
    assert verdict.ending(run(tmp_path, recs)).failure == "crash"


@pytest.mark.parametrize("log, cls, shown", [
    ("...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n", "oom",
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("RuntimeError: DataLoader worker (pid 123) is killed by signal: Bus error.\n", "loader", None),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error\n", "nccl",
     None),
    ("Traceback (most recent call last):\n  File x\nValueError: something else\n"
     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n", "crash", "ValueError: something else"),
    ("", "crash", "exit code 1"),
])
def test_without_an_error_record_the_log_tail_decides(tmp_path, log, cls, shown):
    v = verdict.ending(run(tmp_path, log=log))
    assert v.failure == cls and v.error is None
    if shown is not None:
        assert v.reason == shown


def test_in_the_log_an_oom_outranks_the_nccl_errors_after_it(tmp_path):
    log = ("[rank1]: torch.OutOfMemoryError: CUDA out of memory\n"
           "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n")
    assert verdict.ending(run(tmp_path, log=log)).failure == "oom"


def test_exit_0_without_a_summary_is_a_crash_and_with_one_a_success(tmp_path):
    assert verdict.ending(run(tmp_path, rc=0)).reason == "the job exited without a summary record"
    assert verdict.judge(run(tmp_path, [SUMMARY], rc=0)) == verdict.OK
    assert verdict.judge(run(tmp_path, [SUMMARY], rc=None)).ok  # a live worker's trial: no exit code
    # A summary and a non-zero exit: the exit stands (a rank died after rank 0 wrote its summary).
    assert verdict.ending(run(tmp_path, [SUMMARY], log="Bus error\n", rc=1)).failure == "loader"


def test_a_run_the_launcher_stopped_is_judged_by_why(tmp_path):
    # Records that arrive after the decision to stop are what the kill provokes: not the run's own failure.
    late = [{"kind": "window", "window": 0}, error("nccl", t=5.0, message="peer closed")]
    hang = verdict.ending(run(tmp_path, late, stopped="hang", n_before_stop=1, waited_s=312.4))
    assert hang.failure == "hang" and hang.reason.startswith("no measurement window for 312 s (trial timeout); "
                                                             "waiting for a window;")
    assert "first window" in verdict.ending(run(tmp_path, stopped="hang", n_before_stop=0)).reason
    assert "--trial-timeout" in hang.fix
    stopped = verdict.ending(run(tmp_path, late, stopped="interrupted", n_before_stop=1))
    assert (stopped.failure, stopped.reason) == ("interrupted", "interrupted (Ctrl-C)")
    # What a rank reported before the stop still decides.
    assert verdict.ending(run(tmp_path, late, stopped="hang", n_before_stop=2)).failure == "nccl"


def test_a_run_still_stepping_at_its_timeout_is_slow_and_a_hang_claims_only_the_stacks_its_log_has(tmp_path):
    began = [{"kind": "first_step", "t": 1001.0}]
    beats = [{"kind": "steps", "t": 1000.0 + t, "steps": n, "step_s": 4.0} for t, n in ((9, 4), (13, 5))]
    slow = verdict.ending(run(tmp_path, began + beats, stopped="hang", n_before_stop=3, waited_s=15.0))
    assert slow.failure == "slow" and "--trial-timeout" in slow.fix
    assert slow.reason.startswith("not stuck, but too slow for its timeout: still stepping")
    assert "5 steps" in slow.reason
    # Its last step record long before the stop: it stopped stepping (a hang), and it did report steps.
    stuck = verdict.ending(run(tmp_path, began + beats, stopped="hang", n_before_stop=3, waited_s=60.0))
    assert stuck.failure == "hang" and "no step reported" not in stuck.reason
    assert "the ranks left no stack in the log" in stuck.reason
    (tmp_path / "log.txt").write_text("---- rank 0 (pid 7) was stopped; its threads were here ----\n  File x\n")
    stuck = verdict.ending(TrialRun(records=began, stopped="hang", n_before_stop=1, log_path=tmp_path / "log.txt",
                                    t_launch=1000.0, t_end=1100.0))
    assert "each rank's stack is in the log" in stuck.reason
    assert "no step reported" in verdict.ending(run(tmp_path, stopped="hang", n_before_stop=0)).reason


def test_a_pruned_or_measured_run_is_no_failure(tmp_path):
    late = [error("nccl", t=5.0)]
    assert verdict.ending(run(tmp_path, late, stopped="pruned", n_before_stop=0)) == verdict.OK
    assert verdict.judge(run(tmp_path, late, stopped="pruned", n_before_stop=0), pruned=True) == verdict.OK
    # A user's script that went on after its summary: measured, whatever its exit.
    assert verdict.judge(run(tmp_path, [SUMMARY, *late], stopped="measured", n_before_stop=1, rc=-9)).ok


def test_a_figure_that_does_not_stand_is_a_failure(tmp_path):
    diverged = {**SUMMARY, "loss_finite": False, "loss_reason": "loss rose from 2 to 9: lower the lr"}
    v = verdict.judge(run(tmp_path, [diverged], rc=0))
    assert (v.failure, v.reason, v.fix) == ("diverged", "loss rose from 2 to 9: lower the lr",
                                            verdict.FIXES[Failure.DIVERGED])
    old = {**SUMMARY, "loss_finite": False, "loss_nonfinite_in_windows": 3}  # a summary without loss_reason
    assert verdict.figure(old).reason == "loss NaN/inf in 3 step(s) of the measured windows"
    v = verdict.judge(run(tmp_path, [{**SUMMARY, "imgs_per_s": None}], rc=0))
    assert (v.failure, v.reason) == ("crash", "the job reported no throughput")
    # The run's own failure comes first; a pruned trial's figure is the pruner's, not a summary's.
    assert verdict.judge(run(tmp_path, [diverged, error("oom")])).failure == "oom"
    assert verdict.judge(run(tmp_path, [], stopped="pruned"), pruned=True).ok


@pytest.mark.parametrize("exc, line, cls", [
    (type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB"),
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
     "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "oom"),
    (RuntimeError("DataLoader worker (pid 123) is killed by signal: Bus error."),
     "RuntimeError: DataLoader worker (pid 123) is killed by signal: Bus error.", "loader"),
    (type("DistBackendError", (RuntimeError,), {})("NCCL error in: ProcessGroupNCCL.cpp:1970"),
     "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970", "nccl"),
    (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:5431"),
     "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:5431", "nccl"),
    (ValueError("something else"), "ValueError: something else", "crash"),
])
def test_the_job_and_the_tuner_read_a_failure_by_the_same_signatures(exc, line, cls):
    assert classify(exc) == cls
    found = verdict.from_log([line])
    assert (found.failure if found else Failure.CRASH) == cls


def test_words_a_log_says_in_passing_name_a_failure_only_in_an_exception(tmp_path):
    # NCCL_DEBUG=INFO: every line names nccl; the failure is the exception after them.
    log = "host:1:1 [0] NCCL INFO Channel 00/02 : 0 1\nValueError: bad label 7\n"
    assert verdict.ending(run(tmp_path, log=log)).failure == "crash"
    assert classify(RuntimeError("nccl communicator was aborted")) == "nccl"
    assert classify(RuntimeError("unable to allocate shared memory (shm) segment")) == "loader"
    assert [s.failure for s in SIGNATURES] == ["oom", "loader", "nccl"]  # the order the classes are looked for


def test_failures_recorded_without_a_run():
    assert verdict.invalid(["a: fix a", "b: fix b"]).attrs() == {"failure_class": "config",
                                                                 "failure_message": "a: fix a; b: fix b"}
    oom = verdict.predicted_oom("p3")
    assert oom.failure == "oom" and oom.reason.startswith("trial p3 ran out of memory at a batch <= this one")
    assert verdict.abandoned(KeyboardInterrupt()).attrs() == {"failure_class": "interrupted",
                                                               "failure_message": "interrupted (Ctrl-C)"}
    assert verdict.abandoned(KeyboardInterrupt("terminated by SIGTERM")).reason == "terminated by SIGTERM"
    assert verdict.abandoned(OSError("disk full")).attrs() == {"failure_class": "search",
                                                               "failure_message": "OSError: disk full"}
    assert verdict.search_failure("taken by another worker").failure == "search"
    assert verdict.stale("its search (pid 7 on h) is gone").attrs() == {
        "failure_class": "stale", "failure_message": "its search (pid 7 on h) is gone"}
    assert verdict.OK.attrs() == {} and verdict.OK.ok


def test_a_search_whose_trials_were_all_ended_from_outside_has_not_failed():
    study = optuna.create_study()
    for cls in verdict.NOT_ITS_FAULT:
        t = study.ask()
        t.set_user_attr("stage", "search")
        for key, value in verdict.failed(Failure(cls), "from outside").attrs().items():
            t.set_user_attr(key, value)
        study.tell(t, state=optuna.trial.TrialState.FAIL)
    assert all_failed(study) is None
    t = study.ask()
    t.set_user_attr("stage", "search")
    for key, value in verdict.failed(Failure.CRASH, "rank 0: boom").attrs().items():
        t.set_user_attr(key, value)
    study.tell(t, state=optuna.trial.TrialState.FAIL)
    assert "(1: 1 crash); trial 3: crash: rank 0: boom" in all_failed(study)


def test_a_full_run_names_the_root_cause_or_what_its_log_shows(tmp_path):
    plan = SimpleNamespace(log_path=tmp_path / "train.log")
    recs = [error("nccl", t=1.0, message="peer closed"), error("oom", rank=1, t=2.0, message="CUDA out of memory")]
    result = fullrun.TrainResult.of(recs, returncode=1, verdict=verdict.ending(run(tmp_path, recs)))
    assert fullrun.failure_message(plan, result) == \
        f"the job failed (oom, rank 1): CUDA out of memory; log: {plan.log_path}"
    log = "torch.OutOfMemoryError: CUDA out of memory\n"
    result = fullrun.TrainResult.of([], returncode=1, verdict=verdict.ending(run(tmp_path, log=log)))
    assert fullrun.failure_message(plan, result) == (
        f"the job exited with code 1 and no error record (oom: {log.strip()}); log: {plan.log_path}")


def windows(*losses):
    """Window records whose loss went through ``losses`` (each window from one figure to the next)."""
    return [{"kind": "window", "window": i, "loss_start": a, "loss_end": b}
            for i, (a, b) in enumerate(itertools.pairwise(losses))]


def test_a_loss_that_never_moved_is_flagged_and_its_figure_stands(tmp_path):
    still = verdict.judge(run(tmp_path, [*windows(0.0, 0.0, 0.0, 0.0), SUMMARY], rc=0))
    assert still.ok and "never moved" in still.warning, still
    learning = verdict.judge(run(tmp_path, [*windows(2.3, 2.2, 2.25, 2.1), SUMMARY], rc=0))
    assert learning == verdict.OK
    # What the script's ImageFolder holds, where its settings record says: one class is the slip to name.
    folder = {"kind": "settings", "image_folder": {"path": "/data/photos", "classes": 1}}
    named = verdict.judge(run(tmp_path, [folder, *windows(0.0, 0.0, 0.0), SUMMARY], rc=0))
    assert "1 class" in named.warning and "/data/photos" in named.warning, named.warning


STOPPED = "---- {who} (pid {pid}) was stopped; its threads were here ----\n"
WAITING = ('Current thread 0x7f (most recent call first):\n'
           '  File "/venv/lib/python3.11/multiprocessing/connection.py", line 947 in wait\n'
           '  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1293 in _try_get_data\n'
           '  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1466 in _get_data\n')
IN_DATASET = '  File "/job/data.py", line 12 in __getitem__\n'
IN_COLLECTIVE = '  File "/venv/site-packages/torch/distributed/distributed_c10d.py", line 3787 in broadcast\n'
TIMED_OUT = "[gloo] Timed out waiting 300000ms for send operation to complete"


def test_a_collective_that_timed_out_while_a_peer_waited_for_its_batches_is_a_stalled_loader(tmp_path):
    """Rank 0's collective timed out because rank 1 never reached it: rank 1 waited for a batch its loader worker
    never delivered. The verdict names the wait, not the collective, and points at the workers' stacks."""
    log = (STOPPED.format(who="rank 0", pid=10) + IN_COLLECTIVE + STOPPED.format(who="rank 1", pid=11) + WAITING
           + STOPPED.format(who="rank 1's loader worker", pid=12) + IN_DATASET)
    v = verdict.judge(run(tmp_path, [error("nccl", rank=0, message=TIMED_OUT)], log=log))
    assert v.failure == "hang" and v.fix == verdict.STALL_FIX
    assert v.reason.startswith("rank 1 waited for its next batch from its DataLoader's workers, which never "
                               "delivered it, until a peer's collective timed out (rank 0: [gloo] Timed out"), v.reason
    assert v.reason.endswith("the ranks' and their loader workers' stacks are in the log")
    # A framework's own SIGTERM handler (Lightning's) raised over the wait instead of the stack printer: the
    # traceback says it.
    traceback = ('Traceback (most recent call last):\n'
                 '  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1293, in '
                 '_try_get_data\n    data = self._data_queue.get(timeout=timeout)\nRuntimeError: Connection closed\n')
    v = verdict.judge(run(tmp_path, [error("nccl", rank=0, message=TIMED_OUT)], log=traceback))
    assert v.failure == "hang" and v.reason.startswith("a rank waited for its next batch")
    assert v.reason.endswith("its traceback is in the log")
    # Nothing waited for a batch: the collective's own failure.
    v = verdict.judge(run(tmp_path, [error("nccl", rank=0, message=TIMED_OUT)],
                          log=STOPPED.format(who="rank 1", pid=11) + IN_COLLECTIVE))
    assert v.failure == "nccl" and v.reason == f"rank 0: {TIMED_OUT}"
