"""The knobs: every setting a search may change, one entry each, and every fact of the job the project knows of it.

An entry (``Knob``) says what the rest of the project needs to know of a knob as the job has it: its TrainConfig
dotted path, the range it may take in the built-in image-model space, what a change of it takes (its scope), whether
a micro-batch's device memory or a compiled graph depends on it, how it reads in tables and lines, which of its
choices need a GPU, which part of the job the stages measure along it, what repairs a configuration failure that
names it, and the name under which a user's own script receives it (``trainer.runtime``) with the helper that applies
it there. Everything else derives from this table (``Table``): the tuner's search space (``autotune.space``), the
stages' grid, the labels of ``autotune show``, the OOM signature, the graph a compile is keyed by, the runtime's
settings. The tuner's policy for a knob (whether the built-in space holds it, its measuring orders, its first values,
one-off costs) is the tuner's own, keyed by the same path (``autotune.policy``). Adding a knob is adding an entry
here and one there (and, for the built-in job, the code in ``trainer/`` that applies its config field).

Readers ask for the table when they need it (``table()``, ``knob(path)``), so a test can put a table of its own in
place (``using``, ``extended``) and see a knob of its own everywhere, without touching another module.

This module imports nothing heavy: the tuner reads it without torch, and a user's script through the runtime.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

Scope = Literal["process", "model", "pipeline"]
"""What changing a setting takes: ``process``: a new process (NCCL reads its variables when its communicators are
made, the process group's backend and timeout are fixed at start); ``pipeline``: the input pipeline rebuilt (loader
workers, decode threads); ``model``: the rest, rebuilt in place (model, DDP wrapper, optimizer, precision, layout,
batch, measurement)."""

Helper = Literal["loader", "image_loader", "model", "step", "always"]
"""The runtime helper that applies a setting to a user's script (``trainer.runtime.Run``): ``loader`` (a DataLoader
argument of that name; ``image_loader`` takes them too), ``image_loader`` (the input pipelines of ``trainer.data``),
``model`` (layout, the DDP wrapper, torch.compile), ``step`` (autocast and the GradScaler, accumulation),
``always`` (set when the run starts)."""

AUTO = "auto"
"""A range end filled in per machine, where the knob says what it means (``Knob.auto``)."""

BATCH_CHOICES = (32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Powers of two and 1.5x between them: enough resolution near the memory limit without a continuous range."""


BATCH_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, *BATCH_CHOICES)
"""``BATCH_CHOICES`` continued below them in the same steps: where a user's script runs a smaller batch of its own,
its space reaches down to half of it (``autotune.space.resolve``'s ``own_batch``)."""


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""``Knob.ceiling_value`` of a knob the ceiling's measurements leave as the point or the base has it."""


@dataclass(kw_only=True)
class Range:
    """The values a knob is searched over: either ``choices`` (categorical) or ``low``/``high`` (an int or float
    range), optionally only where a condition holds. A table entry carries the built-in space's (``Knob.space``); a
    study spec's ``space.PATH`` states its own with the same fields."""

    choices: list[Any] | None = None
    """Values to pick from; ``default`` (in a spec) stands for null: the library's own choice."""

    low: Any = None
    """Range start (inclusive); ``auto`` where the knob defines it (``Knob.auto``)."""

    high: Any = None
    """Range end (inclusive); ``auto`` where the knob defines it."""

    log: bool = False
    """Sample the range on a log scale."""

    step: float | int | None = None
    """Range step (ints: default 1)."""

    when: str | None = None
    """Condition on another setting, ``"PATH OP VALUE"`` with OP one of == != > >= < <= in; the knob is only
    suggested when it holds (evaluated on the trial's config so far: searched values, else the base)."""


