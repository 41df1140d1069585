"""The launcher's process tree: what a stopped job leaves in its log."""

import re
import sys
import time

from autotune.runner.process import ProcessTree, processes_in

STALLED_WORKER = """
import multiprocessing, os, sys, time
from trainer.exit_signals import stacks_on_sigterm

def worker_waits_for_ever(started):
    started.set()
    while True:
        time.sleep(0.05)

if __name__ == "__main__":
    stacks_on_sigterm()
    ctx = multiprocessing.get_context("fork")  # as a DataLoader's workers start on Linux
    started = ctx.Event()
    ctx.Process(target=worker_waits_for_ever, args=(started,), daemon=True).start()
    started.wait()
    print("ready", flush=True)
    ctx.Queue().get()  # the rank, waiting for a batch that never comes
"""


def test_a_stopped_rank_and_its_stalled_loader_worker_each_leave_their_stack_in_the_log(tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    script.write_text(STALLED_WORKER)
    log = tmp_path / "log.txt"
    with open(log, "wb") as out:
        tree = ProcessTree([sys.executable, str(script)], env={"RANK": "1", "PYTHONPATH": ":".join(sys.path)},
                           log=out)
        deadline = time.monotonic() + 60
        while b"ready" not in log.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"ready" in log.read_bytes(), log.read_text()
        tree.scan()
        assert tree.kill() == []
    text = log.read_text()
    blocks = re.split(r"^---- (.+) \(pid \d+\) was stopped; its threads were here ----$", text, flags=re.M)
    # The rank first, then its worker, each in a block of its own: where the rank waits, and where its worker does.
    assert blocks[1::2] == ["rank 1", "rank 1's loader worker"], text
    assert "in get" in blocks[2] and "worker_waits_for_ever" not in blocks[2]
    assert "in worker_waits_for_ever" in blocks[4]
    assert processes_in(tree.groups) == [] and not tree.stacks.exists()


FRAMEWORK_HANDLER = """
import os, signal, sys, time
from trainer.exit_signals import rearm, stacks_on_sigterm

def framework_waits():
    print("ready", flush=True)
    while True:
        time.sleep(0.05)

if __name__ == "__main__":
    stacks_on_sigterm()
    # As Lightning does as its fit begins: a SIGTERM handler of its own, in Python, replacing the stack printer.
    signal.signal(signal.SIGTERM, lambda *_: (print("framework handler ran", flush=True), sys.exit(1)))
    if sys.argv[1] == "rearm":
        rearm()
    framework_waits()
"""


def test_a_frameworks_own_sigterm_handler_still_runs_after_the_rearmed_stack_printer(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(FRAMEWORK_HANDLER)
    for how in ("rearm", "none"):
        log = tmp_path / f"log-{how}.txt"
        with open(log, "wb") as out:
            tree = ProcessTree([sys.executable, str(script), how], env={"RANK": "0", "PYTHONPATH": ":".join(sys.path)},
                               log=out)
            deadline = time.monotonic() + 60
            while b"ready" not in log.read_bytes() and time.monotonic() < deadline:
                time.sleep(0.05)
            tree.scan()
            assert tree.kill() == []
        text = log.read_text()
        assert "framework handler ran" in text, text  # the framework's handler runs either way
        # Only a rearmed printer writes the rank's stack: the framework's handler replaced it otherwise.
        assert ("in framework_waits" in text) is (how == "rearm"), text
