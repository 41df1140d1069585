"""What a new user meets: tuning a model by name on their own folder without writing YAML, a minimal spec, the live
view, hints that work when pasted, and the small frictions (help text, exit codes, wide rows)."""

from __future__ import annotations

import optuna
import pytest
import yaml

from autotune import cli
from tests.helpers.cli import autotune
from tests.jobutil import make_jpeg_folder


@pytest.mark.slow
def test_a_torchvision_model_by_name_on_a_users_folder_without_yaml(tmp_path):
    make_jpeg_folder(tmp_path / "photos", classes=3, per_class=10)
    r = autotune("search", "--model", "mobilenet_v3_small", "--data", tmp_path / "photos", "--image-size", "48",
                 "--trials", "2", cwd=tmp_path, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # It says what it found and what it tunes ...
    assert "autotune: data: 30 training images in 3 classes, about 4" in out  # px of a few of them
    assert "model mobilenet_v3_small (from --model) at 48 px (from --image-size" in out
    # ... batch sizes the folder cannot fill are not drawn (30 images, 15 per rank) ...
    assert "training.batch_size: 16, 32 dropped (the data holds 15 training images per rank" in out
    # ... and while a trial runs, its phase and windows (plain lines in a log).
    assert "trial 0 [baseline] warm-up" in out and "trial 0 [baseline] window 1 " in out
    name = "cpu-demo-mobilenet_v3_small-photos"  # another model and data: another study
    trials = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'studies' / f'{name}.db'}").trials
    assert len(trials) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


@pytest.mark.slow
def test_a_minimal_spec_needs_a_name_and_a_model(tmp_path):
    spec = tmp_path / "mine.yaml"
    spec.write_text(yaml.safe_dump({"name": "mine", "base": {"model": {"name": "tests.helpers.models:tiny"},
                                                              "data": {"image_size": 32}}}))
    r = autotune("search", "--spec", spec, "--trials", "1", cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # Synthetic data (the default): no input pipeline to tune, and said so.
    assert "loader.num_workers: not searched (synthetic data: no input pipeline)" in out
    (t,) = optuna.load_study(study_name="mine", storage=f"sqlite:///{tmp_path / 'studies' / 'mine.db'}").trials
    assert t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs["stage"] == "baseline"


def test_hints_name_a_command_that_works(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", "best.yaml"]) == 2
    assert "no study in ./studies: run `autotune search` first" in capsys.readouterr().err
    assert cli.main(["show"]) == 2
    assert "run `autotune search` first" in capsys.readouterr().err
    (tmp_path / "studies").mkdir()
    for name in ("alpha", "beta"):
        optuna.create_study(study_name=name, storage=f"sqlite:///studies/{name}.db")
    assert cli.main(["show"]) == 2
    assert "2 studies in ./studies (alpha, beta): pick one with --study NAME" in capsys.readouterr().err
    assert cli.main(["show", "--study", "gamma"]) == 2
    assert "no study gamma in ./studies (here: alpha, beta)" in capsys.readouterr().err
    assert cli.main(["search", "--data", str(tmp_path / "nope"), "--trials", "1"]) == 2
    err = capsys.readouterr().err
    hint = err.split("make one with `", 1)[1].split("`", 1)[0]
    assert hint == f"autotune make-data {tmp_path / 'nope'} --images 1000 --classes 10"
    assert cli.main(hint.split()[1:]) == 0  # pasted as it is, the hint works
    assert (tmp_path / "nope" / "train").is_dir()


def test_help_is_whole_sentences_and_search_takes_study_like_the_other_commands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "`autotune show`, `export`, `train`, `report` and `dashboard` use what it found." in text
    parser = cli.build_parser()
    assert parser.parse_args(["search", "--study", "x"]).study == "x"
    assert parser.parse_args(["search", "--study-name", "x"]).study == "x"  # the old spelling still works
