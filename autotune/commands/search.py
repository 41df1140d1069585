"""`autotune search`: an Optuna study whose trials are short torchrun DDP jobs, measured in global imgs/s."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from autotune.cli import command
from autotune.exceptions import DataError, GPUError, LaunchError


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", help="study spec: a YAML path or a built-in name (resnet50, cpu-demo); default: "
                                  "resnet50 when GPUs are visible, else cpu-demo")
    p.add_argument("--trials", type=int, help="trials to run in this call (default: the spec's budget.trials)")
    p.add_argument("--timeout", type=float, help="start no trial after this many seconds")
    p.add_argument("--trial-timeout", type=float, help="kill a trial with no measurement window for this long")
    p.add_argument("--storage", help="SQLAlchemy URL (default: sqlite:///studies/<name>.db); resumes when it exists")
    p.add_argument("--study-name", help="default: the spec's name")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default: every selected GPU; 2 on CPU)")
    p.add_argument("--gpus", help="GPUs to use, indices into CUDA_VISIBLE_DEVICES or UUIDs, e.g. 0,1")
    p.add_argument("--objective", choices=["throughput", "pareto", "weighted"], help="default: the spec's")
    p.add_argument("--seed", type=int, help="sampler seed (default: the spec's)")
    p.add_argument("--data", help="use this ImageFolder instead of the spec's data (generated when unset)")


def detect_gpus(nvml) -> int:
    """GPUs on this host, without importing torch when there is clearly none (keeps a CPU start fast)."""
    if nvml.available:
        return nvml.count()
    if not Path("/dev/nvidiactl").exists() and not Path("/proc/driver/nvidia").exists():
        return 0
    import torch

    return torch.cuda.device_count()


def choose_spec(args, n_visible: int, say) -> str:
    if args.spec:
        return args.spec
    if n_visible:
        say(f"autotune: {n_visible} GPU(s) visible: running the built-in resnet50 study (ResNet-50, generated "
            "ImageNet-like JPEGs) on them; --spec picks another")
        return "resnet50"
    say("autotune: no GPU visible: running the built-in cpu-demo study (2 gloo ranks, small model and images); "
        "on a GPU machine the same command tunes ResNet-50")
    return "cpu-demo"


def data_cache_root(spec) -> Path:
    if spec.data.cache_dir:
        return Path(spec.data.cache_dir).expanduser()
    if os.environ.get("AUTOTUNE_CACHE"):
        return Path(os.environ["AUTOTUNE_CACHE"]) / "data"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "ddp-autotune" / "data"


def ensure_data(spec, data_arg: str | None, say):
    """The base config with a data folder: ``--data``, the spec's path, or a generated set (made once, cached)."""
    if data_arg:
        path = Path(data_arg).expanduser().resolve()
        if not path.is_dir():
            raise DataError(f"--data {data_arg}: no such folder; run `autotune make-data {data_arg}` to make one")
        return spec.base_config(str(path)).with_overrides({"data.kind": "imagefolder"})
    if not spec.generates_data:
        base = spec.base_config()
        if base.data.kind == "imagefolder":
            path = Path(base.data.path).expanduser()
            if not path.is_dir():
                raise DataError(f"base.data.path {path}: no such folder; fix the spec or pass --data DIR")
            return base.with_overrides({"data.path": str(path.resolve())})
        return base
    gen = spec.data.generate
    root = data_cache_root(spec) / "imagefolder-{images}x{classes}-seed{seed}".format(
        images=gen["images"], classes=gen["classes"], seed=gen.get("seed", 0))
    from trainer.datagen import make_image_folder

    say(f"autotune: data: {gen['images']} generated JPEGs in {gen['classes']} classes at {root} (made once, then "
        "reused)")
    make_image_folder(root, images=gen["images"], classes=gen["classes"], val_fraction=gen.get("val_fraction", 0.0),
                      seed=gen.get("seed", 0), progress=sys.stderr.isatty())
    return spec.base_config(str(root.resolve()))


