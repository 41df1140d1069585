"""Set-ups the tuner's tests share."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.cli import autotune


@dataclass(frozen=True)
class QuickStart:
    """The README's quick start as a user runs it: ``autotune search`` with no arguments in a fresh folder (the
    embedded cpu-demo study, its default budget), then ``autotune export best.yaml`` there."""

    folder: Path
    search: subprocess.CompletedProcess
    export: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def quick_start(tmp_path_factory) -> QuickStart:
    """One real cpu-demo search and its export for every test that reads them (the quick start's own test, the full
    run, the report): the search alone takes minutes on 2 cores. Tests only read its folder; what they write goes
    elsewhere."""
    folder = tmp_path_factory.mktemp("quick-start")
    env = {"PYTHONUNBUFFERED": "1"}
    search = autotune("search", cwd=folder, timeout=1000, env=env)
    export = autotune("export", "best.yaml", cwd=folder, env=env) if search.returncode == 0 else search
    return QuickStart(folder, search, export)
