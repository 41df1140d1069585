"""The measurement protocol's decisions, driven step by step in one process (world of one, CPU)."""

import itertools
import time

import pytest
import torch

from trainer.config import MeasureConfig
from trainer.meter import ThroughputMeter


def drive(meter, step_times, limit=10_000):
    """Feed ``step_times`` (seconds, cycled) to the meter by sleeping; returns the emitted records."""
    for i, dt in zip(range(limit), itertools.cycle(step_times)):
        if meter.done:
            break
        time.sleep(dt)
        meter.step()
    return meter


def make(records, **cfg):
    base = dict(warmup_min_steps=2, settle_steps=2, settle_span_s=0.02, settle_tolerance=0.5, window_s=0.05,
                windows=3, max_windows=6, spread_target=0.5)
    base.update(cfg)
    return ThroughputMeter(MeasureConfig(**base), images_per_step=8, device=torch.device("cpu"),
                           emit=records.append)


def test_prefetched_steps_are_never_compared():
    records = []
    meter = make(records, warmup_min_steps=0)
    meter.prefetched_steps = 12
    drive(meter, [0.002])
    assert meter.warmup_steps >= 12 + 2 * 2


def test_windows_count_images_and_finish_after_the_protocol():
    records = []
    meter = drive(make(records), [0.004])
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "warmup_done" and kinds.count("window") == len(meter.windows) >= 3
    for r in records[1:]:
        assert r["images"] == r["steps"] * 8
    summary = meter.summary()
    assert summary["windows"] == len(meter.windows) and len(summary["windows_used"]) >= 3


def test_a_slow_start_is_left_out_once_the_latest_windows_agree():
    records = []
    meter = make(records, spread_target=0.5, window_s=0.2, settle_span_s=0.1, max_windows=8)
    # Warm-up settles on fast steps (2 + 2 spans of 5), then a 5x slower patch (a late recompile) spoils the first
    # windows, then steady again: the summary stands on the steady tail, not on the median of everything.
    # (Targets are loose so that sleep jitter on a loaded machine cannot decide the outcome.)
    meter = drive(meter, [0.02] * 14 + [0.1] * 12 + [0.02] * 1000)
    summary = meter.summary()
    assert summary["windows"] > 3
    assert summary["windows_used"] == [w.index for w in meter.windows[-3:]]
    assert summary["spread"] <= 0.5
    assert summary["imgs_per_s"] > 2 * min(w.imgs_per_s for w in meter.windows)


def test_window_re_aim_is_bounded():
    records = []
    meter = make(records, window_s=0.05, windows=4, max_windows=4, spread_target=10)
    drive(meter, [0.001] * 30 + [0.01] * 1000)
    steps = [w.steps for w in meter.windows]
    for a, b in zip(steps, steps[1:]):
        assert b <= 2 * a and b >= a // 2


def test_time_spent_paused_is_not_a_warm_up_step():
    records = []
    # Tolerance 100 %: sleep jitter on a loaded machine must not matter; a counted pause would make one span ~15x
    # the other.
    meter = make(records, warmup_min_steps=0, settle_steps=3, settle_span_s=0.0, settle_tolerance=1.0)
    for _ in range(3):
        time.sleep(0.02)
        meter.step()
    with meter.paused():  # a validation pass in the middle of warm-up
        time.sleep(1.0)
    for _ in range(3):
        time.sleep(0.02)
        meter.step()
    assert meter.state == "measure"  # two like spans of 3 steps: settled, the pause did not count
    assert max(meter._step_times) < 0.5