@command("search", help="tune a DDP job: an Optuna study whose trials are short torchrun runs", arguments=arguments)
def run(args) -> int:
    from autotune.gpu import Nvml, parse_gpu_list, select, to_nvml, visible_entries

    say = lambda s: print(s, flush=True)  # noqa: E731
    nvml = Nvml()
    n_visible = len(visible_entries(detect_gpus(nvml)))
    from autotune.spec import load_spec

    spec = load_spec(choose_spec(args, n_visible, say))
    entries = select(visible_entries(detect_gpus(nvml)), parse_gpu_list(args.gpus))
    on_gpu = bool(entries)
    if args.gpus and not on_gpu:
        raise GPUError(f"--gpus {args.gpus}: no GPU visible on this machine")
    nproc = args.nproc_per_node or spec.world.nproc_per_node or (len(entries) if on_gpu else 2)
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node {nproc}: must be >= 1")
    if on_gpu:
        if nproc > len(entries):
            raise GPUError(f"--nproc-per-node {nproc}: only {len(entries)} GPU(s) selected "
                           f"({','.join(entries)}); lower it or select more with --gpus")
        entries = entries[:nproc]
    gpus = to_nvml(nvml, entries) if on_gpu else []
    options = SearchOptions(spec=spec, nproc=nproc, entries=entries if on_gpu else None, gpus=gpus, nvml=nvml,
                            trials=args.trials, timeout_s=args.timeout, trial_timeout_s=args.trial_timeout,
                            storage=args.storage, study_name=args.study_name, objective=args.objective,
                            seed=args.seed, data=args.data)
    study = search(options, say=say)
    best = best_line(study)
    if best:
        say(best)
    return 0


# ---- the search loop ---------------------------------------------------------------------------------------------


class SearchOptions:
    def __init__(self, *, spec, nproc: int, entries: list[str] | None, gpus: list, nvml, trials: int | None = None,
                 timeout_s: float | None = None, trial_timeout_s: float | None = None, storage: str | None = None,
                 study_name: str | None = None, objective: str | None = None, seed: int | None = None,
                 data: str | None = None):
        self.__dict__.update(locals())
        del self.__dict__["self"]


