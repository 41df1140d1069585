"""Study storage: URLs, opening them, loading a study, the attributes a trial records, and where trial logs go.

By default every study lives in one SQLite file, ``studies/autotune.db``, so that the stock tools (``optuna studies
--storage sqlite:///studies/autotune.db``, optuna-dashboard) list them all; a study made in a file of its own
(``studies/<name>.db``, as earlier versions did) is found and opened there. Any SQLAlchemy URL works through Optuna's
RDBStorage — PostgreSQL (``postgresql+psycopg://user:pass@host/db``, the ``postgres`` extra) is the one for many
search workers on one or many nodes; or a journal file (``journal:///path/x.journal``, or a path ending
``.journal``) for workers that share only a file system.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from autotune.exceptions import StorageError

JOURNAL_PREFIX = "journal://"

SPEC_KEY = "autotune:spec"
"""The study's spec (a mapping), in the study's system attrs."""

CONFIG_KEY = "autotune:config"
"""A trial's full TrainConfig (a mapping), in the trial's system attrs."""

PARTS_SUFFIX = ".parts"
"""The parts study of study ``x`` (its measurements of parts, ``autotune.study.view``) is ``x.parts``, in the same
storage: not a study to pick by itself."""


def parts_name(study_name: str) -> str:
    return study_name + PARTS_SUFFIX


# ---- records a person does not read -----------------------------------------------------------------------------
# Bulky records (the spec, a trial's whole config, its logs, owner, timings, per-window figures) go into Optuna's
# system attrs: Optuna's CLI tables (`optuna studies`, `optuna trials`) print every user attr on one line, and a spec
# there would make each row thousands of characters wide. User attrs keep what a person reads in those tables and in
# the dashboard: stage, figures and their intervals, failure. Optuna's storage API is the way to the others.

ATTR_PREFIX = "autotune:attr:"
"""A trial attribute kept out of the user attrs is the system attr ``ATTR_PREFIX + name``."""

PERSON_ATTRS = frozenset({"stage", "imgs_per_s", "ci_low", "ci_high", "ci_half_width", "precise", "loss_start",
                          "loss_end", "util_mean",
                          "wall_s", "failure_class", "failure_message", "owner_host", "owner_pid",
                          "repaired_by_next", "oom_predicted_from"})
"""The trial attributes recorded as user attrs (what ``optuna trials`` and the dashboard show); every other one a
search records is a system attr. What Optuna enqueues with a trial (stage, overrides, retry_of, ...) and the
heartbeat stay user attrs."""

MESSAGE_WIDTH = 120
"""A failure message longer than this is cut in the user attrs (one wide row widens the whole ``optuna trials``
table); the whole message is kept as a system attr."""


def record_on_study(study, key: str, value: Any) -> None:
    study._storage.set_study_system_attr(study._study_id, key, value)


def study_record(study, key: str, default: Any = None) -> Any:
    """A record of the study: its system attrs first, then its user attrs (studies made by earlier versions)."""
    found = study._storage.get_study_system_attrs(study._study_id).get(key)
    if found is None:
        found = study.user_attrs.get(key.split(":", 1)[-1])
    return default if found is None else found


def record_on_trial(trial, key: str, value: Any) -> None:
    trial.storage.set_trial_system_attr(trial._trial_id, key, value)


def set_trial_attrs(trial, attrs: dict[str, Any]) -> None:
    """Record a running trial's attributes: ``PERSON_ATTRS`` as user attrs, the rest as system attrs."""
    for key, value in attrs.items():
        if key not in PERSON_ATTRS:
            record_on_trial(trial, ATTR_PREFIX + key, value)
            continue
        if key == "failure_message" and isinstance(value, str) and len(value) > MESSAGE_WIDTH:
            record_on_trial(trial, ATTR_PREFIX + key, value)
            value = value[:MESSAGE_WIDTH - 1] + "…"
        trial.set_user_attr(key, value)


def trial_attrs(t) -> dict[str, Any]:
    """Every attribute a trial (a FrozenTrial) recorded, wherever it went: its user attrs and the system attrs of
    ``set_trial_attrs`` (these win: a cut failure message is whole there)."""
    kept = {k[len(ATTR_PREFIX):]: v for k, v in t.system_attrs.items() if k.startswith(ATTR_PREFIX)}
    return {**t.user_attrs, **kept}


STUDIES = Path("studies")
"""The folder of the default storage, relative to the working directory."""

DEFAULT_DB = "autotune.db"
"""The SQLite file every study goes into by default."""


