"""StudySpec: the shipped specs are valid, every problem of a bad spec is reported at once, specs are found by name."""

from __future__ import annotations

import pytest
import yaml

from autotune.exceptions import SpecError
from autotune.spec import StudySpec, builtin_names, find_spec, load_spec
from tests.helpers.cli import REPO


@pytest.mark.parametrize("name", ["resnet50", "cpu-demo"])
def test_shipped_specs_are_valid_and_installed_with_the_package(name):
    spec = StudySpec.from_yaml(REPO / "studies" / f"{name}.yaml")
    assert spec.name == name
    packaged = REPO / "autotune" / "studies" / f"{name}.yaml"  # package data: `pip install .` ships these
    assert packaged.read_text() == (REPO / "studies" / f"{name}.yaml").read_text()
    assert name in builtin_names()
    # The export section must make a runnable train config out of any trial.
    assert spec.export["training.mode"] == "train"


def test_resnet50_baseline_is_the_seed_tutorials_defaults():
    b = load_spec(str(REPO / "studies" / "resnet50.yaml")).baseline
    assert (b["training.batch_size"], b["loader.num_workers"], b["training.precision"], b["data.decode"]) == \
        (64, 4, "fp32", "pil")


def test_specs_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_spec("cpu-demo").name == "cpu-demo.yaml"  # the packaged copy
    (tmp_path / "studies").mkdir()
    own = tmp_path / "studies" / "cpu-demo.yaml"
    own.write_text((REPO / "studies" / "cpu-demo.yaml").read_text().replace("trials: 12", "trials: 2"))
    assert load_spec("cpu-demo").budget.trials == 2  # ./studies wins over the packaged copy
    with pytest.raises(SpecError, match=r"no such spec file or built-in spec .*cpu-demo"):
        find_spec("nope")


def _spec(**over):
    data = {"name": "t", "base": {"model": {"name": "resnet18"}}, "default_space": False,
            "space": {"training.batch_size": {"choices": [8, 16]}}}
    data.update(over)
    return data


def test_every_problem_is_reported_at_once():
    bad = _spec(
        name="bad name!",
        base={"loader": {"num_wrkers": 2}},
        space={
            "training.batch_size": {"choices": [8, "big"]},
            "loader.num_workers": {"low": 4, "high": 2},
            "training.nope": {"choices": [1, 2]},
            "ddp.bucket_cap_mb": {"low": 0, "high": 10, "log": True},
            "data.decode": {"choices": ["pil", "bogus"]},
            "loader.prefetch_factor": {"low": 1, "high": 4, "when": "loader.num_workers >>> 0"},
            "training.precision": {"choices": ["fp32"], "low": 1},
            "training.accum_steps": {"low": 1, "high": "auto"},
        },
        baseline={"training.batch_size": 8, "optimizer.lr": 0.2},
        budget={"trials": 0, "trial_timeout_s": 10, "timeot_s": 5},
        objective={"kind": "fastest"},
    )
    with pytest.raises(SpecError) as e:
        StudySpec.from_dict(bad)
    problems = e.value.problems
    for expected in ["base.loader.num_wrkers: unknown setting (did you mean num_workers?)",
                     "budget.timeot_s: unknown setting (did you mean timeout_s",
                     "objective.kind='fastest': expected one of throughput, pareto, weighted",
                     "name='bad name!'",
                     "space.training.batch_size: choice 'big'", "space.loader.num_workers: low=4 > high=2",
                     "space.training.nope: no such TrainConfig setting", "log scale needs low > 0",
                     "space.data.decode: choice 'bogus'", "space.loader.prefetch_factor.when: cannot parse",
                     "space.training.precision: give either choices or low/high",
                     "space.training.accum_steps.high: auto is only defined for loader.num_workers",
                     "baseline.optimizer.lr: not a searched knob", "budget.trials=0"]:
        assert any(expected in p for p in problems), (expected, problems)
    assert len(problems) >= 14


def test_yaml_errors_name_the_file_and_line(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: x\nspace: {a: [1,\n")
    with pytest.raises(SpecError, match=r"s.yaml: not valid YAML \(line \d\)"):
        StudySpec.from_yaml(f)
    f.write_text("- a list\n")
    with pytest.raises(SpecError, match="expected a mapping of settings at the top level"):
        StudySpec.from_yaml(f)


def test_imagefolder_base_needs_a_path_or_a_generator():
    with pytest.raises(SpecError, match=r"data\.path is required"):
        StudySpec.from_dict(_spec(base={"data": {"kind": "imagefolder"}}))
    spec = StudySpec.from_dict(_spec(base={"data": {"kind": "imagefolder"}},
                                     data={"generate": {"images": 100, "classes": 2}}))
    assert spec.generates_data
    assert spec.base_config("/data/x").data.path == "/data/x"


def test_fingerprint_changes_with_what_makes_trials_comparable():
    a = StudySpec.from_dict(_spec())
    assert a.fingerprint(2) == StudySpec.from_dict(_spec(budget={"trials": 99})).fingerprint(2)
    assert a.fingerprint(2) != a.fingerprint(4)
    assert a.fingerprint(2) != StudySpec.from_dict(_spec(space={"training.batch_size": [8, 32]})).fingerprint(2)


def test_a_choice_that_needs_its_condition_is_checked_under_it():
    """CUDA graphs need a compiled model: a spec searching the compile mode only where the model is compiled (the
    knob's own space) was refused, each choice checked against an eager base."""
    mode = {"choices": [None, "reduce-overhead"], "when": "training.compile == true"}
    spec = StudySpec.from_dict(_spec(space={"training.compile": [False, True], "training.compile_mode": mode}))
    assert spec.space["training.compile_mode"].choices == [None, "reduce-overhead"]
    with pytest.raises(SpecError, match=r"needs training\.compile=true"):  # no condition: still refused
        StudySpec.from_dict(_spec(space={"training.compile_mode": ["reduce-overhead"]}))


def test_space_shorthand_and_removal():
    spec = StudySpec.from_dict(_spec(default_space=True, space={"training.batch_size": [8, 16], "nccl.algo": None}))
    assert spec.space["training.batch_size"].choices == [8, 16]
    assert spec.space["nccl.algo"] is None
    yaml.safe_dump(spec.to_dict())  # stored on the study as plain data
