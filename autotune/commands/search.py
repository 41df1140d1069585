"""`autotune search`: an Optuna study whose trials are short torchrun DDP jobs, measured in global imgs/s.

Several searches may share one study (PostgreSQL, or a journal file on a shared file system): start one per node, or
one per group of GPUs with ``--gpus``; each runs its ``--trials`` and they never run the same trial twice. Everything
that can be checked before the study is touched is checked first (spec, models, data, knob ranges, GPUs, storage), so
a mistake costs one line and no trace in the study.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from autotune.cli import command
from autotune.exceptions import AutotuneError, DataError, GPUError, LaunchError, SpecError


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", help="study spec: a YAML path or a built-in name (resnet50, cpu-demo); default: "
                                  "resnet50 when GPUs are visible, else cpu-demo")
    p.add_argument("--trials", type=int, help="trials to run in this call (default: the spec's budget.trials)")
    p.add_argument("--timeout", type=float, help="start no trial after this many seconds")
    p.add_argument("--trial-timeout", type=float, help="kill a trial with no measurement window for this long")
    p.add_argument("--storage", help="SQLAlchemy URL (default: sqlite:///studies/<name>.db; postgresql+psycopg://"
                                     "user:pass@host/db for many search workers) or journal:///path/x.journal (a "
                                     "shared file system); resumes the study when it exists")
    p.add_argument("--study-name", help="default: the spec's name")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default: every selected GPU; 2 on CPU)")
    p.add_argument("--gpus", help="GPUs to use, indices into CUDA_VISIBLE_DEVICES or UUIDs, e.g. 0,1")
    p.add_argument("--objective", choices=["throughput", "pareto", "weighted"], help="default: the spec's")
    p.add_argument("--seed", type=int, help="sampler seed (default: the spec's); it makes a new study reproducible — "
                   "a resuming or joining worker derives a seed of its own from it, so it does not repeat draws")
    p.add_argument("--data", help="use this ImageFolder instead of the spec's data (generated when unset)")
    p.add_argument("--stale-after", type=float, help="a RUNNING trial of a search on another machine whose heartbeat "
                                                     "is older than this many seconds is stale: marked FAIL and run "
                                                     "again (default 180)")


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


def given_data(spec, data_arg: str | None):
    """The base config when its data already exists (``--data``, the spec's path, synthetic), checked: the folder
    exists and holds images. None when the spec's data is to be generated (``generate_data``)."""
    if data_arg:
        path = Path(data_arg).expanduser().resolve()
        if not path.is_dir():
            raise DataError(f"--data {data_arg}: no such folder; run `autotune make-data {data_arg}` to make one")
        base = spec.base_config(str(path)).with_overrides({"data.kind": "imagefolder"})
        return _check_images(base, "--data")
    if spec.generates_data:
        return None
    base = spec.base_config()
    if base.data.kind == "imagefolder":
        path = Path(base.data.path).expanduser()
        if not path.is_dir():
            raise DataError(f"base.data.path {path}: no such folder; fix the spec or pass --data DIR")
        base = base.with_overrides({"data.path": str(path.resolve())})
        return _check_images(base, "base.data.path")
    return base


def _check_images(base, where: str):
    """An ImageFolder with no image (or a validation split that does not match) fails every trial: say so now."""
    from trainer.config import ConfigError
    from trainer.data.files import resolve_splits

    try:
        resolve_splits(base)
    except ConfigError as e:
        raise DataError(f"{where}: {'; '.join(e.problems)}; it needs one folder per class with JPEG/PNG files in "
                        "them (`autotune make-data DIR` makes one)") from None
    return base


def ensure_data(spec, data_arg: str | None, say):
    """The base config with a data folder: ``--data``, the spec's path, or a generated set (made once, cached)."""
    base = given_data(spec, data_arg)
    return base if base is not None else generate_data(spec, say)


def generate_data(spec, say):
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
    for flag, value in (("--trials", args.trials), ("--timeout", args.timeout), ("--trial-timeout", args.trial_timeout),
                        ("--stale-after", args.stale_after)):
        if value is not None and value <= 0:
            raise AutotuneError(f"{flag} {value:g}: must be > 0")
    from autotune.study import HEARTBEAT_S

    if args.stale_after is not None and args.stale_after < 3 * HEARTBEAT_S:
        raise AutotuneError(f"--stale-after {args.stale_after:g}: must be >= {3 * HEARTBEAT_S:g} s (three heartbeats), "
                            "or a live trial on another machine could be taken for stale")
    nvml = Nvml()
    n_visible = len(visible_entries(detect_gpus(nvml)))
    from autotune.spec import load_spec

    spec = load_spec(choose_spec(args, n_visible, say))
    if args.gpus and not n_visible:
        raise GPUError(f"--gpus {args.gpus}: no GPU visible on this machine (CUDA_VISIBLE_DEVICES="
                       f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); drop --gpus to search on the CPU")
    entries = select(visible_entries(detect_gpus(nvml)), parse_gpu_list(args.gpus))
    on_gpu = bool(entries)
    nproc = args.nproc_per_node if args.nproc_per_node is not None else \
        spec.world.nproc_per_node or (len(entries) if on_gpu else 2)
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
                            seed=args.seed, data=args.data, stale_after_s=args.stale_after)
    # SIGTERM (a scheduler, `kill`) and SIGHUP (the terminal closed) end the search like Ctrl-C: the running trial's
    # processes are killed and the trial is recorded, instead of leaving it RUNNING for the next search to reclaim.
    old = ({s: signal.signal(s, _terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
           if threading.current_thread() is threading.main_thread() else {})
    try:
        study = search(options, say=say)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    best = best_line(study)
    if best:
        say(best)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP: handled as Ctrl-C is (the launcher kills the trial's processes on KeyboardInterrupt)."""


def _terminated(signum, frame):
    raise Terminated(f"terminated ({signal.Signals(signum).name})")


# ---- checks before the study is touched --------------------------------------------------------------------------


def preflight(spec, base, space, baseline: dict[str, Any], world: int) -> None:
    """What would otherwise fail trial after trial: model names that do not resolve, knob range ends outside what
    the config accepts, a baseline config that is invalid, less data than one global batch. One SpecError/DataError
    listing every problem."""
    from trainer.config import ConfigError, TrainConfig

    problems = model_problems(spec, space, baseline, base.model.name)
    for p in space.params:
        if p.kind == "categorical":
            continue  # choices were checked with the spec
        for end, value in (("low", p.low), ("high", p.high)):
            try:
                TrainConfig().with_overrides({p.path: value})
            except ConfigError as e:
                problems += [f"space.{p.path}.{end}: {x}" for x in e.problems if x.startswith(f"{p.path}=")]
    base_dict = base.to_dict()
    try:
        cfg = base.with_overrides(space.derive(dict(baseline), base_dict))
    except ConfigError as e:
        problems += [f"baseline (trial 0): {x}" for x in e.problems]
        cfg = None
    if problems:
        raise SpecError(problems, spec.source)
    if cfg is not None and cfg.data.kind == "imagefolder" and cfg.data.path and Path(cfg.data.path).is_dir():
        from trainer.data.files import resolve_splits

        n = len(resolve_splits(cfg)[0].samples)
        need = cfg.training.batch_size * cfg.training.accum_steps * world
        if n < need:
            raise DataError(f"data folder {cfg.data.path}: {n} training images, fewer than one global batch of trial "
                            f"0 ({need} = batch x accum x {world} ranks); add images or lower the batch")


def model_problems(spec, space, baseline: dict[str, Any], base_model: str) -> list[str]:
    """Every model a trial may build must resolve: a torchvision classification model or an importable
    ``package.module:function``."""
    import difflib
    import importlib

    names = {base_model: "base.model.name"}
    param = space.by_path().get("model.name")
    for c in (param.choices if param is not None else ()):
        names.setdefault(c, "space.model.name")
    if "model.name" in baseline:
        names.setdefault(baseline["model.name"], "baseline.model.name")
    problems, known = [], None
    for name, where in names.items():
        if not isinstance(name, str):
            continue
        if ":" in name:
            module, _, fn = name.partition(":")
            try:
                obj = getattr(importlib.import_module(module), fn, None)
            except Exception as e:  # noqa: BLE001 - ImportError, or the module itself raising
                problems.append(f"{where}={name!r}: cannot import {module} ({type(e).__name__}: {e}); is it on "
                                "PYTHONPATH?")
                continue
            if not callable(obj):
                problems.append(f"{where}={name!r}: {module} has no function {fn}")
            continue
        if known is None:
            from trainer.model import classification_models

            known = classification_models()
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
            problems.append(f"{where}={name!r}: not a torchvision classification model ({hint}); or give a factory "
                            "as package.module:function")
    return problems


# ---- the search loop ---------------------------------------------------------------------------------------------


class SearchOptions:
    def __init__(self, *, spec, nproc: int, entries: list[str] | None, gpus: list, nvml, trials: int | None = None,
                 timeout_s: float | None = None, trial_timeout_s: float | None = None, storage: str | None = None,
                 study_name: str | None = None, objective: str | None = None, seed: int | None = None,
                 data: str | None = None, stale_after_s: float | None = None):
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
    # Checked before the storage is opened: a bad input leaves no trace. A generated data set is made after the
    # storage is known to work (it can take minutes); until then the spec's base stands in for it.
    base = given_data(spec, o.data)
    probe = base or spec.base_config("<generated>")
    baseline = space.baseline_params(spec, probe.to_dict())
    starts = space.start_params(spec)
    preflight(spec, probe, space, baseline, o.nproc * nnodes)

    storage_url = o.storage or study_mod.default_storage(name)
    storage = study_mod.open_storage(storage_url)
    if base is None:
        base = generate_data(spec, say)
    base_dict = base.to_dict()
    fingerprint = gpu_mod.fingerprint(o.nvml, o.gpus)
    study = study_mod.create_or_load(spec=spec, study_name=name, storage=storage, objective=objective, nproc=o.nproc,
                                     seed=o.seed, baseline=baseline, starts=starts,
                                     attrs={"fingerprint": fingerprint, "torchrun_args": spec.world.torchrun_args,
                                            "reference_global_batch": _reference_batch(base, baseline,
                                                                                       o.nproc * nnodes)})
    stale_after = o.stale_after_s or study_mod.STALE_AFTER_S
    for line in study_mod.reclaim_stale(study, storage, stale_after_s=stale_after):
        say(f"autotune: {line}")
    so_far = study.get_trials(deepcopy=False)
    n_before = len(so_far) if any(t.state.name != "WAITING" for t in so_far) else 0  # not just trial 0 enqueued
    logs = study_mod.log_root(storage_url, name)
    trials = o.trials or spec.budget.trials
    timeout_s = o.timeout_s if o.timeout_s is not None else spec.budget.timeout_s
    trial_timeout = o.trial_timeout_s or spec.budget.trial_timeout_s

    where = f"{o.nproc} x {'GPU ' + ', '.join(g.name for g in o.gpus[:1]) if o.gpus else 'CPU (gloo)'}"
    say(f"autotune: study {name} ({'resuming, ' + str(n_before) + ' trials so far' if n_before else 'new'}) in "
        f"{study_mod.display_url(storage_url)}; {trials} trial(s) on {where}; objective {objective.kind}; "
        f"logs in {logs}/")
    for note in space.notes:
        say(f"autotune: note: {note}")
    if not util_available:
        say(f"autotune: GPU utilization unavailable ({reason}): recorded as such, not estimated")
    say("autotune: search space: " + "; ".join(f"{p.path} {p.describe()}" + (f" if {p.when.path} {p.when.op} "
                                                                           f"{p.when.value}" if p.when else "")
                                             for p in space.params))

    me = study_mod.owner()

    def run_one(trial) -> None:
        for k, v in me.items():
            trial.set_user_attr(k, v)
        heartbeat = study_mod.Heartbeat(trial)
        heartbeat.beat(force=True)
        if trial.user_attrs.get("retry_of") is not None:
            progress.say(f"autotune: trial {trial.number} re-runs the parameters of stale trial "
                         f"{trial.user_attrs['retry_of']}")
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
                                on_record=on_record, on_poll=heartbeat.beat)
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
                attrs.update(gpu_mod.summarize(samples, run.steady_windows, len(o.gpus)))
            if failure is None and (s := run.summary or {}).get("loss_finite") is False:
                failure, message = "config", f"diverged: loss NaN/inf for the last {s['loss_nonfinite_run']} steps"
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
        # Another worker may have died since: its trial's parameters are then the next to run (enqueued first).
        for line in study_mod.reclaim_stale(study, storage, stale_after_s=stale_after):
            progress.say(f"autotune: {line}")
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
        trial.set_user_attr("failure_message", (str(exc) or "interrupted (Ctrl-C)") if interrupted else
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