def search(o: SearchOptions, say=print):
    """Run ``o.trials`` trials of the spec's study (creating or resuming it); returns the Optuna study."""
    from optuna.trial import TrialState

    from trainer.config import ConfigError

    from autotune import gpu as gpu_mod
    from autotune import study as study_mod
    from autotune.launch import TrialJob, nnodes_of, run_trial
    from autotune.objective import Objective, measured_attrs, state_for
    from autotune.progress import Progress
    from autotune.space import predicted_oom, resolve

    spec = o.spec
    name = o.study_name or spec.name
    objective = Objective(kind=o.objective or spec.objective.kind, weights=spec.objective.weights)
    util_available = o.nvml.available and bool(o.gpus)
    reason = "no GPU" if not o.entries else (o.nvml.reason or "no NVML device for the selected GPUs")
    objective.check(util_available, reason)
    nnodes = nnodes_of(spec.world.torchrun_args)
    space = resolve(spec, world_size=o.nproc * nnodes, nproc_per_node=o.nproc, cpu_only=not o.entries)
    base = ensure_data(spec, o.data, say)
    base_dict = base.to_dict()
    baseline = space.baseline_params(spec, base_dict)

    storage_url = o.storage or study_mod.default_storage(name)
    storage = study_mod.open_storage(storage_url)
    fingerprint = gpu_mod.fingerprint(o.nvml, o.gpus)
    study = study_mod.create_or_load(spec=spec, study_name=name, storage=storage, objective=objective, nproc=o.nproc,
                                     seed=o.seed, attrs={"fingerprint": fingerprint,
                                                         "torchrun_args": spec.world.torchrun_args,
                                                         "reference_global_batch": _reference_batch(
                                                             base, baseline, o.nproc * nnodes)})
    n_before = len(study.get_trials(deepcopy=False))
    study_mod.enqueue_baseline(study, baseline)
    logs = study_mod.log_root(storage_url, name)
    trials = o.trials or spec.budget.trials
    timeout_s = o.timeout_s if o.timeout_s is not None else spec.budget.timeout_s
    trial_timeout = o.trial_timeout_s or spec.budget.trial_timeout_s

    where = f"{o.nproc} x {'GPU ' + ', '.join(g.name for g in o.gpus[:1]) if o.gpus else 'CPU (gloo)'}"
    say(f"autotune: study {name} ({'resuming, ' + str(n_before) + ' trials so far' if n_before else 'new'}) in "
        f"{storage_url}; {trials} trial(s) on {where}; objective {objective.kind}; logs in {logs}/")
    for note in space.notes:
        say(f"autotune: note: {note}")
    if not util_available:
        say(f"autotune: GPU utilization unavailable ({reason}): recorded as such, not estimated")
    say("autotune: search space: " + "; ".join(f"{p.path} {p.describe()}" + (f" if {p.when.path} {p.when.op} "
                                                                           f"{p.when.value}" if p.when else "")
                                             for p in space.params))

    def run_one(trial) -> None:
        for k, v in study_mod.owner().items():
            trial.set_user_attr(k, v)
        overrides = space.suggest(trial, base_dict)
        trial_dir = logs / f"trial-{trial.number}"
        attrs: dict[str, Any] = {"overrides": overrides, "log_path": str((trial_dir / "log.txt").resolve()),
                                 "util_available": util_available, "util_mean": None}
        t0 = time.monotonic()
        failure, message, run = None, None, None
        cfg = None
        try:
            cfg = base.with_overrides({**overrides, "name": f"{name}-trial-{trial.number}",
                                       "output_dir": str(trial_dir)})
            attrs["config"] = cfg.to_dict()
        except ConfigError as e:
            failure, message = "config", "; ".join(e.problems)
        if cfg is not None:
            ooms = [(t.number, t.user_attrs["config"]) for t in study.get_trials(deepcopy=False)
                    if t.user_attrs.get("failure_class") == "oom" and "config" in t.user_attrs
                    and not t.user_attrs.get("oom_predicted_from")]
            prior = predicted_oom(attrs["config"], ooms)
            if prior is not None:
                failure, message = "oom", f"trial {prior} ran out of memory at a batch <= this one with the same " \
                                          "memory-relevant settings; not launched"
                attrs["oom_predicted_from"] = prior
        if failure is None:
            sampler = gpu_mod.Sampler(o.nvml, o.gpus).start()
            seen: list[dict] = []

            def on_record(rec, trial=trial, seen=seen):
                if rec.get("kind") != "window":
                    return False
                seen.append(rec)
                ips = float(rec.get("imgs_per_s", 0.0))
                progress.status(f"trial {trial.number}: window {len(seen)}: {ips:,.1f} imgs/s")
                if objective.multi:
                    return False
                trial.report(ips, step=int(rec.get("window", len(seen) - 1)))
                return trial.should_prune()

            try:
                run = run_trial(TrialJob(config=cfg, trial_dir=trial_dir, nproc_per_node=o.nproc,
                                         gpus=[g.uuid for g in o.gpus] if o.gpus else o.entries,
                                         torchrun_args=spec.world.torchrun_args, timeout_s=trial_timeout),
                                on_record=on_record)
            finally:
                samples = sampler.stop()
            failure, message = run.failure_class, run.failure_message
            attrs.update(measured_attrs(run.windows, run.summary))
            attrs.update(run.timing())
            attrs["windows"] = len(run.windows)
            attrs["pgids"] = run.pgids
            attrs["env"] = {k: v for k, v in run.env.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED")}
            if run.leftover_pids:
                attrs["leftover_pids"] = run.leftover_pids
            if run.summary is None and run.of_kind("start"):
                attrs["versions"] = run.of_kind("start")[0].get("versions")
            if run.returncode is not None:
                attrs["returncode"] = run.returncode
            if util_available:
                attrs.update(gpu_mod.summarize(samples, run.windows, len(o.gpus)))
            if failure is None and run.summary is not None and run.summary.get("loss_finite") is False:
                failure, message = "config", "the loss is not finite (NaN/inf) with this config"
        attrs["wall_s"] = round(time.monotonic() - t0, 3)
        if failure is not None:
            attrs["failure_class"], attrs["failure_message"] = failure, message
        attrs = {k: v for k, v in attrs.items() if v is not None or k in ("util_mean",)}
        for k, v in attrs.items():
            trial.set_user_attr(k, v)

        pruned = run is not None and run.stopped == "pruned"
        state = "pruned" if pruned else state_for(failure)
        ips = attrs.get("imgs_per_s")
        if state == "complete" and ips is None:
            state, failure = "fail", "crash"
            trial.set_user_attr("failure_class", "crash")
            trial.set_user_attr("failure_message", "the job reported no throughput")
        if state == "complete":
            study_mod.set_feasibility(trial, False)
            study.tell(trial, objective.values(attrs))
        elif state == "infeasible":
            study_mod.set_feasibility(trial, True)
            study.tell(trial, objective.infeasible_values())
        elif state == "pruned":
            study_mod.set_feasibility(trial, False)
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, state=TrialState.FAIL)

        params = {p.path: trial.params[p.path] for p in space.params if p.path in trial.params}
        outcome = {"complete": "ok", "pruned": "pruned", "infeasible": f"infeasible:{failure}",
                   "fail": f"FAIL:{failure}"}[state]
        b = _best(study, objective)
        progress.trial_done(number=trial.number, params=params, outcome=outcome, ips=ips,
                            util=attrs.get("util_mean"), best=b, baseline=_baseline_value(study),
                            wall=time.monotonic() - t0)
        if failure is not None and state != "pruned":
            progress.say(f"      {failure}: {message} (log: {attrs['log_path']})")

    progress = Progress(total=trials, timeout_s=timeout_s)
    t_start = time.monotonic()
    for _ in range(trials):
        if timeout_s is not None and time.monotonic() - t_start > timeout_s:
            say(f"autotune: time budget of {timeout_s:.0f} s spent; stopping")
            break
        trial = study.ask()
        try:
            run_one(trial)
        except BaseException as e:
            _abandon(study, trial, e)
            raise
    return study


