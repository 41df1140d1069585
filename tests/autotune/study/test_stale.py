"""Failure drills: a search SIGKILLed mid-trial (nothing of its trial survives; the next search marks the trial stale
and runs its parameters again), trials whose owner is gone on this or another machine, a rank killed inside a trial,
and a checkpoint write that fails half-way."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch

from autotune.runner.process import descendants, processes_in
from autotune.study import liveness as study_mod
from autotune.study.storage import open_storage, trial_attrs
from tests.helpers.cli import autotune, start_autotune
from tests.helpers.specs import tiny_spec
from trainer import checkpoint as ckpt

S = optuna.trial.TrialState
M = "tests.helpers.models:"


# ---- owners and heartbeats ---------------------------------------------------------------------------------------


@pytest.fixture
def running(tmp_path):
    """A study on SQLite and a factory of RUNNING trials with given owner attrs."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")

    def make(params=None, **attrs):
        if params:
            study.enqueue_trial(params)
        trial = study.ask()
        for k in params or {}:
            trial.suggest_categorical(k, [32, 64])
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        return study.trials[trial.number]

    return study, storage, make


def test_owner_on_this_machine_alive_dead_or_pid_reused(running):
    _study, _, make = running
    me = study_mod.owner()
    assert me["owner_pid"] == os.getpid() and me["owner_start"] and me["owner_boot"] and me["owner_pidns"]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = {**me, "owner_pid": sleeper.pid, "owner_start": study_mod.process_start(sleeper.pid)}
        assert study_mod.stale_reason(make(**alive)) is None
        reused = {**alive, "owner_start": alive["owner_start"] - 1}  # same PID, another process
        assert "the pid now belongs to another process" in study_mod.stale_reason(make(**reused))
        # A live owner is never stale, however old its heartbeat: only it may finish its trial.
        assert study_mod.stale_reason(make(**alive, heartbeat=time.time() - 1e6)) is None
    finally:
        sleeper.kill()
        sleeper.wait()
    assert f"(pid {sleeper.pid} on {me['owner_host']}) is gone" in study_mod.stale_reason(make(**alive))


def test_owner_on_another_machine_is_judged_by_its_heartbeat(running):
    _study, _, make = running
    other = {**study_mod.owner(), "owner_host": "node-7", "owner_pid": 1}  # PID 1 there says nothing here
    assert study_mod.stale_reason(make(**other, heartbeat=time.time() - 30)) is None
    reason = study_mod.stale_reason(make(**other, heartbeat=time.time() - 600))
    assert reason.startswith("no heartbeat from its search (pid 1 on node-7) for 6") and "limit 180 s" in reason
    # Same host name, other PID namespace (a container with the host's name): the heartbeat decides, not our PIDs.
    container = {**study_mod.owner(), "owner_pid": 2 ** 22 - 1, "owner_pidns": "pid:[1]"}
    assert study_mod.stale_reason(make(**container, heartbeat=time.time())) is None
    assert study_mod.stale_reason(make(), now=time.time() + 600) == "no owner recorded, started 600 s ago"


def test_heartbeat_is_refreshed_at_most_every_interval(running, monkeypatch):
    study, _, _ = running
    trial = study.ask()
    clock = [1000.0]  # the heartbeat's own clock, stepped by hand: a loaded machine cannot make it flaky
    monkeypatch.setattr(study_mod.time, "monotonic", lambda: clock[0])
    beat = study_mod.Heartbeat(trial, interval=10.0)
    beat.beat(force=True)
    first = study.trials[-1].user_attrs["heartbeat"]
    clock[0] += 9.9
    beat.beat()
    assert study.trials[-1].user_attrs["heartbeat"] == first
    clock[0] += 0.2
    time.sleep(0.01)  # the stored beat is wall time: let it move
    beat.beat()
    assert study.trials[-1].user_attrs["heartbeat"] > first and beat.failures == 0


def test_stale_trials_are_failed_and_their_params_run_again_once(running):
    study, storage, make = running
    gone = {**study_mod.owner(), "owner_host": "node-7", "owner_pid": 1, "heartbeat": time.time() - 600}
    t0 = make({"training.batch_size": 64}, baseline=True, **gone)
    make({"training.batch_size": 32}, **{**gone, "heartbeat": time.time()})  # alive elsewhere: untouched

    (line,) = study_mod.reclaim_stale(study, storage)
    # 600 s and the time this test took to get here (seconds on a loaded machine)
    assert re.fullmatch(rf"trial {t0.number}: stale \(no heartbeat from its search \(pid 1 on node-7\) for 6\d\d s "
                        r"\(limit 180 s\)\): marked FAIL; its parameters run again as a new trial", line), line
    trials = study.get_trials()
    assert trials[0].state == S.FAIL and trials[0].user_attrs["failure_class"] == "stale"
    assert "no heartbeat" in trials[0].user_attrs["failure_message"]
    assert trials[1].state == S.RUNNING
    retry = trials[2]
    assert retry.state == S.WAITING and retry.user_attrs == {"retry_of": 0, "baseline": True}
    assert retry.system_attrs["fixed_params"] == {"training.batch_size": 64}
    assert study_mod.reclaim_stale(study, storage) == []  # nothing new: no second retry

    # The retry runs, and its owner vanishes too: FAIL again, but not a third run.
    rerun = study.ask()
    assert rerun.number == 2 and rerun.suggest_categorical("training.batch_size", [32, 64]) == 64
    for k, v in gone.items():
        rerun.set_user_attr(k, v)
    (line,) = study_mod.reclaim_stale(study, storage)
    assert line.endswith("not run again (it was already the re-run of trial 0)")
    assert [t.state for t in study.get_trials()] == [S.FAIL, S.RUNNING, S.FAIL]