@dataclass(frozen=True, kw_only=True)
class GpuChoice:
    """A choice of a knob that is left out of the space on a machine without a GPU."""

    value: Any
    why: str = ""
    """The reason the note gives after ``no GPU``."""

    runs_on_cpu: bool = False
    """It runs without a GPU, only worse: kept where it is the knob's only choice."""

    module: str | None = None
    """A module the choice runs on that an extra installs: left out, GPU or not, where it does not import."""

    install: str = ""
    """The command that installs ``module``, for the note."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Knob:
    """One knob: a TrainConfig setting a search may change, and every fact of the job about it (see the module
    docstring)."""

    path: str
    """The TrainConfig setting, by dotted path."""

    label: str
    """Short label in tables and the live view; empty: the value speaks for itself (``bf16``, ``nvjpeg-gpu``)."""

    scope: Scope
    """What a change of it takes (``Scope``)."""

    doc: str = ""
    """What it is, in a phrase."""

    # ---- the space ---------------------------------------------------------------------------------------------

    space: Range | None = None
    """The built-in space's range (``None`` among the choices stands for the library's own choice)."""

    auto: Literal["cores"] | None = None
    """What ``auto`` means as an end of its range: ``cores``: as ``low`` 0, as ``high`` the CPU cores per rank.
    ``None``: ``auto`` is refused."""

    gpu_only: tuple[GpuChoice, ...] = ()
    """Choices dropped from the space on a machine without a GPU, with the note's reason."""

    needs_gpu: str | None = None
    """Not searched at all without a GPU, even where a spec names it: the note's reason."""

    batch: Literal["micro", "accum"] | None = None
    """Its part in the images of an optimizer step: ``micro``: the per-rank micro-batch (choices the data cannot
    fill are dropped; with ``fixed_global_batch`` so are those that do not divide it); ``accum``: the micro-batches
    per step (derived, not searched, under ``fixed_global_batch``)."""

    # ---- what a measurement depends on -------------------------------------------------------------------------

    memory: bool = False
    """A change moves a micro-batch's device memory enough that an OOM at batch B says nothing about batch B under
    the other value (``autotune.space.predicted_oom``)."""

    graph: bool = False
    """A compiled graph is keyed by it (``trainer.compiled.graph_key``): a trial that changes it compiles afresh."""

    # ---- how the stages measure along it -----------------------------------------------------------------------

    measured: Literal["ceiling", "supply"] | None = None
    """``ceiling``: a dimension of the ceiling's grid (the model alone is measured along it); ``supply``: the input
    pipelines measured alone, in its order."""

    value_labels: tuple[tuple[Any, str], ...] = ()
    """How a value reads in lines (default: the value itself)."""

    omitted: tuple[Any, ...] = ()
    """Values a line leaves out: eager reads ``fp16 channels_last``, not ``... eager``; NCCL's own choice is not
    mentioned."""

    ceiling_value: Any = UNSET
    """Its value while the model alone is measured (the ceiling: synthetic data on the device, no loader, one
    micro-batch per step); ``UNSET``: the grid point's or the base's."""

    defining: bool = False
    """One of the settings that tell one kind of configuration from another for the stages (its pipeline family,
    precision, layout, compile): what the refine stage holds of a good end-to-end trial while the sampler draws the
    rest, and what tells one candidate from another."""

    shown: int | None = None
    """Its place in a stage measurement's line, lower first (``autotune show``, the live view); ``None``: not shown
    there (its value is the same for every measurement)."""

    repair: tuple[Any, str] | None = None
    """A configuration failure whose message names the knob is run once more at this value: (value, why)."""

    # ---- a user's script ---------------------------------------------------------------------------------------

    runtime: str | None = None
    """The name a user's script reads it by (``trainer.runtime``); ``None``: set by the launcher for any job
    (NCCL's variables)."""

    runtime_default: Any = None
    """What a script gets that neither names the knob nor is given a value by the run: the library's own default
    (DataLoader's, DDP's, torch's), so a helper changes nothing the script did not ask for."""

    applied_by: Helper | None = None
    """The runtime helper that applies it (``Helper``); ``None``: the script reads it itself."""

    def value_label(self, value: Any) -> str:
        """How ``value`` reads in lines (``value_labels``)."""
        return dict(self.value_labels).get(value, str(value))

    def is_omitted(self, value: Any) -> bool:
        return any(value is u for u in self.omitted)  # ``is``: 0 is not False

    @property
    def gpu_values(self) -> tuple[Any, ...]:
        return tuple(g.value for g in self.gpu_only)


