"""What a user expects of a search of their own script (and of the report and wording it shares with the built-in
job), one test each.

The script is ``tests/helpers/scripts/segment.py``: a tiny U-Net on an in-memory dataset with its own augmentation,
adapted to the runtime as a new user would. Here its search runs on a simulated machine (``tests.helpers.machine``:
the search's own engine, stage planner, evaluator and recording step, only the trials' runs are simulated; the
figures are inputs of the tests), with the settings record its real trial 0 writes on 2 gloo ranks (``APPLIES``).
What needs a real process (a script's own torchrun, its records and its log) is in ``test_script_defects_cli.py``.
"""

from __future__ import annotations

import html
import io
import itertools
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from autotune import overview, report
from autotune.hw.nvml import Nvml
from autotune.objective import Objective
from autotune.runner.torchrun import Torchrun
from autotune.runner.trial import TrialJob
from autotune.search import script
from autotune.search.engine import Engine, best_line
from autotune.search.evaluate import baseline_measure, why_supply_stops
from autotune.search.prepare import Plan, SearchOptions
from autotune.search.progress import Progress
from autotune.space import resolve
from autotune.study import view
from autotune.study.setup import create_or_load
from autotune.study.storage import CONFIG_KEY
from tests.helpers.cli import REPO
from tests.helpers.machine import FakePool, Machine
from trainer.estimate import Interval
from trainer.protocol import nonfinite_reason

optuna.logging.set_verbosity(optuna.logging.WARNING)

SEGMENT = REPO / "tests" / "helpers" / "scripts" / "segment.py"

APPLIES = {"batch_size": 16, "num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True,
           "channels_last": False, "bucket_cap_mb": 25.0, "gradient_as_bucket_view": False, "static_graph": False,
           "compile": False, "accum_steps": 1, "precision": "fp32"}
"""What segment.py's trial 0 applies, as its settings record says on 2 gloo ranks (its own batch 16, 2 workers,
persistent workers, the DataLoader's prefetch depth)."""

SAMPLES_PER_RANK = 256
"""Its 512 images over 2 ranks (the settings record's ``samples_per_rank``)."""


@dataclass(kw_only=True)
class CpuRanks(Machine):
    """CPU ranks as issue 28 saw them: a small batch runs faster per image than the largest one (``small_batch`` >
    1: the batch stays in the caches)."""



def cpu_ranks(**changes) -> CpuRanks:
    return CpuRanks(**{"ceilings": {("fp32", False): 300.0, ("fp32", True): 200.0, ("bf16", False): 150.0,
                                    ("bf16", True): 120.0},
                       "supplies": {"pil": 3000.0}, "plateau": 64, "small_batch": 1.4, "max_workers": 1, **changes})


def script_plan(trials: int, *, root: Path | None = None, spec_file: Path | None = None,
                image_folder: dict | None = None) -> Plan:
    """The plan ``autotune search --script segment.py [--spec spec_file]`` makes on 2 CPU ranks of a 2-core machine
    once its trial 0 has said what it applies (``autotune.search.script.apply``); ``image_folder``: what its settings
    record would say of a Dataset that is an image folder (segment.py's is not)."""
    spec = script.script_spec(str(SEGMENT), [], gpu=False, spec=str(spec_file) if spec_file else None)
    base = spec.base_config()
    plan = Plan(options=SearchOptions(script=str(SEGMENT)), spec=spec, name=spec.name, objective=Objective(),
                nproc=2, torchrun=Torchrun.parse([]), entries=None, gpus=[], nvml=Nvml(), util_reason="no GPU",
                space=resolve(spec, world_size=2, nproc_per_node=2, cpu_only=True, cores=2), base=base, probe=base,
                baseline={}, starts=[], data=None, storage_url=f"sqlite:///{root or Path('studies')}/autotune.db",
                trials=trials, timeout_s=None, trial_timeout_s=300.0)
    found = script.Probe(applies=dict(APPLIES), unit="images", loader=True, samples_per_rank=SAMPLES_PER_RANK,
                         image_folder=image_folder)
    return script.apply(plan, found)