# ---- the search process killed ------------------------------------------------------------------------------------


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_search_killed_mid_trial_leaves_no_process_and_the_next_search_reruns_the_trial(tmp_path, tiny_jpegs):
    # Real JPEGs and a loader worker per rank: the trial's tree is search -> torchrun -> 2 ranks -> 2 workers. The
    # ranks block in forward (no collective, no store: nothing but a parent-death signal would end them).
    flag = tmp_path / "stuck"
    flag.touch()
    spec = tiny_spec(tmp_path, "killed", **{
        "base.model.name": M + "block_while", "base.model.kwargs": {"flag": str(flag)},
        "base.data": {"kind": "imagefolder", "path": str(tiny_jpegs), "image_size": 32},
        "base.loader.num_workers": 1, "base.training.batch_size": 4,
        "space.training.batch_size": {"choices": [4, 8]}, "baseline.training.batch_size": 4})
    storage = f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}"
    search = start_autotune("search", "--spec", spec, cwd=tmp_path, log=tmp_path / "first.log")
    try:
        _wait_for(lambda: all(Path(f"{flag}.rank{r}").exists() for r in (0, 1)), 90, "both ranks in forward")
        tree = {pid: study_mod.process_start(pid) for pid in descendants(search.pid)}
        assert len(tree) >= 5, tree  # torchrun, 2 ranks, 2 loader workers
    finally:
        search.send_signal(signal.SIGKILL)  # no clean-up of any kind
        search.wait()

    def survivors():
        return [p for p, start in tree.items() if study_mod.process_start(p) == start]

    # torchrun dies with the search, the ranks with torchrun, loader workers notice their rank is gone (<= 5 s).
    deadline = time.monotonic() + 20
    while survivors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert survivors() == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in survivors()]
    (t,) = optuna.load_study(study_name="killed", storage=storage).get_trials()
    assert t.state == S.RUNNING and t.user_attrs["owner_pid"] == search.pid  # what the kill left behind

    flag.unlink()  # the re-run trains normally
    r = autotune("search", "--spec", spec, "--trials", "1", cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"trial 0: stale (its search (pid {search.pid} on {socket.gethostname()}) is gone): marked FAIL; its " \
           "parameters run again as a new trial" in out
    assert "trial 1 re-runs the parameters of trial 0, its search was gone" in out
    t0, t1 = optuna.load_study(study_name="killed", storage=storage).get_trials()
    assert t0.state == S.FAIL and t0.user_attrs["failure_class"] == "stale"
    assert t1.state == S.COMPLETE and t1.user_attrs["retry_of"] == 0 and t1.params == t0.params
    assert t1.user_attrs["stage"] == "baseline" and t1.user_attrs["imgs_per_s"] > 0  # the baseline, after all
    assert " baseline " in autotune("show", cwd=tmp_path, timeout=60).stdout


@pytest.mark.slow
def test_a_rank_killed_inside_a_trial_is_recorded_and_the_search_goes_on(tmp_path):
    spec = tiny_spec(tmp_path, "rank-killed", **{
        "space.model.name": {"choices": [M + "die_on_rank", M + "tiny"]}, "baseline.model.name": M + "die_on_rank",
        "budget.trial_timeout_s": 20})
    r = autotune("search", "--spec", spec, "--trials", "2", cwd=tmp_path)
    out = r.stdout + r.stderr
    t0, t1 = optuna.load_study(study_name="rank-killed",
                               storage=f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}").get_trials()
    # The search went on; it exits 1 only when no end-to-end trial measured anything.
    assert r.returncode == (0 if t1.state == S.COMPLETE else 1), out
    a = trial_attrs(t0)
    assert t0.state == S.FAIL and a["failure_class"] in ("nccl", "crash"), a
    assert a["wall_s"] < 20 and a["windows"] == 0  # noticed at once, not at the trial timeout
    assert "leftover_pids" not in a and processes_in(set(a["pgids"])) == []
    assert "SIGKILL" in Path(a["log_path"]).read_text()  # torchrun names the signal
    assert t1.state in (S.COMPLETE, S.FAIL) and t1.datetime_complete is not None  # the search went on


# ---- checkpoints --------------------------------------------------------------------------------------------------


def test_a_checkpoint_write_that_fails_half_way_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    state = {"step": 1, "weights": torch.arange(1000.0)}
    first = ckpt.save_checkpoint(tmp_path, 1, state, keep_last=1)
    before = first.read_bytes()
    real_save = torch.save

    def disk_full(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)  # most of the bytes land in the temporary file, then the disk is full
        f.truncate(f.tell() // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save_checkpoint(tmp_path, 2, {"step": 2, "weights": torch.zeros(1000)}, keep_last=1)
    monkeypatch.undo()

    assert ckpt.list_checkpoints(tmp_path) == [first] and sorted(os.listdir(tmp_path)) == [first.name]  # no temp
    assert first.read_bytes() == before
    path, loaded = ckpt.load_latest(tmp_path, "cpu")
    assert path == first and loaded["step"] == 1 and torch.equal(loaded["weights"], state["weights"])
