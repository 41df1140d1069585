"""The measurement protocol's decisions, driven step by step in one process (world of one, CPU)."""

import itertools
import statistics
import time

import pytest
import torch

from trainer.config import MeasureConfig
from trainer.meter import STEP_TIME_STEPS, ThroughputMeter, Window, short_epochs


def drive(meter, step_times, limit=10_000):
    """Feed ``step_times`` (seconds, cycled) to the meter by sleeping; returns the meter."""
    for _, dt in zip(range(limit), itertools.cycle(step_times)):
        if meter.done:
            break
        time.sleep(dt)
        meter.step()
    return meter


def make(records, **cfg):
    base = {"warmup_min_steps": 2, "window_s": 0.05, "windows": 3, "max_windows": 6, "spread_target": 0.5}
    base.update(cfg)
    return ThroughputMeter(MeasureConfig(**base), images_per_step=8, device=torch.device("cpu"),
                           emit=records.append)


def windows_at(meter, rates, seconds=1.0):
    """Give the meter finished windows of these imgs/s (8 images per step), as if it had measured them."""
    meter.windows = [Window(index=i, t0=float(i), t1=float(i) + seconds, steps=round(r * seconds / 8),
                            images=8 * round(r * seconds / 8), seconds=seconds) for i, r in enumerate(rates)]


def test_the_prefetched_steps_are_discarded_and_then_windows_start():
    records = []
    meter = make(records, warmup_min_steps=0)
    meter.prefetched_steps = 12
    drive(meter, [0.002])
    # The buffer, then the steps whose pace sizes the first window (buffered steps come at once: no pace).
    assert meter.warmup_steps == 12 + STEP_TIME_STEPS and not meter.warmup_capped
    assert records[0]["kind"] == "warmup_done" and records[0]["steps"] == 12 + STEP_TIME_STEPS


def test_the_first_step_is_always_discarded():
    records = []
    meter = drive(make(records, warmup_min_steps=0), [0.002])
    assert meter.warmup_steps == 1


def test_a_deep_prefetch_buffer_is_cut_short_by_the_time_cap():
    records = []
    meter = make(records, warmup_min_steps=0, warmup_max_s=0.1)
    meter.prefetched_steps = 10_000
    drive(meter, [0.01])
    assert meter.warmup_capped and meter.warmup_steps < 100 and records[0]["capped"] is True


def test_windows_count_images_and_finish_once_the_latest_agree():
    records = []
    meter = drive(make(records), [0.004])
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "warmup_done" and kinds.count("window") == len(meter.windows) >= 3
    for r in records[1:]:
        assert r["images"] == r["steps"] * 8
    summary = meter.summary()
    assert summary["windows"] == len(meter.windows) and len(summary["windows_used"]) == 3


def test_a_slow_start_is_left_out_once_the_latest_windows_agree():
    records = []
    meter = make(records, spread_target=0.5, window_s=0.2, max_windows=8)
    # A 5x slower patch after the discarded steps (a loader catching up, a late recompile) spoils the first windows,
    # then steady again: the result stands on the steady tail, not on the median of everything. (Targets are loose
    # so that sleep jitter on a loaded machine cannot decide the outcome.)
    meter = drive(meter, [0.02] * 2 + [0.1] * 12 + [0.02] * 1000)
    summary = meter.summary()
    assert summary["settled"] and summary["windows"] > 3
    assert summary["windows_used"] == [w.index for w in meter.windows[-3:]]
    assert summary["spread"] <= 0.5
    assert summary["imgs_per_s"] > 2 * min(w.imgs_per_s for w in meter.windows)


def test_windows_that_never_agree_stop_at_the_limit_and_stand_on_the_latest_half():
    records = []
    meter = make(records, spread_target=0.0, windows=3, max_windows=8, window_s=0.05)
    drive(meter, [0.002, 0.02, 0.002, 0.002, 0.03])
    summary = meter.summary()
    assert len(meter.windows) == 8 and summary["settled"] is False
    assert summary["windows_used"] == [4, 5, 6, 7]


