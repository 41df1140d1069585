"""What a study found, in the sentence the search's last line, ``show`` and the report share
(``autotune.study.found``)."""

from __future__ import annotations

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from autotune.study import view
from autotune.study.found import found

BATCH = CategoricalDistribution([32, 64, 128, 256])


def study_of(runs: list[tuple[str, int, float, float]]) -> optuna.Study:
    """A study of complete end-to-end trials: (stage, batch, imgs/s, half-width) each, in order."""
    study = optuna.create_study(direction="maximize")
    for stage, batch, ips, half in runs:
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=ips, params={"training.batch_size": batch},
                                     distributions={"training.batch_size": BATCH},
                                     user_attrs={"stage": stage, "imgs_per_s": ips, "ci_half_width": half}))
    return study


def test_the_best_run_twice_is_no_tie_with_itself_and_names_the_configuration_that_ties_it():
    # Trial 2's configuration is run again as trial 4: the best stands on both runs; trial 1 ties with it.
    study = study_of([("baseline", 32, 5000.0, 0.01), ("search", 64, 7000.0, 0.01), ("search", 128, 7100.0, 0.02),
                      ("search", 256, 6000.0, 0.01), ("confirm", 128, 7140.0, 0.02)])
    trials = view.views(study)
    best = view.fastest(trials)
    assert [r[0] for r in best.attrs[view.RUNS]] == [2, 4]
    assert [v.label for v in view.tied(trials)] == ["2", "1"]
    line = found(trials)
    assert line.startswith("trial 2, ") and "(trials 2 and 4: " in line
    assert "a tie with trial 1 (" in line and "a tie with trial 2" not in line, line
