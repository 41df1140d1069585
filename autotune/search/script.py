"""A user's own training script as the job (``autotune search --script train.py [-- ARGS]``).

The script imports ``trainer.runtime`` and owns its loop; what the tuner may change is only what the script
applies (a setting it reads, or one a runtime helper applies). That is known only once the script ran, so the
search's first trial — trial 0, the script with its own defaults — runs before the study is touched (the *probe*):
a script that does not exist, fails at import or on its first step, never reports a step, or ignores a setting it
declared costs one line naming the fix and leaves no study behind. Its ``settings`` record says what the script
applies, with its defaults, its unit, and whether its loader goes through the runtime (then its supply and its
ceiling can be measured like the built-in job's); the study records all of it, and the space searches only those
knobs. A resumed study reads them back instead of probing again.

``path.py`` runs in a fresh ``torchrun`` per trial; ``path.py:function`` or ``package.module:function`` runs trial
after trial in one live worker (the trainer calls the function).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Any

from autotune.exceptions import AutotuneError
from autotune.hw.nvml import Sampler
from autotune.runner.trial import TrialJob, TrialRun, run_trial
from autotune.search.evaluate import TRIAL_0, baseline_measure
from autotune.spec import StudySpec
from autotune.study.view import Stage
from autotune.verdict import ending, judge, script_fix
from trainer.knobs import table
from trainer.protocol import Failure, Kind

PROBE_KEY = "script"
"""The study attr holding what the probe found: ``{applies: {name: default}, unit, loader}``."""

BASE_SPEC: dict[str, Any] = {
    "description": "a user's own training script",
    "budget": {"trials": 16, "trial_timeout_s": 300},
    "sampler": {"kind": "tpe", "seed": 0, "n_startup_trials": 6},
}
"""A script study's spec besides the script and its measurement: a modest budget."""

MEASURE = {"warmup_min_steps": 5, "warmup_max_s": 60, "window_s": 0.25, "precision": 0.03, "max_s": 30}
"""The measurement protocol of a script's trials: windows of a quarter second until the figure is known within ±3 %,
for at most 30 s (a script's own DataLoader restarts every epoch, and its rounds vary: it takes longer to know)."""

CPU_MEASURE = {"warmup_min_steps": 3, "warmup_max_s": 30, "window_s": 0.5, "precision": 0.03, "max_s": 6}
"""On a machine without GPUs: a CPU trial should take seconds, not minutes, so it ends within ±3 % or after 6 s of
windows with its interval as it is (a demo's figure; what a GPU search is for takes ``MEASURE``)."""


class ScriptError(AutotuneError):
    """The script cannot be tuned as it is: a missing file, a first run that failed, nothing reported."""


@dataclasses.dataclass(kw_only=True)
class Probe:
    """What trial 0 found out about the script."""

    applies: dict[str, Any]
    """The settings it applies, by runtime name, with the values it ran with (its defaults)."""

    unit: str = "samples"
    loader: bool = False
    """Its loader goes through the runtime: its supply (the loader alone) and its ceiling (its first batch replayed
    on the device) can be measured."""

    samples_per_rank: int | None = None
    """What one rank's loader holds per epoch, when it can tell: no batch larger is tried."""

    image_folder: dict[str, Any] | None = None
    """Where the script's own Dataset is an image folder of JPEGs (torchvision's ImageFolder): its ``path`` and, where
    its transform says, the crop (``image_size``); the project's pipelines could read the same files
    (``autotune.search.stages._folder``)."""

    run: TrialRun | None = None
    samples: list | None = None
    """The NVML samples of the probe's run (a fresh probe; None when read back from a study)."""

    def record(self) -> dict[str, Any]:
        return {"applies": self.applies, "unit": self.unit, "loader": self.loader,
                "samples_per_rank": self.samples_per_rank, "image_folder": self.image_folder}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Probe:
        folder = data.get("image_folder")
        return cls(applies=dict(data.get("applies") or {}), unit=data.get("unit") or "samples",
                   loader=bool(data.get("loader")), samples_per_rank=data.get("samples_per_rank"),
                   image_folder=dict(folder) if isinstance(folder, dict) and folder.get("path") else None)


def parse_script(script: str) -> tuple[str | None, str | None]:
    """(path, entry) of ``--script``: ``train.py`` is a path; ``train.py:main`` and ``pkg.mod:main`` are entries."""
    if re.fullmatch(r"[\w.]+:\w+", script) and not script.split(":")[0].endswith(".py"):
        return None, script
    if ":" in script and script.rsplit(":", 1)[0].endswith(".py"):
        file, fn = script.rsplit(":", 1)
        return None, f"{Path(file).expanduser().resolve()}:{fn}"
    return str(Path(script).expanduser().resolve()), None


