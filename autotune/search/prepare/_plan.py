"""What a search runs, decided before the study is opened (``Plan``), and what its data folder holds
(``DataSummary``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.hw.nvml import Gpu, Nvml
from autotune.objective import Objective
from autotune.runner.torchrun import Torchrun
from autotune.search.prepare._options import SearchOptions
from autotune.space import SearchSpace
from autotune.spec import StudySpec
from autotune.study.view import Stage
from trainer.config import TrainConfig


@dataclass(kw_only=True)
class DataSummary:
    """What a data folder holds, read before any trial (``summarize_data``)."""

    path: str
    train: int
    val: int
    classes: int
    mean_size: tuple[float, float] | None = None
    """Mean width x height of a sample of the training images."""

    def line(self) -> str:
        size = f", about {self.mean_size[0]:.0f}x{self.mean_size[1]:.0f} px" if self.mean_size else ""
        val = f" + {self.val} for validation" if self.val else ""
        return f"{self.train} training images{val} in {self.classes} classes{size} at {self.path}"


@dataclass(kw_only=True, frozen=True)
class Plan:
    """What a search runs, decided before the study is opened, and not changed after: what is only known later (the
    generated data, a script's first run) makes a new plan (``dataclasses.replace``) before the engine starts."""

    options: SearchOptions
    spec: StudySpec
    name: str
    objective: Objective
    nproc: int
    torchrun: Torchrun
    entries: list[str] | None
    """``CUDA_VISIBLE_DEVICES`` entries of the trials' GPUs; None on a machine without GPUs."""

    gpus: list[Gpu]
    nvml: Nvml
    util_reason: str | None
    """Why NVML utilization is unavailable (None: it is available)."""

    space: SearchSpace
    base: TrainConfig | None
    """The base config with its data path; None while the spec's data is still to be generated."""

    probe: TrainConfig
    """The base config, with a stand-in for data still to be generated (what the checks run on)."""

    baseline: dict[str, Any]
    starts: list[dict[str, Any]]
    data: DataSummary | None
    storage_url: str
    trials: int
    timeout_s: float | None
    trial_timeout_s: float
    notes: list[str] = field(default_factory=list)
    optimizer_line: str = ""
    """Which optimizer the trials run and why (the spec's, the model family's recipe, or the command line's)."""

    measures_ceiling: bool = True
    """The job can run its model on a synthetic batch (the built-in job can; a user's script when its loader goes
    through the runtime, which replays its first batch on the device): the stages measure the ceiling."""

    measures_supply: bool = True
    """The job's input pipeline can run alone (the built-in job's can; a user's script's when it hands its loader
    to the runtime): the stages measure each pipeline's supply. With neither, the search climbs from trial 0, then
    the sampler draws, and it says so."""

    script: Any = None
    """For a user's script: what its first run found (``autotune.search.script.Probe``); None for the built-in job
    (and for a script until then)."""

    preloaded: dict[Stage, Any] = field(default_factory=dict)
    """Runs already made for a stage's first trial, by stage (a script's probe is its baseline): (run, samples)."""

    @property
    def world(self) -> int:
        return self.nproc * self.torchrun.nnodes

    @property
    def util_available(self) -> bool:
        return self.util_reason is None

    @property
    def is_script(self) -> bool:
        return self.probe.script.given
