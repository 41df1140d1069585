"""The pruner races intervals: a trial stops once its interval lies below the best configuration's, never while the two
overlap; a pruned trial's stored value is the figure it shows."""

from __future__ import annotations

import dataclasses
import io

import optuna
import pytest

from autotune.search.engine import Engine
from autotune.search.progress import Progress
from autotune.spec import StudySpec
from autotune.study import view
from autotune.study.pruning import LIVE_INTERVAL, BestFeasiblePruner
from autotune.study.setup import create_or_load
from autotune.study.storage import record_on_trial
from tests.helpers.machine import SPEC, FakePool, Machine, constructed_plan

optuna.logging.set_verbosity(optuna.logging.WARNING)


def study_with(best: tuple[float, float] | None, *, infeasible: float | None = None, part: float | None = None):
    """A study whose complete trials are: a feasible end-to-end one at ``best`` (figure, half-width), an infeasible
    one, a stage measurement recorded in the main study as older studies did (each when given)."""
    study = optuna.create_study(direction="maximize", pruner=BestFeasiblePruner())
    for value, attrs, constraints in ((best, {}, {"failed": 0.0}),
                                      (infeasible, {"failure_class": "oom"}, {"failed": 1.0}),
                                      (part, {"stage": "ceiling"}, {"failed": 0.0})):
        if value is None:
            continue
        ips, half = value if isinstance(value, tuple) else (value, 0.01)
        t = study.ask()
        for k, v in {**attrs, "imgs_per_s": ips, "ci_half_width": half}.items():
            t.set_user_attr(k, v)
        for k, v in constraints.items():
            t.set_constraint(k, v)
        study.tell(t, ips)
    return study


def prunes(study, estimates, stage=None) -> bool:
    """Report ``estimates`` ((figure, half-width) after each window) as the search's Watch does."""
    trial = study.ask()
    if stage:
        trial.set_user_attr("stage", stage)
    for step, (ips, half) in enumerate(estimates):
        record_on_trial(trial, LIVE_INTERVAL, [ips, half])
        trial.report(ips, step=step)
    return trial.should_prune()


@pytest.mark.parametrize("estimates, expected", [
    ([(600.0, 0.02)], True),  # 588-612 against 990-1,010: measurably slower
    ([(960.0, 0.05)], False),  # 912-1,008 reaches into 990-1,010: a tie is still possible ...
    ([(960.0, 0.02)], True),  # ... 941-979 does not
    ([(985.0, 0.02)], False),  # 965-1,005: a tie
    ([(700.0, 0.5)], False),  # 350-1,050: too wide to tell yet
    ([(700.0, 0.5), (700.0, 0.1)], True),  # ... and told once narrower
    ([(1100.0, 0.02)], False),  # above the best
])
def test_a_trial_is_pruned_once_its_interval_lies_below_the_bests(estimates, expected):
    assert prunes(study_with((1000.0, 0.01)), estimates) is expected


def test_a_wider_best_prunes_less():
    assert prunes(study_with((1000.0, 0.01)), [(950.0, 0.02)])  # 931-969 against 990-1,010
    assert not prunes(study_with((1000.0, 0.05)), [(950.0, 0.02)])  # against 950-1,050: a tie


def test_infeasible_trials_and_stage_measurements_never_set_the_bar():
    study = study_with(None, infeasible=5000.0, part=12000.0)  # no feasible end-to-end trial yet
    assert not prunes(study, [(600.0, 0.01)])
    study = study_with((1000.0, 0.01), infeasible=5000.0, part=12000.0)  # the bar is 1,000, not 5,000 or 12,000
    assert not prunes(study, [(995.0, 0.01)]) and prunes(study, [(600.0, 0.01)])


@pytest.mark.parametrize("stage", ["baseline", "ceiling", "supply", "confirm"])
def test_the_baseline_confirmations_and_stage_measurements_are_never_pruned(stage):
    assert not prunes(study_with((1000.0, 0.01)), [(10.0, 0.01)], stage=stage)


def test_a_spec_with_the_retired_pruner_settings_still_loads():
    with pytest.warns(FutureWarning, match=r"pruner.tolerance, pruner.min_windows: retired \(the pruner races"):
        spec = StudySpec.from_dict({**SPEC, "pruner": {"kind": "best", "tolerance": 0.05, "min_windows": 2}})
    assert spec.pruner.kind == "best"


def test_a_pruned_trial_stores_the_figure_and_interval_it_shows(in_tmp):
    plan = constructed_plan({**SPEC, "stages": {"enabled": False}}, trials=12)
    storage = optuna.storages.InMemoryStorage()
    study = create_or_load(spec=plan.spec, study_name=plan.name, storage=storage, objective=plan.objective, nproc=2,
                           baseline=plan.baseline)
    best = {**plan.baseline, "training.precision": "fp16", "training.channels_last": True,
            "training.batch_size": 512, "data.decode": "nvjpeg-gpu", "loader.num_workers": 8}
    study.enqueue_trial(best)
    for workers in (2, 3):  # slower: fed by fewer loader workers
        study.enqueue_trial({**best, "loader.num_workers": workers})
    engine = Engine(plan, study, storage, lambda line: None)
    engine.progress = Progress(total=plan.trials, timeout_s=None, out=io.StringIO())
    engine.plan = dataclasses.replace(engine.plan, trials=4)
    engine.run(FakePool(Machine(ceilings={("fp16", True): 6000.0, ("fp32", False): 2000.0},
                                supplies={"pil": 1500.0, "nvjpeg-gpu": 11000.0}), "pool"))
    pruned = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.PRUNED]
    assert len(pruned) == 2
    views = view.views(study)
    top = view.fastest(views).interval
    for t in pruned:
        v = next(v for v in views if v.number == t.number and not v.part)
        assert t.value == t.user_attrs["imgs_per_s"] == v.imgs_per_s  # what show prints
        assert v.half_width is not None and v.interval.below(top)  # stopped once measurably slower
