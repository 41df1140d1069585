"""Study specs for tests: a tiny CPU study (2 gloo ranks, a small conv net, synthetic data, 0.3 s windows) whose
trials take ~6 s on 2 cores, changed setting by setting."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

TINY: dict[str, Any] = {
    "name": "tiny",
    "base": {
        "model": {"name": "tests.helpers.models:tiny"},
        "data": {"kind": "synthetic", "image_size": 32, "num_classes": 4},
        "loader": {"num_workers": 0},
        "training": {"batch_size": 8},
        "ddp": {"timeout_s": 30},
        "measure": {"warmup_min_steps": 2, "window_s": 0.3, "precision": 0.05, "max_s": 0.9},
    },
    "world": {"nproc_per_node": 2},
    "default_space": False,
    "space": {"training.batch_size": {"choices": [4, 8, 16]}, "ddp.bucket_cap_mb": {"low": 5, "high": 50}},
    "baseline": {"training.batch_size": 8, "ddp.bucket_cap_mb": 25},
    "budget": {"trials": 2, "trial_timeout_s": 30},
    "sampler": {"seed": 0},
    "pruner": {"kind": "none"},
    "stages": {"enabled": False},  # the machinery under test is the search's; the stages have tests of their own
}


def tiny_spec(folder: Path, name: str = "tiny", **changes: Any) -> Path:
    """Write the tiny spec with ``changes`` (``"base.loader.num_workers": 1``; ``None`` deletes a key) to
    ``folder/NAME.yaml``; returns its path."""
    spec = copy.deepcopy(TINY)
    spec["name"] = name
    for dotted, value in changes.items():
        section, _, rest = dotted.partition(".")
        # space and baseline are keyed by dotted TrainConfig paths themselves
        *parents, leaf = [section, rest] if section in ("space", "baseline", "export") else dotted.split(".")
        node = spec
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path = Path(folder) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
