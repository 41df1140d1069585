"""The measurement protocol's decisions, driven step by step in one process (world of one, CPU): mostly on a clock
of the test's own (``clock=``), so that nothing depends on how loaded the machine is; a script's own loader and the
slowest of two ranks in real time."""

import itertools
import random
import statistics
import time

import pytest
import torch

from tests.helpers.traces import Clock
from trainer.config import MeasureConfig
from trainer.estimate import MIN_BATCHES
from trainer.meter import PACE_STEPS, ThroughputMeter, timed_batches


def make(records=None, *, clock=None, **cfg):
    base = {"warmup_min_steps": 2, "window_s": 0.05, "precision": 0.02, "max_s": 5.0}
    base.update(cfg)
    return ThroughputMeter(MeasureConfig(**base), images_per_step=8, device=torch.device("cpu"),
                           emit=(records if records is not None else []).append, clock=clock or Clock())


def drive(meter, step_times, limit=100_000, loss=None):
    """Feed ``step_times`` (seconds, cycled) to the meter on its clock; returns the meter."""
    for _, dt in zip(range(limit), itertools.cycle(step_times), strict=False):
        if meter.done:
            break
        meter.clock.t += dt
        meter.step(loss)
    return meter


def test_the_prefetched_steps_are_discarded_and_then_windows_start():
    records = []
    meter = make(records, warmup_min_steps=0)
    meter.prefetched_steps = 12
    drive(meter, [0.002])
    # The buffer, then the steps whose pace sizes the first window (buffered steps come at once: no pace).
    assert meter.warmup_steps == 12 + PACE_STEPS and not meter.warmup_capped
    assert records[0]["kind"] == "warmup_done" and records[0]["steps"] == 12 + PACE_STEPS


def test_the_first_step_is_always_discarded():
    meter = drive(make(warmup_min_steps=0), [0.002])
    assert meter.warmup_steps == 1


def test_a_deep_prefetch_buffer_is_cut_short_by_the_time_cap():
    records = []
    meter = make(records, warmup_min_steps=0, warmup_max_s=0.1)
    meter.prefetched_steps = 10_000
    drive(meter, [0.01])
    assert meter.warmup_capped and meter.warmup_steps < 100 and records[0]["capped"] is True


def test_a_steady_pace_ends_once_its_interval_is_within_the_precision():
    records = []
    meter = drive(make(records), [0.004, 0.0041, 0.0039])
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "warmup_done" and kinds.count("window") == len(meter.windows)
    for r in records[1:]:
        assert r["images"] == r["steps"] * 8
    s = meter.summary()
    assert meter.ended == "precise" and s["precise"] and s["ended"] == "precise"
    assert s["ci_half_width"] <= 0.02 and s["ci_low"] <= s["imgs_per_s"] <= s["ci_high"]
    assert s["imgs_per_s"] == pytest.approx(8 / 0.004, rel=0.01) and s["ci_batches"] >= MIN_BATCHES
    assert records[-1]["estimate"]["half_width"] == pytest.approx(s["ci_half_width"], abs=1e-5)


def test_a_slow_start_is_found_in_the_windows_and_left_out():
    """Steps 3x slower after the discarded ones, catching up over 150 steps (a loader filling its queue, caches
    warming): MSER finds where it ends, and the figure is the steady pace's, not an average with the ramp."""
    rng = random.Random(0)
    ramp = [0.004 * (3 - 2 * i / 150) for i in range(150)]
    meter = drive(make(), [t * (1 + 0.05 * rng.gauss(0, 1)) for t in ramp + [0.004] * 20_000])
    s = meter.summary()
    assert s["steady_start"] >= 5 and s["windows_used"][0] == s["steady_start"]
    assert s["imgs_per_s"] == pytest.approx(2000, rel=0.02)


def test_a_pace_that_never_steadies_ends_at_the_cap_with_its_interval_as_it_is():
    rng = random.Random(0)
    meter = drive(make(max_s=2.0, precision=0.001), [0.01 * rng.lognormvariate(0, 1) for _ in range(5000)])
    s = meter.summary()
    assert meter.ended == "capped" and not s["precise"] and s["ended"] == "capped"
    assert 2.0 <= s["measured_s"] < 2.0 + 0.2
    assert s["ci_half_width"] > 0  # whatever it is: it is stated


def test_window_re_aim_is_bounded():
    meter = drive(make(window_s=0.05, max_s=1.0), [0.001] * 30 + [0.01] * 1000)
    steps = [w.steps for w in meter.windows]
    for a, b in itertools.pairwise(steps):
        assert a // 2 <= b <= 2 * a


