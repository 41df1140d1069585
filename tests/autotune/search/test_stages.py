"""The stages' decisions, on a real in-memory Optuna study (and its parts study) searched by the search's own engine,
stage planner, evaluator, pruner and recording step; only the trials' runs are simulated (``tests.helpers.machine``).

What is checked: the first end-to-end trial comes right after one ceiling and one supply; cuDNN's search is decided
on shapes new to their worker, per precision and layout; candidates are picked by measurement, one per decode family;
a pipeline dropped on an imprecise supply still runs end to end; a precision whose end-to-end trials diverge gives way
to the next; a small budget runs a smaller plan and says which; measurements of parts keep to their share of a time
budget; an interrupted supply is measured again by the next search; a draw the ceiling bounds below the best is not
launched; a trial 0 whose interval stays wide is measured again; leaders that tie are run again and named a tie;
Optuna's view of the main study holds end-to-end trials only."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import re
from types import SimpleNamespace
from unittest import mock

import optuna
import pytest
from optuna.trial import TrialState

from autotune.formatting import fmt_ips
from autotune.overview import conclusions, cudnn_lines, headline, table
from autotune.search.engine import Engine, best_line
from autotune.search.evaluate import BASELINE_CAP
from autotune.search.progress import Progress
from autotune.search.stages import REACH, Budget
from autotune.search.stages._measure import supply_overrides
from autotune.search.stages._ranking import worker_share
from autotune.study import view
from autotune.study.liveness import owner
from autotune.study.measured import DATA_WAIT_SAID, cudnn_decided, grid, trainable_ceiling
from autotune.study.setup import create_or_load, parts_study
from tests.helpers.machine import SPEC, FakePool, Machine, SimClock, constructed_plan, util_of

optuna.logging.set_verbosity(optuna.logging.WARNING)

GPU = {("fp16", True): 6000.0, ("fp16", False): 4000.0, ("bf16", True): 5400.0, ("bf16", False): 3600.0,
       ("fp32", True): 2400.0, ("fp32", False): 2000.0}
"""A model that likes fp16 and channels_last (an input to the simulation)."""

FEEDS = {"pil": 1500.0, "torchvision-cpu": 5000.0, "nvjpeg-gpu": 11000.0}


@pytest.fixture(autouse=True)
def _cwd(in_tmp, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE", str(in_tmp / "cache"))  # the machine's compile records: this test's own
    return in_tmp


def search(machine: Machine, *, gpu: bool = True, trials: int = 30, timeout: float | None = None, spec=SPEC,
           storage=None, pool: FakePool | None = None, trial_timeout: float = 60.0, clock: SimClock | None = None,
           util: bool = False):
    """Run a search of ``spec`` on the simulated machine; returns what a test looks at. With ``clock``, the search's
    time is the runs' simulated seconds (``Machine.run_s``, ...), so a time budget is spent as on a machine; with
    ``util``, each run's GPU utilization is the machine's (``Machine.busy``), as NVML would give it."""
    pool = pool or FakePool(machine, "pool", clock=clock)
    with contextlib.ExitStack() as patched:
        if clock is not None:
            patched.enter_context(mock.patch("autotune.search.engine.time", SimpleNamespace(monotonic=clock.monotonic)))
        if util:
            patched.enter_context(mock.patch("autotune.search.evaluate.summarize", util_of(pool)))
        plan = constructed_plan(spec, gpu=gpu, trials=trials, timeout_s=timeout, trial_timeout_s=trial_timeout)
        plan = dataclasses.replace(plan, util_reason=None if util else plan.util_reason)
        storage = storage or optuna.storages.InMemoryStorage()
        study = create_or_load(spec=plan.spec, study_name=plan.name, storage=storage, objective=plan.objective,
                               nproc=2, baseline=plan.baseline, starts=plan.starts)
        lines: list[str] = []
        engine = Engine(plan, study, storage, lines.append)
        out = io.StringIO()
        engine.progress = Progress(total=plan.trials, timeout_s=plan.timeout_s, out=out)
        result = SimpleNamespace(study=study, parts=engine.parts, pool=pool, engine=engine, storage=storage)
        engine.introduce()
        try:
            engine.run(pool)
        finally:
            result.out = "\n".join(lines) + "\n" + out.getvalue()
            result.views = view.views(study)
    return result


def stage_of(v) -> str:
    return v.stage


def parts(r, name: str) -> list:
    return [v for v in r.views if v.stage == name]


def e2e(r) -> list:
    return [v for v in r.views if v.end_to_end]


def test_the_first_end_to_end_trial_comes_right_after_one_ceiling_and_one_supply():
    r = search(Machine(ceilings=GPU, supplies=FEEDS, cudnn_gain=1.1))
    first = r.views[:5]
    assert [v.stage for v in first] == ["baseline", "ceiling", "ceiling", "supply", "candidate"]
    # The likeliest fastest first: fp16 and channels_last at the largest batch, then GPU decode.
    assert {(v.setting("training.precision"), v.setting("training.channels_last"), v.setting("training.batch_size"))
            for v in first[1:3]} == {("fp16", True, 512)}
    assert first[3].setting("data.decode") == "nvjpeg-gpu" and first[4].setting("data.decode") == "nvjpeg-gpu"
    # nvJPEG feeds more than the model can take: its measurement stopped early, a complete measurement all the same.
    assert first[3].outcome == "part" and "above the ceiling" in first[3].attrs["stopped_early"]
    assert first[3].attrs["measured_s"] < SPEC["base"]["measure"]["max_s"]
    # The stage measurements are trials of the parts study, the end-to-end ones of the main study.
    assert all(v.part for v in r.views if v.stage in ("ceiling", "supply"))
    assert not any(v.part for v in e2e(r))


def test_what_the_prior_ranks_below_a_clearly_slower_step_is_not_measured():
    r = search(Machine(ceilings=GPU, supplies=FEEDS))
    measured = {(v.setting("training.precision"), v.setting("training.channels_last")) for v in parts(r, "ceiling")}
    # bf16 ran slower than fp16 and NCHW slower than channels_last: fp32 and the NCHW variants of the slower
    # precisions are dominated, and said so.
    assert measured == {("fp16", True), ("bf16", True), ("fp16", False)}
    assert "stages: fp32 not measured: bf16 already ran slower than fp16" in r.out


def test_a_study_in_tokens_reads_the_stages_figures_in_tokens(monkeypatch):
    made = create_or_load

    def in_tokens(**kw):  # as a script that counts tokens records its unit on the study
        study = made(**kw)
        study.set_user_attr("unit", "tokens")
        return study

    monkeypatch.setitem(globals(), "create_or_load", in_tokens)
    r = search(Machine(ceilings=GPU, supplies=FEEDS))
    said = [line for line in r.out.splitlines() if "ran slower than" in line]
    assert said and all("tokens/s" in line and "imgs/s" not in line for line in said), said
    bound = r.engine.stages.snapshot().bound_of(view.fastest(r.views).config)
    assert "tokens/s" in bound[1] and "imgs/s" not in bound[1], bound


def test_an_input_bound_job_measures_no_further_precision_or_layout():
    slow = {"pil": 300.0, "torchvision-cpu": 900.0, "nvjpeg-gpu": 1200.0}
    r = search(Machine(ceilings=GPU, supplies=slow), trials=20)
    assert len({(v.setting("training.precision"), v.setting("training.channels_last"))
                for v in parts(r, "ceiling")}) == 1
    assert "no other precision or layout is measured: the input pipelines" in r.out


def test_each_trial_keeps_its_steps_wait_for_data_an_input_bound_one_waits_and_a_compute_bound_one_does_not():
    """The share of its measured time each run's step waited for data, from its summary to the trial: end to end,
    what the pipeline feeds short of what the model takes (``Machine.data_wait``); the model alone waits for none;
    the loader alone has no step to split."""
    waiting = search(Machine(ceilings=GPU, supplies={"pil": 300.0, "torchvision-cpu": 900.0, "nvjpeg-gpu": 1200.0}),
                     trials=4)
    computing = search(Machine(ceilings=GPU, supplies=FEEDS), trials=4)
    assert view.fastest(waiting.views).attrs["data_wait_share"] >= DATA_WAIT_SAID
    assert view.fastest(computing.views).attrs["data_wait_share"] < 0.01
    for r in (waiting, computing):
        assert all(v.attrs["data_wait_share"] == 0.0 for v in parts(r, "ceiling"))
        assert all("data_wait_share" not in v.attrs for v in parts(r, "supply"))


def test_pairs_the_ceiling_cannot_tell_apart_are_told_apart_end_to_end():
    # On CPU ranks bf16 ties with and without channels_last on the model alone; end to end channels_last loses.
    cpu = {("fp32", False): 600.0, ("fp32", True): 560.0, ("bf16", False): 850.0, ("bf16", True): 851.0}
    r = search(Machine(ceilings=cpu, supplies={"pil": 2600.0, "torchvision-cpu": 5200.0},
                       e2e_share_at={("bf16", True): 0.4}), gpu=False, trials=16)
    candidates = [v for v in r.views if v.stage == "candidate"]
    tie = [v for v in candidates if v.attrs.get("tie_of")]
    assert len(tie) == 1 and (tie[0].setting("training.precision"), tie[0].setting("training.channels_last")) in \
        {("bf16", True), ("bf16", False)}
    # What follows the tie is run at the pair that did better end to end.
    after = [v for v in r.views[r.views.index(tie[0]) + 1:] if v.end_to_end and v.stage in ("candidate", "refine")]
    assert after and all((v.setting("training.precision"), v.setting("training.channels_last")) == ("bf16", False)
                         for v in after)
    assert (view.fastest(r.views).setting("training.precision"),
            view.fastest(r.views).setting("training.channels_last")) == ("bf16", False)


def test_cudnns_search_is_decided_on_shapes_new_to_their_worker_per_precision_and_layout():
    # The simulated worker keeps cuDNN's plans keyed without the search flag: a run in a worker that already ran its
    # shapes gets the first run's plans. Measured there, the search could never show what it buys.
    r = search(Machine(ceilings=GPU, supplies=FEEDS, cudnn_gain=1.1), trials=12)
    decided = cudnn_decided(r.study)["fp16 channels_last"]
    assert decided["benchmark"] is True
    assert decided["with_search"]["imgs_per_s"] > decided["without_search"]["imgs_per_s"] / REACH * 0.9
    for side in ("with_search", "without_search"):
        assert decided[side]["shapes_new_to_worker"] is True
    # The one with the search ran in a fresh worker: the first had run its shapes without it.
    runs = [x for x in r.pool.runs if x["config"].data.kind == "synthetic"][:2]
    assert [x["config"].training.cudnn_benchmark for x in runs] == [False, True] and runs[1]["fresh"]
    # Every end-to-end trial at that precision and layout runs with the decision.
    assert all(v.setting("training.cudnn_benchmark") is True for v in e2e(r)
               if (v.setting("training.precision"), v.setting("training.channels_last")) == ("fp16", True))
    # A second precision and layout a candidate runs at is decided on its own: bf16 ties fp16 on the model alone,
    # so a candidate runs there; its measurement without the search comes after the grid's with it, which had
    # already run those shapes in the live worker.
    tied = search(Machine(ceilings={**GPU, ("bf16", True): 5999.0}, supplies=FEEDS, cudnn_gain=1.1), trials=14)
    bf16 = cudnn_decided(tied.study)["bf16 channels_last"]
    assert bf16["benchmark"] is True and bf16["without_search"]["shapes_new_to_worker"] is True
    # And no run with the search on got the plans a run without it had left in its worker.
    for result in (r, tied):
        assert all(x["plans_searched"] for x in result.pool.runs if x["config"].training.cudnn_benchmark)
    # show gives the two figures the decision stands on.
    line = next(x for x in cudnn_lines(r.study) if "fp16 channels_last" in x)
    assert line.startswith("cuDNN's algorithm search, fp16 channels_last: on") and \
        fmt_ips(decided["without_search"]["imgs_per_s"]) in line and line in table(r.study)


def test_cudnns_search_is_left_off_where_it_buys_nothing():
    r = search(Machine(ceilings=GPU, supplies=FEEDS, cudnn_gain=1.0), trials=12)
    assert cudnn_decided(r.study)["fp16 channels_last"]["benchmark"] is False
    fast = [v for v in e2e(r) if (v.setting("training.precision"), v.setting("training.channels_last"))
            == ("fp16", True)]
    assert fast and all(v.setting("training.cudnn_benchmark") is False for v in fast)


def test_cudnns_decisions_are_stored_by_their_settings_and_an_older_study_keyed_by_label_reads_the_same():
    r = search(Machine(ceilings=GPU, supplies=FEEDS, cudnn_gain=1.0), trials=12)
    stored = r.study.user_attrs["cudnn"]
    assert [e["settings"]["training.precision"] for e in stored] == ["fp16"]  # renaming a label loses nothing
    fast = next(v for v in e2e(r) if (v.setting("training.precision"), v.setting("training.channels_last"))
                == ("fp16", True))
    planner, decided = r.engine.stages, cudnn_decided(r.study)
    assert planner.cudnn_for(fast.config) is False
    r.study.set_user_attr("cudnn", decided)  # as a study made before records it: by the point's label
    assert cudnn_decided(r.study) == decided and planner.cudnn_for(fast.config) is False
    assert any(line.startswith("cuDNN's algorithm search, fp16 channels_last: off") for line in cudnn_lines(r.study))


def test_ties_at_the_ceiling_are_run_one_per_decode_family_the_most_headroom_first():
    spec = copy.deepcopy(SPEC)
    # Declared in the order the old cut kept: it must not matter.
    spec["space"]["data.hybrid_cpu_fraction"]["choices"] = [0.75, 0.5, 0.25]
    # 8,000 at 8 workers alone, 6,000 at the 6 a GPU rank's own processes leave it: within 90 % of a 6,000 ceiling.
    feeds = {"pil": 1500.0, "torchvision-cpu": 8000.0, "nvjpeg-gpu": 11000.0}
    r = search(Machine(ceilings=GPU, supplies=feeds), spec=spec, trials=16)
    picked = [(v.setting("data.decode"), v.setting("data.hybrid_cpu_fraction") if v.setting("data.decode") == "hybrid"
               else None) for v in r.views if v.stage == "candidate"]
    # Hybrid at 25 %, 50 % and 75 % are all bounded by the ceiling; 25 % has the most headroom.
    assert picked[0] == ("nvjpeg-gpu", None)
    assert set(picked) == {("nvjpeg-gpu", None), ("hybrid", 0.25), ("torchvision-cpu", None)}


def test_a_pipeline_dropped_on_an_imprecise_supply_still_runs_end_to_end():
    # libjpeg-turbo on the CPU swings 50 %: its figure falls short of the band, the top of its interval reaches it.
    # End to end its CPU decode has 6 of the 8 workers it fed with alone (``_ranking.worker_share``).
    feeds = {"pil": 1500.0, "torchvision-cpu": 6000.0, "nvjpeg-gpu": 11000.0}
    r = search(Machine(ceilings=GPU, supplies=feeds, noisy={"torchvision-cpu": 0.5}), trials=20)
    supply = next(v for v in parts(r, "supply") if v.setting("data.decode") == "torchvision-cpu")
    share = worker_share(r.engine.stages.scope)
    assert share == 0.75
    assert supply.precise is False
    assert supply.imgs_per_s * share < REACH * GPU[("fp16", True)] <= supply.interval.high * share
    run = [v for v in r.views if v.stage == "candidate" and v.setting("data.decode") == "torchvision-cpu"]
    # It runs end to end (and, measurably slower there than the best, is stopped by the pruner).
    assert len(run) == 1 and run[0].attrs.get("uncertain") is True and run[0].imgs_per_s is not None
    assert "torchvision-cpu's supply is uncertain" in r.out
    # A precise supply far below the band gets none; its measurement stopped once it was clearly out of reach.
    pil = next(v for v in parts(r, "supply") if v.setting("data.decode") == "pil")
    assert "out of reach" in pil.attrs["stopped_early"]
    assert not [v for v in r.views if v.stage == "candidate" and v.setting("data.decode") == "pil"]


def test_when_a_precision_diverges_end_to_end_the_next_fastest_takes_over():
    r = search(Machine(ceilings=GPU, supplies=FEEDS, diverges={"fp16"}, cudnn_gain=1.1), trials=24)
    fp16 = [v for v in e2e(r) if v.setting("training.precision") == "fp16"]
    assert fp16 and all(v.failure_class == "diverged" for v in fp16)
    good = [v for v in r.views if v.stage == "candidate" and v.feasible]
    assert good and all(v.setting("training.precision") == "bf16" for v in good)
    # The climb moves from the best end-to-end trial, holding its precision, not the baseline's.
    climb = [v for v in r.views if v.stage in ("climb", "refine")]
    assert climb and {v.params["training.precision"] for v in climb} == {"bf16"}
    assert view.fastest(r.views).setting("training.precision") == "bf16"
    # cuDNN decided for the precision and layout the candidates moved to, as for the first.
    assert set(cudnn_decided(r.study)) == {"fp16 channels_last", "bf16 channels_last"}
    # The ceiling a tuned run is measured against is one that trains: bf16's, not fp16's faster one.
    assert view.ceiling(r.views).setting("training.precision") == "fp16"
    top = trainable_ceiling(r.views)
    assert top.setting("training.precision") == "bf16" and top.imgs_per_s == pytest.approx(GPU[("bf16", True)], 0.1)
    assert f"of the GPUs' ceiling ({top.imgs_per_s:,.0f})" in best_line(r.study)
    assert any("bf16, channels_last, batch" in line for line in headline(r.views))


def test_a_candidate_whose_every_trial_fails_is_replaced_by_the_next():
    spec = copy.deepcopy(SPEC)
    spec["stages"]["candidates"] = 2
    feeds = {"pil": 1500.0, "torchvision-cpu": 7500.0, "nvjpeg-gpu": 11000.0}
    r = search(Machine(ceilings=GPU, supplies=feeds, oom_decodes={"nvjpeg-gpu"}), spec=spec, trials=20)
    nvjpeg = [v for v in e2e(r) if v.setting("data.decode") == "nvjpeg-gpu" and not v.baseline]
    assert nvjpeg and all(v.outcome == view.Outcome.INFEASIBLE and v.failure_class == "oom" for v in nvjpeg)
    # nvJPEG ran out of memory at its batch and at the repair's: the two candidates that count are the next two.
    ran = {v.setting("data.decode") for v in r.views
           if v.stage == "candidate" and v.outcome in (view.Outcome.MEASURED, view.Outcome.PRUNED)}
    assert ran == {"hybrid", "torchvision-cpu"}
    assert {v.params["data.decode"] for v in r.views if v.stage == "refine"} <= {"hybrid", "torchvision-cpu"}


@pytest.mark.parametrize("trials, ceilings, supplies, said", [
    (4, 1, 1, "cuDNN's algorithm search not compared: too few trials"),
    (2, 0, 0, "stages: not run: 1 trial(s) left for them, fewer than the 3 the smallest staged plan needs"),
])
def test_a_small_budget_runs_a_smaller_plan_and_says_which(trials, ceilings, supplies, said):
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=trials)
    assert len(parts(r, "ceiling")) == ceilings and len(parts(r, "supply")) == supplies
    assert said in r.out
    assert len(e2e(r)) == trials - ceilings - supplies
    if ceilings:
        assert [v.stage for v in r.views] == ["baseline", "ceiling", "supply", "candidate"]


def test_measurements_of_parts_keep_to_their_share_of_a_time_budget():
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=3)
    planner = r.engine.stages
    planner.spend.cost = lambda vs, part: 10.0  # seconds a trial of either kind takes here
    vs = view.views(r.study)
    budget = Budget(trials=30, left=20, seconds=100.0, left_s=60.0, parts_run=3, parts_s=35.0)
    assert planner.spend.affords_part(planner.snapshot(budget, vs))  # 45 s of parts within half of 100 s
    budget = Budget(trials=30, left=20, seconds=100.0, left_s=60.0, parts_run=4, parts_s=45.0)
    assert not planner.spend.affords_part(planner.snapshot(budget, vs))
    assert any("they have had their share of this search's budget (4 of 30 trials, 45 of 100 s)" in n
               for n in planner.take_notes())


def test_a_slow_trial_0_does_not_make_a_timed_search_skip_its_stages():
    """Trial 0 runs in a fresh process with up to twice the windows: on 1xH200 it took 65 s of a 170 s search, and
    timing the staged plan by it skipped every stage (1,758 imgs/s where the stages reached 5,682)."""
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=1)
    planner = r.engine.stages
    vs = [dataclasses.replace(v, attrs={**v.attrs, "wall_s": 65.0}) for v in view.views(r.study)]
    assert [v.stage for v in vs] == ["baseline"]
    assert planner.spend.cost(vs, part=True) is None and planner.spend.cost(vs, part=False) is None
    assert planner.spend.core_fits(Budget(trials=16, left=15, seconds=170.0, left_s=105.0), vs=vs)
    later = [*vs, dataclasses.replace(vs[0], number=1, stage="refine", attrs={**vs[0].attrs, "wall_s": 40.0})]
    assert planner.spend.cost(later, part=True) == 40.0  # a live-worker trial's time does count


def test_an_interrupted_supply_is_measured_again_when_the_search_resumes():
    storage = optuna.storages.InMemoryStorage()
    machine = Machine(ceilings=GPU, supplies=FEEDS, interrupt={"loader"})
    with pytest.raises(KeyboardInterrupt):
        search(machine, trials=10, storage=storage)
    r = search(machine, trials=6, storage=storage)  # the same study, resumed
    assert "stages: resumed from 3 measurement(s) of parts" in r.out  # both ceilings and the interrupted supply
    supplies = [v for v in r.views if v.stage == "supply" and v.attrs["overrides"]["data.decode"] == "nvjpeg-gpu"]
    assert [v.outcome for v in supplies] == [view.Outcome.FAIL, view.Outcome.PART]
    assert supplies[0].failure_class == "interrupted"
    assert view.ceiling(r.views) is not None and any(v.stage == "candidate" for v in r.views)


def test_a_stale_measurement_of_a_part_is_run_again_as_a_measurement():
    storage = optuna.storages.InMemoryStorage()
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=2, storage=storage)
    parts_of = parts_study(r.study)
    parts_of.enqueue_trial({}, user_attrs={"stage": "supply", "overrides": {"data.decode": "pil"}})
    t = parts_of.ask()
    for k, v in {**owner(), "owner_pid": 2 ** 22 - 1}.items():  # a search that is gone
        t.set_user_attr(k, v)
    lines = r.engine.reclaim()
    assert len(lines) == 1 and lines[0].startswith(f"trial p{t.number}: stale")
    again = parts_of.get_trials(states=(TrialState.WAITING,))
    assert len(again) == 1 and again[0].user_attrs["overrides"] == {"data.decode": "pil"}
    assert again[0].user_attrs["retry_of"] == t.number and again[0].user_attrs["stage"] == "supply"


def test_a_draw_the_ceiling_bounds_below_the_best_is_not_launched_and_costs_no_trial():
    storage = optuna.storages.InMemoryStorage()
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=20, storage=storage)
    small = [v for v in parts(r, "ceiling") if v.setting("training.batch_size") < 128]
    assert small, "the batch ladder reached below the plateau"
    # A draw at batch 64 (where the model alone already runs slower than the best trial) ...
    best = view.fastest(r.views)
    r.study.enqueue_trial({**best.params, "training.batch_size": 64, "training.accum_steps": 1},
                          user_attrs={"stage": "refine"})
    again = search(Machine(ceilings=GPU, supplies=FEEDS), trials=1, storage=storage)
    skipped = [v for v in again.views if v.attrs.get("pruned_before_launch") and v.stage == "refine"]
    assert len(skipped) == 1 and skipped[0].state == TrialState.PRUNED and skipped[0].imgs_per_s is None
    assert "batch 64" in skipped[0].attrs["pruned_before_launch"] and "not launched" in again.out
    t = again.study.trials[skipped[0].number]
    assert t.intermediate_values == {} and t.value is None  # the sampler sees a pruned draw that never ran
    # ... and the search still ran its one trial (moves of the climb the ceiling bounds are not launched either)
    assert len([v for v in again.views[len(r.views):] if not v.attrs.get("pruned_before_launch")]) == 1
    assert len(again.pool.runs) == 1


def test_a_baseline_whose_interval_stays_wide_is_measured_again_and_both_runs_stand_combined():
    r = search(Machine(ceilings=GPU, supplies=FEEDS, noisy={"pil": 0.3}), trials=10)
    runs = [v for v in r.views if v.baseline]
    assert len(runs) == 2 and runs[1].attrs["remeasure_of"] == 0
    assert runs[0].precise is False and runs[0].half_width > SPEC["base"]["measure"]["precision"]
    # Trial 0 may measure longer than other trials before its interval stands as it is.
    assert runs[0].attrs["measured_s"] >= BASELINE_CAP * SPEC["base"]["measure"]["max_s"]
    fresh = [x["fresh"] for x in r.pool.runs if x["config"].data.decode == "pil"
             and x["config"].data.kind != "synthetic" and x["config"].training.mode != "loader"]
    assert fresh == [True, True]
    base = view.baseline(r.views)
    assert min(v.imgs_per_s for v in runs) <= base.imgs_per_s <= max(v.imgs_per_s for v in runs)
    assert base.attrs[view.RUNS] == [[v.number, v.imgs_per_s, v.half_width] for v in runs]
    # It comes after the first end-to-end candidate: the first answer is not delayed.
    stages = [v.stage for v in r.views]
    assert stages.index("candidate") < len(stages) - 1 - stages[::-1].index("baseline")


def test_optunas_view_of_the_main_study_holds_end_to_end_trials_only():
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=14)
    main = r.study.get_trials()
    assert main and not any(t.user_attrs.get("stage") in ("ceiling", "supply") for t in main)
    assert {t.user_attrs["stage"] for t in r.parts.get_trials()} == {"ceiling", "supply"}
    # Optuna's best is an end-to-end trial; the search's best (its runs combined) is the same or ties with it.
    best = next(v for v in e2e(r) if v.number == r.study.best_trial.number)
    assert best.interval.ties(view.fastest(r.views).interval)
    # The project's own view still has both, in the order they ran.
    assert {v.stage for v in r.views} >= {"baseline", "ceiling", "supply", "candidate", "climb"}


def test_a_job_that_can_measure_neither_part_runs_the_sampler_alone_and_says_so():
    plan = dataclasses.replace(constructed_plan(trials=3), measures_ceiling=False, measures_supply=False)
    storage = optuna.storages.InMemoryStorage()
    study = create_or_load(spec=plan.spec, study_name=plan.name, storage=storage, objective=plan.objective,
                           nproc=2, baseline=plan.baseline)
    lines: list[str] = []
    engine = Engine(plan, study, storage, lines.append)
    engine.progress = Progress(total=3, timeout_s=None, out=io.StringIO())
    engine.introduce()
    engine.run(FakePool(Machine(ceilings=GPU, supplies=FEEDS), "pool"))
    assert any("stages: not run: this job can measure neither the model alone" in x for x in lines)
    assert not engine.parts.get_trials() and len(study.get_trials()) == 3


COMPILING = copy.deepcopy(SPEC)
COMPILING["space"]["training.compile"] = [False, True]


def compiled(v) -> bool:
    return bool(v.setting("training.compile"))


def test_compile_is_measured_last_at_the_best_point_and_kept_where_it_is_faster():
    machine = Machine(ceilings=GPU, supplies=FEEDS, compile_gain=1.2, compile_s=40.0)
    r = search(machine, spec=COMPILING, trials=24, trial_timeout=300.0)
    ceilings = parts(r, "ceiling")
    # Eager first: the first end-to-end answer does not wait on a compile.
    assert not compiled(ceilings[0]) and not any(compiled(v) for v in r.views[:r.views.index(e2e(r)[1])])
    # One compiled point, at the fastest eager one, after every eager precision and layout the stages measured:
    # no compile for each point of the grid.
    done = [v for v in ceilings if compiled(v)]
    assert [(v.setting("training.precision"), v.setting("training.channels_last")) for v in done] == [("fp16", True)]
    assert all(not compiled(v) for v in ceilings[:ceilings.index(done[0])])
    assert done[0].attrs["compile_s"] == 40.0
    # It measured faster: the candidates go compiled, the fastest trial is compiled, and refining it holds what its
    # graph is keyed by, so the compile is paid once per worker, not once per draw.
    assert compiled(view.fastest(r.views))
    refined = [v for v in r.views if v.stage == "refine" and compiled(v)]
    assert refined and len({(v.params["training.batch_size"], v.params["training.accum_steps"],
                             v.params["ddp.bucket_cap_mb"]) for v in refined}) == 1
    assert "refining a compiled trial holds its batch, accumulation and DDP settings" in r.out
    assert r.pool.compiles <= 3, r.pool.compiles
    assert "compiled against eager last, where the budget pays for its one-off cost" in r.out
    # cuDNN's decision for the compiled point is its eager point's: no compile in a fresh worker for evidence.
    assert set(cudnn_decided(r.study)) <= {"fp16 channels_last", "bf16 channels_last", "fp16 NCHW"}


def test_a_compile_that_is_slower_is_measured_once_and_eager_is_kept():
    r = search(Machine(ceilings=GPU, supplies=FEEDS, compile_gain=0.8, compile_s=40.0), spec=COMPILING, trials=20,
               trial_timeout=300.0)
    assert len([v for v in parts(r, "ceiling") if compiled(v)]) == 1
    assert not any(compiled(v) for v in e2e(r))
    assert "compiled already ran slower than eager" not in r.out  # nothing left beyond it to call dominated
    assert not compiled(view.fastest(r.views))


def test_a_compile_the_trial_timeout_or_the_time_left_cannot_pay_for_is_not_measured_and_said():
    r = search(Machine(ceilings=GPU, supplies=FEEDS, compile_gain=1.2, compile_s=40.0), spec=COMPILING, trials=16)
    assert not any(compiled(v) for v in r.views)
    assert ("stages: compiled not measured: a run with it would take about 60 s (a prior: no compile of its graph is "
            "recorded on this machine), too near the trial timeout (60 s; --trial-timeout raises it); eager stays"
            ) in r.out
    planner = r.engine.stages
    planner.plan = planner.scope.plan = dataclasses.replace(planner.plan, trial_timeout_s=300.0)
    planner.spend.cost = lambda vs, part: 10.0
    vs = view.views(r.study)
    dim, order = planner_dim("training.compile"), [False, True]
    snap = planner.snapshot(Budget(trials=30, left=20, seconds=400.0, left_s=100.0, parts_run=3, parts_s=30.0), vs)
    assert planner.spend.affords_one_off(snap, dim, order, 1)  # 60 s of compile, 10 s of measurement, 2 x 10 s after it
    snap = planner.snapshot(Budget(trials=30, left=20, seconds=400.0, left_s=80.0, parts_run=3, parts_s=30.0), vs)
    assert not planner.spend.affords_one_off(snap, dim, order, 1)
    assert any("its first run costs about 60 s more (a prior: no compile of its graph is recorded on this machine), "
               "and the 80 s left cannot pay for it" in n for n in planner.take_notes())


def h200ish(**kw) -> Machine:
    """A machine whose seconds are of the order 1xH200 showed for ResNet-50 (inputs of the simulation): a cold
    compile 55 s, the same graph from the on-disk caches 6 s, a run on a live worker about 10 s, a fresh worker 15 s
    more."""
    return Machine(**{"ceilings": GPU, "supplies": FEEDS, "compile_gain": 1.15, "compile_s": 55.0,
                      "cached_compile_s": 6.0, "run_s": 6.0, "fresh_s": 15.0, **kw})


def test_a_240_s_search_weighs_compile_where_this_machine_compiled_its_graph_and_a_cold_one_says_why_not():
    machine = h200ish()
    cold = search(machine, spec=COMPILING, trials=24, timeout=240.0, trial_timeout=150.0, clock=SimClock())
    assert not any(compiled(v) for v in cold.views)
    assert ("stages: compiled not measured: its first run costs about 60 s more (a prior: no compile of its graph is "
            "recorded on this machine)") in cold.out and "eager stays" in cold.out
    # A search with time to spare on the same machine compiles the graph, cold, into the machine's caches ...
    long = search(machine, spec=COMPILING, trials=24, trial_timeout=150.0, clock=SimClock())
    (first,) = [v for v in parts(long, "ceiling") if compiled(v)]
    assert first.attrs["compile_s"] == 55.0 and first.attrs["compile_from_caches"] is False
    # ... so the next 240 s search prices loading it at a share of that, measures it, and keeps what it measured.
    again = search(machine, spec=COMPILING, trials=24, timeout=240.0, trial_timeout=150.0, clock=SimClock())
    (loaded,) = [v for v in parts(again, "ceiling") if compiled(v)]
    assert loaded.attrs["compile_s"] == 6.0 and loaded.attrs["compile_from_caches"] is True
    assert ("stages: compiled measured: its first run costs about 8 s more (its graph is in this machine's compile "
            "caches, compiled in 55 s; loading it is priced at 15% of that until a run says)") in again.out
    assert compiled(view.fastest(again.views)) and view.fastest(again.views).end_to_end
    # The compiled candidate after it ran the ceiling's graph on the same live worker: no second compile.
    follows = next(v for v in e2e(again) if compiled(v))
    assert follows.attrs["compile_reused"] is True and follows.attrs["compile_s"] == 0.0
    # Once a run from the caches said what it cost, that is the price.
    third = search(machine, spec=COMPILING, trials=24, timeout=240.0, trial_timeout=150.0, clock=SimClock())
    assert ("compiled measured: its first run costs about 6 s more (its graph loads from this machine's compile "
            "caches: at most 6 s when it did)") in third.out


def test_a_compile_loaded_from_the_caches_that_runs_slower_is_said_and_eager_stays():
    machine = h200ish(compile_gain=0.9)
    search(machine, spec=COMPILING, trials=24, trial_timeout=150.0, clock=SimClock())  # compiles it, cold
    r = search(machine, spec=COMPILING, trials=24, timeout=240.0, trial_timeout=150.0, clock=SimClock())
    assert len([v for v in parts(r, "ceiling") if compiled(v)]) == 1
    assert not any(compiled(v) for v in e2e(r)) and not compiled(view.fastest(r.views))
    said = re.search(r"stages: compiled ran slower than eager at fp16 channels_last's other settings \(([\d,]+) "
                     r"against ([\d,]+) imgs/s\): eager stays", r.out)
    assert said, r.out
    assert [round(float(x.replace(",", "")), -2) for x in said.groups()] == [5400.0, 6000.0]


def test_a_budget_too_small_for_the_stages_climbs_from_the_baseline_and_holds_compile_there():
    r = search(Machine(ceilings=GPU, supplies=FEEDS, compile_gain=1.2), spec=COMPILING, trials=2)
    assert [v.stage for v in r.views] == ["baseline", "climb"]
    assert not any(compiled(v) for v in r.views)
    base, move = r.views
    assert move.attrs["climb_from"] == base.number
    assert {k for k in {*base.params, *move.params} if base.params.get(k) != move.params.get(k)} == \
        {move.attrs["climb_knob"]}
    assert "the climb from the baseline, then the sampler" in r.out


def planner_dim(path: str):
    return next(d for d in grid() if d.path == path)


def test_a_measurement_two_search_workers_planned_at_once_runs_once():
    storage = optuna.storages.InMemoryStorage()
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=1, storage=storage)  # trial 0 only
    planner = r.engine.stages
    request = supply_overrides(planner.snapshot(), "pil", None)
    for _ in range(2):  # as two workers that both saw no such measurement would
        r.parts.enqueue_trial({}, user_attrs={"stage": "supply", "overrides": request}, skip_if_exists=False)
    again = search(Machine(ceilings=GPU, supplies=FEEDS), trials=6, storage=storage)
    pil = [t for t in parts_study(again.study).get_trials()
           if t.user_attrs.get("stage") == "supply" and t.user_attrs["overrides"]["data.decode"] == "pil"]
    assert [t.state for t in pil] == [TrialState.COMPLETE, TrialState.FAIL]
    assert pil[1].user_attrs["failure_class"] == "search"
    assert f"the same measurement as trial p{pil[0].number}" in pil[1].user_attrs["failure_message"]
    # The twin cost nothing: the search still ran its 6 trials.
    launched = [v for v in again.views if v.outcome != view.Outcome.FAIL and not v.attrs.get("pruned_before_launch")]
    assert len(launched) == len(r.views) + 6



def test_where_dali_is_installed_it_is_measured_first_at_its_most_threads_then_end_to_end_at_half(monkeypatch):
    monkeypatch.setattr("autotune.space.importable", lambda module: True)
    spec = copy.deepcopy(SPEC)
    spec["space"].update({
        "data.decode": ["pil", "torchvision-cpu", "nvjpeg-gpu", "hybrid", "dali"],
        "loader.num_workers": {"low": 2, "high": 8, "when": "data.decode != dali"},
        "data.dali_threads": {"low": 1, "high": "auto", "when": "data.decode == dali"},
        "data.dali_prefetch": {"low": 1, "high": 4, "when": "data.decode == dali"}})
    r = search(Machine(ceilings=GPU, supplies={**FEEDS, "dali": 14000.0}), spec=spec, trials=12)
    supplies = parts(r, "supply")
    assert supplies[0].setting("data.decode") == "dali"
    assert supplies[0].setting("data.dali_threads") == 8  # 16 cores over 2 ranks
    under = [v for v in e2e(r) if v.setting("data.decode") == "dali"]
    # End to end its threads share the cores with the training process: the candidate takes half (Policy.first_share).
    assert under and under[0].stage == "candidate" and under[0].setting("data.dali_threads") == 4
    # Its queue and the engines' share at what measurement found likeliest fastest (Policy.first), where searched.
    assert under[0].setting("data.dali_prefetch") == 3
    drawn = [t.params for t in r.study.trials if t.params.get("data.decode") == "dali"]
    assert drawn and all("loader.num_workers" not in p and "data.dali_prefetch" in p for p in drawn)


def test_leaders_that_tie_are_run_again_and_still_tying_are_named_a_tie():
    # nvJPEG and the hybrid at 25 % both feed more than the model takes: end to end each runs at the ceiling's pace,
    # and one run each cannot tell them apart. The last trials run them again, and the search says they tie.
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=10)
    confirms = [v for v in r.views if v.stage == "confirm"]
    assert confirms, [v.stage for v in r.views]
    assert "stages: the last trials run the leaders whose intervals overlap the best's once more" in r.out
    tied = view.tied(r.views)
    assert len(tied) >= 2 and {v.number for v in confirms} <= {v.number for v in r.views}
    for again in confirms:
        first = next(v for v in e2e(r) if v.number == again.attrs["confirm_of"])
        assert again.params == first.params
    best = view.fastest(r.views)
    assert len(best.attrs[view.RUNS]) == 2  # named by its runs combined
    said = best_line(r.study)
    assert "a tie with trial" in said and "their intervals overlap" in said, said
    # The confirmation ran to its end: the pruner never cuts a leader's run again.
    assert all(v.outcome == "measured" for v in confirms)


def test_a_lucky_best_that_stands_clear_of_the_rest_is_not_run_again():
    # nvJPEG's first end-to-end run is 6 % lucky: its interval lies above every other answer's, so nothing ties with
    # it and nothing is confirmed; the export's re-measure in a fresh process is what checks such a run.
    r = search(Machine(ceilings=GPU, supplies=FEEDS, luck={"nvjpeg-gpu": [1.06]}), trials=10)
    best = view.fastest(r.views)
    assert best.setting("data.decode") == "nvjpeg-gpu" and view.tied(r.views) == [best]
    assert not [v for v in r.views if v.stage == "confirm"]


def test_a_search_with_budget_to_spare_confirms_nothing_before_its_last_trials():
    r = search(Machine(ceilings=GPU, supplies=FEEDS), trials=30)
    stages = [v.stage for v in r.views if v.end_to_end]
    confirms = [i for i, s in enumerate(stages) if s == "confirm"]
    assert confirms and min(confirms) >= len(stages) - 3  # the last ones only, at most CONFIRM_TOP


def test_a_best_that_never_had_a_competitor_is_not_confirmed_the_budget_explores_instead():
    # Trials of about a minute (a script's own loader in whole epochs took 171 s on 1xH200): after the first candidate
    # the time left pays for one trial. Picked from one run, its figure is no draw's top: the last trial explores.
    r = search(Machine(ceilings=GPU, supplies=FEEDS, run_s=60.0), trials=30, timeout=330, clock=SimClock())
    assert [v.stage for v in e2e(r)] == ["baseline", "candidate", "climb"]


# ---- what really limits the job: a decode on the GPUs beside the model, a model bound by its launches ----------------

SMALL = {("fp16", True): 14265.0, ("fp16", False): 11000.0, ("bf16", True): 12500.0, ("bf16", False): 9800.0,
         ("fp32", True): 8841.0, ("fp32", False): 7428.0}
"""A small classifier: alone, its model runs faster than most pipelines feed (an input to the simulation)."""

GPU_DECODE = {"pil": 1500.0, "torchvision-cpu": 5000.0, "nvjpeg-gpu": 15929.0}


def test_a_decode_on_the_gpus_is_charged_its_device_time_and_the_pipelines_are_measured_before_the_model_again():
    # nvJPEG alone feeds more than the model takes, with the GPUs a third busy decoding: beside the model, each
    # sample pays both. A pipeline that decodes less on the GPUs raises that bound more than a faster model does.
    machine = Machine(ceilings=SMALL, supplies=GPU_DECODE, decode_busy={"nvjpeg-gpu": 0.33})
    r = search(machine, trials=14, util=True)
    said = re.search(r"stages: (\S+)'s decode takes (\d+)% of each sample's time on the GPUs beside the model, "
                     r"bounding it at [\d,]+: the other pipelines are measured before other precisions and layouts",
                     r.out)
    assert said, r.out
    parts_run = [v for v in r.views if v.stage in ("ceiling", "supply")]
    first_other = next((i for i, v in enumerate(parts_run) if v.stage == "ceiling"
                        and (v.setting("training.precision"), v.setting("training.channels_last")) != ("fp16", True)),
                       len(parts_run))
    last_supply = max(i for i, v in enumerate(parts_run) if v.stage == "supply")
    assert last_supply < first_other, [(v.stage, v.setting("data.decode")) for v in parts_run]
    nvjpeg = r.engine.stages.snapshot(views_read=r.views).pipe_of({"data": {"decode": "nvjpeg-gpu"}})
    assert nvjpeg.device_share == pytest.approx(0.33, abs=0.01)
    assert nvjpeg.with_model(14265.0) == pytest.approx(1 / (1 / 14265 + 0.33 / 15929), rel=0.02)
    # show names the decode's share of the GPUs as what limits the job, with the fix.
    limit = dict(conclusions(r.study))["what limits it"]
    assert "shared by the model and the decode" in limit and "% of each sample's time" in limit, limit
    assert "NVIDIA DALI's hardware decoder (pip install 'ddp-autotune[dali]')" in limit, limit


def test_a_draw_is_not_launched_where_its_decode_beside_the_model_bounds_it_below_the_best():
    machine = Machine(ceilings=SMALL, supplies=GPU_DECODE, decode_busy={"nvjpeg-gpu": 0.33})
    r = search(machine, trials=14, util=True)
    snap = r.engine.stages.snapshot(views_read=r.views)
    best = view.fastest(r.views)
    bound = snap.bound_of({**best.config, "data": {**best.config["data"], "decode": "nvjpeg-gpu"}})
    assert bound is not None and "decode on the GPUs takes" in bound[1], bound
    assert bound[0] < 14265 * 0.85  # well under the model alone: the decode's device time is charged


def test_a_model_bound_by_its_launches_weighs_compile_before_other_precisions_and_layouts():
    # The model alone keeps the GPUs 35 % busy: its steps wait on the host's kernel launches, which a compile cuts.
    machine = Machine(ceilings=GPU, supplies=FEEDS, model_busy=0.35, compile_gain=1.4, compile_s=20.0)
    r = search(machine, spec=COMPILING, trials=24, util=True, trial_timeout=150.0)
    ceilings = parts(r, "ceiling")
    order = [(v.setting("training.precision"), v.setting("training.channels_last"), compiled(v)) for v in ceilings]
    first_other = next(i for i, o in enumerate(order) if o != order[0])
    assert order[first_other] == ("fp16", True, True), order  # compiled comes first, then the rest
    assert "stages: the model alone keeps the GPUs 35 % busy at fp16 channels_last: the host's kernel launches " \
           "bound its steps, so compiled is weighed before other precisions and layouts" in r.out
    # A busy model keeps the old order: precisions and layouts first, compiled last.
    busy = search(Machine(ceilings=GPU, supplies=FEEDS, compile_gain=1.4, compile_s=20.0), spec=COMPILING,
                  trials=24, util=True, trial_timeout=150.0)
    assert "kernel launches bound" not in busy.out


# ---- the climb: each trial after the candidates a neighbour of the best -------------------------------------------

CROWDED = {"pil": 1500.0, "torchvision-cpu": 2500.0, "nvjpeg-gpu": 2000.0}
"""Pipelines that feed less than the model takes (an input to the simulation): the job is input-bound."""


def crowded_machine() -> Machine:
    """Its pipelines feed their most from 4 loader workers on; end to end, every worker past 4 takes a core the
    rank's own processes need (``Machine.contend_past``), so the fastest count is below the cores."""
    return Machine(ceilings=GPU, supplies=CROWDED, max_workers=4, contend_past=4, contention=0.1)


