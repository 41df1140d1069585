"""A sampler that does not draw again what a trial already ran: TPE's relative draw, drawn once more (a few times at
most) while it repeats a trial that ran or runs.

Where the stages hold most knobs (a refine trial holds the best's defining settings; a compiled one its graph too),
the knobs left to TPE are a few discrete ones, and its model of the best region is sharp: TPE then often draws an
earlier trial's configuration exactly, a run that measures nothing new (docs/benchmarks.md). A repeat is no
exploration, and the leaders' repeats the search wants are the confirm stage's, which it enqueues whole (this sampler
leaves a trial whose every searched knob is fixed as it is).
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

DRAWS = 8
"""Relative draws tried before a repeat stands: TPE that draws one configuration this many times in a row has settled
on it, and one more run of it sharpens that configuration's figure (a mean of its runs)."""

RAN = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
"""Trials whose configuration is known to the search: measured, judged infeasible or pruned, or running now. A failed
trial is not: TPE ignores it, and a draw of its configuration is a run again of a failure from outside."""


class DistinctSampler(BaseSampler):
    """``inner`` (a multivariate TPE) with repeats drawn again: everything else is the inner sampler's."""

    def __init__(self, inner: BaseSampler, *, draws: int = DRAWS):
        self.inner, self.draws = inner, draws

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        fixed = trial.system_attrs.get("fixed_params") or {}
        params = self.inner.sample_relative(study, trial, search_space)
        if not params or all(name in fixed for name in search_space):
            return params
        ran = [t.params for t in study.get_trials(deepcopy=False, states=RAN) if t.params and t.number != trial.number]
        for _ in range(self.draws - 1):
            if not any(repeats({**params, **fixed}, p) for p in ran):
                break
            # The last draw is the one returned: TPE's constant liar shares it with other search workers.
            params = self.inner.sample_relative(study, trial, search_space)
        return params

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self.inner.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.inner.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: list[float] | None) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()


def repeats(draw: dict[str, Any], params: dict[str, Any]) -> bool:
    """Whether ``draw`` (the fixed and the relatively sampled params of a trial about to run) is the configuration of
    a trial that ran with ``params``: every param of that trial drawn the same. Which conditional params are active
    follows from the others' values, so a param the draw holds and that trial lacks is one neither runs."""
    return all(name in draw and draw[name] == value for name, value in params.items())
