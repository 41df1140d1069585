"""A pruner that races intervals: a trial stops as soon as its figure is known to be below the best's.

A percentile pruner keeps only the top share of trials at each window, and its statistics include every trial that
reported windows, also the ones later ruled infeasible: it stops trials that are well above the best complete
feasible trial whenever others reported faster windows.

``BestFeasiblePruner`` compares a trial with one thing only: the interval of the best configuration
(``autotune.study.view.configurations``: feasible, complete, end to end, its runs combined). While a trial measures,
each window brings its running estimate and interval (``trainer.estimate``); once that interval lies entirely below the
best's (``Interval.below``), the trial is measurably slower and more windows would only narrow a figure already known
to lose. A trial whose interval still overlaps the best's runs on: it may be a tie, or the faster.

What a trial reports (``autotune.search.evaluate.Watch``): at each window with an estimate, the estimate as Optuna's
intermediate value and the interval as the ``live_interval`` system attr ([imgs/s, half-width]). A pruned trial's
Optuna value is then its last intermediate value, the figure ``show`` prints for it with its interval.

A stage measurement, the baseline, a confirmation (a leader run again: a run cut short would leave its figure to the
faster runs) and any trial before a feasible one exists run to the end.
"""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.study.view import MEASUREMENT_STAGES, Stage, TrialView, configurations
from trainer.estimate import Interval

LIVE_INTERVAL = "autotune:live_interval"
"""The system attr of a running end-to-end trial: its running estimate and interval, [imgs/s, half-width]."""

NEVER_PRUNED = MEASUREMENT_STAGES | {Stage.BASELINE, Stage.CONFIRM, Stage.PROFILE}
"""Stages whose trials always measure to the end."""


class BestFeasiblePruner(optuna.pruners.BasePruner):
    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if trial.user_attrs.get("stage") in NEVER_PRUNED:
            return False
        live = trial.system_attrs.get(LIVE_INTERVAL)
        best = best_feasible(study)
        if not live or best is None:
            return False
        return Interval(*live).below(best)


def best_feasible(study: optuna.Study) -> Interval | None:
    """The interval of the best configuration (``view.configurations``: one run more than once at its runs
    combined); None before there is one."""
    done = [TrialView.of(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    best = max(configurations(done), key=lambda v: v.imgs_per_s, default=None)
    return best.interval if best is not None else None
