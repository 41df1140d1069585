"""The stages' decisions, on a real Optuna study whose measurements are recorded by the search's own recording step:
what the ceiling measures, when cuDNN's algorithm search stays off, which pipelines become candidates, and that a
small budget keeps room for end-to-end trials."""

from __future__ import annotations

from types import SimpleNamespace

import optuna
import pytest

from autotune.objective import Objective
from autotune.search.evaluate import Evaluation
from autotune.search.record import record
from autotune.search.stages import StagePlanner
from autotune.space import resolve
from autotune.spec import StudySpec
from autotune.study.setup import create_or_load
from autotune.study.view import views

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPEC = {"name": "s", "base": {"model": {"name": "resnet18"}, "data": {"kind": "imagefolder", "path": "/d"}},
        "default_space": False,
        # fp16 is dropped without a GPU
        "space": {"training.precision": ["fp32", "bf16", "fp16"], "training.channels_last": [False, True],
                  "training.batch_size": [64, 128, 256], "data.decode": ["pil", "torchvision-cpu", "nvjpeg-gpu",
                                                                        "hybrid"],
                  "data.hybrid_cpu_fraction": {"choices": [0.25, 0.5], "when": "data.decode == hybrid"},
                  "loader.num_workers": {"low": 2, "high": 8}},
        "baseline": {"training.precision": "fp32", "training.batch_size": 64, "data.decode": "pil"}}


def planner(gpu: bool):
    spec = StudySpec.from_dict(SPEC)
    space = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=not gpu, cores=32)
    probe = spec.base_config()
    plan = SimpleNamespace(spec=spec, space=space, probe=probe, entries=["0", "1"] if gpu else None,
                           data=SimpleNamespace(classes=10), baseline=space.baseline_params(spec, probe.to_dict()))
    study = create_or_load(spec=spec, study_name="s", storage=optuna.storages.InMemoryStorage(),
                           objective=Objective(), nproc=2)
    return StagePlanner(plan, study), study, space, probe


def run_waiting(study, space, probe, measure):
    """Ask and record every waiting trial with ``measure(config) -> imgs/s`` as its figure."""
    while any(t.state == optuna.trial.TrialState.WAITING for t in study.get_trials(deepcopy=False)):
        trial = study.ask()
        stage = trial.user_attrs.get("stage", "search")
        overrides = trial.user_attrs.get("overrides") or space.suggest(trial, probe.to_dict())
        cfg = probe.with_overrides(overrides)
        record(study, trial, Evaluation(stage=stage, attrs={"imgs_per_s": measure(cfg)}, config=cfg), Objective(),
               space)


def model_speed(cfg):
    """A model that likes fp16 and channels_last, and keeps its pace down to batch 128."""
    t = cfg.training
    return ({"fp32": 1000.0, "bf16": 2000.0, "fp16": 3000.0}[t.precision] * (2 if t.channels_last else 1)
            * (1.0 if t.batch_size >= 128 else 0.7) * (1.0 if t.cudnn_benchmark else 0.999))


def test_the_ceiling_measures_each_precision_and_layout_then_smaller_batches_of_the_fastest():
    p, study, space, probe = planner(gpu=False)
    assert p.enqueue_next(left=20) == "ceiling"  # the first pair alone (on a GPU it decides cuDNN's search) ...
    run_waiting(study, space, probe, model_speed)
    assert p.enqueue_next(left=19) == "ceiling"  # ... then the others
    overrides = [t.user_attrs["overrides"] for t in study.get_trials(deepcopy=False)]
    assert [(o["training.precision"], o["training.channels_last"], o["training.batch_size"]) for o in overrides] == \
        [("fp32", False, 256), ("fp32", True, 256), ("bf16", False, 256), ("bf16", True, 256)]
    assert all(o["data.kind"] == "synthetic" and o["data.num_classes"] == 10 for o in overrides)
    run_waiting(study, space, probe, model_speed)
    assert p.enqueue_next(left=16) == "ceiling"  # batch 128 for bf16 + channels_last: the pace holds
    run_waiting(study, space, probe, model_speed)
    assert p.enqueue_next(left=15) == "ceiling"  # and 64, where it does not
    run_waiting(study, space, probe, model_speed)
    assert p.ceiling_choice(views(study))["training.batch_size"] == 128  # the smallest batch on the plateau
    assert p.enqueue_next(left=14) == "supply"


def test_on_a_gpu_cudnns_search_is_measured_twice_and_kept_off_when_it_buys_nothing():
    p, study, space, probe = planner(gpu=True)
    p.enqueue_next(left=30)
    first_two = [t.user_attrs["overrides"]["training.cudnn_benchmark"] for t in study.get_trials(deepcopy=False)]
    assert first_two == [True, False]
    run_waiting(study, space, probe, model_speed)  # 0.1 % apart: below the 1 % it must buy
    p.enqueue_next(left=28)
    assert study.user_attrs["decided"] == {"training.cudnn_benchmark": False}
    rest = [t.user_attrs["overrides"] for t in study.get_trials(deepcopy=False)][2:]
    assert len(rest) == 5 and all(o["training.cudnn_benchmark"] is False for o in rest)


def test_candidates_are_the_pipelines_whose_supply_best_meets_the_ceiling_hybrid_derived_from_its_ends():
    p, study, space, probe = planner(gpu=True)
    supplies = {"pil": 2000.0, "torchvision-cpu": 4000.0, "nvjpeg-gpu": 9000.0}
    for left in (40, 38, 34, 33, 32):
        p.enqueue_next(left=left)
        run_waiting(study, space, probe, lambda c: supplies[c.data.decode] if c.training.mode == "loader"
                    else model_speed(c))
    measured = [v.setting("data.decode") for v in views(study) if v.stage == "supply"]
    assert sorted(measured) == ["nvjpeg-gpu", "pil", "torchvision-cpu"]  # hybrid: derived from its two ends
    assert p.enqueue_next(left=30) == "candidate"
    cands = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("stage") == "candidate"]
    picked = [(t.system_attrs["fixed_params"]["data.decode"],
               t.system_attrs["fixed_params"].get("data.hybrid_cpu_fraction")) for t in cands]
    # Ceiling 6,000 (fp16, CL, batch 128). Bounds, each capped at the ceiling: nvjpeg 9,000 -> 6,000; hybrid 25 %:
    # 1 / max(0.25 / 4,000, 0.75 / 9,000) = 12,000 -> 6,000; hybrid 50 %: 8,000 -> 6,000; torchvision-cpu 4,000 and
    # pil 2,000 fall short of 90 % of the best bound.
    assert sorted(picked, key=str) == sorted([("nvjpeg-gpu", None), ("hybrid", 0.25), ("hybrid", 0.5)], key=str)
    for t in cands:
        fixed = t.system_attrs["fixed_params"]
        assert (fixed["training.precision"], fixed["training.channels_last"], fixed["training.batch_size"]) == \
            ("fp16", True, 128)
        assert fixed["loader.num_workers"] == 8  # the most workers the space allows


@pytest.mark.parametrize("left, expected", [(3, None), (6, "ceiling")])
def test_a_small_budget_keeps_room_for_end_to_end_trials(left, expected):
    p, _, _, _ = planner(gpu=False)
    assert p.enqueue_next(left=left) == expected  # 4 ceiling measurements need 6 trials left (2 kept end to end)
