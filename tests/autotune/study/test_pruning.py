"""The pruner stops a trial only when its pace has settled below the best feasible complete trial."""

from __future__ import annotations

import optuna
import pytest

from autotune.study.pruning import BestFeasiblePruner

optuna.logging.set_verbosity(optuna.logging.WARNING)


def study_with(best: float | None, *, infeasible: float | None = None, part: float | None = None):
    """A study whose complete trials are: a feasible end-to-end one at ``best``, an infeasible one, a stage
    measurement (each when given)."""
    study = optuna.create_study(direction="maximize", pruner=BestFeasiblePruner(tolerance=0.05, min_windows=2))
    for value, attrs, constraints in ((best, {}, {"failed": 0.0, "measures_a_part": 0.0}),
                                      (infeasible, {"failure_class": "oom"}, {"failed": 1.0, "measures_a_part": 0.0}),
                                      (part, {"stage": "ceiling"}, {"failed": 0.0, "measures_a_part": 1.0})):
        if value is None:
            continue
        t = study.ask()
        for k, v in {**attrs, "imgs_per_s": value}.items():
            t.set_user_attr(k, v)
        for k, v in constraints.items():
            t.set_constraint(k, v)
        study.tell(t, value)
    return study


def prunes(study, windows, stage=None) -> bool:
    trial = study.ask()
    if stage:
        trial.set_user_attr("stage", stage)
    for i, w in enumerate(windows):
        trial.report(w, step=i)
    return trial.should_prune()


@pytest.mark.parametrize("windows, expected", [
    ([600.0], False),  # one window says nothing yet
    ([600.0, 610.0], True),  # settled, far below 1,000
    ([600.0, 900.0], False),  # still climbing: not settled
    ([960.0, 955.0], False),  # settled within the tolerance of the best: could still be it
    ([500.0, 1100.0, 1080.0], False),  # above the best
])
def test_only_a_settled_pace_clearly_below_the_best_is_pruned(windows, expected):
    assert prunes(study_with(1000.0), windows) is expected


def test_infeasible_trials_and_stage_measurements_never_set_the_bar():
    study = study_with(None, infeasible=5000.0, part=12000.0)  # no feasible end-to-end trial yet
    assert not prunes(study, [600.0, 610.0])
    study = study_with(1000.0, infeasible=5000.0, part=12000.0)  # the bar is 1,000, not 5,000 or 12,000
    assert not prunes(study, [980.0, 990.0]) and prunes(study, [600.0, 610.0])


def test_the_baseline_and_stage_measurements_are_never_pruned():
    for stage in ("baseline", "ceiling", "supply"):
        assert not prunes(study_with(1000.0), [10.0, 10.0], stage=stage)
