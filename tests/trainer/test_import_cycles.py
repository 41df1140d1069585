"""The job's modules import in one direction: no cycle among the modules of ``trainer/``, counting every import of
a module — at module level, inside a function, under ``TYPE_CHECKING`` (each is how a cycle hides)."""

from __future__ import annotations

import ast
from pathlib import Path

import trainer

ROOT = Path(trainer.__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((ROOT / "trainer").rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The ``trainer`` modules ``name`` imports anywhere in its file (``from P import m``: ``P.m`` when that is a
    module, else ``P``); a package a module sits in is not counted (Python imports it first anyway)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def test_the_walk_sees_the_job_the_runtime_and_the_applier():
    edges = {name: imported(name, path) for name, path in MODULES.items()}
    assert {"trainer.apply", "trainer.records", "trainer.runtime.request"} <= set(MODULES)
    assert {"trainer.apply", "trainer.records"} <= edges["trainer.job"] & edges["trainer.runtime._run"]


def test_no_import_cycle_among_the_modules_of_trainer():
    edges = {name: sorted(imported(name, path)) for name, path in MODULES.items()}
    done, stack = set(), []

    def visit(name):
        if name in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(name):], name]))
        if name in done:
            return
        stack.append(name)
        for target in edges[name]:
            visit(target)
        stack.pop()
        done.add(name)

    for name in edges:
        visit(name)