class Sim:
    """A search of the script on a simulated machine: its lines (what ``autotune search`` prints), the study, the
    configs the pool was asked to run."""

    def __init__(self, tmp: Path, machine: Machine, trials: int, *, enqueue=(), cancels: bool = True,
                 image_folder: dict | None = None, first: dict | None = None):
        """``first``: settings trial 0 ran with besides the base's (its measurement, as the probe set it)."""
        self.plan = plan = script_plan(trials, root=tmp, image_folder=image_folder)
        self.pool = FakePool(machine, tmp, cancels=cancels)
        # Trial 0 ran before the study existed (the probe), in a fresh process: the baseline trial records it.
        job = TrialJob(config=plan.base.with_overrides({**baseline_measure(plan.base.measure), **(first or {}),
                                                        "output_dir": str(tmp / "trial-0")}),
                       trial_dir=tmp / "trial-0", nproc_per_node=2)
        plan.preloaded["baseline"] = (self.pool.run(job, fresh=True), [])
        self.pool.runs.clear()
        storage = optuna.storages.InMemoryStorage()
        self.study = create_or_load(spec=plan.spec, study_name=plan.name, storage=storage, objective=plan.objective,
                                    nproc=2, baseline=plan.baseline, starts=plan.starts,
                                    attrs={script.PROBE_KEY: plan.script.record(),
                                           "unit": "images", "fingerprint": {"gpu_count": 0, "cpu_count": 2}})
        for params in enqueue:
            self.study.enqueue_trial(params, user_attrs={"stage": "search"}, skip_if_exists=False)
        self.said: list[str] = []
        engine = Engine(plan, self.study, storage, self.said.append)
        self.out = io.StringIO()
        engine.progress = Progress(total=plan.trials, timeout_s=None, out=self.out)
        engine.introduce()
        engine.run(self.pool)
        self.engine = engine
        self.views = view.views(self.study)

    @property
    def lines(self) -> str:
        return "\n".join(self.said) + "\n" + self.out.getvalue()


# ---- 1. a supply stopped early on the plain-script path ------------------------------------------------------------


def test_a_supply_stopped_early_in_a_process_of_its_own_stands_as_one_measurement(tmp_path, two_cores):
    # The plain path: each trial a torchrun of its own, killed at once when a supply stops early (no summary).
    sim = Sim(tmp_path, cpu_ranks(), 4, cancels=False)
    supplies = [v for v in sim.views if v.stage == "supply"]
    assert [v.outcome for v in supplies] == [view.Outcome.PART], \
        [(v.label, v.outcome, v.failure_message) for v in supplies]
    assert supplies[0].attrs.get("stopped_early") and supplies[0].imgs_per_s, supplies[0].attrs
    e2e = [v for v in sim.views if not v.part and not v.baseline and v.outcome == view.Outcome.MEASURED]
    assert e2e, sim.lines  # a 4-trial search: trial 0, the ceiling, the supply, one end-to-end trial


# ---- 2. a draw without loader workers -------------------------------------------------------------------------------


def test_a_draw_without_loader_workers_runs_instead_of_failing_for_the_scripts_own_loader_defaults(tmp_path,
                                                                                                  two_cores):
    sim = Sim(tmp_path, cpu_ranks(), 2, enqueue=[{"loader.num_workers": 0}])
    (draw,) = [v for v in sim.views if not v.part and v.params.get("loader.num_workers") == 0]
    # Zero workers is a setting the script can run (DataLoader's default): the sampler must not learn it "fails".
    assert draw.outcome == view.Outcome.MEASURED, f"{draw.outcome} {draw.failure_class}: {draw.failure_message}"


# ---- 3. trial 0 measured again ------------------------------------------------------------------------------------


def test_trial_0_measured_again_runs_the_scripts_own_settings(tmp_path, two_cores):
    sim = Sim(tmp_path, cpu_ranks(noisy={"pil": 0.2}), 8)
    again = [t for t in sim.study.get_trials() if t.user_attrs.get("remeasure_of") == 0]
    assert again, sim.lines  # trial 0's windows never agreed: it is measured again in a fresh process
    config = again[0].system_attrs[CONFIG_KEY]
    assert (config["training"]["batch_size"], config["loader"]["num_workers"]) == (16, 2), \
        f"the re-measure of trial 0 ran batch {config['training']['batch_size']}, " \
        f"{config['loader']['num_workers']} worker(s); the script's own are 16 and 2"


