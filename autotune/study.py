"""Study storage and set-up: storage URL, sampler, pruner, create-or-resume, trial 0 = the baseline, and trials
whose search is gone.

Storage: SQLite under ``studies/`` by default (``sqlite:///studies/<name>.db``); any SQLAlchemy URL through Optuna's
RDBStorage — PostgreSQL (``postgresql+psycopg://user:pass@host/db``, the ``postgres`` extra) is the one for many
search workers on one or many nodes; or a journal file (``journal:///path/x.journal``, or a path ending
``.journal``) for workers that share only a file system. Running ``autotune search`` again loads the same study and
adds trials; so does a second search started while the first runs: they share the study, and TPE's constant liar
keeps them from trying the same thing at once. Study-level user attrs record the spec and its fingerprint, so
``export`` needs nothing but the storage.

Optuna's own heartbeat only covers ``study.optimize``, not ask/tell, so a search records who runs each trial (host,
PID, the PID's start time, boot and PID namespace) and refreshes a ``heartbeat`` user attr every ``HEARTBEAT_S``
while the trial runs. A search that starts finds RUNNING trials whose owner is gone — on this machine: the PID is
dead or now someone else's; elsewhere: no heartbeat for ``stale_after_s`` — marks them FAIL (``stale``, with the
reason) and enqueues their parameters again, once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from autotune.exceptions import StorageError
from autotune.objective import Objective, constraints
from autotune.spec import StudySpec

HEARTBEAT_S = 10.0
"""How often a running trial's ``heartbeat`` user attr is refreshed."""

STALE_AFTER_S = 180.0
"""A trial owned by another machine whose heartbeat is older than this is stale (18 missed beats: a slow database
or a busy host does not get a live trial reclaimed)."""

SETUP_WAIT_S = 30.0
"""A search that finds the study just created by another worker waits this long for that worker to record the spec
and enqueue trial 0, so that trial 0 is the baseline whichever worker asks first."""

JOURNAL_PREFIX = "journal://"


def default_storage(name: str, root: str | Path = "studies") -> str:
    return f"sqlite:///{Path(root) / name}.db"


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
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy can parse: it fails later with its own message
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
        except Exception as e:  # noqa: BLE001 - unwritable folder, not a journal file
            raise StorageError(f"storage {shown}: {_first_line(e)}; use a writable path on a file system every "
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
        except Exception as e:  # noqa: BLE001 - bad URL, unreachable server, missing driver, unwritable file
            # Workers started together on a new database all create Optuna's tables: the losers of that race see
            # a duplicate-key or already-exists error, and find the tables there a moment later.
            attempt += 1
            if type(e).__name__ not in ("IntegrityError", "ProgrammingError") or attempt > 4:
                raise StorageError(f"storage {shown}: {_first_line(e)}; {_storage_fix(url, e)}") from None
            time.sleep(0.5 * attempt)


def _first_line(e: BaseException) -> str:
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
                   seed: int | None = None, attrs: dict[str, Any] | None = None,
                   baseline: dict[str, Any] | None = None, starts: list[dict[str, Any]] | None = None):
    """Create the study (recording the spec and enqueuing ``baseline`` as trial 0) or load it to resume; refuses,
    without writing anything, a study made by a different spec, world size or objective.

    Creation is what decides between workers started together: the database lets exactly one create the study, and
    the others wait until it has recorded the spec and enqueued trial 0 (``SETUP_WAIT_S``)."""
    import optuna

    fp = spec.fingerprint(nproc)
    sampler, pruner = make_sampler(spec, seed), make_pruner(spec, objective.multi)
    try:
        try:
            study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner,
                                        directions=objective.directions)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
            created = False
    except Exception as e:  # noqa: BLE001 - the database went away, or refuses the write
        raise StorageError(f"study {study_name}: {_first_line(e)}; check the storage") from None
    if created:
        _record_setup(study, spec, fp, objective, nproc, attrs, baseline, starts)
        return study
    ua = _wait_for_setup(study)
    old = ua.get("spec_fingerprint")
    if old is not None and old != fp:
        raise StorageError(f"study {study_name} exists with a different spec or world size (fingerprint {old}, "
                           f"now {fp}); use --study-name NEW, or rerun with the spec and --nproc-per-node it was "
                           "made with")
    have = [d.name.lower() for d in study.directions]
    if have != [d.lower() for d in objective.directions]:
        raise StorageError(f"study {study_name} exists with objective directions {have}, this search needs "
                           f"{list(objective.directions)}; use --study-name NEW or the objective it was made with")
    if old is None:  # a study made elsewhere (the Optuna CLI, an older version): adopt it
        fresh = not study.get_trials(deepcopy=False)
        _record_setup(study, spec, fp, objective, nproc, attrs, baseline if fresh else None,
                      starts if fresh else None)
    # A sampler seeded as the study's first worker was would draw that worker's random start-up trials again
    # (a resumed GPU search re-ran trials 1-4 as 7-10): a joining or resuming worker gets a seed of its own.
    base_seed = spec.sampler.seed if seed is None else seed
    if base_seed is not None:
        study.sampler = make_sampler(spec, worker_seed(base_seed, len(study.get_trials(deepcopy=False))))
    return study


