"""`autotune search` for real: torchrun trials with 2 gloo ranks, a SQLite study, failures made real (a model that
raises, one that hangs, one that runs out of memory), resume, and the stock Optuna CLI reading the result."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from autotune.launch import processes_in
from trainer.config import TrainConfig

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def autotune(*args, cwd: Path, timeout: int = 400, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "AUTOTUNE_CACHE": str(cwd / "cache"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cpu_demo_search_records_every_trial_and_exports_a_runnable_config(tmp_path):
    r = autotune("search", "--trials", "4", cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "no GPU visible: running the built-in cpu-demo study" in out  # says which and why
    assert "GPU utilization unavailable" in out
    assert out.count("trial ") >= 4 and "best " in out and "ETA" in out

    storage = f"sqlite:///{tmp_path / 'studies' / 'cpu-demo.db'}"
    study = optuna.load_study(study_name="cpu-demo", storage=storage)
    trials = study.get_trials()
    assert len(trials) == 4
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in trials), \
        [(t.number, t.state, t.user_attrs.get("failure_message")) for t in trials]
    t0 = trials[0]
    assert t0.user_attrs["baseline"] is True and t0.state == optuna.trial.TrialState.COMPLETE
    assert t0.params["training.batch_size"] == 16 and t0.params["data.decode"] == "pil"
    a = t0.user_attrs
    assert a["imgs_per_s"] > 0 and t0.value == pytest.approx(a["imgs_per_s"])
    # cpu-demo: windows 3, max_windows 5; settling takes the window before the result's, so 4 or 5 windows ran.
    assert len(a["imgs_per_s_windows"]) in (4, 5) and a["spread"] >= 0
    assert a["util_available"] is False and "util_mean" in a and a["util_mean"] is None  # never invented
    assert a["launch_s"] > 0 and a["measure_s"] > 0 and a["wall_s"] >= a["launch_s"] + a["measure_s"]
    assert a["versions"]["torch"] and a["owner_pid"] > 0 and a["owner_host"]
    assert Path(a["log_path"]).is_file() and a["log_path"] == str(tmp_path / "studies/cpu-demo/trial-0/log.txt")
    assert a["env"]["NCCL_NVLS_ENABLE"] == "0" and a["env"]["OMP_NUM_THREADS"] == "1"
    assert len(a["peak_mem_bytes"]) == 2

    # The stock Optuna CLI reads the same storage.
    optuna_cli = shutil.which("optuna", path=str(Path(sys.executable).parent)) or shutil.which("optuna")
    listed = subprocess.run([optuna_cli, "trials", "--study-name", "cpu-demo", "--storage",
                             storage, "-f", "json"], capture_output=True, text=True, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert sorted(t["number"] for t in json.loads(listed.stdout)) == [0, 1, 2, 3]

    r = autotune("show", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "(baseline)" in r.stdout and "1.00x" in r.stdout and "study cpu-demo: 4 trials" in r.stdout
    assert "(start 0) " in r.stdout  # trial 1: the spec's start, after the baseline
    assert "median launched trial (" in r.stdout and ", first step " in r.stdout and ", windows " in r.stdout

    r = autotune("export", "best.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "lr scaled linearly" in r.stderr  # demo global batch differs from the 256 the lr is set for
    cfg = TrainConfig.from_yaml(tmp_path / "best.yaml")  # the job ignores the autotune: section
    assert cfg.training.mode == "train" and cfg.training.epochs == 1
    doc = yaml.safe_load((tmp_path / "best.yaml").read_text())["autotune"]
    best = max((t for t in trials if t.state == optuna.trial.TrialState.COMPLETE), key=lambda t: t.value)
    assert doc["trial"] == best.number and doc["measured"]["imgs_per_s"] == pytest.approx(best.value)
    g = cfg.training.batch_size * cfg.training.accum_steps * 2
    assert cfg.optimizer.lr == pytest.approx(0.1 * g / 256) and cfg.optimizer.reference_global_batch == g
    assert doc["torchrun"]["nproc_per_node"] == 2 and doc["fingerprint"]["cpu_count"] >= 1
    assert doc["env"]["NCCL_NVLS_ENABLE"] == "0"


FAILURE_SPEC = """
name: failures
base:
  model: {name: "tests.helpers.models:tiny"}
  data: {kind: synthetic, image_size: 32, num_classes: 4}
  loader: {num_workers: 0}
  training: {batch_size: 8}
  ddp: {timeout_s: 30}
  measure: {warmup_min_steps: 2, window_s: 0.3, windows: 3, max_windows: 3}
world: {nproc_per_node: 2}
default_space: false
space:
  model.name: {choices: ["tests.helpers.models:tiny", "tests.helpers.models:explode", "tests.helpers.models:hang",
                         "tests.helpers.models:memory_limited"]}
  training.batch_size: {choices: [8, 32, 64]}
  loader.persistent_workers: {choices: [false, true]}     # true with 0 workers: an invalid combination
