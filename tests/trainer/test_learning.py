"""The loss check on constructed window sequences, and the optimizer recipes by model family."""

from __future__ import annotations

import itertools

import pytest

from trainer.config import TrainConfig
from trainer.learning import RECIPES, RISE_LIMIT, check_loss, recipe_for, window_losses

NAN, INF = float("nan"), float("inf")


def windows(*figures):
    """Window records whose losses chain as the meter's do: each one starts where the one before ended."""
    return [{"loss_start": a, "loss_end": b, "loss_nonfinite": 0} for a, b in itertools.pairwise(figures)]


def test_window_losses_are_the_first_start_then_every_end_for_records_and_objects():
    recs = windows(4.7, 4.6, 4.5)
    assert window_losses(recs) == [4.7, 4.6, 4.5]

    class W:
        def __init__(self, start, end):
            self.loss_start, self.loss_end = start, end

    assert window_losses([W(2.0, 1.0), W(1.0, 0.5)]) == [2.0, 1.0, 0.5]
    assert window_losses([]) == []


@pytest.mark.parametrize("figures", [
    [4.61, 4.60, 4.69, 4.53, 4.55, 4.59, 4.46, 4.47],  # a healthy run, noisy single-step losses (GPU trial 0)
    [6.24, 7.27, 6.05, 4.89],  # the largest honest wobble measured: +16.5 % in one window, then down
    [4.65, 4.60, 4.60, 4.80],  # a slow rise at the end within the noise (+3 % over the start)
    [23.05, 17.55, 7.31, 6.64, 4.66],  # windows entered in the loss spike of SGD without warm-up, settling
    [1.10, 1.00, 1.20, 1.08, 0.79, 1.62, 1.19, 1.50, 1.15],  # CPU, batch 4: one bad batch at the very end
])
def test_runs_that_learn_or_wobble_within_noise_stand(figures):
    assert check_loss(figures) == (True, None)


@pytest.mark.parametrize("figures, start, end", [
    ([4.7, 6.9, 30.0, 80.0, 162.0], "4.7", "80"),  # the measured failure: 4.7 -> 162 over the windows
    ([4.6, 5.3, 7.0, 9.2], "4.6", "7"),  # a doubling (the lower of the last two is already 1.5x)
    ([4.6, 4.6, 9.2, 9.3], "4.6", "9.2"),
    ([2.0, 2.2, 3.0, 3.1], "2", "3"),  # a steady rise of half
])
def test_a_loss_that_rises_or_explodes_voids_the_figure_with_its_cause(figures, start, end):
    ok, reason = check_loss(figures)
    assert not ok
    assert reason.startswith(f"loss rose from {start} to {end}: learning rate too high for this model and optimizer")
    assert "--lr" in reason and "--optimizer" in reason


def test_the_limit_is_the_lower_of_the_last_two_against_the_start():
    assert check_loss([2.0, 2.0, RISE_LIMIT * 2.0 - 0.01, 9.0]).ok  # one figure at 4.5x is one batch
    assert not check_loss([2.0, 2.0, RISE_LIMIT * 2.0, 9.0]).ok
    assert not check_loss([2.0, 3.0]).ok  # one window: its end is all there is
    assert check_loss([2.0]).ok and check_loss([]).ok


def test_nan_and_divergence_void_the_figure_and_a_skipped_overflow_outside_the_windows_does_not():
    assert check_loss([4.6, 4.5], nonfinite_steps=3) == (False, "loss NaN/inf in 3 step(s) of the measured windows")
    assert check_loss([4.6, NAN, NAN], diverged_steps=7) == (False, "loss NaN/inf for the last 7 steps")
    # An fp16 step the GradScaler skipped, counted in a warm-up window: not counted, and no rise either.
    assert check_loss([4.6, INF, 4.4, 4.3]).ok
    assert check_loss([4.6, NAN, 9.5, 9.4]).reason.startswith("loss rose from 4.6 to 9.4")


def test_no_loss_or_a_loss_that_is_not_positive_is_judged_on_nan_alone():
    assert check_loss([None, None, None]).ok  # loader mode: no model
    assert check_loss([-3.0, -1.0, 2.0]).ok  # a user's loss may be negative: a ratio means nothing there
    assert check_loss([0.0, 1.0, 1.0]).ok


def test_a_runtime_can_name_its_own_fix():
    ok, reason = check_loss([1.0, 3.0, 3.0], hint="lower LR in train.py")
    assert not ok and reason == "loss rose from 1 to 3: lower LR in train.py"


@pytest.mark.parametrize("model, family, name", [
    ("vit_b_16", "ViT", "adamw"), ("swin_v2_t", "Swin", "adamw"), ("maxvit_t", "MaxViT", "adamw"),
    ("convnext_tiny", "ConvNeXt", "adamw"), ("vgg16", "AlexNet/VGG without BatchNorm", "sgd"),
    ("alexnet", "AlexNet/VGG without BatchNorm", "sgd"), ("mobilenet_v2", "MobileNetV2", "sgd"),
])
def test_families_whose_recipe_is_not_sgd_at_0_1_get_theirs(model, family, name):
    r = recipe_for(model)
    assert r is not None and r.family == family and r.optimizer["name"] == name


@pytest.mark.parametrize("model", ["resnet50", "vgg16_bn", "regnet_y_400mf", "efficientnet_b0", "mobilenet_v3_small",
                                   "mypkg.models:build"])
def test_the_rest_keep_the_default(model):
    assert recipe_for(model) is None


def test_every_recipe_is_a_valid_optimizer_section_and_names_real_models():
    import torchvision.models as tvm

    models = tvm.list_models(module=tvm)
    for r in RECIPES:
        TrainConfig.from_dict({"optimizer": r.optimizer})  # raises on a bad field or value
        assert any(recipe_for(m) is r for m in models), r.family  # a prefix that matches nothing is a typo
        assert r.source and r.describe().startswith(r.optimizer["name"])
