"""NVML sampler logic — UUID mapping, >= 10 Hz sampling, clipping to windows, aggregation — against a fake
``pynvml`` module (the one fake these tests allow: this machine has no GPU)."""

from __future__ import annotations

import sys
import time
import types

import pytest

from autotune.exceptions import GPUError
from autotune.hw import nvml as gpu
from autotune.hw import placement


class FakeNVMLError(Exception):
    pass


def fake_pynvml(n: int = 4, *, util=lambda i, t: 50.0 + 10 * i, unsupported=(), init_error=None):
    """A pynvml stand-in with ``n`` GPUs; ``util(i, t)`` decides GPU i's utilization at wall time t."""
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.NVML_CLOCK_SM = 1
    m.calls = []

    class H:
        def __init__(self, i):
            self.i = i

    def need(name):
        if name in unsupported:
            raise FakeNVMLError(f"{name}: Not Supported")

    def init():
        if init_error:
            raise init_error

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: n
    m.nvmlDeviceGetHandleByIndex = lambda i: H(i)
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h.i:04d}aaaa-1111"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlSystemGetDriverVersion = lambda: "580.1"

    def utilization(h):
        need("util")
        m.calls.append(h.i)
        return types.SimpleNamespace(gpu=util(h.i, time.time()), memory=0)

    m.nvmlDeviceGetUtilizationRates = utilization

    def memory(h):
        need("mem")
        return types.SimpleNamespace(used=(1000 + h.i) * 2**20, total=141 * 2**30)

    m.nvmlDeviceGetMemoryInfo = memory

    def power(h):
        need("power")
        return 300_000 + 1000 * h.i

    m.nvmlDeviceGetPowerUsage = power

    def clock(h, kind):
        need("clock")
        return 1980

    m.nvmlDeviceGetClockInfo = clock

    def gpm_support(h):
        raise FakeNVMLError("GPM: Not Supported")

    m.nvmlGpmQueryDeviceSupport = gpm_support
    return m


@pytest.fixture
def nvml(monkeypatch):
    def make(**kw):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(**kw))
        return gpu.Nvml()

    return make


