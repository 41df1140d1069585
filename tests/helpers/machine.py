"""A simulated machine behind a stand-in worker pool, for searches run on a constructed study.

The search's own engine, stage planner, evaluator (its checks, fresh-worker rules, the live Watch and its pruner
calls) and recording step run unchanged on an in-memory Optuna study; only the trial's run is simulated: ``FakePool``
answers ``WorkerPool.run`` with the records a job would stream (start, ready, first step, warm-up, windows, summary
or error), computed by ``Machine`` from the trial's config. The measurement is the job's own: the real meter
(``trainer.meter``) on a clock of simulated seconds, fed steps at the machine's pace, so its windows, estimates,
intervals and stops are the protocol's. A cancel (the Watch returning True) ends the run at its next window with a
summary, as a live worker does.

A compiled run compiles where its worker has not compiled its graph (``trainer.compiled.graph_key``), from the
machine's on-disk caches where an earlier run of the machine compiled it, and records what it paid in its compile
cache folder as the job does (``trainer.compile_costs``). With a ``SimClock``, each run advances the search's clock
by the seconds it would take, so time budgets are spent as on a machine.

The figures a machine is built with are inputs of a test, not measurements of anything.
"""

from __future__ import annotations

import functools
import random
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.hw.nvml import Nvml
from autotune.objective import Objective
from autotune.runner.torchrun import Torchrun
from autotune.runner.trial import Stopped, TrialRun
from autotune.search.prepare import DataSummary, Plan, SearchOptions
from autotune.space import resolve
from autotune.spec import StudySpec
from tests.helpers.traces import Clock
from trainer.compile_costs import Paid, graph_key, record
from trainer.config import TrainConfig
from trainer.meter import ThroughputMeter

FOLDER_CLASSES = 10
"""Classes of the constructed plans' data folder (which need not exist)."""


