"""The trials' optimizer: `--optimizer` / `--lr` into the spec's base, the model family's recipe where the spec's
optimizer was chosen for another model, and the line that says which and why."""

from __future__ import annotations

import pytest

from autotune.exceptions import AutotuneError, SpecError
from autotune.search.prepare import SearchOptions, check_options, with_command_line
from autotune.spec import StudySpec, load_spec


def chosen(spec, **options):
    new, why = with_command_line(spec, SearchOptions(**options))
    return new.base_config("<generated>").optimizer, why


def test_a_transformer_named_on_the_command_line_gets_its_recipe_and_the_line_says_so():
    opt, why = chosen(load_spec("resnet50"), model="vit_b_16")
    assert (opt.name, opt.lr, opt.weight_decay, opt.reference_global_batch) == ("adamw", 7.5e-4, 0.05, 1024)
    assert why.startswith("optimizer adamw lr 0.00075, weight decay 0.05 (for a global batch of 1024): torchvision's")
    assert "the ViT recipe (--optimizer / --lr set another)" in why
    opt, why = chosen(load_spec("resnet50"), model="convnext_tiny")
    assert (opt.name, opt.lr) == ("adamw", 1e-3) and "ConvNeXt" in why


def test_a_model_without_a_recipe_keeps_the_specs_optimizer():
    opt, why = chosen(load_spec("resnet50"), model="resnet18")
    assert (opt.name, opt.lr, opt.reference_global_batch) == ("sgd", 0.1, 256)
    assert why == "optimizer sgd lr 0.1 (the spec's; --optimizer / --lr set another)"
    spec = load_spec("resnet50")
    assert with_command_line(spec, SearchOptions())[0] is spec  # nothing given: the spec as it is


def test_the_command_line_wins_and_lr_is_the_one_trial_0_runs_at():
    opt, why = chosen(load_spec("resnet50"), model="vit_b_16", lr=3e-4)
    assert (opt.name, opt.lr, opt.reference_global_batch) == ("adamw", 3e-4, None)  # export rescales from trial 0's
    assert why == "optimizer adamw lr 0.0003 (from --lr)"
    opt, why = chosen(load_spec("resnet50"), optimizer="adamw")  # resnet50: no AdamW recipe, AdamW's usual lr
    assert (opt.name, opt.lr, opt.weight_decay) == ("adamw", 1e-3, 1e-4) and why.endswith("(from --optimizer)")
    opt, _ = chosen(load_spec("resnet50"), model="swin_t", optimizer="sgd", lr=0.05)
    assert (opt.name, opt.lr) == ("sgd", 0.05)
    opt, _ = chosen(load_spec("resnet50"), model="swin_t", optimizer="adamw")  # the recipe's, for the same optimizer
    assert (opt.lr, opt.weight_decay, opt.reference_global_batch) == (1e-3, 0.05, 1024)


def test_a_spec_that_names_a_transformer_but_no_optimizer_gets_the_recipe_and_one_that_sets_it_keeps_it():
    bare = StudySpec.from_dict({"name": "mine", "base": {"model": {"name": "maxvit_t"}}})
    opt, why = chosen(bare)
    assert (opt.name, opt.lr) == ("adamw", 7.5e-4) and "MaxViT" in why
    own = StudySpec.from_dict({"name": "mine", "base": {"model": {"name": "maxvit_t"}, "optimizer": {"lr": 0.01}}})
    opt, why = chosen(own)
    assert (opt.name, opt.lr) == ("sgd", 0.01) and why.startswith("optimizer sgd lr 0.01 (the spec's")


def test_bad_values_are_refused_with_the_flag_named():
    with pytest.raises(AutotuneError, match=r"--lr -0\.1: must be > 0"):
        check_options(SearchOptions(lr=-0.1))
    with pytest.raises(SpecError, match=r"optimizer\.name"):
        with_command_line(load_spec("resnet50"), SearchOptions(optimizer="lamb"))
