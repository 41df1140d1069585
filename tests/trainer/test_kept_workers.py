"""A live worker keeps a script's persistent DataLoader workers from one trial to the next where they would serve the
same data with the same settings (``trainer.runtime.kept``), in-process on a process group of one (gloo): the next
trial's batches come from the same worker processes, with its own sampler; other data, other settings, a dataset
that cannot be compared, or a run outside a live worker start workers of their own."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
import torch
from torch.utils.data import Dataset

from tests.trainer.test_runtime_idioms import group  # noqa: F401  (the process group of one)
from trainer.config import MeasureConfig
from trainer.protocol import ResultWriter
from trainer.runtime import kept, setup
from trainer.runtime.request import Active, Request, activate
from trainer.worker import leftovers


class Numbered(Dataset):
    """Items that say which process made them and which data they are: ``(pid, value + index)``."""

    def __init__(self, value: float, n: int = 8, transform=None):
        self.value, self.n, self.transform = value, n, transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(os.getpid()), self.value + i])


def trial(env, data, *, worker_trial: int | None = 1, workers: int = 1, batch_size: int = 4,
          sampler=None) -> tuple[set[int], list[float]]:
    """One trial as a live worker runs it: the script hands ``data`` to ``run.loader`` with persistent workers and
    reads one epoch. Returns the worker processes that made its batches and the values they held."""
    request = Request(mode="measure", settings={}, measure=MeasureConfig(warmup_min_steps=2))
    activate(Active(request=request, writer=ResultWriter(None, 0), env=env, worker_trial=worker_trial))
    run = setup()
    try:
        loader = run.loader(data, batch_size=batch_size, num_workers=workers, persistent_workers=True,
                            sampler=sampler)
        rows = torch.cat(list(loader))
        RESUMED.append(loader.resumed)
    finally:
        run.close()
        activate(None)
    return {int(p) for p in rows[:, 0].tolist()}, rows[:, 1].tolist()


RESUMED: list[bool] = []
"""Whether each ``trial``'s loader said it resumed kept workers (what its settings record tells the tuner)."""


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


@pytest.fixture
def no_kept():
    kept.release()
    yield
    kept.release()


def test_the_next_trial_on_the_same_data_and_settings_reads_from_the_same_workers(group, no_kept):  # noqa: F811
    baseline = set(threading.enumerate())
    first, values = trial(group, Numbered(10.0))
    assert values == [10.0 + i for i in range(8)]
    assert leftovers(baseline, grace_s=0.2) is None  # kept by the worker (processes, queue threads), not left behind
    assert first <= children()
    # A new dataset object holding the same data, another batch size and the trial's own sampler (reversed order).
    reverse = list(range(7, -1, -1))
    again, values = trial(group, Numbered(10.0), batch_size=2, sampler=reverse)
    assert again == first
    assert values == [10.0 + i for i in reverse]  # the new trial's sampler, not the kept one's
    assert RESUMED[-2:] == [False, True]  # the second trial says its workers were kept


@pytest.mark.parametrize("change", ["data", "workers", "unpicklable", "plain run"])
def test_other_data_other_settings_or_no_live_worker_start_workers_of_their_own(group, no_kept, change):  # noqa: F811
    first, _ = trial(group, Numbered(10.0))
    data = {"data": Numbered(20.0), "unpicklable": Numbered(10.0, transform=lambda x: x)}.get(change, Numbered(10.0))
    second, values = trial(group, data, workers=2 if change == "workers" else 1,
                           worker_trial=None if change == "plain run" else 2)
    assert not second & first
    assert values == [(20.0 if change == "data" else 10.0) + i for i in range(8)]  # never the kept workers' data
    assert not first & children()  # the kept workers that no longer match are gone
    assert RESUMED[-1] is False
    if change in ("unpicklable", "plain run"):
        assert not children()  # nothing to compare or no next trial: nothing kept
