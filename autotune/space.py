"""The search space: StudySpec knobs → Optuna ``trial.suggest_*`` calls → TrainConfig overrides.

Parameters are named by their TrainConfig dotted path, so a trial's params *are* its overrides (plus derived values:
the accumulation in fixed-global-batch mode). Conditional knobs (``when``) are suggested only when their condition
holds, so e.g. ``loader.prefetch_factor`` never appears on a trial with ``loader.num_workers: 0``. What a range
says is declared (and validated) in ``autotune.ranges``; this module resolves it for a machine and its data, with
the facts of the knob table (``trainer.knobs``): the choices that need a GPU, what ``auto`` means, the batch.

A batch size that ran out of memory is not tried again at a larger size with the same memory-relevant settings
(``trainer.knobs.Table.memory_settings``): such a suggestion is recorded as infeasible without launching anything.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.exceptions import SpecError
from autotune.policy import Policy, policy
from autotune.ranges import DEFAULT_CHOICE, Condition, base_kind, declared, effective, field_type, norm_choice
from trainer.knobs import AUTO, BATCH_LADDER, UNSET, Knob, Range, knob, table

if TYPE_CHECKING:
    from autotune.spec import StudySpec


@dataclass(frozen=True, kw_only=True)
class Param:
    """A knob as this search space searches it: its table entry (``trainer.knobs.Knob``: every fact about it) and
    the fixed Optuna distribution resolved for the machine and data, under the knob's dotted path."""

    knob: Knob
    kind: str
    """``categorical``, ``int`` or ``float``."""

    choices: tuple = ()
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    when: Condition | None = None

    @property
    def path(self) -> str:
        return self.knob.path

    @property
    def policy(self) -> Policy:
        """The search's policy for the knob (``autotune.policy``)."""
        return policy(self.knob.path)

    def suggest(self, trial) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.path, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.path, self.low, self.high, step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.path, self.low, self.high, step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        if self.kind == "categorical":
            return self.match(value) is not _MISSING
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not float(value).is_integer():
            return False
        return self.low <= value <= self.high

    def match(self, value: Any) -> Any:
        """The choice equal to ``value`` (25 matches 25.0, but True never matches 1), else ``_MISSING``."""
        for c in self.choices:
            if value == c and isinstance(value, bool) == isinstance(c, bool) and (value is None) == (c is None):
                return c
        return _MISSING

    def nearest(self, value: Any) -> Any:
        """The value of this knob closest to ``value``: a range's end, the nearest numeric choice, else the first."""
        if self.kind != "categorical":
            number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else self.low
            return min(max(number, self.low), self.high)
        numeric = [c for c in self.choices if isinstance(c, (int, float)) and not isinstance(c, bool)]
        if numeric and isinstance(value, (int, float)) and not isinstance(value, bool):
            return min(numeric, key=lambda c: (abs(c - value), c))
        return self.choices[0]

    def describe(self) -> str:
        if self.kind == "categorical":
            return "{" + ", ".join(_show(c) for c in self.choices) + "}"
        return f"[{self.low} .. {self.high}{' log' if self.log else ''}]"


_MISSING = object()


def _show(v: Any) -> str:
    return DEFAULT_CHOICE if v is None else str(v).lower() if isinstance(v, bool) else str(v)


