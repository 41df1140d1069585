"""Shared fixtures (generic: any test module may use them)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A test run started in the background of a script (`cmd &`) inherits SIGINT ignored, and so would every process the
# tests start: the Ctrl-C tests would send a signal nobody hears. A handled signal is reset to its default on exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _no_extras(monkeypatch):
    """The search space of every test sees a machine without NVIDIA DALI, whatever this one has: a simulated GPU
    search (and the shipped studies' golden records) must launch the same runs on CI and on a GPU machine. A test
    that wants DALI in the space patches ``autotune.space.importable`` itself; processes a test starts see the real
    machine."""
    from autotune import space

    real = space.importable
    monkeypatch.setattr(space, "importable", lambda module: module != "nvidia.dali" and real(module))


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


PG_URL_ENV = "AUTOTUNE_TEST_POSTGRES_URL"
"""A PostgreSQL server the tests may create databases on (``postgresql+psycopg://user@host:port/db``). `.ci/run`
starts one on loopback and sets it, so CI always runs the PostgreSQL tests; without it they are skipped."""


@pytest.fixture
def pg_url():
    """A fresh, empty PostgreSQL database for one test (dropped afterwards)."""
    url = os.environ.get(PG_URL_ENV)
    if not url:
        pytest.skip(f"{PG_URL_ENV} is not set (.ci/run starts a PostgreSQL server on loopback and sets it)")
    import uuid

    import sqlalchemy

    server = sqlalchemy.engine.make_url(url)
    name = f"autotune_test_{uuid.uuid4().hex[:10]}"
    admin = sqlalchemy.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