def worker_seed(seed: int, n_trials: int) -> int:
    """The sampler seed of a worker joining a study of ``n_trials`` trials: distinct per host, process and study
    size, so neither a resume nor a second worker started beside the first repeats its draws."""
    key = f"{seed}:{n_trials}:{socket.gethostname()}:{os.getpid()}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little")


def _record_setup(study, spec: StudySpec, fp: str, objective: Objective, nproc: int, attrs: dict[str, Any] | None,
                  baseline: dict[str, Any] | None, starts: list[dict[str, Any]] | None = None) -> None:
    study.set_user_attr("spec_fingerprint", fp)
    study.set_user_attr("spec", spec.to_dict())
    study.set_user_attr("objective", objective.kind)
    study.set_user_attr("nproc_per_node", nproc)
    for k, v in (attrs or {}).items():
        study.set_user_attr(k, v)
    if baseline is not None:
        study.enqueue_trial(baseline, user_attrs={"baseline": True})
        study.set_user_attr("baseline_enqueued", True)
    for i, params in enumerate(starts or []):
        study.enqueue_trial(params, user_attrs={"start": i})
    study.set_user_attr("setup_complete", True)  # last: what other workers wait for


def _wait_for_setup(study) -> dict[str, Any]:
    deadline = time.monotonic() + SETUP_WAIT_S
    while True:
        ua = study.user_attrs
        # baseline_enqueued: a study made before setup_complete existed.
        if ua.get("setup_complete") or ua.get("baseline_enqueued") or time.monotonic() > deadline:
            return ua
        if "spec_fingerprint" not in ua and study.get_trials(deepcopy=False):
            return ua  # trials but no spec: not being set up by anyone, made by another tool
        time.sleep(0.2)


def enqueue_baseline(study, params: dict[str, Any]) -> bool:
    """Enqueue trial 0 (the baseline) once per study. Returns whether it was enqueued now. (``create_or_load`` with
    ``baseline=`` does this as part of creating the study; this is for a study set up without one.)"""
    if study.user_attrs.get("baseline_enqueued") or study.get_trials(deepcopy=False):
        return False
    study.enqueue_trial(params, user_attrs={"baseline": True})
    study.set_user_attr("baseline_enqueued", True)
    return True


# ---- trial owners, heartbeats, stale trials -----------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, /proc/PID/stat field 22); None when there is no such live
    process (a zombie is dead). With the PID it names one process for the life of the machine: PIDs are reused,
    start times on one boot are not."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def owner() -> dict[str, Any]:
    """Who runs a trial: enough to tell, later and from anywhere, whether that process still exists."""
    return {"owner_host": socket.gethostname(), "owner_pid": os.getpid(), "owner_start": process_start(os.getpid()),
            "owner_boot": _read("/proc/sys/kernel/random/boot_id"), "owner_pidns": _pid_namespace()}


class Heartbeat:
    """Refreshes the trial's ``heartbeat`` user attr (wall time) at most every ``interval`` s; call ``beat()`` as
    often as convenient (the launcher calls it on every poll). A storage hiccup must not kill a running trial: a
    failed beat is counted and the next one tries again."""

    def __init__(self, trial, interval: float = HEARTBEAT_S):
        self.trial, self.interval, self.last, self.failures = trial, interval, float("-inf"), 0

    def beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        try:
            self.trial.set_user_attr("heartbeat", time.time())
        except Exception:  # noqa: BLE001 - the database is briefly away: the trial goes on
            self.failures += 1


