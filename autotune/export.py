"""``autotune export``: a study's chosen trial → a TrainConfig YAML that ``autotune train`` and ``python -m trainer``
accept.

The file is the trial's full TrainConfig (top-level keys as in any job YAML) with the spec's ``export`` overrides
applied (a train run instead of a measurement), plus one ``autotune:`` section the job ignores::

    autotune:
      study: resnet50            # where it came from
      trial: 17
      torchrun: {nproc_per_node: 2, args: [], command: "torchrun --standalone --nproc-per-node 2 -m trainer ..."}
      env: {NCCL_ALGO: Ring, OMP_NUM_THREADS: '16', NCCL_NVLS_ENABLE: '0', ...}
      fingerprint: {gpu_model: ..., gpu_count: 2, driver: ..., torch: ..., cuda: ..., nccl: ..., cpu_count: 32}
      measured: {imgs_per_s: 7146.0, spread: 0.012, util_mean: 91.0, baseline_imgs_per_s: 1681.0, gain: 4.25}
      lr_scaling: {rule: linear, from_lr: 0.1, from_global_batch: 256, to_lr: 0.4, to_global_batch: 1024}

Learning rate: when the trial's global batch (micro-batch x accum x world) differs from the reference the spec's
learning rate was set for, the rate is scaled linearly (Goyal et al., 2017) and a warning says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.exceptions import StorageError
from autotune.launch import nnodes_of

PICKS = ("best", "fastest", "util", "balanced")


def feasible(study) -> list:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("constraint", 0.0) <= 0 and "config" in t.user_attrs
            and t.user_attrs.get("imgs_per_s") is not None]


def pareto_front(trials: list) -> list:
    """Trials no other trial beats on both imgs/s and utilization."""
    def key(t):
        return float(t.user_attrs["imgs_per_s"]), float(t.user_attrs.get("util_mean") or 0.0)

    return [t for t in trials if not any(key(o)[0] >= key(t)[0] and key(o)[1] >= key(t)[1] and key(o) != key(t)
                                         for o in trials)]


def pick_trial(study, pick: str = "best"):
    """``best``: the objective's best (pareto: the fastest on the front); ``fastest``: max imgs/s; ``util``: max
    utilization on the front; ``balanced``: the front's best product of normalized imgs/s and util; or a trial
    number."""
    ok = feasible(study)
    if pick.isdigit():
        number = int(pick)
        match = [t for t in study.get_trials(deepcopy=False) if t.number == number]
        if not match:
            raise StorageError(f"--pick {pick}: study {study.study_name} has no trial {number}")
        if match[0] not in ok:
            t = match[0]
            why = t.user_attrs.get("failure_class") or t.state.name.lower()
            raise StorageError(f"--pick {pick}: trial {number} did not complete a measurement ({why}); "
                               "pick a completed trial (`autotune show`)")
        return match[0]
    if pick not in PICKS:
        raise StorageError(f"--pick {pick}: use one of {', '.join(PICKS)} or a trial number")
    if not ok:
        raise StorageError(f"study {study.study_name} has no completed, feasible trial yet; run `autotune search`")
    ips = lambda t: float(t.user_attrs["imgs_per_s"])  # noqa: E731
    util = lambda t: float(t.user_attrs.get("util_mean") or 0.0)  # noqa: E731
    multi = len(study.directions) > 1
    if pick == "fastest" or (pick == "best" and multi):
        return max(ok, key=ips)
    if pick == "best":
        return max(ok, key=lambda t: t.value)
    if not any(t.user_attrs.get("util_mean") is not None for t in ok):
        raise StorageError(f"--pick {pick}: no trial of this study recorded GPU utilization; use best or fastest")
    front = pareto_front(ok)
    if pick == "util":
        return max(front, key=lambda t: (util(t), ips(t)))
    top_ips, top_util = max(map(ips, front)), max(map(util, front)) or 1.0
    return max(front, key=lambda t: (ips(t) / top_ips) * (util(t) / top_util))


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


def build(study, trial) -> tuple[dict[str, Any], list[str]]:
    """(the YAML mapping, warnings) for ``trial`` of ``study``."""
    from trainer.config import TrainConfig

    warnings: list[str] = []
    spec = study.user_attrs.get("spec") or {}
    a = trial.user_attrs
    cfg = TrainConfig.from_dict(a["config"])
    export_overrides = dict(spec.get("export") or {})
    name = f"{study.study_name}-best" if trial.number != 0 else f"{study.study_name}-baseline"
    cfg = cfg.with_overrides({**export_overrides, "name": name, "output_dir": f"runs/{name}"})
    data = cfg.to_dict()
    nproc = int(study.user_attrs.get("nproc_per_node") or 1)
    torchrun_args = list(study.user_attrs.get("torchrun_args") or [])
    world = nproc * nnodes_of(torchrun_args)
    lr_record, warn = scale_lr(data, reference_batch=study.user_attrs.get("reference_global_batch"), world=world)
    if warn:
        warnings.append(warn)
    TrainConfig.from_dict(data)  # still valid after scaling

    baseline = next((t for t in feasible(study) if t.user_attrs.get("baseline")), None)
    ips = float(a["imgs_per_s"])
    measured = {k: a.get(k) for k in ("imgs_per_s", "imgs_per_s_windows", "spread", "util_mean", "util_p50_per_gpu",
                                      "mem_used_max_mib", "power_mean_w", "sm_clock_mean_mhz", "sm_active_mean",
                                      "peak_mem_bytes", "launch_s", "measure_s") if a.get(k) is not None}
    measured["util_available"] = bool(a.get("util_available"))
    if baseline is not None:
        b = float(baseline.user_attrs["imgs_per_s"])
        measured["baseline_trial"] = baseline.number
        measured["baseline_imgs_per_s"] = b
        measured["gain"] = round(ips / b, 3) if b > 0 else None
    versions = a.get("versions") or {}
    fingerprint = {**(study.user_attrs.get("fingerprint") or {}),
                   **{k: versions.get(k) for k in ("torch", "torchvision", "cuda", "cudnn", "nccl") if k in versions}}
    multi_node = any(x.split("=")[0] in ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint") for x in torchrun_args)
    command = " ".join(["torchrun", *([] if multi_node else ["--standalone"]), "--nproc-per-node", str(nproc),
                        *torchrun_args, "-m", "trainer", "--config", "<this file>"])
    env = dict(a.get("env") or {})
    data["autotune"] = {
        "study": study.study_name,
        "trial": trial.number,
        "params": dict(trial.params),
        "objective": study.user_attrs.get("objective"),
        "torchrun": {"nproc_per_node": nproc, "args": torchrun_args, "command": command},
        "env": env,
        "fingerprint": fingerprint,
        "measured": measured,
    }
    if lr_record:
        data["autotune"]["lr_scaling"] = lr_record
    return data, warnings


def write(data: dict[str, Any], path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    a = data["autotune"]
    head = (f"# Exported by `autotune export` from study {a['study']}, trial {a['trial']}: "
            f"{a['measured'].get('imgs_per_s', 0):,.1f} imgs/s"
            + (f" ({a['measured']['gain']:.2f}x trial {a['measured']['baseline_trial']})"
               if a["measured"].get("gain") else "")
            + f".\n# Run: {a['torchrun']['command'].replace('<this file>', str(path))}\n"
              "# (or `autotune train --config " + str(path) + "`; the `autotune:` section is ignored by the job)\n")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(head + yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
    return path
