"""``autotune export``: a study's chosen trial → a TrainConfig YAML that ``autotune train`` and ``python -m trainer``
accept, re-measured in a fresh process so that the figure it carries is one a fresh job reaches.

The file is the trial's full TrainConfig (top-level keys as in any job YAML) with the spec's ``export`` overrides
applied (a train run instead of a measurement) — for a user's script, only what its run reads (the settings it
applies, the mode, the measurement, the script: ``script_only``) — plus one ``autotune:`` section the job ignores::

    autotune:
      study: resnet50            # where it came from
      trial: 17
      torchrun: {nproc_per_node: 2, args: [], command: "torchrun --standalone --nproc-per-node 2 -m trainer ..."}
      env: {OMP_NUM_THREADS: '16', NCCL_NVLS_ENABLE: '0', ...}
      fingerprint: {gpu_model: ..., gpu_count: 2, driver: ..., torch: ..., cuda: ..., nccl: ..., cpu_count: 32}
      measured: {imgs_per_s: 7146.0, ci_half_width: 0.012, util_mean: 91.0, baseline_imgs_per_s: 1681.0,
                 gain: 4.25, gain_half_width: 0.021,
                 runs: [[17, 7180.2, 0.011], [23, 7111.8, 0.014]],  # run twice by the search: their runs combined
                 remeasured: {imgs_per_s: 7101.3, ci_half_width: 0.009, ratio: 0.994, agrees: true,
                              fresh_process: true}}
      lr_scaling: {rule: linear, from_lr: 0.1, from_global_batch: 256, to_lr: 0.4, to_global_batch: 1024}

Learning rate: when the trial's global batch (micro-batch x accum x world) differs from the reference the spec's
learning rate was set for, the rate is scaled linearly (Goyal et al., 2017) and a warning says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from autotune.exceptions import StorageError
from autotune.formatting import fmt_interval, fmt_ratio
from autotune.hw.nvml import Nvml
from autotune.hw.placement import gpu_count, to_nvml, visible_entries
from autotune.outputs import write_atomic
from autotune.policy import policy
from autotune.ranges import Condition
from autotune.runner.torchrun import Torchrun
from autotune.runner.trial import TrialJob, run_trial
from autotune.space import get_path
from autotune.study import view
from autotune.study.storage import record_on_study, study_record
from autotune.study.view import TrialView
from autotune.verdict import judge
from trainer.config import TrainConfig
from trainer.estimate import Interval
from trainer.knobs import table
from trainer.runtime.request import ENV_CONFIG, ENV_REQUEST

PICKS = ("best", "fastest", "util", "balanced")

GAP_WARNING = 0.03
"""A fresh-process re-measure whose interval does not overlap the search's figure's, and that lies further than this
from it, is reported."""

REMEASURED_KEY = "autotune:remeasured:"
"""A study system attr per re-measured trial (``REMEASURED_KEY + number``): what ``autotune export`` measured for it
in a fresh process, for ``autotune show`` and the report."""


def pareto_front(trials: list[TrialView]) -> list[TrialView]:
    """Trials no other trial beats on both imgs/s and utilization."""
    def key(v):
        return v.imgs_per_s, v.util or 0.0

    return [v for v in trials if not any(key(o)[0] >= key(v)[0] and key(o)[1] >= key(v)[1] and key(o) != key(v)
                                         for o in trials)]


def pick_trial(study, pick: str = "best") -> TrialView:
    """``best``: the objective's best (pareto: the fastest on the front); ``fastest``: max imgs/s; ``util``: max
    utilization on the front; ``balanced``: the front's best product of normalized imgs/s and util; or a trial
    number. A configuration run more than once is picked by its runs combined (``view.configurations``)."""
    trials = view.views(study)
    ok = view.configurations(trials)
    if pick.isdigit():
        match = [v for v in trials if v.number == int(pick) and not v.part]
        if not match:
            raise StorageError(f"--pick {pick}: study {study.study_name} has no trial {pick}")
        if not match[0].feasible or not match[0].end_to_end:
            why = match[0].failure_class or (f"a {match[0].stage} measurement, not a training configuration"
                                             if not match[0].end_to_end else match[0].state.name.lower())
            raise StorageError(f"--pick {pick}: trial {pick} is not a complete end-to-end measurement ({why}); "
                               "pick one that is (`autotune show`)")
        return next((a for a in ok if a.number == match[0].number), match[0])
    if pick not in PICKS:
        raise StorageError(f"--pick {pick}: use one of {', '.join(PICKS)} or a trial number")
    if not ok:
        raise StorageError(f"study {study.study_name} has no complete, feasible end-to-end trial yet; run "
                           "`autotune search` (more trials)")
    multi = len(study.directions) > 1
    if pick == "fastest" or (pick == "best" and multi):
        return max(ok, key=lambda v: v.imgs_per_s)
    if pick == "best":
        return max(ok, key=lambda v: v.value)
    if not any(v.util is not None for v in ok):
        raise StorageError(f"--pick {pick}: no trial of this study recorded GPU utilization; use best or fastest")
    front = pareto_front(ok)
    if pick == "util":
        return max(front, key=lambda v: (v.util or 0.0, v.imgs_per_s))
    top_ips, top_util = max(v.imgs_per_s for v in front), max(v.util or 0.0 for v in front) or 1.0
    return max(front, key=lambda v: (v.imgs_per_s / top_ips) * ((v.util or 0.0) / top_util))


def scale_lr(config: dict[str, Any], *, reference_batch: int | None, world: int) -> tuple[dict | None, str | None]:
    """Linear LR scaling to the trial's global batch; returns (record, warning) — both None when unchanged."""
    t, opt = config["training"], config["optimizer"]
    ref = opt.get("reference_global_batch") or reference_batch
    g = int(t["batch_size"]) * int(t["accum_steps"]) * world
    if not ref or ref == g:
        return None, None
    lr = float(opt["lr"])
    new = lr * g / ref
    opt["lr"], opt["reference_global_batch"] = new, g
    record = {"rule": "linear", "from_lr": lr, "from_global_batch": ref, "to_lr": new, "to_global_batch": g}
    warn = (f"global batch {g} differs from the reference {ref} the learning rate was set for: lr scaled linearly "
            f"{lr:g} -> {new:g}")
    if g / ref > 2 and not opt.get("warmup_epochs"):
        warn += " (a large increase; consider optimizer.warmup_epochs: 5)"
    return record, warn


