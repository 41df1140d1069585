"""Which GPUs a run uses: ``--gpus`` and ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs) resolved to NVML
devices. Indices are NVML's (PCI bus) order, which is why runs are launched with the resolved UUIDs rather than
indices."""

from __future__ import annotations

import os
from pathlib import Path

from autotune.exceptions import GPUError, LaunchError
from autotune.hw.nvml import Gpu, Nvml


def parse_gpu_list(text: str | None) -> list[str] | None:
    """``"0,1"`` / ``"GPU-ab12,GPU-cd34"`` → entries; ``None`` or blank → ``None`` (meaning: all visible)."""
    if text is None:
        return None
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    return items


def visible_entries(count: int, env: dict[str, str] | None = None) -> list[str]:
    """What CUDA would see: ``CUDA_VISIBLE_DEVICES`` entries, or indices 0..count-1 when it is unset."""
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return [str(i) for i in range(count)]
    entries = []
    for s in cvd.split(","):
        s = s.strip()
        # CUDA stops at the first invalid entry (e.g. -1 hides everything after it).
        if not s or (s.lstrip("-").isdigit() and int(s) < 0):
            break
        entries.append(s)
    return entries


def select(visible: list[str], selection: list[str] | None) -> list[str]:
    """The trial's ``CUDA_VISIBLE_DEVICES`` entries. ``selection`` (``--gpus``) indexes into what CUDA sees (so
    ``--gpus 1`` under ``CUDA_VISIBLE_DEVICES=2,3`` is physical GPU 3) or names UUIDs directly."""
    if selection is None:
        return list(visible)
    chosen = []
    for s in selection:
        if s.isdigit():
            if int(s) >= len(visible):
                raise GPUError(f"--gpus {s}: {len(visible)} GPU(s) visible"
                               f"{f' (indices 0..{len(visible) - 1})' if visible else ''}; "
                               "pick from those or fix CUDA_VISIBLE_DEVICES")
            chosen.append(visible[int(s)])
        else:
            chosen.append(s)
    if len(set(chosen)) != len(chosen):
        raise GPUError(f"--gpus {','.join(selection)}: a GPU is listed twice; list each once")
    return chosen


def to_nvml(nvml: Nvml, entries: list[str]) -> list[Gpu]:
    """NVML devices for CUDA_VISIBLE_DEVICES-style entries (indices are NVML's PCI order; UUIDs may be prefixes)."""
    if not nvml.available:
        return []
    devices = nvml.all_gpus()
    out = []
    for entry in entries:
        if entry.isdigit():
            idx = int(entry)
            if idx >= len(devices):
                raise GPUError(f"GPU {entry}: NVML sees {len(devices)} GPU(s); fix CUDA_VISIBLE_DEVICES or --gpus")
            out.append(devices[idx])
        elif entry.startswith("MIG-"):
            # MIG instances have no utilization counters of their own; keep the UUID so the trial still runs there.
            out.append(Gpu(index=-1, uuid=entry, name="MIG instance", handle=None))
        else:
            want = entry if entry.startswith("GPU-") else f"GPU-{entry}"
            match = [d for d in devices if d.uuid.startswith(want)]
            if len(match) != 1:
                known = ", ".join(d.uuid for d in devices) or "none"
                raise GPUError(f"GPU {entry}: {'no' if not match else 'more than one'} GPU matches that UUID "
                               f"(NVML sees: {known})")
            out.append(match[0])
    return out




def place(visible: list[str], selection: list[str] | None, nproc: int | None) -> tuple[int, list[str] | None]:
    """(ranks per node, the run's ``CUDA_VISIBLE_DEVICES`` entries or None without GPUs): ``--gpus`` picked from
    what is visible, ``nproc`` of them (default: all of them; 2 gloo ranks on a machine without GPUs)."""
    if selection and not visible:
        raise GPUError(f"--gpus {','.join(selection)}: no GPU visible on this machine (CUDA_VISIBLE_DEVICES="
                       f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); drop --gpus to run on the CPU")
    entries = select(visible, selection)
    nproc = nproc if nproc is not None else (len(entries) if entries else 2)
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node {nproc}: must be >= 1")
    if not entries:
        return nproc, None
    if nproc > len(entries):
        raise GPUError(f"--nproc-per-node {nproc}: only {len(entries)} GPU(s) selected ({','.join(entries)}); lower "
                       "it or select more with --gpus")
    return nproc, entries[:nproc]


def gpu_count(nvml: Nvml) -> int:
    """GPUs on this host, without importing torch when there is clearly none (keeps a CPU start fast); NVML when it
    is there, else CUDA (a container without the NVML library)."""
    if nvml.available:
        return nvml.count()
    if not Path("/dev/nvidiactl").exists() and not Path("/proc/driver/nvidia").exists():
        return 0
    import torch

    return torch.cuda.device_count()
