"""A search's data: the folder given (``--data``, the spec's path) checked, the spec's generated data made once in
the data cache, what a folder holds, and how many images each rank can see."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from autotune.exceptions import DataError
from autotune.search.compile_cache import cache_root
from autotune.search.prepare._data_check import DataCheck
from autotune.search.prepare._images import check_images
from autotune.search.prepare._plan import DataSummary
from autotune.spec import StudySpec
from trainer.config import TrainConfig
from trainer.data.files import resolve_splits
from trainer.datagen import make_image_folder


def data_cache_root(spec: StudySpec) -> Path:
    if spec.data.cache_dir:
        return Path(spec.data.cache_dir).expanduser()
    return cache_root() / "data"


def given_data(spec: StudySpec, data_arg: str | None) -> tuple[TrainConfig | None, DataCheck | None]:
    """The base config when its data already exists (``--data``, the spec's path, synthetic), checked: the folder
    exists and holds images (``DataCheck``: its result, to be recorded once every other check passed too). None
    when the spec's data is to be generated (``generate_data``)."""
    if data_arg:
        path = Path(data_arg).expanduser().resolve()
        if path.exists() and not path.is_dir():
            raise DataError(f"--data {data_arg}: a file, not a folder; point --data at an ImageFolder (a folder "
                            "with one sub-folder of images per class)")
        if not path.is_dir():
            raise DataError(f"--data {data_arg}: no such folder; make one with `autotune make-data {data_arg} "
                            "--images 1000 --classes 10`, or point --data at an ImageFolder (one sub-folder per "
                            "class)")
        base = spec.base_config(str(path)).with_overrides({"data.kind": "imagefolder"})
        return base, check_images(base, "--data", data_cache_root(spec))
    if spec.generates_data:
        return None, None
    base = spec.base_config()
    if base.data.kind == "imagefolder":
        path = Path(base.data.path).expanduser()
        if not path.is_dir():
            what = "a file, not a folder" if path.exists() else "no such folder"
            raise DataError(f"base.data.path {path}: {what}; fix the spec or pass --data DIR")
        base = base.with_overrides({"data.path": str(path.resolve())})
        return base, check_images(base, "base.data.path", data_cache_root(spec))
    return base, None


def generate_data(spec: StudySpec, say) -> TrainConfig:
    gen = spec.data.generate
    root = data_cache_root(spec) / "imagefolder-{images}x{classes}-seed{seed}".format(
        images=gen["images"], classes=gen["classes"], seed=gen.get("seed", 0))
    say(f"autotune: data: {gen['images']} generated JPEGs in {gen['classes']} classes at {root} (made once, then "
        "reused)")
    make_image_folder(root, images=gen["images"], classes=gen["classes"], val_fraction=gen.get("val_fraction", 0.0),
                      seed=gen.get("seed", 0), progress=sys.stderr.isatty())
    return spec.base_config(str(root.resolve()))


def summarize_data(base: TrainConfig, sample: int = 32) -> DataSummary:
    """What an ImageFolder holds: counts, classes and the size of a few images (read from their headers)."""
    from PIL import Image

    train, val = resolve_splits(base)
    step = max(1, len(train.samples) // sample)
    sizes = []
    for path, _ in train.samples[::step][:sample]:
        try:
            with Image.open(path) as im:
                sizes.append(im.size)
        except OSError:
            continue
    mean = (statistics.fmean(w for w, _ in sizes), statistics.fmean(h for _, h in sizes)) if sizes else None
    return DataSummary(path=str(base.data.path), train=len(train.samples), val=len(val.samples) if val else 0,
                       classes=len(train.classes), mean_size=mean)


def images_per_rank(spec: StudySpec, data: DataSummary | None, world: int) -> int | None:
    """Training images each rank sees per epoch (the largest batch the data can fill), when known before any run."""
    if data is not None:
        return data.train // world
    gen = spec.data.generate if spec.generates_data else None
    if gen:
        val = max(1, int(gen["images"] * gen.get("val_fraction", 0.0))) if gen.get("val_fraction") else 0
        return (gen["images"] - val) // world
    return None
