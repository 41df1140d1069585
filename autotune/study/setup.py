"""Creating a study or joining one: the sampler, the pruner, the spec recorded with the study, trial 0, and its
parts study (the stages' measurements of the model alone and of each input pipeline alone, ``autotune.study.view``).

Running ``autotune search`` again loads the same study and adds trials; so does a second search started while the
first runs: they share the study, and TPE's constant liar keeps them from trying the same thing at once. The study
records its spec and fingerprint, so ``export`` needs nothing but the storage.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import warnings
import zlib
from typing import Any

import optuna

from autotune.exceptions import StorageError
from autotune.objective import Objective
from autotune.spec import StudySpec
from autotune.study.distinct import DistinctSampler
from autotune.study.pruning import BestFeasiblePruner
from autotune.study.storage import SPEC_KEY, first_line, parts_name, record_on_study
from autotune.study.view import Stage

SETUP_WAIT_S = 30.0
"""A search that finds the study just created by another worker waits this long for that worker to record the spec
and enqueue trial 0, so that trial 0 is the baseline whichever worker asks first."""


def make_sampler(spec: StudySpec, seed: int | None = None) -> optuna.samplers.BaseSampler:
    s = spec.sampler
    seed = s.seed if seed is None else seed
    if s.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # Constraints: each trial sets its own (``set_constraint``) before it is told; TPE reads them from the trial.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # group/multivariate: stable enough
        tpe = optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.n_startup_trials,
                                         multivariate=s.multivariate, group=s.multivariate,
                                         constant_liar=s.constant_liar)
    return DistinctSampler(tpe)


def make_pruner(spec: StudySpec, multi_objective: bool) -> optuna.pruners.BasePruner:
    p = spec.pruner
    # Optuna cannot prune multi-objective studies (trial.report refuses them).
    if p.kind == "none" or multi_objective:
        return optuna.pruners.NopPruner()
    return BestFeasiblePruner()


def parts_study(study: optuna.Study) -> optuna.Study:
    """The parts study of ``study`` (created when missing; several workers may race to, one wins). Its trials have no
    Optuna parameters and are never pruned: no sampler or pruner of its own learns or decides anything."""
    try:
        return optuna.create_study(study_name=parts_name(study.study_name), storage=study._storage,
                                   load_if_exists=True, direction="maximize", sampler=optuna.samplers.RandomSampler(),
                                   pruner=optuna.pruners.NopPruner())
    except Exception as e:
        raise StorageError(f"study {parts_name(study.study_name)}: {first_line(e)}; check the storage") from None


def create_or_load(*, spec: StudySpec, study_name: str, storage, objective: Objective, nproc: int,
                   seed: int | None = None, attrs: dict[str, Any] | None = None,
                   baseline: dict[str, Any] | None = None, starts: list[dict[str, Any]] | None = None) -> optuna.Study:
    """Create the study (recording the spec and enqueuing ``baseline`` as trial 0) or load it to resume; refuses,
    without writing anything, a study made by a different spec, world size or objective.

    Creation is what decides between workers started together: the database lets exactly one create the study, and
    the others wait until it has recorded the spec and enqueued trial 0 (``SETUP_WAIT_S``)."""
    fp = spec.fingerprint(nproc)
    sampler, pruner = make_sampler(spec, study_seed(spec, study_name, seed)), make_pruner(spec, objective.multi)
    try:
        try:
            study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner,
                                        directions=objective.directions)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
            created = False
    except Exception as e:
        raise StorageError(f"study {study_name}: {first_line(e)}; check the storage") from None
    if created:
        parts_study(study)  # before setup_complete: a joining worker finds both
        _record_setup(study, spec, fp, objective, nproc, attrs, baseline, starts)
        return study
    ua = _wait_for_setup(study)
    old = ua.get("spec_fingerprint")
    if old is not None and old != fp:
        raise StorageError(_other_setup(study_name, spec, old, fp))
    have = [d.name.lower() for d in study.directions]
    if have != [d.lower() for d in objective.directions]:
        raise StorageError(f"study {study_name} exists with objective directions {have}, this search needs "
                           f"{list(objective.directions)}; use --study NEW or the objective it was made with")
    if old is None:  # a study made elsewhere (the Optuna CLI, an older version): adopt it
        fresh = not study.get_trials(deepcopy=False)
        _record_setup(study, spec, fp, objective, nproc, attrs, baseline if fresh else None,
                      starts if fresh else None)
    # A sampler seeded as the study's first worker was would draw that worker's random start-up trials again: a
    # joining or resuming worker gets a seed of its own.
    base_seed = spec.sampler.seed if seed is None else seed
    if base_seed is not None:
        study.sampler = make_sampler(spec, worker_seed(base_seed, len(study.get_trials(deepcopy=False))))
    parts_study(study)
    return study


def _other_setup(study_name: str, spec: StudySpec, old: str, fp: str) -> str:
    """Why a study that exists cannot be joined, in the terms of what the search was given: a ``--script`` search
    is given no spec, so it hears of the script's form (a file, or a function on a live worker), its arguments and
    the world size."""
    if spec.source.startswith("--script"):
        return (f"study {study_name} exists, made for another script, another form of it (train.py and "
                f"train.py:main are two studies), other script arguments or another world size (fingerprint {old}, "
                f"now {fp}); use --study NEW, or rerun with the {spec.source}, arguments and --nproc-per-node it "
                "was made with")
    return (f"study {study_name} exists with a different spec or world size (fingerprint {old}, now {fp}); use "
            "--study NEW, or rerun with the spec and --nproc-per-node it was made with")


def study_seed(spec: StudySpec, study_name: str, seed: int | None) -> int | None:
    """The sampler seed of the worker that creates a study: ``seed`` where given (``--seed``: reproducible); else
    the spec's mixed with the study's name, so that studies of one spec do not all draw the same first trials."""
    if seed is not None or spec.sampler.seed is None:
        return seed
    return zlib.crc32(f"{spec.sampler.seed}:{study_name}".encode())


def worker_seed(seed: int, n_trials: int) -> int:
    """The sampler seed of a worker joining a study of ``n_trials`` trials: distinct per host, process and study
    size, so neither a resume nor a second worker started beside the first repeats its draws."""
    key = f"{seed}:{n_trials}:{socket.gethostname()}:{os.getpid()}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little")


def _record_setup(study, spec: StudySpec, fp: str, objective: Objective, nproc: int, attrs: dict[str, Any] | None,
                  baseline: dict[str, Any] | None, starts: list[dict[str, Any]] | None = None) -> None:
    study.set_user_attr("spec_fingerprint", fp)
    record_on_study(study, SPEC_KEY, spec.to_dict())
    study.set_user_attr("objective", objective.kind)
    study.set_user_attr("nproc_per_node", nproc)
    for k, v in (attrs or {}).items():
        study.set_user_attr(k, v)
    if baseline is not None:
        study.enqueue_trial(baseline, user_attrs={"stage": Stage.BASELINE})
    for i, params in enumerate(starts or []):
        study.enqueue_trial(params, user_attrs={"stage": Stage.START, "start": i})
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