def test_cuda_visible_devices_indices_and_uuids_map_to_the_right_nvml_devices(nvml):
    lib = nvml(n=4)
    visible = placement.visible_entries(lib.count(), {"CUDA_VISIBLE_DEVICES": "2,GPU-0003,0"})
    assert visible == ["2", "GPU-0003", "0"]
    chosen = placement.select(visible, ["1", "2"])  # --gpus indexes into what CUDA sees
    assert chosen == ["GPU-0003", "0"]
    assert [g.index for g in placement.to_nvml(lib, chosen)] == [3, 0]
    assert [g.uuid for g in placement.to_nvml(lib, ["2"])] == ["GPU-0002aaaa-1111"]
    assert placement.visible_entries(lib.count(), {}) == ["0", "1", "2", "3"]
    assert placement.visible_entries(lib.count(), {"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]  # CUDA stops at -1
    assert placement.visible_entries(lib.count(), {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_bad_gpu_selections_name_what_is_there(nvml):
    lib = nvml(n=2)
    with pytest.raises(GPUError, match=r"--gpus 5: 2 GPU\(s\) visible \(indices 0..1\)"):
        placement.select(["0", "1"], ["5"])
    with pytest.raises(GPUError, match="listed twice"):
        placement.select(["0", "1"], ["0", "0"])
    with pytest.raises(GPUError, match=r"no GPU matches that UUID.*GPU-0000aaaa-1111"):
        placement.to_nvml(lib, ["GPU-ffff"])
    with pytest.raises(GPUError, match="more than one"):
        placement.to_nvml(lib, ["GPU-000"])


def test_sampler_runs_at_10_hz_on_exactly_the_trials_gpus(nvml):
    lib = nvml(n=4)
    gpus = placement.to_nvml(lib, ["1", "3"])
    s = gpu.Sampler(lib, gpus).start()
    time.sleep(1.05)
    samples = s.stop()
    per_gpu = {i: [x for x in samples if x.gpu == i] for i in (0, 1)}
    assert all(len(v) >= 10 for v in per_gpu.values()), {k: len(v) for k, v in per_gpu.items()}
    assert set(lib.lib.calls) == {1, 3}  # GPUs 0 and 2 belong to someone else
    first = per_gpu[0][0]
    assert first.util == 60.0 and first.mem_used_mib == pytest.approx(1001) and first.power_w == pytest.approx(301)
    assert first.sm_clock_mhz == 1980 and first.sm_active is None  # no GPM on this "GPU"
    n = len(samples)
    time.sleep(0.3)
    assert len(s.samples) == n  # stopped means stopped


def test_only_samples_inside_windows_count(nvml):
    t_start = time.time()
    # Busy (90 %) only while "windows" run; idle (0 %) during the launch/warm-up around them.
    spans = []
    lib = nvml(n=2, util=lambda i, t: 90.0 + i if any(a <= t <= b for a, b in spans) else 0.0)
    s = gpu.Sampler(lib, placement.to_nvml(lib, ["0", "1"]), interval=0.02).start()
    time.sleep(0.2)
    spans.append((time.time(), time.time() + 0.3))
    time.sleep(0.5)
    spans.append((time.time(), time.time() + 0.3))
    time.sleep(0.5)
    samples = s.stop()
    assert any(x.util == 0.0 for x in samples) and samples[0].t >= t_start
    windows = [{"window": i, "t0": a, "t1": b} for i, (a, b) in enumerate(spans)]
    attrs = gpu.summarize(samples, windows, 2)
    assert attrs["util_available"] is True
    assert attrs["util_p50_per_gpu"] == [90.0, 91.0]
    assert attrs["util_mean"] == pytest.approx(90.5, abs=0.5)
    assert attrs["mem_used_max_mib"] == pytest.approx(1001)
    assert attrs["power_mean_w"] == pytest.approx(300.5, abs=0.5)
    assert attrs["sm_active_mean"] is None
    unclipped = sum(x.util for x in samples) / len(samples)
    assert unclipped < 60  # what an average over the whole run would have claimed


def test_unsupported_queries_are_dropped_not_invented(nvml):
    lib = nvml(n=1, unsupported=("power", "clock"))
    s = gpu.Sampler(lib, placement.to_nvml(lib, ["0"]))
    s.sample_once()
    s.sample_once()
    attrs = gpu.summarize(s.samples, [{"t0": 0, "t1": time.time() + 1}], 1)
    assert attrs["power_mean_w"] is None and attrs["sm_clock_mean_mhz"] is None
    assert attrs["util_mean"] == 50.0


def test_without_nvml_utilization_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=FakeNVMLError("NVML Shared Library Not Found")))
    lib = gpu.Nvml()
    assert not lib.available and "Not Found" in lib.reason
    assert placement.to_nvml(lib, ["0"]) == []
    s = gpu.Sampler(lib, []).start()
    assert not s.active and s.stop() == []
    attrs = gpu.summarize([], [{"t0": 0.0, "t1": 1.0}], 0)
    assert attrs == {"util_available": False, "util_mean": None, "nvml_samples": 0}


def test_this_machine_without_a_gpu_sees_none_and_says_why_nvml_is_missing():
    lib = gpu.Nvml()  # the real library on this machine: nvidia-ml-py installed, no driver (CI)
    if lib.available and lib.count():
        pytest.skip("a GPU machine: NVML is available here")
    assert placement.gpu_count(lib) == 0
    assert (lib.reason is not None) == (not lib.available)  # a reason exactly when there is no NVML


def test_gpm_sm_activity_where_supported_without_leaking_samples(monkeypatch):
    m = fake_pynvml(n=1)
    live = set()

    class Req:
        def __init__(self):
            self.metrics = [types.SimpleNamespace(metricId=0, value=0.0)]

    def alloc():
        s = object()
        live.add(id(s))
        m._keep = [*getattr(m, "_keep", []), s]
        return s

    def metrics_get(req):
        assert req.sample1 is not req.sample2 and req.metrics[0].metricId == m.NVML_GPM_METRIC_SM_UTIL
        req.metrics[0].value = 77.0

    m.nvmlGpmQueryDeviceSupport = lambda h: types.SimpleNamespace(isSupportedDevice=1)
    m.nvmlGpmSampleAlloc = alloc
    m.nvmlGpmSampleGet = lambda h, s: s
    m.nvmlGpmSampleFree = lambda s: live.discard(id(s))
    m.c_nvmlGpmMetricsGet_t = Req
    m.NVML_GPM_METRICS_GET_VERSION, m.NVML_GPM_METRIC_SM_UTIL = 1, 2
    m.nvmlGpmMetricsGet = metrics_get
    monkeypatch.setitem(sys.modules, "pynvml", m)
    lib = gpu.Nvml()
    s = gpu.Sampler(lib, placement.to_nvml(lib, ["0"]))
    for _ in range(4):
        s.sample_once()
    s.stop()
    assert [x.sm_active for x in s.samples] == [None, 77.0, 77.0, 77.0]  # a GPM figure needs two samples
    assert gpu.summarize(s.samples, [{"t0": 0, "t1": time.time() + 1}], 1)["sm_active_mean"] == 77.0
    assert not live  # every GPM sample freed
