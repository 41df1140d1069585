"""TrainConfig: the one schema the tuner and the job share.

A run is fully described by a `TrainConfig`: a tree of kw-only dataclasses, one per component, loaded from and
written to YAML. The tuner writes one per trial (``autotune/space.py`` sets fields by dotted path, e.g.
``training.batch_size``); ``autotune export`` writes the best one; the job reads it.

Validation collects *every* problem before raising, each with the fix, so a user editing a YAML by hand sees all of
them at once instead of one per launch.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# What a change of a setting takes lives with the knobs; re-exported: the worker asks the config's module.
from trainer.knobs import Scope as Scope
from trainer.knobs import scope_of as scope_of
from trainer.protocol import Failure, nccl_env_problems

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""``training.compile_mode`` values that record CUDA graphs (Inductor's cudagraph trees)."""


class ConfigError(ValueError):
    """A TrainConfig (or its YAML) is invalid. ``problems`` holds one line per problem, each naming the fix."""

    failure = Failure.CONFIG

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "resnet50"
    """A torchvision classification model name (``torchvision.models.list_models``) or ``package.module:function``."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the model constructor (``num_classes`` comes from ``data``)."""


@dataclass(kw_only=True)
class DataConfig:
    kind: Literal["synthetic", "imagefolder", "script"] = "synthetic"
    """``synthetic``: random tensors made once on the device (the compute ceiling; for a user's script, its first
    batch replayed on the device); ``imagefolder``: JPEG files; ``script``: whatever the user's script reads."""

    path: str | None = None
    """ImageFolder root (class sub-folders). If it holds ``train/`` (and ``val/``), those are used."""

    val_path: str | None = None
    """Validation ImageFolder; default ``<path>/val`` when it exists, else ``val_fraction`` of the training files."""

    val_fraction: float = 0.0
    """Fraction of the training files held out for validation when there is no validation folder."""

    image_size: int = 224
    """Side of the square crop fed to the model."""

    num_classes: int | None = None
    """Classes of the model head; ``None`` means: the ImageFolder's class count (1000 for synthetic data)."""

    decode: Literal["pil", "torchvision-cpu", "nvjpeg-gpu", "hybrid", "dali"] = "pil"
    """Input pipeline: PIL in loader workers (the classic), ``torchvision.io`` libjpeg-turbo in workers (uint8 out,
    normalized on the device), nvJPEG on the GPU with batched GPU augmentation (workers only read bytes), or
    ``hybrid``: ``hybrid_cpu_fraction`` of each batch as ``torchvision-cpu``, the rest as ``nvjpeg-gpu``, or
    ``dali``: an NVIDIA DALI pipeline (``pip install 'ddp-autotune[dali]'``) that reads the files itself and decodes
    each image's random crop on the GPU's hardware JPEG engines and CUDA (the DataLoader's settings do not apply)."""

    hybrid_cpu_fraction: float = 0.5
    """``decode: hybrid`` only: the share of every batch decoded and augmented by the loader workers (0: all on the
    GPU, 1: all on the CPU); it balances CPU cores against device time taken from training."""

    dali_hw_decoder_load: float = 0.65
    """``decode: dali`` only: the share of each batch DALI's hardware JPEG decoder takes; the rest is decoded with
    CUDA on the SMs (DALI's ``hw_decoder_load``)."""

    dali_threads: int = 4
    """``decode: dali`` only: DALI's CPU threads per rank (file reads, header parsing, the CPU stages)."""

    dali_prefetch: int = 2
    """``decode: dali`` only: batches DALI's pipeline prepares ahead of the one training takes (its queue depth)."""

    dali_gpu_huffman: bool = False
    """``decode: dali`` only: the share of each batch not on the hardware engines has its Huffman decoding done with
    the GPU's help (nvJPEG's hybrid Huffman decoder for every image: DALI's ``hybrid_huffman_threshold`` 0), rather
    than on DALI's CPU threads, whose decoded coefficients are then copied to the device image by image."""

    dali_crop: Literal["roi", "full"] = "roi"
    """``decode: dali`` only, training: ``roi`` decodes only each image's random crop (DALI's fused
    ``decoders.image_random_crop``); ``full`` decodes the whole image and crops it on the GPU
    (``random_resized_crop``), the shape of MLPerf's ResNet-50 pipeline: more decode work, a separate crop kernel,
    a decode the hardware engines take whole."""

    dali_half_out: bool = False
    """``decode: dali`` only: where the run computes in fp16 or bf16, DALI's normalize emits float16 images (half the
    bytes its last kernel writes and the model's first layer reads; autocast casts them on) instead of float32; an
    fp32 run gets float32 either way."""

    dali_antialias: bool = True
    """``decode: dali`` only: the resize to the model's input filters out what the downscale would alias (as
    torchvision's ``antialias=True``); off, a plain bilinear resize that costs less device time."""

    crop_scale: tuple[float, float] = (0.08, 1.0)
    """RandomResizedCrop area range, as in torchvision."""

    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    """RandomResizedCrop aspect-ratio range, as in torchvision."""

    hflip: bool = True
    """Random horizontal flip with p=0.5."""

    def problems(self) -> list[str]:
        p = []
        if self.kind == "imagefolder" and not self.path:
            p.append("data.path is required when data.kind is imagefolder (run `autotune make-data DIR` to make one)")
        if self.image_size < 8:
            p.append(f"data.image_size={self.image_size}: must be >= 8")
        if self.num_classes is not None and self.num_classes < 1:
            p.append(f"data.num_classes={self.num_classes}: must be >= 1")
        if self.decode not in DECODES:  # built in code (a script's run.image_loader), not type-checked by loading
            p.append(removed_problem("data.decode", self.decode)
                     or f"data.decode={self.decode!r}: expected one of {', '.join(DECODES)}")
        if not 0.0 <= self.hybrid_cpu_fraction <= 1.0:
            p.append(f"data.hybrid_cpu_fraction={self.hybrid_cpu_fraction}: must be in [0, 1]")
        if not 0.0 <= self.dali_hw_decoder_load <= 1.0:
            p.append(f"data.dali_hw_decoder_load={self.dali_hw_decoder_load}: must be in [0, 1]")
        if self.dali_crop not in DALI_CROPS:
            p.append(f"data.dali_crop={self.dali_crop!r}: expected one of {', '.join(DALI_CROPS)}")
        for name in ("dali_threads", "dali_prefetch"):
            if getattr(self, name) < 1:
                p.append(f"data.{name}={getattr(self, name)}: must be >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            p.append(f"data.val_fraction={self.val_fraction}: must be in [0, 1)")
        for name, (lo, hi) in (("crop_scale", self.crop_scale), ("crop_ratio", self.crop_ratio)):
            if not 0 < lo <= hi:
                p.append(f"data.{name}=({lo}, {hi}): needs 0 < low <= high")
        if self.crop_scale[1] > 1.0:
            p.append(f"data.crop_scale high={self.crop_scale[1]}: must be <= 1")
        return p


DECODES: tuple[str, ...] = typing.get_args(typing.get_type_hints(DataConfig)["decode"])
"""The input pipelines ``data.decode`` names."""

DALI_CROPS: tuple[str, ...] = typing.get_args(typing.get_type_hints(DataConfig)["dali_crop"])
"""The shapes of DALI's training decode ``data.dali_crop`` names."""


@dataclass(kw_only=True)
class LoaderConfig:
    num_workers: int = 4
    """DataLoader worker processes per rank."""

    prefetch_factor: int | None = None
    """Batches each worker keeps in flight; only with ``num_workers > 0`` (``None``: torch's default, 2)."""

    pin_memory: bool = True
    """Page-locked host batches, so the host-to-device copy can be asynchronous (ignored without CUDA)."""

    persistent_workers: bool = False
    """Keep workers alive across epochs; only with ``num_workers > 0``."""

    def problems(self) -> list[str]:
        p = []
        if self.num_workers < 0:
            p.append(f"loader.num_workers={self.num_workers}: must be >= 0")
        if self.num_workers == 0 and self.prefetch_factor is not None:
            p.append("loader.prefetch_factor is set but loader.num_workers is 0: "
                     "remove prefetch_factor or use num_workers >= 1")
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            p.append(f"loader.prefetch_factor={self.prefetch_factor}: must be >= 1")
        if self.num_workers == 0 and self.persistent_workers:
            p.append("loader.persistent_workers needs loader.num_workers >= 1: set it to false or add workers")
        return p


@dataclass(kw_only=True)
class TrainingConfig:
    mode: Literal["measure", "train", "loader"] = "measure"
    """``measure``: warm-up then timed windows, then stop (a search trial). ``train``: epochs/steps with
    validation and checkpoints. ``loader``: the input pipeline alone, no model (what it can deliver per GPU)."""

    batch_size: int = 64
    """Per-rank micro-batch size."""

    accum_steps: int = 1
    """Micro-batches per optimizer step; the gradient all-reduce runs once per optimizer step."""

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype; ``fp16`` adds a GradScaler."""

    channels_last: bool = False
    """NHWC memory format for model and inputs (tensor cores prefer it)."""

    compile: bool = False
    """``torch.compile`` the model (DDP wrapper included: its buckets still overlap the backward pass). A cold
    compile of ResNet-50 costs about a minute; a live worker pays it once per graph (``trainer.compiled``), and the
    first step's record says what it cost (``compile_s``)."""

    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None
    """``torch.compile`` mode (``None``: torch's default). ``reduce-overhead`` records the model's forward and
    backward as CUDA graphs (one launch instead of hundreds; the optimizer, the GradScaler and DDP's all-reduces stay
    outside them, eager); ``max-autotune`` adds Triton's kernel autotuning to that, ``max-autotune-no-cudagraphs``
    the autotuning alone. Only with ``compile: true``; the CUDA-graph modes only without gradient accumulation."""

    compile_cache_dir: str | None = None
    """Where torch.compile keeps its on-disk caches (Inductor's FX graph cache, AOTAutograd's, autotuning results),
    so a fresh process loads what an earlier one compiled. ``None``: torch's default (``TORCHINDUCTOR_CACHE_DIR``,
    else ``/tmp/torchinductor_<user>``)."""

    cudnn_benchmark: bool = True
    """cuDNN tries several convolution algorithms per new shape and keeps the fastest. The trying makes the first step
    many times longer and may leave the steady state unchanged (``docs/benchmarks.md``): a search decides it by
    measurement once (the ceiling stage) instead of paying it in every trial."""

    epochs: int | None = None
    """Train mode: epochs over the dataset."""

    steps: int | None = None
    """Train mode: optimizer steps (overrides ``epochs`` when both are set). Measure mode: a hard cap."""

    seed: int = 0
    """Seed for model init, sampler order and augmentation."""

    validate_every: int = 1
    """Train mode: run validation every N epochs (0: never)."""

    log_every_s: float = 10.0
    """Train mode: seconds between progress lines on rank 0."""

    @property
    def supply(self) -> bool:
        """The run measures the input pipeline alone: a supply, as the search and the runtime call it (``mode:
        loader``, the word a config file spells it with)."""
        return self.mode == "loader"

    def problems(self) -> list[str]:
        p = []
        if self.batch_size < 1:
            p.append(f"training.batch_size={self.batch_size}: must be >= 1")
        if self.accum_steps < 1:
            p.append(f"training.accum_steps={self.accum_steps}: must be >= 1")
        for name in ("epochs", "steps"):
            v = getattr(self, name)
            if v is not None and v < 1:
                p.append(f"training.{name}={v}: must be >= 1")
        if self.compile_mode is not None and not self.compile:
            p.append(f"training.compile_mode={self.compile_mode} needs training.compile=true: set it, or remove "
                     "compile_mode")
        if self.compile and self.compile_mode in CUDA_GRAPH_MODES and self.accum_steps > 1:
            # A CUDA graph replays into the same output memory, so the micro-batch whose gradient AccumulateGrad kept
            # is overwritten by the next one's (pytorch/pytorch#169545; wrong gradients, or an error on access).
            p.append(f"training.compile_mode={self.compile_mode} with training.accum_steps={self.accum_steps}: CUDA "
                     "graphs overwrite one micro-batch's gradients with the next one's; set training.accum_steps=1 "
                     "or compile_mode=max-autotune-no-cudagraphs (or default)")
        return p


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    """Peak learning rate for this run's global batch (export scales it when the global batch changes)."""

    momentum: float = 0.9
    weight_decay: float = 1e-4
    schedule: Literal["constant", "cosine"] = "constant"
    """``cosine``: linear warm-up for ``warmup_epochs`` then cosine decay to zero over the run."""

    warmup_epochs: float = 0.0
    reference_global_batch: int | None = None
    """Global batch the ``lr`` was chosen for; recorded so later changes of the batch can rescale it."""


@dataclass(kw_only=True)
class DDPConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """``auto``: NCCL when CUDA is available, gloo otherwise (same code path)."""

    timeout_s: float = 300.0
    """Collective timeout; a stuck all-reduce fails after this instead of hanging forever."""

    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size: larger buckets mean fewer, bigger all-reduces."""

    gradient_as_bucket_view: bool = False
    """Gradients alias the all-reduce buckets (saves a copy and memory)."""

    static_graph: bool = False
    """Tell DDP the graph never changes (enables some overlap optimizations)."""

    find_unused_parameters: bool = False
    broadcast_buffers: bool = True

    def problems(self) -> list[str]:
        p = []
        if self.bucket_cap_mb <= 0:
            p.append(f"ddp.bucket_cap_mb={self.bucket_cap_mb}: must be > 0")
        if self.timeout_s <= 0:
            p.append(f"ddp.timeout_s={self.timeout_s}: must be > 0")
        return p


@dataclass(kw_only=True)
class NcclConfig:
    algo: Literal["Ring", "Tree"] | None = None
    """The all-reduce algorithm (``NCCL_ALGO=allreduce:<algo>``); ``None`` leaves NCCL's choice. Scoped to
    all-reduce because a bare ``NCCL_ALGO=Tree`` leaves broadcast and all-gather without any algorithm: DDP's first
    broadcast then fails with "invalid usage"."""

    proto: Literal["Simple", "LL"] | None = None
    """NCCL_PROTO; ``None`` leaves NCCL's choice (LL128 is never forced)."""

    min_ctas: int | None = None
    max_ctas: int | None = None
    buffsize: int | None = None
    """NCCL_BUFFSIZE in bytes."""

    extra: dict[str, str] = field(default_factory=dict)
    """Further NCCL_* variables, passed as they are (NVLS may not be turned on)."""

    def to_env(self) -> dict[str, str]:
        env = {f"NCCL_{k.upper()}": str(v) for k, v in (("proto", self.proto), ("min_ctas", self.min_ctas),
               ("max_ctas", self.max_ctas), ("buffsize", self.buffsize)) if v is not None}
        if self.algo is not None:
            env["NCCL_ALGO"] = f"allreduce:{self.algo}"
        env.update({k: str(v) for k, v in self.extra.items()})
        return env


@dataclass(kw_only=True)
class MeasureConfig:
    """The measurement protocol: a few steps discarded, then short timed windows until the figure's 95 % interval
    is tight enough (``trainer.estimate``). Where the warm-up ends is found from the windows themselves: a loader
    catching up or a late recompile shows in them, and the time spent finding it is mostly time measured anyway."""

    warmup_min_steps: int = 10
    """Steps always discarded before the first window (cudnn.benchmark, allocator, loader start-up), on top of the
    steps the loader's prefetch buffer serves."""

    warmup_max_s: float = 120.0
    """The discarded steps end after this long even if fewer ran (recorded as ``warmup_capped``)."""

    window_s: float = 0.25
    """Target length of one timed window: the unit the interval's batches are made of (each window ends with a
    device sync)."""

    precision: float = 0.02
    """The measurement ends once its 95 % interval's half-width is at most this share of the figure."""

    max_s: float = 30.0
    """Seconds of windows at most: a measurement that reaches them ends with its interval as it is (wider than
    ``precision``). A train run measures to its end."""

    profile_steps: int = 0
    """After the measured windows, this many more steps run under ``torch.profiler`` and the summary splits the step
    into its parts (``step_split``: waiting for data, host-to-device copy, forward and backward, optimizer,
    communication, the host's launch gaps; ``trainer.profile``). The windows are measured before it, so its overhead
    touches no figure. 0: no profile. A measure run only."""

    def problems(self) -> list[str]:
        p = []
        if self.warmup_min_steps < 0:
            p.append(f"measure.warmup_min_steps={self.warmup_min_steps}: must be >= 0")
        if self.window_s <= 0:
            p.append(f"measure.window_s={self.window_s}: must be > 0")
        if not 0 < self.precision < 1:
            p.append(f"measure.precision={self.precision}: must be between 0 and 1 (0.02: ±2 %)")
        if self.profile_steps < 0:
            p.append(f"measure.profile_steps={self.profile_steps}: must be >= 0")
        if self.max_s < self.window_s:
            p.append(f"measure.max_s={self.max_s}: must be at least measure.window_s ({self.window_s})")
        return p


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Default ``<output_dir>/checkpoints``."""

    every_epochs: int = 1
    """Train mode: save after every N epochs (0: never)."""

    every_steps: int | None = None
    """Train mode: also save every N optimizer steps."""

    keep_last: int = 2
    resume: bool = False
    """Resume from the newest checkpoint in ``dir`` when there is one."""


@dataclass(kw_only=True)
class ScriptConfig:
    """The user's own training script as the job (``autotune search --script``): it imports ``trainer.runtime``,
    which hands it the run's settings (those it applies) and measures the steps it reports. The ``model`` and most
    of the ``data`` and ``training`` sections then mean nothing: the script builds its own."""

    path: str | None = None
    """A script file, run as ``torchrun ... PATH ARGS``: a fresh process per trial."""

    entry: str | None = None
    """``package.module:function``, called with no arguments: trial after trial in one live worker."""

    args: list[str] = field(default_factory=list)
    """The script's command-line arguments (``sys.argv[1:]`` while an entry function runs)."""

    applies: list[str] = field(default_factory=list)
    """The settings the script applies, by their runtime names (``trainer.knobs``), found by its first run; a run
    hands it these and no others, so everything else keeps the script's own defaults."""

    def problems(self) -> list[str]:
        from trainer.knobs import table

        names = table().by_runtime_name
        p = []
        if self.path and self.entry:
            p.append("script: set script.path or script.entry, not both")
        if self.entry is not None and ":" not in self.entry:
            p.append(f"script.entry={self.entry!r}: write package.module:function")
        unknown = [a for a in self.applies if a not in names]
        if unknown:
            p.append(f"script.applies: unknown {', '.join(unknown)}{did_you_mean(unknown[0], names)}")
        return p

    @property
    def given(self) -> bool:
        return bool(self.path or self.entry)


@dataclass(kw_only=True)
class TrainConfig:
    name: str = "run"
    output_dir: str = "runs/run"
    """Where checkpoints and logs go (rank 0 writes)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    script: ScriptConfig = field(default_factory=ScriptConfig)

    # ---- (de)serialization -------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> TrainConfig:
        problems: list[str] = []
        # `autotune export` adds an `autotune:` section (torchrun args, env, fingerprint, figures): not the job's.
        data = {k: v for k, v in (data or {}).items() if k != "autotune"}
        data = _drop_removed(drop_retired(data), problems)
        cfg = build_dataclass(cls, data, "", problems)
        # Every problem at once: a badly typed setting was left at its default, so the cross-field checks can run
        # too; only their lines about a setting already reported are dropped (they would judge the default).
        reported = {_setting_of(x) for x in problems}
        problems.extend(x for x in cfg.problems() if _setting_of(x) not in reported)
        if problems:
            raise ConfigError(problems)
        return cfg

    def to_yaml(self, path: str | Path | None = None) -> str:
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        return cls.from_dict(load_yaml_mapping(path))

    def with_overrides(self, overrides: dict[str, Any]) -> TrainConfig:
        """A copy with dotted-path fields replaced, e.g. ``{"training.batch_size": 256}``; validated."""
        data = self.to_dict()
        problems = []
        for dotted, value in overrides.items():
            node = data
            *parents, leaf = dotted.split(".")
            for part in parents:
                if not isinstance(node.get(part), dict):
                    problems.append(f"{dotted}: no such setting")
                    break
                node = node[part]
            else:
                if leaf not in node and dotted not in REMOVED_SETTINGS:  # those: from_dict names the fix
                    problems.append(f"{dotted}: no such setting{did_you_mean(leaf, node)}")
                else:
                    node[leaf] = value
        if problems:
            raise ConfigError(problems)
        return TrainConfig.from_dict(data)

    # ---- validation --------------------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Every cross-field problem, each with its fix (types were checked while building): each section's own,
        then those across sections."""
        p: list[str] = []
        for section in (self.loader, self.data, self.training, self.ddp, self.measure, self.script):
            p += section.problems()
        t, d = self.training, self.data
        if t.mode == "train" and t.epochs is None and t.steps is None and not self.script.given:
            # (a user's script counts its own epochs)
            p.append("training.mode=train needs training.epochs or training.steps")
        if d.kind == "synthetic" and t.supply:
            p.append("training.mode=loader measures an input pipeline: use data.kind=imagefolder")
        if (d.kind == "script") != self.script.given and not (self.script.given and d.kind == "synthetic"):
            p.append("data.kind=script goes with script.path or script.entry (the user's script reads its own data)"
                     if d.kind == "script" else
                     f"script.{'path' if self.script.path else 'entry'} is set: use data.kind=script (or synthetic)")
        if self.optimizer.lr <= 0:
            p.append(f"optimizer.lr={self.optimizer.lr}: must be > 0")
        if self.ddp.static_graph and t.accum_steps > 1:
            # DDP(static_graph=True) under no_sync() asserts in its reducer on the first backward, and without the
            # assert it would stop all-reducing gradients after one step (pytorch/pytorch#187732): not runnable.
            p.append(f"ddp.static_graph=true with training.accum_steps={t.accum_steps}: DDP's static graph breaks "
                     "under gradient accumulation (no_sync) in this torch; set ddp.static_graph=false or "
                     "training.accum_steps=1")
        if self.checkpoint.keep_last < 1:
            p.append(f"checkpoint.keep_last={self.checkpoint.keep_last}: must be >= 1")
        p.extend(nccl_env_problems(self.nccl.to_env()))
        return p

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.output_dir) / "checkpoints"


