"""Study storage and set-up: storage URL, sampler, pruner, create-or-resume, trial 0 = the baseline.

Default storage is SQLite under ``studies/`` (``sqlite:///studies/<name>.db``); any SQLAlchemy URL works through
Optuna's RDBStorage (PostgreSQL for many search workers). Running ``autotune search`` again loads the same study and
adds trials. Study-level user attrs record the spec and its fingerprint, so ``export`` needs nothing but the storage.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from pathlib import Path
from typing import Any

from autotune.exceptions import StorageError
from autotune.objective import Objective, constraints
from autotune.spec import StudySpec


def default_storage(name: str, root: str | Path = "studies") -> str:
    Path(root).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(root) / name}.db"


def log_root(storage_url: str, study_name: str) -> Path:
    """Where trial folders go: next to a SQLite file, else ``studies/<name>/`` in the working directory."""
    if storage_url.startswith("sqlite:///") and ":memory:" not in storage_url:
        db = Path(storage_url[len("sqlite:///"):])
        return db.parent / study_name
    return Path("studies") / study_name


def open_storage(url: str):
    """An Optuna storage for ``url`` (SQLAlchemy URL, or a ``.log``/``.journal`` path: JournalFile storage)."""
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)
    try:
        if url.endswith((".log", ".journal")) and "://" not in url:
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            return JournalStorage(JournalFileBackend(url))
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            db = url.split(":///", 1)[-1]
            if db and db != ":memory:":
                Path(db).parent.mkdir(parents=True, exist_ok=True)
            # Several search workers may share a SQLite file: wait for the lock instead of failing at once.
            kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
        return optuna.storages.RDBStorage(url, **kwargs)
    except Exception as e:  # noqa: BLE001 - bad URL, unreachable server, missing driver
        raise StorageError(f"storage {url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                           "(check the URL; PostgreSQL needs `pip install ddp-autotune[postgres]`)") from None


def make_sampler(spec: StudySpec, seed: int | None = None):
    import optuna

    s = spec.sampler
    seed = s.seed if seed is None else seed
    if s.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # Optuna >= 5 reads constraints the trial set itself (set_feasibility); 4.x needs constraints_func.
    extra = {} if _has_set_constraint() else {"constraints_func": constraints}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # group/multivariate: stable enough
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.n_startup_trials,
                                          multivariate=s.multivariate, group=s.multivariate,
                                          constant_liar=s.constant_liar, **extra)


def _has_set_constraint() -> bool:
    import optuna

    return hasattr(optuna.trial.Trial, "set_constraint")


def set_feasibility(trial, infeasible: bool) -> None:
    """Mark a trial (in)feasible for the sampler before ``tell``: constraint 1.0 infeasible, 0.0 feasible."""
    value = 1.0 if infeasible else 0.0
    trial.set_user_attr("constraint", value)
    if _has_set_constraint():
        trial.set_constraint("infeasible", value)


def make_pruner(spec: StudySpec, multi_objective: bool):
    import optuna

    p = spec.pruner
    # Optuna cannot prune multi-objective studies (trial.report refuses them).
    if p.kind == "none" or multi_objective:
        return optuna.pruners.NopPruner()
    pct = 50.0 if p.kind == "median" else p.percentile
    return optuna.pruners.PercentilePruner(pct, n_startup_trials=p.n_startup_trials, n_warmup_steps=p.n_warmup_steps)


def create_or_load(*, spec: StudySpec, study_name: str, storage, objective: Objective, nproc: int,
                   seed: int | None = None, attrs: dict[str, Any] | None = None):
    """Create the study or load it to resume; refuses a study made by a different spec or objective."""
    import optuna

    fp = spec.fingerprint(nproc)
    try:
        study = optuna.create_study(study_name=study_name, storage=storage, sampler=make_sampler(spec, seed),
                                    pruner=make_pruner(spec, objective.multi), directions=objective.directions,
                                    load_if_exists=True)
    except ValueError as e:  # existing study with other directions
        raise StorageError(f"study {study_name}: {e}; use another --study-name") from None
    old = study.user_attrs.get("spec_fingerprint")
    if old is not None and old != fp:
        raise StorageError(f"study {study_name} exists with a different spec or world size (fingerprint {old}, "
                           f"now {fp}); use --study-name NEW, or rerun with the spec and --nproc-per-node it was "
                           "made with")
    if old is None:
        study.set_user_attr("spec_fingerprint", fp)
        study.set_user_attr("spec", spec.to_dict())
        study.set_user_attr("objective", objective.kind)
        study.set_user_attr("nproc_per_node", nproc)
        for k, v in (attrs or {}).items():
            study.set_user_attr(k, v)
    return study


def enqueue_baseline(study, params: dict[str, Any]) -> bool:
    """Enqueue trial 0 (the baseline) once per study. Returns whether it was enqueued now."""
    if study.user_attrs.get("baseline_enqueued") or study.get_trials(deepcopy=False):
        return False
    study.set_user_attr("baseline_enqueued", True)
    study.enqueue_trial(params, user_attrs={"baseline": True})
    return True


def owner() -> dict[str, Any]:
    """Who runs a trial (for finding stale trials whose search process is gone)."""
    return {"owner_host": socket.gethostname(), "owner_pid": os.getpid()}


def load(study_name: str | None, storage_url: str):
    """Load a study for export/show; with one study in the storage its name may be omitted."""
    import optuna

    storage = open_storage(storage_url)
    names = optuna.study.get_all_study_names(storage)
    if study_name is None:
        if len(names) != 1:
            raise StorageError(f"{storage_url} holds {len(names)} studies ({', '.join(names) or 'none'}); "
                               "name one with --study")
        study_name = names[0]
    if study_name not in names:
        raise StorageError(f"no study {study_name!r} in {storage_url} (there: {', '.join(names) or 'none'})")
    return optuna.load_study(study_name=study_name, storage=storage)


def resolve_storage(study_name: str | None, storage: str | None) -> str:
    """``--storage`` or the default SQLite file of ``--study``; refuses to invent a database to read from."""
    if storage:
        return storage
    if study_name:
        db = Path("studies") / f"{study_name}.db"
        if not db.is_file():
            raise StorageError(f"no {db} here; run `autotune search` first or pass --storage URL")
        return f"sqlite:///{db}"
    dbs = sorted(Path("studies").glob("*.db"))
    if len(dbs) == 1:
        return f"sqlite:///{dbs[0]}"
    raise StorageError(f"{'no' if not dbs else len(dbs)} study databases in ./studies; pass --study NAME or "
                       "--storage URL")
