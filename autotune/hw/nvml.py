"""NVML in the parent: what a trial's GPUs did while its windows were timed.

The job measures throughput; the tuner measures the GPUs, because NVML belongs to the host and not to any rank.
A sampler thread records timestamped samples (utilization, memory used, power, SM clock, and GPM SM activity where
the GPU supports it) of exactly the trial's GPUs, and only samples that fall inside the job's measurement windows
count: warm-up, cudnn autotuning and the launch would otherwise drag the figures down.

GPUs are matched by UUID. ``CUDA_VISIBLE_DEVICES`` may hold indices or (prefixes of) ``GPU-``/``MIG-`` UUIDs; indices
are NVML's (PCI bus) order, which is why trials are launched with the resolved UUIDs rather than indices.
Without NVML (a CPU machine, a container without the driver library) utilization is *unavailable* — reported so,
never estimated.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

SAMPLE_INTERVAL_S = 0.1
"""10 Hz: NVML's utilization counter itself covers the last 1/6 s to 1 s, so sampling faster buys nothing."""


@dataclass(kw_only=True)
class Gpu:
    index: int
    """NVML index (PCI bus order)."""

    uuid: str
    name: str
    handle: Any = field(default=None, repr=False, compare=False)


@dataclass(kw_only=True)
class Sample:
    t: float
    """Wall time (``time.time()``), the clock the job stamps its windows with."""

    gpu: int
    """Position of the GPU in the trial's GPU list."""

    util: float | None = None
    """Percent of the last sample period during which a kernel ran (``nvmlDeviceGetUtilizationRates().gpu``)."""

    mem_used_mib: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    sm_active: float | None = None
    """GPM ``SM_UTIL``: percent of SMs busy since the previous sample (Hopper and newer)."""


class Nvml:
    """An initialized NVML library (the ``pynvml`` module of nvidia-ml-py), or the reason there is none."""

    def __init__(self):
        self.lib = None
        self.reason: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.lib = pynvml
        except Exception as e:
            self.reason = f"{type(e).__name__}: {e}".strip().rstrip(":")

    @property
    def available(self) -> bool:
        return self.lib is not None

    def count(self) -> int:
        return self.lib.nvmlDeviceGetCount() if self.lib else 0

    def all_gpus(self) -> list[Gpu]:
        if not self.lib:
            return []
        out = []
        for i in range(self.lib.nvmlDeviceGetCount()):
            h = self.lib.nvmlDeviceGetHandleByIndex(i)
            out.append(Gpu(index=i, uuid=_text(self.lib.nvmlDeviceGetUUID(h)),
                           name=_text(self.lib.nvmlDeviceGetName(h)),
                           handle=h))
        return out

    def driver_version(self) -> str | None:
        try:
            return _text(self.lib.nvmlSystemGetDriverVersion()) if self.lib else None
        except Exception:
            return None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Sampler:
    """Samples the given GPUs at ``interval`` seconds on a daemon thread between ``start()`` and ``stop()``."""

    def __init__(self, nvml: Nvml, gpus: list[Gpu], interval: float = SAMPLE_INTERVAL_S):
        self.nvml, self.gpus, self.interval = nvml, [g for g in gpus if g.handle is not None], interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Each NVML query that a GPU does not support is dropped after its first failure instead of failing 10x/s.
        self._unsupported: set[tuple[int, str]] = set()
        self._gpm_prev: dict[int, Any] = {}
        self._gpm_ok = {i: self._gpm_supported(g) for i, g in enumerate(self.gpus)}

    @property
    def active(self) -> bool:
        return bool(self.gpus) and self.nvml.available

    def _gpm_supported(self, gpu: Gpu) -> bool:
        lib = self.nvml.lib
        try:
            return bool(lib.nvmlGpmQueryDeviceSupport(gpu.handle).isSupportedDevice)
        except Exception:
            return False

    def _query(self, i: int, what: str, fn):
        if (i, what) in self._unsupported:
            return None
        try:
            return fn()
        except Exception:
            self._unsupported.add((i, what))
            return None

    def _gpm_sm_active(self, i: int, gpu: Gpu) -> float | None:
        if not self._gpm_ok.get(i):
            return None
        lib = self.nvml.lib
        try:
            cur = lib.nvmlGpmSampleGet(gpu.handle, lib.nvmlGpmSampleAlloc())
            prev, self._gpm_prev[i] = self._gpm_prev.get(i), cur
            if prev is None:
                return None
            req = lib.c_nvmlGpmMetricsGet_t()
            req.version, req.numMetrics, req.sample1, req.sample2 = lib.NVML_GPM_METRICS_GET_VERSION, 1, prev, cur
            req.metrics[0].metricId = lib.NVML_GPM_METRIC_SM_UTIL
            try:
                lib.nvmlGpmMetricsGet(req)
            finally:
                lib.nvmlGpmSampleFree(prev)
            return float(req.metrics[0].value)
        except Exception:
            self._gpm_ok[i] = False
            return None

    def sample_once(self) -> None:
        lib = self.nvml.lib
        for i, g in enumerate(self.gpus):
            h = g.handle
            util = self._query(i, "util", lambda h=h: float(lib.nvmlDeviceGetUtilizationRates(h).gpu))
            mem = self._query(i, "mem", lambda h=h: lib.nvmlDeviceGetMemoryInfo(h).used / 2**20)
            power = self._query(i, "power", lambda h=h: lib.nvmlDeviceGetPowerUsage(h) / 1000.0)
            clock = self._query(i, "clock", lambda h=h: float(lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_SM)))
            sm = self._gpm_sm_active(i, g)
            self.samples.append(Sample(t=time.time(), gpu=i, util=util, mem_used_mib=mem, power_w=power,
                                       sm_clock_mhz=clock, sm_active=sm))

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t)))

    def start(self) -> Sampler:
        if self.active:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        lib = self.nvml.lib
        for s in self._gpm_prev.values():
            with contextlib.suppress(Exception):
                lib.nvmlGpmSampleFree(s)
        self._gpm_prev.clear()
        return self.samples


