"""How sure a user's script's figures are, as its search and ``show`` say it: a trial 0 whose windows were too few for
an interval, a figure without an interval set beside others, trial 0 measured once to the baseline's precision, a
loss that never moved.

The search runs on the simulated machine of ``test_script_defects`` (the search's own engine, stages, evaluator and
recording; only the runs are simulated, and the figures are inputs of the tests)."""

from __future__ import annotations

import re

import optuna
import pytest

from autotune import export, overview, report
from autotune.search import script
from autotune.search.evaluate import BASELINE_CAP, BASELINE_PRECISION
from autotune.study import view
from autotune.study.found import found
from autotune.study.storage import open_storage, trial_attrs
from tests.autotune.search import test_script_defects as defects
from tests.autotune.search.test_script_defects import Sim, cpu_demo_study, cpu_ranks, script_plan, storage_of
from tests.helpers.cli import REPO, autotune
from tests.helpers.machine import FakePool

ONE_WINDOW = {"measure.max_s": 0.5, "measure.warmup_min_steps": 1, "training.batch_size": 512}
"""Trial 0's measurement cut to one window (a script whose steps are slow): a figure without an interval. Each of its
steps takes longer than the cap, so the first window ends past it whatever the machine's noise."""


# ---- trial 0 without an interval -----------------------------------------------------------------------------------


def test_a_search_whose_trial_0_has_no_interval_runs_to_its_end_and_says_why(tmp_path, two_cores):
    sim = Sim(tmp_path, cpu_ranks(), 6, first=ONE_WINDOW)
    first = next(v for v in sim.views if v.baseline)
    assert first.imgs_per_s is not None and first.half_width is None, first.attrs  # the case: a figure, no interval
    assert len([v for v in sim.views if not v.part]) > 2, sim.lines  # the search went on after trial 0
    said = re.search(r"trial 0 has no interval \((.+?)\)", sim.lines)
    assert said and "1 window" in said.group(1), sim.lines  # why it is measured again, in the search's lines


def test_show_the_report_and_the_export_of_a_baseline_without_an_interval_say_why(tmp_path, two_cores):
    sim = Sim(tmp_path, cpu_ranks(), 2, first=ONE_WINDOW)  # no budget left to measure it again
    assert view.baseline(sim.views).half_width is None
    shown = overview.table(sim.study)
    assert re.search(r"trial 0.*no interval: 1 window", shown), shown
    report.render_html(sim.study)
    data, _ = export.build(sim.study, export.pick_trial(sim.study))
    assert data["autotune"]["measured"].get("gain_half_width") is None, data["autotune"]["measured"]


# ---- a figure without an interval is no tie ------------------------------------------------------------------------


def unknown_beside_known(tmp_path) -> optuna.Study:
    """Trial 0 at 100 ± 1 %; trial 1 at 453 ± 2 %; trial 2 at 295, one window: no interval."""
    known = [100.0, 101.0, 99.0, 100.0]
    return cpu_demo_study(storage_of(tmp_path), trials=[
        ("baseline", {"training.batch_size": 8, "data.decode": "pil"}, known, True, (1.4, 1.3), {}),
        ("refine", {"training.batch_size": 32, "data.decode": "pil"}, [450.0, 455.0, 453.0, 453.0], True, (1.3, 1.2),
         {"ci_half_width": 0.02}),
        ("refine", {"training.batch_size": 64, "data.decode": "pil"}, [295.0, 295.0, 295.0, 295.0], False,
         (1.3, 1.2), {"ci_half_width": None, "windows": 1, "measured_s": 0.5})], parts=[])


def test_a_trial_without_an_interval_is_never_named_a_tie(tmp_path):
    study = unknown_beside_known(tmp_path)
    trials = view.views(study)
    line = found(trials)
    assert line.startswith("trial 1,") and "tie" not in line, line
    assert [v.number for v in view.tied(trials)] == [1]
    shown = overview.table(study)
    row = next(ln for ln in shown.splitlines() if ln.startswith("2 "))
    assert "=" not in row.split()[5], row  # its ratio to trial 0 is not marked a tie either
    assert re.search(r"trial 2's interval is unknown: 1 window .*too few", shown), shown


# ---- trial 0 measured once, to the baseline's precision ------------------------------------------------------------


def test_trial_0_of_a_script_is_measured_to_the_baselines_precision(tmp_path, monkeypatch, two_cores):
    plan = script_plan(3, root=tmp_path)
    pool = FakePool(cpu_ranks(), tmp_path)
    jobs = []

    def run_trial(job):  # trial 0 in a fresh process, with the settings record the script writes
        jobs.append(job)
        run = pool.run(job, fresh=True)
        run.records.insert(1, {"kind": "settings", "t": 0.0, "unit": "images", "applied": defects.APPLIES,
                               "loader": True, "samples_per_rank": defects.SAMPLES_PER_RANK})
        return run

    monkeypatch.setattr(script, "run_trial", run_trial)
    script.probe(plan, tmp_path / "logs", lambda line: None)
    m = jobs[0].config.measure
    assert (m.precision, m.max_s) == (BASELINE_PRECISION, BASELINE_CAP * plan.base.measure.max_s), m


