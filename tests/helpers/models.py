"""Model factories that make a trial fail for real, the way a user model or a machine would.

The job builds them through ``model.name: "tests.helpers.models:NAME"`` (called as ``NAME(num_classes=N,
**model.kwargs)``); the trial's PYTHONPATH must include the repository root.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn


class Tiny(nn.Module):
    """A real conv net (conv, BN, ReLU, pool, linear) small enough that a CPU trial is dominated by its launch."""

    def __init__(self, num_classes: int, width: int = 8):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


def tiny(num_classes: int, width: int = 8) -> nn.Module:
    return Tiny(num_classes, width)


class _Explode(Tiny):
    def __init__(self, num_classes: int, rank: int | None):
        super().__init__(num_classes)
        self.rank = rank

    def forward(self, x):
        if self.rank is None or int(os.environ.get("RANK", 0)) == self.rank:
            raise RuntimeError("injected failure: this model's forward raises")
        return super().forward(x)


def explode(num_classes: int, rank: int | None = 1) -> nn.Module:
    """Forward raises on ``rank`` (all ranks when None); the other ranks then lose their peer mid-collective."""
    return _Explode(num_classes, rank)


class _Hang(Tiny):
    def forward(self, x):
        while True:  # a deadlock, as far as anyone outside can tell
            time.sleep(1)


def hang(num_classes: int) -> nn.Module:
    """Forward never returns: no window ever arrives."""
    return _Hang(num_classes)


class _MemoryLimited(Tiny):
    def __init__(self, num_classes: int, max_batch: int):
        super().__init__(num_classes)
        self.max_batch = max_batch

    def forward(self, x):
        if x.shape[0] > self.max_batch:
            # What a GPU says when a micro-batch does not fit; a CPU test cannot run out of device memory for real.
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a batch of {x.shape[0]} "
                                         f"(this model fits {self.max_batch})")
        return super().forward(x)


def memory_limited(num_classes: int, max_batch: int = 16) -> nn.Module:
    """Runs out of memory above ``max_batch`` images per rank, like a GPU at its limit."""
    return _MemoryLimited(num_classes, max_batch)


class _Sleepy(Tiny):
    def __init__(self, num_classes: int, delay_s: float):
        super().__init__(num_classes)
        self.delay_s = delay_s

    def forward(self, x):
        time.sleep(self.delay_s)  # a slow model that leaves the CPU to others (tests run several jobs on 2 cores)
        return super().forward(x)


def sleepy(num_classes: int, delay_s: float = 0.05) -> nn.Module:
    """Each forward takes at least ``delay_s``: a trial that stays mid-flight long enough to be interrupted."""
    return _Sleepy(num_classes, delay_s)


class _DieOnRank(Tiny):
    def __init__(self, num_classes: int, rank: int, after_steps: int):
        super().__init__(num_classes)
        self.rank, self.after_steps, self.steps = rank, after_steps, 0

    def forward(self, x):
        self.steps += 1
        if int(os.environ.get("RANK", 0)) == self.rank and self.steps > self.after_steps:
            os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer or a machine check does: no goodbye
        return super().forward(x)


def die_on_rank(num_classes: int, rank: int = 1, after_steps: int = 3) -> nn.Module:
    """Rank ``rank`` SIGKILLs itself after ``after_steps`` forwards; its peers are left mid-collective."""
    return _DieOnRank(num_classes, rank, after_steps)


class _BlockWhile(Tiny):
    def __init__(self, num_classes: int, flag: str):
        super().__init__(num_classes)
        self.flag = Path(flag)

    def forward(self, x):
        if self.flag.exists():
            Path(f"{self.flag}.rank{os.environ.get('RANK', 0)}").touch()  # "I am stuck": the test may act now
            while self.flag.exists():
                time.sleep(0.1)
        return super().forward(x)


def block_while(num_classes: int, flag: str) -> nn.Module:
    """Forward blocks while the file ``flag`` exists (touching ``FLAG.rankN`` first), then trains normally: a trial
    stuck mid-flight, touching nothing shared (no collective, no store), that runs fine once the flag is gone."""
    return _BlockWhile(num_classes, flag)


def broken(num_classes: int) -> nn.Module:
    """A factory that raises when called, as one whose weights file is missing does."""
    raise FileNotFoundError(f"weights-{num_classes}.pt: no such file (this factory needs its weights)")
