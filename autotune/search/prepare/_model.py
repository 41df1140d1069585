"""The model preflight: every model a trial may build resolves (a factory is called once, on the CPU), the space's
range ends and trial 0's config are valid, and the data fills one global batch; and what is tuned, in words."""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from typing import Any

from autotune.exceptions import DataError, SpecError
from autotune.search.prepare._plan import DataSummary, Plan
from autotune.space import SearchSpace
from autotune.spec import StudySpec
from trainer.config import ConfigError, TrainConfig
from trainer.data.files import resolve_splits
from trainer.model import classification_models


def classes_of(spec: StudySpec, base: TrainConfig, data: DataSummary | None) -> int:
    """The classes the model is built for, as the job decides them (``trainer.data.num_classes``), before any run."""
    if base.data.num_classes is not None:
        return base.data.num_classes
    if data is not None:
        return data.classes
    if spec.generates_data:
        return int(spec.data.generate["classes"])
    return 1000 if base.data.kind == "synthetic" else 1


def preflight(spec: StudySpec, base: TrainConfig, space: SearchSpace, baseline: dict[str, Any], world: int, *,
              classes: int = 1000) -> None:
    """What would otherwise fail trial after trial: model names that do not resolve, a model factory that raises,
    knob range ends outside what the config accepts, a baseline config that is invalid, less data than one global
    batch. One SpecError/DataError listing every problem."""
    problems = model_problems(space, baseline, base.model.name, classes=classes, kwargs=dict(base.model.kwargs))
    for p in space.params:
        if p.kind == "categorical":
            continue  # choices were checked with the spec
        for end, value in (("low", p.low), ("high", p.high)):
            try:
                TrainConfig().with_overrides({p.path: value})
            except ConfigError as e:
                problems += [f"space.{p.path}.{end}: {x}" for x in e.problems if x.startswith(f"{p.path}=")]
    try:
        cfg = base.with_overrides(space.derive(dict(baseline), base.to_dict()))
    except ConfigError as e:
        problems += [f"baseline (trial 0): {x}" for x in e.problems]
        cfg = None
    if problems:
        raise SpecError(problems, spec.source)
    if cfg is not None and cfg.data.kind == "imagefolder" and cfg.data.path and Path(cfg.data.path).is_dir():
        n = len(resolve_splits(cfg)[0].samples)
        need = cfg.training.batch_size * world
        if n < need:
            raise DataError(f"data folder {cfg.data.path}: {n} training images, fewer than one batch of trial 0 on "
                            f"every rank ({need} = batch x {world} ranks); add images or lower the batch")


def model_problems(space: SearchSpace, baseline: dict[str, Any], base_model: str, *, classes: int = 1000,
                   kwargs: dict[str, Any] | None = None) -> list[str]:
    """Every model a trial may build must resolve: a torchvision classification model, or an importable
    ``package.module:function`` that builds a module when called as the job calls it."""
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
            problems += _factory_problems(name, where, classes, kwargs or {})
            continue
        known = known or classification_models()
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
            problems.append(f"{where}={name!r}: not a torchvision classification model ({hint}); or give a factory "
                            "as package.module:function")
    return problems


def _factory_problems(name: str, where: str, classes: int, kwargs: dict[str, Any]) -> list[str]:
    """A factory is imported and called once, on the CPU, as every trial would call it: one that raises costs
    one line now instead of every trial's budget."""
    module, _, fn = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module), fn, None)
    except Exception as e:
        return [f"{where}={name!r}: cannot import {module} ({type(e).__name__}: {e}); is it on PYTHONPATH?"]
    if not callable(obj):
        return [f"{where}={name!r}: {module} has no function {fn}"]
    import torch

    call = f"{fn}(num_classes={classes}{''.join(f', {k}={v!r}' for k, v in kwargs.items())})"
    try:
        with torch.device("cpu"):
            model = obj(num_classes=classes, **kwargs)
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return [f"{where}={name!r}: {call} raised {type(e).__name__}{': ' + text if text else ''}; fix the "
                "factory (every trial calls it so)"]
    if not isinstance(model, torch.nn.Module):
        return [f"{where}={name!r}: {call} returned {type(model).__name__}, not a torch.nn.Module"]
    return []


def describe_model(plan: Plan) -> str:
    """What is tuned: the model, the image size, and where each comes from."""
    cfg = plan.probe
    if plan.is_script:
        s = cfg.script
        found = plan.script
        applies = ", ".join(sorted(found.applies)) if found else "not known yet"
        return (f"job: the script {s.path or s.entry}{' ' + ' '.join(s.args) if s.args else ''} (its own model and "
                f"data; {'a fresh torchrun per trial' if s.path else 'trial after trial in one live worker'}), in "
                f"{found.unit if found else 'its unit'}/s; it applies: {applies}")
    source = "--model" if plan.options.model else "the spec"
    size = "--image-size" if plan.options.image_size else "the spec"
    line = (f"model {cfg.model.name} (from {source}) at {cfg.data.image_size} px (from {size}; --model and "
            "--image-size change them)")
    return f"{line}; {plan.optimizer_line}" if plan.optimizer_line else line
