"""Which spec a search runs and what the command line changes in it: the spec (a built-in one by the machine when
none is named), ``--model``/``--image-size``/``--optimizer``/``--lr`` merged into its base, the study's name, and the
trials' GPUs and ranks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from autotune.hw.placement import parse_gpu_list, place
from autotune.search.prepare._options import SearchOptions
from autotune.spec import StudySpec, load_spec
from trainer.config import TrainConfig
from trainer.learning import DEFAULT_LR, recipe_for


def choose_spec(o: SearchOptions, n_visible: int, say) -> str:
    if o.spec:
        return o.spec
    name = "resnet50" if n_visible else "cpu-demo"
    where = f"{n_visible} GPU(s) visible" if n_visible else "no GPU visible"
    if o.model or o.data:
        what = " on ".join(x for x in (o.model, o.data) if x)
        say(f"autotune: {where}: tuning {what} with the built-in {name} study's settings ("
            + ("every visible GPU" if n_visible else "2 gloo ranks on the CPU")
            + ", its search space and budget); --spec picks another")
    elif n_visible:
        say(f"autotune: {where}: running the built-in resnet50 study (ResNet-50, generated ImageNet-like JPEGs) on "
            "them; --spec picks another")
    else:
        say(f"autotune: {where}: running the built-in cpu-demo study (2 gloo ranks, small model and images); on a "
            "GPU machine the same command tunes ResNet-50")
    return name


def with_command_line(spec: StudySpec, o: SearchOptions) -> tuple[StudySpec, str]:
    """The spec with ``--model``, ``--image-size``, ``--optimizer`` and ``--lr`` in its base (checked as any spec
    is), and which optimizer the trials run, in words."""
    section, why = optimizer_section(spec, o)
    if o.model is None and o.image_size is None and section is None:
        return spec, why
    data = spec.to_dict()
    base = data["base"]
    if o.model is not None:
        base["model"] = {"name": o.model}
    if o.image_size is not None:
        base.setdefault("data", {})["image_size"] = o.image_size
    if section is not None:
        base["optimizer"] = section
    data["name"] = spec.name
    flags = [f for f, v in (("--model", o.model), ("--image-size", o.image_size), ("--optimizer", o.optimizer),
                            ("--lr", o.lr)) if v is not None]
    return StudySpec.from_dict(data, source=f"{spec.source} with {'/'.join(flags) or 'its model family recipe'}"), why


def optimizer_section(spec: StudySpec, o: SearchOptions) -> tuple[dict[str, Any] | None, str]:
    """The base's ``optimizer`` section for this search (None: the spec's, unchanged) and where it comes from.

    ``--optimizer``/``--lr`` win. Otherwise a model named on the command line, or a spec that sets no optimizer,
    gets its family's recipe (``trainer.learning.RECIPES``) where it has one: a spec's optimizer was chosen for the
    spec's own model, and the job's default (SGD at 0.1) does not train every family (a transformer's loss diverges
    with it)."""
    base_opt = dict(spec.base.get("optimizer") or {}) if isinstance(spec.base.get("optimizer"), dict) else {}
    model = o.model or ((spec.base.get("model") or {}).get("name") if isinstance(spec.base.get("model"), dict)
                        else None) or TrainConfig().model.name
    recipe = recipe_for(model)
    if recipe is not None and o.model is None and base_opt:
        recipe = None  # the spec chose this model's optimizer itself
    change = "--optimizer / --lr set another"
    if o.optimizer is not None or o.lr is not None:
        name = (o.optimizer or (recipe.optimizer["name"] if recipe else None) or base_opt.get("name")
                or TrainConfig().optimizer.name)
        section = {**base_opt, "name": name}
        if recipe is not None and recipe.optimizer["name"] == name:
            section.update(recipe.optimizer)  # its weight decay (and reference batch, unless --lr names the lr)
        elif name != base_opt.get("name", TrainConfig().optimizer.name):
            section.pop("weight_decay", None)  # another optimizer's weight decay means something else
        if o.lr is not None:
            # The lr trial 0 runs at: export rescales it from trial 0's global batch.
            section["lr"], section["reference_global_batch"] = o.lr, None
        elif recipe is None or recipe.optimizer["name"] != name:
            # (a name the job does not know gets any lr: the spec's check refuses the name itself)
            section["lr"], section["reference_global_batch"] = DEFAULT_LR.get(name, 0.1), None
        flags = " and ".join(f for f, v in (("--optimizer", o.optimizer), ("--lr", o.lr)) if v is not None)
        return section, f"optimizer {name} lr {section['lr']:g} (from {flags})"
    if recipe is not None:
        return dict(recipe.optimizer), f"optimizer {recipe.describe()}, the {recipe.family} recipe ({change})"
    cfg = spec.base_config("<generated>" if spec.generates_data else None).optimizer
    whose = "the spec's" if base_opt else "the default"
    return None, f"optimizer {cfg.name} lr {cfg.lr:g} ({whose}; {change})"


def study_name(spec: StudySpec, o: SearchOptions) -> str:
    """The spec's name, with the model and data folder given on the command line: another model or data is another
    study (its trials would not compare with the spec's)."""
    parts = [spec.name]
    if o.model:
        # A factory by its module too: mypkg.resnets:build and mypkg.vits:build are other models.
        parts.append(o.model.replace(":", "."))
    if o.data:
        parts.append(Path(o.data).expanduser().resolve().name)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(parts)).strip("-.") or spec.name


def placement(o: SearchOptions, spec: StudySpec, visible: list[str]) -> tuple[list[str] | None, int]:
    """(the trials' GPU entries or None without GPUs, ranks per node)."""
    nproc, entries = place(visible, parse_gpu_list(o.gpus), o.nproc if o.nproc is not None
                           else spec.world.nproc_per_node)
    return entries, nproc


def job_spec(o: SearchOptions, visible: list[str], say) -> tuple[StudySpec, str]:
    """The spec the trials run (a user's script's, or the chosen spec with the command line's changes) and which
    optimizer they run, in words (empty for a script: it builds its own)."""
    if o.script:
        from autotune.search.script import check, script_spec

        check(o.script)
        return script_spec(o.script, o.script_args, o.study, gpu=bool(visible), spec=o.spec), ""
    return with_command_line(load_spec(choose_spec(o, len(visible), say)), o)
