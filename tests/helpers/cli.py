"""Running the real `autotune` command line from tests: a fresh process with the repository on PYTHONPATH (the
trials' ranks import ``tests.helpers`` model factories) and a private data cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cli_env(cwd: Path, extra: dict | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "AUTOTUNE_CACHE": str(cwd / "cache"), **(extra or {})}


def autotune(*args, cwd: Path, timeout: int = 400, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m autotune ARGS`` to completion."""
    return subprocess.run([sys.executable, "-m", "autotune", *map(str, args)], cwd=cwd, env=cli_env(cwd, env),
                          capture_output=True, text=True, timeout=timeout)


def start_autotune(*args, cwd: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    """``python -m autotune ARGS`` in the background, stdout and stderr to ``log``."""
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "autotune", *map(str, args)], cwd=cwd, env=cli_env(cwd, env),
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