def test_settled_needs_the_result_and_the_window_before_it_to_agree_at_full_length():
    meter = make([], windows=3, max_windows=8, window_s=1.0, spread_target=0.05)
    windows_at(meter, [500, 1000, 1010, 1000, 1005])
    assert meter.settled and [w.index for w in meter.steady()] == [2, 3, 4]
    windows_at(meter, [500, 1000, 1010, 1000])  # the window before the latest three is still warming up
    assert not meter.settled
    windows_at(meter, [940, 960, 980, 1000, 1020, 1040])  # a slow ramp: any three agree, four do not
    assert not meter.settled
    windows_at(meter, [1000, 1000, 1010, 900])  # the latest disagree by 11 %
    assert not meter.settled and len(meter.steady()) == 3
    windows_at(meter, [1000, 1000, 1010, 1000], seconds=0.4)  # short windows, aimed from warm-up steps
    assert not meter.settled
    windows_at(meter, [1000, 1010, 1000])  # too few
    assert not meter.settled


def test_window_re_aim_is_bounded():
    records = []
    meter = make(records, window_s=0.05, windows=4, max_windows=4, spread_target=10)
    drive(meter, [0.001] * 30 + [0.01] * 1000)
    steps = [w.steps for w in meter.windows]
    for a, b in itertools.pairwise(steps):
        assert b <= 2 * a and b >= a // 2


def test_a_window_holds_one_batch_from_every_loader_worker():
    records = []
    meter = make(records, window_s=0.001, windows=3, max_windows=3)
    meter.span_steps = 6
    drive(meter, [0.002])
    assert all(w.steps >= 6 for w in meter.windows)


def test_time_spent_paused_is_not_a_warm_up_step():
    records = []
    meter = make(records, warmup_min_steps=6)
    for _ in range(3):
        time.sleep(0.02)
        meter.step()
    with meter.paused():  # a validation pass in the middle of warm-up
        time.sleep(1.0)
    for _ in range(3):
        time.sleep(0.02)
        meter.step()
    assert meter.state == "measure"
    assert max(meter._step_times) < 0.5 and meter.step_time_s < 0.5


def test_a_train_run_stands_on_all_its_windows():
    records = []
    meter = make(records, window_s=0.02, windows=3, max_windows=3)
    meter.continuous = True
    drive(meter, [0.002], limit=300)
    assert len(meter.windows) > 3 and not meter.done
    assert meter.summary()["windows_used"] == [w.index for w in meter.windows]


def test_a_pause_inside_a_window_is_left_out_of_its_seconds_and_the_window_goes_on():
    """Short train epochs: validation after every 2 steps would discard every window if a pause voided it."""
    records = []
    meter = make(records, warmup_min_steps=2, window_s=0.1)
    meter.continuous = True
    drive(meter, [0.01], limit=4)  # warm-up done, a window open
    assert meter.state == "measure"
    pauses = 0
    for _ in range(30):
        time.sleep(0.01)
        meter.step()
        if meter.windows:
            break
        with meter.paused():  # an epoch's end: validation, a checkpoint
            time.sleep(0.05)
        pauses += 1
    (w,) = meter.windows[:1]
    window = next(r for r in records if r["kind"] == "window")
    assert pauses >= 3 and window["paused_s"] >= 0.05 * pauses  # every pause inside the window was counted ...
    assert w.seconds < 0.05 * pauses  # ... and left out: the window holds the steps' own time, not the pauses'


