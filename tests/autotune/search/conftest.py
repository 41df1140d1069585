"""Fixtures the search tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def two_cores(monkeypatch):
    """The space of a 2-core machine (CI's), whatever this one has: loader workers [0 .. 1] per rank."""
    import autotune.space

    monkeypatch.setattr(autotune.space.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(autotune.space.os, "cpu_count", lambda: 2)
