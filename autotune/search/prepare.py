"""Everything a search decides before it touches the study: the spec (or a model and a data folder given on the
command line), the GPUs and ranks, the data, the search space for this machine and this data, trial 0, and every
check that would otherwise fail trial after trial. A mistake costs one line and leaves no trace in any study."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.exceptions import AutotuneError, DataError, SpecError, StorageError
from autotune.hw.nvml import Gpu, Nvml
from autotune.hw.placement import gpu_count, parse_gpu_list, place, to_nvml, visible_entries
from autotune.objective import Objective
from autotune.runner.torchrun import Torchrun
from autotune.space import SearchSpace, resolve
from autotune.spec import StudySpec, load_spec
from autotune.study.liveness import HEARTBEAT_S
from autotune.study.storage import default_storage, missing_folder, writable_problem
from trainer.config import ConfigError, TrainConfig
from trainer.data.files import resolve_splits
from trainer.datagen import make_image_folder
from trainer.learning import DEFAULT_LR, recipe_for
from trainer.model import classification_models


@dataclass(kw_only=True)
class SearchOptions:
    """``autotune search``'s options; every field ``None`` means: the spec's (or the machine's) default."""

    spec: str | None = None
    """A spec YAML path or a built-in name; default: resnet50 when GPUs are visible, else cpu-demo."""

    model: str | None = None
    """Tune this model instead of the spec's: a torchvision classifier name or ``package.module:factory``."""

    data: str | None = None
    """Use this ImageFolder instead of the spec's data."""

    image_size: int | None = None
    optimizer: str | None = None
    """``sgd`` or ``adamw`` instead of the spec's (or the model family's recipe, ``trainer.learning.RECIPES``)."""

    lr: float | None = None
    """The learning rate every trial runs at (for trial 0's global batch; export rescales it to the tuned one)."""

    trials: int | None = None
    timeout_s: float | None = None
    trial_timeout_s: float | None = None
    storage: str | None = None
    study: str | None = None
    nproc: int | None = None
    gpus: str | None = None
    objective: str | None = None
    seed: int | None = None
    stale_after_s: float | None = None
    script: str | None = None
    """Tune this training script instead of the built-in job: ``train.py`` (a fresh torchrun per trial) or
    ``train.py:main`` / ``package.module:main`` (a function, trial after trial in one live worker)."""

    script_args: list[str] = field(default_factory=list)
    """The script's own command-line arguments."""


@dataclass(kw_only=True)
class DataSummary:
    path: str
    train: int
    val: int
    classes: int
    mean_size: tuple[float, float] | None = None
    """Mean width x height of a sample of the training images."""

    def line(self) -> str:
        size = f", about {self.mean_size[0]:.0f}x{self.mean_size[1]:.0f} px" if self.mean_size else ""
        val = f" + {self.val} for validation" if self.val else ""
        return f"{self.train} training images{val} in {self.classes} classes{size} at {self.path}"


@dataclass(kw_only=True)
class Plan:
    """What a search runs, decided before the study is opened."""

    options: SearchOptions
    spec: StudySpec
    name: str
    objective: Objective
    nproc: int
    torchrun: Torchrun
    entries: list[str] | None
    """``CUDA_VISIBLE_DEVICES`` entries of the trials' GPUs; None on a machine without GPUs."""

    gpus: list[Gpu]
    nvml: Nvml
    util_reason: str | None
    """Why NVML utilization is unavailable (None: it is available)."""

    space: SearchSpace
    base: TrainConfig | None
    """The base config with its data path; None while the spec's data is still to be generated."""

    probe: TrainConfig
    """The base config, with a stand-in for data still to be generated (what the checks run on)."""

    baseline: dict[str, Any]
    starts: list[dict[str, Any]]
    data: DataSummary | None
    storage_url: str
    trials: int
    timeout_s: float | None
    trial_timeout_s: float
    notes: list[str] = field(default_factory=list)
    optimizer_line: str = ""
    """Which optimizer the trials run and why (the spec's, the model family's recipe, or the command line's)."""

    measures_ceiling: bool = True
    """The job can run its model on a synthetic batch (the built-in job can; a user's script when its loader goes
    through the runtime, which replays its first batch on the device): the stages measure the ceiling."""

    measures_supply: bool = True
    """The job's input pipeline can run alone (the built-in job's can; a user's script's when it hands its loader
    to the runtime): the stages measure each pipeline's supply. With neither, the search runs the sampler alone and
    says so."""

    script: Any = None
    """For a user's script: what its first run found (``autotune.search.script.Probe``); None for the built-in job
    (and for a script until then)."""

    preloaded: dict[str, Any] = field(default_factory=dict)
    """Runs already made for a stage's first trial, by stage (a script's probe is its baseline): (run, samples)."""

    @property
    def world(self) -> int:
        return self.nproc * self.torchrun.nnodes

    @property
    def util_available(self) -> bool:
        return self.util_reason is None

    @property
    def is_script(self) -> bool:
        return self.probe.script.given



def prepare(o: SearchOptions, say=print) -> Plan:
    check_options(o)
    nvml = Nvml()
    visible = visible_entries(gpu_count(nvml))
    if o.script:
        from autotune.search.script import check, script_spec

        check(o.script)
        spec, optimizer_line = script_spec(o.script, o.script_args, o.study, gpu=bool(visible)), ""
    else:
        spec, optimizer_line = with_command_line(load_spec(choose_spec(o, len(visible), say)), o)
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
    problem = writable_problem(storage_url)
    if problem:
        raise StorageError(problem)
    if checked is not None:  # recorded only now: a search refused for another mistake leaves no file behind
        checked.settle(say)
    folder = missing_folder(storage_url)
    if folder is not None:  # every check passed: the search is about to make it
        say(f"autotune: making folder {folder} for the study storage")
    return Plan(options=o, spec=spec, name=name, objective=objective, nproc=nproc, torchrun=torchrun,
                entries=entries, gpus=gpus, nvml=nvml, util_reason=util_reason, space=space, base=base, probe=probe,
                baseline=baseline, starts=starts, data=data, storage_url=storage_url,
                trials=o.trials or spec.budget.trials,
                timeout_s=o.timeout_s if o.timeout_s is not None else spec.budget.timeout_s,
                trial_timeout_s=o.trial_timeout_s or spec.budget.trial_timeout_s, optimizer_line=optimizer_line)


def check_options(o: SearchOptions) -> None:
    if o.script and (o.spec or o.model or o.data or o.image_size or o.optimizer or o.lr):
        given = next(f for f, v in (("--spec", o.spec), ("--model", o.model), ("--data", o.data),
                                    ("--image-size", o.image_size), ("--optimizer", o.optimizer), ("--lr", o.lr))
                     if v)
        raise AutotuneError(f"--script with {given}: the script builds its own model, optimizer and data; pass "
                            "its arguments after `--` (autotune search --script train.py -- --data DIR)")
    if o.script_args and not o.script:
        raise AutotuneError(f"arguments after `--` ({' '.join(o.script_args)}) are a script's: give --script too")
    for flag, value in (("--trials", o.trials), ("--timeout", o.timeout_s), ("--trial-timeout", o.trial_timeout_s),
                        ("--stale-after", o.stale_after_s), ("--image-size", o.image_size), ("--lr", o.lr)):
        if value is not None and value <= 0:
            raise AutotuneError(f"{flag} {value:g}: must be > 0")
    if o.stale_after_s is not None and o.stale_after_s < 3 * HEARTBEAT_S:
        raise AutotuneError(f"--stale-after {o.stale_after_s:g}: must be >= {3 * HEARTBEAT_S:g} s (three "
                            "heartbeats), or a live trial on another machine could be taken for stale")


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
    spec's own model, and the job's default (SGD at 0.1) does not train every family (a transformer's loss went from
    4.7 to 162 with it)."""
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


# ---- data ---------------------------------------------------------------------------------------------------------


def data_cache_root(spec: StudySpec) -> Path:
    if spec.data.cache_dir:
        return Path(spec.data.cache_dir).expanduser()
    if os.environ.get("AUTOTUNE_CACHE"):
        return Path(os.environ["AUTOTUNE_CACHE"]) / "data"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "ddp-autotune" / "data"


def given_data(spec: StudySpec, data_arg: str | None) -> tuple[TrainConfig | None, DataCheck | None]:
    """The base config when its data already exists (``--data``, the spec's path, synthetic), checked: the folder
    exists and holds images (``DataCheck``: the verdict, to be recorded once every other check passed too). None
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
        return base, _check_images(base, "--data", data_cache_root(spec))
    if spec.generates_data:
        return None, None
    base = spec.base_config()
    if base.data.kind == "imagefolder":
        path = Path(base.data.path).expanduser()
        if not path.is_dir():
            what = "a file, not a folder" if path.exists() else "no such folder"
            raise DataError(f"base.data.path {path}: {what}; fix the spec or pass --data DIR")
        base = base.with_overrides({"data.path": str(path.resolve())})
        return base, _check_images(base, "base.data.path", data_cache_root(spec))
    return base, None


def _check_images(base: TrainConfig, where: str, cache: Path | None = None) -> DataCheck:
    """An ImageFolder with no image (or a validation split that does not match), or with a file that is no image,
    fails every trial: say so now. A folder whose files are unchanged since a clean check recorded in ``cache``
    (``DataCheck``) is not checked again."""
    try:
        train, val = resolve_splits(base)
    except ConfigError as e:
        raise DataError(f"{where}: {'; '.join(e.problems)}; it needs one folder per class with JPEG/PNG files in "
                        "them (`autotune make-data DIR --images N --classes C` makes one)") from None
    paths = [p for split in (train, val) if split is not None for p, _ in split.samples]
    checked = DataCheck(path=str(Path(base.data.path).resolve()), files=len(paths), signature=files_signature(paths),
                        cache=cache)
    if checked.recorded():
        return checked
    with check_progress(len(paths), checked.path) as step:
        bad = unreadable_images(paths, progress=step)
    if bad:
        path, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise DataError(f"{where}: {path} is not a readable image: {why}{more}; remove or replace "
                        f"{'it' if len(bad) == 1 else 'them'} (every file of the folder was checked)")
    return checked


CHECK_FORMAT = 1
"""Bumped whenever ``image_problem`` accepts less than before, so a folder an older check passed is checked again."""

MANY_FILES = 20_000
"""A check of more files than this says so in a line when its progress cannot be shown live (stderr no terminal)."""

PROGRESS_AFTER_S = 3.0
"""A check still running after this long shows its progress (files checked / total) on a terminal."""


@dataclass(kw_only=True)
class DataCheck:
    """A data folder's files and their verdict. A clean check is recorded in the data cache (a small JSON file per
    folder, by its resolved path) with a signature of the files it checked; a later search whose files have the
    same signature skips the check (~1.3 M files of ImageNet: a minute or more every search start, also on resume).
    A failing check is never recorded."""

    path: str
    """The folder, resolved."""

    files: int
    signature: str
    """``files_signature`` of the files checked."""

    cache: Path | None = None
    """The data cache folder (``data_cache_root``); None: nothing is recorded."""

    skipped: bool = False
    """The files are unchanged since a recorded clean check, so they were not checked again."""

    @property
    def record_path(self) -> Path | None:
        if self.cache is None:
            return None
        key = hashlib.sha256(self.path.encode()).hexdigest()[:20]
        return self.cache / "checked" / f"{Path(self.path).name[:40]}-{key}.json"

    def recorded(self) -> bool:
        """Whether a clean check of exactly these files is on record (sets ``skipped``)."""
        record = self.record_path
        try:
            stored = json.loads(record.read_text()) if record is not None else None
        except (OSError, ValueError):
            stored = None  # none yet, or unreadable: check (and record it afresh)
        self.skipped = (isinstance(stored, dict) and stored.get("format") == CHECK_FORMAT
                        and stored.get("path") == self.path and stored.get("signature") == self.signature)
        return self.skipped

    def settle(self, say) -> None:
        """Once every other check passed: say that the check was skipped, or record the clean one."""
        if self.skipped:
            say(f"autotune: data: {self.path} checked before ({self.files} files unchanged since); not checked "
                "again")
            return
        record = self.record_path
        if record is None:
            return
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")  # two searches starting at once
            tmp.write_text(json.dumps({"format": CHECK_FORMAT, "path": self.path, "files": self.files,
                                       "signature": self.signature, "checked_at": time.time()}))
            os.replace(tmp, record)
        except OSError:
            pass  # a cache that cannot be written costs the next search its check again, nothing more


def files_signature(paths: list[str]) -> str:
    """A hash of the sorted (path, size, mtime_ns, ctime_ns) of ``paths``: any file added, removed, rewritten or
    touched changes it (ctime too: a copy that kept another file's mtime and size is still a change). Stats come
    from one ``os.scandir`` per folder; a file missing there counts as missing. Costs a stat per file, no read."""
    by_folder: dict[str, set[str]] = {}
    for p in paths:
        folder, name = os.path.split(p)
        by_folder.setdefault(folder, set()).add(name)
    rows = []
    for folder, names in by_folder.items():
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.name in names:
                        try:
                            st = e.stat()
                        except OSError:
                            continue
                        rows.append(f"{e.path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n")
        except OSError:
            continue
    rows.sort()
    h = hashlib.sha256(f"{len(paths)} {len(rows)}\n".encode())
    for r in rows:
        h.update(r.encode())
    return h.hexdigest()


@contextmanager
def check_progress(total: int, root: str) -> Iterator[Callable[[int], None] | None]:
    """How a long check shows its progress on stderr, as ``make-data`` does: on a terminal, a live line of files
    checked / total once the check has run ``PROGRESS_AFTER_S``; elsewhere (a log file, CI), one line at the start
    when it checks more than ``MANY_FILES`` files. Yields the callback for files done (None: nothing to show)."""
    if not sys.stderr.isatty():
        if total > MANY_FILES:
            print(f"autotune: data: checking every file of {root} ({total} files) before trial 0; a later search "
                  "skips this while they are unchanged", file=sys.stderr, flush=True)
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="file", desc=f"autotune: data: checking {root}", delay=PROGRESS_AFTER_S,
              dynamic_ncols=True) as bar:
        yield bar.update


CHECK_TAIL_BYTES = 1024
"""A JPEG's end marker is looked for in this many last bytes: some writers pad a file after it."""

CHECK_THREADS = 8
"""Threads checking files: they wait on the disk (a network file system's latency) more than they compute."""


def image_problem(path: str) -> str | None:
    """Why the file cannot be a training image (None: it can): unreadable, empty, a JPEG without its start or end
    marker (cut short), a PNG without its end chunk, or a header PIL cannot parse. Reads the first and last bytes
    and the header, never the pixels: bounded work per file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            head = f.read(16)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - CHECK_TAIL_BYTES))
            tail = f.read()
            if not head:
                return "an empty file"
            if head[:2] == b"\xff\xd8" and b"\xff\xd9" not in tail:
                return "a JPEG cut short (no end marker)"
            if head[:8] == b"\x89PNG\r\n\x1a\n" and b"IEND" not in tail:
                return "a PNG cut short (no end chunk)"
            f.seek(0)
            try:
                with Image.open(f):  # parses the header, never the pixels
                    pass
            except (UnidentifiedImageError, ValueError, SyntaxError, EOFError) as e:
                return f"PIL cannot read its header ({e})"
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    return None


def unreadable_images(paths: list[str], chunk: int = 512,
                      progress: Callable[[int], None] | None = None) -> list[tuple[str, str]]:
    """(path, why) of every file in ``paths`` that ``image_problem`` rejects, in the order given. ``progress`` is
    called (on the caller's thread) with the number of files of each part checked."""
    def check(part: list[str]) -> list[tuple[str, str]]:
        return [(p, why) for p in part if (why := image_problem(p)) is not None]

    parts = [paths[i:i + chunk] for i in range(0, len(paths), chunk)]
    pool = ThreadPoolExecutor(CHECK_THREADS)
    try:
        futures = {pool.submit(check, part): len(part) for part in parts}
        if progress is not None:
            for done in as_completed(futures):
                progress(futures[done])
        found = [bad for f in futures for bad in f.result()]
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # Ctrl-C, SIGTERM: stop now, not after a million files
        raise
    pool.shutdown()
    return found


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


# ---- checks ---------------------------------------------------------------------------------------------------------


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
