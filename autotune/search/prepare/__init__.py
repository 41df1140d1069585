"""Everything a search decides before it touches the study: the spec (or a model and a data folder given on the
command line), the GPUs and ranks, the data, the search space for this machine and this data, trial 0, and every
check that would otherwise fail trial after trial. A mistake costs one line and leaves no trace in any study.

``prepare`` is the order of those steps; each concern is a module of its own: the options (``_options``), the
plan (``_plan``), the spec and what the command line changes in it (``_choice``), the data (``_data``), the image
check (``_images``) and its record (``_data_check``), the model preflight (``_model``)."""

from __future__ import annotations

from autotune.exceptions import StorageError
from autotune.hw.nvml import Nvml
from autotune.hw.placement import gpu_count, to_nvml, visible_entries
from autotune.objective import Objective
from autotune.runner.torchrun import Torchrun
from autotune.search.prepare._choice import (
    choose_spec,
    job_spec,
    optimizer_section,
    placement,
    study_name,
    with_command_line,
)
from autotune.search.prepare._data import data_cache_root, generate_data, given_data, images_per_rank, summarize_data
from autotune.search.prepare._data_check import DataCheck, check_progress, files_signature
from autotune.search.prepare._images import image_problem, unreadable_images
from autotune.search.prepare._model import classes_of, describe_model, model_problems, preflight
from autotune.search.prepare._options import SearchOptions, check_options
from autotune.search.prepare._plan import DataSummary, Plan
from autotune.space import resolve
from autotune.study.storage import default_storage, missing_folder, writable_problem

__all__ = [
    "DataCheck", "DataSummary", "Plan", "SearchOptions", "check_options", "check_progress",
    "choose_spec", "classes_of", "data_cache_root", "describe_model", "files_signature", "generate_data",
    "given_data", "image_problem", "images_per_rank", "job_spec", "model_problems", "optimizer_section",
    "placement", "preflight", "prepare", "study_name", "summarize_data", "unreadable_images", "with_command_line",
]


def prepare(o: SearchOptions, say=print) -> Plan:
    check_options(o)
    nvml = Nvml()
    visible = visible_entries(gpu_count(nvml))
    spec, optimizer_line = job_spec(o, visible, say)
    entries, nproc = placement(o, spec, visible)
    gpus = to_nvml(nvml, entries) if entries else []
    torchrun = Torchrun.parse(spec.world.torchrun_args)
    world = nproc * torchrun.nnodes
    objective = Objective(kind=o.objective or spec.objective.kind, weights=spec.objective.weights)
    util_reason = None if nvml.available and gpus else ("no GPU" if not entries else
                                                        nvml.reason or "no NVML device for the selected GPUs")
    objective.check(util_reason is None, util_reason or "")
    base, checked = given_data(spec, o.data)
    data = summarize_data(base) if base is not None and base.data.kind == "imagefolder" else None
    probe = base or spec.base_config("<generated>")
    space = resolve(spec, world_size=world, nproc_per_node=nproc, cpu_only=not entries,
                    max_batch=images_per_rank(spec, data, world),
                    synthetic=probe.data.kind == "synthetic")
    baseline = space.baseline_params(spec, probe.to_dict())
    starts = space.start_params(spec)
    preflight(spec, probe, space, baseline, world, classes=classes_of(spec, probe, data))
    name = o.study or study_name(spec, o)
    storage_url = o.storage or default_storage(name)
    _settle(storage_url, checked, say)
    return Plan(options=o, spec=spec, name=name, objective=objective, nproc=nproc, torchrun=torchrun,
                entries=entries, gpus=gpus, nvml=nvml, util_reason=util_reason, space=space, base=base, probe=probe,
                baseline=baseline, starts=starts, data=data, storage_url=storage_url,
                trials=o.trials or spec.budget.trials,
                timeout_s=o.timeout_s if o.timeout_s is not None else spec.budget.timeout_s,
                trial_timeout_s=o.trial_timeout_s or spec.budget.trial_timeout_s, optimizer_line=optimizer_line)


def _settle(storage_url: str, checked: DataCheck | None, say) -> None:
    """The last check (the storage is writable), then what only a search that passed every check leaves behind:
    the data check's record, and the storage's folder (said here; the search makes it)."""
    problem = writable_problem(storage_url)
    if problem:
        raise StorageError(problem)
    if checked is not None:  # recorded only now: a search refused for another mistake leaves no file behind
        checked.settle(say)
    folder = missing_folder(storage_url)
    if folder is not None:  # every check passed: the search is about to make it
        say(f"autotune: making folder {folder} for the study storage")