def grid_optimum(machine: Machine, spec=SPEC) -> float:
    """The machine's fastest end-to-end pace over every point of the spec's space (the simulation's own figures)."""
    space, base = spec["space"], constructed_plan(spec).base
    low, high = space["loader.num_workers"]["low"], space["loader.num_workers"]["high"]
    best = 0.0
    for precision in space["training.precision"]:
        for layout in space["training.channels_last"]:
            for bs in space["training.batch_size"]:
                for decode in space["data.decode"]:
                    for fraction in space["data.hybrid_cpu_fraction"]["choices"] if decode == "hybrid" else [0.5]:
                        for workers in range(low, high + 1):
                            cfg = base.with_overrides({
                                "training.precision": precision, "training.channels_last": layout,
                                "training.batch_size": bs, "data.decode": decode,
                                "data.hybrid_cpu_fraction": fraction, "loader.num_workers": workers})
                            best = max(best, machine.pace(cfg, searched=True))
    return best


def test_where_workers_past_a_count_slow_the_job_the_climb_finds_the_machines_optimum():
    machine = crowded_machine()
    r = search(machine, trials=16)
    best = view.fastest(r.views)
    optimum = grid_optimum(machine)
    assert best.imgs_per_s >= 0.95 * optimum, r.out
    # The candidate left the rank's processes a share of the cores; the climb moved its workers down from there, and
    # the best is a climb trial that beat the first candidate.
    first = next(v for v in e2e(r) if v.stage == "candidate")
    assert first.params["loader.num_workers"] < SPEC["space"]["loader.num_workers"]["high"]
    assert best.stage == "climb" and first.interval.below(best.interval)
    assert best.params["loader.num_workers"] < first.params["loader.num_workers"]
    # The best reaches well below what its parts allow: its profiled step names its wait for data, and the climb
    # takes the loader's knobs first.
    assert "its profiled step's largest cost is waiting for data; what addresses it first: more loader workers" \
        in r.out


