"""A pruner that cannot throw away a winner, and judges a pace as the meter does.

A percentile pruner keeps only the top share of trials at each window, and its statistics include every trial that
reported windows — also the ones later ruled infeasible: it stops trials that are well above the best complete
feasible trial whenever others reported faster windows.

``BestFeasiblePruner`` compares a trial with one number only: the best feasible, complete, end-to-end trial
(``autotune.study.view``). It stops a trial when its pace has settled below that best by more than the tolerance — a
settled pace does not climb above a bar it is clearly under. *Settled* is the meter's own rule
(``trainer.meter.ThroughputMeter.settled``) or stricter: the latest ``measure.windows`` + 1 full windows (each at least
half of ``window_s``, consecutive) agree within ``measure.spread_target``; a pruner that judged two windows stopped a
trial that was still rising (9,780 → 9,851 → 10,016 imgs/s on 2xH200) where the meter would have measured on.

What a trial reports (``autotune.search.evaluate.Watch``): at each full window, the median of its latest full windows
(as many as the rule judges) as Optuna's intermediate value, and the windows themselves as the ``live_windows`` user
attr ([step, imgs/s] pairs). A pruned trial's Optuna value is then its last intermediate value — the median of the
windows judged — and that is the figure ``show`` prints for it: one number per pruned trial.

A trial still ramping up, one within the tolerance of the best, a stage measurement, the baseline, a confirmation
(a leader run again: a run cut short would leave its mean to the faster runs) and any trial before a feasible one
exists run to the end.
"""

from __future__ import annotations

import itertools
import statistics

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.study.view import MEASUREMENT_STAGES, TrialView, answers

LIVE_WINDOWS = "autotune:live_windows"
"""The user attr of a running end-to-end trial: its full windows so far, as [step, imgs/s] pairs."""


def judged(windows: list[tuple[int, float]], n: int) -> list[float]:
    """The latest ``n`` windows of ``windows`` ([step, imgs/s], in order) if they are consecutive steps (a short
    window between them is not reported, and breaks the run as it breaks the meter's), else []."""
    tail = [tuple(w) for w in windows[-n:]]
    if len(tail) < n or any(b[0] != a[0] + 1 for a, b in itertools.pairwise(tail)):
        return []
    return [float(ips) for _, ips in tail]


def pace(windows: list[tuple[int, float]], n: int) -> float:
    """What a trial reports at each full window: the median of its latest ``n`` full windows (fewer at first)."""
    return statistics.median(float(ips) for _, ips in windows[-n:])


class BestFeasiblePruner(optuna.pruners.BasePruner):
    def __init__(self, *, tolerance: float = 0.05, min_windows: int = 2, settle_windows: int = 4,
                 spread_target: float = 0.05):
        self.tolerance, self.spread_target = tolerance, spread_target
        self.n = max(min_windows, settle_windows)
        """Windows judged: never fewer than the meter needs to call a pace settled."""

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if trial.user_attrs.get("stage") in (*MEASUREMENT_STAGES, "baseline", "confirm"):
            return False
        latest = judged(trial.system_attrs.get(LIVE_WINDOWS) or [], self.n)
        if not latest:
            return False
        best = best_feasible(study)
        if best is None:
            return False
        med = statistics.median(latest)
        settled = med > 0 and (max(latest) - min(latest)) / med <= self.spread_target
        return settled and max(latest) < best * (1 - self.tolerance)


def best_feasible(study: optuna.Study) -> float | None:
    """imgs/s of the best answer (``view.answers``: a configuration run more than once at the mean of its runs);
    None before there is one."""
    done = [TrialView.of(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    return max((v.imgs_per_s for v in answers(done)), default=None)
