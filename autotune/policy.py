"""The search's policy for each knob: what the tuner assumes and prefers of it, one entry per knob, keyed by the path
of its entry in the knob table (``trainer.knobs``, the job's facts of it: its type, scope, range, who applies it).

An entry (``Policy``) holds priors, never answers: whether the knob is in the built-in space, the order the stages
measure its values in (the likeliest fastest first), what a value costs once before anything is measured, its value
in the stages' first end-to-end trial, its value where its range's condition fails, what an exported full run sets
it to, and whether training itself depends on it. A knob without an entry here (a test's own, or a setting a spec
names) has the default policy: in the built-in space where the table has it, no order, no cost.

The stages read a knob through ``Searched`` (``ceiling_grid``, ``supply``): its table entry and its policy under the
attribute names of either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Literal

from trainer.knobs import UNSET, Knob, Table, table


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The search's policy for one knob (see the module docstring)."""

    path: str
    """The knob's dotted path, as the knob table has it."""

    default_space: bool | Literal["gpu"] = True
    """Part of the built-in image-model space (``autotune.ranges.default_space``); ``"gpu"``: there on GPU machines
    only (a spec that names it searches it anywhere); otherwise a spec adds it."""

    gpu_order: tuple[Any, ...] = ()
    """Measuring order on GPUs, the likeliest fastest first: a prior, never an answer (it decides only what is
    measured first and, once a step along it measures clearly slower, what is left out as dominated)."""

    cpu_order: tuple[Any, ...] = ()
    """Measuring order on CPU ranks."""

    trains: bool = False
    """Whether the model trains depends on its value: end-to-end trials that diverged at a value, none of which
    trained, rule the value out at every other setting."""

    one_off_s: float | None = None
    """What a value after the first costs once, on its first run in a worker (torch.compile: the compile), before
    anything is measured: seconds, a prior the stage planner uses until a run of it says what it cost. Such a
    dimension is measured last, and only where the budget left pays for the cost and for end-to-end trials after it
    (``autotune.search.stages._budget.Spend.affords_one_off``)."""

    one_off_attr: str | None = None
    """The trial attribute a run records that one-off cost in (``compile_s``)."""

    one_off_cached_share: float | None = None
    """What the first run pays where this machine already paid the cost for the same graph (torch.compile loading it
    from the on-disk caches; ``trainer.compile_costs`` records each compile), as a share of what it paid then: a
    prior the planner uses until a run from the caches says what it cost. ``None``: nothing is cached."""

    first: Any = UNSET
    """Its value in the stages' first end-to-end trial of a pipeline its range is searched under (a candidate), where
    measurement found one value the likeliest fastest; ``UNSET``: the base's (the sampler weighs it afterwards)."""

    first_share: float | None = None
    """For a range that ends at the CPU cores per rank (``auto="cores"``): its value in that first end-to-end trial
    as this share of its most (the pipeline alone still takes them all: what it can feed, with no model beside it);
    ``None``: its most there too."""

    off: Any = UNSET
    """Its value where the condition of its range (``Range.when``) does not hold: what the setting is without the
    thing it needs (no prefetch depth and no kept workers without loader workers). A trial whose condition fails
    takes it, whatever the base holds (a script's own ``prefetch_factor=2`` under a draw of ``num_workers=0``);
    ``UNSET``: the base's value stands."""

    full_run: tuple[Any, str] | None = None
    """(value, why) for a setting the built-in job's trials cannot observe but a run of many epochs pays for: an
    exported full run takes this value where its range's condition holds, and the export says why."""

    def order(self, choices: list[Any], on_gpu: bool) -> list[Any]:
        """``choices`` in measuring order here (those the order does not know last, as given)."""
        prior = list(self.gpu_order if on_gpu else self.cpu_order)
        return sorted(choices, key=lambda c: prior.index(c) if c in prior else len(prior) + choices.index(c))