def test_shows_table_gives_each_trial_the_settings_its_line_gave(tmp_path, two_cores):
    """The script's own 2 workers lie outside a 2-core machine's space [0 .. 1]: trial 0 has no param for them. Its
    line said ``wk=2``; ``show``'s table and its "settings" line left the workers out. A stage measurement's row
    keeps what tells it from the others (its line's), not its whole config (a ceiling on synthetic data "pil")."""
    sim = Sim(tmp_path, cpu_ranks(), 4)
    lines = sim.out.getvalue().splitlines()
    said = {re.match(r"trial\s+(\S+)", ln).group(1): nxt.strip() for ln, nxt in itertools.pairwise(lines)
            if ln.startswith("trial ")}
    assert "wk=2" in said["0"], sim.lines
    rows = {ln.split()[0].rstrip("*"): ln for ln in overview.table(sim.study).splitlines()
            if re.match(r"p?\d+\*?\S*\s+\w+\s", ln)}
    assert any(label.startswith("p") for label in said), said
    for label, settings in said.items():
        assert rows[label].endswith(settings), f"{rows[label]!r}\nagainst its line {settings!r}"


# ---- 5. the ceiling of CPU ranks -----------------------------------------------------------------------------------


def test_on_cpu_ranks_no_trial_runs_above_the_bound_its_ceiling_puts_on_it(tmp_path, two_cores):
    sim = Sim(tmp_path, cpu_ranks(noisy={"pil": 0.2}), 8)
    snap = sim.engine.stages.snapshot(views_read=sim.views)
    above = []
    for v in view.feasible(sim.views):
        bound = snap.bound_of(v.config)  # the top of the bounding measurement's interval
        if bound is not None and v.interval.low > bound[0]:
            above.append(f"trial {v.label}: {v.imgs_per_s:,.0f} against {bound[1]}")
    dropped = [v.attrs["pruned_before_launch"] for v in sim.views if v.attrs.get("pruned_before_launch")]
    assert not above, "; ".join(above) + (f" — and draws dropped against that bound: {dropped}" if dropped else "")
    head = "\n".join(overview.headline(sim.views, "CPU ranks"))
    share = re.search(r"= (\d+)% of the ceiling", head)
    assert share is None or int(share.group(1)) <= 105, head


# ---- 7. a script's study name --------------------------------------------------------------------------------------


def test_the_plain_and_the_function_path_of_a_script_are_two_studies():
    plain = script.script_spec(str(SEGMENT), [], gpu=False).name
    function = script.script_spec(f"{SEGMENT}:main", [], gpu=False).name
    # Their trials do not compare: the function path pays torchrun, imports and set-up once, the plain path per trial.
    assert plain != function, plain


def test_a_script_study_made_by_the_other_path_is_refused_without_speaking_of_a_spec():
    storage = optuna.storages.InMemoryStorage()
    kw = {"storage": storage, "objective": Objective(), "nproc": 2, "baseline": {}, "starts": []}
    create_or_load(spec=script.script_spec(str(SEGMENT), [], "mine", gpu=False), study_name="mine", **kw)
    with pytest.raises(Exception) as e:
        create_or_load(spec=script.script_spec(f"{SEGMENT}:main", [], "mine", gpu=False), study_name="mine", **kw)
    # A script's search is given no spec: the fix it can act on is another --study (or the path it was made by).
    assert "spec" not in str(e.value), str(e.value)


def test_the_readme_says_how_a_scripts_study_is_named_and_how_to_narrow_its_space():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Tune your own script"):readme.index("## How a search finds what is fast")]
    assert "script-" in section, "how a script's study is named (script-<its name>) is not said"
    assert re.search(r"narrow|--spec|space:", section), "how to narrow or widen what a script's search searches"


