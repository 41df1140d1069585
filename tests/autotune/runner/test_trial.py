"""A run in a process of its own: torchrun argv and environment (NVLS safety), and a real job stopped mid-run (how a
run's records read as a failure class: tests/autotune/test_verdict.py)."""

from __future__ import annotations

import itertools
import sys
import time

import pytest

from autotune.exceptions import LaunchError
from autotune.runner.process import processes_in
from autotune.runner.torchrun import Torchrun, run_env, trainer_args
from autotune.runner.trial import TrialJob, run_trial, steady_windows
from autotune.verdict import ending
from trainer.config import TrainConfig
from trainer.protocol import SAFETY_ENV


def trial_env(job, base):
    """The job's environment on top of ``base`` (instead of this process's)."""
    return run_env(nccl=job.config.nccl.to_env(), nproc=job.nproc_per_node, gpus=job.gpus, extra=job.extra_env,
                   cores=job.cores, base=base)


def torchrun_argv(nproc, args, config, result):
    return Torchrun.parse(args).argv(nproc, trainer_args(config, result))


def _job(tmp_path, **cfg):
    return TrialJob(config=TrainConfig().with_overrides(cfg), trial_dir=tmp_path, nproc_per_node=2, cores=8)


def test_env_sets_the_trials_nccl_variables_threads_and_the_safety_variables(tmp_path):
    job = _job(tmp_path, **{"nccl.algo": "Ring", "nccl.buffsize": 4 << 20})
    env, ours = trial_env(job, {"PATH": "/bin", "NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "64"})
    assert env["NCCL_ALGO"] == "allreduce:Ring" and env["NCCL_BUFFSIZE"] == str(4 << 20)
    assert env["OMP_NUM_THREADS"] == "4"  # 8 cores / 2 ranks, whatever the parent had
    assert env["NCCL_DEBUG"] == "WARN" and env["PATH"] == "/bin"  # inherited
    assert {k: env[k] for k in SAFETY_ENV} == SAFETY_ENV == {k: ours[k] for k in SAFETY_ENV}
    assert "CUDA_VISIBLE_DEVICES" not in env
    job.gpus = ["GPU-aaaa", "GPU-bbbb"]
    assert trial_env(job, {})[0]["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"


@pytest.mark.parametrize("inherited, message", [
    ({"NCCL_NVLS_ENABLE": "1"}, "NCCL_NVLS_ENABLE=1: NVLink multicast must stay off"),
    ({"NCCL_PROTO": "LL128"}, "LL128 may not be forced"),
    ({"NCCL_ALGO": "NVLS"}, "NVLS algorithms may not be used"),
    ({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}, "TORCH_SYMM_MEM_DISABLE_MULTICAST=0 in the environment"),
])
def test_an_unsafe_inherited_environment_is_refused(tmp_path, inherited, message):
    with pytest.raises(LaunchError, match=message):
        trial_env(_job(tmp_path), inherited)


def test_an_unsafe_config_is_refused_even_if_it_skipped_validation(tmp_path):
    job = _job(tmp_path)
    job.config.nccl.extra = {"NCCL_NVLS_ENABLE": "1"}  # set behind TrainConfig's back
    with pytest.raises(LaunchError, match="NVLink multicast must stay off"):
        trial_env(job, {})


def test_argv_runs_torchrun_of_this_python_standalone_unless_multi_node(tmp_path):
    argv = torchrun_argv(2, [], tmp_path / "c.yaml", tmp_path / "r.jsonl")
    assert argv[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[-6:] == ["-m", "trainer", "--config", str(tmp_path / "c.yaml"), "--result", str(tmp_path / "r.jsonl")]
    multi = torchrun_argv(8, ["--nnodes=2", "--rdzv-endpoint=h:29500"], tmp_path / "c", tmp_path / "r")
    assert "--standalone" not in multi and "--nnodes=2" in multi
    with pytest.raises(LaunchError, match="nproc-per-node"):
        torchrun_argv(2, ["--nproc-per-node=4"], tmp_path / "c", tmp_path / "r")
    with pytest.raises(LaunchError, match="torchrun does not"):
        torchrun_argv(2, ["--no-such-flag"], tmp_path / "c", tmp_path / "r")


@pytest.mark.parametrize("args, nnodes, own", [
    ([], 1, False), (["--nnodes=2"], 2, True), (["--nnodes", "1:4"], 4, True), (["--master-addr", "node0"], 1, True),
    (["--master_addr=node0"], 1, True), (["--rdzv_endpoint=h:1", "--nnodes=2"], 2, True),
    (["--max-restarts=1"], 1, False),
])
def test_torchrun_arguments_are_read_by_torchruns_own_parser(args, nnodes, own):
    """Every spelling torchrun takes means what torchrun takes it to mean (dashes or underscores, = or a space);
    a rendezvous of the user's own means no --standalone."""
    t = Torchrun.parse(args)
    assert (t.nnodes, t.rendezvous) == (nnodes, own)
    assert ("--standalone" in t.argv(2, [])) is not own


@pytest.mark.slow
def test_a_real_job_is_streamed_live_and_stopped_with_its_whole_process_tree(tmp_path, repo_on_pythonpath):
    cfg = TrainConfig().with_overrides({
        "model.name": "tests.helpers.models:tiny", "data.image_size": 32, "training.batch_size": 8,
        "loader.num_workers": 1, "measure.warmup_min_steps": 2,
        "measure.window_s": 0.5, "measure.precision": 0.0001, "measure.max_s": 25.0,
        "ddp.timeout_s": 30.0})
    arrivals = []

    def on_record(rec):
        arrivals.append((rec["kind"], time.time()))
        return rec["kind"] == "window" and rec["window"] == 1  # "prune" after the second window

    polls = []
    run = run_trial(TrialJob(config=cfg, trial_dir=tmp_path / "t", nproc_per_node=2, timeout_s=60), on_record,
                    on_poll=lambda: polls.append(time.monotonic()))
    assert run.stopped == "pruned" and ending(run).ok
    assert len(polls) > 10 and max(b - a for a, b in itertools.pairwise(polls)) < 2  # the heartbeat's chance, often
    kinds = [k for k, _ in arrivals]
    assert kinds[:4] == ["start", "ready", "first_step", "warmup_done"] and kinds.count("window") == 2
    assert "summary" not in kinds
    assert run.leftover_pids == [] and processes_in(set(run.pgids)) == []
    assert len(run.pgids) >= 3  # torchrun's group and one per rank (ranks start their own sessions)
    t = run.timing()
    w = run.windows  # the meter sizes windows in steps aimed at window_s: their wall span is what was measured
    assert 0 < t["launch_s"] < t["wall_s"] and 0 < t["measure_s"] == pytest.approx(w[-1]["t1"] - w[0]["t0"], abs=1e-3)
    assert t["setup_s"] > 0 and t["first_step_s"] > 0 and t["setup_s"] + t["first_step_s"] <= t["warmup_s"]
    assert (tmp_path / "t" / "log.txt").read_text().startswith("$ " + sys.executable)
    assert TrainConfig.from_yaml(tmp_path / "t" / "config.yaml") == cfg


def test_utilization_is_taken_over_the_windows_the_result_stands_on():
    windows = [{"kind": "window", "window": i, "t0": float(i), "t1": i + 1.0} for i in range(5)]
    # The job left windows 0-1 out as warm-up: GPU samples during them must not count either.
    assert steady_windows(windows, {"windows_used": [2, 3, 4]}) == windows[2:]
    # A pruned or killed run has no summary: every window that arrived.
    assert steady_windows(windows, None) == windows
    assert steady_windows(windows, {"imgs_per_s": None}) == windows
