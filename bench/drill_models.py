"""Model factories for bench/drill.py: the tests' failures (tests/helpers/models.py: a rank SIGKILLed, a forward
that never returns, on the tests' Tiny net), aimed at the last rank of whatever world the drill runs in and timed to
strike inside the measurement windows, so that on N GPUs the other ranks are left inside a real NCCL collective.

The job builds them through ``model.name: "bench.drill_models:NAME"`` (the repository root on the trial's
PYTHONPATH). Imports torch and the tests' helpers only, never the tuner. Outside torchrun (the search calls a factory
once on the CPU before its first trial) nothing is injected.
"""

from __future__ import annotations

import os
import signal
import time

from torch import nn

from tests.helpers.models import Tiny


def _last_rank() -> int | None:
    """The last rank of this job's world; None outside torchrun."""
    if "RANK" not in os.environ:
        return None
    return int(os.environ.get("WORLD_SIZE", 1)) - 1


class _OnLastRank(Tiny):
    """Trains normally until ``after_s`` seconds after its first forward (inside the measurement windows of a tiny
    trial), then ``fail()`` on the last rank."""

    def __init__(self, num_classes: int, after_s: float):
        super().__init__(num_classes)
        self.rank, self.after_s, self.t0 = _last_rank(), after_s, None

    def forward(self, x):
        self.t0 = self.t0 or time.monotonic()
        if self.rank is not None and int(os.environ["RANK"]) == self.rank and time.monotonic() - self.t0 > self.after_s:
            self.fail()
        return super().forward(x)


class _Kill(_OnLastRank):
    def fail(self):
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer or a machine check does: no goodbye


class _Hang(_OnLastRank):
    def fail(self):
        while True:  # a deadlock, as far as anyone outside can tell; the peers wait in the gradient all-reduce
            time.sleep(1)


def kill_last_rank(num_classes: int, after_s: float = 2.0) -> nn.Module:
    """The last rank SIGKILLs itself ``after_s`` seconds into training (as the tests' ``die_on_rank`` does after
    some steps); its peers are left mid-collective."""
    return _Kill(num_classes, after_s)


def hang_last_rank(num_classes: int, after_s: float = 2.0) -> nn.Module:
    """The last rank's forward never returns from ``after_s`` seconds into training: its peers block in DDP's
    all-reduce (an NCCL kernel on a GPU) and no further window arrives."""
    return _Hang(num_classes, after_s)
