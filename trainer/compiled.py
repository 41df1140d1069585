"""torch.compile for the training step, paid once per live process and graph, not once per trial.

A trial worker runs trial after trial in one process. Dynamo keys its compiled code on the code objects it traced,
guarded on the inputs' shapes and dtypes; since parameters are graph inputs (torch >= 2.5 always inlines built-in
modules), a new model of the same architecture and shapes reuses the graphs a trial before it compiled, without a
recompile (a tiny conv net's next trial compiles nothing and gives the eager loss to the last digit). So a worker keeps
Dynamo's caches while the graph a trial compiles stays the same (``graph_key``) and resets them when it changes: the
caches then hold one graph's code, never reach Dynamo's recompile limit (after 8 entries per code object it falls back
to eager, silently), and nothing a past trial compiled can decide how a later one runs. Graphs are compiled with static
shapes (``dynamic=False``): a reused worker runs the same kernels a fresh process would, whatever batch sizes earlier
trials had (automatic dynamic shapes would otherwise switch to a dynamic graph at the second batch size).

CUDA graphs (``reduce-overhead``, ``max-autotune``) hold memory pools recorded against the trial's own parameters
and buffers: those trials reset everything at their close, and the next one records again (its compile then comes
from the on-disk caches below).

On disk, Inductor's FX graph cache and AOTAutograd's cache (both on by default) keep compiled kernels across
processes: a fresh worker that compiles a graph an earlier process compiled loads it, in a fraction of the cold
compile's time (docs/benchmarks.md).
``training.compile_cache_dir`` says where; torch's default is ``/tmp/torchinductor_<user>``, shared by every process
of the user on the machine. Where the config names the folder, each compile a run pays is recorded in it
(``trainer.compile_costs``), so the tuner can price the next compile of the same graph by what it cost here.

``CompileClock`` counts compile time the way Dynamo reports it (its start/end callbacks: frames, lazily compiled
backward graphs, CUDA-graph recording), and the caches' hits and misses, so a trial's records say what its compile
cost and whether the on-disk caches served it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from trainer import compile_costs
from trainer.compile_costs import graph_key as graph_key  # re-exported: where a compiled run's graph is keyed
from trainer.config import CUDA_GRAPH_MODES, TrainConfig

_CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit", ("fxgraph_cache_miss", "fxgraph_cache_bypass")),
                   ("aot_autograd", "autograd_cache_hit", ("autograd_cache_miss", "autograd_cache_bypass")))
"""Where torch counts the on-disk caches' hits and misses (``torch._dynamo.utils.counters``): a graph the caches
could not take (a bypass) was compiled as if missed."""


class CompileClock:
    """Seconds and count of compilations in this process, from Dynamo's compile start/end callbacks (nested
    compilations count once: Dynamo runs the callbacks at the outermost level only).

    It also notes the threads a compilation starts: Inductor's compile pool and tqdm's monitor live as long as the
    process, and a worker must not take them for threads a trial left behind (``process_threads``)."""

    def __init__(self):
        self.seconds = 0.0
        self.count = 0
        self.threads: set[threading.Thread] = set()
        self._t0: float | None = None
        self._before: set[threading.Thread] = set()

    def _start(self, *_args) -> None:  # torch >= 2.6 passes the trigger and compile id; earlier, nothing
        self._t0 = time.perf_counter()
        self._before = set(threading.enumerate())

    def _end(self, *_args) -> None:
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1
            self._t0 = None
        self.threads |= set(threading.enumerate()) - self._before

    def install(self) -> None:
        """(Re)register the callbacks: ``torch._dynamo.reset()`` clears every registered callback."""
        from torch._dynamo.callback import callback_handler

        if self._start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._start)
        if self._end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._end)

    def read(self) -> tuple[float, int, int, int]:
        """(seconds, compiles, cache hits, cache misses) so far in this process."""
        from torch._dynamo.utils import counters

        hits = sum(counters[group][hit] for group, hit, _ in _CACHE_COUNTERS)
        misses = sum(counters[group][miss] for group, _, missed in _CACHE_COUNTERS for miss in missed)
        return self.seconds, self.count, hits, misses


class CompileCache:
    """This process's compiled graphs across trials (one per process: ``PROCESS``)."""

    def __init__(self):
        self.key: str | None = None
        self.cache_dir: str | None = None
        self.clock = CompileClock()

    def prepare(self, cfg: TrainConfig, key: str) -> bool:
        """Before a compiled trial builds its model: point the on-disk caches where the config says, and reset
        Dynamo's in-memory caches unless they hold this trial's graph. Returns whether they do (the trial reuses
        them)."""
        self._cache_dir(cfg.training.compile_cache_dir)
        reused = self.key == key
        if self.key is not None and not reused:
            torch._dynamo.reset()
        self.key = key
        self.clock.install()
        return reused

    def release(self, cfg: TrainConfig) -> None:
        """At a compiled trial's close: CUDA graphs are recorded against this trial's parameters and hold memory
        pools sized for them; reset everything so the next trial starts from a fresh process's state."""
        if cfg.training.compile_mode in CUDA_GRAPH_MODES:
            self.reset()

    def reset(self) -> None:
        torch._dynamo.reset()
        self.key = None

    def _cache_dir(self, path: str | None) -> None:
        if path is None or path == self.cache_dir:
            return
        os.makedirs(path, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(path)
        if self.cache_dir is not None:  # Inductor memoizes paths under the old folder
            from torch._inductor.utils import clear_caches

            clear_caches()
        self.cache_dir = path


PROCESS = CompileCache()


def process_threads() -> set[threading.Thread]:
    """Threads torch.compile started for the life of the process (its compile pool, a progress monitor)."""
    return set(PROCESS.clock.threads)


def compile_model(module: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """``torch.compile`` with the config's mode and static shapes (see the module's docstring)."""
    mode = cfg.training.compile_mode
    return torch.compile(module, mode=None if mode == "default" else mode, dynamic=False)


def compile_record(before: tuple[float, int, int, int]) -> dict[str, Any]:
    """``compile_s``, ``compiles`` and ``compile_from_caches`` (every graph compiled found in the on-disk caches)
    since ``before`` (a ``PROCESS.clock.read()``)."""
    seconds, count, hits, misses = PROCESS.clock.read()
    return {"compile_s": round(seconds - before[0], 4), "compiles": count - before[1],
            "compile_from_caches": hits > before[2] and misses == before[3]}


def record_paid(cfg: TrainConfig, key: str, compiled: dict[str, Any]) -> None:
    """Record what this run's compile cost (``compile_record``) beside the caches it compiled into, where the config
    names their folder and the run compiled at all (a graph a live worker reused cost nothing to price by)."""
    if cfg.training.compile_cache_dir is None or not compiled.get("compiles"):
        return
    compile_costs.record(cfg.training.compile_cache_dir, key, compile_costs.Paid(
        seconds=compiled["compile_s"], from_caches=compiled["compile_from_caches"], torch=torch.__version__,
        t=round(time.time(), 3)))
