"""The profile's split of a step (``trainer.profile``) from a trace's events: each moment counted once, in the order
the module gives (on a GPU: the step's work, then copies, then exposed communication, then idle, waiting for data or
the host's launch gaps). The traces are made up here: a CPU machine has no device timeline to record one from; the
real CPU run is tested in test_job.py."""

from types import SimpleNamespace

import pytest
import torch

from trainer.profile import DATA, PARTS, STEP, device_split, host_split, largest

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def event(name, start, end, *, device=CPU, thread=1, parent=None, launched_by=None, number=0):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           thread=thread, cpu_parent=parent, id=number,
                           linked_correlation_id=launched_by.id if launched_by is not None else 0)


def test_a_gpu_step_is_split_on_the_devices_timeline_each_moment_once():
    step = event(STEP, 0, 100)
    optimizer = event("Optimizer.step#SGD.step", 60, 75, parent=step)
    launch = event("cudaLaunchKernel", 61, 62, parent=optimizer, number=7)
    events = [step, event(DATA, 0, 30, parent=step), optimizer, launch,
              event("Memcpy HtoD (Pinned -> Device)", 25, 32, device=CUDA),  # the last 2 µs hidden by the compute
              event("volta_sgemm", 30, 60, device=CUDA),
              event("multi_tensor_apply_kernel", 60, 70, device=CUDA, launched_by=launch),
              event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 80, device=CUDA),  # 10 µs not overlapped
              event(STEP, 0, 100, device=CUDA)]  # the step's range mirrored on the device: no work of its own
    split = device_split(events)
    assert split == {"data": 0.25, "copy": 0.05, "compute": 0.3, "optimizer": 0.1, "communication": 0.1,
                     "launch": 0.2}
    assert sum(split.values()) == pytest.approx(1.0)
    assert largest(split) == ("compute", 0.3)


def test_a_cpu_step_is_split_on_the_ranks_main_thread_and_what_it_cannot_see_is_not_measured():
    step = event(STEP, 0, 100)
    events = [step, event(DATA, 0, 20, parent=step), event("aten::convolution", 20, 50, parent=step),
              event("Optimizer.step#SGD.step", 80, 95, parent=step),
              event("gloo:all_reduce", 40, 70, thread=2)]  # the main thread waits for it from 50 to 70
    split = host_split(events)
    assert split == {"data": 0.2, "copy": None, "compute": 0.45, "optimizer": 0.15, "communication": 0.2,
                     "launch": None}
    assert set(split) == set(PARTS)
    assert host_split([]) == dict.fromkeys(PARTS) and largest(dict.fromkeys(PARTS)) is None


def test_a_profiler_that_cannot_start_costs_the_split_not_the_trial(monkeypatch):
    """The trial is measured before its profile runs: a profiler that fails (another one already running, no CUPTI
    on a GPU) leaves a split that says why, and the steps run on."""
    import trainer.profile as profile_module

    def refuses(**kwargs):
        raise RuntimeError("Can't disable Kineto profiler when it's not running\nsecond line")

    monkeypatch.setattr(profile_module, "profile", refuses)
    ran = []
    split = profile_module.profile_steps(lambda: ran.append(torch.ones(2).sum()), 3, torch.device("cpu"))
    assert len(ran) == 3 and split["steps"] == 3
    assert split["error"] == "RuntimeError: Can't disable Kineto profiler when it's not running"
    assert {p: split[p] for p in PARTS} == dict.fromkeys(PARTS) and largest(split) is None
