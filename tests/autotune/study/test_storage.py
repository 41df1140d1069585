"""Where studies live by default (one SQLite file that the stock tools list whole, older per-study files still
found), what a trial records where (user attrs a person reads, system attrs the rest), and a storage a search cannot
write."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autotune import cli
from autotune.exceptions import StorageError
from autotune.study import storage as st
from autotune.study import view

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_every_new_study_goes_into_one_file_and_an_older_file_of_its_own_is_still_found(in_tmp):
    assert st.default_storage("alpha") == "sqlite:///studies/autotune.db"
    (in_tmp / "studies").mkdir()
    optuna.create_study(study_name="old", storage="sqlite:///studies/old.db")  # an earlier version's layout
    assert st.default_storage("old") == "sqlite:///studies/old.db"  # resumed there, never a second "old"
    for name in ("alpha", "beta"):
        optuna.create_study(study_name=name, storage=st.default_storage(name))
    assert st.study_files() == {Path("studies/autotune.db"): ["alpha", "beta"], Path("studies/old.db"): ["old"]}
    assert st.resolve_storage("beta", None) == "sqlite:///studies/autotune.db"
    assert st.resolve_storage("old", None) == "sqlite:///studies/old.db"
    assert st.resolve_storage(None, None, every_study=True) == "sqlite:///studies/autotune.db"  # the dashboard
    with pytest.raises(StorageError, match=r"3 studies in ./studies \(alpha, beta, old\): pick one with --study"):
        st.resolve_storage(None, None)
    with pytest.raises(StorageError, match=r"no study gamma in ./studies \(here: alpha, beta, old\)"):
        st.resolve_storage("gamma", None)
    (in_tmp / "studies" / "notes.db").write_text("not a database")  # left out, never written to
    assert st.resolve_storage("alpha", None) == "sqlite:///studies/autotune.db"
    assert (in_tmp / "studies" / "notes.db").read_text() == "not a database"


def test_the_stock_optuna_cli_lists_every_study_of_the_default_file(in_tmp):
    for name in ("alpha", "beta"):
        optuna.create_study(study_name=name, storage=st.open_storage(st.default_storage(name)))
    optuna_cli = shutil.which("optuna", path=str(Path(sys.executable).parent)) or shutil.which("optuna")
    r = subprocess.run([optuna_cli, "studies", "--storage", "sqlite:///studies/autotune.db", "-f", "json"],
                       capture_output=True, text=True, cwd=in_tmp)
    assert r.returncode == 0, r.stderr
    assert '"alpha"' in r.stdout and '"beta"' in r.stdout


def test_a_trial_keeps_what_a_person_reads_as_user_attrs_and_the_rest_as_system_attrs():
    study = optuna.create_study()
    trial = study.ask()
    long_message = "RuntimeError: " + "x" * 400
    st.set_trial_attrs(trial, {"stage": "candidate", "imgs_per_s": 93.3, "failure_class": "crash",
                               "failure_message": long_message, "log_path": "/a/long/path/to/log.txt",
                               "imgs_per_s_windows": [90.0, 93.3, 95.1], "owner_boot": "b3c5", "owner_pid": 7})
    study.tell(trial, 93.3)
    t = study.trials[0]
    assert set(t.user_attrs) == {"stage", "imgs_per_s", "failure_class", "failure_message", "owner_pid"}
    assert len(t.user_attrs["failure_message"]) == st.MESSAGE_WIDTH  # cut where a table row shows it ...
    a = st.trial_attrs(t)
    assert a["failure_message"] == long_message  # ... and whole where the tool reads it
    assert a["log_path"] == "/a/long/path/to/log.txt" and a["imgs_per_s_windows"] == [90.0, 93.3, 95.1]
    v = view.TrialView.of(t)
    assert v.failure_message == long_message and v.attrs["owner_boot"] == "b3c5" and v.imgs_per_s == 93.3
    # A trial recorded by an earlier version (everything a user attr) reads the same.
    old = optuna.trial.create_trial(value=1.0, user_attrs={"stage": "search", "imgs_per_s": 1.0, "log_path": "/x"})
    assert st.trial_attrs(old)["log_path"] == "/x"


def _immutable(path: Path) -> bool:
    """Make ``path`` unwritable even for root (chattr +i); False where that cannot be done here."""
    path.chmod(0o444)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return True
    import os

    return not os.access(path, os.W_OK)


def test_a_read_only_study_database_is_one_line_naming_the_fix(in_tmp, capsys):
    from tests.helpers.specs import tiny_spec

    db = in_tmp / "ro.db"
    optuna.create_study(study_name="ro", storage=f"sqlite:///{db}")
    if not _immutable(db):
        pytest.skip("cannot make a file read-only here (root without chattr)")
    try:
        rc = cli.main(["search", "--spec", str(tiny_spec(in_tmp, "ro")), "--storage", f"sqlite:///{db}"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert f"storage sqlite:///{db}: the file is read-only; make it writable (chmod u+w {db})" in err
        assert "invalid data" not in err
        assert cli.main(["show", "--storage", f"sqlite:///{db}"]) == 0  # reading it still works
    finally:
        subprocess.run(["chattr", "-i", str(db)], capture_output=True)
        db.chmod(0o644)


def test_optunas_commit_error_says_what_the_database_said():
    cause = optuna.exceptions.StorageInternalError("An exception is raised during the commit. This typically "
                                                   "happens due to invalid data in the commit.")
    try:
        try:
            raise RuntimeError("(sqlite3.OperationalError) attempt to write a readonly database")
        except RuntimeError as e:
            raise cause from e
    except optuna.exceptions.StorageInternalError as e:
        assert st.first_line(e) == "RuntimeError: attempt to write a readonly database"
