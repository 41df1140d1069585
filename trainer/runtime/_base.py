"""What every part of a user's script's run shares: which helper applies which setting, the two ways a run ends
early, and the markers of a value not given."""

from __future__ import annotations

from trainer.config import ConfigError
from trainer.knobs import table

# Which helper applies which setting is the knob table's (``trainer.knobs.Knob.applied_by``).
LOADER = table().applied_by("loader")
"""The settings ``Run.loader`` applies (DataLoader arguments)."""

MODEL = table().applied_by("model")
"""The settings ``Run.model`` applies (layout, the DDP wrapper, torch.compile)."""

STEP = table().applied_by("step")
"""The settings ``Run.step`` applies (autocast and the GradScaler, gradient accumulation)."""

IMAGES = table().applied_by("image_loader")
"""The settings ``Run.image_loader`` applies on top of the loader's (the input pipeline of ``trainer.data``)."""

DDP_WRAPPER = tuple(name for name in MODEL if table().by_runtime_name[name].path.startswith("ddp."))
"""The settings of ``MODEL`` that are DistributedDataParallel's arguments: each a ``trainer.config.DDPConfig``
field, by its knob's path."""

_UNSET = object()
_END = object()

SCRIPT_LOSS_HINT = ("learning rate too high for this model, optimizer and batch: the script owns its optimizer, "
                    "so lower its learning rate there (or scale it with the batch size)")


class TrialDone(SystemExit):
    """Raised by ``report()`` when a script goes on after its trial was measured: a plain script ends there (exit 0,
    the records complete); a live worker takes it as the trial's normal end."""

    def __init__(self):
        super().__init__(0)


class ScriptError(ConfigError):
    """A script that cannot be measured as written (a setting it declares and never reads, a DataLoader built with a
    fixed value the run sets, no step reported): a config failure, with the fix."""