def test_the_first_window_is_sized_on_steps_after_the_buffer():
    """A loader-bound run: buffered steps come at once, then each takes its real time. Sized on the buffered ones,
    the first window was 10x too long."""
    records = []
    meter = make(records, warmup_min_steps=0, window_s=0.1)
    meter.prefetched_steps = 8
    drive(meter, [0.0] * 8 + [0.02] * 1000, limit=8 + STEP_TIME_STEPS)
    assert meter.state == "measure" and meter.step_time_s >= 0.015
    assert meter.steps_per_window <= 7  # 0.1 s of 0.02 s steps (and never the 0 s of a buffered one)


def test_a_non_finite_loss_inside_a_window_is_counted_and_voids_the_figure():
    records = []
    meter = make(records, warmup_min_steps=1, window_s=0.02, windows=2, max_windows=2, spread_target=10.0)
    losses = [1.0, 1.0, float("nan"), 1.0, float("inf")] + [1.0] * 100
    for x in losses:
        if meter.done:
            break
        time.sleep(0.005)
        meter.step(torch.tensor(x))
    windows = [r for r in records if r["kind"] == "window"]
    assert sum(w["loss_nonfinite"] for w in windows) == 2  # the first step (warm-up) is not in any window
    # Two windows, too few to settle: the result stands on both, and so on both bad steps.
    assert len(windows) == 2 and meter.summary()["windows_used"] == [0, 1]
    assert meter.summary()["loss_nonfinite_in_windows"] == 2