def test_a_window_holds_one_batch_from_every_loader_worker():
    meter = make(window_s=0.001, max_s=0.2)
    meter.span_steps = 6
    drive(meter, [0.002])
    assert all(w.steps >= 6 for w in meter.windows)


def test_time_spent_paused_is_not_a_warm_up_step():
    meter = make(warmup_min_steps=6)
    drive(meter, [0.02], limit=3)
    with meter.paused():  # a validation pass in the middle of warm-up
        meter.clock.t += 1.0
    drive(meter, [0.02], limit=3)
    assert meter.state == "measure"
    assert max(meter._step_times) < 0.5 and meter.step_time_s < 0.5


def test_a_train_run_stands_on_all_its_windows():
    meter = make(window_s=0.02)
    meter.continuous = True
    drive(meter, [0.002], limit=3000)
    assert len(meter.windows) > 30 and not meter.done and meter.latest is None  # no estimate per window
    s = meter.summary()
    assert s["windows_used"] == [w.index for w in meter.windows] and s["steady_start"] == 0 and s["ended"] == "run"


def test_a_pause_inside_a_window_is_left_out_of_its_seconds_and_the_window_goes_on():
    """Short train epochs: validation after every 2 steps would discard every window if a pause voided it."""
    records = []
    meter = make(records, window_s=0.1)
    meter.continuous = True
    drive(meter, [0.01], limit=4)  # warm-up done, a window open
    assert meter.state == "measure"
    pauses = 0
    for _ in range(30):
        meter.clock.t += 0.01
        meter.step()
        if meter.windows:
            break
        with meter.paused():  # an epoch's end: validation, a checkpoint
            meter.clock.t += 0.05
        pauses += 1
    window = next(r for r in records if r["kind"] == "window")
    assert pauses >= 3 and window["paused_s"] == pytest.approx(0.05 * pauses)  # every pause inside was counted ...
    assert meter.windows[0].seconds == pytest.approx(0.01 * meter.windows[0].steps)  # ... and left out of it


def test_the_first_window_is_sized_on_steps_after_the_buffer():
    """A loader-bound run: buffered steps come at once, then each takes its real time. Sized on the buffered ones,
    the first window would be ten times too long."""
    meter = make(warmup_min_steps=0, window_s=0.1)
    meter.prefetched_steps = 8
    drive(meter, [0.0] * 8 + [0.02] * 1000, limit=8 + PACE_STEPS)
    assert meter.state == "measure" and meter.step_time_s == pytest.approx(0.02)
    assert meter.steps_per_window == 5  # 0.1 s of 0.02 s steps (and never the 0 s of a buffered one)


def test_a_non_finite_loss_inside_the_measured_span_is_counted_and_voids_the_figure():
    records = []
    meter = make(records, warmup_min_steps=1, window_s=0.02, max_s=0.2)
    losses = [1.0, 1.0, float("nan"), 1.0, float("inf")] + [1.0] * 1000
    for x in losses:
        if meter.done:
            break
        meter.clock.t += 0.005
        meter.step(torch.tensor(x))
    windows = [r for r in records if r["kind"] == "window"]
    assert sum(w["loss_nonfinite"] for w in windows) == 2  # the first step (warm-up) is not in any window
    assert meter.summary()["loss_nonfinite_in_windows"] == 2  # a steady pace: the span starts at the first window


def test_a_stepping_run_says_so_while_no_window_closes():
    records = []
    meter = make(records, warmup_min_steps=100, warmup_max_s=60)
    meter._t_said -= 10  # as if the last record went out 10 s ago
    meter.step()
    beat = records[-1]
    assert beat["kind"] == "steps" and beat["steps"] == 1 and beat["state"] == "warmup" and beat["step_s"] >= 0
    meter.step()
    assert len(records) == 1  # not again before STEPS_EVERY_S


def test_an_epochs_turn_is_a_window_of_its_own_charged_over_the_real_epoch():
    """Epochs of 40 steps of 0.01 s; each turn (the last 4 steps, the restart, the first 4) costs 0.3 s beyond
    them. The turns are marked windows, the steady windows close around them, and the figure charges each turn
    once per epoch: an epoch's samples over its real time."""
    records = []
    meter = make(records, window_s=0.05, max_s=10.0, precision=0.01)
    meter.epoch_steps = 40
    step = 0
    while not meter.done:
        at = step % 40
        meter.clock.t += 0.01 + (0.3 if at == 0 and step else 0.0)  # the restart, before an epoch's first batch
        meter.step()
        step += 1
        if at == 35:
            meter.turn_begins()
        elif at == 3:
            meter.turn_ends()
    turns = [r for r in records if r["kind"] == "window" and r["turn"]]
    assert turns and all(t["steps"] == 8 for t in turns)
    s = meter.summary()
    assert s["epoch_turns"] >= 1 and s["epoch_turn_s"] == pytest.approx(0.3, rel=0.01)
    assert s["imgs_per_s"] == pytest.approx(40 * 8 / (40 * 0.01 + 0.3), rel=0.01)
    assert s["imgs_per_s_steady"] == pytest.approx(800, rel=0.01) and s["turn_windows"] == [t["window"] for t in turns]


