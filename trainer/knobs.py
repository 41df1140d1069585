"""The knobs: every setting a search may change, one entry each.

An entry says everything the rest of the project needs to know of a knob: its TrainConfig dotted path, the range
the built-in image-model space searches, what a change of it takes (its scope), whether a micro-batch's device
memory depends on it, its short label in tables, and the name under which a user's own script receives it
(``trainer.runtime``). The tuner's search space (``autotune.space``), its stages, the live trial worker (scope) and
the runtime all read this table; adding a knob is adding an entry here (and, for the built-in job, the code in
``trainer/`` that applies its config field).

This module imports nothing heavy: the tuner reads it without torch, and a user's script through the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Scope = Literal["process", "model", "pipeline"]
"""What changing a setting takes: ``process``: a new process (NCCL reads its variables when its communicators are
made, the process group's backend and timeout are fixed at start); ``pipeline``: the input pipeline rebuilt (loader
workers, decode threads); ``model``: the rest, rebuilt in place (model, DDP wrapper, optimizer, precision, layout,
batch, measurement)."""

AUTO = "auto"
"""A range end filled in per machine: for ``loader.num_workers``, the CPU cores per rank."""

BATCH_CHOICES = (32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Powers of two and 1.5x between them: enough resolution near the memory limit without a continuous range."""


@dataclass(frozen=True, kw_only=True)
class KnobDef:
    path: str
    """The TrainConfig setting, by dotted path."""

    label: str
    """Short label in tables and the live view; empty: the value speaks for itself (``bf16``, ``nvjpeg-gpu``)."""

    scope: Scope
    memory: bool = False
    """A change moves a micro-batch's device memory enough that an OOM at batch B says nothing about batch B under
    the other value (``autotune.space.predicted_oom``)."""

    choices: tuple[Any, ...] | None = None
    """The built-in space's choices (``None`` stands for the library's own choice); or a range with ``low``/``high``."""

    low: Any = None
    high: Any = None
    log: bool = False
    when: str | None = None
    """The built-in space searches the knob only when this condition holds (``PATH OP VALUE``)."""

    default_space: bool | str = True
    """Part of the built-in image-model space (``autotune.space.DEFAULT_SPACE``); ``"gpu"``: there on GPU machines
    only (a spec that names it searches it anywhere); otherwise a spec adds it."""

    runtime: str | None = None
    """The name a user's script reads it by (``trainer.runtime``); ``None``: set by the launcher for any job
    (NCCL's variables)."""

    runtime_default: Any = None
    """What a script gets that neither names the knob nor is given a value by the run: the library's own default
    (DataLoader's, DDP's, torch's), so a helper changes nothing the script did not ask for."""

    doc: str = ""