def _two_ranks(rank: int, port: int, slow_step_s: float, out) -> None:
    """One rank of a 2-rank gloo group: rank 1's steps take ``slow_step_s``, rank 0's nothing; each rank reports
    its windows and how long its own steps took inside them."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        records = []
        meter = ThroughputMeter(MeasureConfig(warmup_min_steps=2, window_s=0.2, windows=2, max_windows=2,
                                              spread_target=10.0), images_per_step=8, device=torch.device("cpu"),
                                emit=records.append)
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
                 [r["seconds"] for r in records if r["kind"] == "window"]))
    finally:
        dist.destroy_process_group()


def test_a_window_lasts_as_long_as_its_slowest_rank():
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
    (fast_windows, fast_own, emitted), (slow_windows, slow_own, _) = got[0], got[1]
    assert len(fast_windows) == len(slow_windows) == 2
    assert fast_windows == slow_windows and emitted == [round(x, 6) for x in fast_windows]  # one duration, agreed
    for seconds, own_fast, own_slow in zip(fast_windows, fast_own, slow_own, strict=True):
        assert own_fast < 0.1 * own_slow  # rank 0 itself did next to nothing ...
        assert seconds >= own_slow  # ... and its window holds every step of rank 1


def test_an_epoch_boundary_is_kept_out_of_the_windows_and_charged_over_the_epoch():
    records = []
    meter = make(records, window_s=0.04, spread_target=0.3)
    n = 0
    while not meter.done:
        if n and n % 10 == 0:  # a boundary every 10 steps: its workers joined and spawned anew
            with meter.epoch_boundary(end=True):
                time.sleep(0.01)
            with meter.epoch_boundary():
                time.sleep(0.05)
        time.sleep(0.004)
        meter.step()
        n += 1
    windows = [r for r in records if r["kind"] == "window"]
    assert meter.settled and any(w["paused_s"] >= 0.05 for w in windows)  # inside a window, yet left out of it
    assert meter.epoch_starts and all(s >= 0.06 for s in meter.epoch_starts)  # the end's seconds and the start's
    steady = meter.summary()["imgs_per_s"]
    meter.charge_epochs(epoch_images=80, start_s=0.06)  # 10 steps of 8 images, then 0.06 s of boundary
    s = meter.summary()
    assert s["imgs_per_s_steady"] == steady and s["epoch_start_s"] == 0.06
    assert s["imgs_per_s"] == pytest.approx(80 / (80 / steady + 0.06), rel=1e-3)
    # A train run's windows measure its whole pace: nothing paused, nothing charged.
    train = make([])
    train.continuous = True
    with train.epoch_boundary():
        pass
    assert train.epoch_starts == []


def test_a_stepping_run_says_so_while_no_window_closes():
    records = []
    meter = make(records, warmup_min_steps=100, warmup_max_s=60)
    meter._t_said -= 10  # as if the last record went out 10 s ago
    meter.step()
    beat = records[-1]
    assert beat["kind"] == "steps" and beat["steps"] == 1 and beat["state"] == "warmup" and beat["step_s"] >= 0
    meter.step()
    assert len(records) == 1  # not again before STEPS_EVERY_S


# ---- a script's own loader, restarted every epoch -----------------------------------------------------------------


class _Records(list):
    def write(self, record, *, any_rank=False):
        self.append(record)

    def __bool__(self):  # a writer, even while it holds no record
        return True


def _measure_own_loader(loader, *, mode: str, step_s: float = 0.0):
    """A script's loop over its own DataLoader (``run.loader``) in-process, as a live worker runs its trial: the
    loader alone (``supply``) or a loop whose every step takes ``step_s`` (``measure``). Returns the records."""
    from trainer.records import Dist
    from trainer.runtime import setup
    from trainer.runtime._run import TrialDone
    from trainer.runtime.request import Active, Request, activate

    cfg = MeasureConfig(warmup_min_steps=2, window_s=0.05, windows=3, max_windows=8, spread_target=0.1)
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


@pytest.mark.parametrize("mode, step_s", [("supply", 0.0), ("measure", 0.003), ("measure", 0.01)],
                         ids=["loader-alone", "loader-bound", "compute-bound"])
def test_short_epochs_of_a_loader_restarted_every_epoch_are_measured_in_whole_epochs(mode, step_s):
    """The 1xH200 case in small: 62 batches an epoch from 16 workers starting together (3 rounds and 14 batches),
    each restart slower than a round. Between two turns there is room for one window of two rounds only: windows of
    whole rounds were each one epoch's steady part, the turn charged beside them. Windows of whole epochs, cut at
    each epoch's start, hold the restart, the partial round and the first round's wait: they agree, and their
    figure is an epoch's images over its real wall time, with nothing charged beside it. (The spread target is loose
    so that sleep jitter on a loaded machine cannot decide the outcome.)"""
    from tests.helpers.bursty import BurstyLoader

    loader = BurstyLoader(batches=62, batch_size=8, workers=16, batch_s=0.08, spawn_s=0.12, join_s=0.01)
    records = _measure_own_loader(loader, mode=mode, step_s=step_s)
    summary = next(r for r in records if r["kind"] == "summary")
    windows = {r["window"]: r for r in records if r["kind"] == "window"}
    assert summary["epoch_windows"] and summary["settled"] and summary["spread"] <= 0.1, summary["imgs_per_s_windows"]
    used = [windows[i] for i in summary["windows_used"]]
    assert all(w["steps"] == 62 * w["epochs"] and not w["paused_s"] for w in used), used
    assert "epoch_start_s" not in summary and summary["imgs_per_s"] == statistics.median(
        w["imgs_per_s"] for w in used)  # no charge beside the windows
    epochs = [b - a for a, b in itertools.pairwise(loader.starts)]
    truth = 62 * 8 / statistics.median(epochs)  # an epoch's images over its real wall time
    assert summary["imgs_per_s"] == pytest.approx(truth, rel=0.03), (summary, epochs)
    # The warm-up epoch, four windows of one epoch, and (a script's loop) the step that learns it is measured.
    assert len(loader.starts) <= 6 + (mode != "supply")


def test_long_epochs_of_a_loader_restarted_every_epoch_keep_windows_of_whole_rounds():
    """22 batches an epoch from 4 workers: the four rounds between two turns hold one window of four rounds. Each
    epoch's turn (its last, partial round, the workers joined and spawned anew, the next epoch's first round) is kept
    out of the windows of whole rounds and charged net of its steps' steady time: the figure is still what an epoch
    really takes."""
    from tests.helpers.bursty import BurstyLoader

    loader = BurstyLoader(batches=22, batch_size=8, workers=4, batch_s=0.08, spawn_s=0.05, join_s=0.01)
    records = _measure_own_loader(loader, mode="measure", step_s=0.01)
    summary = next(r for r in records if r["kind"] == "summary")
    windows = [r for r in records if r["kind"] == "window"]
    assert not summary["epoch_windows"] and summary["settled"], summary["imgs_per_s_windows"]
    assert all(w["steps"] % 4 == 0 and w["epochs"] == 0 for w in windows)
    assert summary["epoch_starts"] >= 1 and summary["epoch_starts"] == len(summary["epoch_turns_s"])
    epochs = [b - a for a, b in itertools.pairwise(loader.starts)]
    truth = 22 * 8 / statistics.median(epochs)
    assert summary["imgs_per_s"] == pytest.approx(truth, rel=0.04), (summary, epochs)


def test_windows_of_whole_rounds_agree_where_the_rounds_vary():
    """Rounds whose length varies from one to the next (here 0.5, 0.9, 1.5 and 1.1 times a batch's time, over and
    over): a window of two rounds ends early or late with its last round, and the next one moves the other way, so
    neighbours never agree (on 1xH200, windows of two rounds of a script's 16 PIL workers ahead of ResNet-50 varied
    2.6-19 % (coefficient of variation), of four rounds 1.9-10 %). Windows of four rounds hold the cycle: they agree."""
    from tests.helpers.bursty import BurstyLoader

    loader = BurstyLoader(batches=100_000, batch_size=8, workers=4, batch_s=0.04, round_factors=(0.5, 0.9, 1.5, 1.1))
    records = _measure_own_loader(loader, mode="measure", step_s=0.001)
    summary = next(r for r in records if r["kind"] == "summary")
    windows = [r for r in records if r["kind"] == "window"]
    assert all(w["steps"] % 16 == 0 for w in windows), windows
    assert summary["settled"], summary["imgs_per_s_windows"]


def test_an_epoch_no_window_reached_the_end_of_is_charged_its_start_with_persistent_workers_too():
    """Epochs far longer than a trial (as a real data set's): no turn is measured, so the first epoch's start is
    charged over an epoch. Persistent workers spare an epoch the spawn, not the wait for its first round: they begin
    an epoch's batches only when it begins (on 1xH200 each epoch of a script's 16 persistent PIL workers began with
    a 3.3-6.9 s wait for its first batch). Charging them nothing made persistence look free."""
    from tests.helpers.bursty import BurstyLoader

    loader = BurstyLoader(batches=100_000, batch_size=8, workers=4, batch_s=0.08, spawn_s=0.01, persistent=True)
    records = _measure_own_loader(loader, mode="measure", step_s=0.01)
    summary = next(r for r in records if r["kind"] == "summary")
    assert len(loader.starts) == 1 and summary["epoch_start_s"] >= 0.08, summary
    assert summary["imgs_per_s"] < summary["imgs_per_s_steady"]


def test_the_rule_for_windows_of_whole_epochs():
    # Fewer than TURN_ROUNDS whole rounds between two turns: whole epochs.
    assert short_epochs(62, 16)  # 1xH200, a 32,000-image folder at batch 512: 3 rounds and 14 batches
    assert short_epochs(19, 4) and not short_epochs(20, 4)  # 4 whole rounds: 3 between turns; 5: 4, one window
    assert not short_epochs(2502, 16)  # ImageNet at batch 512: 156 rounds
    assert short_epochs(3, 0)  # no workers: the main process's batches, a round each


def test_windows_of_whole_epochs_are_cut_at_each_epochs_start_and_charge_nothing():
    """Epochs of 4 steps, each start 0.03 s of restart: the warm-up ends at an epoch's start, each window holds
    whole epochs (as many as window_s asks), restarts included; images an accumulation carried over an epoch's end
    are the ending epoch's."""
    records = []
    meter = make(records, warmup_min_steps=2, window_s=0.1, windows=2, max_windows=4, spread_target=0.5)
    meter.epoch_windows = True
    epochs = 0
    while not meter.done and epochs < 40:
        meter.epoch_begins(images=8 if epochs else 0)  # the first epoch's start comes before any step: no window's
        with meter.epoch_boundary():  # workers spawned: inside the window, not paused
            time.sleep(0.03)
        for _ in range(4):
            time.sleep(0.005)
            meter.step()
        epochs += 1
    windows = [r for r in records if r["kind"] == "window"]
    warmup = next(r for r in records if r["kind"] == "warmup_done")
    assert meter.done and warmup["epochs_per_window"] == 2  # 0.1 s of 0.05 s epochs
    assert all(w["steps"] == 4 * w["epochs"] and w["images"] == 40 * w["epochs"] for w in windows)
    assert all(w["paused_s"] == 0 and w["seconds"] >= 0.05 * w["epochs"] for w in windows)
    steady = meter.summary()["imgs_per_s"]
    meter.charge_epochs(epoch_images=32, start_s=0.03)
    assert meter.summary()["imgs_per_s"] == steady and meter.summary()["epoch_windows"]


