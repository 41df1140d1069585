"""The records a run writes about itself, for the built-in job (``trainer.job``) and a user's script
(``trainer.runtime``) alike: the process's place in the run (``Dist``), the ``start`` record, the ``summary`` record
with its loss check and peak memory, and the non-finite loss counters both keep on the device."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.learning import DEFAULT_HINT, check_loss, window_losses
from trainer.meter import ThroughputMeter
from trainer.protocol import Kind

DIVERGED_STEPS = 5
"""Consecutive non-finite step losses at the end of a run that make it diverged. A diverged run (NaN/inf weights)
stays non-finite every step after; a few in a row tell it from a forward pass that overflowed once (the GradScaler
skips that step and the weights stay finite). Either way the summary's ``loss_finite`` is False when a non-finite
loss falls inside the measured windows: the loss is computed before anything is scaled, so a healthy run has none
there (an fp16 run at too high a learning rate can have many non-finite steps that are never five in a row:
``docs/benchmarks.md``)."""


@dataclass(kw_only=True, frozen=True)
class Dist:
    """This process's place in the run, fixed for the life of the process (``trainer.apply`` sets it up)."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    init_s: float = 0.0
    """Seconds the process group took to set up (with NCCL: its communicators, made eagerly)."""


def count_nonfinite(loss: torch.Tensor, run: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's update of the non-finite loss counters: ``run`` (consecutive non-finite steps, 0 after a finite one)
    and ``total``. Pure tensor arithmetic on the device: no ``.item()``, no branch on the value, so the host never
    waits for the GPU; a per-step sync would stall the launch queue every step and cost the throughput we measure."""
    bad = (~torch.isfinite(loss)).all().to(run.dtype)
    return (run + 1) * bad, total + bad


def loss_diverged(run: int, steps_run: int) -> bool:
    """Diverged: the last DIVERGED_STEPS step losses were all non-finite, or, in a run shorter than that, all were."""
    return steps_run > 0 and run >= min(DIVERGED_STEPS, steps_run)


def summary_record(meter: ThroughputMeter, env: Dist, *, mode: str, loss: torch.Tensor,
                   nonfinite: tuple[torch.Tensor, torch.Tensor] | None, steps_run: int, steps: int, epochs: int,
                   global_batch: int | None, unit: str = "images", extra: dict[str, Any] | None = None,
                   loss_hint: str = DEFAULT_HINT) -> dict[str, Any]:
    """A run's summary record, for the built-in job and a user's script alike: the meter's figures, the loss
    check, peak memory per rank. Collective: every rank calls it (the worst rank's loss counts). ``nonfinite``:
    the (run, total) counters of count_nonfinite; None (loader mode, no loss) judges ``loss`` alone, as one step."""
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
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # the worst rank decides, as for every other judgement
    run, total = (int(v) for v in counts.tolist())
    measured = meter.summary()
    # A figure is a training figure only if the loss stayed finite where it was measured and at the end, and did
    # not rise across the windows (trainer.learning: one rule for the built-in job and a user's script).
    check = check_loss(window_losses(meter.windows), nonfinite_steps=measured["loss_nonfinite_in_windows"],
                       diverged_steps=run if loss_diverged(run, steps_run) else 0, hint=loss_hint)
    return {"kind": Kind.SUMMARY, "t": time.time(), "mode": mode, "world_size": env.world_size, "unit": unit,
            **measured, **(extra or {}), "steps": steps, "epochs": epochs, "loss": loss_value,
            "loss_finite": check.ok, "loss_reason": check.reason, "loss_nonfinite_steps": total,
            "loss_nonfinite_run": run, "peak_mem_bytes": peaks,
            "peak_mem_kind": "cuda_max_allocated" if env.device.type == "cuda" else "host_max_rss",
            "global_batch": global_batch, "versions": versions()}


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
