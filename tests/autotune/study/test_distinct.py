"""The search's sampler does not draw again a configuration a trial ran: the DALI refine trials of the 1xH200 search
``s10`` (its trials 0-16 as they ran, the best's defining settings held as the refine stage holds them), asked for one
more draw under 20 seeds."""

from __future__ import annotations

import json
import warnings

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from autotune.spec import StudySpec
from autotune.study.distinct import DistinctSampler
from autotune.study.setup import make_sampler

HELD = {"training.batch_size": 512, "training.precision": "fp16", "training.compile": True, "data.decode": "dali"}
"""The defining and graph settings the refine stage held (the rest of s10's were at their one value)."""

SPACE = {"training.batch_size": CategoricalDistribution((64, 128, 256, 512)),
         "training.precision": CategoricalDistribution(("fp32", "bf16", "fp16")),
         "training.compile": CategoricalDistribution((False, True)),
         "data.decode": CategoricalDistribution(("pil", "dali")),
         "data.dali_hw_decoder_load": CategoricalDistribution((0.25, 0.35, 0.5, 0.65, 0.8, 0.95)),
         "data.dali_threads": IntDistribution(1, 16),
         "data.dali_prefetch": IntDistribution(1, 4)}

S10 = [  # trial: DALI's hardware share, threads, queue; imgs/s; pruned
    (1, 0.5, 16, 3, 5645.5, False), (3, 0.5, 16, 3, 6361.5, False), (5, 0.35, 8, 4, 6664.9, False),
    (6, 0.25, 2, 1, 1691.2, False), (7, 0.35, 8, 4, 6116.2, False), (9, 0.95, 11, 1, 5428.8, True),
    (10, 0.35, 3, 2, 3474.6, False), (11, 0.25, 15, 4, 6185.5, False), (12, 0.5, 9, 3, 6701.6, False),
    (13, 0.5, 9, 3, 6661.9, False), (14, 0.95, 6, 4, 6232.0, False), (15, 0.5, 4, 4, 6185.1, False),
    (16, 0.35, 13, 3, 6737.9, False)]


def s10_trials() -> list[optuna.trial.FrozenTrial]:
    out = [create_trial(params={"training.batch_size": 64, "training.precision": "fp32", "training.compile": False,
                                "data.decode": "pil"}, distributions={k: SPACE[k] for k in HELD}, value=790.1)]
    for number, hw, threads, queue, ips, pruned in S10:
        params = {**HELD, "training.compile": number != 1, "data.dali_hw_decoder_load": hw,
                  "data.dali_threads": threads, "data.dali_prefetch": queue}
        out.append(create_trial(params=params, distributions=SPACE,
                                **({"state": TrialState.PRUNED, "intermediate_values": {0: ips}} if pruned else
                                   {"value": ips})))
    return out


def next_draw(sampler: optuna.samplers.BaseSampler, fixed: dict) -> str:
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.add_trials(s10_trials())
    study.enqueue_trial(fixed)
    trial = study.ask()
    for name, dist in SPACE.items():
        trial._suggest(name, dist)
    return json.dumps(trial.params, sort_keys=True)


@pytest.fixture(autouse=True)
def quiet():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def test_a_refine_draw_is_not_a_configuration_already_run():
    ran = {json.dumps(t.params, sort_keys=True) for t in s10_trials()}
    spec = StudySpec(name="s10")
    draws = [next_draw(make_sampler(spec, seed), HELD) for seed in range(20)]
    assert not ran & set(draws)
    # TPE alone, asked the same, repeats a configuration it ran (s10's trials 13, 17 and 18 were such repeats).
    alone = [next_draw(make_sampler(spec, seed).inner, HELD) for seed in range(20)]
    assert ran & set(alone)


def test_a_trial_enqueued_whole_runs_as_enqueued_a_repeat_included():
    """The confirm stage runs a leader again by enqueuing its whole configuration: that repeat is wanted."""
    leader = json.loads(json.dumps(s10_trials()[-1].params))
    assert json.loads(next_draw(make_sampler(StudySpec(name="s10"), 0), leader)) == leader


def test_a_sampler_that_draws_only_repeats_runs_one_after_a_few_draws():
    """TPE that keeps drawing one configuration has settled on it: after ``draws`` tries the repeat stands."""

    class Stuck(optuna.samplers.RandomSampler):
        calls = 0

        def infer_relative_search_space(self, study, trial):
            return {k: SPACE[k] for k in ("data.dali_hw_decoder_load", "data.dali_threads", "data.dali_prefetch")}

        def sample_relative(self, study, trial, search_space):
            Stuck.calls += 1
            return {"data.dali_hw_decoder_load": 0.35, "data.dali_threads": 13, "data.dali_prefetch": 3}

    draw = json.loads(next_draw(DistinctSampler(Stuck(), draws=4), HELD))
    assert Stuck.calls == 4 and draw == {**HELD, "data.dali_hw_decoder_load": 0.35, "data.dali_threads": 13,
                                         "data.dali_prefetch": 3}