MEASURED_KEYS = ("imgs_per_s", "ci_low", "ci_high", "ci_half_width", "precise", "imgs_per_s_windows", "loss_start",
                 "loss_end", "util_mean",
                 "util_p50_per_gpu", "mem_used_max_mib", "power_mean_w", "sm_clock_mean_mhz", "sm_active_mean",
                 "peak_mem_bytes", "launch_s", "measure_s", "worker", view.RUNS)


def build(study, trial: TrialView) -> tuple[dict[str, Any], list[str]]:
    """(the YAML mapping, warnings) for ``trial`` of ``study``."""
    warnings: list[str] = []
    spec = study_record(study, "autotune:spec", {})
    name = f"{study.study_name}-{'baseline' if trial.baseline else 'best'}"
    cfg = TrainConfig.from_dict(trial.config).with_overrides({**dict(spec.get("export") or {}), "name": name,
                                                              "output_dir": f"runs/{name}"})
    if not cfg.script.given:  # a script's trials charge its epoch turns: what they measured stands
        changes, said = for_a_full_run(cfg)
        cfg = cfg.with_overrides(changes)
        warnings += said
    data = cfg.to_dict()
    nproc = int(study.user_attrs.get("nproc_per_node") or 1)
    torchrun = Torchrun.parse(list(study.user_attrs.get("torchrun_args") or []))
    if cfg.script.given:  # the script owns its optimizer: its learning rate is its own to scale
        lr_record, warn = None, script_batch_note(cfg, reference=study.user_attrs.get("reference_global_batch"),
                                                  world=nproc * torchrun.nnodes)
        data = script_only(data, cfg)
    else:
        lr_record, warn = scale_lr(data, reference_batch=study.user_attrs.get("reference_global_batch"),
                                   world=nproc * torchrun.nnodes)
    if warn:
        warnings.append(warn)
    TrainConfig.from_dict(data)  # still valid after scaling

    a = trial.attrs
    measured = {k: a[k] for k in MEASURED_KEYS if a.get(k) is not None}
    measured["util_available"] = bool(a.get("util_available"))
    measured["per"] = view.rate(study)
    base = view.baseline(view.views(study))
    if base is not None and base.imgs_per_s:
        gain = trial.interval.over(base.interval)
        measured.update(baseline_trial=base.number, baseline_imgs_per_s=base.imgs_per_s,
                        baseline_half_width=base.half_width, gain=round(gain.value, 3),
                        gain_half_width=round(gain.half_width, 4) if gain.known else None)
    versions = a.get("versions") or {}
    fingerprint = {**(study.user_attrs.get("fingerprint") or {}),
                   **{k: versions.get(k) for k in ("torch", "torchvision", "cuda", "cudnn", "nccl") if k in versions}}
    data["autotune"] = {
        "study": study.study_name, "trial": trial.number, "params": dict(trial.params),
        "objective": study.user_attrs.get("objective"),
        "torchrun": {"nproc_per_node": nproc, "args": list(torchrun.args),
                     "command": run_command(cfg, torchrun, nproc, "<this file>")},
        "env": {k: v for k, v in (a.get("env") or {}).items() if k not in TRIAL_ENV}, "fingerprint": fingerprint,
        "measured": measured,
    }
    if lr_record:
        data["autotune"]["lr_scaling"] = lr_record
    return data, warnings


