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
