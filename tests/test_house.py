"""The house rules that a reader of ``autotune/`` and ``trainer/`` can check without running anything (DEVELOPERS.md):
no import circle, no function over 80 lines, each DDP knob named in at most one module besides the knob table, the
config and the search's policy, ``trainer/`` never importing ``autotune/``, no module reading a script's run's private
members, and the stages' shape (no stage importing another, one table of their order). Read from the source with
``ast``: nothing is imported. (That a trial leaves ``DataLoader.__iter__`` as it found it needs a run:
``tests/trainer/test_runtime_idioms.py``.)"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the folder holding ``autotune/`` and ``trainer/``
PACKAGES = ("autotune", "trainer")
MAX_FUNCTION_LINES = 80
KNOB_HOMES = {"trainer.knobs", "trainer.config", "autotune.policy"}
"""Where a knob's facts belong: the table, the config's field and the search's policy for it; every other module
derives them from those."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))


def project_module(dotted: str) -> str | None:
    """The module of ours that importing ``dotted`` runs last: itself, or the nearest package above it that is
    one of ours (``import autotune.spec.X`` where ``X`` is a name, not a module); None outside the project."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def imports(name: str) -> set[str]:
    """Every project module ``name`` imports (``imports_in``)."""
    return imports_in(tree(name), name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0])


def imports_in(module: ast.Module, package: str) -> set[str]:
    """Every project module a module of ``package`` imports, wherever the import stands: at module level, inside a
    function, under ``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader follows). ``from P
    import m`` counts ``P.m`` when ``m`` is a module, else ``P``; relative imports are resolved against ``package``."""
    found = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parts = package.split(".")
                source = ".".join(parts[:len(parts) - (node.level - 1)] + ([source] if source else []))
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        found |= {m for t in targets if (m := project_module(t)) is not None}
    return found


def with_packages(targets: set[str]) -> set[str]:
    """The modules importing ``targets`` runs: each one's packages too (``autotune.search.progress`` runs
    ``autotune.search``'s ``__init__`` first, and whatever that imports)."""
    found = set(targets)
    for t in targets:
        parts = t.split(".")
        found |= {p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in MODULES}
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules importing it runs. A module importing a package that contains it is left out:
    Python has that package half-initialised already when the module runs (``trainer.data``'s own test forbids it
    there)."""
    return {name: {t for t in with_packages(imports(name)) if t != name and not name.startswith(t + ".")}
            for name in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative: no recursion
    limit), each sorted, sorted by their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_walk_sees_every_kind_of_import_and_finds_a_circle():
    assert {"autotune.spec", "autotune.search.engine", "trainer.knobs", "trainer.runtime"} <= set(MODULES)
    source = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import optuna\n"
        "import trainer.config\n"
        "from . import knobs, no_such_module\n"
        "from .data import files\n"
        "if TYPE_CHECKING:\n"
        "    from autotune.spec import StudySpec\n"
        "def f():\n"
        "    from autotune.search.prepare import _plan, prepare\n")
    assert imports_in(source, "trainer") == {"trainer.config", "trainer.knobs", "trainer", "trainer.data.files",
                                             "autotune.spec", "autotune.search.prepare._plan",
                                             "autotune.search.prepare"}
    assert with_packages({"autotune.search.progress"}) == {"autotune", "autotune.search", "autotune.search.progress"}
    assert circles({"a": {"b"}, "b": {"c", "a"}, "c": set(), "d": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"f"}, "f": {"e"}}) == [["a", "b", "c"],
                                                                                                ["e", "f"]]


def test_no_import_circle_among_the_modules_of_autotune_and_trainer():
    assert circles(import_graph()) == []


def test_trainer_never_imports_autotune():
    found = [f"{name} imports {t}" for name, targets in import_graph().items() if name.startswith("trainer")
             for t in sorted(targets) if t.split(".")[0] == "autotune"]
    assert found == []


def test_no_function_is_over_80_lines():
    """Counted from its ``def`` line to its last, docstring included; nested functions and methods too."""
    long = [f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
            for name in MODULES for node in ast.walk(tree(name))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (lines := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES]
    assert long == []


def ddp_knobs() -> list[str]:
    """The DDP wrapper's tuned flags: the fields of ``trainer.config.DDPConfig`` that the wrapper takes as they are
    (the process group's backend and timeout, and the flags a model needs, are not knobs)."""
    config = tree("trainer.config")
    ddp = next(n for n in config.body if isinstance(n, ast.ClassDef) and n.name == "DDPConfig")
    fields = [n.target.id for n in ddp.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return [f for f in fields if f not in ("backend", "timeout_s", "find_unused_parameters", "broadcast_buffers")]


def test_the_ddp_knobs_are_the_three_the_table_tunes():
    assert ddp_knobs() == ["bucket_cap_mb", "gradient_as_bucket_view", "static_graph"]
    table = MODULES["trainer.knobs"].read_text()
    assert all(re.search(rf"\b{k}\b", table) for k in ddp_knobs())


def test_each_ddp_knob_is_named_in_at_most_one_module_besides_the_table_and_the_config():
    """Named anywhere in a module's text (code, string, comment or docstring): a fact about a knob written outside
    the table is a copy that the next knob's author does not know to change."""
    named = {k: sorted(name for name, path in MODULES.items() if name not in KNOB_HOMES
                       and re.search(rf"\b{k}\b", path.read_text())) for k in ddp_knobs()}
    assert {k: where for k, where in named.items() if len(where) > 1} == {}


STAGES_PACKAGE = "autotune.search.stages"
PLANNER = "autotune.search.stages._planner"
"""The one module of the stages package that names the stages: its table ``STAGES`` is their order."""


def stage_modules() -> set[str]:
    """The stage modules: each module of the stages package that defines a class with a ``next`` method (a stage
    answers ``next(snapshot)``), a ``Protocol`` aside (``_ask.Step`` says what a stage is). The package itself, the
    planner and the helpers the stages share (``_ask``, ``_budget``, ``_notes``, ``_measure``, ``_ranking``: no such
    class) are not stages."""
    def is_stage(c: ast.stmt) -> bool:
        return (isinstance(c, ast.ClassDef) and not any(getattr(b, "id", None) == "Protocol" for b in c.bases)
                and any(isinstance(f, ast.FunctionDef) and f.name == "next" for f in c.body))

    return {name for name in MODULES if name.startswith(STAGES_PACKAGE + ".") and name != PLANNER
            and any(is_stage(c) for c in tree(name).body)}


def planner_table() -> list[tuple[str, str]]:
    """(name, module) of each row of the planner's ``STAGES``, in order, read from its source."""
    planner = tree(PLANNER)
    module_of = {a.asname or a.name: node.module for node in planner.body if isinstance(node, ast.ImportFrom)
                 for a in node.names}
    value = next(n.value for n in planner.body if isinstance(n, ast.AnnAssign) and n.target.id == "STAGES")
    return [(row.elts[0].value, module_of[row.elts[1].id]) for row in value.elts]


def test_no_stage_module_imports_another_and_the_planners_table_lists_each_once():
    stages = stage_modules()
    assert {"autotune.search.stages._ceiling", "autotune.search.stages._refine"} <= stages
    assert "autotune.search.stages._measure" not in stages  # a helper the stages share
    found = [f"{name} imports {t}" for name in sorted(stages) for t in sorted(imports(name)) if t in stages]
    assert found == []
    modules = [module for _, module in planner_table()]
    assert sorted(modules) == sorted(stages)


def test_only_the_planner_writes_to_a_study():
    """A stage answers a request; the planner enqueues it and records what the stages decided."""
    writes = ("enqueue_trial", "set_user_attr", "tell")
    found = [f"{name}:{node.lineno} {node.attr}" for name in MODULES if name.startswith(STAGES_PACKAGE + ".")
             and name != PLANNER for node in ast.walk(tree(name))
             if isinstance(node, ast.Attribute) and node.attr in writes]
    assert found == []


def test_the_stages_order_reads_the_same_in_the_planner_its_package_and_docs_search_md():
    names = [name for name, _ in planner_table()]
    package = ast.get_docstring(tree(STAGES_PACKAGE))
    assert re.findall(r"^\d+\. \*\*(.+?)\*\*", package, re.M) == names
    docs = (ROOT / "docs" / "search.md").read_text()
    assert [row.strip() for row in re.findall(r"^\| \d+ \| ([^|]+)\|", docs, re.M)] == names


def test_show_and_the_overview_do_not_import_the_search():
    """Not even through another module: reading a study needs the study's readings (``autotune.study``), not the
    search that made it."""
    graph = import_graph()
    for start in ("autotune.commands.show", "autotune.overview"):
        seen, todo = {start}, [start]
        while todo:
            for t in graph[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        assert sorted(m for m in seen if m.split(".")[:2] == ["autotune", "search"]) == [], start


RUN_NAMES = ("run", "_run")
"""What the project calls a script's run (``trainer.runtime.Run``) or the adapter around it, as a name or an
attribute: ``run``, ``self.run``, ``self._run``."""


def private_run_reads(module: ast.Module) -> list[str]:
    """``run._x``, ``self.run._x``, ``self.run.run._x``: a private member read (or written) through a name of a run.
    ``Run`` is composed of parts (its settings, loaders, steps, reports), each with the interface the others use;
    the run's own methods read its members through ``self``, which this does not count."""
    found = []
    for node in ast.walk(module):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id in RUN_NAMES) or \
                (isinstance(owner, ast.Attribute) and owner.attr in RUN_NAMES):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_run_reads_check_sees_each_form():
    source = ast.parse("run._applied\nself.run._mark_ready()\nself.run.run._loader = 1\nself._run._value('x')\n"
                       "run.settings()\nself._applied\nrun.__class__\ntrainer._run\n")
    assert sorted(private_run_reads(source)) == ["1: run._applied", "2: self.run._mark_ready",
                                                  "3: self.run.run._loader", "4: self._run._value"]


def test_no_module_reads_a_runs_private_members():
    found = {name: where for name in MODULES if (where := private_run_reads(tree(name)))}
    assert found == {}