def test_a_trial_0_within_the_baselines_precision_at_its_cap_is_not_measured_again(tmp_path, two_cores):
    # Trial 0 measured to the study's ±3 % (a script study started before its probe measured to the baseline's
    # precision): its cap reached at ±3.7 %, within the baseline's ±5 %.
    sim = Sim(tmp_path, cpu_ranks(noisy={"pil": 0.1}), 8, first={"measure.precision": 0.03})
    first = next(v for v in sim.views if v.baseline)
    assert first.precise is False and 0.03 < first.half_width <= BASELINE_PRECISION, first.attrs
    again = [v for v in sim.views if v.attrs.get("remeasure_of") is not None]
    assert not again, sim.lines


def test_a_trial_0_measured_again_names_the_precision_it_was_measured_to(tmp_path, two_cores):
    sim = Sim(tmp_path, cpu_ranks(noisy={"pil": 0.2}), 8)
    assert any(v.attrs.get("remeasure_of") == 0 for v in sim.views), sim.lines
    said = next(ln for ln in sim.lines.splitlines() if "measured again in a fresh process" in ln)
    assert f"±{BASELINE_PRECISION:.0%}" in said and "±3%" not in said, said


def test_a_trial_0_wider_only_by_its_loaders_turn_seen_once_is_measured_once_and_show_says_why(tmp_path, monkeypatch,
                                                                                                 two_cores):
    """A script's own loader on epochs longer than a trial: its windows come within the precision, but the first
    epoch's start, charged per epoch and seen once, keeps the interval wider (``trainer.estimate.stop``: ``turn``). A
    fresh process would measure what the windows already hold: trial 0 is not measured again, and ``show`` says why
    its interval is wide instead of calling it capped. The simulated runs end so where they would have reached their
    cap (the simulated machine has no epochs)."""
    import trainer.meter

    real = trainer.meter.stop
    monkeypatch.setattr(trainer.meter, "stop", lambda est, **kw: "turn" if real(est, **kw) == "capped" else
                        real(est, **kw))
    sim = Sim(tmp_path, cpu_ranks(noisy={"pil": 0.2}), 8)  # noisy enough to be measured again at its cap
    first = next(v for v in sim.views if v.baseline)
    assert first.attrs.get("ended") == "turn" and first.half_width > BASELINE_PRECISION, first.attrs
    assert not any(v.attrs.get("remeasure_of") is not None for v in sim.views), sim.lines
    shown = overview.table(sim.study)
    row = next(ln for ln in shown.splitlines() if ln.startswith("0"))
    assert "^" in row and "~" not in row, row
    assert re.search(r"\^ its windows came within the precision asked; its loader's epoch turn, seen only", shown)
    assert "reached its time cap" not in shown.split("how sure:")[1].splitlines()[0], shown


@pytest.fixture(autouse=True)
def _quiet():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


# ---- a loss that never moves ---------------------------------------------------------------------------------------


def test_a_loss_that_never_moves_is_flagged_in_the_trials_row_and_in_show(tmp_path, two_cores):
    sim = Sim(tmp_path, cpu_ranks(loss=0.0), 3)
    first = next(v for v in sim.views if v.baseline)
    assert first.outcome == "measured" and first.imgs_per_s, first.attrs  # the figure stays ...
    shown = overview.table(sim.study)
    row = next(ln for ln in shown.splitlines() if ln.startswith("0"))
    assert "0->0!" in row, row  # ... flagged in its row ...
    assert re.search(r"! trial 0: its loss never moved", shown), shown  # ... and said in words
    assert re.search(r"how sure: .*WARNING: its loss never moved", shown), shown


# ---- trials on the live worker (a real search: 2 gloo ranks) -------------------------------------------------------

USER_FOLDER = REPO / "tests" / "helpers" / "scripts" / "user_folder.py"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_image_folder_scripts_trials_stay_on_the_live_worker(tmp_path):
    """A user's ImageFolder script on the function path: trial 0 starts the worker, and the trials after it run on it;
    a trial that needs a fresh process says which setting asks for one."""
    from tests.jobutil import make_jpeg_folder

    data = make_jpeg_folder(tmp_path / "photos", classes=4, per_class=64)
    r = autotune("search", "--script", f"{USER_FOLDER}:main", "--trials", "4", "--", "--data", data,
                 cwd=tmp_path, timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    shown = autotune("show", "--study", "script-user_folder-main", cwd=tmp_path).stdout
    count = re.search(r"\((\d+) launched, (\d+) on a live worker(?:, (\d+) of them with the loader workers an "
                      r"earlier trial kept)?\)", shown)
    assert count, shown
    study = optuna.load_study(study_name="script-user_folder-main",
                              storage=open_storage(f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}"))
    ran = [trial_attrs(t) for t in study.get_trials()] + [trial_attrs(t) for t in view.parts_of(study).get_trials()]
    fresh = [a for a in ran if a.get("fresh_process")]
    # Trial 0 in a fresh process, as a user's job runs; the worker it started serves the rest, but a re-measure of
    # trial 0, which is the point of one.
    assert int(count.group(1)) == len(fresh) and int(count.group(2)) == len(ran) - len(fresh), shown
    assert int(count.group(3) or 0) == sum(1 for a in ran if a.get("loader_kept")), shown
    assert all(a.get("stage") == "baseline" for a in fresh), [(a.get("stage"), a.get("fresh_process")) for a in fresh]
    rows = [ln for ln in shown.splitlines() if re.match(r"\d+\*?\s+baseline", ln)]
    assert rows and all("fresh process:" in ln for ln in rows), shown