def _abandon(study, trial, exc: BaseException) -> None:
    """A trial the search could not finish (Ctrl-C, an unsafe environment, a bug) is FAIL, not left RUNNING."""
    from optuna.trial import TrialState

    try:  # on a trial that was already told, Optuna refuses the first call: nothing to do then
        interrupted = isinstance(exc, KeyboardInterrupt)
        trial.set_user_attr("failure_class", "interrupted" if interrupted else "search")
        trial.set_user_attr("failure_message", "interrupted (Ctrl-C)" if interrupted else
                            f"{type(exc).__name__}: {exc}"[:300])
        study.tell(trial, state=TrialState.FAIL)
    except Exception:  # noqa: BLE001 - already finished, or the storage is gone: the original error matters more
        pass


def _reference_batch(base, baseline: dict[str, Any], world: int) -> int:
    """The global batch the base learning rate is meant for: ``optimizer.reference_global_batch`` if the spec sets
    it, else the baseline's global batch."""
    if base.optimizer.reference_global_batch:
        return base.optimizer.reference_global_batch
    bs = baseline.get("training.batch_size", base.training.batch_size)
    acc = baseline.get("training.accum_steps", base.training.accum_steps)
    return int(bs * acc * world)


def _feasible_complete(study):
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("constraint", 0.0) <= 0 and t.user_attrs.get("imgs_per_s") is not None]


def _best(study, objective) -> tuple[int, float] | None:
    done = _feasible_complete(study)
    if not done:
        return None
    t = max(done, key=lambda t: t.user_attrs["imgs_per_s"])
    return t.number, float(t.user_attrs["imgs_per_s"])


def _baseline_value(study) -> float | None:
    for t in _feasible_complete(study):
        if t.user_attrs.get("baseline"):
            return float(t.user_attrs["imgs_per_s"])
    return None


def best_line(study) -> str | None:
    from autotune.objective import Objective

    b = _best(study, Objective())
    if b is None:
        return "autotune: no trial has completed yet; see the trial logs"
    base = _baseline_value(study)
    gain = f", {b[1] / base:.2f}x the baseline (trial 0: {base:,.1f})" if base else ""
    return (f"autotune: fastest: trial {b[0]} at {b[1]:,.1f} imgs/s{gain}. `autotune show` lists the trials; "
            f"`autotune export best.yaml --study {study.study_name}` writes its config")