def test_each_climb_trial_is_one_knob_one_step_from_its_point_and_no_draw_comes_before_the_climb_ends():
    r = search(crowded_machine(), trials=30)
    by_number = {v.number: v for v in e2e(r)}
    climbs = [v for v in e2e(r) if v.stage == "climb"]
    assert len(climbs) >= 4
    points = {c.attrs["climb_from"] for c in climbs}
    for c in climbs:
        point = by_number[c.attrs["climb_from"]]
        changed = {k for k in {*c.params, *point.params} if c.params.get(k) != point.params.get(k)}
        assert changed == {c.attrs["climb_knob"]}, (c.number, changed)
    # Each point is the first candidate, a climb trial that beat its own point (or tied it cheaper), or a later draw
    # that beat the climb's end: the climb then starts again from it.
    for number in points:
        moved = by_number[number]
        assert moved.stage != "climb" or moved.attrs["climb_from"] < number
    # The sampler draws only once the first climb has no move left.
    draws = [v.number for v in e2e(r) if v.stage in ("refine", "search")]
    first = [c for c in climbs if not draws or c.number < min(draws)]
    start = first[0].attrs["climb_from"]
    assert first and {c.attrs["climb_from"] for c in first} <= {start, *(c.number for c in first)}
    assert "stages: the climb ends at trial" in r.out