@dataclass(kw_only=True)
class Machine:
    ceilings: dict[tuple[str, bool], float]
    """imgs/s of the model alone per (precision, channels_last), cuDNN's search on, at a batch >= ``plateau``."""

    supplies: dict[str, float] = field(default_factory=dict)
    """imgs/s each decode path feeds at the most loader workers (hybrid: from its ends)."""

    plateau: int = 128
    small_batch: float = 0.6
    """The pace below ``plateau`` images per step, as a share of the pace at it."""

    cudnn_gain: float = 1.0
    """The pace with cuDNN's plans found by its search over the pace with the heuristics' plans."""

    noisy: dict[str, float] = field(default_factory=dict)
    """Decode paths whose pace swings by this share (the standard deviation of each half second's pace): their
    intervals narrow slowly."""

    diverges: set[str] = field(default_factory=set)
    """Precisions whose end-to-end loss leaves the finite numbers (synthetic data trains fine)."""

    max_batch: int | None = None
    """Larger micro-batches run out of memory."""

    oom_decodes: set[str] = field(default_factory=set)
    """Decode paths whose end-to-end runs run out of memory at every batch (their buffers beside the model's)."""

    interrupt: set[str] = field(default_factory=set)
    """Kinds of run (``loader``, ``synthetic``, ``e2e``) that raise KeyboardInterrupt at their first window, once."""

    e2e_share: float = 0.95
    """An end-to-end run's pace as a share of min(compute, supply)."""

    e2e_share_at: dict[tuple[str, bool], float] = field(default_factory=dict)
    """``e2e_share`` for some (precision, channels_last): a layout the model alone runs as fast as another may run
    slower end to end (the inputs' conversion)."""

    max_workers: int = 8

    contend_past: int | None = None
    """End to end, loader workers past this count contend with the rank's own processes for cores: each one more
    costs ``contention`` of the pace (the pipeline alone, with no model beside it, is not slowed)."""

    contention: float = 0.1

    luck: dict[str, list[float]] = field(default_factory=dict)
    """Per decode path, the pace of its successive end-to-end runs as multiples of their steady pace (1.0 once the
    list is spent): one run's luck, which a run again does not repeat."""

    compile_gain: float = 1.0
    """The pace compiled over the pace eager, at every precision and layout."""

    compile_s: float = 0.0
    """Seconds a compile takes: a compiled run's first step in a worker that has not compiled its graph."""

    cached_compile_s: float | None = None
    """Seconds that compile takes where the on-disk caches hold its graph (``on_disk``); None: ``compile_s``."""

    on_disk: set[str] = field(default_factory=set)
    """The graphs (``graph_key``) the machine's on-disk compile caches hold: every graph a run of it compiled."""

    run_s: float = 0.0
    """Seconds a run takes besides its windows and its compile on a live worker (set-up, first step, warm-up): what
    it advances a ``SimClock`` by."""

    fresh_s: float = 0.0
    """Seconds more a run in a fresh worker takes (torchrun, import torch, the CUDA context)."""

    decode_busy: dict[str, float] = field(default_factory=dict)
    """Decode paths that decode on the GPUs: the share of the time the GPUs are busy while the path feeds alone.
    End to end such a path and the model share the GPUs: per sample, the model's time plus the decode's."""

    loss: float | None = None
    """Every step's loss, one figure throughout (a run that learns nothing: one class in its data); None: the
    windows carry no loss, and a run's summary says it fell."""

    model_busy: float = 0.98
    """The share of the time the GPUs are busy while the model alone runs (below 0.6: the host's kernel launches
    bound it)."""

    profile: dict[str, float] | None = None
    """What a profiled run (``measure.profile_steps``) splits its step into (``trainer.profile.PARTS``); None: its
    wait for data (``data_wait``), the GPUs busy with the model at its pace's share of the model alone's, and the rest
    the host's launch gaps (a rank's own process slowed by the loader's workers crowding its cores)."""

    def step_split(self, cfg, searched: bool) -> dict[str, float] | None:
        """A run's profile of its step, where its config asks for one."""
        if not cfg.measure.profile_steps or self.kind(cfg) == "loader":
            return None
        busy = min(1.0, self.pace(cfg, searched) / self.compute(cfg, searched))
        wait = min(self.data_wait(cfg, searched) or 0.0, 1.0 - busy)
        split = self.profile or {"data": wait, "copy": 0.0, "compute": busy, "optimizer": 0.0, "communication": 0.0,
                                 "launch": 1.0 - busy - wait}
        return {**split, "steps": cfg.measure.profile_steps, "seconds": 1.0, "rank": 0}

    def compute(self, cfg, searched: bool) -> float:
        t = cfg.training
        ips = self.ceilings[(t.precision, t.channels_last)] * (self.compile_gain if t.compile else 1.0)
        if t.batch_size * t.accum_steps < self.plateau:
            ips *= self.small_batch
        return ips if searched else ips / self.cudnn_gain

    def supply(self, cfg) -> float:
        d = cfg.data.decode
        if d == "hybrid":
            f = cfg.data.hybrid_cpu_fraction
            ips = 1.0 / max(f / self.supplies["torchvision-cpu"], (1 - f) / self.supplies["nvjpeg-gpu"])
        else:
            ips = self.supplies[d]
        return ips * min(1.0, max(1, cfg.loader.num_workers) / self.max_workers)

    def kind(self, cfg) -> str:
        return "loader" if cfg.training.mode == "loader" else "synthetic" if cfg.data.kind == "synthetic" else "e2e"

    def pace(self, cfg, searched: bool) -> float:
        kind = self.kind(cfg)
        if kind == "loader":
            return self.supply(cfg)
        if kind == "synthetic":
            return self.compute(cfg, searched)
        share = self.e2e_share_at.get((cfg.training.precision, cfg.training.channels_last), self.e2e_share)
        compute, supply = self.compute(cfg, searched), self.supply(cfg)
        device_s = self.device_s(cfg)
        crowded = max(0, cfg.loader.num_workers - self.contend_past) if self.contend_past is not None else 0
        return share * min(supply, 1.0 / (1.0 / compute + device_s)) * max(0.2, 1.0 - self.contention * crowded)

    def data_wait(self, cfg, searched: bool) -> float | None:
        """The share of a run's time its steps wait for data: end to end, what the pipeline feeds short of what the
        model (and a decode on the GPUs beside it) would take; a run on synthetic data waits for none; the loader
        alone times no wait (None)."""
        kind = self.kind(cfg)
        if kind == "loader":
            return None
        if kind == "synthetic":
            return 0.0
        takes = 1.0 / (1.0 / self.compute(cfg, searched) + self.device_s(cfg))
        return max(0.0, 1.0 - self.supply(cfg) / takes)

    def device_s(self, cfg) -> float:
        """Seconds of the GPUs' time each sample's decode takes (the hybrid: its GPU share's)."""
        d = cfg.data.decode
        if d == "hybrid" and "nvjpeg-gpu" in self.decode_busy:
            return (1 - cfg.data.hybrid_cpu_fraction) * self.decode_busy["nvjpeg-gpu"] / self.supplies["nvjpeg-gpu"]
        return self.decode_busy.get(d, 0.0) / self.supply(cfg) if d in self.decode_busy else 0.0

    def busy(self, cfg) -> float | None:
        """NVML's utilization (%) of a run of ``cfg``, as ``autotune.hw.nvml.summarize`` would give it (``util_of``)."""
        kind = self.kind(cfg)
        if kind == "synthetic":
            return 100.0 * self.model_busy
        if kind == "loader":
            return 100.0 * self.decode_busy.get(cfg.data.decode, 0.02)
        return 100.0 * min(1.0, self.model_busy + self.decode_busy.get(cfg.data.decode, 0.0))

    def swing(self, cfg) -> float:
        """The share each half second's pace swings by: a noisy pipeline's, else a steady machine's little."""
        swing = self.noisy.get(cfg.data.decode, 0.0) if self.kind(cfg) != "synthetic" else 0.0
        return swing or STEADY_SWING