_KNOBS = (
    KnobDef(path="training.batch_size", label="bs", scope="model", choices=BATCH_CHOICES,
            runtime="batch_size", runtime_default=1, doc="per-rank micro-batch"),
    KnobDef(path="training.accum_steps", label="acc", scope="model", choices=(1, 2, 4),
            runtime="accum_steps", runtime_default=1,
            doc="micro-batches per optimizer step; the non-final ones run inside DDP's no_sync()"),
    KnobDef(path="training.precision", label="", scope="model", memory=True, choices=("fp32", "bf16", "fp16"),
            runtime="precision", runtime_default="fp32", doc="autocast dtype; fp16 adds a GradScaler"),
    KnobDef(path="training.channels_last", label="cl", scope="model", memory=True, choices=(False, True),
            runtime="channels_last", runtime_default=False, doc="NHWC memory format for model and inputs"),
    KnobDef(path="training.compile", label="compile", scope="model", memory=True, choices=(False, True),
            default_space="gpu", runtime="compile", runtime_default=False,
            doc="torch.compile; a cold compile costs about a minute on a GPU, so the stages measure it last, where "
                "the budget pays for it (on CPU ranks Inductor's C++ compile takes minutes: a spec adds it there)"),
    # None: torch's default mode; reduce-overhead: CUDA graphs for forward and backward; the autotuning modes cost
    # minutes of compile per graph, so a spec adds them.
    KnobDef(path="training.compile_mode", label="mode", scope="model", memory=True,
            choices=(None, "reduce-overhead"), when="training.compile == true", default_space=False,
            runtime="compile_mode", doc="torch.compile mode (reduce-overhead: the step's model part as CUDA graphs)"),
    KnobDef(path="training.cudnn_benchmark", label="cudnn_search", scope="model", choices=(True, False),
            default_space=False, runtime="cudnn_benchmark",
            doc="cuDNN's per-shape algorithm search; the ceiling stage decides it by measurement"),
    KnobDef(path="loader.num_workers", label="wk", scope="pipeline", low=0, high=AUTO,
            runtime="num_workers", runtime_default=0, doc="DataLoader worker processes per rank"),
    KnobDef(path="loader.prefetch_factor", label="pf", scope="pipeline", low=1, high=8,
            when="loader.num_workers > 0", runtime="prefetch_factor", doc="batches in flight per worker"),
    KnobDef(path="loader.pin_memory", label="pin", scope="pipeline", choices=(True, False),
            runtime="pin_memory", runtime_default=False, doc="page-locked host batches"),
    KnobDef(path="loader.persistent_workers", label="pers", scope="pipeline", choices=(False, True),
            when="loader.num_workers > 0", runtime="persistent_workers", runtime_default=False,
            doc="workers kept across epochs"),
    KnobDef(path="data.decode", label="", scope="pipeline", memory=True,
            choices=("pil", "torchvision-cpu", "nvjpeg-gpu", "hybrid"), runtime="decode", runtime_default="pil",
            doc="the input pipeline of an ImageFolder read through trainer.data"),
    # Three points span the trade: the ends (0 and 1) are nvjpeg-gpu and torchvision-cpu, already decode choices.
    KnobDef(path="data.hybrid_cpu_fraction", label="cpu_share", scope="pipeline", choices=(0.25, 0.5, 0.75),
            when="data.decode == hybrid", runtime="hybrid_cpu_fraction", runtime_default=0.5,
            doc="hybrid decode: the share of each batch the loader workers decode"),
    # The hardware engines' share of a hybrid batch: nvjpeg-hw needs nvImageCodec, which is opt-in, so a spec adds it.
    KnobDef(path="data.hybrid_hw_fraction", label="hw_share", scope="pipeline", choices=(0.0, 0.25, 0.5),
            when="data.decode == hybrid", default_space=False, runtime="hybrid_hw_fraction",
            doc="hybrid decode: the share of each batch the GPU's hardware JPEG engines decode"),
    KnobDef(path="data.hw_roi_decode", label="roi", scope="pipeline", choices=(False, True),
            when="data.decode == nvjpeg-hw", default_space=False, runtime="hw_roi_decode",
            doc="nvjpeg-hw: decode only the crop box of each image"),
    KnobDef(path="ddp.bucket_cap_mb", label="bkt", scope="model", low=5.0, high=200.0, log=True,
            runtime="bucket_cap_mb", runtime_default=25.0, doc="DDP gradient bucket size"),
    KnobDef(path="ddp.gradient_as_bucket_view", label="gbv", scope="model", memory=True, choices=(False, True),
            runtime="gradient_as_bucket_view", runtime_default=False, doc="gradients alias the all-reduce buckets"),
    # DDP's static graph breaks under no_sync() (pytorch/pytorch#187732): only searched without accumulation.
    KnobDef(path="ddp.static_graph", label="static", scope="model", memory=True, choices=(False, True),
            when="training.accum_steps == 1", runtime="static_graph", runtime_default=False, doc="DDP static graph"),
    # NCCL's algorithm, protocol, CTA and buffer variables: NCCL documents them as debugging variables, no
    # measurement here has shown them to matter, and each change takes a new process: a spec adds them.
    KnobDef(path="nccl.algo", label="algo", scope="process", choices=(None, "Ring", "Tree"), default_space=False),
    KnobDef(path="nccl.proto", label="proto", scope="process", choices=(None, "Simple", "LL"), default_space=False),
    KnobDef(path="nccl.min_ctas", label="minc", scope="process", default_space=False),
    KnobDef(path="nccl.max_ctas", label="maxc", scope="process", default_space=False),
    KnobDef(path="nccl.buffsize", label="buf", scope="process", default_space=False),
)

KNOBS: dict[str, KnobDef] = {k.path: k for k in _KNOBS}
"""Every knob by its dotted path, in the order the built-in space suggests them."""

BY_RUNTIME_NAME: dict[str, KnobDef] = {k.runtime: k for k in _KNOBS if k.runtime}
"""The knobs a user's script can receive, by the name it reads them under."""

MEMORY_SETTINGS = ("model.name", "model.kwargs", "data.image_size",
                   *(k.path for k in _KNOBS if k.memory))
"""Settings an OOM at a batch depends on: the model and image size, and the knobs marked ``memory``."""

_PROCESS_SETTINGS = frozenset({"ddp.backend", "ddp.timeout_s"})


def scope_of(path: str) -> Scope:
    """What a change of the dotted setting ``path`` needs (see ``Scope``): the knob's own scope, else by section
    (``nccl``, the user's ``script`` and the process group's backend and timeout: a new process; ``data``/``loader``:
    the pipeline)."""
    if path in KNOBS:
        return KNOBS[path].scope
    section = path.split(".", 1)[0]
    if section in ("nccl", "script") or path in _PROCESS_SETTINGS:
        return "process"
    if section in ("data", "loader"):
        return "pipeline"
    return "model"


def label_of(path: str) -> str:
    """The short label of a setting in tables: the knob's, else the last part of its path."""
    return KNOBS[path].label if path in KNOBS else path.rsplit(".", 1)[-1]