def default_storage(name: str, root: str | Path = STUDIES) -> str:
    """Where a search keeps study ``name``: ``studies/autotune.db``, or the file of its own an earlier version made
    (``studies/<name>.db``), so that resuming it never starts a second study of that name."""
    own = Path(root) / f"{name}.db"
    return f"sqlite:///{own if own.is_file() else Path(root) / DEFAULT_DB}"


def missing_folder(url: str) -> Path | None:
    """The folder a SQLite or journal URL's file would be made in, when it does not exist yet (None otherwise)."""
    f = sqlite_path(url) or journal_path(url)
    if f is None:
        return None
    folder = f.expanduser().parent
    return None if folder.exists() else folder


def writable_problem(url: str) -> str | None:
    """Why a search cannot write the SQLite or journal file of ``url`` (None: it can, or it is another kind of
    storage). SQLite fails a write into a read-only file with an error that blames the data ("invalid data in the
    commit"), and it needs its folder too, for the journal it writes beside the file."""
    f = sqlite_path(url) or journal_path(url)
    if f is None:
        return None
    f = f.expanduser()
    shown = display_url(url)
    if f.exists() and not os.access(f, os.W_OK):
        return f"storage {shown}: the file is read-only; make it writable (chmod u+w {f}) or pass another --storage"
    folder = f.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        return (f"storage {shown}: the folder {folder} is not writable (the database and its journal are written "
                "there); pass --storage in a folder you can write")
    return None


def journal_path(url: str) -> Path | None:
    """The file of a journal storage URL (``journal:///abs/x.journal``, ``journal://rel/x.journal``, or a plain path
    ending ``.journal``/``.log``); None for anything else."""
    if url.startswith(JOURNAL_PREFIX):
        return Path(url[len(JOURNAL_PREFIX):])
    if "://" not in url and url.endswith((".journal", ".log")):
        return Path(url)
    return None


def sqlite_path(url: str) -> Path | None:
    """The database file of a ``sqlite:///`` URL; None for other URLs and in-memory SQLite."""
    if url.startswith("sqlite:///"):
        db = url[len("sqlite:///"):].split("?", 1)[0]
        return Path(db) if db and db != ":memory:" else None
    return None


def display_url(url: str) -> str:
    """The URL as it may be printed: the password hidden."""
    if "@" not in url or journal_path(url) is not None:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def log_root(storage_url: str, study_name: str) -> Path:
    """Where trial folders go: next to a SQLite or journal file, else ``studies/<name>/`` in the working directory
    (each node of a PostgreSQL study keeps the logs of the trials it ran)."""
    f = sqlite_path(storage_url) or journal_path(storage_url)
    if f is not None:
        return f.parent / study_name
    return Path("studies") / study_name


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg2 to SQLAlchemy; the postgres extra installs psycopg (3): use it when psycopg2
    is not there."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain) and importlib.util.find_spec("psycopg2") is None \
                and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url[len(plain):]
    return url


def open_storage(url: str, *, create: bool = True):
    """An Optuna storage for ``url``. ``create=False`` (show, export, report, dashboard) refuses a SQLite or journal
    file that does not exist instead of creating an empty one. Any failure is one StorageError naming the fix."""
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)
    shown = display_url(url)
    journal = journal_path(url)
    if journal is not None:
        if not create and not journal.is_file():
            raise StorageError(f"storage {shown}: no such journal file; run `autotune search --storage {shown}` "
                               "first or check the path")
        try:
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            journal.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(journal)))
        except Exception as e:
            raise StorageError(f"storage {shown}: {first_line(e)}; use a writable path on a file system every "
                               "worker shares") from None
    url = normalize_url(url)
    db = sqlite_path(url)
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        if db is not None and not create and not db.is_file():
            raise StorageError(f"storage {shown}: no such database; run `autotune search` first or pass "
                               "--storage URL")
        # Several search workers may share a SQLite file: wait for the lock instead of failing at once.
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    elif url.startswith(("postgresql", "postgres")):
        # pre_ping: a search runs for hours, the server may restart under it; connect_timeout: an unreachable host
        # says so in seconds instead of hanging.
        kwargs["engine_kwargs"] = {"pool_pre_ping": True, "connect_args": {"connect_timeout": 10}}
    attempt = 0
    while True:
        try:
            if db is not None:
                db.parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.RDBStorage(url, **kwargs)
        except Exception as e:
            # Workers started together on a new database all create Optuna's tables: the losers of that race see
            # a duplicate-key or already-exists error, and find the tables there a moment later.
            attempt += 1
            if type(e).__name__ not in ("IntegrityError", "ProgrammingError") or attempt > 4:
                raise StorageError(f"storage {shown}: {first_line(e)}; {_storage_fix(url, e)}") from None
            time.sleep(0.5 * attempt)


