"""Bad input never crashes and never touches the study: every mistake below gets one line saying what is wrong and
how to fix it, exit code 2, and leaves the storage exactly as it was (same studies, same trials, same bytes) and no
new file behind."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import optuna
import pytest

from autotune import cli
from autotune.objective import Objective
from autotune.space import importable
from autotune.spec import StudySpec
from autotune.study.setup import create_or_load
from autotune.study.storage import open_storage
from tests.helpers.cli import REPO, autotune
from tests.helpers.specs import tiny_spec
from tests.jobutil import make_jpeg_folder

M = "tests.helpers.models:"
BASELINE = {"training.batch_size": 8, "ddp.bucket_cap_mb": 25.0}


@pytest.fixture(scope="module")
def existing(tmp_path_factory):
    """A SQLite storage holding study ``bad`` (made by the tiny spec) with one finished trial, and data folders."""
    d = tmp_path_factory.mktemp("bad-input")
    url = f"sqlite:///{d / 'studies.db'}"
    storage = open_storage(url)
    study = create_or_load(spec=StudySpec.from_yaml(tiny_spec(d, "bad")), study_name="bad",
                                     storage=storage, objective=Objective(), nproc=2, baseline=BASELINE)
    trial = study.ask()
    trial.suggest_categorical("training.batch_size", [4, 8, 16])
    study.tell(trial, 1234.5)
    (d / "empty" / "class0").mkdir(parents=True)
    make_jpeg_folder(d / "few", classes=1, per_class=3)
    make_jpeg_folder(d / "cut", classes=2, per_class=8)
    cut = d / "cut" / "class1" / "005.jpg"
    cut.write_bytes(cut.read_bytes()[:300])  # a copy that died half-way
    make_jpeg_folder(d / "html", classes=2, per_class=8)
    (d / "html" / "class0" / "002.jpg").write_text("<html>403 Forbidden</html>")  # what a failed download saves
    (d / "notes.txt").write_text("not a folder")
    return d, url


def snapshot(d: Path, url: str):
    storage = open_storage(url, create=False)
    studies = {}
    for s in optuna.get_all_study_names(storage):
        study = optuna.load_study(study_name=s, storage=storage)
        studies[s] = (study.user_attrs, [(t.number, t.state, t.values, t.params, t.user_attrs) for t in study.trials])
    return studies, hashlib.sha256((d / "studies.db").read_bytes()).hexdigest()


CASES = {
    # id: (spec changes, or a spec file's text; extra arguments; what the one line must say)
    "invalid-yaml": ("name: bad\nbase: {model: [resnet18\n", [], "not valid YAML (line 3)"),
    "unknown-model": ({"base.model.name": "resnet5000"}, [],
                      "base.model.name='resnet5000': not a torchvision classification model (did you mean resnet50"),
    "unknown-model-choice": ({"space.model.name": {"choices": [M + "tiny", M + "nothere"]}}, [],
                             f"space.model.name='{M}nothere': tests.helpers.models has no function nothere"),
    "unknown-knob": ({"space.training.batchsize": {"choices": [8, 16]}}, [],
                     "space.training.batchsize: no such TrainConfig setting"),
    "knob-range-out-of-range": ({"space.loader.num_workers": {"low": -1, "high": 2}}, [],
                                "space.loader.num_workers.low: loader.num_workers=-1: must be >= 0"),
    "knob-choice-out-of-range": ({"space.training.batch_size": {"choices": [0, 8]}}, [],
                                 "space.training.batch_size: choice 0: training.batch_size=0: must be >= 1"),
    "baseline-outside-its-knob": ({"baseline.training.batch_size": 12}, [],
                                  "baseline.training.batch_size=12: outside the searched {4, 8, 16}"),
    "missing-data-folder": ({}, ["--data", "{d}/nope"],
                            "--data {d}/nope: no such folder; make one with `autotune make-data {d}/nope --images 1000 "
                            "--classes 10`, or point --data at an ImageFolder (one sub-folder per class)"),
    "data-is-a-file": ({}, ["--data", "{d}/notes.txt"],
                       "--data {d}/notes.txt: a file, not a folder; point --data at an ImageFolder"),
    "empty-dataset": ({}, ["--data", "{d}/empty"], "--data: data folder {d}/empty: Found no valid file"),
    "jpeg-cut-short": ({}, ["--data", "{d}/cut"],
                       "--data: {d}/cut/class1/005.jpg is not a readable image: a JPEG cut short (no end marker); "
                       "remove or replace it"),
    "not-an-image": ({}, ["--data", "{d}/html"], "--data: {d}/html/class0/002.jpg is not a readable image: PIL "
                                                 "cannot read its header"),
    "factory-raises": ({"base.model.name": M + "broken"}, [],
                       f"base.model.name='{M}broken': broken(num_classes=4) raised FileNotFoundError: "
                       "weights-4.pt: no such file (this factory needs its weights); fix the factory"),
    "less-data-than-a-batch": ({}, ["--data", "{d}/few"],
                               "training.batch_size: every choice is larger than the 1 training images per rank; add "
                               "images or smaller batch choices"),
    "unreachable-storage": ({}, ["--storage", "postgresql+psycopg://autotune@127.0.0.1:1/studies"],
                            "Connection refused; check that the server runs and is reachable"),
    "study-exists-with-another-spec": ({"space.training.batch_size": {"choices": [8, 16]}}, [],
                                       "study bad exists with a different spec or world size"),
    "no-trials": ({}, ["--trials", "0"], "--trials 0: must be > 0"),
    "gpus-on-a-cpu-machine": ({}, ["--gpus", "0"], "--gpus 0: no GPU visible on this machine"),
    "dali-not-installed": ({"base.data.decode": "dali"}, [],
                           "data.decode=dali needs nvidia.dali, which is not installed: "
                           "pip install 'ddp-autotune[dali]'"),
    "nvjpeg-hw-removed": ({"space.data.hybrid_hw_fraction": {"choices": [0.0, 0.25]}}, [],
                          "space.data.hybrid_hw_fraction: removed with data.decode=nvjpeg-hw; for the GPU's hardware "
                          "JPEG decoder use data.decode: dali (pip install 'ddp-autotune[dali]')"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_the_study_unchanged(case, existing, tmp_path, tmp_path_factory):
    d, url = existing
    env = None
    if case == "dali-not-installed" and importable("nvidia.dali"):  # as if not installed, whatever this machine has
        hide = tmp_path_factory.mktemp("no-dali")
        (hide / "sitecustomize.py").write_text("import sys\nsys.modules['nvidia.dali'] = None\n")
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(hide), str(REPO), os.environ.get("PYTHONPATH")) if p)}
    changes, extra, message = CASES[case]
    if isinstance(changes, str):
        (tmp_path / "bad.yaml").write_text(changes)
        spec = tmp_path / "bad.yaml"
    else:
        spec = tiny_spec(tmp_path, "bad", **changes)
    extra = [a.replace("{d}", str(d)) for a in extra]
    storage = [] if "--storage" in extra else ["--storage", url]
    before = snapshot(d, url)

    r = autotune("search", "--spec", spec, "--study-name", "bad", *storage, *extra, cwd=tmp_path, timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("autotune search: error: ") and r.stderr.count("\n") == 1, r.stderr  # one line
    assert message.replace("{d}", str(d)) in r.stderr, r.stderr
    assert r.stdout == ""  # nothing started
    assert snapshot(d, url) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # no database, log folder or data made


def test_more_ranks_than_visible_gpus_is_refused_before_anything(existing, tmp_path, monkeypatch, capsys):
    from tests.autotune.test_hw import fake_pynvml  # the one fake allowed: this machine has no GPU

    d, url = existing
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(n=2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)
    before = snapshot(d, url)
    spec = tiny_spec(tmp_path, "bad")
    for args, message in ((["--nproc-per-node", "4"], "--nproc-per-node 4: only 2 GPU(s) selected (0,1); lower it "
                                                      "or select more with --gpus"),
                          (["--gpus", "1", "--nproc-per-node", "2"], "--nproc-per-node 2: only 1 GPU(s) selected"),
                          (["--gpus", "2"], "--gpus 2: 2 GPU(s) visible (indices 0..1)")):
        rc = cli.main(["search", "--spec", str(spec), "--storage", url, "--study-name", "bad", *args])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("autotune search: error: ") and message in err and err.count("\n") == 1
    assert snapshot(d, url) == before and sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


# ---- the data check: recorded when clean, skipped while the files are unchanged ----------------------------------


@pytest.fixture
def check_data(tmp_path, monkeypatch):
    """``prepare`` a search of the tiny spec on ``--data DIR``, in this process, with a private data cache; returns
    a function: folder -> (lines said, files checked)."""
    from autotune.search import prepare as P
    from autotune.search.prepare import _images

    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "cache"))
    spec = tiny_spec(tmp_path, "check")
    checked: list[str] = []
    image_problem = _images.image_problem
    monkeypatch.setattr(_images, "image_problem", lambda p: checked.append(p) or image_problem(p))

    def check(folder: Path) -> tuple[list[str], int]:
        said: list[str] = []
        checked.clear()
        P.prepare(P.SearchOptions(spec=str(spec), data=str(folder), storage=f"sqlite:///{tmp_path / 's.db'}"),
                  say=said.append)
        return said, len(checked)

    return check


def records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "data" / "checked").glob("*.json"))


def test_an_unchanged_folder_is_checked_once_and_any_change_checks_it_again(check_data, tmp_path):
    from autotune.exceptions import DataError

    d = make_jpeg_folder(tmp_path / "imgs", classes=2, per_class=12)
    said, n = check_data(d)
    assert n == 24 and not any("checked before" in s for s in said) and len(records(tmp_path)) == 1
    said, n = check_data(d)
    assert n == 0 and f"autotune: data: {d} checked before (24 files unchanged since); not checked again" in said

    f = d / "class0" / "003.jpg"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: same bytes, a newer mtime
    assert check_data(d)[1] == 24
    assert check_data(d)[1] == 0
    (d / "class1" / "100.jpg").write_bytes((d / "class1" / "000.jpg").read_bytes())  # added
    assert check_data(d)[1] == 25
    assert check_data(d)[1] == 0
    f.write_bytes(f.read_bytes()[:200])  # corrupted after a clean check: found
    with pytest.raises(DataError, match=r"class0/003\.jpg is not a readable image: a JPEG cut short"):
        check_data(d)
    with pytest.raises(DataError, match=r"class0/003\.jpg is not a readable image"):
        check_data(d)  # checked again, found again
    (d / "class1" / "100.jpg").unlink()
    f.write_bytes((d / "class1" / "000.jpg").read_bytes())  # repaired, one file removed
    assert check_data(d)[1] == 24
    assert check_data(d)[1] == 0 and len(records(tmp_path)) == 1


def test_a_failing_check_is_never_recorded(check_data, tmp_path):
    from autotune.exceptions import DataError

    d = make_jpeg_folder(tmp_path / "imgs", classes=2, per_class=12)
    (d / "class1" / "004.jpg").write_text("<html>403 Forbidden</html>")
    for _ in range(2):
        with pytest.raises(DataError, match=r"class1/004\.jpg is not a readable image"):
            check_data(d)
        assert records(tmp_path) == []


def test_a_long_check_shows_its_progress_on_stderr(check_data, tmp_path, monkeypatch, capsys):
    import io

    from autotune.search.prepare import _data_check as P

    d = make_jpeg_folder(tmp_path / "imgs", classes=2, per_class=12)
    monkeypatch.setattr(P, "MANY_FILES", 20)
    check_data(d)  # not a terminal: one line saying how many files
    err = capsys.readouterr().err
    assert err == f"autotune: data: checking every file of {d} (24 files) before trial 0; a later search skips " \
                  "this while they are unchanged\n"

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setattr(P, "PROGRESS_AFTER_S", 0.0)
    with P.check_progress(24, str(d)) as step:
        step(12)
        step(12)
    out = tty.getvalue()
    assert "\r" in out and f"autotune: data: checking {d}" in out and "24/24" in out