def test_a_spec_for_a_script_narrows_and_widens_what_it_searches(tmp_path, two_cores):
    spec = tmp_path / "segment-narrow.yaml"
    spec.write_text("space:\n  training.batch_size: {choices: [8, 16, 32]}\n  loader.persistent_workers: null\n"
                    "  training.cudnn_benchmark: [true, false]\nbudget: {trials: 5}\n")
    plan = script_plan(5, spec_file=spec)
    space = plan.space.by_path()
    assert list(space["training.batch_size"].choices) == [8, 16, 32]  # widened below the built-in choices, and narrowed
    assert "loader.persistent_workers" not in space and "loader.num_workers" in space  # one knob off, the rest kept
    assert plan.spec.budget.trials == 5 and plan.spec.name == "script-segment"
    # A knob it names that the script does not apply is said, not dropped in silence.
    assert any(n.startswith("training.cudnn_benchmark: not searched (the script does not apply") for n in
               plan.space.notes), plan.space.notes


def test_a_spec_for_a_script_refuses_what_the_script_owns(tmp_path):
    from autotune.exceptions import SpecError

    spec = tmp_path / "wrong.yaml"
    spec.write_text("model: {name: resnet18}\nbaseline: {training.batch_size: 8}\nbase: {optimizer: {lr: 0.1}}\n")
    with pytest.raises(SpecError) as e:
        script.script_spec(str(SEGMENT), [], gpu=False, spec=str(spec))
    text = str(e.value)
    assert "model: not for a script" in text and "baseline: not for a script" in text and "base.optimizer" in text


# ---- 8. a script's export ------------------------------------------------------------------------------------------


def test_a_scripts_export_carries_no_setting_of_the_built_in_job(tmp_path, two_cores):
    from autotune import export

    sim = Sim(tmp_path, cpu_ranks(), 2)
    data, _ = export.build(sim.study, export.pick_trial(sim.study))
    # The script builds its own model, optimizer and data: settings it never reads are noise a reader takes for its own.
    leftovers = {k: data.get(k) for k in ("model", "optimizer") if k in data}
    leftovers.update({f"data.{k}": data["data"][k] for k in ("image_size", "decode") if k in data.get("data", {})})
    assert not leftovers, leftovers


# ---- 9. `autotune train` of a script -------------------------------------------------------------------------------


def script_train_plan(tmp_path: Path, two_cores_sim: Sim, *, remeasured: float | None = None):
    """``autotune train --config best.yaml``'s plan for the script's export (``remeasured``: the figure the export's
    fresh-process re-measure recorded, as ``autotune export`` writes it)."""
    from autotune import export, fullrun

    trial = export.pick_trial(two_cores_sim.study)
    data, _ = export.build(two_cores_sim.study, trial)
    if remeasured is not None:
        data["autotune"]["measured"]["remeasured"] = {"imgs_per_s": remeasured, "ratio": remeasured / trial.imgs_per_s,
                                                      "fresh_process": True}
    path = export.write(data, tmp_path / "best.yaml")
    return fullrun.plan(fullrun.TrainOptions(config=path, out=tmp_path / "run", script_args=["--epochs", "2"]))


def train_result(summary: dict):
    from autotune.fullrun import TrainResult

    return TrainResult.of([{"kind": "summary", "t": 0.0, **summary}], returncode=0, leftover_pids=[], wall_s=12.0)


SCRIPT_SUMMARY = {"mode": "train", "unit": "images", "imgs_per_s": 150.0, "windows": 4, "spread": 0.02,
                  "steps": 32, "epochs": 2, "loss": 0.4, "loss_finite": True, "loss_start": 0.9, "loss_end": 0.4}
"""What the script's full run (the runtime in train mode) summarizes."""


def test_train_of_a_script_claims_no_checkpoints_folder_it_does_not_keep(tmp_path, two_cores):
    from autotune.fullrun import closing_lines

    p = script_train_plan(tmp_path, Sim(tmp_path / "sim", cpu_ranks(), 2))
    lines, _, _ = closing_lines(p, train_result(SCRIPT_SUMMARY))
    claimed = [ln for ln in lines if "checkpoints in" in ln]
    # The script keeps its own checkpoints (if any): the runtime writes none in that folder.
    assert not claimed or Path(p.config.checkpoint_dir).is_dir(), claimed