def first_line(e: BaseException) -> str:
    if type(e).__name__ == "StorageInternalError" and e.__cause__ is not None:
        e = e.__cause__  # Optuna's own text guesses at "invalid data"; the database's says what happened
    text = str(e).strip()
    if text.startswith("(") and ") " in text:  # SQLAlchemy prefixes the driver's exception class: keep the message
        text = text.split(") ", 1)[1]
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _storage_fix(url: str, e: BaseException) -> str:
    if isinstance(e, ImportError) or "No module named" in str(e):
        if url.startswith("postgres"):
            return "install the PostgreSQL driver: pip install 'ddp-autotune[postgres]' (psycopg 3)"
        return "install the database driver the URL names"
    if type(e).__name__ == "ArgumentError" or "://" not in url:
        return ("write a SQLAlchemy URL (sqlite:///studies/x.db, postgresql+psycopg://user:pass@host/db) or a "
                "journal file (journal:///path/x.journal)")
    if url.startswith("sqlite"):
        return "check that the folder of the database file exists and is writable"
    return "check that the server runs and is reachable, and the host, port, user, password and database in the URL"


def load(study_name: str | None, storage_url: str):
    """Load a study for export/show/report; with one study in the storage its name may be omitted. Never creates
    a database: a path that does not exist is an error naming the fix."""
    import optuna

    storage = open_storage(storage_url, create=False)
    try:
        names = optuna.study.get_all_study_names(storage)
    except Exception as e:
        raise StorageError(f"storage {display_url(storage_url)}: {first_line(e)}; is it an autotune/Optuna "
                           "study storage?") from None
    shown = display_url(storage_url)
    if study_name is None:  # a study's parts study is not a study to pick
        names = [n for n in names if not (n.endswith(PARTS_SUFFIX) and n[:-len(PARTS_SUFFIX)] in names)]
        if not names:
            raise StorageError(f"{shown} holds no study yet: run `autotune search --storage {shown}` first")
        if len(names) != 1:
            raise StorageError(f"{shown} holds {len(names)} studies ({', '.join(names)}); name one with --study")
        study_name = names[0]
    if study_name not in names:
        raise StorageError(f"no study {study_name!r} in {shown} (there: {', '.join(names) or 'none'})")
    return optuna.load_study(study_name=study_name, storage=storage)


def study_files(root: str | Path = STUDIES) -> dict[Path, list[str]]:
    """The SQLite files under ``root`` and the studies each holds (the default file first), read without writing
    anything: a file that is no Optuna storage is left out."""
    root = Path(root)
    files = sorted(root.glob("*.db"), key=lambda f: (f.name != DEFAULT_DB, f.name))
    found = {}
    for f in files:
        try:
            with sqlite3.connect(f"file:{f.resolve()}?mode=ro", uri=True) as db:
                found[f] = [row[0] for row in db.execute("SELECT study_name FROM studies ORDER BY study_id")]
        except sqlite3.Error:
            continue
    return found


def resolve_storage(study_name: str | None, storage: str | None, *, every_study: bool = False) -> str:
    """``--storage``, else the SQLite file under ``studies/`` that holds ``--study`` (or the only study there);
    refuses to invent a database to read from, and says what there is instead. ``every_study`` (the dashboard,
    which shows every study of a storage): without ``--study``, the default file."""
    if storage:
        return storage
    # A study's parts study (its stage measurements) is not a study to pick.
    files = {f: [n for n in held if not (n.endswith(PARTS_SUFFIX) and n[:-len(PARTS_SUFFIX)] in held)]
             for f, held in study_files().items()}
    names = [n for held in files.values() for n in held]
    if study_name:
        where = next((f for f, held in files.items() if study_name in held), None)
        if where is None:
            there = f" (here: {', '.join(names)})" if names else ""
            raise StorageError(f"no study {study_name} in ./studies{there}; run `autotune search` first, or pass "
                               "--storage URL")
        return f"sqlite:///{where}"
    if not names:
        raise StorageError("no study in ./studies: run `autotune search` first (or pass --storage URL)")
    if every_study and (STUDIES / DEFAULT_DB) in files:
        return f"sqlite:///{STUDIES / DEFAULT_DB}"
    if len(names) == 1:
        return f"sqlite:///{next(f for f, held in files.items() if held)}"
    raise StorageError(f"{len(names)} studies in ./studies ({', '.join(names)}): pick one with --study NAME")
