"""The model: a torchvision classification model by name, or a user factory ``package.module:function``."""

from __future__ import annotations

import difflib
import importlib

import torch

from trainer.config import ConfigError, TrainConfig


def classification_models() -> list[str]:
    import torchvision.models as tvm

    return tvm.list_models(module=tvm)


def build_model(cfg: TrainConfig, num_classes: int) -> torch.nn.Module:
    name, kwargs = cfg.model.name, dict(cfg.model.kwargs)
    if ":" in name:
        return _from_factory(name, num_classes, kwargs)
    import torchvision.models as tvm

    known = classification_models()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
        raise ConfigError([f"model.name={name!r} is not a torchvision classification model ({hint}); "
                           "or give a factory as package.module:function"])
    # weights=None: trials measure speed, and these machines reach no model hub.
    return tvm.get_model(name, weights=None, num_classes=num_classes, **kwargs)


def _from_factory(spec: str, num_classes: int, kwargs: dict) -> torch.nn.Module:
    module_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError([f"model.name={spec!r}: cannot import {module_name} ({e}); is it on PYTHONPATH?"]) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError([f"model.name={spec!r}: {module_name} has no callable {fn_name}"])
    model = fn(num_classes=num_classes, **kwargs)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError([f"model.name={spec!r} returned {type(model).__name__}, not a torch.nn.Module"])
    return model