def test_train_progress_of_a_script_prints_no_none():
    from autotune.fullrun import ProgressView

    out = io.StringIO()
    progress = ProgressView(out=out, enabled=False)
    # The runtime's progress record of a script's full run (trainer.runtime._reports.Reports._progress).
    progress.record({"kind": "settings", "unit": "images"})
    progress.record({"kind": "progress", "t": 0.0, "step": 8, "epoch": None, "total_steps": None, "loss": 0.5,
                     "lr": None, "imgs_per_s": 120.0, "unit": "images"})
    assert "None" not in out.getvalue(), out.getvalue()


def test_train_compares_with_the_re_measure_the_export_said_to_trust(tmp_path, two_cores):
    from autotune.fullrun import closing_lines

    p = script_train_plan(tmp_path, Sim(tmp_path / "sim", cpu_ranks(), 2), remeasured=160.0)
    lines, warnings, _ = closing_lines(p, train_result(SCRIPT_SUMMARY))
    compared = [ln for ln in lines + warnings if ln.startswith("search") or "re-measure" in ln]
    assert any("160" in ln for ln in compared), compared


def test_train_of_one_window_claims_no_spread(tmp_path, two_cores):
    from autotune.fullrun import closing_lines

    p = script_train_plan(tmp_path, Sim(tmp_path / "sim", cpu_ranks(), 2))
    lines, _, _ = closing_lines(p, train_result({**SCRIPT_SUMMARY, "windows": 1, "spread": 0.0}))
    measured = next(ln for ln in lines if ln.startswith("measured"))
    # One window has no spread to speak of (and "1 windows" is not English).
    assert "1 windows" not in measured and "spread 0.0%" not in measured, measured


# ---- 13. a trial 0 whose loss goes NaN ----------------------------------------------------------------------------


def test_a_script_whose_first_run_diverges_is_refused_at_the_probe_with_the_fix(tmp_path, monkeypatch, two_cores):
    plan = script_plan(3, root=tmp_path)
    pool = FakePool(cpu_ranks(diverges={"fp32"}), tmp_path)

    def run_trial(job):  # trial 0 in a fresh process: its settings record, then a loss that leaves the finite numbers
        run = pool.run(job, fresh=True)
        run.records.insert(1, {"kind": "settings", "t": 0.0, "unit": "images", "applied": APPLIES, "loader": True,
                               "samples_per_rank": SAMPLES_PER_RANK})
        return run

    monkeypatch.setattr(script, "run_trial", run_trial)
    # Nothing after it can be measured: a run that does not learn is not fast, and each trial would diverge the same.
    with pytest.raises(script.ScriptError) as e:
        script.probe(plan, tmp_path / "logs", lambda line: None)
    assert "learning rate" in str(e.value), str(e.value)  # the script owns its optimizer: the fix is there


# ---- 14. the space of a script on CPU ranks ------------------------------------------------------------------------


def test_pinned_memory_is_not_searched_on_cpu_ranks(two_cores):
    plan = script_plan(8)
    # The runtime pins only for a CUDA device (trainer.runtime._run.Run.loader): on CPU ranks both values run the same.
    assert "loader.pin_memory" not in plan.space.by_path(), plan.space.by_path()["loader.pin_memory"].describe()


def test_the_batch_space_holds_the_scripts_own_batch_and_smaller_ones(two_cores):
    plan = script_plan(8)
    choices = plan.space.by_path()["training.batch_size"].choices
    assert 16 in choices and min(choices) < 16, choices


# ---- 15. an export to a folder that cannot be made --------------------------------------------------------------


UNMAKEABLE = "/proc/no/such/dir/best.yaml"
"""A folder ``os.access`` calls writable for root (its nearest existing folder, /proc, is) that cannot be made."""


def export_to_unmakeable(tmp_path: Path, study, monkeypatch) -> tuple[int, str, list]:
    """``autotune export /proc/no/such/dir/best.yaml`` of ``study`` (in-process); (exit code, stderr, the trials the
    export measured again)."""
    import contextlib

    from autotune import cli, export

    measured = []

    def remeasure(study, trial, data, folder, **kw):  # records the call; the measurement is beside the point here
        measured.append(trial.number)
        return "re-measured in a fresh process: (not run by this test)"

    monkeypatch.setattr(export, "remeasure", remeasure)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["export", UNMAKEABLE, "--study", study.study_name, "--storage", storage_of(tmp_path)])
    return code, err.getvalue(), measured


