"""The input-pipeline package imports in one direction: ``trainer.data`` (the public API) imports its modules, and
no module imports a package that contains it (``trainer.data``, ``trainer.data.gpu``), the project's modules only
at module level (a function-level import is how a cycle hides), and never in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import trainer.data

PACKAGE = Path(trainer.data.__file__).parent
ROOT = PACKAGE.parents[1]  # the folder holding ``trainer/``


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def project_imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for each import of a ``trainer`` module in ``path``; ``from P
    import m`` counts as importing ``P`` and, when ``m`` is a module, ``P.m``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets = [source] + [f"{source}.{a.name}" for a in node.names if is_module(f"{source}.{a.name}")]
        else:
            continue
        found += [(t, node.lineno, node in tree.body) for t in targets if t == "trainer" or t.startswith("trainer.")]
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_package_is_what_this_test_walks():
    assert {"trainer.data", "trainer.data.cpu", "trainer.data.gpu", "trainer.data.gpu.pipeline"} <= set(MODULES)


def test_no_module_imports_a_package_that_contains_it():
    back = [f"{name} (line {line}) imports {target}"
            for name, path in MODULES.items() for target, line, _ in project_imports(path)
            if target.startswith("trainer.data") and name.startswith(target + ".")]
    assert back == []


def test_project_modules_are_imported_at_module_level():
    hidden = [f"{name} (line {line}) imports {target} inside a function or block"
              for name, path in MODULES.items() for target, line, top in project_imports(path) if not top]
    assert hidden == []


def test_no_import_cycle():
    edges = {name: sorted({t for t, _, _ in project_imports(path) if t in MODULES and t != name})
             for name, path in MODULES.items()}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(name):], name]))
        if name in done:
            return
        path.append(name)
        for target in edges[name]:
            visit(target)
        path.pop()
        done.add(name)

    for name in edges:
        visit(name)
