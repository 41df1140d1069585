"""A DataLoader that hands over its batches as a real one restarted every epoch does, in real time but without
work of its own (sleeps only, so that a loaded test machine cannot change its rhythm): ``workers`` workers, all
started together at each epoch's start, each making its batches one after the other in ``batch_s`` each, at most
``prefetch`` ahead of what was taken, served in order; an epoch's start spawns them (``spawn_s``) and its end joins
them (``join_s``). ``persistent`` only says so to whoever reads ``persistent_workers``: a real loader's persistent
workers still start an epoch's batches only when it begins, and all together. A script's own PIL loader on a GPU
host behaves so: after each restart, its batches come in bursts, one batch per worker in each."""

from __future__ import annotations

import time
import warnings

import torch
from torch.utils.data import DataLoader


class BurstyLoader(DataLoader):
    def __init__(self, *, batches: int, batch_size: int = 8, workers: int = 4, batch_s: float = 0.08,
                 spawn_s: float = 0.06, join_s: float = 0.01, prefetch: int = 2, persistent: bool = False,
                 round_factors: tuple[float, ...] = (1.0,)):
        with warnings.catch_warnings():  # "more workers than cores": this loader's workers are never started
            warnings.simplefilter("ignore", UserWarning)
            super().__init__(range(batches * batch_size), batch_size=batch_size, num_workers=workers,
                             prefetch_factor=prefetch, drop_last=True, persistent_workers=persistent)
        self.batch_s, self.spawn_s, self.join_s = batch_s, spawn_s, join_s
        self.round_factors = round_factors
        """Each round's batches take ``batch_s`` times its factor, the factors cycled: rounds that vary (on 1xH200 a
        round of 16 PIL workers took 1.9-3.5 s in one run)."""
        self.starts: list[float] = []
        """When each epoch began (``iter``): consecutive ones are an epoch's real wall time."""

    def __iter__(self):
        self.starts.append(time.perf_counter())
        return _Epoch(self)


class _Epoch:
    def __init__(self, loader: BurstyLoader):
        self.loader, self.i = loader, 0
        self.spawned = time.perf_counter() + loader.spawn_s
        self.finish: list[float] = []
        self.taken: list[float] = []

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        sim, i = self.loader, self.i
        if i == len(sim):
            time.sleep(sim.join_s)
            raise StopIteration
        workers, depth = sim.num_workers, sim.num_workers * sim.prefetch_factor
        # A worker starts a batch once it finished its previous one and the batch's slot in the prefetch queue is
        # free (the batch `depth` before it was taken), never before the workers are up.
        start = max(self.spawned, self.finish[i - workers] if i >= workers else 0.0,
                    self.taken[i - depth] if i >= depth else 0.0)
        self.finish.append(start + sim.batch_s * sim.round_factors[i // workers % len(sim.round_factors)])
        wait = self.finish[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self.taken.append(time.perf_counter())
        self.i += 1
        return torch.zeros(sim.batch_size, 1)