_POLICIES = (
    Policy(path="training.batch_size"),
    Policy(path="training.accum_steps"),
    # Lower precision runs on tensor cores; on CPU ranks fp32 is the native arithmetic, and CPU autocast is bf16.
    Policy(path="training.precision", gpu_order=("fp16", "bf16", "fp32"), cpu_order=("fp32", "bf16", "fp16"),
           trains=True),
    # channels_last is the tensor cores' native convolution layout; on CPU ranks NCHW is the native one.
    Policy(path="training.channels_last", gpu_order=(True, False), cpu_order=(False, True)),
    # Eager first on both: a cold compile makes the first ceiling many times longer than an eager one, and the first
    # end-to-end answer waits on that ceiling. From the on-disk caches a fresh process compiles the same graph in a
    # small share of the cold time (one_off_cached_share; docs/benchmarks.md). On CPU ranks Inductor's C++ compile
    # takes minutes: a spec adds it there.
    Policy(path="training.compile", default_space="gpu", gpu_order=(False, True), cpu_order=(False, True),
           one_off_s=60.0, one_off_attr="compile_s", one_off_cached_share=0.15),
    # CUDA graphs barely speed up the model alone, and fed by a real input pipeline the job runs slower with them;
    # the autotuning modes cost minutes of compile per graph (docs/benchmarks.md): a spec adds them.
    Policy(path="training.compile_mode", default_space=False),
    # The ceiling stage decides cuDNN's algorithm search by measurement.
    Policy(path="training.cudnn_benchmark", default_space=False),
    # End to end the rank's own processes (the training loop, the pinning thread, a GPU decode's host work) need
    # cores beside the loader's workers: the first candidate leaves them a quarter, and the climb settles the count.
    Policy(path="loader.num_workers", first_share=0.75),
    Policy(path="loader.prefetch_factor", off=None),
    Policy(path="loader.pin_memory"),
    # The built-in job's trials read one endless stream of epochs, so kept and restarted workers measure alike; a
    # run of many epochs restarts them at every epoch unless they are kept.
    Policy(path="loader.persistent_workers", off=False,
           full_run=(True, "the trials stream their epochs without restarting the loader's workers, so they measure "
                           "kept and restarted workers alike; a run of many epochs restarts them at every epoch")),
    # Decode on the GPU first where there is one (it does not compete with the loader workers for cores): DALI's fused
    # decode + crop on the hardware engines and CUDA (what MLPerf's ResNet-50 submissions feed NVIDIA GPUs with),
    # nvJPEG's CUDA decoder, then decode to tensors on the CPU, then PIL.
    Policy(path="data.decode", gpu_order=("dali", "nvjpeg-gpu", "hybrid", "torchvision-cpu", "pil"),
           cpu_order=("torchvision-cpu", "pil")),
    Policy(path="data.hybrid_cpu_fraction"),
    # End to end a share of the hardware JPEG engines below DALI's default (0.65) feeds the model fastest, though the
    # engines alone decode the most at the highest share: the more they decode, the longer the model waits
    # (docs/benchmarks.md). The candidate starts at 0.35.
    Policy(path="data.dali_hw_decoder_load", first=0.35),
    # DALI threads on every core starve the training process of CPU; about half of the cores is faster end to end,
    # and a few threads too few to feed the model (docs/benchmarks.md): the candidate starts at half.
    Policy(path="data.dali_threads", first_share=0.5),
    # The fastest DALI configurations queue 3 or 4 batches, slower ones 1 or 2 (docs/benchmarks.md): the candidate
    # starts at 3.
    Policy(path="data.dali_prefetch", first=3),
    # With the GPU's help in Huffman decoding both the job and its pipeline alone run slower (docs/benchmarks.md):
    # out of the default space; a spec adds it.
    Policy(path="data.dali_gpu_huffman", default_space=False),
    Policy(path="data.dali_crop"),
    Policy(path="data.dali_half_out"),
    Policy(path="data.dali_antialias"),
    Policy(path="ddp.bucket_cap_mb"),
    Policy(path="ddp.gradient_as_bucket_view"),
    Policy(path="ddp.static_graph"),
    # NCCL's algorithm, protocol, CTA and buffer variables: NCCL documents them as debugging variables, no
    # measurement here has shown them to matter, and each change takes a new process: a spec adds them.
    *(Policy(path=f"nccl.{name}", default_space=False) for name in ("algo", "proto", "min_ctas", "max_ctas",
                                                                      "buffsize")),
)

POLICIES: dict[str, Policy] = {p.path: p for p in _POLICIES}
"""The search's policy for each knob of the shipped table, by path."""


def policy(path: str) -> Policy:
    """The search's policy for the knob at ``path``: its entry, else the default policy (in the built-in space where
    the table in use has the knob: a test's own; not for a setting only a spec names)."""
    return POLICIES.get(path) or Policy(path=path, default_space=path in table().knobs)


_OWN = frozenset({f.name for f in fields(Policy)} - {"path"} | {"order"})


@dataclass(frozen=True)
class Searched:
    """A knob as the search reads it: its table entry (``knob``: the job's facts) and its policy (``policy``: the
    tuner's), each attribute from whichever holds it (``d.path``, ``d.value_label(x)``, ``d.one_off_s``,
    ``d.order(choices, on_gpu)``)."""

    knob: Knob
    policy: Policy

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("knob", "policy"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.policy if name in _OWN else self.knob, name)


def searched(k: Knob) -> Searched:
    return Searched(k, policy(k.path))


@functools.lru_cache(maxsize=8)
def _views(t: Table) -> tuple[tuple[Searched, ...], Searched | None]:
    return tuple(searched(k) for k in t.ceiling_grid), searched(t.supply) if t.supply is not None else None


def ceiling_grid() -> tuple[Searched, ...]:
    """The dimensions the model alone is measured along (``trainer.knobs.Table.ceiling_grid``), with their policy."""
    return _views(table())[0]


def supply() -> Searched | None:
    """The knob the input pipelines are measured alone along (``trainer.knobs.Table.supply``), with its policy."""
    return _views(table())[1]
