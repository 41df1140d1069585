"""Many search workers on one study: a real PostgreSQL server (AUTOTUNE_TEST_POSTGRES_URL, started by .ci/run) and a
journal file; the storage URL forms; the study set-up that makes trial 0 the baseline whichever worker asks first."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import optuna
import pytest

from autotune.exceptions import StorageError
from autotune.objective import Objective
from autotune.spec import StudySpec
from autotune.study import setup as study_setup
from autotune.study import storage as study_mod
from autotune.study.setup import create_or_load
from autotune.study.storage import trial_attrs
from tests.helpers.cli import autotune, start_autotune
from tests.helpers.specs import tiny_spec

S = optuna.trial.TrialState


def _run_workers(tmp_path: Path, spec: Path, storage: str, *, workers: int, trials: int) -> list[int]:
    procs = [start_autotune("search", "--spec", spec, "--storage", storage, "--trials", trials, cwd=tmp_path,
                            log=tmp_path / f"worker-{i}.log") for i in range(workers)]
    for i, p in enumerate(procs):
        rc = p.wait(timeout=300)
        assert rc == 0, (tmp_path / f"worker-{i}.log").read_text()
    return [p.pid for p in procs]


def _assert_consistent(trials, pids: list[int], per_worker: int) -> None:
    """Every trial ran exactly once, to completion, by one of the workers; trial 0 is the one baseline."""
    n = per_worker * len(pids)
    assert len(trials) == n and sorted(t.number for t in trials) == list(range(n))
    assert all(t.state == S.COMPLETE and t.user_attrs["imgs_per_s"] > 0 for t in trials), \
        [(t.number, t.state.name, t.user_attrs.get("failure_message")) for t in trials]
    assert Counter(t.user_attrs["owner_pid"] for t in trials) == dict.fromkeys(pids, per_worker)
    assert [t.number for t in trials if t.user_attrs.get("stage") == "baseline"] == [0]
    assert trials[0].params == {"training.batch_size": 8, "ddp.bucket_cap_mb": 25.0}
    for t in trials:
        assert t.user_attrs["heartbeat"] >= t.datetime_start.timestamp() - 1
        records = [json.loads(line) for line in Path(trial_attrs(t)["result_path"]).read_text().splitlines()]
        # One job per trial: one start, one summary (a trial run twice would append a second pair).
        assert [r["kind"] for r in records].count("start") == 1, t.number
        assert [r["kind"] for r in records].count("summary") == 1, t.number


@pytest.mark.slow
def test_two_search_workers_share_one_postgresql_study(tmp_path, pg_url):
    spec = tiny_spec(tmp_path, "shared")
    pids = _run_workers(tmp_path, spec, pg_url, workers=2, trials=3)

    trials = optuna.load_study(study_name="shared", storage=pg_url).get_trials()
    _assert_consistent(trials, pids, per_worker=3)
    r = autotune("show", "--storage", pg_url, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and "study shared: 6 trials (6 measured end to end)" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_two_search_workers_share_a_journal_file(tmp_path):
    spec = tiny_spec(tmp_path, "journaled")
    journal = tmp_path / "shared-fs" / "studies.journal"
    pids = _run_workers(tmp_path, spec, f"journal://{journal}", workers=2, trials=1)

    trials = optuna.load_study(study_name="journaled", storage=study_mod.open_storage(str(journal))).get_trials()
    _assert_consistent(trials, pids, per_worker=1)
    assert Path(trial_attrs(trials[1])["result_path"]).parent == journal.parent / "journaled" / "trial-1"  # beside
    r = autotune("show", "--storage", journal, cwd=tmp_path, timeout=60)  # a plain path ending .journal works too
    assert r.returncode == 0 and "study journaled: 2 trials" in r.stdout, r.stderr


def test_storage_urls(tmp_path, monkeypatch):
    assert study_mod.journal_path("journal:///abs/x.journal") == Path("/abs/x.journal")
    assert study_mod.journal_path("journal://rel/x.journal") == Path("rel/x.journal")
    assert study_mod.journal_path("runs/x.journal") == Path("runs/x.journal")
    assert study_mod.journal_path("sqlite:///x.db") is None and study_mod.journal_path("postgresql://h/db") is None
    assert study_mod.display_url("postgresql+psycopg://me:s3cret@db.example:5432/studies") == \
        "postgresql+psycopg://me:***@db.example:5432/studies"
    psycopg2 = importlib.util.find_spec("psycopg2") is not None  # SQLAlchemy's default driver, if installed
    assert study_mod.normalize_url("postgresql://me@h/db") == ("postgresql://me@h/db" if psycopg2 else
                                                              "postgresql+psycopg://me@h/db")
    assert study_mod.log_root("sqlite:////data/s/x.db", "x") == Path("/data/s/x")
    assert study_mod.log_root("journal:///nfs/j/x.journal", "x") == Path("/nfs/j/x")
    assert study_mod.log_root("postgresql+psycopg://h/db", "x") == Path("studies/x")

    monkeypatch.chdir(tmp_path)
    for url in ("sqlite:///nope/none.db", "journal:///" + str(tmp_path / "none.journal"), "none.journal"):
        with pytest.raises(StorageError, match="no such"):
            study_mod.load(None, url)
    assert list(tmp_path.iterdir()) == []  # reading never creates a database, nor its folder


def _spec(tmp_path) -> StudySpec:
    return StudySpec.from_yaml(tiny_spec(tmp_path))


def test_the_worker_that_creates_the_study_enqueues_the_baseline_and_the_others_do_not(tmp_path):
    storage = study_mod.open_storage(f"sqlite:///{tmp_path / 's.db'}")
    spec, base = _spec(tmp_path), {"training.batch_size": 8, "ddp.bucket_cap_mb": 25.0}
    for _ in range(3):  # three workers, one after the other
        study = create_or_load(spec=spec, study_name="s", storage=storage, objective=Objective(), nproc=2,
                                         baseline=base)
    (t0,) = study.get_trials()
    assert t0.state == S.WAITING and t0.user_attrs == {"stage": "baseline"}
    assert study.user_attrs["setup_complete"] and study.user_attrs["spec_fingerprint"] == spec.fingerprint(2)
    assert study.ask().params == {} and study.trials[0].system_attrs["fixed_params"] == base  # trial 0 = baseline

    with pytest.raises(StorageError, match="different spec"):
        create_or_load(spec=spec, study_name="s", storage=storage, objective=Objective(), nproc=4)
    with pytest.raises(StorageError, match="exists with objective directions"):  # --objective pareto
        create_or_load(spec=spec, study_name="s", storage=storage, objective=Objective(kind="pareto"),
                                 nproc=2)
    # Nothing was written by the refused workers: the study, its one trial, and the parts study made with it.
    assert len(study.get_trials()) == 1 and optuna.get_all_study_names(storage) == ["s", "s.parts"]


def test_a_worker_waits_for_the_study_set_up_then_adopts_a_study_nobody_sets_up(tmp_path, monkeypatch):
    storage = study_mod.open_storage(f"sqlite:///{tmp_path / 's.db'}")
    optuna.create_study(study_name="s", storage=storage, direction="maximize")  # e.g. a creator that died at once
    monkeypatch.setattr(study_setup, "SETUP_WAIT_S", 0.5)
    study = create_or_load(spec=_spec(tmp_path), study_name="s", storage=storage, objective=Objective(),
                                     nproc=2, baseline={"training.batch_size": 8})
    assert [t.user_attrs for t in study.get_trials()] == [{"stage": "baseline"}]
    assert study.user_attrs["setup_complete"]


def test_starts_follow_the_baseline_and_a_resumed_or_joining_worker_does_not_repeat_the_first_ones_draws(tmp_path):
    """A GPU search resumed with the same sampler seed re-ran its random start-up trials (1-4 again as 7-10)."""
    from autotune.space import resolve

    def worker(path, n, starts=()):
        spec = StudySpec.from_yaml(tiny_spec(tmp_path, **{"sampler.n_startup_trials": 20, "starts": list(starts)}))
        space = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=True, cores=2)
        storage = study_mod.open_storage(f"sqlite:///{path}")
        study = create_or_load(spec=spec, study_name="s", storage=storage, objective=Objective(), nproc=2,
                                         baseline={"training.batch_size": 8, "ddp.bucket_cap_mb": 25.0},
                                         starts=space.start_params(spec))
        drawn = []
        for _ in range(n):
            t = study.ask()
            drawn.append(space.suggest(t, spec.base_config().to_dict()))
            study.tell(t, 1.0)
        return study, drawn

    study, _ = worker(tmp_path / "starts.db", 3, starts=[{"training.batch_size": 16}])
    assert [t.user_attrs for t in study.trials] == [{"stage": "baseline"}, {"stage": "start", "start": 0}, {}]
    assert study.trials[1].params["training.batch_size"] == 16 and "ddp.bucket_cap_mb" in study.trials[1].params

    _, first = worker(tmp_path / "a.db", 4)
    assert first[0] == {"training.batch_size": 8, "ddp.bucket_cap_mb": 25.0}
    assert worker(tmp_path / "b.db", 4)[1] == first  # a new study with the spec's seed is reproducible ...
    _, resumed = worker(tmp_path / "a.db", 3)  # ... and a worker that resumes it draws new points
    assert not {d["ddp.bucket_cap_mb"] for d in first[1:]} & {d["ddp.bucket_cap_mb"] for d in resumed}, \
        (first, resumed)