STEADY_SWING = 0.005
"""How much a steady run's pace varies from one half second to the next."""

RAMP_S = 1.0
"""A run's first seconds, at a fifth below its pace (a loader filling its queue, caches warming)."""


def util_of(pool: FakePool):
    """A stand-in for ``autotune.hw.nvml.summarize`` (``monkeypatch``-ed into ``autotune.search.evaluate``, with the
    plan's ``util_available`` set): the GPUs' utilization of the pool's latest run, as its machine says."""
    def summarize(samples, windows, n):
        return {"util_available": True, "util_mean": pool.machine.busy(pool.runs[-1]["config"])}

    return summarize


class FakeWorker:
    def __init__(self, name: str):
        self.name, self.plans = name, {}
        """cuDNN's plan cache of this worker: shape -> whether its search found them (keyed without the flag)."""
        self.graphs: set[str] = set()
        """The graphs this worker compiled (``trainer.compiled.graph_key``)."""

    def alive(self) -> bool:
        return True


class FakePool:
    """``WorkerPool``'s interface over a ``Machine``: a worker lives on until a failure or a fresh request."""

    def __init__(self, machine: Machine, root: Path, *, cancels: bool = True, clock: SimClock | None = None):
        self.machine, self.root, self.clock = machine, Path(root), clock
        self.cancels = cancels
        """A stop asked for (the Watch returning True) ends the run at its next window with a summary, as a live
        worker does; False: at once, without one, as a user's script in a torchrun of its own is killed
        (``autotune.runner.trial.run_trial``)."""
        self.worker: FakeWorker | None = None
        self.launched = 0
        self.compiles = 0
        self.runs: list[dict[str, Any]] = []
        """One entry per run: the config, the worker, whether it was a fresh one, and whether the cuDNN plans it ran
        on were found by the search."""

    def run(self, job, *, fresh: bool | str = False, on_record=None, on_poll=None) -> TrialRun:
        m, cfg = self.machine, job.config
        started = bool(fresh) or self.worker is None
        why = (fresh if isinstance(fresh, str) else "a fresh process was asked for") if fresh else \
            "no live worker yet" if started else None
        if started:
            self.launched += 1
            self.worker = FakeWorker(f"worker-{self.launched}")
        w = self.worker
        d = Path(job.trial_dir)
        run = TrialRun(log_path=d / "log.txt", result_path=d / "result.jsonl", worker=w.name, t_launch=time.time(),
                       fresh=why)
        shape = (cfg.training.precision, cfg.training.channels_last, cfg.training.batch_size)
        searched = w.plans.setdefault(shape, cfg.training.cudnn_benchmark) if m.kind(cfg) != "loader" else True
        self.runs.append({"config": cfg, "worker": w.name, "fresh": bool(fresh), "plans_searched": searched})
        stop = False

        def emit(rec: dict) -> None:
            nonlocal stop
            run.records.append(rec)
            if on_record is not None and on_record(rec) and run.stopped is None:
                run.stopped, stop = Stopped.PRUNED, True

        t = time.time()
        emit({"kind": "start", "t": t, "worker_trial": True})
        if (m.max_batch is not None and m.kind(cfg) != "loader" and cfg.training.batch_size > m.max_batch) or \
                (m.kind(cfg) == "e2e" and cfg.data.decode in m.oom_decodes):
            emit({"kind": "error", "t": t, "class": "oom", "rank": 0, "message": "CUDA out of memory (simulated)"})
            self.worker = None
            return self._end(run)
        emit({"kind": "ready", "t": t + 1.0})
        compiled = cfg.training.compile and m.kind(cfg) != "loader"
        compile_s, from_caches = self.compile(cfg, job.nproc_per_node) if compiled else (0.0, False)
        emit({"kind": "first_step", "t": t + 2.0 + (3.0 if searched else 0.0) + compile_s, "first_batch_s": 0.1})
        emit({"kind": "warmup_done", "t": t + 6.0})
        if m.kind(cfg) in m.interrupt:
            m.interrupt.discard(m.kind(cfg))
            self.worker = None
            raise KeyboardInterrupt
        steady = m.pace(cfg, searched)
        draws = m.luck.get(cfg.data.decode) if m.kind(cfg) == "e2e" else None
        if draws:
            steady *= draws.pop(0)
        meter = self.measure(cfg, job.nproc_per_node, steady, emit, lambda: stop)
        if stop and not self.cancels:
            self.worker = None
            return self._end(run)
        if self.clock is not None:
            measured = sum(w.seconds for w in meter.windows)  # its warm-up is part of run_s
            self.clock.advance((m.fresh_s if started else 0.0) + m.run_s + compile_s + measured)
        finite = not (m.kind(cfg) == "e2e" and cfg.training.precision in m.diverges)
        falls = {"loss_start": 2.0, "loss_end": 1.9 if finite else float("nan")} if m.loss is None else {}
        emit({"kind": "summary", **meter.summary(), "loss_finite": finite, **falls,
              "loss_nonfinite_in_windows": 0 if finite else 3,
              **({"compile_s": compile_s, "compiles": int(compile_s > 0),
                  "compile_reused": compile_s == 0, "compile_from_caches": from_caches} if compiled else {})})
        return self._end(run)

    def measure(self, cfg, world: int, steady: float, emit, stopped) -> ThroughputMeter:
        """The job's meter fed steps at ``steady`` imgs/s on a clock of simulated seconds: a short ramp (``RAMP_S``
        slower), then the pace swinging by the machine's share each half second, seeded by the run."""
        # Seeded by what runs and how often it ran before: a run's noise does not depend on what else a search ran,
        # nor on where (its folders).
        what = _what(cfg)
        again = sum(1 for r in self.runs[:-1] if _what(r["config"]) == what)
        rng = random.Random(zlib.crc32(repr((what, again)).encode()))
        images = cfg.training.batch_size * cfg.training.accum_steps * world
        meter = ThroughputMeter(cfg.measure, images_per_step=images, device=_CPU, emit=lambda r: None,
                                clock=Clock(), stop_requested=stopped)
        swing, chunk, pace = self.machine.swing(cfg), -1, steady
        wait = self.machine.data_wait(cfg, self.runs[-1]["plans_searched"])
        loss = None if self.machine.loss is None else _torch().tensor(self.machine.loss)
        while not meter.done:
            if int(meter.clock.t / 0.5) != chunk:
                chunk = int(meter.clock.t / 0.5)
                pace = steady * max(0.05, 1 + swing * rng.gauss(0, 1))
            ramp = 0.8 if meter.clock.t < RAMP_S else 1.0
            step_s = images / (pace * ramp)
            if wait is not None:  # the step's share of waiting for its batch, as the job's timed batches tell it
                meter.waited(wait * step_s)
            meter.clock.t += step_s
            n = len(meter.windows)
            meter.step(loss)
            for w in meter.windows[n:]:
                emit({"kind": "window", "window": w.index, "t0": w.t0, "t1": w.t1, "seconds": w.seconds,
                      "steps": w.steps, "images": w.images, "imgs_per_s": w.imgs_per_s, "turn": w.turn,
                      "loss_start": w.loss_start, "loss_end": w.loss_end,
                      "estimate": {"imgs_per_s": meter.latest.value, "half_width": meter.latest.half_width,
                                   "start": meter.latest.start} if meter.latest else None})
                if stopped() and not self.cancels:
                    return meter
        meter.step_split = self.machine.step_split(cfg, self.runs[-1]["plans_searched"])
        return meter

    def compile(self, cfg, world: int) -> tuple[float, bool]:
        """(seconds, from the on-disk caches) of a compiled run's compile in the current worker; recorded as the job
        records it."""
        m, w = self.machine, self.worker
        classes = cfg.data.num_classes or (1000 if cfg.data.kind == "synthetic" else FOLDER_CLASSES)
        key = graph_key(cfg, classes, world)
        if key in w.graphs:
            return 0.0, False
        from_caches = key in m.on_disk
        seconds = m.cached_compile_s if from_caches and m.cached_compile_s is not None else m.compile_s
        w.graphs.add(key)
        m.on_disk.add(key)
        self.compiles += seconds > 0
        if seconds > 0 and cfg.training.compile_cache_dir:
            import torch

            record(cfg.training.compile_cache_dir, key, Paid(seconds=seconds, from_caches=from_caches,
                                                             torch=torch.__version__, t=time.time()))
        return seconds, from_caches

    def _end(self, run: TrialRun) -> TrialRun:
        run.t_end = time.time()
        return run

    def close(self) -> list[int]:
        self.worker = None
        return []