DALI_INSTALL = "pip install 'ddp-autotune[dali]'"
"""What installs NVIDIA DALI (``data.decode: dali``)."""

_DECODE_ON_GPU = (GpuChoice(value="nvjpeg-gpu"),
                  GpuChoice(value="hybrid", why="both of its shares would decode on the CPU"),
                  GpuChoice(value="dali", why="DALI decodes on the mixed device", module="nvidia.dali",
                            install=DALI_INSTALL))

_NOT_UNDER_DALI = "data.decode != dali"
"""DALI reads, decodes and queues the batches itself: the DataLoader's settings have no effect there."""

_KNOBS = (
    Knob(path="training.batch_size", label="bs", scope="model", space=Range(choices=BATCH_CHOICES), batch="micro",
         graph=True, shown=5, runtime="batch_size", runtime_default=1, applied_by="loader",
         doc="per-rank micro-batch"),
    Knob(path="training.accum_steps", label="acc", scope="model", space=Range(choices=(1, 2, 4)), batch="accum",
         graph=True, ceiling_value=1, runtime="accum_steps", runtime_default=1, applied_by="step",
         doc="micro-batches per optimizer step; the non-final ones run inside DDP's no_sync()"),
    Knob(path="training.precision", label="", scope="model", space=Range(choices=("fp32", "bf16", "fp16")),
         gpu_only=(GpuChoice(value="fp16", why="CPU autocast is bf16", runs_on_cpu=True),), memory=True, graph=True,
         measured="ceiling", defining=True, shown=3, runtime="precision", runtime_default="fp32", applied_by="step",
         doc="autocast dtype; fp16 adds a GradScaler"),
    Knob(path="training.channels_last", label="cl", scope="model", space=Range(choices=(False, True)), memory=True,
         graph=True, measured="ceiling", value_labels=((True, "channels_last"), (False, "NCHW")), defining=True,
         shown=4, runtime="channels_last", runtime_default=False, applied_by="model",
         doc="NHWC memory format for model and inputs"),
    Knob(path="training.compile", label="compile", scope="model", space=Range(choices=(False, True)), memory=True,
         measured="ceiling", value_labels=((False, "eager"), (True, "compiled")), omitted=(False,), defining=True,
         shown=8, runtime="compile", runtime_default=False, applied_by="model",
         doc="torch.compile; a cold compile costs about a minute on a GPU, so the stages measure it last, where "
             "the budget pays for it (on CPU ranks Inductor's C++ compile takes minutes: a spec adds it there)"),
    # None: torch's default mode; reduce-overhead: CUDA graphs for forward and backward.
    Knob(path="training.compile_mode", label="mode", scope="model", memory=True, graph=True,
         space=Range(choices=(None, "reduce-overhead"), when="training.compile == true"), runtime="compile_mode",
         applied_by="model", doc="torch.compile mode (reduce-overhead: the step's model part as CUDA graphs)"),
    Knob(path="training.cudnn_benchmark", label="cudnn_search", scope="model", space=Range(choices=(True, False)),
         shown=7, runtime="cudnn_benchmark", applied_by="always",
         doc="cuDNN's per-shape algorithm search; the ceiling stage decides it by measurement"),
    Knob(path="loader.num_workers", label="wk", scope="pipeline", space=Range(low=0, high=AUTO, when=_NOT_UNDER_DALI),
         auto="cores", ceiling_value=0, shown=6, runtime="num_workers", runtime_default=0, applied_by="loader",
         doc="DataLoader worker processes per rank"),
    Knob(path="loader.prefetch_factor", label="pf", scope="pipeline",
         space=Range(low=1, high=8, when="loader.num_workers > 0"), ceiling_value=None, runtime="prefetch_factor",
         applied_by="loader", doc="batches in flight per worker"),
    # The runtime and the built-in job pin only for a CUDA device (trainer.apply.loader_args): on CPU ranks both
    # values run the same.
    Knob(path="loader.pin_memory", label="pin", scope="pipeline",
         space=Range(choices=(True, False), when=_NOT_UNDER_DALI),
         needs_gpu="pinned memory only matters for a copy to a CUDA device", runtime="pin_memory",
         runtime_default=False, applied_by="loader", doc="page-locked host batches"),
    # A script's trials charge its epoch turns, so what they measured of kept workers stands there.
    Knob(path="loader.persistent_workers", label="pers", scope="pipeline",
         space=Range(choices=(False, True), when="loader.num_workers > 0"), ceiling_value=False,
         runtime="persistent_workers", runtime_default=False, applied_by="loader", doc="workers kept across epochs"),
    Knob(path="data.decode", label="", scope="pipeline", memory=True,
         space=Range(choices=("pil", "torchvision-cpu", "nvjpeg-gpu", "hybrid", "dali")), gpu_only=_DECODE_ON_GPU,
         measured="supply", defining=True, shown=1, runtime="decode", runtime_default="pil",
         applied_by="image_loader", doc="the input pipeline of an ImageFolder read through trainer.data"),
    # Three points span the trade: the ends (0 and 1) are nvjpeg-gpu and torchvision-cpu, already decode choices.
    Knob(path="data.hybrid_cpu_fraction", label="cpu_share", scope="pipeline",
         space=Range(choices=(0.25, 0.5, 0.75), when="data.decode == hybrid"), shown=2,
         runtime="hybrid_cpu_fraction", runtime_default=0.5, applied_by="image_loader",
         doc="hybrid decode: the share of each batch the loader workers decode"),
    # DALI's settings, searched only under its pipeline. hw_decoder_load: the share of each batch the hardware JPEG
    # engines decode, the rest on CUDA; DALI's own default is 0.65, and the best share depends on the machine: the
    # range reaches below the default for the search to find where the trade turns (autotune.policy).
    Knob(path="data.dali_hw_decoder_load", label="hw_load", scope="pipeline",
         space=Range(choices=(0.25, 0.35, 0.5, 0.65, 0.8, 0.95), when="data.decode == dali"), shown=2,
         runtime="dali_hw_decoder_load", runtime_default=0.65, applied_by="image_loader",
         doc="DALI: the share of each batch its hardware JPEG decoder takes, the rest decoded with CUDA"),
    Knob(path="data.dali_threads", label="dali_thr", scope="pipeline",
         space=Range(low=1, high=AUTO, when="data.decode == dali"), auto="cores", runtime="dali_threads",
         runtime_default=4, applied_by="image_loader",
         doc="DALI: CPU threads per rank (file reads, header parsing, the CPU stages)"),
    Knob(path="data.dali_prefetch", label="dali_q", scope="pipeline",
         space=Range(low=1, high=4, when="data.decode == dali"), runtime="dali_prefetch", runtime_default=2,
         applied_by="image_loader", doc="DALI: batches its pipeline prepares ahead (queue depth)"),
    # The CPU-Huffman share of DALI's decode costs host-to-device copies of coefficients, several times a JPEG's size.
    Knob(path="data.dali_gpu_huffman", label="gpu_huff", scope="pipeline",
         space=Range(choices=(False, True), when="data.decode == dali"),
         value_labels=((True, "gpu_huffman"), (False, "cpu_huffman")), omitted=(False,), runtime="dali_gpu_huffman",
         runtime_default=False, applied_by="image_loader",
         doc="DALI: Huffman decoding with the GPU's help for the images the hardware engines do not take"),
    # The shape of DALI's graph, each weighed like any other setting: the crop decoded alone or the whole image
    # cropped after (MLPerf's shape), float16 out under a half-precision run, the resize's antialias.
    Knob(path="data.dali_crop", label="crop", scope="pipeline", space=Range(choices=("roi", "full"),
         when="data.decode == dali"), runtime="dali_crop", runtime_default="roi", applied_by="image_loader",
         doc="DALI: decode only the random crop (roi) or the whole image, cropped on the GPU after (full)"),
    Knob(path="data.dali_half_out", label="out", scope="pipeline", graph=True,
         space=Range(choices=(False, True), when="data.decode == dali"),
         value_labels=((True, "half_out"), (False, "float_out")), omitted=(False,), runtime="dali_half_out",
         runtime_default=False, applied_by="image_loader",
         doc="DALI: float16 images out where the run computes in fp16 or bf16"),
    Knob(path="data.dali_antialias", label="aa", scope="pipeline",
         space=Range(choices=(True, False), when="data.decode == dali"),
         value_labels=((True, "antialias"), (False, "no_antialias")), omitted=(True,), runtime="dali_antialias",
         runtime_default=True, applied_by="image_loader", doc="DALI: the resize's antialias filter"),
    Knob(path="ddp.bucket_cap_mb", label="bkt", scope="model", space=Range(low=5.0, high=200.0, log=True),
         graph=True, runtime="bucket_cap_mb", runtime_default=25.0, applied_by="model",
         doc="DDP gradient bucket size"),
    Knob(path="ddp.gradient_as_bucket_view", label="gbv", scope="model", space=Range(choices=(False, True)),
         memory=True, graph=True, runtime="gradient_as_bucket_view", runtime_default=False, applied_by="model",
         doc="gradients alias the all-reduce buckets"),
    # DDP's static graph breaks under no_sync() (pytorch/pytorch#187732): only searched without accumulation, and a
    # draw that runs it with accumulation anyway runs again without it.
    Knob(path="ddp.static_graph", label="static", scope="model",
         space=Range(choices=(False, True), when="training.accum_steps == 1"), memory=True, graph=True,
         repair=(False, "DDP's static graph does not run with accumulation"), runtime="static_graph",
         runtime_default=False, applied_by="model", doc="DDP static graph"),
    # NCCL's algorithm, protocol, CTA and buffer variables (debugging variables, NCCL documents).
    *(Knob(path=f"nccl.{name}", label=label, scope="process", space=space, omitted=(None,),
           needs_gpu="gloo does not read NCCL settings")
      for name, label, space in (("algo", "algo", Range(choices=(None, "Ring", "Tree"))),
                                 ("proto", "proto", Range(choices=(None, "Simple", "LL"))),
                                 ("min_ctas", "minc", None), ("max_ctas", "maxc", None), ("buffsize", "buf", None))),
)