def _setting_of(problem: str) -> str:
    """The dotted setting a problem line starts with (``training.batch_size=-1: ...`` -> ``training.batch_size``)."""
    return problem.split("=", 1)[0].split(":", 1)[0].split(" ", 1)[0]


def process_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings of ``cfg`` a live process cannot change: two configs with equal values can share a process."""
    return {"nccl_env": cfg.nccl.to_env(), "ddp.backend": cfg.ddp.backend, "ddp.timeout_s": cfg.ddp.timeout_s,
            "script": [cfg.script.path, cfg.script.entry, list(cfg.script.args)]}


def serves(settings: dict[str, Any], cfg: TrainConfig) -> bool:
    """Whether a live process made with ``settings`` (``process_settings``) can run ``cfg``: the same settings, or
    the built-in job on a process made for a user's function and otherwise the same (a worker runs either)."""
    mine = process_settings(cfg)
    if mine == settings:
        return True
    other = {k: v for k, v in settings.items() if k != "script"}
    return not cfg.script.given and {k: v for k, v in mine.items() if k != "script"} == other


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: no such file"])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError([f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of settings at the top level, got {type(data).__name__}"])
    return data


# ---- generic builder: dict -> nested kw-only dataclasses, collecting every problem ---------------------------------


# Settings earlier versions wrote (into an exported best.yaml, a study's stored trial configs) that no longer mean
# anything: rules for when a measurement has settled, replaced by its interval. Such files still load.
RETIRED_SETTINGS = {"measure": ("settle_steps", "settle_span_s", "settle_tolerance", "windows", "max_windows",
                                "spread_target")}
