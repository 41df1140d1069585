"""The knob table is the one place a knob is declared: every entry must name a real setting with valid values."""

from __future__ import annotations

import pytest
import yaml

from trainer.config import TrainConfig, scope_of
from trainer.knobs import AUTO, BY_RUNTIME_NAME, KNOBS, MEMORY_SETTINGS


@pytest.mark.parametrize("path", sorted(KNOBS))
def test_every_knob_is_a_setting_with_valid_choices(path):
    k = KNOBS[path]
    section, leaf = path.split(".")
    assert leaf in TrainConfig().to_dict()[section], f"{path}: no such TrainConfig setting"
    # A conditional knob is drawn only where its condition holds: its values are checked there.
    where = {}
    if k.when and " == " in k.when:
        cond, _, value = k.when.partition(" == ")
        where = {cond: yaml.safe_load(value)}
    for value in [*(k.choices or ()), *(end for end in (k.low, k.high) if end not in (None, AUTO))]:
        TrainConfig().with_overrides({**where, path: value})  # raises ConfigError for a value the job refuses
    assert scope_of(path) == k.scope


def test_runtime_names_are_unique_and_cover_every_non_nccl_knob():
    assert len(BY_RUNTIME_NAME) == len([k for k in KNOBS.values() if k.runtime])
    assert {k.path for k in KNOBS.values() if k.runtime is None} == {p for p in KNOBS if p.startswith("nccl.")}


def test_memory_settings_include_the_model_and_the_memory_knobs():
    assert {"model.name", "data.image_size", "training.precision"} <= set(MEMORY_SETTINGS)
    assert "ddp.bucket_cap_mb" not in MEMORY_SETTINGS