def for_a_full_run(cfg: TrainConfig) -> tuple[dict[str, Any], list[str]]:
    """The built-in job's settings its trials cannot observe, at what a run of many epochs wants
    (``autotune.policy.Policy.full_run``) where their range's condition holds: (the overrides, a line for each)."""
    data, changes, said = cfg.to_dict(), {}, []
    for k in table().entries:
        full_run = policy(k.path).full_run
        if full_run is None or k.space is None:
            continue
        value, why = full_run
        when = Condition.parse(k.space.when) if k.space.when else None
        if get_path(data, k.path) == value or (when is not None and not when.holds(get_path(data, when.path))):
            continue
        changes[k.path] = value
        said.append(f"{k.path}: {json.dumps(value)} for the full run ({why})")
    return changes, said


TRIAL_ENV = (ENV_REQUEST, ENV_CONFIG)
"""Variables of the trial's own run (its request file, in its trial folder): a run of the export makes its own."""

SCRIPT_TRAINING = ("mode", "log_every_s")
"""Of ``training``, what a script's run reads besides the settings it applies (``trainer.runtime.request``)."""


def script_only(data: dict[str, Any], cfg: TrainConfig) -> dict[str, Any]:
    """A script's config as its run reads it: the settings it applies, the run's mode and measurement, the script.
    The script builds its own model, optimizer and data: the built-in job's defaults for them (resnet50, SGD at 0.1,
    224 px) would be read as its own."""
    out: dict[str, Any] = {"name": data["name"], "output_dir": data["output_dir"], "data": {"kind": "script"},
                           "training": {k: data["training"][k] for k in SCRIPT_TRAINING}}
    names = table().by_runtime_name
    for name in cfg.script.applies:
        *parents, leaf = names[name].path.split(".")
        src, dst = data, out
        for part in parents:
            src, dst = src[part], dst.setdefault(part, {})
        dst[leaf] = src[leaf]
    out["measure"], out["script"] = data["measure"], data["script"]
    return out


def run_command(cfg: TrainConfig, torchrun: Torchrun, nproc: int, config: str) -> str:
    """The command that runs the exported config by hand: the built-in job (and a user's training function, which
    the trainer calls) reads it as its config; a user's script runs as itself, its runtime reading the file from
    ``AUTOTUNE_CONFIG``."""
    if cfg.script.path:
        return f"{ENV_CONFIG}={config} " + torchrun.command(nproc, [cfg.script.path, *cfg.script.args])
    return torchrun.command(nproc, ["-m", "trainer", "--config", config])