RETIRED_WHY = "a measurement ends on its interval: measure.precision and measure.max_s"


def drop_retired(data: dict[str, Any], retired: dict[str, tuple[str, ...]] = RETIRED_SETTINGS,
                 why: str = RETIRED_WHY) -> dict[str, Any]:
    """``data`` without the ``retired`` settings (section -> keys), each one dropped said once (``why``)."""
    import warnings

    for section, keys in retired.items():
        sub = data.get(section)
        if isinstance(sub, dict) and (old := [k for k in keys if k in sub]):
            data = {**data, section: {k: v for k, v in sub.items() if k not in old}}
            warnings.warn(f"ignoring {', '.join(f'{section}.{k}' for k in old)}: retired ({why})", FutureWarning,
                          stacklevel=3)
    return data


_USE_DALI = "for the GPU's hardware JPEG decoder use data.decode: dali (pip install 'ddp-autotune[dali]')"

REMOVED_SETTINGS: dict[str, Any] = {"data.hybrid_hw_fraction": 0.0, "data.hw_roi_decode": False}
"""Settings of the retired ``nvjpeg-hw`` pipeline (nvImageCodec on the hardware JPEG engines; DALI's hardware path
measured faster end to end), by the value at which they changed nothing. Every exported config and stored trial
holds them at that value, and loads as it ran; any other value asked for the engines and is refused with the fix."""

