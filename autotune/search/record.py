"""Record a trial's evaluation in the study: its attributes, its Optuna state and constraints, and — for a failure
of the configuration with a repair — its draw enqueued once more, repaired (``autotune.search.repair``).

``study`` is the study the trial belongs to: the main one, or for a measurement of a part the parts study
(``autotune.study.view``), where its repair is enqueued too. States: a measurement is COMPLETE; a configuration
failure is COMPLETE and infeasible (``failed`` constraint: the sampler learns the combination fails); a pruned trial
is PRUNED, its value the median of the windows the pruner judged (what it shows), or none when it was pruned before
launch; an environment failure is FAIL (the sampler learns nothing from it) — ``autotune.study.view.Outcome``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optuna.trial import TrialState

from autotune.objective import Objective
from autotune.search.evaluate import Evaluation
from autotune.search.repair import batch_choices, repair_for
from autotune.space import SearchSpace
from autotune.study.storage import CONFIG_KEY, record_on_trial, set_trial_attrs
from autotune.study.view import FAILED_CONSTRAINT, REQUEST_ATTRS, Outcome


def record(study, trial, ev: Evaluation, objective: Objective, space: SearchSpace,
           known_oom: Callable[[dict[str, Any]], int | None] = lambda config: None) -> Outcome:
    """Tell the study; returns how the trial ended (``Outcome``: measured, part, infeasible, pruned or fail)."""
    if ev.config is not None:
        record_on_trial(trial, CONFIG_KEY, ev.config.to_dict())
    outcome = ev.outcome
    retry = plan_repair(trial, ev, space, known_oom) if outcome == Outcome.INFEASIBLE else None
    if retry is not None:
        ev.repaired_by_next = retry[1]["repaired"]
    attrs = ev.attrs()
    set_trial_attrs(trial, attrs)
    if outcome.constrained:
        trial.set_constraint(FAILED_CONSTRAINT, 1.0 if outcome == Outcome.INFEASIBLE else 0.0)
    if outcome == Outcome.INFEASIBLE:
        study.tell(trial, objective.infeasible_values())
    elif outcome.state == TrialState.COMPLETE:
        study.tell(trial, objective.values(attrs))
    else:
        study.tell(trial, state=outcome.state)
    if retry is not None:
        study.enqueue_trial(retry[0], user_attrs=retry[1], skip_if_exists=False)
    return outcome


def plan_repair(trial, ev: Evaluation, space: SearchSpace,
                known_oom: Callable[[dict[str, Any]], int | None]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(params, user attrs) of the repaired draw of an infeasible trial, or None. An end-to-end draw is repaired
    once, and only through its own parameters; a measurement of a part moves on (its batch keeps going down until
    it fits)."""
    part = ev.stage.measures_part
    if trial.user_attrs.get("retry_of") is not None and not part:
        return None
    config = ev.config.to_dict() if ev.config is not None else None
    base_batch = config["training"]["batch_size"] if config else 0

    def fits(batch: int) -> bool:
        return config is None or known_oom({**config, "training": {**config["training"], "batch_size": batch}}) is None

    fix = repair_for(ev.failure, ev.message, config, batches=batch_choices(space, base_batch), fits=fits)
    if fix is None or (not part and not set(fix.changes) <= set(trial.params)):
        return None
    attrs: dict[str, Any] = {**{k: trial.user_attrs[k] for k in REQUEST_ATTRS if k in trial.user_attrs},
                             "stage": ev.stage, "retry_of": trial.number, "repaired": fix.changes,
                             "repair_reason": fix.why}
    if part:
        attrs["overrides"] = {**(trial.user_attrs.get("overrides") or {}), **fix.changes}
        return {}, attrs
    return {**trial.params, **fix.changes}, attrs