def storage_of(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'studies.db'}"


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a folder os.access calls writable that mkdir refuses: "
                                                          "/proc, as root")


@needs_root
def test_export_of_a_script_to_a_folder_it_cannot_make_fails_before_measuring(tmp_path, monkeypatch, two_cores):
    sim = Sim(tmp_path / "sim", cpu_ranks(), 2)
    optuna.copy_study(from_study_name=sim.study.study_name, from_storage=sim.study._storage,
                      to_storage=storage_of(tmp_path))
    study = optuna.load_study(study_name=sim.study.study_name, storage=storage_of(tmp_path))
    code, err, measured = export_to_unmakeable(tmp_path, study, monkeypatch)
    assert code != 0, err
    assert measured == [], f"re-measured trial {measured} before finding it cannot write {UNMAKEABLE}: {err}"


@needs_root
def test_export_of_the_built_in_job_to_a_folder_it_cannot_make_fails_before_measuring(tmp_path, monkeypatch):
    study = cpu_demo_study(storage_of(tmp_path))
    code, err, measured = export_to_unmakeable(tmp_path, study, monkeypatch)
    assert code != 0, err
    assert measured == [], f"re-measured trial {measured} before finding it cannot write {UNMAKEABLE}: {err}"


# ---- 16. the report's first screen: one baseline, and a rising loss said ------------------------------------------


DIST = {"training.batch_size": CategoricalDistribution([8, 16, 32, 64]),
        "data.decode": CategoricalDistribution(["pil", "torchvision-cpu"])}


def cpu_demo_study(storage: str, *, trials=None, parts=None) -> optuna.Study:
    """A cpu-demo study as a new user's report showed it: trial 0 (the baseline, pil, its interval wide) 40.6 imgs/s;
    trial 2 its re-measure in a fresh process, 52.6; trial 4 the fastest, 120 imgs/s, its loss rising over its
    windows (1.16 -> 1.55); a ceiling of 112 imgs/s."""
    study = optuna.create_study(study_name="cpu-demo", storage=storage, direction="maximize")
    study.set_user_attr("objective", "throughput")
    study.set_user_attr("nproc_per_node", 2)
    study.set_user_attr("fingerprint", {"gpu_count": 0, "cpu_count": 2})
    rows = trials if trials is not None else [
        ("baseline", {"training.batch_size": 8, "data.decode": "pil"}, [38.0, 44.0, 40.6, 47.0], False, (1.4, 1.3), {}),
        ("candidate", {"training.batch_size": 32, "data.decode": "torchvision-cpu"}, [88.0, 90.0, 89.0, 89.5], True,
         (1.3, 1.2), {}),
        ("baseline", {"training.batch_size": 8, "data.decode": "pil"}, [52.0, 52.6, 53.0, 52.5], True, (1.3, 1.25),
         {"remeasure_of": 0}),
        ("refine", {"training.batch_size": 16, "data.decode": "torchvision-cpu"}, [100.0, 101.0, 100.5, 101.5], True,
         (1.25, 1.2), {}),
        ("refine", {"training.batch_size": 64, "data.decode": "torchvision-cpu"}, [119.0, 120.0, 121.0, 120.5], True,
         (1.16, 1.55), {}),
    ]
    for stage, params, windows, ok, (l0, l1), extra in rows:
        med = statistics.median(windows[-3:])
        config = {"model": {"name": "resnet18"}, "data": {"kind": "imagefolder", "path": "/nonexistent/cpu-demo",
                                                          "decode": params["data.decode"], "image_size": 64},
                  "training": {"batch_size": params["training.batch_size"], "precision": "fp32",
                               "channels_last": False, "accum_steps": 1}}
        attrs = {"stage": stage, "imgs_per_s": med, "imgs_per_s_windows": windows, "precise": ok,
                 "ci_half_width": (max(windows[-3:]) - min(windows[-3:])) / med / 2, "loss_start": l0, "loss_end": l1,
                 "loss_finite": True, "constraint": 0.0, "wall_s": 9.0, **extra}
        study.add_trial(create_trial(state=TrialState.COMPLETE, values=[med], params=params, distributions=DIST,
                                     user_attrs=attrs, system_attrs={CONFIG_KEY: config,
                                                                     "constraints:failed": 0.0}))
    part = optuna.create_study(study_name="cpu-demo.parts", storage=storage, direction="maximize")
    for stage, overrides, ips in parts if parts is not None else [
            ("ceiling", {"training.precision": "fp32", "data.kind": "synthetic", "training.batch_size": 64}, 112.0)]:
        part.add_trial(create_trial(state=TrialState.COMPLETE, values=[ips], user_attrs={
            "stage": stage, "overrides": overrides, "imgs_per_s": ips, "imgs_per_s_windows": [ips] * 4,
            "ci_half_width": 0.005, "precise": True}, system_attrs={CONFIG_KEY: {
                "training": {"precision": "fp32", "batch_size": 64, "channels_last": False},
                "data": {"kind": "synthetic"}}}))
    return study


