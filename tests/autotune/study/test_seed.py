"""The sampler's seed: studies of one spec draw different trials unless a seed is given."""

from __future__ import annotations

import optuna

from autotune.objective import Objective
from autotune.spec import StudySpec
from autotune.study.setup import create_or_load
from tests.helpers.machine import SPEC


def first_draws(name: str, seed: int | None = None) -> list[dict]:
    spec = StudySpec.from_dict({**SPEC, "sampler": {"kind": "random", "seed": 0}})
    study = create_or_load(spec=spec, study_name=name, storage=optuna.storages.InMemoryStorage(),
                           objective=Objective(), nproc=2, seed=seed)
    out = []
    for _ in range(3):
        t = study.ask()
        out.append({"bs": t.suggest_categorical("bs", [32, 64, 128, 256, 512]), "wk": t.suggest_int("wk", 0, 16)})
        study.tell(t, 1.0)
    return out


def test_studies_of_one_spec_draw_their_own_trials_and_a_given_seed_repeats_them():
    assert first_draws("a") == first_draws("a")  # a study's draws are reproducible from its spec and name
    assert first_draws("a") != first_draws("b")
    assert first_draws("a", seed=7) == first_draws("b", seed=7)