def test_the_steps_wait_for_data_is_the_steady_windows_share_without_the_warm_up_or_the_turns():
    """Each step waits 2.5 ms for its batch and computes 7.5 ms: a quarter of the measured time waiting for data. The
    warm-up's batches come slowly (a loader filling its queue) and each epoch's restart is a long wait, inside its
    turn: neither is in the share."""
    records = []
    meter = make(records, window_s=0.05, max_s=10.0, precision=0.01)
    meter.epoch_steps = 40

    def loader():
        for step in itertools.count():
            meter.clock.t += 0.0025 + (0.05 if meter.state == "warmup" else 0.0) + (0.3 if step % 40 == 0 else 0.0)
            yield step

    for step in timed_batches(loader(), meter.waited, meter.clock):
        if meter.done:
            break
        meter.clock.t += 0.0075
        meter.step()
        if step % 40 == 35:
            meter.turn_begins()
        elif step % 40 == 3:
            meter.turn_ends()
    windows = [r for r in records if r["kind"] == "window"]
    assert any(w["turn"] for w in windows) and meter.warmup_steps > 1
    for w in windows:
        if not w["turn"]:
            assert w["wait_s"] == pytest.approx(0.0025 * w["steps"])
    assert meter.summary()["data_wait_share"] == pytest.approx(0.25)
    # A loop whose waits are not timed (the loader alone, a script's loop of its own) has no split.
    untimed = drive(make(records := []), [0.01])
    assert untimed.summary()["data_wait_share"] is None and all(r["wait_s"] is None for r in records[1:])


def test_a_turn_in_progress_delays_the_first_window_to_its_end():
    meter = make(warmup_min_steps=3)
    drive(meter, [0.01], limit=2)
    meter.turn_begins()
    drive(meter, [0.01], limit=5)
    assert meter.state == "warmup"  # the minimum is met, but inside a turn
    meter.turn_ends()
    drive(meter, [0.01], limit=1)
    assert meter.state == "measure" and not any(w.turn for w in meter.windows)


def test_a_train_run_marks_no_turn():
    meter = make()
    meter.continuous = True
    drive(meter, [0.01], limit=20)
    meter.turn_begins()
    drive(meter, [0.01], limit=20)
    meter.turn_ends()
    assert not any(w.turn for w in meter.windows)


def _two_ranks(rank: int, port: int, slow_step_s: float, out) -> None:
    """One rank of a 2-rank gloo group: rank 1's steps take ``slow_step_s``, rank 0's nothing; each rank reports
    its windows and how long its own steps took inside them."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        records = []
        meter = ThroughputMeter(MeasureConfig(warmup_min_steps=2, window_s=0.2, precision=0.5, max_s=0.3),
                                images_per_step=8, device=torch.device("cpu"), emit=records.append)
        own = [0.0]  # this rank's step time inside the current window
        while not meter.done:
            t0 = time.perf_counter()
            if rank == 1:
                time.sleep(slow_step_s)
            measuring = meter.state == "measure"
            own[-1] += time.perf_counter() - t0 if measuring else 0.0
            n = len(meter.windows)
            meter.step()
            if len(meter.windows) > n:
                own.append(0.0)
        out.put((rank, [w.seconds for w in meter.windows], own[:len(meter.windows)],
                 [r["seconds"] for r in records if r["kind"] == "window"], meter.ended))
    finally:
        dist.destroy_process_group()


def test_a_window_lasts_as_long_as_its_slowest_rank_and_the_ranks_end_together():
    """Rank 0 runs ahead and waits at the window's end; its window is as long as rank 1's steps, not its own."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_two_ranks, args=(r, port, 0.02, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {r: rest for r, *rest in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
    (fast_windows, fast_own, emitted, fast_end), (slow_windows, slow_own, _, slow_end) = got[0], got[1]
    assert len(fast_windows) == len(slow_windows) >= 2 and fast_end == slow_end == "capped"
    assert fast_windows == slow_windows and emitted == [round(x, 6) for x in fast_windows]  # one duration, agreed
    for seconds, own_fast, own_slow in zip(fast_windows, fast_own, slow_own, strict=True):
        assert own_fast < 0.1 * own_slow  # rank 0 itself did next to nothing ...
        assert seconds >= own_slow  # ... and its window holds every step of rank 1