MEMORY_ALSO = ("model.name", "model.kwargs", "data.image_size")
"""Settings beyond the knobs that an OOM at a batch depends on: the model and the image size."""

GRAPH_ALSO = ("model.name", "model.kwargs", "data.image_size", "data.num_classes", "ddp.find_unused_parameters",
              "ddp.broadcast_buffers")
"""Settings beyond the knobs that a compiled graph is keyed by: the model, its input shape and head, the rest of the
DDP wrapper (its buckets split the graph)."""

_PROCESS_SETTINGS = frozenset({"ddp.backend", "ddp.timeout_s"})


@dataclass(frozen=True)
class Table:
    """A table of knobs and what follows from it (each view computed once per table)."""

    entries: tuple[Knob, ...]
    """In the order the built-in space suggests them."""

    def __post_init__(self):
        paths = [k.path for k in self.entries]
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            raise ValueError(f"knob table: {', '.join(twice)} listed twice")

    @cached_property
    def knobs(self) -> dict[str, Knob]:
        """Every knob by its dotted path."""
        return {k.path: k for k in self.entries}

    @cached_property
    def by_runtime_name(self) -> dict[str, Knob]:
        """The knobs a user's script can receive, by the name it reads them under."""
        return {k.runtime: k for k in self.entries if k.runtime}

    @cached_property
    def memory_settings(self) -> tuple[str, ...]:
        """Settings an OOM at a batch depends on: ``MEMORY_ALSO`` and the knobs marked ``memory``."""
        return (*MEMORY_ALSO, *(k.path for k in self.entries if k.memory))

    @cached_property
    def graph_settings(self) -> tuple[str, ...]:
        """Settings a compiled graph is keyed by: ``GRAPH_ALSO`` and the knobs marked ``graph``."""
        return (*GRAPH_ALSO, *(k.path for k in self.entries if k.graph))

    @cached_property
    def ceiling_grid(self) -> tuple[Knob, ...]:
        """The dimensions the model alone is measured along, in the order the stages explore them."""
        return tuple(k for k in self.entries if k.measured == "ceiling")

    @cached_property
    def supply(self) -> Knob | None:
        """The knob the input pipelines are measured alone along."""
        return next((k for k in self.entries if k.measured == "supply"), None)

    @cached_property
    def ceiling_fixed(self) -> dict[str, Any]:
        """What a measurement of the model alone sets, by path (``Knob.ceiling_value``)."""
        return {k.path: k.ceiling_value for k in self.entries if k.ceiling_value is not UNSET}

    @cached_property
    def defining_settings(self) -> tuple[str, ...]:
        """What the refine stage holds of a good end-to-end trial (``Knob.defining``)."""
        return tuple(k.path for k in self.entries if k.defining)

    @cached_property
    def shown(self) -> tuple[str, ...]:
        """What a stage measurement's line shows, in order (``Knob.shown``)."""
        return tuple(k.path for k in sorted((k for k in self.entries if k.shown is not None), key=lambda k: k.shown))

    @cached_property
    def repairs(self) -> tuple[Knob, ...]:
        """The knobs whose configuration failures have a repair."""
        return tuple(k for k in self.entries if k.repair is not None)

    def batch(self, role: Literal["micro", "accum"]) -> str | None:
        """The path of the knob with that part in the images of a step (``Knob.batch``)."""
        return next((k.path for k in self.entries if k.batch == role), None)

    def applied_by(self, helper: Helper) -> tuple[str, ...]:
        """The runtime names of the settings ``helper`` applies."""
        return tuple(k.runtime for k in self.entries if k.applied_by == helper and k.runtime)