class SimClock:
    """The search's clock (``autotune.search.engine``'s ``time.monotonic``) in a simulation: it moves only as the
    runs it is given to (``FakePool(clock=...)``) take their simulated seconds."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


_CPU = __import__("torch").device("cpu")


def _torch():
    import torch

    return torch


def _what(cfg) -> str:
    """What a run's config runs, without where (its folders and its name): the settings where it differs from the
    job's defaults, so that a setting added to the job at its default leaves every run's noise as it was."""
    where = {"name", "output_dir", "training.compile_cache_dir", "data.path", "script.path"}
    default = _defaults()
    return repr(sorted((k, v) for k, v in flat(cfg.to_dict()).items() if k not in where and default.get(k) != v))


@functools.cache
def _defaults() -> dict:
    return flat(TrainConfig().to_dict())


def flat(d: dict, prefix: str = "") -> dict:
    """A nested config dict as one level of dotted paths."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


SPEC: dict[str, Any] = {
    "name": "sim",
    "base": {"model": {"name": "resnet18"}, "data": {"kind": "imagefolder", "path": "/sim", "image_size": 64},
             "measure": {"window_s": 0.5, "precision": 0.02, "max_s": 20}},
    "default_space": False,
    "space": {"training.precision": ["fp32", "bf16", "fp16"], "training.channels_last": [False, True],
              "training.batch_size": [64, 128, 256, 512], "training.accum_steps": [1, 2],
              "data.decode": ["pil", "torchvision-cpu", "nvjpeg-gpu", "hybrid"],
              "data.hybrid_cpu_fraction": {"choices": [0.25, 0.5, 0.75], "when": "data.decode == hybrid"},
              "loader.num_workers": {"low": 2, "high": 8}, "ddp.bucket_cap_mb": {"low": 5, "high": 100}},
    "baseline": {"training.precision": "fp32", "training.channels_last": False, "training.batch_size": 64,
                 "training.accum_steps": 1, "data.decode": "pil", "loader.num_workers": 4, "ddp.bucket_cap_mb": 25},
    "sampler": {"seed": 0, "n_startup_trials": 4},
    "pruner": {"kind": "best"},
    "stages": {"enabled": True, "candidates": 3},
}


def constructed_plan(spec: dict[str, Any] = SPEC, *, gpu: bool = True, trials: int = 30,
                     timeout_s: float | None = None, trial_timeout_s: float = 60.0) -> Plan:
    """The plan ``autotune.search.prepare`` would make of ``spec`` on 2 ranks (GPUs or CPU ranks), with a data
    folder of 10 classes that need not exist."""
    s = StudySpec.from_dict(spec)
    space = resolve(s, world_size=2, nproc_per_node=2, cpu_only=not gpu, cores=16)
    base = s.base_config()
    return Plan(options=SearchOptions(), spec=s, name=s.name, objective=Objective(), nproc=2,
                torchrun=Torchrun.parse([]), entries=["0", "1"] if gpu else None, gpus=[],
                nvml=Nvml(), util_reason="no GPU", space=space, base=base, probe=base,
                baseline=space.baseline_params(s, base.to_dict()), starts=[],
                data=DataSummary(path="/sim", train=10000, val=0, classes=FOLDER_CLASSES),
                storage_url="sqlite:///studies/sim.db", trials=trials, timeout_s=timeout_s,
                trial_timeout_s=trial_timeout_s)
