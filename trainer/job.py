"""The DDP job torchrun launches: one loop for search trials (``measure``), full runs (``train``) and the input
pipeline alone (``loader``).

A process sets up its distributed environment once (``init_distributed``: the safety environment, NCCL variables,
the process group); a ``Job`` is one run of one TrainConfig on it: ``build`` (data, model, optimizer), ``run`` (steps
until the mode says stop, then the summary record), ``close`` (pipelines, threads and memory released). A fresh
process runs one job; a trial worker (``trainer.worker``) runs one job per trial in the same process.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import math
import os
import resource
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import checkpoint as ckpt
from trainer.compiled import PROCESS as COMPILED
from trainer.compiled import compile_model, compile_record, graph_key
from trainer.config import CUDA_GRAPH_MODES, ConfigError, TrainConfig
from trainer.data import GPU_DECODE_PATHS, build_pipeline, num_classes
from trainer.learning import DEFAULT_HINT, loss_verdict, window_losses
from trainer.loop import autocast, evaluate, grad_scaler, train_step
from trainer.meter import ThroughputMeter, sync
from trainer.model import build_model
from trainer.optim import build_optimizer, build_scheduler
from trainer.protocol import SAFETY_ENV, Failure, Kind, ResultWriter, error_record, nccl_env_problems

DIVERGED_STEPS = 5
"""Consecutive non-finite step losses at the end of a run that make it diverged. A diverged run (NaN/inf weights)
stays non-finite every step after; a few in a row tell it from a forward pass that overflowed once (the GradScaler
skips that step and the weights stay finite). Either way the summary's ``loss_finite`` is False when a non-finite
loss falls inside the measured windows: the loss is computed before anything is scaled, so a healthy run has none
there (on 2xH200 an fp16 run at lr 0.4 without warm-up had NaN losses in 112 steps and never 5 in a row)."""


@dataclass(kw_only=True, frozen=True)
class Dist:
    """This process's place in the run, fixed for the life of the process."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    init_s: float = 0.0
    """Seconds the process group took to set up (with NCCL: its communicators, made eagerly)."""


# ---- the process: once --------------------------------------------------------------------------------------------


def init_distributed(cfg: TrainConfig) -> Dist:
    """The safety environment, NCCL variables and the process group: everything a live process cannot change later
    (``trainer.config.process_settings``)."""
    apply_env(cfg)
    if "RANK" not in os.environ:  # `python -m trainer` without torchrun: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = cfg.ddp.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(["ddp.backend=nccl needs CUDA GPUs: use auto or gloo on this machine"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads()))
    t0 = time.perf_counter()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.ddp.timeout_s),
                            device_id=device if backend == "nccl" else None)
    return Dist(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=device,
                backend=backend, init_s=round(time.perf_counter() - t0, 4))


