"""`autotune dashboard`: optuna-dashboard on a real SQLite study, on loopback, stopped cleanly; a one-line hint when
the package is missing."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

from tests.helpers.cli import cli_env

UNBUFFERED = {"PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_dashboard_serves_the_study_on_loopback_and_stops(tmp_path, stop):
    pytest.importorskip("optuna_dashboard", reason="the `dashboard` extra (pip install 'ddp-autotune[dashboard]')")
    storage = f"sqlite:///{tmp_path / 'd.db'}"
    study = optuna.create_study(study_name="dash-study", storage=storage, direction="maximize")
    study.optimize(lambda t: t.suggest_int("training.batch_size", 8, 64), n_trials=3)

    proc = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--storage", storage, "--port", "0"],
                            cwd=tmp_path, env=cli_env(tmp_path, UNBUFFERED), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the socket is bound
        m = re.search(r"http://127\.0\.0\.1:(\d+)/dashboard", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        port = int(m.group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=30) as resp:
            body = json.load(resp)
        names = [s["study_name"] for s in body["study_summaries"]]
        assert names == ["dash-study"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/dashboard", timeout=30) as resp:
            assert resp.status == 200 and b"<html" in resp.read().lower()
        # Loopback only: the port is not reachable on another local address of this host.
        listening = _listening_addresses(port)
        assert listening == {"127.0.0.1"}, listening
        t = time.monotonic()
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "dashboard stopped" in out and time.monotonic() - t < 10
    assert "Traceback" not in err


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp, IPv4)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # 0A: LISTEN
            found.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_missing_package_gives_the_install_hint(tmp_path):
    # `sys.modules[name] = None` is how Python itself spells "this module cannot be imported".
    code = ("import sys; sys.modules['optuna_dashboard'] = None; from autotune.cli import main; "
            "sys.exit(main(['dashboard', '--storage', 'sqlite:///x.db']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(tmp_path, UNBUFFERED),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip() == ("autotune dashboard: error: optuna-dashboard is not installed: "
                                "pip install 'ddp-autotune[dashboard]'")
    assert not (tmp_path / "x.db").exists()  # nothing was created on the way to the hint


def test_missing_database_is_one_line_and_not_created(tmp_path):
    pytest.importorskip("optuna_dashboard", reason="the `dashboard` extra (pip install 'ddp-autotune[dashboard]')")
    r = subprocess.run([sys.executable, "-m", "autotune", "dashboard", "--storage", "sqlite:///nope.db"],
                       cwd=tmp_path, env=cli_env(tmp_path, UNBUFFERED), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such database" in r.stderr
    assert not (tmp_path / "nope.db").exists()