RESNET50 = {("fp16", True): 6238.0, ("fp16", False): 4300.0, ("bf16", True): 5600.0, ("bf16", False): 3900.0,
            ("fp32", True): 2500.0, ("fp32", False): 2100.0}
"""A ResNet-50 on one GPU, with the supplies below (inputs to the simulation)."""


def test_a_cpu_decode_is_charged_the_cores_a_ranks_own_processes_take_and_its_candidate_gets_the_workers_it_needs():
    # The bound alone ranks hybrid at a 75 % CPU share first (it takes the least of the GPUs), but that share needs
    # every core the pipeline had alone; end to end the rank's own processes take two of them.
    machine = Machine(ceilings=RESNET50, supplies={"pil": 2514.0, "torchvision-cpu": 4680.0, "nvjpeg-gpu": 12336.0},
                      decode_busy={"nvjpeg-gpu": 0.26})
    r = search(machine, trials=12, util=True)
    candidates = [v for v in e2e(r) if v.stage == "candidate"]
    hybrid = [v.setting("data.hybrid_cpu_fraction") for v in candidates if v.setting("data.decode") == "hybrid"]
    # Charged, the 75 % share feeds 4,680 x 6/8 at most; the 50 % share, bounded by the GPUs' time, ranks first.
    assert hybrid and hybrid[0] == 0.5, [(v.setting("data.decode"), v.setting("data.hybrid_cpu_fraction"))
                                         for v in candidates]
    # Workers that only read files start at the policy's share; a CPU share that needs more gets more, never all.
    workers = {v.setting("data.decode"): v.setting("loader.num_workers") for v in candidates}
    most = SPEC["space"]["loader.num_workers"]["high"]
    assert workers["nvjpeg-gpu"] == round(0.75 * most)
    assert all(w <= most - 2 for w in workers.values())