baseline: {model.name: "tests.helpers.models:tiny", training.batch_size: 8, loader.persistent_workers: false}
budget: {trials: 1, trial_timeout_s: 20}
pruner: {kind: none}
"""


def test_failures_are_recorded_with_their_class_and_the_search_goes_on(tmp_path):
    spec = tmp_path / "failures.yaml"
    spec.write_text(FAILURE_SPEC)
    r = autotune("search", "--spec", str(spec), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    storage = f"sqlite:///{tmp_path / 'studies' / 'failures.db'}"
    study = optuna.load_study(study_name="failures", storage=storage)
    assert len(study.trials) == 1 and study.trials[0].user_attrs["baseline"]

    m = "tests.helpers.models:"
    for name, bs, persistent in [("explode", 8, False), ("hang", 8, False), ("memory_limited", 32, False),
                                 ("memory_limited", 64, False), ("tiny", 8, True)]:
        study.enqueue_trial({"model.name": m + name, "training.batch_size": bs, "loader.persistent_workers": persistent})
    r = autotune("search", "--spec", str(spec), "--trials", "5", cwd=tmp_path)  # resumes the same study
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "resuming, 6 trials so far" in out  # 1 run + 5 enqueued

    trials = optuna.load_study(study_name="failures", storage=storage).get_trials()
    assert len(trials) == 6
    S = optuna.trial.TrialState
    by = {t.number: t for t in trials}
    assert by[0].state == S.COMPLETE and by[0].user_attrs["imgs_per_s"] > 0

    crash = by[1]
    assert crash.state == S.FAIL and crash.user_attrs["failure_class"] == "crash"
    assert "injected failure" in crash.user_attrs["failure_message"]
    assert "injected failure" in Path(crash.user_attrs["log_path"]).read_text()

    hang = by[2]
    assert hang.state == S.FAIL and hang.user_attrs["failure_class"] == "hang"
    assert 20 <= hang.user_attrs["wall_s"] < 45
    assert processes_in(set(hang.user_attrs["pgids"])) == [] and "leftover_pids" not in hang.user_attrs

    oom = by[3]
    assert oom.state == S.COMPLETE and oom.user_attrs["failure_class"] == "oom"
    assert oom.user_attrs["constraint"] == 1.0 and oom.value == 0.0  # infeasible: learnable, never the best

    predicted = by[4]
    assert predicted.state == S.COMPLETE and predicted.user_attrs["failure_class"] == "oom"
    assert predicted.user_attrs["oom_predicted_from"] == 3 and "launch_s" not in predicted.user_attrs

    invalid = by[5]
    assert invalid.state == S.COMPLETE and invalid.user_attrs["failure_class"] == "config"
    assert "persistent_workers" in invalid.user_attrs["failure_message"] and invalid.user_attrs["constraint"] == 1.0

    assert "FAIL:hang" in out and "infeasible:oom" in out and "infeasible:config" in out
    r = autotune("export", "best.yaml", "--study", "failures", cwd=tmp_path)
    assert r.returncode == 0 and yaml.safe_load((tmp_path / "best.yaml").read_text())["autotune"]["trial"] == 0
    r = autotune("export", "x.yaml", "--study", "failures", "--pick", "2", cwd=tmp_path)
    assert r.returncode == 2 and "trial 2 did not complete a measurement (hang)" in r.stderr


def test_a_study_made_by_another_spec_is_not_silently_mixed(tmp_path):
    spec = tmp_path / "failures.yaml"
    spec.write_text(FAILURE_SPEC)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    # Create the study record only (no trial needs to run for the fingerprint check).
    from autotune import study as study_mod
    from autotune.objective import Objective
    from autotune.spec import StudySpec

    study_mod.create_or_load(spec=StudySpec.from_yaml(spec), study_name="failures",
                             storage=study_mod.open_storage(storage), objective=Objective(), nproc=2)
    spec.write_text(FAILURE_SPEC.replace("choices: [8, 32, 64]", "choices: [8, 16]"))
    r = autotune("search", "--spec", str(spec), "--storage", storage, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "exists with a different spec" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("sig, message", [(signal.SIGINT, "interrupted (Ctrl-C)"),
                                          (signal.SIGTERM, "terminated (SIGTERM)")])
def test_ctrl_c_or_sigterm_kills_the_running_trial_and_records_it(tmp_path, sig, message):
    spec = tmp_path / "failures.yaml"
    spec.write_text(FAILURE_SPEC.replace('baseline: {model.name: "tests.helpers.models:tiny"',
                                         'baseline: {model.name: "tests.helpers.models:hang"'))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "search", "--spec", str(spec)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "studies" / "failures" / "trial-0" / "result.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and "start" in log.read_text()):
        time.sleep(0.2)
    assert log.exists(), proc.kill() or proc.communicate()[0]
    proc.send_signal(sig)  # the search only, as a terminal's Ctrl-C reaches it (trials have own sessions)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in out, out
    (t,) = optuna.load_study(study_name="failures", storage=f"sqlite:///{tmp_path / 'studies' / 'failures.db'}").trials
    assert t.state == optuna.trial.TrialState.FAIL and t.user_attrs["failure_class"] == "interrupted"
    assert t.user_attrs["failure_message"] == message
    start = json.loads(log.read_text().splitlines()[0])
    assert not Path(f"/proc/{start['pid']}").exists()  # rank 0 of the trial is gone
