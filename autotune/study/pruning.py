"""A pruner that cannot throw away a winner.

A percentile pruner keeps only the top share of trials at each window, and its statistics include every trial that
reported windows — also the ones later ruled infeasible: it stops trials that are well above the best complete
feasible trial whenever others reported faster windows.

``BestFeasiblePruner`` compares a trial with one number only: the best feasible, complete, end-to-end trial
(``autotune.study.view``). It stops a trial when its pace has settled (its latest windows agree within the tolerance)
below that best by more than the tolerance: a settled pace does not climb above a bar it is clearly under. A trial
still ramping up, one that beats the best in any recent window, a stage measurement, and any trial before a feasible
one exists run to the end.
"""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.study.view import MEASUREMENT_STAGES, TrialView


class BestFeasiblePruner(optuna.pruners.BasePruner):
    def __init__(self, *, tolerance: float = 0.05, min_windows: int = 2):
        self.tolerance, self.min_windows = tolerance, min_windows

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if trial.user_attrs.get("stage") in (*MEASUREMENT_STAGES, "baseline"):
            return False
        values = [v for _, v in sorted(trial.intermediate_values.items())]
        if len(values) < self.min_windows:
            return False
        best = best_feasible(study)
        if best is None:
            return False
        latest = values[-self.min_windows:]
        settled = (max(latest) - min(latest)) <= self.tolerance * min(latest)
        return settled and max(latest) < best * (1 - self.tolerance)


def best_feasible(study: optuna.Study) -> float | None:
    """imgs/s of the best feasible complete end-to-end trial; None before there is one."""
    done = [TrialView.of(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    return max((v.imgs_per_s for v in done if v.feasible), default=None)