def first_screen(study) -> str:
    rows = report.trial_rows(study)
    page = report._first_screen(study, None) + report._header(study, rows, None)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_the_reports_first_screen_names_one_baseline(tmp_path):
    text = first_screen(cpu_demo_study(storage_of(tmp_path)))
    named = set(re.findall(r"trial (\d+)(?: with its re-measure)? \(the baseline|trial (\d+) \(baseline", text))
    baselines = {a or b for a, b in named}
    assert len(baselines) == 1, f"baselines named: {sorted(baselines)}: {text}"


def test_the_report_says_when_the_fastest_trials_loss_rose(tmp_path):
    text = first_screen(cpu_demo_study(storage_of(tmp_path)))
    assert "1.16->1.55" in text  # the figure is there ...
    around = text[text.index("1.16->1.55") - 200:text.index("1.16->1.55") + 200]
    assert re.search(r"\b(ris|rose|increas|grew|went up|not learn)", around), around  # ... and said for what it is


# ---- 17. wording ---------------------------------------------------------------------------------------------------


def constructed(storage: str, failures: list[tuple[view.Outcome, str, str]], *, pruned_before_launch: int = 0,
                pruned_running: int = 0) -> optuna.Study:
    """A study with a measured trial 0 and, after it, ``failures`` (state, class, message) as the search records
    them, and pruned trials: ``pruned_before_launch`` never launched (a bound below the best), ``pruned_running``
    stopped in their windows."""
    study = cpu_demo_study(storage, trials=[
        ("baseline", {"training.batch_size": 8, "data.decode": "pil"}, [40.0, 41.0, 40.5, 40.8], True, (1.4, 1.3),
         {})], parts=[])
    for state, cls, message in failures:
        st = state.state
        study.add_trial(create_trial(state=st, values=[0.0] if st == TrialState.COMPLETE else None,
                                     params={"training.batch_size": 16, "data.decode": "pil"}, distributions=DIST,
                                     user_attrs={"stage": "refine", "failure_class": cls, "failure_message": message,
                                                 "constraint": 1.0 if st == TrialState.COMPLETE else None},
                                     system_attrs={"constraints:failed": 1.0} if st == TrialState.COMPLETE else {}))
    for i in range(pruned_before_launch + pruned_running):
        attrs = {"stage": "refine"}
        if i < pruned_before_launch:
            attrs["pruned_before_launch"] = ("the model alone at fp32 NCHW batch 64 runs 30 imgs/s, below the best "
                                             "(40); not launched")
        else:
            attrs.update(imgs_per_s_windows=[20.0, 21.0], measure_s=2.0, launch_s=1.0, wall_s=5.0)
        study.add_trial(create_trial(state=TrialState.PRUNED, params={"training.batch_size": 32, "data.decode": "pil"},
                                     distributions=DIST, user_attrs=attrs))
    return study


