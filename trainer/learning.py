"""Does a run learn? The check of a measured run's loss, and the optimizer recipes that make a model learn.

A run that does not learn is not fast: its images/s describe no training anyone would keep. ``check_loss`` judges
the loss figures of a run's measurement windows (the built-in job and a user's-script runtime call the same
function, on plain numbers); ``RECIPES`` holds, for the model families whose reference recipe is not SGD at lr 0.1,
an optimizer that trains them, so a search by model name starts from one.

This module imports nothing heavy: the tuner reads the recipes without torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

RISE_LIMIT = 1.5
"""A run whose loss at the end of its windows is this many times the loss at their start, or more, does not learn.

Why 1.5: the window losses of runs that train wobble up from one window to the next by far less than half and end
only a little above their lowest figure, while a run that diverges rises by orders of magnitude (docs/benchmarks.md).
1.5 sits well above the largest honest wobble above the start, and below a doubling, which must void. On the CPU
(2 gloo ranks, resnet18 at 32 px, batch 4, one step per window) single-step losses scatter much more; the test configs
train at a learning rate that keeps them below this limit."""


class LossCheck(NamedTuple):
    ok: bool
    """The figure stands: the loss stayed finite and did not rise."""

    reason: str | None
    """Why it does not, in words (None when it does)."""


DEFAULT_HINT = ("learning rate too high for this model and optimizer; set it with `--lr` / `--optimizer` "
                "(optimizer.lr / optimizer.name in a spec or config)")


def check_loss(losses: Sequence[float | None], *, nonfinite_steps: int = 0, diverged_steps: int = 0,
               hint: str = DEFAULT_HINT) -> LossCheck:
    """Whether a run's measured figure stands, judged on its loss; pure, on plain numbers.

    ``losses``: the loss figures of the measurement windows in order: the first window's ``loss_start``, then every
    window's ``loss_end`` (``window_losses`` builds it from the windows; ``None`` entries, no model, are skipped).
    ``nonfinite_steps``: steps with a NaN/inf loss inside the windows the figure stands on. ``diverged_steps``: the
    run ended with this many non-finite step losses in a row (0: it did not diverge). The built-in job counts both on
    the device (``trainer.records``); a runtime passes the sum of its windows' ``loss_nonfinite`` and 0.

    The figure is void when (1) the run diverged, (2) any step of the windows had a non-finite loss, or (3) the loss
    rose: the lower of the last two figures is ``RISE_LIMIT`` times the first or more. Each figure is one step's loss
    (the mean over the ranks), so one unlucky batch at the very end is not a trend: it takes the last two. The start
    is the reference because it is the scale the run began its windows at; a low point in between is one batch's
    luck as often as progress. A run that entered its windows in a loss spike (SGD without warm-up: ResNet-50 trials
    start their windows at 14-35 and settle at 4.6) and ends below the spike stands, whatever it did in between.
    Losses that start at or below zero (a user's loss need not be positive) are judged on (1) and (2) alone.
    """
    if diverged_steps:
        return LossCheck(False, f"loss NaN/inf for the last {diverged_steps} steps")
    if nonfinite_steps:
        return LossCheck(False, f"loss NaN/inf in {nonfinite_steps} step(s) of the measured windows")
    # A non-finite figure outside the counted windows is one overflowed fp16 step the GradScaler skipped (the weights
    # stayed finite): (1) and (2) judge non-finite losses; the rise is judged on the finite figures.
    figures = [float(x) for x in losses if x is not None and math.isfinite(x)]
    if len(figures) < 2 or figures[0] <= 0:
        return LossCheck(True, None)
    start = figures[0]
    end = min(figures[-2:]) if len(figures) > 2 else figures[-1]
    if end >= RISE_LIMIT * start:
        return LossCheck(False, f"loss rose from {start:.3g} to {end:.3g}: {hint}")
    return LossCheck(True, None)


def window_losses(windows: Iterable[Mapping[str, Any] | Any]) -> list[float | None]:
    """The loss figures of ``windows`` for ``check_loss``: the first one's ``loss_start``, then each one's
    ``loss_end``. A window is a ``window`` record (a mapping) or an object with those attributes (the meter's)."""
    out: list[float | None] = []
    for i, w in enumerate(windows):
        get = w.get if isinstance(w, Mapping) else lambda k, w=w: getattr(w, k, None)
        if i == 0:
            out.append(get("loss_start"))
        out.append(get("loss_end"))
    return out


# ---- optimizer recipes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Recipe:
    family: str
    prefixes: tuple[str, ...]
    """torchvision model names it covers (``name.startswith``)."""

    exclude: tuple[str, ...] = ()
    """Names it does not cover although a prefix matches (``vgg16_bn`` has BatchNorm: the default recipe)."""

    optimizer: dict[str, Any]
    """``optimizer`` settings of the TrainConfig (name, lr, weight_decay, reference_global_batch)."""

    source: str
    """Where the figures come from."""

    def describe(self) -> str:
        o = self.optimizer
        return (f"{o['name']} lr {o['lr']:g}, weight decay {o['weight_decay']:g} (for a global batch of "
                f"{o['reference_global_batch']}): {self.source}")


_TV = "torchvision's reference recipe (references/classification)"
_ADAMW_SCALED = ("scaled linearly to a global batch of 1,024 (the trials' batches lie around it; trials run without "
                 "the recipe's warm-up, so its lower end)")

RECIPES: tuple[Recipe, ...] = (
    Recipe(family="ConvNeXt", prefixes=("convnext_",),
           optimizer={"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, "reference_global_batch": 1024},
           source=f"{_TV} for ConvNeXt: AdamW 1e-3 at 8 x 128 images, weight decay 0.05"),
    Recipe(family="Swin", prefixes=("swin_",),
           optimizer={"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, "reference_global_batch": 1024},
           source=f"{_TV} for Swin and Swin V2: AdamW 1e-3 at 8 x 128 images, weight decay 0.05"),
    Recipe(family="MaxViT", prefixes=("maxvit_",),
           optimizer={"name": "adamw", "lr": 7.5e-4, "weight_decay": 0.05, "reference_global_batch": 1024},
           source=f"{_TV} for MaxViT: AdamW 3e-3 at 32 x 128 images, weight decay 0.05, {_ADAMW_SCALED}"),
    Recipe(family="ViT", prefixes=("vit_",),
           optimizer={"name": "adamw", "lr": 7.5e-4, "weight_decay": 0.05, "reference_global_batch": 1024},
           source=f"{_TV} for ViT: AdamW 3e-3 at 8 x 512 images, {_ADAMW_SCALED}; weight decay 0.05 as for the "
                  "other transformers (the recipe's 0.3 goes with its 300 epochs of heavy augmentation)"),
    Recipe(family="AlexNet/VGG without BatchNorm", prefixes=("alexnet", "vgg"),
           exclude=("vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn"),
           optimizer={"name": "sgd", "lr": 0.01, "weight_decay": 1e-4, "reference_global_batch": 256},
           source=f"{_TV} for AlexNet and VGG: lr 0.1 is too high without BatchNorm, 0.01 at 8 x 32 images"),
    Recipe(family="MobileNetV2", prefixes=("mobilenet_v2",),
           optimizer={"name": "sgd", "lr": 0.045, "weight_decay": 4e-5, "reference_global_batch": 256},
           source=f"{_TV} for MobileNetV2: SGD 0.045 at 8 x 32 images, weight decay 4e-5"),
)
"""The families whose reference recipe is not SGD at lr 0.1 per 256 images (ResNet, ResNeXt, Wide ResNet, RegNet,
EfficientNet and the rest train with it or near it: the default). MobileNetV3's recipe is RMSprop, which the job
does not offer: it keeps the default, and the loss check says when that does not train."""

DEFAULT_RECIPE = Recipe(family="default", prefixes=(),
                        optimizer={"name": "sgd", "lr": 0.1, "weight_decay": 1e-4, "reference_global_batch": 256},
                        source=f"{_TV} for ResNet and most torchvision classifiers: SGD 0.1 at 8 x 32 images")

DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}
"""The learning rate for an optimizer named without one (``--optimizer`` alone) on a model no recipe covers."""


def recipe_for(model: str) -> Recipe | None:
    """The recipe for a torchvision model name; None: no recipe of its own (the default applies: SGD 0.1 per 256),
    or a factory (``package.module:function``), whose optimizer the job cannot guess."""
    if ":" in model:
        return None
    for r in RECIPES:
        if model.startswith(r.prefixes) and model not in r.exclude:
            return r
    return None
