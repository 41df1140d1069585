"""Where a search's compiles go on this machine, and what a compile of a given graph has cost here.

Every compiled trial of every search on the machine, and the export's re-measure and ``autotune train`` of what they
found (their configs name the same folder), compile into one folder of the autotune cache, beside the data cache:
what one search compiled, the next loads from Inductor's and AOTAutograd's on-disk caches in seconds instead of a
minute, and the job's records there (``trainer.compile_costs``) say what it cost, so the stages can price it.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from trainer.compile_costs import Paid, graph_key, read
from trainer.config import TrainConfig


def cache_root() -> Path:
    """The autotune cache folder: ``$AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME/ddp-autotune`` (``~/.cache``)."""
    if os.environ.get("AUTOTUNE_CACHE"):
        return Path(os.environ["AUTOTUNE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "ddp-autotune"


def compile_cache(cfg: TrainConfig) -> Path:
    """The folder a run of ``cfg`` compiles into: its ``training.compile_cache_dir``, else the machine's."""
    return Path(cfg.training.compile_cache_dir) if cfg.training.compile_cache_dir else cache_root() / "compile"


def paid_here(cfg: TrainConfig, classes: int | None, world_size: int) -> list[Paid]:
    """What compiling ``cfg``'s graph has cost on this machine, under the torch installed here (``classes``: the
    data folder's, for a config that does not set its head)."""
    if cfg.data.num_classes is not None:
        classes = cfg.data.num_classes
    elif cfg.data.kind == "synthetic":
        classes = 1000  # as the job sizes a synthetic run's head (trainer.data.num_classes)
    if classes is None:
        return []
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    return read(compile_cache(cfg), graph_key(cfg, classes, world_size), torch=torch)