def summarize(samples: list[Sample], windows: list[dict], n_gpus: int) -> dict[str, Any]:
    """User attrs from the samples inside the windows' [t0, t1]: means over all the trial's GPUs, p50 per GPU.

    Returns ``util_available=False`` (and no util figures) when nothing was sampled inside a window — which is what
    happens without NVML, and also for a trial killed before its first window.
    """
    spans = [(float(w["t0"]), float(w["t1"])) for w in windows if "t0" in w and "t1" in w]
    inside = [s for s in samples if any(t0 <= s.t <= t1 for t0, t1 in spans)]
    utils = [s.util for s in inside if s.util is not None]
    if not utils:
        return {"util_available": False, "util_mean": None, "nvml_samples": len(inside)}

    def mean(attr):
        xs = [getattr(s, attr) for s in inside if getattr(s, attr) is not None]
        return round(statistics.fmean(xs), 2) if xs else None

    per_gpu = []
    for i in range(n_gpus):
        xs = [s.util for s in inside if s.gpu == i and s.util is not None]
        per_gpu.append(round(statistics.median(xs), 2) if xs else None)
    mems = [s.mem_used_mib for s in inside if s.mem_used_mib is not None]
    return {
        "util_available": True,
        "util_mean": round(statistics.fmean(utils), 2),
        "util_p50_per_gpu": per_gpu,
        "mem_used_max_mib": round(max(mems), 1) if mems else None,
        "power_mean_w": mean("power_w"),
        "sm_clock_mean_mhz": mean("sm_clock_mhz"),
        "sm_active_mean": mean("sm_active"),
        "nvml_samples": len(inside),
    }


def fingerprint(nvml: Nvml, gpus: list[Gpu]) -> dict[str, Any]:
    """Host side of the hardware/software fingerprint (the job adds torch/CUDA/NCCL versions)."""
    import platform
    import socket

    return {
        "gpu_model": gpus[0].name if gpus else None,
        "gpu_count": len(gpus),
        "gpu_uuids": [g.uuid for g in gpus],
        "driver": nvml.driver_version(),
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
    }
