"""`autotune export` picking and LR scaling, on a real Optuna study (in-memory storage) with recorded trials."""

from __future__ import annotations

import optuna
import pytest
import yaml

from autotune import export, study as study_mod
from autotune.exceptions import StorageError
from autotune.objective import Objective
from autotune.spec import StudySpec
from trainer.config import TrainConfig

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPEC = {"name": "x", "base": {"model": {"name": "resnet50"}, "optimizer": {"lr": 0.1, "reference_global_batch": 256}},
        "default_space": False, "space": {"training.batch_size": [64, 128, 256]},
        "export": {"training.mode": "train", "training.epochs": 90}}


def make_study(kind: str, rows: list[tuple[int, float | None, float | None, str | None]]):
    """rows: (batch, imgs/s, util, failure class) — recorded the way `autotune search` records them."""
    spec = StudySpec.from_dict(SPEC)
    objective = Objective(kind=kind)
    study = study_mod.create_or_load(spec=spec, study_name="x", storage=optuna.storages.InMemoryStorage(),
                                     objective=objective, nproc=2,
                                     attrs={"fingerprint": {"gpu_model": "NVIDIA H200", "gpu_count": 2},
                                            "torchrun_args": [], "reference_global_batch": 256})
    base = spec.base_config()
    for i, (bs, ips, util, failure) in enumerate(rows):
        t = study.ask({"training.batch_size": optuna.distributions.CategoricalDistribution([64, 128, 256])})
        cfg = base.with_overrides({"training.batch_size": bs})
        attrs = {"config": cfg.to_dict(), "baseline": i == 0, "util_available": util is not None,
                 "env": {"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "8"}, "versions": {"torch": "2.11.0"}}
        if failure:
            attrs["failure_class"] = failure
        else:
            attrs.update(imgs_per_s=ips, util_mean=util, spread=0.01)
        for k, v in attrs.items():
            t.set_user_attr(k, v)
        study_mod.set_feasibility(t, failure is not None)
        study.tell(t, objective.infeasible_values() if failure else objective.values(attrs))
    return study


def test_best_is_the_fastest_feasible_trial_and_lr_scales_with_the_global_batch(tmp_path):
    study = make_study("throughput", [(64, 1000.0, None, None), (256, 3000.0, None, None), (128, None, None, "oom")])
    trial = export.pick_trial(study)
    assert trial.number == 1
    data, warnings = export.build(study, trial)
    assert any("lr scaled linearly 0.1 -> 0.2" in w for w in warnings)  # 256 x 2 ranks = 512 = 2 x 256
    a = data["autotune"]
    assert a["lr_scaling"] == {"rule": "linear", "from_lr": 0.1, "from_global_batch": 256, "to_lr": 0.2,
                               "to_global_batch": 512}
    assert a["measured"]["gain"] == 3.0 and a["measured"]["baseline_trial"] == 0
    assert a["fingerprint"] == {"gpu_model": "NVIDIA H200", "gpu_count": 2, "torch": "2.11.0"}
    assert a["torchrun"]["command"].startswith("torchrun --standalone --nproc-per-node 2 -m trainer --config")
    path = export.write(data, tmp_path / "best.yaml")
    cfg = TrainConfig.from_yaml(path)
    assert cfg.optimizer.lr == pytest.approx(0.2) and cfg.training.mode == "train" and cfg.training.epochs == 90
    assert yaml.safe_load(path.read_text())["autotune"]["trial"] == 1


def test_same_global_batch_keeps_the_lr(tmp_path):
    study = make_study("throughput", [(128, 1000.0, None, None)])  # 128 x 2 = 256
    data, warnings = export.build(study, export.pick_trial(study))
    assert warnings == [] and "lr_scaling" not in data["autotune"] and data["optimizer"]["lr"] == 0.1


def test_pareto_picks_from_the_front():
    rows = [(64, 1700.0, 59.0, None), (256, 3200.0, 46.0, None), (128, 2000.0, 40.0, None), (128, 2600.0, 80.0, None)]
    study = make_study("pareto", rows)
    assert [t.number for t in export.pareto_front(export.feasible(study))] == [1, 3]
    assert export.pick_trial(study, "best").number == 1  # pareto "best": the fastest on the front
    assert export.pick_trial(study, "util").number == 3
    assert export.pick_trial(study, "balanced").number == 3  # 2600/3200 * 80/80 > 3200/3200 * 46/80


def test_bad_picks_say_what_to_do():
    study = make_study("throughput", [(64, 1000.0, None, None), (128, None, None, "oom")])
    with pytest.raises(StorageError, match="trial 1 did not complete a measurement \\(oom\\)"):
        export.pick_trial(study, "1")
    with pytest.raises(StorageError, match="no trial 9"):
        export.pick_trial(study, "9")
    with pytest.raises(StorageError, match="no trial of this study recorded GPU utilization"):
        export.pick_trial(study, "util")
    with pytest.raises(StorageError, match="use one of best, fastest"):
        export.pick_trial(study, "cheapest")
    empty = make_study("throughput", [(64, None, None, "oom")])
    with pytest.raises(StorageError, match="no completed, feasible trial"):
        export.pick_trial(empty)