def script_batch_note(cfg: TrainConfig, *, reference: int | None, world: int) -> str | None:
    g = cfg.training.batch_size * cfg.training.accum_steps * world
    if "batch_size" not in cfg.script.applies or not reference or reference == g:
        return None
    return (f"global batch {g} differs from the script's own {reference}: the script's learning rate is not "
            f"scaled (it owns its optimizer); the usual rule scales it by {g / reference:g}")


def write(data: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    a, m = data["autotune"], data["autotune"]["measured"]
    again = m.get("remeasured") or {}
    head = (f"# Exported by `autotune export` from study {a['study']}, trial {a['trial']}: "
            f"{fmt_interval(m.get('imgs_per_s', 0), m.get('ci_half_width'), m.get('per', 'imgs/s'))}"
            + (f" ({fmt_ratio(Interval(m['gain'], m.get('gain_half_width') or math.inf))} trial {m['baseline_trial']})"
               if m.get("gain") else "")
            + (f"; re-measured in a fresh process: {fmt_interval(again['imgs_per_s'], again.get('ci_half_width'))}"
               if again.get("imgs_per_s") else "")
            + f".\n# Run: {a['torchrun']['command'].replace('<this file>', str(path))}\n"
              "# (or `autotune train --config " + str(path) + "`; the `autotune:` section is ignored by the job)\n")
    write_atomic(path, head + yaml.safe_dump(data, sort_keys=False))
    return path


# ---- the honesty check ------------------------------------------------------------------------------------------


def remeasure(study, trial: TrialView, data: dict[str, Any], folder: Path, *, timeout_s: float = 600.0) -> str:
    """Measure the trial's configuration again in a fresh process on this machine, as the search measured it (same
    data, world and settings), and record both figures in ``data``. Returns the line to print: the two figures, and
    a warning when they differ by more than their intervals and ``GAP_WARNING`` allow, or why it could not run
    here."""
    nproc = data["autotune"]["torchrun"]["nproc_per_node"]
    fp = study.user_attrs.get("fingerprint") or {}
    nvml = Nvml()
    visible = visible_entries(gpu_count(nvml))
    gpus = to_nvml(nvml, visible[:nproc]) if visible else []
    why_not = _not_here(fp, gpus, nproc, trial.config)
    if why_not:
        return f"not re-measured: {why_not} (`--no-remeasure` skips this check)"
    cfg = TrainConfig.from_dict(trial.config).with_overrides({"output_dir": str(folder)})
    job = TrialJob(config=cfg, trial_dir=folder, nproc_per_node=nproc,
                   gpus=[g.uuid for g in gpus] if gpus else (visible[:nproc] or None),
                   torchrun_args=list(data["autotune"]["torchrun"]["args"]), timeout_s=timeout_s)
    run = run_trial(job)
    v = judge(run)
    if not v.ok:
        data["autotune"]["measured"]["remeasured"] = {"failed": str(v.failure), "why": v.reason}
        return f"re-measure FAILED in a fresh process ({v.failure}: {v.reason}); log {run.log_path}"
    return record_remeasure(study, trial, data, run.summary)


def record_remeasure(study, trial: TrialView, data: dict[str, Any], s: dict[str, Any]) -> str:
    """A fresh-process measurement of ``trial`` (``s``: its job's summary) recorded in ``data`` and with the study,
    judged against the search's figure and its interval, and set against trial 0's; returns the line to print."""
    per = view.rate(study)
    fresh = Interval(float(s["imgs_per_s"]), float(s.get("ci_half_width") or math.inf))  # none: too few windows
    searched = trial.interval
    ratio = fresh.value / searched.value
    # The same configuration measured twice agrees where the intervals overlap, or where the two lie within the gap
    # a fresh process is allowed (its own noise the intervals of one process do not hold).
    agrees = fresh.a_tie(searched) or abs(ratio - 1) <= GAP_WARNING
    again = {"imgs_per_s": fresh.value, "ci_half_width": s.get("ci_half_width"), "precise": s.get("precise"),
             "ratio": round(ratio, 4), "agrees": agrees, "loss_start": s.get("loss_start"),
             "loss_end": s.get("loss_end"), "fresh_process": True, "search_worker": trial.attrs.get("worker")}
    base = view.baseline(view.views(study))
    if base is not None and base.number != trial.number and fresh.below(base.interval):
        # Trial 0 ran in a fresh process as well: this is the one comparison of like with like.
        again["below_baseline"] = {"trial": base.number, "imgs_per_s": base.imgs_per_s,
                                   "ci_half_width": base.half_width}
    data["autotune"]["measured"]["remeasured"] = again
    line = (f"re-measured in a fresh process: {fmt_interval(fresh.value, fresh.half_width, per)} = {ratio:.1%} of "
            f"the search's {fmt_interval(searched.value, searched.half_width)}{view.describe_runs(trial, per)}")
    if fresh.a_tie(searched):
        line += ": their intervals overlap"
    elif agrees:
        line += f": within {GAP_WARNING:.0%} of it"
    elif not (fresh.known and searched.known):
        line += (f" — WARNING: they lie more than {GAP_WARNING:.0%} apart, and a figure without an interval (too few "
                 "windows) cannot say whether that is noise: export again to measure it once more")
    else:
        line += (f" — WARNING: their intervals do not overlap and they lie more than {GAP_WARNING:.0%} apart; the "
                 "search's figure for this config is not what a fresh job reaches here (another load on the machine, "
                 "or a trial that profited from an earlier one in its worker): trust the re-measure")
    try:
        record_on_study(study, f"{REMEASURED_KEY}{trial.number}", {
            k: again.get(k) for k in ("imgs_per_s", "ci_half_width", "ratio", "agrees", "below_baseline")})
    except Exception as e:  # a read-only storage: the YAML still carries both figures
        line += f" (not recorded in the study: {type(e).__name__})"
    return line


def below_baseline_warning(trial: TrialView, data: dict[str, Any]) -> str | None:
    """The warning for a trial whose fresh-process figure is below trial 0's (None when it is not)."""
    again = data["autotune"]["measured"].get("remeasured") or {}
    below = again.get("below_baseline")
    if not below:
        return None
    per = data["autotune"]["measured"].get("per", "imgs/s")
    return (f"trial {trial.number} re-measured at {fmt_interval(again['imgs_per_s'], again.get('ci_half_width'), per)}"
            f" in a fresh process, measurably below trial {below['trial']} (the baseline, "
            f"{fmt_interval(below['imgs_per_s'], below.get('ci_half_width'))}): here the tuned configuration is "
            f"not faster than the baseline; export the baseline with `--pick {below['trial']}`, or search again on a "
            "quieter machine")


def remeasures(study) -> dict[int, dict[str, Any]]:
    """What ``autotune export`` re-measured in a fresh process, by trial number."""
    attrs = study._storage.get_study_system_attrs(study._study_id)
    return {int(k[len(REMEASURED_KEY):]): v for k, v in attrs.items()
            if k.startswith(REMEASURED_KEY) and k[len(REMEASURED_KEY):].isdigit() and isinstance(v, dict)}


def _not_here(fp: dict[str, Any], gpus: list, nproc: int, config: dict[str, Any]) -> str | None:
    """Why the trial cannot be measured again on this machine (None: it can)."""
    if fp.get("gpu_count"):
        if len(gpus) < nproc:
            return f"the study ran on {fp['gpu_count']} x {fp.get('gpu_model')}, this machine has {len(gpus)} GPU(s)"
        if fp.get("gpu_model") and gpus[0].name != fp["gpu_model"]:
            return f"the study ran on {fp['gpu_model']}, this machine has {gpus[0].name}"
    elif gpus:
        return "the study ran on the CPU, this machine has GPUs"
    path = (config.get("data") or {}).get("path")
    if (config.get("data") or {}).get("kind") == "imagefolder" and path and not Path(path).is_dir():
        return f"its data folder {path} is not on this machine"
    return None
