"""Checkpoints: rank 0 writes atomically; every rank can resume from the newest complete one.

Atomic means a crash (or a full disk) at any moment leaves the previous checkpoint intact: the state goes to a
temporary file in the same folder, is fsynced, then renamed over the final name (rename is atomic within one file
system), and the folder is fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


def checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"ckpt-{step:09d}.pt"


def list_checkpoints(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name))


def save_checkpoint(folder: str | Path, step: int, state: dict[str, Any], *, keep_last: int) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, step)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    for old in list_checkpoints(folder)[:-keep_last]:
        old.unlink(missing_ok=True)
    return final


def load_latest(folder: str | Path, map_location) -> tuple[Path, dict[str, Any]] | None:
    ckpts = list_checkpoints(folder)
    if not ckpts:
        return None
    # weights_only=False: the state holds optimizer/scheduler dicts and RNG states written by this same job.
    return ckpts[-1], torch.load(ckpts[-1], map_location=map_location, weights_only=False)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