# ---- a script's own loader, restarted every epoch, in real time -----------------------------------------------------


class _Records(list):
    def write(self, record, *, any_rank=False):
        self.append(record)

    def __bool__(self):  # a writer, even while it holds no record
        return True


def _measure_own_loader(loader, *, mode: str, step_s: float = 0.0, max_s: float = 3.0):
    """A script's loop over its own DataLoader (``run.loader``) in-process, as a live worker runs its trial: the
    loader alone (``supply``) or a loop whose every step takes ``step_s`` (``measure``). Returns the records."""
    from trainer.records import Dist
    from trainer.runtime import setup
    from trainer.runtime._base import TrialDone
    from trainer.runtime.request import Active, Request, activate

    cfg = MeasureConfig(warmup_min_steps=2, window_s=0.05, precision=0.02, max_s=max_s)
    records = _Records()
    env = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    activate(Active(request=Request(mode=mode, measure=cfg), writer=records, env=env))
    run = setup(unit="images")
    try:
        batches = run.loader(loader)
        for _ in run.epochs(1000):
            for batch in batches:
                time.sleep(step_s)
                if run.report(len(batch)):
                    break
    except TrialDone:
        pass
    finally:
        run.close()
        activate(None)
    return records


@pytest.mark.parametrize("mode, step_s", [("supply", 0.0), ("measure", 0.003)], ids=["loader-alone", "loader-bound"])
def test_a_script_loaders_turns_are_marked_on_its_rounds_and_its_figure_is_an_epochs_real_pace(mode, step_s):
    """62 batches an epoch from 16 workers starting together (3 rounds and 14 batches), each restart slower than a
    round: every turn, from the last whole round's end to the next epoch's first round, is a window of its own,
    and the figure is an epoch's samples over its real wall time."""
    from tests.helpers.bursty import BurstyLoader

    loader = BurstyLoader(batches=62, batch_size=8, workers=16, batch_s=0.08, spawn_s=0.12, join_s=0.01)
    records = _measure_own_loader(loader, mode=mode, step_s=step_s)
    summary = next(r for r in records if r["kind"] == "summary")
    turns = [r for r in records if r["kind"] == "window" and r["turn"]]
    assert turns and all(t["steps"] == 14 + 16 for t in turns), turns  # the partial round and the first one
    epochs = [b - a for a, b in itertools.pairwise(loader.starts)]
    truth = 62 * 8 / statistics.median(epochs)  # an epoch's images over its real wall time
    assert summary["imgs_per_s"] == pytest.approx(truth, rel=0.05), (summary, epochs)
    assert summary["epoch_turns"] >= 1


def test_an_epoch_no_turn_was_measured_in_is_charged_its_start_with_persistent_workers_too():
    """Epochs far longer than a trial (as a real data set's): no turn is measured, so the first epoch's start is
    charged over an epoch. Persistent workers spare an epoch the spawn, not the wait for its first round: they begin
    an epoch's batches only when it begins; charging them nothing would make persistence look free."""
    from tests.helpers.bursty import BurstyLoader

    loader = BurstyLoader(batches=100_000, batch_size=8, workers=4, batch_s=0.08, spawn_s=0.01, persistent=True)
    records = _measure_own_loader(loader, mode="measure", step_s=0.01, max_s=1.5)
    summary = next(r for r in records if r["kind"] == "summary")
    assert len(loader.starts) == 1 and summary["epoch_turn_s"] >= 0.08 and summary["epoch_turns"] == 0, summary
    assert summary["imgs_per_s"] < summary["imgs_per_s_steady"]


def test_a_real_dataloader_of_short_epochs_marks_its_turns():
    """A script's own DataLoader through ``run.loader``: 5 batches an epoch from 2 worker processes spawned anew each
    epoch. Every rank marks its turns on the same steps."""
    from torch.utils.data import DataLoader

    loader = DataLoader(torch.zeros(40, 1), batch_size=8, num_workers=2, persistent_workers=False)
    records = _measure_own_loader(loader, mode="measure", step_s=0.002, max_s=1.5)
    summary = next(r for r in records if r["kind"] == "summary")
    turns = [r for r in records if r["kind"] == "window" and r["turn"]]
    assert turns and all(t["steps"] == 1 + 2 for t in turns) and summary["epoch_turns"] >= 1