def test_where_the_best_steps_wait_for_data_the_climb_moves_its_workers_up_first_and_down_where_they_do_not():
    # Pipelines that feed less than the model takes, at their most from all 8 workers: the candidate's 6 starve the
    # step, which waits for data; with compute the limit instead, fewer workers (cheaper) come first.
    waiting = search(Machine(ceilings=GPU, supplies=CROWDED), trials=8)
    first = next(v for v in e2e(waiting) if v.stage == "climb")
    point = next(v for v in e2e(waiting) if v.number == first.attrs["climb_from"])
    assert point.attrs["data_wait_share"] >= DATA_WAIT_SAID
    assert (first.attrs["climb_knob"], first.attrs["climb_dir"]) == ("loader.num_workers", "up")
    fed = search(Machine(ceilings=GPU, supplies=FEEDS), trials=8)
    first = next(v for v in e2e(fed) if v.stage == "climb")
    assert first.attrs["climb_dir"] == "down"
    # The same starved step on cores that were full while it ran (``autotune.hw.cpu``): more workers would take
    # cores from the rank's own process, so fewer come first.
    with mock.patch("autotune.search.evaluate.busy_share", lambda readings, windows: 0.97):
        full = search(Machine(ceilings=GPU, supplies=CROWDED), trials=8)
    first = next(v for v in e2e(full) if v.stage == "climb")
    point = next(v for v in e2e(full) if v.number == first.attrs["climb_from"])
    assert point.attrs["data_wait_share"] >= DATA_WAIT_SAID and point.attrs["cpu_busy"] == 0.97
    assert (first.attrs["climb_knob"], first.attrs["climb_dir"]) == ("loader.num_workers", "down")