def _same_machine(a: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the owner's PID can be checked here: same host name, same boot, same PID namespace (a container
    sharing the host's name must not have its PIDs looked up in ours)."""
    return all(a.get(k) is not None and a.get(k) == me.get(k) for k in ("owner_host", "owner_boot", "owner_pidns"))


def stale_reason(t, *, stale_after_s: float = STALE_AFTER_S, now: float | None = None,
                 me: dict[str, Any] | None = None) -> str | None:
    """Why the RUNNING trial ``t`` (a FrozenTrial) has no live owner, or None when it may still be running."""
    now = time.time() if now is None else now
    me = owner() if me is None else me
    a = t.user_attrs
    started = t.datetime_start.timestamp() if t.datetime_start else None
    pid, host = a.get("owner_pid"), a.get("owner_host", "?")
    if pid is None:
        age = now - started if started is not None else None
        if age is not None and age > stale_after_s:
            return f"no owner recorded, started {age:.0f} s ago"
        return None
    if _same_machine(a, me):
        start = process_start(int(pid))
        if start is None:
            return f"its search (pid {pid} on {host}) is gone"
        if a.get("owner_start") is not None and start != a["owner_start"]:
            return f"its search (pid {pid} on {host}) is gone; the pid now belongs to another process"
        return None  # alive, even if slow: only its owner may finish it
    seen = a.get("heartbeat", started)
    if seen is None:
        return None
    age = now - float(seen)
    if age > stale_after_s:
        return f"no heartbeat from its search (pid {pid} on {host}) for {age:.0f} s (limit {stale_after_s:.0f} s)"
    return None


def reclaim_stale(study, storage, *, stale_after_s: float = STALE_AFTER_S) -> list[str]:
    """Mark every RUNNING trial whose owner is gone FAIL (``failure_class: stale``, the reason in
    ``failure_message``) and enqueue its parameters again, once (the new trial carries ``retry_of``; a retry that
    goes stale is not retried). Returns one line per trial, to print. Safe with several searches doing it at once:
    the database lets one of them finish the trial, and only that one enqueues."""
    import optuna
    from optuna.trial import TrialState

    me = owner()
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    lines = []
    study_id = None
    for t in running:
        reason = stale_reason(t, stale_after_s=stale_after_s, me=me)
        if reason is None:
            continue
        if study_id is None:
            study_id = storage.get_study_id_from_name(study.study_name)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            storage.set_trial_user_attr(trial_id, "failure_class", "stale")
            storage.set_trial_user_attr(trial_id, "failure_message", reason)
            storage.set_trial_user_attr(trial_id, "reclaimed_by", f"{me['owner_host']}:{me['owner_pid']}")
            if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # finished meanwhile, by its owner or by another search reclaiming it
        line = f"trial {t.number}: stale ({reason}): marked FAIL"
        retried = {u.user_attrs.get("retry_of") for u in study.get_trials(deepcopy=False)}
        if t.user_attrs.get("retry_of") is not None:
            line += f"; not run again (it was already the re-run of trial {t.user_attrs['retry_of']})"
        elif not t.params:
            line += "; nothing to run again (no parameter had been chosen)"
        elif t.number in retried:
            line += "; already enqueued again"
        else:
            extra = {"baseline": True} if t.user_attrs.get("baseline") else {}
            study.enqueue_trial(dict(t.params), user_attrs={"retry_of": t.number, **extra})
            line += "; its parameters run again as a new trial"
        lines.append(line)
    return lines


def load(study_name: str | None, storage_url: str):
    """Load a study for export/show/report; with one study in the storage its name may be omitted. Never creates
    a database: a path that does not exist is an error naming the fix."""
    import optuna

    storage = open_storage(storage_url, create=False)
    try:
        names = optuna.study.get_all_study_names(storage)
    except Exception as e:  # noqa: BLE001 - reachable but not an Optuna database, or gone meanwhile
        raise StorageError(f"storage {display_url(storage_url)}: {_first_line(e)}; is it an autotune/Optuna "
                           "study storage?") from None
    shown = display_url(storage_url)
    if study_name is None:
        if len(names) != 1:
            raise StorageError(f"{shown} holds {len(names)} studies ({', '.join(names) or 'none'}); "
                               "name one with --study")
        study_name = names[0]
    if study_name not in names:
        raise StorageError(f"no study {study_name!r} in {shown} (there: {', '.join(names) or 'none'})")
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
