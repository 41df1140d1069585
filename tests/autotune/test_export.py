"""`autotune export` picking and LR scaling, on a real Optuna study (in-memory storage) whose trials are recorded by
the search's own recording step."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
import yaml

from autotune import export, overview
from autotune.exceptions import StorageError
from autotune.objective import Objective
from autotune.search.evaluate import Evaluation
from autotune.search.record import record
from autotune.space import resolve
from autotune.spec import StudySpec
from autotune.study import view
from autotune.study.setup import create_or_load
from autotune.study.storage import open_storage
from tests.helpers.cli import autotune
from trainer.config import TrainConfig
from trainer.protocol import Failure

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPEC = {"name": "x", "base": {"model": {"name": "resnet50"}, "optimizer": {"lr": 0.1, "reference_global_batch": 256}},
        "default_space": False, "space": {"training.batch_size": [64, 128, 256]},
        "export": {"training.mode": "train", "training.epochs": 90}}


def make_study(kind: str, rows: list[tuple[int, float | None, float | None, str | None]], stage: str = "search",
               storage=None, **changes):
    """rows: (batch, imgs/s, util, failure class); trial 0 is the baseline; ``changes``: settings of every trial's
    config, by dotted path with ``__`` for the dots."""
    spec = StudySpec.from_dict(SPEC)
    objective = Objective(kind=kind)
    study = create_or_load(spec=spec, study_name="x", storage=storage or optuna.storages.InMemoryStorage(),
                           objective=objective, nproc=2,
                           attrs={"fingerprint": {"gpu_model": "NVIDIA H200", "gpu_count": 2},
                                  "torchrun_args": [], "reference_global_batch": 256})
    space = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=False)
    base = spec.base_config()
    for i, (bs, ips, util, failure) in enumerate(rows):
        t = study.ask({"training.batch_size": optuna.distributions.CategoricalDistribution([64, 128, 256])})
        ev = Evaluation(stage="baseline" if i == 0 else stage, util_available=util is not None,
                        figures={"env": {"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "8"},
                                 "versions": {"torch": "2.11.0"}},
                        config=base.with_overrides({"training.batch_size": bs,
                                                    **{k.replace("__", "."): v for k, v in changes.items()}}),
                        failure=Failure(failure) if failure else None, message="injected" if failure else None)
        if not failure:
            ev.imgs_per_s, ev.util_mean, ev.ci_half_width = ips, util, 0.01
        record(study, t, ev, objective, space)
    return study


def test_best_is_the_fastest_feasible_trial_and_lr_scales_with_the_global_batch(tmp_path):
    study = make_study("throughput", [(64, 1000.0, None, None), (256, 3000.0, None, None), (128, None, None, "oom")])
    trial = export.pick_trial(study)
    assert trial.number == 1
    data, warnings = export.build(study, trial)
    assert any("lr scaled linearly 0.1 -> 0.2" in w for w in warnings)  # 256 x 2 ranks = 512 = 2 x 256
    a = data["autotune"]
    assert a["lr_scaling"] == {"rule": "linear", "from_lr": 0.1, "from_global_batch": 256, "to_lr": 0.2,
                               "to_global_batch": 512}
    assert a["measured"]["gain"] == 3.0 and a["measured"]["baseline_trial"] == 0
    assert a["fingerprint"] == {"gpu_model": "NVIDIA H200", "gpu_count": 2, "torch": "2.11.0"}
    assert a["torchrun"]["command"].startswith("torchrun --standalone --nproc-per-node 2 -m trainer --config")
    path = export.write(data, tmp_path / "best.yaml")
    cfg = TrainConfig.from_yaml(path)
    assert cfg.optimizer.lr == pytest.approx(0.2) and cfg.training.mode == "train" and cfg.training.epochs == 90
    assert yaml.safe_load(path.read_text())["autotune"]["trial"] == 1


def test_same_global_batch_keeps_the_lr(tmp_path):
    study = make_study("throughput", [(128, 1000.0, None, None)], loader__persistent_workers=True)  # 128 x 2 = 256
    data, warnings = export.build(study, export.pick_trial(study))
    assert warnings == [] and "lr_scaling" not in data["autotune"] and data["optimizer"]["lr"] == 0.1


def test_a_full_run_keeps_the_loader_workers_its_trials_could_not_tell_from_restarted_ones():
    """The built-in job's trials stream their epochs: a best trial drawn with workers restarted every epoch measured
    as fast as with them kept, and its export then restarted them at every epoch of the full run."""
    study = make_study("throughput", [(128, 1000.0, None, None)])  # 4 workers, not kept (the job's defaults)
    data, warnings = export.build(study, export.pick_trial(study))
    assert data["loader"]["persistent_workers"] is True and TrainConfig.from_dict(data).loader.persistent_workers
    assert warnings == ["loader.persistent_workers: true for the full run (the trials stream their epochs without "
                        "restarting the loader's workers, so they measure kept and restarted workers alike; a run of "
                        "many epochs restarts them at every epoch)"]
    for changes in ({"loader__num_workers": 0},  # no workers to keep
                    {"script__path": "train.py", "data__kind": "script"}):  # a script's trials charge its turns
        study = make_study("throughput", [(128, 1000.0, None, None)], **changes)
        data, warnings = export.build(study, export.pick_trial(study))
        assert not data.get("loader", {}).get("persistent_workers") and warnings == [], changes


def test_pareto_picks_from_the_front():
    # Four configurations (a configuration run twice would count once, at the mean of its runs).
    rows = [(64, 1700.0, 59.0, None), (256, 3200.0, 46.0, None), (64, 2000.0, 40.0, None), (128, 2600.0, 80.0, None)]
    study = make_study("pareto", rows)
    assert [v.number for v in export.pareto_front(view.feasible(view.views(study)))] == [1, 3]
    assert export.pick_trial(study, "best").number == 1  # pareto "best": the fastest on the front
    assert export.pick_trial(study, "util").number == 3
    assert export.pick_trial(study, "balanced").number == 3  # 2600/3200 * 80/80 > 3200/3200 * 46/80


def test_bad_picks_say_what_to_do():
    study = make_study("throughput", [(64, 1000.0, None, None), (128, None, None, "oom")])
    with pytest.raises(StorageError, match="trial 1 is not a complete end-to-end measurement \\(oom\\)"):
        export.pick_trial(study, "1")
    with pytest.raises(StorageError, match="no trial 9"):
        export.pick_trial(study, "9")
    with pytest.raises(StorageError, match="no trial of this study recorded GPU utilization"):
        export.pick_trial(study, "util")
    with pytest.raises(StorageError, match="use one of best, fastest"):
        export.pick_trial(study, "cheapest")
    empty = make_study("throughput", [(64, None, None, "oom")])
    with pytest.raises(StorageError, match="no complete, feasible end-to-end trial"):
        export.pick_trial(empty)


def test_a_stage_measurement_is_never_an_answer():
    """The model alone on synthetic data (a ceiling measurement) is faster than any end-to-end trial and still not
    something a user can train with: it is neither exported nor counted as the best."""
    study = make_study("throughput", [(64, 1000.0, None, None), (256, 9000.0, None, None)], stage="ceiling")
    assert export.pick_trial(study).number == 0
    with pytest.raises(StorageError, match="a ceiling measurement, not a training configuration"):
        export.pick_trial(study, "1")
    assert view.fastest(view.views(study)).number == 0 and view.ceiling(view.views(study)).number == 1


def test_a_best_trial_that_re_measures_below_trial_0_is_warned_of_and_marked():
    study = make_study("throughput", [(64, 1000.0, None, None), (256, 3000.0, None, None), (128, 2000.0, None, None)])
    best = export.pick_trial(study)
    data, _ = export.build(study, best)
    line = export.record_remeasure(study, best, data, {"imgs_per_s": 900.0, "ci_half_width": 0.02,
                                                       "precise": True})
    assert "= 30.0% of the search's 3,000 ± 1.0 %" in line and "WARNING: their intervals do not overlap" in line
    warning = export.below_baseline_warning(best, data)
    assert warning.startswith("trial 1 re-measured at 900 ± 2.0 % imgs/s in a fresh process, measurably below trial "
                              "0 (the baseline, 1,000 ± 1.0 %)") and "`--pick 0`" in warning
    shown = overview.table(study)
    rows = shown.splitlines()
    assert any(row.startswith(f"1*{overview.BELOW} ") for row in rows), shown  # trial 1's row
    assert f"{overview.BELOW} trial 1 re-measured in a fresh process (`autotune export`) at 900 ± 2.0 % imgs/s, " \
           "measurably below trial 0's 1,000" in shown
    assert "re-measured in a fresh process: 900 ↓ below trial 0" in shown  # in the headline too
    sure = dict(overview.conclusions(study))["how sure"]
    assert ("in a fresh process it measured 900 ± 2.0 % (30% of it, further off than both intervals allow), "
            "measurably below trial 0's 1,000") in sure

    # One that holds up is recorded, and not marked.
    other = next(v for v in view.views(study) if v.number == 2)
    data, _ = export.build(study, other)
    line = export.record_remeasure(study, other, data, {"imgs_per_s": 1990.0, "ci_half_width": 0.01})
    assert line.endswith(": their intervals overlap"), line
    assert export.below_baseline_warning(other, data) is None
    assert export.remeasures(study)[2] == {"imgs_per_s": 1990.0, "ci_half_width": 0.01, "ratio": 0.995,
                                           "agrees": True, "below_baseline": None}
    assert not any(row.startswith(f"2{overview.BELOW}") for row in overview.table(study).splitlines())
    assert any(row.startswith("2 ") for row in overview.table(study).splitlines())


def test_an_output_that_cannot_be_written_is_refused_before_the_re_measure(tmp_path):
    (tmp_path / "studies").mkdir()
    make_study("throughput", [(64, 1000.0, None, None)],
               storage=open_storage(f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}"))
    (tmp_path / "notes.txt").write_text("a file")
    r = autotune("export", "notes.txt/best.yaml", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "autotune export: error: output notes.txt/best.yaml: notes.txt is a file, not a folder" in r.stderr
    assert "re-measure" not in r.stdout
    r = autotune("export", "out/sub/best.yaml", "--no-remeasure", cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and "autotune export: making folder out/sub" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "out" / "sub" / "best.yaml").is_file()
    assert not list((tmp_path / "out" / "sub").glob(".*.tmp"))


def test_a_configuration_run_twice_is_exported_and_checked_at_its_runs_combined():
    # Trial 1 ran 3,300 once; run again (a confirmation) it ran 2,700: its figure is 3,000, and as the two runs lie
    # further apart than either's interval, its interval is half their range: a tie with trial 2's 3,100 ± 1 %.
    study = make_study("throughput", [(64, 1000.0, None, None), (256, 3300.0, None, None), (128, 3100.0, None, None),
                                      (256, 2700.0, None, None)])
    best = export.pick_trial(study)
    assert best.number == 2 and export.pick_trial(study, "fastest").number == 2
    one = export.pick_trial(study, "1")  # asked by number: the configuration's runs combined all the same
    assert one.imgs_per_s == pytest.approx(3000.0) and one.half_width == pytest.approx(0.1)
    assert one.attrs[view.RUNS] == [[1, 3300.0, 0.01], [3, 2700.0, 0.01]] and one.interval.ties(best.interval)
    data, _ = export.build(study, one)
    assert data["autotune"]["measured"]["imgs_per_s"] == pytest.approx(3000.0)
    assert data["autotune"]["measured"]["runs"] == [[1, 3300.0, 0.01], [3, 2700.0, 0.01]]
    line = export.record_remeasure(study, one, data, {"imgs_per_s": 2950.0, "ci_half_width": 0.01})
    assert ("= 98.3% of the search's 3,000 ± 10.0 % (trials 1 and 3: 3,300 ± 1.0 % / 2,700 ± 1.0 % imgs/s): their "
            "intervals overlap") in line, line
    assert "WARNING" not in line


def test_trial_0_measured_twice_is_one_answer_its_runs_combined():
    study = make_study("throughput", [(64, 1000.0, None, None), (128, 900.0, None, None)], stage="baseline")
    (only,) = view.configurations(view.views(study))
    base = view.baseline(view.views(study))
    assert only.imgs_per_s == base.imgs_per_s == pytest.approx(950.0) and base.half_width == pytest.approx(50 / 950)


def test_a_precise_run_counts_for_more_than_a_wide_one():
    study = make_study("throughput", [(64, 1000.0, None, None), (256, 3300.0, None, None), (256, 3100.0, None, None)])
    widths = {1: 0.05, 2: 0.01}  # trial 1 reached its time cap at ± 5 %, trial 2 came within ± 1 %
    vs = [dataclasses.replace(v, half_width=widths.get(v.number, v.half_width)) for v in view.views(study)]
    (best,) = [a for a in view.configurations(vs) if not a.baseline]
    assert best.imgs_per_s == pytest.approx((3300 / 25 + 3100) / (1 / 25 + 1))  # weights 1 / 0.05² and 1 / 0.01²
    assert best.half_width == pytest.approx(100 / best.imgs_per_s)  # half their range: they disagree


def test_the_runs_of_an_answer_read_at_the_tables_precision():
    """A CPU study's best configuration named its runs "(75)": the table gives 75.3."""
    study = make_study("throughput", [(64, 60.0, None, None), (256, 75.3, None, None), (256, 68.5, None, None)])
    (best,) = [a for a in view.configurations(view.views(study)) if not a.baseline]
    assert view.describe_runs(best) == " (trials 1 and 2: 75.3 ± 1.0 % / 68.5 ± 1.0 % imgs/s)"


