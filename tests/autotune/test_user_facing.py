"""What a new user meets: tuning a model by name on their own folder without writing YAML, a minimal spec, the live
view, hints that work when pasted, and the small frictions (help text, exit codes, wide rows)."""

from __future__ import annotations

import os
import shutil
import subprocess

import optuna
import pytest
import yaml

from autotune import cli
from autotune.search.prepare import SearchOptions, choose_spec, study_name
from autotune.spec import load_spec
from tests.helpers.cli import REPO, autotune
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
    trials = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}").trials
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
    (t,) = optuna.load_study(study_name="mine", storage=f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}").trials
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


def test_a_factory_study_is_named_by_its_module_and_the_first_line_names_what_is_tuned(tmp_path):
    spec = load_spec("cpu-demo")
    a = study_name(spec, SearchOptions(model="mypkg.resnets:build", data=str(tmp_path / "photos")))
    b = study_name(spec, SearchOptions(model="mypkg.vits:build", data=str(tmp_path / "photos")))
    assert (a, b) == ("cpu-demo-mypkg.resnets.build-photos", "cpu-demo-mypkg.vits.build-photos")  # no collision
    assert study_name(spec, SearchOptions(model="mobilenet_v3_small")) == "cpu-demo-mobilenet_v3_small"
    said = []
    assert choose_spec(SearchOptions(model="mypkg.vits:build", data="~/photos"), 0, said.append) == "cpu-demo"
    assert said == ["autotune: no GPU visible: tuning mypkg.vits:build on ~/photos with the built-in cpu-demo "
                    "study's settings (2 gloo ranks on the CPU, its search space and budget); --spec picks another"]
    said.clear()
    choose_spec(SearchOptions(), 0, said.append)
    assert "small model and images" in said[0] and "tunes ResNet-50" in said[0]  # the demo itself, as before


def quick_start() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_the_quick_start_is_two_commands_and_ci_runs_the_second_verbatim():
    commands = quick_start()
    assert len(commands) == 2, commands
    assert commands[1] in (REPO / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("shell", [s for s in ("sh", "bash", "zsh") if shutil.which(s)])
def test_the_first_command_takes_the_cpu_wheels_where_there_is_no_nvidia_smi(tmp_path, shell):
    """Run as written, with stand-ins for python and autotune on the PATH: what pip is asked to install."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "argv"
    for name in ("python", "autotune"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
        (bin_dir / name).chmod(0o755)
    first = quick_start()[0]

    def asked(path: str) -> list[str]:
        log.unlink(missing_ok=True)
        r = subprocess.run([shutil.which(shell), "-c", first], env={**os.environ, "PATH": path},
                           capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return log.read_text().splitlines()

    cpu = asked(str(bin_dir))  # no nvidia-smi anywhere on this PATH
    assert cpu == ["python -m pip install . --extra-index-url https://download.pytorch.org/whl/cpu",
                   "autotune search"]
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    # A GPU machine: pip's default torch, and DALI's extra for the GPU study to weigh its pipeline.
    assert asked(str(bin_dir)) == ["python -m pip install .[dali]", "autotune search"]
    # A newcomer reads why before the commands, not after the download has started.
    intro = " ".join((REPO / "README.md").read_text().split("## Quick start", 1)[1].split("```bash", 1)[0].split())
    assert "nvidia-smi" in intro and "CPU builds" in intro and "`dali` extra" in intro and "MB of wheels" in intro
