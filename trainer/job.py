"""The built-in DDP job: one loop for search trials (``measure``), full runs (``train``) and the input pipeline alone
(``loader``).

A ``Job`` is one run of one TrainConfig on a process whose distributed environment is set up already
(``trainer.apply.init_distributed``): ``build`` (data, model, optimizer), ``run`` (steps until the mode says stop,
then the summary record), ``close`` (pipelines, threads and memory released). A fresh process runs one job; a trial
worker runs one job per trial in the same process (``trainer.worker``, which also runs a user's entry function in
its place).
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer import checkpoint as ckpt
from trainer.apply import autocast, cudnn_benchmark, grad_scaler, prepare_model
from trainer.compiled import PROCESS as COMPILED
from trainer.compiled import compile_record, graph_key, record_paid
from trainer.config import CUDA_GRAPH_MODES, TrainConfig
from trainer.data import build_pipeline, num_classes, prefetched_batches
from trainer.loop import evaluate, train_step
from trainer.meter import ThroughputMeter, sync, timed_batches
from trainer.model import build_model
from trainer.optim import build_optimizer, build_scheduler
from trainer.profile import profile_steps
from trainer.protocol import Kind, ResultWriter
from trainer.records import Dist, count_nonfinite, summary_record


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
        self.graph: str | None = None
        self.compile_before = (0.0, 0, 0, 0)
        self.cuda_graphs = False

        self.loss = torch.zeros((), device=env.device)
        # Non-finite step losses: (consecutive at the end, total), kept on the device (see count_nonfinite).
        self.nonfinite = (torch.zeros((), dtype=torch.int64, device=env.device),
                          torch.zeros((), dtype=torch.int64, device=env.device))
        if env.device.type == "cuda":
            cudnn_benchmark(cfg.training.cudnn_benchmark)
            torch.cuda.reset_peak_memory_stats(env.device)  # peak memory is this run's, also in a reused process

    # ---- the table of contents -------------------------------------------------------------------------------

    def run(self) -> None:
        if self.cfg.training.supply:
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
        self.graph = graph_key(cfg, classes, env.world_size) if t.compile else None
        self.compile_reused = COMPILED.prepare(cfg, self.graph) if t.compile else None
        self.compile_before = COMPILED.clock.read()
        self.model, self.raw_model = prepare_model(build_model(cfg, classes), cfg, env.device)
        self.cuda_graphs = t.compile and t.compile_mode in CUDA_GRAPH_MODES
        self.optimizer = build_optimizer(cfg, self.raw_model)
        self.scaler = grad_scaler(t.precision, env.device)
        # Measure runs read one endless stream of epochs (StreamingSampler): no epoch boundary in the windows.
        self.steps_per_epoch = max(1, len(self.pipeline) // t.accum_steps) if self.train_mode else sys.maxsize
        self.total_steps = t.steps or (t.epochs or 1) * self.steps_per_epoch
        self.scheduler = build_scheduler(cfg, self.optimizer, total_steps=self.total_steps,
                                         steps_per_epoch=self.steps_per_epoch)
        self.amp = autocast(t.precision, env.device)
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
        batches = timed_batches(iter(self.pipeline), self.meter.waited)  # the step's wait for data
        start = self.step - self.epoch * self.steps_per_epoch
        for _ in range(start * t.accum_steps):  # resumed mid-epoch: skip what was seen
            next(batches)
        for _ in range(start, self.steps_per_epoch):
            if self.steps_run == 0:
                batches = self.first_step(batches)
            else:
                self.train_one_step(batches)
            if self.finished():
                self.profile(batches)
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
        if compiled and self.env.rank == 0:  # what this graph cost here, for the next process to price it by
            record_paid(self.cfg, self.graph, compiled)
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

    def profile(self, batches: Iterator) -> None:
        """A measure run asked for a profile (``measure.profile_steps``): that many more steps under torch.profiler,
        after the windows, split into their parts (``trainer.profile``) for the summary."""
        t, steps = self.cfg.training, self.cfg.measure.profile_steps
        if (not steps or t.mode != "measure" or not self.meter.done or self.meter.cancelled
                or self.meter.step_split is not None):
            return
        self.meter.step_split = profile_steps(
            lambda: train_step(self.model, batches, self.optimizer, self.scaler, accum_steps=t.accum_steps,
                               autocast_ctx=self.amp, cuda_graphs=self.cuda_graphs), steps, self.env.device)

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
            metrics = evaluate(self.raw_model, self.val_pipeline, autocast_ctx=self.amp, device=env.device)
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
        compiled = compile_record(self.compile_before) if t.compile and not t.supply else {}
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
