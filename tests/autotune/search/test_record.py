"""A trial's result, from its evaluation to the study: the one record (``Evaluation``) and what the study is told
(``autotune.search.record``); a trial's stage, decided once when the search asks for it (``Engine.staged``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from autotune.objective import Objective
from autotune.search.engine import Engine
from autotune.search.evaluate import Evaluation, Stop, Watch, supply_stop
from autotune.search.record import record
from autotune.space import resolve
from autotune.spec import StudySpec
from autotune.study import view
from autotune.study.storage import trial_attrs
from tests.helpers.machine import constructed_plan
from trainer.estimate import Interval
from trainer.protocol import Failure

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPEC = StudySpec.from_dict({"name": "r", "base": {"model": {"name": "resnet18"}}, "default_space": False,
                            "space": {"training.batch_size": [64, 128]}})


def told(ev: Evaluation) -> tuple[view.Outcome, optuna.trial.FrozenTrial]:
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    outcome = record(study, trial, ev, Objective(), resolve(SPEC, world_size=2, nproc_per_node=2, cpu_only=True))
    return outcome, study.trials[0]


def test_an_evaluation_is_stored_under_the_attrs_every_study_has_held():
    ev = Evaluation(stage="search", log_path="/x/log.txt", util_available=True, util_mean=None)
    ev.take({"imgs_per_s": 1000.0, "ci_half_width": 0.01, "precise": True, "wall_s": 12.0, "windows": 5,
             "env": {"OMP_NUM_THREADS": "4"}, "returncode": None})
    assert ev.imgs_per_s == 1000.0 and ev.wall_s == 12.0
    assert ev.figures == {"windows": 5, "env": {"OMP_NUM_THREADS": "4"}, "returncode": None}
    outcome, t = told(ev)
    attrs = trial_attrs(t)
    assert outcome == view.Outcome.MEASURED and t.state == TrialState.COMPLETE and t.values == [1000.0]
    # None is left out, but util_mean: the study says there was no sample, not that it was never asked.
    assert "util_mean" in attrs and attrs["util_mean"] is None and "returncode" not in attrs
    assert {k: attrs[k] for k in ("stage", "log_path", "imgs_per_s", "ci_half_width", "precise", "wall_s", "windows",
                                  "env")} == {"stage": "search", "log_path": "/x/log.txt", "imgs_per_s": 1000.0,
                                              "ci_half_width": 0.01, "precise": True, "wall_s": 12.0, "windows": 5,
                                              "env": {"OMP_NUM_THREADS": "4"}}
    assert "failure_class" not in attrs and view.TrialView.of(t).outcome == outcome


@pytest.mark.parametrize("failure, pruned, part, outcome, state", [
    (Failure.OOM, False, False, view.Outcome.INFEASIBLE, TrialState.COMPLETE),
    (Failure.NCCL, False, False, view.Outcome.FAIL, TrialState.FAIL),
    (None, True, False, view.Outcome.PRUNED, TrialState.PRUNED),
    (None, False, True, view.Outcome.PART, TrialState.COMPLETE),
])
def test_how_a_trial_ended_is_one_outcome_the_study_and_its_readers_agree_on(failure, pruned, part, outcome, state):
    ev = Evaluation(stage="supply" if part else "search", failure=failure, message="m" if failure else None,
                    pruned=pruned, imgs_per_s=None if failure else 900.0, ci_half_width=0.02)
    said, t = told(ev)
    assert said == outcome and t.state == state and view.TrialView.of(t, part=part).outcome == outcome
    attrs = trial_attrs(t)
    assert attrs.get("failure_class") == (str(failure) if failure else None)
    if outcome == view.Outcome.INFEASIBLE:  # told with a value, so the sampler learns the combination fails
        assert t.values == Objective().infeasible_values()


def test_a_trial_is_staged_once_when_asked_for_and_every_reader_takes_that_stage():
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({}, user_attrs={"retry_of": 3})  # its search vanished: its attrs name no stage
    retry = study.ask()
    assert Engine.staged(retry) == view.Stage.RETRY and retry.user_attrs["stage"] == view.Stage.RETRY
    drawn = study.ask()
    assert Engine.staged(drawn) == view.Stage.SEARCH and drawn.user_attrs["stage"] == view.Stage.SEARCH
    assert [view.stage_of(t.user_attrs) for t in study.get_trials(deepcopy=False)] == [view.Stage.RETRY,
                                                                                       view.Stage.SEARCH]


class Quiet:
    per = "imgs/s"

    def window(self, *args) -> None:
        pass


def test_a_supply_stopped_early_keeps_why_as_a_reason_and_as_a_sentence():
    watch = Watch(SimpleNamespace(number=1), view.Stage.SUPPLY, Quiet(), report=False, stop_when={"above": 500.0})
    assert watch.on_record({"kind": "window", "estimate": {"imgs_per_s": 800.0, "half_width": 0.01}})
    assert watch.stopped == Stop.ABOVE and watch.why.startswith("above the ceiling (500 imgs/s)")
    assert supply_stop(Interval(80.0, 0.01), {"below": 500.0}) == Stop.OUT_OF_REACH
    assert supply_stop(Interval(500.0, 0.01), {"above": 900.0, "below": 100.0}) is None


def test_a_plan_is_not_changed_once_decided():
    plan = constructed_plan(trials=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.trials = 4
    assert dataclasses.replace(plan, trials=4).trials == 4 and plan.trials == 3
