"""The pruner stops a trial only when its pace has settled — by the meter's own rule — below the best feasible
complete trial; a pruned trial's stored value is the figure it shows."""

from __future__ import annotations

import io
import statistics

import optuna
import pytest

from autotune.search.engine import Engine
from autotune.search.progress import Progress
from autotune.spec import StudySpec
from autotune.study import view
from autotune.study.pruning import LIVE_WINDOWS, BestFeasiblePruner, pace
from autotune.study.setup import create_or_load, make_pruner
from autotune.study.storage import record_on_trial, trial_attrs
from tests.helpers.machine import SPEC, FakePool, Machine, constructed_plan

optuna.logging.set_verbosity(optuna.logging.WARNING)

# The meter's settling rule for the trials below: 3 windows and the one before them within 5 %.
PRUNER = {"tolerance": 0.05, "min_windows": 2, "settle_windows": 4, "spread_target": 0.05}


def study_with(best: float | None, *, infeasible: float | None = None, part: float | None = None):
    """A study whose complete trials are: a feasible end-to-end one at ``best``, an infeasible one, a stage
    measurement recorded in the main study as older studies did (each when given)."""
    study = optuna.create_study(direction="maximize", pruner=BestFeasiblePruner(**PRUNER))
    for value, attrs, constraints in ((best, {}, {"failed": 0.0}),
                                      (infeasible, {"failure_class": "oom"}, {"failed": 1.0}),
                                      (part, {"stage": "ceiling"}, {"failed": 0.0})):
        if value is None:
            continue
        t = study.ask()
        for k, v in {**attrs, "imgs_per_s": value}.items():
            t.set_user_attr(k, v)
        for k, v in constraints.items():
            t.set_constraint(k, v)
        study.tell(t, value)
    return study


def prunes(study, windows, stage=None, steps=None) -> bool:
    """Report ``windows`` (full windows, at ``steps``: consecutive unless given) as the search's Watch does."""
    trial = study.ask()
    if stage:
        trial.set_user_attr("stage", stage)
    seen: list[list] = []
    for step, w in zip(steps or range(len(windows)), windows, strict=True):
        seen.append([step, w])
        record_on_trial(trial, LIVE_WINDOWS, seen)
        trial.report(pace(seen, 4), step=step)
    return trial.should_prune()


@pytest.mark.parametrize("windows, expected", [
    ([600.0, 610.0], False),  # two windows: the meter would not call that settled
    ([600.0, 605.0, 610.0], False),  # three: nor that
    ([600.0, 605.0, 610.0, 602.0], True),  # the meter's four agreeing windows, far below 1,000
    ([9780.0 / 12, 9851.0 / 12, 10016.0 / 12], False),  # the rising trial the old two-window rule stopped
    ([500.0, 600.0, 700.0, 800.0], False),  # still climbing: not settled
    ([960.0, 955.0, 958.0, 957.0], False),  # settled within the tolerance of the best: could still be it
    ([500.0, 1100.0, 1080.0, 1090.0], False),  # above the best
])
def test_only_a_pace_the_meter_would_call_settled_clearly_below_the_best_is_pruned(windows, expected):
    assert prunes(study_with(1000.0), windows) is expected


def test_a_short_window_between_the_judged_ones_breaks_the_run_as_it_does_for_the_meter():
    # Window 2 was shorter than half of window_s: the Watch did not report it.
    assert not prunes(study_with(1000.0), [600.0, 605.0, 610.0, 602.0], steps=[0, 1, 3, 4])
    # Four consecutive full windows after it: judged.
    assert prunes(study_with(1000.0), [600.0, 605.0, 610.0, 602.0, 604.0], steps=[0, 3, 4, 5, 6])


def test_the_pruner_judges_at_least_the_meters_windows_whatever_the_spec_says():
    spec = StudySpec.from_dict({**SPEC, "pruner": {"kind": "best", "min_windows": 2}})
    assert make_pruner(spec, multi_objective=False).n == SPEC["base"]["measure"]["windows"] + 1
    spec = StudySpec.from_dict({**SPEC, "pruner": {"kind": "best", "min_windows": 6}})
    assert make_pruner(spec, multi_objective=False).n == 6


def test_infeasible_trials_and_stage_measurements_never_set_the_bar():
    study = study_with(None, infeasible=5000.0, part=12000.0)  # no feasible end-to-end trial yet
    assert not prunes(study, [600.0, 610.0, 605.0, 600.0])
    study = study_with(1000.0, infeasible=5000.0, part=12000.0)  # the bar is 1,000, not 5,000 or 12,000
    assert not prunes(study, [980.0, 990.0, 985.0, 980.0]) and prunes(study, [600.0, 610.0, 605.0, 600.0])


def test_the_baseline_and_stage_measurements_are_never_pruned():
    for stage in ("baseline", "ceiling", "supply"):
        assert not prunes(study_with(1000.0), [10.0, 10.0, 10.0, 10.0], stage=stage)


def test_a_pruned_trial_stores_the_figure_it_shows_the_median_of_the_windows_judged(in_tmp):
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
    engine.plan.trials = 4
    engine.run(FakePool(Machine(ceilings={("fp16", True): 6000.0, ("fp32", False): 2000.0},
                                supplies={"pil": 1500.0, "nvjpeg-gpu": 11000.0}), "pool"))
    pruned = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.PRUNED]
    assert len(pruned) == 2
    for t in pruned:
        judged = trial_attrs(t)["judged_windows"]
        assert len(judged) >= SPEC["base"]["measure"]["windows"] + 1
        assert t.value == t.user_attrs["imgs_per_s"] == pytest.approx(statistics.median(judged))
        v = next(v for v in view.views(study) if v.number == t.number and not v.part)
        assert v.imgs_per_s == t.value  # what show prints
