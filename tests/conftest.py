"""Shared fixtures (generic: any test module may use them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_on_pythonpath(monkeypatch):
    """Processes started by the test (torchrun ranks) can import ``tests.helpers`` model factories."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    return REPO


@pytest.fixture(scope="session")
def tiny_jpegs(tmp_path_factory) -> Path:
    """A small ImageFolder (3 classes x 12 JPEGs, ~40 px), made once per test session."""
    from tests.jobutil import make_jpeg_folder

    return make_jpeg_folder(tmp_path_factory.mktemp("tiny-jpegs"), classes=3, per_class=12)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in an empty working directory (default storage ``./studies`` lands there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