REMOVED_VALUES: dict[str, tuple[Any, ...]] = {"data.decode": ("nvjpeg-hw",)}
"""Values of a setting that named the retired pipeline."""


def removed_problem(path: str, value: Any = None) -> str | None:
    """The line naming the fix for a removed setting (at ``value``; any value when None) or a removed value of a
    setting; None when it is neither."""
    at = "" if value is None else f"={value}"
    if path in REMOVED_SETTINGS:
        return f"{path}{at}: removed with data.decode=nvjpeg-hw; {_USE_DALI}"
    if value is not None and value in REMOVED_VALUES.get(path, ()):
        return f"{path}{at}: removed; {_USE_DALI}"
    return None


def _drop_removed(data: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """``data`` without the removed settings and values: a removed setting at its inert value dropped quietly,
    anything else removed reported (one line naming the fix) and dropped, so it is not reported twice."""
    for path in (*REMOVED_SETTINGS, *REMOVED_VALUES):
        section, key = path.split(".")
        sub = data.get(section)
        if not isinstance(sub, dict) or key not in sub:
            continue
        inert = path in REMOVED_SETTINGS and sub[key] == REMOVED_SETTINGS[path]
        problem = None if inert else removed_problem(path, sub[key])
        if inert or problem:
            problems.extend([problem] if problem else [])
            data = {**data, section: {k: v for k, v in sub.items() if k != key}}
    return data


def did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=3)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def build_dataclass(cls, data: Any, prefix: str, problems: list[str], *, convert=None, empty=None):
    """``cls(**data)`` for nested kw-only dataclasses, appending every problem (unknown key with close matches, wrong
    type) to ``problems`` instead of stopping at the first. ``convert(cls, key, value)`` may take over a field (it
    returns ``NotImplemented`` to leave it to the type hint); ``empty()`` builds the stand-in for a non-mapping.
    Shared with the tuner's StudySpec."""
    if not isinstance(data, dict):
        problems.append(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
        return empty() if empty else cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            problems.append(f"{prefix}{key}: unknown setting{did_you_mean(str(key), names)}")
            continue
        tp = hints[key]
        converted = convert(cls, key, value) if convert else NotImplemented
        if converted is not NotImplemented:
            kwargs[key] = converted
        elif dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value, f"{prefix}{key}.", problems, convert=convert)
        else:
            ok, converted, expected = coerce_value(tp, value)
            if ok:
                kwargs[key] = converted
            else:
                problems.append(f"{prefix}{key}={value!r}: expected {expected}")
    return cls(**kwargs)


