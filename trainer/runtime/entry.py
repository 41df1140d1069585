"""A user's training function as the job: ``script.entry = package.module:function``, called with no arguments,
trial after trial in one live worker (``trainer.worker``) or once in a fresh process (``python -m trainer``).

The function calls ``trainer.runtime.setup()`` as a script does; here that finds the worker's request, record
stream and process group (``trainer.runtime.request.activate``) instead of the environment's. The process group
belongs to the worker: ``setup()`` starts none and the run's ``close()`` ends none; the function's own
``dist.init_process_group`` / ``destroy_process_group`` calls are accepted as no-ops on it
(``trainer.apply.group_of_the_worker``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from trainer.apply import OWN_GROUP_FIX, group_of_the_worker
from trainer.config import ConfigError, TrainConfig
from trainer.runtime._base import ScriptError, TrialDone
from trainer.runtime.request import Active, Request, activate, last_run


def load_entry(entry: str) -> Callable[[], Any]:
    """The entry function, checked: importable, callable, and callable with no arguments. An exception the module
    raises while it is imported propagates as it is (its traceback is the script's own)."""
    module_name, _, name = entry.rpartition(":")
    try:
        module = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ConfigError([f"script.entry={entry!r}: cannot import {module_name} ({e}); is it on PYTHONPATH "
                               "(or run autotune from the folder that holds it)?"]) from None
        raise
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError([f"script.entry={entry!r}: {module_name} has no function {name}"])
    problems = signature_problems(entry, fn)
    if problems:
        raise ConfigError(problems)
    return fn


def _import_file(path: str):
    """A script file imported as a module (once per process), its folder first on ``sys.path`` as when Python runs
    it: the entry form ``path/to/train.py:main``."""
    import importlib.util
    from pathlib import Path

    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError([f"script.entry: no such file {file}"])
    name = f"_autotune_entry_{file.stem}_{abs(hash(str(file))):x}"
    if name in sys.modules:
        return sys.modules[name]
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def signature_problems(entry: str, fn: Callable) -> list[str]:
    """An entry is called with no arguments: every parameter it declares needs a default."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if required:
        return [f"script.entry={entry!r}: {fn.__name__}() requires {', '.join(required)}, but an entry is called "
                "with no arguments: give them defaults (a script's arguments arrive in sys.argv)"]
    return []


def run_entry(cfg: TrainConfig, env, writer, *, cancel: str | None = None, worker_trial: int | None = None) -> None:
    """Run the entry function once as this config's run; raises what makes the run no trial (ScriptError: it
    never reported, ended too early), so the caller records it."""
    fn = load_entry(cfg.script.entry)
    request = Request.from_config(cfg, result=writer.path, cancel=cancel)
    activate(Active(request=request, writer=writer, env=env, worker_trial=worker_trial))
    argv, sys.argv = sys.argv, [cfg.script.entry, *cfg.script.args]
    try:
        with contextlib.suppress(TrialDone), group_of_the_worker():  # TrialDone: measured, and the function went on
            try:
                fn()
            except ValueError as e:
                if "process group twice" not in str(e):
                    raise
                raise ScriptError([OWN_GROUP_FIX]) from e
        run = last_run()
        if run is None:
            raise ScriptError([f"script.entry={cfg.script.entry!r}: the function returned without calling "
                               "trainer.runtime.setup(): call it first thing, and run.report(samples, loss) after "
                               "each step"])
        problem = run.ended()
        if problem is not None:
            raise ScriptError([problem])
    finally:
        sys.argv = argv
        run = last_run()
        if run is not None:
            run.close()
        activate(None)