@dataclass(kw_only=True)
class SearchSpace:
    params: list[Param]
    """In suggestion order (a conditional knob after the knobs its condition reads)."""

    fixed_global_batch: int | None = None
    world_size: int = 1
    notes: list[str] = dataclasses.field(default_factory=list)
    """What resolution changed (e.g. choices dropped on a CPU-only machine): printed once by ``autotune search``."""

    def by_path(self) -> dict[str, Param]:
        return {p.path: p for p in self.params}

    def active(self, p: Param, values: dict[str, Any], base: dict[str, Any]) -> bool:
        """Whether ``p`` is suggested given the ``values`` chosen so far (else the base's): its condition holds, and
        the knob its condition reads is itself active where this space searches it (``prefetch_factor`` reads
        ``num_workers``, which DALI's pipeline does not search: neither is suggested there)."""
        if p.when is None:
            return True
        read = self.by_path().get(p.when.path)
        if read is not None and read is not p and not self.active(read, values, base):
            return False
        return p.when.holds(values[p.when.path] if p.when.path in values else get_path(base, p.when.path))

    def suggest(self, trial, base: dict[str, Any], only: set[str] | None = None) -> dict[str, Any]:
        """Suggest every active knob on ``trial`` (``only``: just these); returns the overrides (suggested plus
        derived values)."""
        overrides: dict[str, Any] = {}
        for p in self.params:
            if only is not None and p.path not in only:
                continue
            if not self.active(p, overrides, base):
                continue
            overrides[p.path] = p.suggest(trial)
        return self.derive(overrides, base)

    def derive(self, overrides: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        if self.fixed_global_batch:
            micro, accum = table().batch("micro"), table().batch("accum")
            bs = overrides.get(micro, get_path(base, micro))
            overrides = {**overrides, accum: self.fixed_global_batch // (bs * self.world_size)}
        return overrides

    def settle(self, overrides: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        """``overrides`` with each conditional knob whose condition fails on the trial's config at its ``off`` value
        (``autotune.policy.Policy.off``): a draw without loader workers runs without a prefetch depth and kept workers,
        though the base (a script's own defaults) has them. The condition is the space's where it searches the knob,
        else the table's."""
        out = dict(overrides)
        by = self.by_path()
        for k in table().entries:
            off = policy(k.path).off
            if off is UNSET or (k.path not in by and (k.space is None or not k.space.when)):
                continue
            when = by[k.path].when if k.path in by else Condition.parse(k.space.when)
            if when is None:
                continue
            current = out[when.path] if when.path in out else get_path(base, when.path)
            value = out[k.path] if k.path in out else get_path(base, k.path)
            if not when.holds(current) and value != off:
                out[k.path] = off
        return out

    def baseline_params(self, spec: StudySpec, base: dict[str, Any]) -> dict[str, Any]:
        """The Optuna params of trial 0: ``spec.baseline`` where given, else the base config's value. A value the
        spec's baseline names must be in the space; a base value that is not (a minimal spec whose base never
        mentions the knob: torch's default of 4 loader workers on a machine that allows 1) is moved to the nearest
        value that is, with a note."""
        # Baseline keys whose knob this machine does not search (NCCL on a CPU) are simply not part of trial 0;
        # keys outside the spec's space at all were refused by autotune.ranges.space_problems.
        problems, out = [], {}
        for p in self.params:
            explicit = p.path in spec.baseline
            value = spec.baseline[p.path] if explicit else get_path(base, p.path)
            if isinstance(value, str) and value == DEFAULT_CHOICE:
                value = None
            if not self.active(p, out, base):
                continue
            if not p.contains(value):
                if explicit and not declared(spec, p.path, value):
                    problems.append(f"baseline.{p.path}={_show(value)}: outside the searched {p.describe()}; "
                                    f"set baseline.{p.path} to one of those")
                    continue
                near = p.nearest(value)
                whose = "the spec's baseline" if explicit else "the base's"
                self.notes.append(f"baseline: {p.path}={_show(near)} ({whose} {_show(value)} is not searched on "
                                  f"this machine and data: {p.describe()})")
                value = near
            out[p.path] = p.match(value) if p.kind == "categorical" else value
        if problems:
            raise SpecError(problems, spec.source)
        return out


    def start_params(self, spec: StudySpec) -> list[dict[str, Any]]:
        """The Optuna params of ``spec.starts`` (partial: the sampler draws the rest). Knobs this machine does not
        search are ignored; a start needing a value this machine does not offer (nvjpeg-gpu on a CPU) is left out
        with a note; a value outside the space is an error."""
        problems, out = [], []
        by, ranges = self.by_path(), effective(spec)
        for i, start in enumerate(spec.starts):
            params: dict[str, Any] = {}
            dropped = None
            for path, value in start.items():
                p = by.get(path)
                if isinstance(value, str) and value == DEFAULT_CHOICE:
                    value = None
                if p is None:
                    continue  # a knob this machine does not search (NCCL on a CPU): as for the baseline
                if not p.contains(value):
                    r = ranges.get(path)
                    if r is not None and r.choices is not None and value in [norm_choice(c) for c in r.choices]:
                        dropped = dropped or f"{path}={_show(value)} is not searched on this machine"
                    else:
                        problems.append(f"starts[{i}].{path}={_show(value)}: outside the searched {p.describe()}")
                else:
                    params[path] = p.match(value) if p.kind == "categorical" else value
            if dropped:
                self.notes.append(f"start {i} left out: {dropped}")
            elif params:
                out.append(params)
        if problems:
            raise SpecError(problems, spec.source)
        return out


def get_path(d: dict[str, Any], path: str) -> Any:
    node: Any = d
    for part in path.split("."):
        node = node[part]
    return node


# ---- resolution ----------------------------------------------------------------------------------------------------


def resolve(spec: StudySpec, *, world_size: int, nproc_per_node: int, cpu_only: bool,
            cores: int | None = None, max_batch: int | None = None, synthetic: bool = False,
            applies: set[str] | None = None, own_batch: int | None = None) -> SearchSpace:
    """The spec's space for this machine and data: ``auto`` bounds filled in, GPU-only choices dropped on a CPU
    machine, batch sizes the data cannot fill dropped (``max_batch``: training images per rank), fixed-global-batch
    filtering, knobs ordered so conditions read already-suggested values. On ``synthetic`` data there is no input
    pipeline: the default space's pipeline knobs are not searched (a spec that names one keeps it). ``applies``: a
    user's script's settings (``trainer.knobs`` runtime names): only those knobs are searched. ``own_batch``: the
    script's own batch, which the default space's batch choices then hold, with the ladder's steps down to half of it
    (``trainer.knobs.BATCH_LADDER``): its own setting and the smaller ones it may run faster at are searched too."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    machine = _Machine(world_size=world_size, nproc_per_node=nproc_per_node, cpu_only=cpu_only, cores=cores,
                       max_batch=max_batch, own_batch=own_batch)
    problems: list[str] = uninstalled(spec.base, effective(spec))
    notes: list[str] = []
    params: list[Param] = []
    for path, r in effective(spec).items():
        k = knob(path)
        if applies is not None and path in table().knobs and k.runtime not in applies:
            if path in spec.space:  # named in a spec: said, not dropped in silence
                notes.append(f"{path}: not searched (the script does not apply it"
                             + (f": it would read run.{k.runtime}" if k.runtime else "") + ")")
            continue  # a knob the script does not apply: trials would measure the same thing under other names
        if synthetic and k.scope == "pipeline" and path not in spec.space:
            notes.append(f"{path}: not searched (synthetic data: no input pipeline)")
            continue
        if cpu_only and k.needs_gpu:
            notes.append(f"{path}: not searched (no GPU: {k.needs_gpu})")
            continue
        if cpu_only and path not in spec.space and policy(path).default_space == "gpu":
            continue  # the default space's GPU-only knobs (compile: minutes of C++ compile on CPU ranks)
        param = _resolve_one(spec, k, r, machine, notes, problems)
        if param is not None:
            params.append(param)
    if problems:
        raise SpecError(problems, spec.source)
    params = _settled_conditions(params, notes, applies)
    return SearchSpace(params=_order(params, spec.source), fixed_global_batch=spec.fixed_global_batch,
                       world_size=world_size, notes=notes)


@dataclass(frozen=True, kw_only=True)
class _Machine:
    world_size: int
    nproc_per_node: int
    cpu_only: bool
    cores: int
    max_batch: int | None
    own_batch: int | None = None

    @property
    def per_rank(self) -> int:
        return max(1, self.cores // max(1, self.nproc_per_node))


def _resolve_one(spec: StudySpec, k: Knob, r: Range, machine: _Machine, notes: list[str],
                 problems: list[str]) -> Param | None:
    """One knob's range on this machine (None: nothing left of it to search)."""
    path = k.path
    when = Condition.parse(r.when) if r.when else None
    if r.choices is not None:
        choices = _machine_choices(k, [norm_choice(c) for c in r.choices], machine.cpu_only, notes)
        if k.batch == "micro":
            if machine.own_batch and path not in spec.space:
                choices = _around(choices, machine.own_batch)
            choices = _batch_choices(spec, path, choices, machine, notes, problems)
        if not choices:
            return None
        if len(choices) == 1:
            notes.append(f"{path}: one choice left ({_show(choices[0])}), not searched")
        return Param(knob=k, kind="categorical", choices=tuple(choices), when=when)
    kind, _ = base_kind(field_type(path))
    low, high = _auto("low", r.low, machine), _auto("high", r.high, machine)
    if low > high:
        problems.append(f"space.{path}: low={low} > high={high} on this machine ({machine.cores} cores, "
                        f"{machine.nproc_per_node} ranks)")
        return None
    if kind is int:
        return Param(knob=k, kind="int", low=int(low), high=int(high), log=r.log,
                     step=int(r.step) if r.step else None, when=when)
    return Param(knob=k, kind="float", low=float(low), high=float(high), log=r.log, step=r.step, when=when)


def _auto(end: str, value: Any, machine: _Machine) -> Any:
    """A range end, ``auto`` filled in as the knob defines it (``Knob.auto``: ``cores``, its one meaning; the spec's
    validation refused ``auto`` for a knob without it)."""
    if value != AUTO:
        return value
    return 0 if end == "low" else machine.per_rank


def machine_choices(path: str, *, cpu_only: bool) -> list[Any]:
    """The default choices of the knob at ``path`` that this machine can run (``_machine_choices``)."""
    k = knob(path)
    return _machine_choices(k, [norm_choice(c) for c in k.space.choices], cpu_only, [])


def _machine_choices(k: Knob, choices: list[Any], cpu_only: bool, notes: list[str]) -> list[Any]:
    """The choices this machine can run: without a GPU, none of the knob's GPU-only choices (``Knob.gpu_only``; one
    that runs on a CPU as well is kept where it is the only choice); GPU or not, none whose module (an extra's)
    does not import."""
    for g in k.gpu_only:
        if g.value not in choices:
            continue
        if cpu_only and (not g.runs_on_cpu or len(choices) > 1):
            choices.remove(g.value)
            notes.append(f"{k.path}: {_show(g.value)} dropped (no GPU{': ' + g.why if g.why else ''})")
        elif g.module and not importable(g.module):
            choices.remove(g.value)
            notes.append(f"{k.path}: {_show(g.value)} dropped ({g.module} is not installed: {g.install})")
    return choices


def uninstalled(config: dict[str, Any], searched: Any = ()) -> list[str]:
    """One problem per setting of ``config`` (not among ``searched``) whose value runs on a module an extra installs
    that is not installed here (``data.decode: dali`` without DALI): each trial would fail the same way."""
    problems = []
    for k in table().entries:
        if k.path in searched:
            continue
        try:
            value = get_path(config, k.path)
        except (KeyError, TypeError):  # not set: the config's default, which needs no extra
            continue
        for g in k.gpu_only:
            if g.module and value == g.value and not importable(g.module):
                problems.append(f"{k.path}={_show(value)} needs {g.module}, which is not installed: {g.install}")
    return problems


def importable(module: str) -> bool:
    """Whether ``module`` is installed, found without importing it (the tuner never loads DALI itself)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken one
        return False


def _settled_conditions(params: list[Param], notes: list[str], applies: set[str] | None = None) -> list[Param]:
    """Conditions this space settles: one on a searched choice that holds for every choice is dropped (the knob is
    always suggested, and suggested in its own place), one that holds for none leaves its knob out, with a note
    (DALI's settings where ``dali`` is not among the decode choices). A user's script (``applies``): a condition on a
    knob the script does not apply says nothing of its own code (its own DALI pipeline reads ``dali_threads`` with
    no ``decode`` of the project's), so it is dropped."""
    by_path = {p.path: p for p in params}
    out = []
    for p in params:
        if p.when is not None and applies is not None and p.when.path in table().knobs \
                and table().knobs[p.when.path].runtime not in applies:
            p = dataclasses.replace(p, when=None)
        read = by_path.get(p.when.path) if p.when is not None else None
        if read is None or read.kind != "categorical":
            out.append(p)
            continue
        holds = [p.when.holds(c) for c in read.choices]
        if all(holds):
            out.append(dataclasses.replace(p, when=None))
        elif not any(holds):
            notes.append(f"{p.path}: not searched (it is only searched where {p.when.path} {p.when.op} "
                         f"{_show(p.when.value)}, and no searched choice is)")
        else:
            out.append(p)
    return out


def _around(choices: list[Any], own: int) -> list[Any]:
    """The batch choices with ``own`` and the ladder's steps from half of it up to the smallest choice."""
    numeric = [c for c in choices if isinstance(c, int) and not isinstance(c, bool)]
    low = min(numeric, default=own + 1)
    extra = {b for b in BATCH_LADDER if own / 2 <= b < low} | {own}
    return sorted({*numeric, *extra}) + [c for c in choices if c not in numeric]


def _batch_choices(spec: StudySpec, path: str, choices: list[Any], machine: _Machine, notes: list[str],
                   problems: list[str]) -> list[Any]:
    """Batch sizes the data can fill (one batch per rank at least), and that divide a fixed global batch."""
    max_batch, world_size = machine.max_batch, machine.world_size
    if max_batch is not None:
        kept = [b for b in choices if not isinstance(b, int) or b <= max_batch]
        if len(kept) < len(choices):
            dropped = ", ".join(str(b) for b in choices if b not in kept)
            notes.append(f"{path}: {dropped} dropped (the data holds {max_batch} training images per "
                         "rank: not one batch)")
        if not kept:
            problems.append(f"{path}: every choice is larger than the {max_batch} training images per "
                            "rank; add images or smaller batch choices")
        choices = kept
    if spec.fixed_global_batch:
        g = spec.fixed_global_batch
        kept = [b for b in choices if isinstance(b, int) and g % (b * world_size) == 0]
        if len(kept) < len(choices):
            notes.append(f"{path}: fixed global batch {g} over {world_size} ranks keeps "
                         f"{kept or 'nothing'}")
        if not kept:
            problems.append(f"fixed_global_batch={g}: no batch choice divides it over {world_size} ranks; use a "
                            f"multiple of {world_size} x a batch choice")
        choices = kept
    return choices


def _order(params: list[Param], source: str) -> list[Param]:
    """Stable topological order: a conditional knob after the knob its condition reads."""
    by_path = {p.path: p for p in params}
    out: list[Param] = []
    state: dict[str, int] = {}

    def visit(p: Param, chain: list[str]):
        if state.get(p.path) == 2:
            return
        if state.get(p.path) == 1:
            raise SpecError([f"space: conditions form a cycle: {' -> '.join([*chain, p.path])}"], source)
        state[p.path] = 1
        if p.when is not None and p.when.path in by_path:
            visit(by_path[p.when.path], [*chain, p.path])
        state[p.path] = 2
        out.append(p)

    for p in params:
        visit(p, [])
    return out


# ---- known OOM --------------------------------------------------------------------------------------------------


def memory_signature(config: dict[str, Any]) -> str:
    """What a micro-batch's device memory depends on besides its size (``trainer.knobs.Table.memory_settings``)."""
    return json.dumps({k: get_path(config, k) for k in table().memory_settings}, sort_keys=True, default=str)


def predicted_oom(config: dict[str, Any], oom_trials: list[tuple[int, dict[str, Any]]]) -> int | None:
    """The number of an earlier trial that ran out of memory at a batch <= this one's with the same memory-relevant
    settings, or None."""
    batch = table().batch("micro")
    sig, bs = memory_signature(config), get_path(config, batch)
    for number, other in oom_trials:
        if memory_signature(other) == sig and get_path(other, batch) <= bs:
            return number
    return None
