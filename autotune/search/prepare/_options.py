"""``autotune search``'s options, and the mistakes in them that no spec or machine is needed to see."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.exceptions import AutotuneError
from autotune.study.liveness import HEARTBEAT_S


@dataclass(kw_only=True)
class SearchOptions:
    """``autotune search``'s options; every field ``None`` means: the spec's (or the machine's) default."""

    spec: str | None = None
    """A spec YAML path or a built-in name; default: resnet50 when GPUs are visible, else cpu-demo."""

    model: str | None = None
    """Tune this model instead of the spec's: a torchvision classifier name or ``package.module:factory``."""

    data: str | None = None
    """Use this ImageFolder instead of the spec's data."""

    image_size: int | None = None
    optimizer: str | None = None
    """``sgd`` or ``adamw`` instead of the spec's (or the model family's recipe, ``trainer.learning.RECIPES``)."""

    lr: float | None = None
    """The learning rate every trial runs at (for trial 0's global batch; export rescales it to the tuned one)."""

    trials: int | None = None
    timeout_s: float | None = None
    trial_timeout_s: float | None = None
    storage: str | None = None
    study: str | None = None
    nproc: int | None = None
    gpus: str | None = None
    objective: str | None = None
    seed: int | None = None
    stale_after_s: float | None = None
    script: str | None = None
    """Tune this training script instead of the built-in job: ``train.py`` (a fresh torchrun per trial) or
    ``train.py:main`` / ``package.module:main`` (a function, trial after trial in one live worker)."""

    script_args: list[str] = field(default_factory=list)
    """The script's own command-line arguments."""


def check_options(o: SearchOptions) -> None:
    if o.script and (o.model or o.data or o.image_size or o.optimizer or o.lr):
        given = next(f for f, v in (("--model", o.model), ("--data", o.data),
                                    ("--image-size", o.image_size), ("--optimizer", o.optimizer), ("--lr", o.lr))
                     if v)
        raise AutotuneError(f"--script with {given}: the script builds its own model, optimizer and data; pass "
                            "its arguments after `--` (autotune search --script train.py -- --data DIR)")
    if o.script_args and not o.script:
        raise AutotuneError(f"arguments after `--` ({' '.join(o.script_args)}) are a script's: give --script too")
    for flag, value in (("--trials", o.trials), ("--timeout", o.timeout_s), ("--trial-timeout", o.trial_timeout_s),
                        ("--stale-after", o.stale_after_s), ("--image-size", o.image_size), ("--lr", o.lr)):
        if value is not None and value <= 0:
            raise AutotuneError(f"{flag} {value:g}: must be > 0")
    if o.stale_after_s is not None and o.stale_after_s < 3 * HEARTBEAT_S:
        raise AutotuneError(f"--stale-after {o.stale_after_s:g}: must be >= {3 * HEARTBEAT_S:g} s (three "
                            "heartbeats), or a live trial on another machine could be taken for stale")