def test_show_marks_the_best_when_its_figure_is_the_mean_of_its_runs():
    study = make_study("throughput", [(64, 1000.0, None, None), (256, 3300.0, None, None), (128, 3000.0, None, None),
                                      (256, 3100.0, None, None)])
    rows = overview.table(study).splitlines()
    assert any(row.startswith("1* ") for row in rows), rows  # trial 1 at 3,200, the mean of trials 1 and 3
    assert not any(row.startswith(("2*", "3*")) for row in rows)


def test_a_script_counting_samples_is_exported_in_samples():
    """A user's script measured in samples/s: the export's lines said "imgs/s" and "50,829.0"."""
    study = make_study("throughput", [(64, 16_218.2, None, None), (256, 50_829.0, None, None)])
    study.set_user_attr("unit", "samples")
    best = export.pick_trial(study)
    data, _ = export.build(study, best)
    line = export.record_remeasure(study, best, data, {"imgs_per_s": 15_000.0, "ci_half_width": 0.02})
    assert "re-measured in a fresh process: 15,000 ± 2.0 % samples/s = 29.5% of the search's 50,829 ± 1.0 %" in line, \
        line
    warning = export.below_baseline_warning(best, data)
    assert warning.startswith("trial 1 re-measured at 15,000 ± 2.0 % samples/s in a fresh process, measurably below "
                              "trial 0 (the baseline, 16,218 ± 1.0 %)"), warning



def test_a_study_in_tokens_names_every_figure_of_its_overview_in_tokens():
    """A language model's study: the line of a configuration measured twice said "trials 1 and 2: ... imgs/s", and
    cuDNN's line "1,137,416 imgs/s"."""
    study = make_study("throughput", [(64, 176_667.0, None, None), (256, 1_097_298.0, None, None),
                                      (256, 1_090_000.0, None, None)])
    study.set_user_attr("unit", "tokens")
    study.set_user_attr("cudnn", {"fp16 NCHW": {"benchmark": False, "batch": 256,
                                                "with_search": {"imgs_per_s": 1_137_416.0, "trial": "p1"},
                                                "without_search": {"imgs_per_s": 1_138_897.0, "trial": "p0"}}})
    text = overview.table(study)
    assert "(trials 1 and 2: 1,097,298 ± 1.0 % / 1,090,000 ± 1.0 % tokens/s)" in text, text
    assert "with it 1,137,416 tokens/s" in text and "imgs/s" not in text, text