def coerce_value(tp, value) -> tuple[bool, Any, str]:
    """(ok, converted value, what was expected) for a YAML value against a type hint; shared with the tuner's
    StudySpec so both speak the same language about bad values."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None, "null"
        expected = []
        for arg in args:
            if arg is type(None):
                continue
            ok, converted, exp = coerce_value(arg, value)
            if ok:
                return True, converted, exp
            expected.append(exp)
        return False, value, " or ".join(expected + (["null"] if type(None) in args else []))
    if origin is Literal:
        return value in args, value, "one of " + ", ".join(map(str, args))
    if tp is bool:
        return isinstance(value, bool), value, "true or false"
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value, "a number"
    if tp is str:
        return isinstance(value, str), value, "a string"
    if origin is tuple:
        ok = isinstance(value, (list, tuple)) and len(value) == len(args)
        if ok:
            items = [coerce_value(a, v) for a, v in zip(args, value, strict=True)]
            if all(i[0] for i in items):
                return True, tuple(i[1] for i in items), f"a list of {len(args)} numbers"
        return False, value, f"a list of {len(args)} numbers"
    if origin is list:
        ok = isinstance(value, list)
        if ok and args and args[0] is str:
            return all(isinstance(v, str) for v in value), value, "a list of strings"
        return ok, value, "a list"
    if origin is dict:
        if not isinstance(value, dict):
            return False, value, "a mapping"
        if args and args[1] is float:
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values())
            return ok, {k: float(v) for k, v in value.items()} if ok else value, "a mapping of numbers"
        return True, dict(value), "a mapping"
    return True, value, str(tp)


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
