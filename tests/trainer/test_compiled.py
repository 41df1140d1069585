"""torch.compile in a live worker: a graph is compiled once per process and reused by the next trial with the same
shapes (with exactly a fresh process's result), a changed graph is compiled afresh, and the compile's seconds are on
the first step's record. CPU (Inductor's C++ backend), a tiny conv net, 2 gloo ranks, a few steps."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from autotune.runner.pool import WorkerPool
from autotune.runner.trial import TrialJob, run_trial
from autotune.verdict import ending
from tests.jobutil import tiny_config
from trainer import compile_costs
from trainer.compiled import PROCESS, CompileClock, compile_model, graph_key
from trainer.config import ConfigError, TrainConfig

# Fixed steps in train mode: the loss after them depends only on the config and its seeds.
TRAIN = {"training.mode": "train", "training.steps": 4, "training.validate_every": 0, "checkpoint.every_epochs": 0,
         "training.log_every_s": 1000.0}
TINY = {"model.name": "tests.helpers.models:tiny", "data.num_classes": 4, "loader.num_workers": 0,
        "training.batch_size": 4, "optimizer.lr": 0.05}


def config(tmp_path, **overrides):
    # The on-disk caches outlive the test (pytest's base folder): a later run loads what this one compiled, as a
    # fresh worker of a study does. Nothing asserted depends on whether they are warm.
    cache = tmp_path.parents[1] / "inductor-cache"
    return tiny_config(**{**TINY, **TRAIN, "output_dir": str(tmp_path / "out"),
                          "training.compile_cache_dir": str(cache), **overrides})


def job(cfg, folder):
    return TrialJob(config=cfg, trial_dir=folder, nproc_per_node=2, timeout_s=300.0)


def first_step(run):
    assert ending(run).ok and run.summary is not None, ending(run)
    (rec,) = run.of_kind("first_step")
    return rec


@pytest.mark.slow
def test_a_worker_compiles_a_graph_once_and_the_next_trial_with_its_shapes_reuses_it(tmp_path, repo_on_pythonpath):
    compiled = config(tmp_path, **{"training.compile": True})
    with WorkerPool(tmp_path / "workers") as pool:
        runs = [pool.run(job(c, tmp_path / f"t{i}")) for i, c in enumerate(
            [compiled, compiled, compiled.with_overrides({"training.batch_size": 8})])]
    first, again, other = (first_step(r) for r in runs)
    assert {r.worker for r in runs} == {"worker-1"}
    assert first["compiles"] >= 1 and first["compile_s"] > 0 and first["compile_reused"] is False
    assert again["compiles"] == 0 and again["compile_reused"] is True  # nothing compiled: the graphs were there
    assert again["first_compute_s"] < first["first_compute_s"]
    assert other["compiles"] >= 1 and other["compile_reused"] is False  # another batch: another graph
    assert runs[1].summary["compiles"] == 0  # and no recompile later in the trial either
    fresh = run_trial(job(compiled, tmp_path / "fresh"))
    # A fresh process compiles the graph worker-1 compiled into the cache folder from it, and records what that cost
    # there, beside the worker's own compile (the next search prices a compile of the graph by them).
    loaded = first_step(fresh)
    assert loaded["compile_reused"] is False and loaded["compile_from_caches"] is True
    key = graph_key(compiled, 4, 2)
    paid = compile_costs.read(compiled.training.compile_cache_dir, key)
    assert [p.seconds for p in paid[-2:]] == [first["compile_s"], loaded["compile_s"]]
    assert paid[-1].from_caches and paid[-1].torch == torch.__version__
    assert compile_costs.read(compiled.training.compile_cache_dir, graph_key(  # the other batch's graph: its own
        compiled.with_overrides({"training.batch_size": 8}), 4, 2))
    eager = run_trial(job(compiled.with_overrides({"training.compile": False}), tmp_path / "eager"))
    losses = [r.summary["loss"] for r in (runs[0], runs[1], fresh)]
    assert losses[0] == losses[1] == losses[2] and math.isfinite(losses[0])  # reused: what a fresh process gives
    assert eager.summary["loss"] == pytest.approx(losses[0], rel=1e-3, abs=1e-4)  # compiled: eager's, in fp32


def test_the_graph_key_changes_with_what_is_compiled_and_not_with_the_rest():
    base = TrainConfig().with_overrides({"training.compile": True})
    key = graph_key(base, 10, 2)
    same = {"loader.num_workers": 9, "data.decode": "torchvision-cpu", "optimizer.lr": 0.5, "measure.window_s": 1.0,
            "ddp.timeout_s": 30.0}
    for k, v in same.items():
        assert graph_key(base.with_overrides({k: v}), 10, 2) == key, k
    other = {"training.batch_size": 128, "training.precision": "bf16", "training.channels_last": True,
             "data.image_size": 160, "ddp.bucket_cap_mb": 50.0, "model.name": "resnet18", "training.accum_steps": 2}
    for k, v in other.items():
        assert graph_key(base.with_overrides({k: v}), 10, 2) != key, k
    assert graph_key(base, 100, 2) != key and graph_key(base, 10, 4) != key


def test_cuda_graph_modes_refuse_accumulation_and_a_mode_needs_compile():
    with pytest.raises(ConfigError, match="CUDA graphs overwrite one micro-batch's gradients"):
        TrainConfig().with_overrides({"training.compile": True, "training.compile_mode": "reduce-overhead",
                                      "training.accum_steps": 2})
    with pytest.raises(ConfigError, match=r"needs training\.compile=true"):
        TrainConfig().with_overrides({"training.compile_mode": "max-autotune-no-cudagraphs"})
    ok = TrainConfig().with_overrides({"training.compile": True, "training.compile_mode": "reduce-overhead"})
    assert ok.training.compile_mode == "reduce-overhead"
    TrainConfig().with_overrides({"training.compile": True, "training.compile_mode": "max-autotune-no-cudagraphs",
                                  "training.accum_steps": 4})


def test_the_clock_counts_a_compile_once_and_a_reused_graph_not_at_all_and_holds_no_model():
    """In this process: Dynamo's callbacks time the compile; the compiled code keeps no reference to the model that
    was compiled (a worker's next trial must not keep the last one's weights alive)."""
    torch._dynamo.reset()
    clock = CompileClock()
    clock.install()
    cfg = TrainConfig().with_overrides({"training.compile": True})

    def step(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(6, 3)
        out = compile_model(model, cfg)(torch.ones(2, 6)).sum()
        out.backward()
        return model, out.item()

    model, first = step(0)
    seconds, count, _, _ = clock.read()
    assert count >= 1 and seconds > 0
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    _, again = step(0)
    assert clock.read()[:2] == (seconds, count) and again == first
    torch._dynamo.reset()  # the process-wide cache, as a worker's next trial of another graph does
    assert PROCESS.key is None or isinstance(PROCESS.key, str)