def apply_env(cfg: TrainConfig) -> None:
    """NCCL reads its variables when the first communicator is made, so setting them here, before init, works for
    a job started by hand as well as by the tuner (which sets them too)."""
    problems = nccl_env_problems({k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    if problems:
        raise ConfigError([f"environment: {p}" for p in problems])
    os.environ.update(SAFETY_ENV)
    os.environ.update(cfg.nccl.to_env())


def shutdown_distributed() -> None:
    dist.barrier()
    dist.destroy_process_group()


def run_recorded(writer: ResultWriter, body) -> int:
    """Run ``body()``; every failure ends in an error record (any rank), never in silence. Returns the exit code."""
    try:
        body()
        return 0
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        record = error_record(e)
        writer.write(record, any_rank=True)
        print(f"[rank {writer.rank}] {record['class']}: {record['message']}", file=sys.stderr)
        traceback.print_exc()
        return 3 if record["class"] == Failure.CONFIG else 1


def run(cfg: TrainConfig, result_path: str | None, *, cancel: str | None = None) -> int:
    """One run in a fresh process; returns the process exit code."""
    writer = ResultWriter(result_path, int(os.environ.get("RANK", 0)))

    def body() -> None:
        env = init_distributed(cfg)
        writer.rank = env.rank
        run_job(cfg, env, writer, cancel=cancel)
        shutdown_distributed()

    try:
        return run_recorded(writer, body)
    finally:
        writer.close()


def run_job(cfg: TrainConfig, env: Dist, writer: ResultWriter, *, worker_trial: int | None = None,
            cancel: str | None = None) -> None:
    """The ``start`` record, then one Job from build to close. The run ends early, at a window's end, once the file
    ``cancel`` exists."""
    writer.write(start_record(env, worker_trial))
    if cfg.script.given:  # a user's training function (a script file runs under torchrun itself, not here)
        if cfg.script.path:
            raise ConfigError([f"script.path={cfg.script.path}: a script file runs as `torchrun ... "
                               f"{cfg.script.path}`, not through `python -m trainer`; use script.entry for a function"])
        from trainer.runtime.entry import run_entry

        run_entry(cfg, env, writer, cancel=cancel, worker_trial=worker_trial)
        return
    job = Job(cfg, env, writer, cancel=cancel)
    try:
        job.run()
    finally:
        job.close()


# ---- one run ------------------------------------------------------------------------------------------------------


class Job:
    """One run of ``cfg`` on the process's distributed environment."""

    def __init__(self, cfg: TrainConfig, env: Dist, writer: ResultWriter, *, cancel: str | None = None):
        self.cfg, self.env, self.writer = cfg, env, writer
        self.stop_requested = (lambda: os.path.exists(cancel)) if cancel else None
        self.train_mode = cfg.training.mode == "train"
        self.pipeline = self.val_pipeline = None
        self.model = self.raw_model = self.optimizer = self.scaler = self.scheduler = self.meter = None
        self.step = self.epoch = 0
        self.steps_run = 0
        """Steps this process ran in this job (a resumed run starts its count afresh)."""

        self.compile_reused: bool | None = None
        self.compile_before = (0.0, 0)
        self.cuda_graphs = False

        self.loss = torch.zeros((), device=env.device)
        # Non-finite step losses: (consecutive at the end, total), kept on the device (see count_nonfinite).
        self.nonfinite = (torch.zeros((), dtype=torch.int64, device=env.device),
                          torch.zeros((), dtype=torch.int64, device=env.device))
        if env.device.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.training.cudnn_benchmark
            torch.cuda.reset_peak_memory_stats(env.device)  # peak memory is this run's, also in a reused process

    # ---- the table of contents -------------------------------------------------------------------------------

    def run(self) -> None:
        if self.cfg.training.mode == "loader":
            self.run_loader()
            return
        self.build()
        if self.train_mode and self.cfg.checkpoint.resume:
            self.resume()
        # Where a trial's first seconds go (build vs first step vs settling): the search records the split.
        self.writer.write({"kind": Kind.READY, "t": time.time()})
        while not self.finished():
            self.run_epoch()
        if self.train_mode and not ckpt.checkpoint_path(self.cfg.checkpoint_dir, self.step).exists():
            self.save()  # the final state, always
        self.pipeline.close()
        self.finish(nonfinite=self.nonfinite)

    def build(self) -> None:
        cfg, env, t = self.cfg, self.env, self.cfg.training
        torch.manual_seed(t.seed)
        self.pipeline = build_pipeline(cfg, rank=env.rank, world_size=env.world_size, device=env.device)
        if self.train_mode and t.validate_every:
            self.val_pipeline = build_pipeline(cfg, rank=env.rank, world_size=env.world_size, device=env.device,
                                               split="val")
        classes = num_classes(cfg)
        # A live worker keeps the graphs a trial before it compiled while they are this trial's (trainer.compiled).
        self.compile_reused = COMPILED.prepare(cfg, graph_key(cfg, classes, env.world_size)) if t.compile else None
        self.compile_before = COMPILED.clock.read()
        self.model, self.raw_model = build_ddp_model(cfg, env, classes)
        self.cuda_graphs = t.compile and t.compile_mode in CUDA_GRAPH_MODES
        self.optimizer = build_optimizer(cfg, self.raw_model)
        self.scaler = grad_scaler(cfg, env.device)
        # Measure runs read one endless stream of epochs (StreamingSampler): no epoch boundary in the windows.
        self.steps_per_epoch = max(1, len(self.pipeline) // t.accum_steps) if self.train_mode else sys.maxsize
        self.total_steps = t.steps or (t.epochs or 1) * self.steps_per_epoch
        self.scheduler = build_scheduler(cfg, self.optimizer, total_steps=self.total_steps,
                                         steps_per_epoch=self.steps_per_epoch)
        self.amp = autocast(cfg, env.device)
        # A train run's figure is its whole run's pace, loader start-up included: no prefetch discount there.
        prefetched = 0 if self.train_mode else math.ceil(prefetched_batches(cfg) / t.accum_steps)
        self.meter = ThroughputMeter(cfg.measure, images_per_step=t.batch_size * t.accum_steps, device=env.device,
                                     emit=self.writer.write, continuous=self.train_mode, prefetched_steps=prefetched,
                                     span_steps=math.ceil(cfg.loader.num_workers / t.accum_steps),
                                     stop_requested=self.stop_requested)
        self.last_log = time.monotonic()

    def run_epoch(self) -> None:
        t = self.cfg.training
        # Everything random in an epoch derives from (seed, epoch), so a resumed run replays it exactly.
        torch.manual_seed(t.seed * 100_003 + self.epoch * 1_009 + self.env.rank)
        self.pipeline.set_epoch(self.epoch)
        batches = iter(self.pipeline)
        start = self.step - self.epoch * self.steps_per_epoch
        for _ in range(start * t.accum_steps):  # resumed mid-epoch: skip what was seen
            next(batches)
        for _ in range(start, self.steps_per_epoch):
            if self.steps_run == 0:
                batches = self.first_step(batches)
            else:
                self.train_one_step(batches)
            if self.finished():
                break
        if self.step == (self.epoch + 1) * self.steps_per_epoch:
            self.epoch += 1
            if self.train_mode:
                with self.meter.paused():
                    self.end_of_epoch()

    def first_step(self, batches: Iterator) -> Iterator:
        """The first step, timed in its parts (one sync, once): the loader's first batch, then the first forward
        and backward (cuDNN's algorithm search, the first all-reduce). Returns the iterator the epoch goes on
        with."""
        t0 = time.perf_counter()
        first = next(batches)
        got_batch = time.perf_counter()
        rest = itertools.chain([first], batches)
        self.train_one_step(rest)
        sync(self.env.device)
        done = time.perf_counter()
        # A compiled model compiles in its first forward and backward: compile_s is that part of first_compute_s.
        compiled = ({**compile_record(self.compile_before), "compile_reused": self.compile_reused}
                    if self.cfg.training.compile else {})
        self.writer.write({"kind": Kind.FIRST_STEP, "t": time.time(), "first_batch_s": round(got_batch - t0, 4),
                           "first_compute_s": round(done - got_batch, 4),
                           "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)
                           if self.env.device.type == "cuda" else None, **compiled})
        return rest

    def train_one_step(self, batches: Iterator) -> None:
        t = self.cfg.training
        self.loss = train_step(self.model, batches, self.optimizer, self.scaler, accum_steps=t.accum_steps,
                               autocast_ctx=self.amp, cuda_graphs=self.cuda_graphs)
        self.nonfinite = count_nonfinite(self.loss, *self.nonfinite)
        self.steps_run += 1
        self.scheduler.step()
        self.step += 1
        self.meter.step(self.loss)
        if self.train_mode:
            if time.monotonic() - self.last_log >= t.log_every_s:
                self.last_log = time.monotonic()
                self.progress()
            every = self.cfg.checkpoint.every_steps
            if every and self.step % every == 0:
                with self.meter.paused():
                    self.save()

    def finished(self) -> bool:
        t = self.cfg.training
        if t.steps is not None and self.step >= t.steps:
            return True
        if t.mode == "measure":
            return self.meter.done
        return t.steps is None and self.epoch >= (t.epochs or 0)

    def run_loader(self) -> None:
        """The input pipeline alone: how many images per second it delivers to this rank's device."""
        cfg, env = self.cfg, self.env
        self.pipeline = build_pipeline(cfg, rank=env.rank, world_size=env.world_size, device=env.device)
        self.meter = ThroughputMeter(cfg.measure, images_per_step=cfg.training.batch_size, device=env.device,
                                     emit=self.writer.write, prefetched_steps=prefetched_batches(cfg),
                                     span_steps=cfg.loader.num_workers, stop_requested=self.stop_requested)
        self.writer.write({"kind": Kind.READY, "t": time.time()})
        checksum = torch.zeros((), device=env.device)
        while not self.meter.done:
            self.pipeline.set_epoch(self.epoch)
            for images, _ in self.pipeline:
                checksum += images[:, :, 0, 0].float().sum()  # touch the batch so no lazy work is skipped
                self.meter.step()
                if self.meter.done:
                    break
            self.epoch += 1
        self.pipeline.close()
        self.loss = checksum
        self.finish(nonfinite=None)

    # ---- train-mode chores -----------------------------------------------------------------------------------

    def end_of_epoch(self) -> None:
        cfg, env = self.cfg, self.env
        self.writer.write({"kind": Kind.EPOCH, "t": time.time(), "epoch": self.epoch, "step": self.step})
        if self.val_pipeline is not None and self.epoch % cfg.training.validate_every == 0:
            metrics = evaluate(self.raw_model, self.val_pipeline, autocast_ctx=autocast(cfg, env.device),
                               device=env.device)
            self.writer.write({"kind": Kind.VAL, "t": time.time(), "epoch": self.epoch, "step": self.step, **metrics})
            if env.rank == 0:
                print(f"epoch {self.epoch}: val top1 {metrics['top1']:.4f} top5 {metrics['top5']:.4f} "
                      f"loss {metrics['loss']:.4f} ({metrics['images']} images)", file=sys.stderr)
        if cfg.checkpoint.every_epochs and self.epoch % cfg.checkpoint.every_epochs == 0:
            self.save()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None,
                "step": self.step, "epoch": self.epoch, "config": self.cfg.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = state["step"], state["epoch"]

    def resume(self) -> None:
        found = ckpt.load_latest(self.cfg.checkpoint_dir, map_location=self.env.device)
        if found is None:
            return
        path, state = found
        self.load_state_dict(state)
        self.writer.write({"kind": Kind.RESUME, "t": time.time(), "path": str(path), "step": self.step,
                           "epoch": self.epoch})

    def save(self) -> None:
        if self.env.rank == 0:
            path = ckpt.save_checkpoint(self.cfg.checkpoint_dir, self.step, self.state_dict(),
                                        keep_last=self.cfg.checkpoint.keep_last)
            self.writer.write({"kind": Kind.CHECKPOINT, "t": time.time(), "path": str(path), "step": self.step,
                               "epoch": self.epoch})
        # Nobody runs ahead of a checkpoint that may be read back (resume in the same allocation).
        dist.barrier()

    def progress(self) -> None:
        rate = self.meter.windows[-1].imgs_per_s if self.meter.windows else None
        record = {"kind": Kind.PROGRESS, "t": time.time(), "step": self.step, "epoch": self.epoch,
                  "total_steps": self.total_steps, "loss": float(self.loss.float().item()),
                  "lr": self.scheduler.get_last_lr()[0], "imgs_per_s": rate}
        self.writer.write(record)
        if self.env.rank == 0:
            speed = f"{rate:,.0f} imgs/s" if rate else "warming up"
            print(f"step {self.step}/{self.total_steps} epoch {self.epoch} loss {record['loss']:.4f} {speed}",
                  file=sys.stderr)

    # ---- the end -----------------------------------------------------------------------------------------------

    def finish(self, *, nonfinite: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The summary record. ``nonfinite``: the (run, total) counters of count_nonfinite; None (loader mode, no
        loss) judges the final ``loss`` value alone, as one step."""
        t = self.cfg.training
        if t.mode == "measure" and not self.meter.windows:
            raise RuntimeError("the run ended before one measurement window closed: raise training.steps or add data")
        # Compiles after the first step (a recompile mid-run) show here: the whole trial's compile time and count.
        compiled = compile_record(self.compile_before) if t.compile and t.mode != "loader" else {}
        self.writer.write(summary_record(self.meter, self.env, mode=t.mode, loss=self.loss, nonfinite=nonfinite,
                                         steps_run=self.steps_run, steps=self.step, epochs=self.epoch,
                                         global_batch=t.batch_size * t.accum_steps * self.env.world_size,
                                         extra=compiled))

    def close(self) -> None:
        """Release everything this run built: loader workers and decode threads joined, model, optimizer and
        compiled graphs dropped, cached device memory returned. A worker's next trial starts from what a fresh
        process would have (but for the process group, the CUDA context and cuDNN's per-shape choices)."""
        for pipeline in (self.pipeline, self.val_pipeline):
            if pipeline is not None:
                pipeline.close()
        self.pipeline = self.val_pipeline = None
        self.model = self.raw_model = self.optimizer = self.scaler = self.scheduler = self.meter = None
        self.loss = self.nonfinite = None
        if self.cfg.training.compile:
            COMPILED.release(self.cfg)  # CUDA graphs go with their trial; other graphs stay for the next one's
        gc.collect()
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
            torch.cuda.empty_cache()


# ---- pieces ------------------------------------------------------------------------------------------------------


def build_ddp_model(cfg: TrainConfig, env: Dist, classes: int):
    t, d = cfg.training, cfg.ddp
    model = build_model(cfg, classes).to(env.device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    extra = {}
    if not d.broadcast_buffers:  # passed only when changed: torch >= 2.14 deprecates the argument
        extra["broadcast_buffers"] = False
    ddp = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
              bucket_cap_mb=d.bucket_cap_mb, gradient_as_bucket_view=d.gradient_as_bucket_view,
              static_graph=d.static_graph, find_unused_parameters=d.find_unused_parameters, **extra)
    if t.compile:
        # Compile the DDP wrapper: Dynamo's DDPOptimizer splits the graph at bucket boundaries so the
        # all-reduces still overlap the backward pass.
        return compile_model(ddp, cfg), model
    return ddp, model


def prefetched_batches(cfg: TrainConfig) -> int:
    """Batches ready before the first step whose work is already done: decoded by the loader workers, or decoded
    one ahead on the device. The workers of ``nvjpeg-gpu``/``nvjpeg-hw`` only read bytes: a buffer of bytes still
    has its decode ahead of it, so it does not make a step faster and is not discarded (draining a deep one cost a
    trial 10 s)."""
    if cfg.data.kind == "synthetic" or cfg.loader.num_workers == 0:
        return 0
    ahead = 1 if cfg.data.decode in GPU_DECODE_PATHS else 0
    if cfg.data.decode in ("nvjpeg-gpu", "nvjpeg-hw"):
        return ahead
    return cfg.loader.num_workers * (cfg.loader.prefetch_factor or 2) + ahead


def count_nonfinite(loss: torch.Tensor, run: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's update of the non-finite loss counters: ``run`` (consecutive non-finite steps, 0 after a finite one)
    and ``total``. Pure tensor arithmetic on the device: no ``.item()``, no branch on the value, so the host never
    waits for the GPU; a per-step sync would stall the launch queue every step and cost the throughput we measure."""
    bad = (~torch.isfinite(loss)).all().to(run.dtype)
    return (run + 1) * bad, total + bad


def summary_record(meter: ThroughputMeter, env: Dist, *, mode: str, loss: torch.Tensor,
                   nonfinite: tuple[torch.Tensor, torch.Tensor] | None, steps_run: int, steps: int, epochs: int,
                   global_batch: int | None, unit: str = "images", extra: dict[str, Any] | None = None,
                   loss_hint: str = DEFAULT_HINT) -> dict[str, Any]:
    """A run's summary record, for the built-in job and a user's script alike (``trainer.runtime``): the meter's
    figures, the loss verdict, peak memory per rank. Collective: every rank calls it (the worst rank's loss counts).
    ``nonfinite``: the (run, total) counters of count_nonfinite; None (loader mode, no loss) judges ``loss`` alone,
    as one step."""
    loss_value = float(loss.float().item()) if loss.numel() else float("nan")
    # A user's script may end its process group before the summary of a full run is written (at exit): then this
    # rank's own figures, which for the windows are everyone's already (each window is all-reduced as it closes).
    group = dist.is_initialized()
    peaks = [None] * env.world_size if group else [peak_memory_bytes(env.device)]
    if group:
        dist.all_gather_object(peaks, peak_memory_bytes(env.device))
    if nonfinite is None:
        zero = torch.zeros((), dtype=torch.int64, device=env.device)
        nonfinite, steps_run = count_nonfinite(torch.tensor(loss_value, device=env.device), zero, zero), 1
    counts = torch.stack(list(nonfinite)).to(torch.int64)
    if group:
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # the worst rank decides, as for every other verdict
    run, total = (int(v) for v in counts.tolist())
    measured = meter.summary()
    # A figure is a training figure only if the loss stayed finite where it was measured and at the end, and did
    # not rise across the windows (trainer.learning: one rule for the built-in job and a user's script).
    verdict = loss_verdict(window_losses(meter.windows), nonfinite_steps=measured["loss_nonfinite_in_windows"],
                           diverged_steps=run if loss_diverged(run, steps_run) else 0, hint=loss_hint)
    return {"kind": Kind.SUMMARY, "t": time.time(), "mode": mode, "world_size": env.world_size, "unit": unit,
            **measured, **(extra or {}), "steps": steps, "epochs": epochs, "loss": loss_value,
            "loss_finite": verdict.ok, "loss_reason": verdict.reason, "loss_nonfinite_steps": total,
            "loss_nonfinite_run": run, "peak_mem_bytes": peaks,
            "peak_mem_kind": "cuda_max_allocated" if env.device.type == "cuda" else "host_max_rss",
            "global_batch": global_batch, "versions": versions()}


def loss_diverged(run: int, steps_run: int) -> bool:
    """Diverged: the last DIVERGED_STEPS step losses were all non-finite, or, in a run shorter than that, all were."""
    return steps_run > 0 and run >= min(DIVERGED_STEPS, steps_run)


def start_record(env: Dist, worker_trial: int | None = None) -> dict[str, Any]:
    return {"kind": Kind.START, "t": time.time(), "world_size": env.world_size, "backend": env.backend,
            "device": env.device.type, "host": socket.gethostname(), "pid": os.getpid(), "versions": versions(),
            "gpu": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None,
            "init_s": env.init_s, "worker_trial": worker_trial}


def versions() -> dict[str, Any]:
    import torchvision

    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):  # a build without NCCL
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None, "nccl": nccl,
            "python": sys.version.split()[0]}


def peak_memory_bytes(device: torch.device) -> int:
    """This run's peak device memory; on the CPU the process's peak RSS (a reused process's is its lifetime peak)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