def check(script: str) -> None:
    """What can be told before anything runs: the file or module exists, its source parses, and it defines the
    function named (read, not imported: a first run would take torchrun's start and the script's imports to say the
    same)."""
    path, entry = parse_script(script)
    if path is not None:
        if not Path(path).is_file():
            raise ScriptError(f"--script {script}: no such file; give the path of a Python script that imports "
                              "trainer.runtime (examples/seed_ddp.py is one)")
        _check_source(script, Path(path), None)
        return
    module, fn = entry.rsplit(":", 1)
    if module.endswith(".py"):
        if not Path(module).is_file():
            raise ScriptError(f"--script {script}: no such file {module}")
        _check_source(script, Path(module), fn)
        return
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ScriptError(f"--script {script}: cannot find module {module}; is it on PYTHONPATH (or give the file: "
                          "path/to/file.py:function)?")
    if found.origin and found.origin.endswith(".py"):
        _check_source(script, Path(found.origin), fn)


def _check_source(script: str, file: Path, fn: str | None) -> None:
    """The script's source parses and, for an entry, binds ``fn`` outside any function or class body (a ``def``, a
    class, an import, any name stored at module level, under ``if``/``try``/``with``/``for`` alike). Where the module
    could bind names unseen (a star import, ``globals()``, a module ``__getattr__``), it passes: a wrong refusal would
    stop a script that runs."""
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except SyntaxError as e:
        raise ScriptError(f"--script {script}: {file.name}, line {e.lineno}: {e.msg}") from None
    if fn is None:
        return
    names: set[str] = set()
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # what its body binds is not the module's
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)  # a star import adds "*"
        elif isinstance(node, ast.Name) and (isinstance(node.ctx, ast.Store) or node.id == "globals"):
            names.add(node.id)
        todo.extend(ast.iter_child_nodes(node))
    if fn in names or names & {"*", "globals", "__getattr__"}:
        return
    defs = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    have = f"its functions: {', '.join(defs)}" if defs else "it defines no function at its top level"
    raise ScriptError(f"--script {script}: {file.name} has no function {fn} ({have})")


def study_name(script: str) -> str:
    """A script study's default name: ``script-<file stem>`` for a file run in a fresh torchrun per trial,
    ``script-<stem>-<function>`` for a function on a live worker (``train.py:main``, ``pkg.mod:main``). Two names:
    the two forms' trials do not compare (the function pays torchrun, imports and set-up once, the file per
    trial)."""
    path, entry = parse_script(script)
    if path is not None:
        name = Path(path).stem
    else:
        module, fn = entry.rsplit(":", 1)
        name = f"{Path(module).stem if module.endswith('.py') else module.rsplit('.', 1)[-1]}-{fn}"
    return f"script-{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}"


SPEC_KEYS = ("name", "description", "space", "default_space", "fixed_global_batch", "starts", "budget", "sampler",
             "pruner", "stages", "objective", "world", "base")
"""What a spec for a script may set (``--script train.py --spec mine.yaml``): its space, budget and search; of its
``base``, the measurement only. The script builds its own model, data and optimizer, and trial 0 is the script
with its own defaults: a spec's ``baseline``, ``data`` or ``export`` would mean nothing to it."""


def script_spec(script: str, args: list[str], name: str | None = None, *, gpu: bool = True,
                spec: str | None = None) -> StudySpec:
    """The study spec of ``--script script``: a modest budget and the script's measurement protocol, with what
    the spec file ``spec`` (a YAML path) sets over it."""
    path, entry = parse_script(script)
    data: dict[str, Any] = {**BASE_SPEC, "name": study_name(script),
                            "base": {"data": {"kind": "script"}, "measure": MEASURE if gpu else CPU_MEASURE}}
    source = f"--script {script}"
    if spec is not None:
        data = _with_script_spec(data, spec)
        source = f"{source} --spec {spec}"
    data["base"]["script"] = {"path": path, "entry": entry, "args": list(args)}
    if name:
        data["name"] = name
    return StudySpec.from_dict(data, source=source)


