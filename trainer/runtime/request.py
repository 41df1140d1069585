"""What a run asks of a user's script: the settings it sets, the mode, and where the records go.

The tuner writes a request as a JSON file and names it in ``AUTOTUNE_RUNTIME`` (a trial in a fresh process, a full
run of ``autotune train``); a live worker hands its entry function the request in-process (``activate``); an
exported config named in ``AUTOTUNE_CONFIG`` runs the script with the tuned settings and nothing else. With none of
them the script runs as it always did: its own defaults, no measurement (mode ``plain``). This module is also the
process's memory of the run in progress (``active``, ``last_run``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.config import MeasureConfig, TrainConfig
from trainer.knobs import table

ENV_REQUEST = "AUTOTUNE_RUNTIME"
"""A JSON request file (``Request.to_json``): what the tuner launches a script with."""

ENV_CONFIG = "AUTOTUNE_CONFIG"
"""An exported config (``autotune export``): the script runs with its settings, unmeasured."""

Mode = Literal["plain", "measure", "train", "supply", "ceiling"]


@dataclass(kw_only=True)
class Request:
    mode: Mode = "plain"
    """``plain``: no measurement; ``measure``: a search trial (windows until its figure is known, then the script is
    told to stop); ``train``: a full run (windows over the whole run); ``supply``: the script's loader alone, no model;
    ``ceiling``: the script's first batch replayed on the device (the compute alone)."""

    settings: dict[str, Any] = field(default_factory=dict)
    """Values by runtime name (``trainer.knobs``) that this run sets; every other setting keeps the script's
    default."""

    measure: MeasureConfig = field(default_factory=MeasureConfig)
    result: str | None = None
    """The JSON-lines file the records go to (rank 0; any rank for its own error)."""

    cancel: str | None = None
    """A file whose existence ends the measurement at the next window (a pruned trial)."""

    log_every_s: float = 10.0
    """Train mode: seconds between progress records."""

    @property
    def measured(self) -> bool:
        return self.mode != "plain"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Request:
        data = json.loads(text)
        data["measure"] = MeasureConfig(**data.get("measure") or {})
        return cls(**data)

    @classmethod
    def from_config(cls, cfg: TrainConfig, *, result: str | None = None, cancel: str | None = None) -> Request:
        """The request of a TrainConfig of a script job: the settings the script applies (``script.applies``)
        taken from the config, the mode from ``training.mode`` (``loader``: supply) and ``data.kind``
        (``synthetic``: the ceiling)."""
        names = table().by_runtime_name
        settings = {name: _get(cfg, names[name].path) for name in cfg.script.applies}
        t = cfg.training
        mode: Mode = ("supply" if t.supply else "ceiling" if cfg.data.kind == "synthetic" else t.mode)
        if result is None and t.mode == "train":
            mode = "plain"  # an exported config run by hand: the tuned settings, no records to write
        return cls(mode=mode, settings=settings, measure=cfg.measure, result=result, cancel=cancel,
                   log_every_s=t.log_every_s)


def _get(cfg: TrainConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@dataclass(kw_only=True)
class Active:
    """What a live worker hands the entry function's run in-process: the request, the trial's record stream and
    the process's distributed environment (the worker started the process group)."""

    request: Request
    writer: Any
    """The trial's ``trainer.protocol.ResultWriter``."""

    env: Any
    """The worker's ``trainer.records.Dist``."""

    worker_trial: int | None = None


_ACTIVE: Active | None = None
_RUN: Any = None


def activate(active: Active | None) -> None:
    """What the next ``setup()`` in this process gets (a live worker, before calling its entry function); ``None``
    after the trial."""
    global _ACTIVE, _RUN
    _ACTIVE, _RUN = active, None


def active() -> Active | None:
    return _ACTIVE


def worker_trial() -> int | None:
    return _ACTIVE.worker_trial if _ACTIVE is not None else None


def set_run(run: Any) -> None:
    global _RUN
    _RUN = run


def last_run() -> Any:
    """The ``Run`` the script made last in this process (None before ``setup()``)."""
    return _RUN


def current() -> Request:
    """The run's request: ``AUTOTUNE_RUNTIME``, else ``AUTOTUNE_CONFIG``, else plain (a live worker's is in
    ``active()``)."""
    path = os.environ.get(ENV_REQUEST)
    if path:
        return Request.from_json(Path(path).read_text())
    config = os.environ.get(ENV_CONFIG)
    if config:
        return Request.from_config(TrainConfig.from_yaml(config))
    return Request()