def test_epochs_longer_than_the_warm_up_may_take_are_not_windows():
    """No epoch's start within warmup_max_s: the meter goes on in windows of steps, as without epoch windows."""
    records = []
    meter = make(records, warmup_min_steps=2, warmup_max_s=0.05, window_s=0.02, spread_target=10)
    meter.epoch_windows = True
    drive(meter, [0.005], limit=200)
    assert meter.done and not meter.epoch_windows and meter.warmup_capped
    assert all(r["epochs"] == 0 for r in records if r["kind"] == "window")


def test_a_real_dataloader_of_short_epochs_is_measured_in_whole_epochs():
    """A script's own DataLoader through ``run.loader``: 5 batches an epoch from 2 worker processes spawned anew each
    epoch. The runtime cuts the windows at each epoch's start, on the steps every rank agrees on."""
    from torch.utils.data import DataLoader

    loader = DataLoader(torch.zeros(40, 1), batch_size=8, num_workers=2, persistent_workers=False)
    records = _measure_own_loader(loader, mode="measure", step_s=0.002)
    summary = next(r for r in records if r["kind"] == "summary")
    windows = [r for r in records if r["kind"] == "window"]
    assert summary["epoch_windows"] and windows and "epoch_start_s" not in summary
    assert all(w["epochs"] >= 1 and w["steps"] == 5 * w["epochs"] for w in windows), windows


def test_a_stream_of_worker_rounds_aims_its_first_window_at_a_rounds_pace_not_a_bursts():
    """The built-in job's loader alone on one endless stream (no epoch turns): 4 workers start together and hand
    over their batches in bursts of 4, one burst per round. The warm-up discards the prefetch buffer; its last steps
    then fall inside a burst, nearly free, and their median once aimed the first window at hundreds of steps (on
    1xH200 a libjpeg-turbo supply's first window took 50 s, the measurement 115 s). Aimed at a whole round's pace,
    the first window lasts about ``window_s``."""
    from tests.helpers.bursty import BurstyLoader

    records = []
    loader = BurstyLoader(batches=10_000, batch_size=8, workers=4, batch_s=0.08, spawn_s=0.05)
    meter = make(records, warmup_min_steps=2, window_s=0.16, windows=3, max_windows=6, spread_target=0.5)
    meter.prefetched_steps, meter.span_steps = 4 * 2, 4
    t0 = time.perf_counter()
    for _ in loader:
        meter.step()
        if meter.done:
            break
    first = next(r for r in records if r["kind"] == "window")
    assert first["seconds"] <= 3 * 0.16, first
    assert time.perf_counter() - t0 < 3.0
