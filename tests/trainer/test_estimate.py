"""The estimator and its stopping rule on synthetic traces of known mean (``tests.helpers.traces``), through the
real meter on a clock of the trace's own: its 95 % interval covers the true figure over the span it stands on, and a
steady pace is known sooner than a noisy one."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import pytest

from tests.helpers.traces import Bursty, Trace, measure
from trainer.estimate import LAG1_Z, MIN_BATCHES, Interval, estimate, stop, t_quantile, truncation

SEEDS = range(200)


@dataclass
class W:
    images: float
    seconds: float
    turn: bool = False


@pytest.fixture(scope="module")
def runs():
    """Each kind of trace measured once per seed (shared by the tests below: ~10 s in all)."""
    return {kind: [measure(Bursty(seed) if kind == "bursty" else Trace(kind, seed)) for seed in SEEDS]
            for kind in ("steady", "bursty", "warmup", "trend")}


@pytest.mark.parametrize("kind", ["steady", "bursty", "warmup", "trend"])
def test_the_interval_covers_the_true_figure_over_its_span_in_at_least_90_percent_of_traces(runs, kind):
    covered = [m.meter.estimate(final=True).low <= m.true_rate <= m.meter.estimate(final=True).high
               for m in runs[kind]]
    assert sum(covered) >= 0.9 * len(covered), f"{kind}: {sum(covered)} of {len(covered)} intervals covered"


def test_a_steady_pace_is_known_sooner_than_a_noisy_one(runs):
    took = {kind: statistics.median(m.seconds for m in ms) for kind, ms in runs.items()}
    assert took["steady"] < min(took["bursty"], took["warmup"]), took
    assert all(m.meter.ended == "precise" for m in runs["steady"])


def test_a_noisy_loader_that_reaches_the_cap_reports_its_interval_as_it_is(runs):
    capped = [m for m in runs["bursty"] if m.meter.ended == "capped"]
    assert capped, "the bursty trace is meant to reach the cap at a target of 2 %"
    for m in capped:
        summary = m.meter.summary()
        assert summary["ci_half_width"] > 0.02 and not summary["precise"] and summary["ended"] == "capped"
        assert 30.0 <= m.seconds < 30.0 + 2 * 0.5 + 1.0  # the window in flight at the cap, and a turn at most


def test_the_warm_up_is_found_from_the_data_and_left_out(runs):
    starts = [m.meter.estimate(final=True).start for m in runs["warmup"]]
    assert statistics.median(starts) >= 5  # twice as slow at first, settling over ~4 windows
    assert statistics.median(m.meter.estimate(final=True).start for m in runs["steady"]) == 0


def test_epoch_turns_are_charged_at_the_rate_they_recur_over_the_real_epoch():
    steady = [W(80, 0.5)] * 20  # 160 samples/s between turns
    turn = W(16, 1.1, turn=True)  # 0.1 s at the steady pace, 1.0 s beyond it
    once = estimate([*steady[:10], turn, *steady[10:]], epoch_images=1600, final=True)
    thrice = estimate([*steady[:5], turn, *steady[5:10], turn, *steady[10:15], turn, *steady[15:]],
                      epoch_images=1600, final=True)
    # An epoch of 1,600 samples: 10 s at the steady pace plus 1 s of turn, whatever the span holds.
    assert once.value == pytest.approx(1600 / 11) and thrice.value == pytest.approx(1600 / 11)
    assert once.steady == pytest.approx(160) and thrice.turns == 3 and thrice.turn_s == pytest.approx(1.0)
    # One turn says nothing of its own spread: the interval allows for it costing from nothing to twice as much.
    assert once.half_width > thrice.half_width
    # Without an epoch to charge over (an endless stream), the turn is no part of the figure.
    assert estimate([*steady, turn], final=True).value == pytest.approx(160)


def test_the_first_epochs_start_is_charged_where_no_turn_was_measured():
    est = estimate([W(80, 0.5)] * 20, epoch_images=1600, first_turn_s=2.0, final=True)
    assert est.value == pytest.approx(1600 / 12) and est.turns == 0 and est.turn_s == 2.0


def test_mser_cuts_a_slow_start_at_a_multiple_of_its_batch_and_never_past_half():
    slow = [W(80, 1.0)] * 7 + [W(80, 0.5)] * 23
    assert truncation(slow) == 10  # the first multiple of 5 past the slow windows
    assert truncation([W(80, 1.0)] * 20 + [W(80, 0.5)] * 10) <= 15
    assert truncation([W(80, 0.5)] * 9) == 0  # too few to judge


def test_no_interval_before_enough_batches_unless_final():
    assert estimate([W(80, 0.5)] * (MIN_BATCHES - 1)) is None
    est = estimate([W(80, 0.5), W(80, 0.55)] * 2, final=True)
    assert est is not None and est.batches >= 2


def test_correlated_windows_are_batched_until_their_batches_are_nearly_independent():
    # A pace that wanders (each window like the one before: AR(1), 0.7): single windows are far from independent.
    rng, x, windows = random.Random(0), 0.0, []
    for _ in range(240):
        x = 0.7 * x + rng.gauss(0, 0.02)
        windows.append(W(80, 0.5 * (1 + x)))
    est = estimate(windows, truncate=False)
    assert est is not None and est.batch_windows >= 8 and est.lag1 <= LAG1_Z / est.batches**0.5
    single = 2.045 * statistics.stdev(w.images / w.seconds for w in windows) / len(windows) ** 0.5 / est.value
    assert est.half_width > 1.5 * single  # what treating the windows as independent would have claimed


def test_t_quantiles():
    assert t_quantile(1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile(2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile(9) == pytest.approx(2.262, abs=2e-3)
    assert t_quantile(29) == pytest.approx(2.045, abs=2e-3)


def test_intervals_tie_where_they_overlap_and_a_ratio_carries_both_uncertainties():
    a, b, c = Interval(100.0, 0.02), Interval(103.0, 0.02), Interval(110.0, 0.02)
    assert a.ties(b) and b.ties(a) and a.below(c) and not c.below(a) and not a.ties(c)
    r = c.over(a)
    assert r.value == pytest.approx(1.1) and r.half_width == pytest.approx(0.02 * 2**0.5)
    assert str(Interval(6853.0, 0.012)) == "6853 ± 1.2%"


def test_a_measurement_stops_when_precise_or_capped():
    est = estimate([W(80, 0.5)] * 12)
    assert stop(est, precision=0.02, elapsed_s=6, max_s=30) == "precise"
    assert stop(None, precision=0.02, elapsed_s=6, max_s=30) is None
    assert stop(None, precision=0.02, elapsed_s=30, max_s=30) == "capped"


def test_a_measurement_stops_once_only_a_turn_seen_once_keeps_its_interval_wider_than_asked():
    """A script's own loader on epochs longer than a trial: no turn is measured, and the first epoch's start is charged
    per epoch with its spread unknown (``UNKNOWN_SHARE``). More windows cannot narrow that part of the interval:
    once the windows' own part is within the precision, the measurement ends (``turn``) with its interval as it is,
    instead of running to its cap. Where the charge could still come within the precision, the windows go on."""
    windows = [W(80 + i % 2, 0.5) for i in range(40)]
    est = estimate(windows, epoch_images=1600, first_turn_s=2.0)  # a 2 s start beside a 10 s epoch
    assert est.windows_half_width <= 0.02 < est.floor < est.half_width
    assert stop(est, precision=0.02, elapsed_s=6, max_s=30) == "turn"
    # The same start beside an epoch 20 times longer: within ±2 % once the windows are surer.
    long = estimate([W(80 + 6 * (i % 2), 0.5) for i in range(16)], epoch_images=32000, first_turn_s=2.0)
    assert long.windows_half_width <= 0.02 < long.half_width and long.floor < 0.02
    assert stop(long, precision=0.02, elapsed_s=6, max_s=30) is None
    # A turn measured in the span says the epochs are short enough for more of them to come: the windows go on.
    turn = W(16, 1.1, turn=True)
    for turns in ([*windows[:20], turn, *windows[20:]], [*windows[:10], turn, *windows[10:30], turn, *windows[30:]]):
        est = estimate(turns, epoch_images=1600)
        assert est.floor == 0.0 and est.windows_half_width == est.half_width
        assert stop(est, precision=0.02, elapsed_s=6, max_s=30) != "turn"