def test_a_move_is_taken_only_where_both_figures_have_intervals():
    from autotune.search.stages._climb import Climb

    def run(number: int, ips: float, half: float | None, workers: int) -> view.TrialView:
        return view.TrialView(number=number, state=TrialState.COMPLETE, stage="climb", outcome="measured",
                              imgs_per_s=ips, half_width=half, params={"loader.num_workers": workers},
                              attrs={} if half is not None else {"precise": False})

    point, cheaper = run(1, 1000.0, 0.02, 8), run(2, 990.0, 0.02, 6)
    assert Climb.accepted(cheaper, point, point, "loader.num_workers")  # a tie, and cheaper
    unknown = run(3, 1000.0, None, 8)  # one window: no interval
    assert not Climb.accepted(cheaper, unknown, unknown, "loader.num_workers")
    assert not Climb.accepted(run(4, 5000.0, None, 6), point, point, "loader.num_workers")


EXPOSED = {"data": 0.05, "copy": 0.0, "compute": 0.3, "optimizer": 0.05, "communication": 0.5, "launch": 0.1}
"""A step held back by DDP's communication (an input to the simulation): what neither part measures."""


@pytest.mark.parametrize("share", [0.6, 0.95])
def test_a_best_its_parts_do_not_explain_has_its_step_profiled_once_and_the_climb_starts_at_its_largest_part(share):
    """End to end at ``share`` of what the model alone and its pipeline allow together: at 0.6 the parts do not
    explain it, and the best runs once more with its step profiled; its largest part (DDP's communication) is what
    the climb moves first, and ``show`` says the split. At 0.95 they do, and nothing is profiled."""
    r = search(Machine(ceilings=GPU, supplies=FEEDS, e2e_share=share, profile=EXPOSED), trials=14)
    profiles = [v for v in e2e(r) if v.stage == "profile"]
    if share > 0.8:
        assert profiles == [] and all(v.config["measure"]["profile_steps"] == 0 for v in e2e(r))
        return
    (profile,) = profiles
    of = next(v for v in e2e(r) if v.number == profile.attrs["profile_of"])
    assert profile.params == of.params and profile.config["measure"]["profile_steps"] > 0
    assert profile.attrs["step_split"]["communication"] == EXPOSED["communication"]
    # One more run of the same configuration: its runs stand combined, and the profile is no configuration of its own.
    assert [n for n, *_ in next(c for c in view.configurations(r.views) if c.number == of.number).attrs["runs"]] \
        == [of.number, profile.number]
    climbs = [v for v in e2e(r) if v.stage == "climb" and v.number > profile.number]
    assert climbs and climbs[0].attrs["climb_knob"] == "ddp.bucket_cap_mb", [v.attrs for v in climbs]
    assert "its profiled step's largest cost is DDP's communication" in r.out
    said = dict(conclusions(r.study))["what limits it"]
    assert said.startswith("not explained by the parts") and \
        f"a profile of trial {profile.number}'s step over" in said and \
        "waits 50 % of its time for DDP's communication, the largest cost: DDP's gradient buckets" in said, said