def test_an_interrupted_trial_is_not_said_twice(tmp_path):
    # What the search records for a trial stopped by Ctrl-C (autotune.search.engine.abandon).
    ended = [(view.Outcome.FAIL, "interrupted", "interrupted (Ctrl-C)")]
    text = overview.table(constructed(storage_of(tmp_path), ended))
    assert not re.search(r"interrupted: interrupted", text), text


def test_a_diverged_trial_is_not_said_twice(tmp_path):
    message = nonfinite_reason({"loss_nonfinite_run": 7})  # what a summary without loss_reason is judged as
    text = overview.table(constructed(storage_of(tmp_path), [(view.Outcome.INFEASIBLE, "diverged", message)]))
    row = next(ln for ln in text.splitlines() if "diverged:" in ln)
    assert not re.search(r"diverged: .*\(diverged\)", row), row  # its class, then its reason: not the class again


def test_stages_not_run_is_said_once(tmp_path, two_cores):
    sim = Sim(tmp_path, cpu_ranks(), 2)
    said = [ln for ln in sim.lines.splitlines() if "stages: not run" in ln]
    assert len(said) == 1, said


def test_pruning_counts_only_the_trials_it_stopped(tmp_path):
    text = overview.table(constructed(storage_of(tmp_path), [], pruned_before_launch=5, pruned_running=1))
    line = next(ln for ln in text.splitlines() if ln.startswith("pruning:"))
    assert line.startswith("pruning: 1 trial stopped once measurably slower"), line


def test_a_trial_whose_interval_stays_wide_is_marked_with_its_width(tmp_path, two_cores):
    # The script's loader swings 30 % from one half second to the next: its trials reach their time cap first.
    sim = Sim(tmp_path, cpu_ranks(noisy={"pil": 0.3}), 8)
    table = overview.table(sim.study)
    wide = [v for v in sim.views if v.precise is False and v.outcome == "measured"]
    assert wide, table
    precision = sim.plan.base.measure.precision
    for v in wide:
        row = next(ln for ln in table.splitlines() if re.match(rf"{v.label}\*?\S*\s", ln))
        assert f"{100 * v.half_width:.1f}%~" in row and v.half_width > precision, row
    assert "~ the trial reached its time cap (measure.max_s) with its interval wider than the precision" in table


def test_one_trial_is_one_trial(tmp_path):
    text = overview.table(constructed(storage_of(tmp_path), []))
    assert "1 trials" not in text, text.splitlines()[0]


def test_the_gain_column_names_the_baseline_it_is_against(tmp_path):
    study = cpu_demo_study(storage_of(tmp_path))
    assert view.baseline(view.views(study)).number == 0  # trial 0 with its re-measure, combined
    header = next(ln for ln in overview.table(study).splitlines() if ln.startswith("#"))
    assert "vs #0+2 " in header, header  # both runs its figure stands on



def test_a_supply_stopped_early_says_its_bound_in_the_jobs_unit():
    # A script counting samples: its supply stopped above the ceiling printed "(37,543 imgs/s)".
    stop = {"above": 37_543.0, "below": None}
    why = why_supply_stops(Interval(90_000.0, 0.1), stop, per="samples/s")
    assert why == "above the ceiling (37,543 samples/s): 81,000 at the least", why
    assert "imgs/s" in why_supply_stops(Interval(90_000.0, 0.1), stop)  # the built-in job's images


def test_the_searchs_last_line_gives_its_figures_as_the_table_does(tmp_path):
    # It printed "fastest: trial 3 at 50,829.0 samples/s, 3.13x the baseline (trial 0: 16,218.2)" above a table
    # that says 50,829 and 16,218.
    study = cpu_demo_study(storage_of(tmp_path), trials=[
        ("baseline", {"training.batch_size": 8, "data.decode": "pil"}, [16_218.2] * 4, True, (1.4, 1.3), {}),
        ("refine", {"training.batch_size": 16, "data.decode": "pil"}, [50_829.0] * 4, True, (1.3, 1.2), {})],
        parts=[])
    line = best_line(study)
    assert "trial 1, 50,829 ± 0.0 % imgs/s" in line and "(the baseline, 16,218 ± 0.0 %)" in line, line
