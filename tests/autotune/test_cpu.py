"""The host's CPU over a trial's measured windows (``autotune.hw.cpu``)."""

import itertools
import time

from autotune.hw.cpu import CpuSampler, Reading, busy_share, read

STAT = """cpu  900 0 300 1800 0 0 0 0 0 0
cpu0 400 0 100 500 0 0 0 0 0 0
cpu1 500 0 200 1300 0 0 0 0 0 0
intr 12345
ctxt 678
"""


def test_the_cores_ticks_are_those_of_the_trials_cores_idle_and_io_wait_not_busy(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert (read({0}, stat).busy, read({0}, stat).total) == (500, 1000)
    both = read({0, 1}, stat)
    assert (both.busy, both.total) == (1200, 3000)  # the aggregate "cpu" line is not counted again
    assert read({0}, tmp_path / "none") is None  # no /proc/stat: unavailable, never estimated


def test_the_busy_share_is_the_difference_of_the_readings_inside_the_windows_only():
    readings = [Reading(t=0.5, busy=0, total=100),  # before the windows: the warm-up, not counted
                Reading(t=1.0, busy=100, total=200), Reading(t=2.0, busy=190, total=300),
                Reading(t=3.0, busy=280, total=400), Reading(t=9.0, busy=280, total=1000)]
    windows = [{"t0": 1.0, "t1": 2.0}, {"t0": 2.0, "t1": 3.0}]
    assert busy_share(readings, windows) == 0.9
    assert busy_share(readings, [{"t0": 1.0, "t1": 1.5}]) is None  # one reading inside: no difference to take
    assert busy_share(readings, []) is None


def test_the_sampler_reads_this_machines_cores_while_it_runs():
    sampler = CpuSampler(interval=0.01).start()
    t0 = time.time()
    while time.time() - t0 < 0.2:
        sum(i * i for i in range(1000))  # keep one core busy
    readings = sampler.stop()
    assert len(readings) >= 3 and all(b.total >= a.total for a, b in itertools.pairwise(readings))
    share = busy_share(readings, [{"t0": readings[0].t, "t1": readings[-1].t}])
    assert share is not None and 0.0 < share <= 1.0
