"""The DDP job torchrun launches: one loop for search trials (``measure``), full runs (``train``) and the input
pipeline alone (``loader``)."""

from __future__ import annotations

import datetime
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import checkpoint as ckpt
from trainer.config import ConfigError, TrainConfig, nccl_env_problems
from trainer.data import GPU_DECODE_PATHS, build_pipeline, num_classes
from trainer.loop import autocast, build_optimizer, build_scheduler, evaluate, grad_scaler, train_step
from trainer.meter import ResultWriter, ThroughputMeter, sync
from trainer.model import build_model

# Set for every process this job starts (loader workers, NCCL): NVLink multicast can take a shared host's GPUs down.
SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Consecutive non-finite step losses at the end of a run that make it diverged (summary's loss_finite False). With
# fp16 a batch can overflow in the forward pass (an inf/NaN loss): GradScaler finds the gradients non-finite, skips
# that step and lowers the scale, the weights stay finite and the next losses are finite again, so an isolated
# non-finite step is normal. A diverged run (NaN/inf weights) stays non-finite every step after; a few in a row tell
# the two apart without needing a long run.
DIVERGED_STEPS = 5


@dataclass(kw_only=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def run(cfg: TrainConfig, result_path: str | None) -> int:
    """Run the job; returns the process exit code. Every failure ends in an error record, never in silence."""
    writer = ResultWriter(result_path, int(os.environ.get("RANK", 0)))
    try:
        env = setup_distributed(cfg)
        writer.rank = env.rank
        writer.write(start_record(env))
        if cfg.training.mode == "loader":
            measure_loader(cfg, env, writer)
        else:
            train(cfg, env, writer)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as e:  # noqa: BLE001 - classify, record, exit non-zero
        if isinstance(e, SystemExit) and not e.code:
            raise
        record = error_record(e)
        writer.write(record, any_rank=True)
        print(f"[rank {writer.rank}] {record['class']}: {record['message']}", file=sys.stderr)
        traceback.print_exc()
        return 3 if record["class"] == "config" else 1
    finally:
        writer.close()


def train(cfg: TrainConfig, env: Dist, writer: ResultWriter) -> None:
    """The run, as a table of contents: data, model, optimizer, resume, then steps until the mode says stop."""
    t = cfg.training
    torch.manual_seed(t.seed)
    pipeline = build_pipeline(cfg, rank=env.rank, world_size=env.world_size, device=env.device)
    val_pipeline = (build_pipeline(cfg, rank=env.rank, world_size=env.world_size, device=env.device, split="val")
                    if t.mode == "train" and t.validate_every else None)
    model, raw_model = build_ddp_model(cfg, env, num_classes(cfg))
    optimizer = build_optimizer(cfg, raw_model)
    scaler = grad_scaler(cfg, env.device)
    # Measure runs read one endless stream of epochs (data.StreamingSampler): no epoch boundary in the windows.
    steps_per_epoch = max(1, len(pipeline) // t.accum_steps) if t.mode == "train" else sys.maxsize
    total_steps = t.steps or (t.epochs or 1) * steps_per_epoch
    scheduler = build_scheduler(cfg, optimizer, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
    amp = autocast(cfg, env.device)

    step, epoch = 0, 0
    if t.mode == "train" and cfg.checkpoint.resume:
        step, epoch = resume(cfg, env, raw_model, optimizer, scaler, scheduler, writer)

    # A train run's figure is its whole run's pace, loader start-up included: no prefetch discount there.
    prefetched = 0 if t.mode == "train" else math.ceil(prefetched_batches(cfg) / t.accum_steps)
    meter = ThroughputMeter(cfg.measure, images_per_step=t.batch_size * t.accum_steps, device=env.device,
                            emit=writer.write, continuous=t.mode == "train", prefetched_steps=prefetched,
                            span_steps=math.ceil(cfg.loader.num_workers / t.accum_steps))
    loss = torch.zeros((), device=env.device)
    # Non-finite step losses: (consecutive at the end, total), kept on the device (see count_nonfinite).
    nonfinite = (torch.zeros((), dtype=torch.int64, device=env.device),
                 torch.zeros((), dtype=torch.int64, device=env.device))
    steps_run = 0  # steps this process ran (a resumed run starts its count afresh)
    # Where a trial's first half-minute goes (build vs first step vs settling): the search records the split.
    writer.write({"kind": "ready", "t": time.time()})
    last_log = time.monotonic()
    while not finished(cfg, step, epoch, meter):
        # Everything random in an epoch derives from (seed, epoch), so a resumed run replays it exactly.
        torch.manual_seed(t.seed * 100_003 + epoch * 1_009 + env.rank)
        pipeline.set_epoch(epoch)
        batches = iter(pipeline)
        for _ in range((step - epoch * steps_per_epoch) * t.accum_steps):  # resumed mid-epoch: skip what was seen
            next(batches)
        for _ in range(step - epoch * steps_per_epoch, steps_per_epoch):
            loss = train_step(model, batches, optimizer, scaler, accum_steps=t.accum_steps, autocast_ctx=amp)
            nonfinite = count_nonfinite(loss, *nonfinite)
            steps_run += 1
            if steps_run == 1:
                # One sync, once: the first step's end (loader start-up, cudnn autotuning, NCCL communicators).
                sync(env.device)
                writer.write({"kind": "first_step", "t": time.time()})
            scheduler.step()
            step += 1
            meter.step(loss)
            if t.mode == "train" and time.monotonic() - last_log >= t.log_every_s:
                last_log = time.monotonic()
                progress(writer, env, step, epoch, total_steps, loss, scheduler, meter)
            if t.mode == "train" and cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                with meter.paused():
                    save(cfg, env, raw_model, optimizer, scaler, scheduler, step, epoch, writer)
            if finished(cfg, step, epoch, meter):
                break
        if step == (epoch + 1) * steps_per_epoch:
            epoch += 1
            if t.mode == "train":
                with meter.paused():
                    end_of_epoch(cfg, env, raw_model, val_pipeline, optimizer, scaler, scheduler, step, epoch, writer)
    if t.mode == "train" and not ckpt.checkpoint_path(cfg.checkpoint_dir, step).exists():
        save(cfg, env, raw_model, optimizer, scaler, scheduler, step, epoch, writer)  # the final state, always
    pipeline.close()
    finish(cfg, env, meter, loss, step, epoch, writer, nonfinite=nonfinite, steps_run=steps_run)


def prefetched_batches(cfg: TrainConfig) -> int:
    """Batches the loader workers hold ready before the first step (plus one decoded ahead on the GPU path)."""
    if cfg.data.kind == "synthetic" or cfg.loader.num_workers == 0:
        return 0
    ahead = 1 if cfg.data.decode in GPU_DECODE_PATHS else 0
    return cfg.loader.num_workers * (cfg.loader.prefetch_factor or 2) + ahead


def finished(cfg: TrainConfig, step: int, epoch: int, meter: ThroughputMeter) -> bool:
    t = cfg.training
    if t.steps is not None and step >= t.steps:
        return True
    if t.mode == "measure":
        return meter.done
    return t.steps is None and epoch >= (t.epochs or 0)


def end_of_epoch(cfg, env, raw_model, val_pipeline, optimizer, scaler, scheduler, step, epoch, writer) -> None:
    record: dict[str, Any] = {"kind": "epoch", "t": time.time(), "epoch": epoch, "step": step}
    writer.write(record)
    if val_pipeline is not None and epoch % cfg.training.validate_every == 0:
        metrics = evaluate(raw_model, val_pipeline, autocast_ctx=autocast(cfg, env.device), device=env.device)
        writer.write({"kind": "val", "t": time.time(), "epoch": epoch, "step": step, **metrics})
        if env.rank == 0:
            print(f"epoch {epoch}: val top1 {metrics['top1']:.4f} top5 {metrics['top5']:.4f} "
                  f"loss {metrics['loss']:.4f} ({metrics['images']} images)", file=sys.stderr)
    if cfg.checkpoint.every_epochs and epoch % cfg.checkpoint.every_epochs == 0:
        save(cfg, env, raw_model, optimizer, scaler, scheduler, step, epoch, writer)


def count_nonfinite(loss: torch.Tensor, run: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's update of the non-finite loss counters: ``run`` (consecutive non-finite steps, 0 after a finite one)
    and ``total``. Pure tensor arithmetic on the device: no ``.item()``, no branch on the value, so the host never
    waits for the GPU; a per-step sync would stall the launch queue every step and cost the throughput we measure."""
    bad = (~torch.isfinite(loss)).all().to(run.dtype)
    return (run + 1) * bad, total + bad


def loss_diverged(run: int, steps_run: int) -> bool:
    """Diverged: the last DIVERGED_STEPS step losses were all non-finite, or, in a run shorter than that, all were."""
    return steps_run > 0 and run >= min(DIVERGED_STEPS, steps_run)


def finish(cfg, env, meter, loss, step, epoch, writer, *, nonfinite=None, steps_run: int = 1) -> None:
    """The summary record. ``nonfinite``: the (run, total) counters of count_nonfinite; None (loader mode, no loss)
    judges the final ``loss`` value alone, as one step."""
    if cfg.training.mode == "measure" and not meter.windows:
        raise RuntimeError("the run ended before one measurement window closed: raise training.steps or add data")
    loss_value = float(loss.float().item()) if loss.numel() else float("nan")
    peak = peak_memory_bytes(env.device)
    peaks = [None] * env.world_size
    dist.all_gather_object(peaks, peak)
    if nonfinite is None:
        zero = torch.zeros((), dtype=torch.int64, device=env.device)
        nonfinite = count_nonfinite(torch.tensor(loss_value, device=env.device), zero, zero)
    counts = torch.stack(list(nonfinite)).to(torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # the worst rank decides, as for every other verdict
    run, total = (int(v) for v in counts.tolist())
    writer.write({"kind": "summary", "t": time.time(), "mode": cfg.training.mode, "world_size": env.world_size,
                  **meter.summary(), "steps": step, "epochs": epoch, "loss": loss_value,
                  "loss_finite": not loss_diverged(run, steps_run), "loss_nonfinite_steps": total,
                  "loss_nonfinite_run": run, "peak_mem_bytes": peaks,
                  "peak_mem_kind": "cuda_max_allocated" if env.device.type == "cuda" else "host_max_rss",
                  "global_batch": cfg.training.batch_size * cfg.training.accum_steps * env.world_size,
                  "versions": versions()})


def measure_loader(cfg: TrainConfig, env: Dist, writer: ResultWriter) -> None:
    """The input pipeline alone: how many images per second it delivers to this rank's device."""
    pipeline = build_pipeline(cfg, rank=env.rank, world_size=env.world_size, device=env.device)
    meter = ThroughputMeter(cfg.measure, images_per_step=cfg.training.batch_size, device=env.device,
                            emit=writer.write, prefetched_steps=prefetched_batches(cfg),
                            span_steps=cfg.loader.num_workers)
    epoch, checksum = 0, torch.zeros((), device=env.device)
    while not meter.done:
        pipeline.set_epoch(epoch)
        for images, _ in pipeline:
            checksum += images[:, :, 0, 0].float().sum()  # touch the batch so no lazy work is skipped
            meter.step()
            if meter.done:
                break
        epoch += 1
    pipeline.close()
    finish(cfg, env, meter, checksum, 0, epoch, writer)


# ---- setup ---------------------------------------------------------------------------------------------------------


def setup_distributed(cfg: TrainConfig) -> Dist:
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
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads()))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.ddp.timeout_s),
                            device_id=device if backend == "nccl" else None)
    return Dist(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=device,
                backend=backend)


def apply_env(cfg: TrainConfig) -> None:
    """NCCL reads its variables when the first communicator is made, so setting them here, before init, works for
    a job started by hand as well as by the tuner (which sets them too)."""
    problems = nccl_env_problems({k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    if problems:
        raise ConfigError([f"environment: {p}" for p in problems])
    os.environ.update(SAFETY_ENV)
    for key, value in cfg.nccl.to_env().items():
        os.environ[key] = value


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
        return torch.compile(ddp, mode=t.compile_mode), model
    return ddp, model


def resume(cfg, env, raw_model, optimizer, scaler, scheduler, writer) -> tuple[int, int]:
    found = ckpt.load_latest(cfg.checkpoint_dir, map_location=env.device)
    if found is None:
        return 0, 0
    path, state = found
    raw_model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    writer.write({"kind": "resume", "t": time.time(), "path": str(path), "step": state["step"],
                  "epoch": state["epoch"]})
    return state["step"], state["epoch"]


def save(cfg, env, raw_model, optimizer, scaler, scheduler, step, epoch, writer) -> None:
    if env.rank == 0:
        state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None,
                 "step": step, "epoch": epoch, "config": cfg.to_dict()}
        path = ckpt.save_checkpoint(cfg.checkpoint_dir, step, state, keep_last=cfg.checkpoint.keep_last)
        writer.write({"kind": "checkpoint", "t": time.time(), "path": str(path), "step": step, "epoch": epoch})
    # Nobody runs ahead of a checkpoint that may be read back (resume in the same allocation).
    dist.barrier()


def progress(writer, env, step, epoch, total_steps, loss, scheduler, meter) -> None:
    rate = meter.windows[-1].imgs_per_s if meter.windows else None
    record = {"kind": "progress", "t": time.time(), "step": step, "epoch": epoch, "total_steps": total_steps,
              "loss": float(loss.float().item()), "lr": scheduler.get_last_lr()[0], "imgs_per_s": rate}
    writer.write(record)
    if env.rank == 0:
        speed = f"{rate:,.0f} imgs/s" if rate else "warming up"
        print(f"step {step}/{total_steps} epoch {epoch} loss {record['loss']:.4f} {speed}", file=sys.stderr)


# ---- records -------------------------------------------------------------------------------------------------------


def start_record(env: Dist) -> dict[str, Any]:
    return {"kind": "start", "t": time.time(), "world_size": env.world_size, "backend": env.backend,
            "device": env.device.type, "host": socket.gethostname(), "pid": os.getpid(), "versions": versions(),
            "gpu": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None}


def versions() -> dict[str, Any]:
    import torchvision

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = None
    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None, "nccl": nccl,
            "python": sys.version.split()[0]}


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def classify(exc: BaseException) -> str:
    """Failure class (ARCHITECTURE.md): oom, nccl, loader, config, crash."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if isinstance(exc, ConfigError):
        return "config"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in low:
        return "oom"
    if "dataloader worker" in low or "shared memory" in low or "bus error" in low or "shm" in low:
        return "loader"
    dist_errors = tuple(getattr(dist, n) for n in ("DistError", "DistBackendError", "DistNetworkError")
                        if hasattr(dist, n))
    if isinstance(exc, dist_errors) or any(s in low for s in ("nccl", "gloo", "connection closed by peer",
                                                                "connection reset by peer", "watchdog")):
        return "nccl"
    return "crash"


def error_record(exc: BaseException) -> dict[str, Any]:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = "".join(traceback.format_exception(exc)[-6:])
    return {"kind": "error", "t": time.time(), "class": classify(exc), "rank": int(os.environ.get("RANK", 0)),
            "type": type(exc).__name__, "message": message[:500], "detail": detail[-4000:]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