def _with_script_spec(data: dict[str, Any], spec: str) -> dict[str, Any]:
    from autotune.exceptions import SpecError
    from autotune.spec import find_spec
    from trainer.config import ConfigError, load_yaml_mapping

    try:
        given = load_yaml_mapping(find_spec(spec))
    except ConfigError as e:
        raise SpecError([x.split(": ", 1)[-1] for x in e.problems], spec) from None
    problems = [f"{k}: not for a script (it builds its own model, data and optimizer, and trial 0 runs its own "
                f"defaults); a script's spec sets {', '.join(SPEC_KEYS[:-1])} and base.measure" for k in given
                if k not in SPEC_KEYS]
    base = given.get("base") or {}
    problems += [f"base.{k}: not for a script; of base, a script's spec sets measure only" for k in
                 (base if isinstance(base, dict) else {"": None}) if k != "measure"]
    if problems:
        raise SpecError(problems, spec)
    # A section it sets in part keeps the script study's other values (its sampler's start-up trials, say).
    out = {**data, **{k: {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
                      for k, v in given.items() if k != "base"}}
    out["base"] = {**data["base"], "measure": {**data["base"]["measure"], **(base.get("measure") or {})}}
    return out


def probe(plan, logs: Path, say, *, pool=None) -> Probe:
    """Trial 0 in a fresh process: the script with its own defaults (the run sets nothing). Raises ScriptError,
    naming the fix, when it cannot stand as a trial. ``pool`` (``autotune.runner.pool.WorkerPool``): a function's
    trial 0 starts a worker of the pool, which the trials after it run on; without one, a process of its own."""
    # Measured as trial 0 is for every job: to the baseline's precision, with its longer cap.
    cfg = plan.base.with_overrides({**baseline_measure(plan.base.measure), "name": f"{plan.name}-trial-0",
                                    "output_dir": str(logs / "trial-0")})
    job = TrialJob(config=cfg, trial_dir=logs / "trial-0", nproc_per_node=plan.nproc,
                   gpus=[g.uuid for g in plan.gpus] if plan.gpus else plan.entries,
                   torchrun_args=list(plan.torchrun.args), timeout_s=plan.trial_timeout_s)
    say(f"autotune: trial 0 runs the script with its own defaults, to learn what it applies "
        f"(log: {job.trial_dir / 'log.txt'})")
    sampler = Sampler(plan.nvml, plan.gpus).start()
    try:
        run = run_trial(job) if pool is None else pool.run(job, fresh=TRIAL_0)
    finally:
        samples = sampler.stop()
    settings = run.of_kind(Kind.SETTINGS)
    # judge, not ending: a first run whose loss left the finite numbers is no baseline, and each trial would too.
    if not judge(run).ok or run.summary is None or not settings:
        raise ScriptError(failure_line(run, plan.options.script))
    found = settings[-1]
    applies = {name: value for name, value in (found.get("applied") or {}).items() if name in table().by_runtime_name}
    folder = found.get("image_folder")
    return Probe(applies=applies, unit=found.get("unit") or "samples", loader=bool(found.get("loader")),
                 samples_per_rank=found.get("samples_per_rank"), run=run, samples=samples,
                 image_folder=folder if isinstance(folder, dict) and folder.get("path") else None)


def known(storage, name: str) -> Probe | None:
    """What an existing study's probe found (a resumed search probes no more), or None."""
    import optuna

    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return None
    found = study.user_attrs.get(PROBE_KEY)
    return Probe.from_record(found) if isinstance(found, dict) else None


def failure_line(run: TrialRun, script: str) -> str:
    """One line for a first run that cannot stand as a trial: what happened, where the whole story is."""
    log = run.log_path
    v = ending(run)
    if v.ok and run.summary is not None:
        v = judge(run)  # its figure does not stand (a loss that left the finite numbers)
    if v.ok and run.summary is None:
        if not run.of_kind(Kind.START):
            why = ("it never called trainer.runtime.setup() (or ended before it): call `run = runtime.setup(...)` "
                   "first thing")
        else:
            why = "it ended without a summary"
    elif v.failure == Failure.HANG and not run.of_kind(Kind.FIRST_STEP):
        why = f"{v.reason}; does it call run.report(samples, loss) after each step?"
    elif v.failure in (Failure.HANG, Failure.SLOW):
        why = f"{v.failure}: {v.reason}; {v.fix}"
    else:
        fix = script_fix(v)
        why = f"{v.failure}: {v.reason}" + (f"; {fix}" if fix else "")
    return f"--script {script}: its first run (trial 0, its own defaults) failed: {why} (log: {log})"


def apply(plan, found: Probe):
    """The plan of a script study once its probe is known (a new ``Plan``: the one given is not changed): the base
    carries the script's defaults and the settings it applies, the space searches only those."""
    from autotune.space import resolve

    overrides = {table().by_runtime_name[n].path: v for n, v in found.applies.items()}
    overrides["script.applies"] = sorted(found.applies)
    base = plan.base.with_overrides(overrides)
    space = resolve(plan.spec, world_size=plan.world, nproc_per_node=plan.nproc, cpu_only=not plan.entries,
                    applies=set(found.applies), max_batch=found.samples_per_rank,
                    own_batch=found.applies.get(table().knobs[table().batch("micro")].runtime))
    # trial 0 has run: the baseline trial records it instead of running it again
    preloaded = {**plan.preloaded, Stage.BASELINE: (found.run, found.samples or [])} if found.run is not None else \
        plan.preloaded
    return dataclasses.replace(plan, base=base, probe=base, space=space, script=found, preloaded=preloaded,
                               baseline=baseline_params(space, base.to_dict()), measures_ceiling=found.loader,
                               measures_supply=found.loader)


def baseline_params(space, base: dict[str, Any]) -> dict[str, Any]:
    """Trial 0's Optuna params: what the script ran with, where the space holds it. Unlike the built-in job's
    baseline, nothing is moved into the space: trial 0 has run already, with the script's own values (a value the
    space does not hold is in the trial's config, not among its params)."""
    from autotune.space import get_path

    params: dict[str, Any] = {}
    for p in space.params:
        if not space.active(p, params, base):
            continue
        value = get_path(base, p.path)
        if p.contains(value):
            params[p.path] = p.match(value) if p.kind == "categorical" else value
        else:
            space.notes.append(f"trial 0 ran the script's {p.path}={value}, which this machine's space "
                               f"{p.describe()} does not hold")
    return params