SHIPPED = Table(_KNOBS)
"""The project's knobs."""

_IN_USE: list[Table] = [SHIPPED]


def table() -> Table:
    """The table every reader uses: the shipped one, unless a test put its own in place (``using``)."""
    return _IN_USE[-1]


@contextlib.contextmanager
def using(t: Table) -> Iterator[Table]:
    """Inside the block, ``table()`` is ``t`` for every reader in this process: how a test adds (``extended``) or
    replaces knobs without touching another module. Values a module derived at import (the runtime's helper
    tuples, ``trainer.data.GPU_DECODE_PATHS``) keep the shipped table's."""
    _IN_USE.append(t)
    try:
        yield t
    finally:
        _IN_USE.remove(t)


def extended(*extra: Knob) -> contextlib.AbstractContextManager[Table]:
    """``using`` the table in use with ``extra`` added (an entry with a path already in it replaces that one)."""
    paths = {k.path for k in extra}
    return using(Table((*(k for k in table().entries if k.path not in paths), *extra)))


def knob(path: str) -> Knob:
    """The knob of the dotted setting ``path``: its entry, else a plain one (the last part of its path as its label,
    its scope by section, no other fact): a spec may search any TrainConfig setting."""
    entry = table().knobs.get(path)
    if entry is not None:
        return entry
    return Knob(path=path, label=path.rsplit(".", 1)[-1], scope=_scope_by_section(path))


def _scope_by_section(path: str) -> Scope:
    section = path.split(".", 1)[0]
    if section in ("nccl", "script") or path in _PROCESS_SETTINGS:
        return "process"
    if section in ("data", "loader"):
        return "pipeline"
    return "model"


def scope_of(path: str) -> Scope:
    """What a change of the dotted setting ``path`` needs (see ``Scope``): the knob's own scope, else by section
    (``nccl``, the user's ``script`` and the process group's backend and timeout: a new process; ``data``/``loader``:
    the pipeline)."""
    return knob(path).scope


def label_of(path: str) -> str:
    """The short label of a setting in tables: the knob's, else the last part of its path."""
    return knob(path).label

