"""The trial worker's own parts: the requests file read as it grows, what a closed trial may not leave behind, and
the settings a live process cannot change."""

from __future__ import annotations

import json
import threading
import time

from trainer.config import TrainConfig, process_settings
from trainer.worker import leftovers, read_requests


def test_requests_are_read_as_they_are_appended_and_a_partial_line_waits(tmp_path):
    path = tmp_path / "requests.jsonl"
    got = []

    def reader():
        for request in read_requests(path, poll_s=0.01):
            got.append(request)
            if request.get("stop"):
                return

    t = threading.Thread(target=reader)
    t.start()  # before the file exists: the reader waits for it
    time.sleep(0.05)
    with open(path, "ab") as f:
        f.write(json.dumps({"trial": 1}).encode() + b"\n" + b'{"tri')
        f.flush()
        time.sleep(0.1)
        assert got == [{"trial": 1}]  # the half-written second line is not read yet
        f.write(b'al": 2}\n{"stop": true}\n')
    t.join(timeout=5)
    assert got == [{"trial": 1}, {"trial": 2}, {"stop": True}]


def test_a_thread_a_trial_left_running_is_found_and_a_finished_one_is_not():
    baseline = set(threading.enumerate())
    stop = threading.Event()
    straggler = threading.Thread(target=stop.wait, name="left-behind", daemon=True)
    straggler.start()
    assert leftovers(baseline, grace_s=0.2) == "thread 'left-behind'"
    stop.set()
    straggler.join()
    assert leftovers(baseline, grace_s=0.2) is None


def test_process_settings_are_what_only_a_new_process_can_change():
    base = TrainConfig()
    same = base.with_overrides({"training.batch_size": 256, "data.decode": "nvjpeg-gpu", "ddp.bucket_cap_mb": 100.0})
    assert process_settings(same) == process_settings(base)
    for change in ({"nccl.algo": "Ring"}, {"ddp.timeout_s": 30.0}, {"ddp.backend": "gloo"}):
        assert process_settings(base.with_overrides(change)) != process_settings(base), change


def test_tqdms_monitor_is_the_processs_and_no_trial_left_it():
    from tqdm import tqdm

    from trainer.worker import lifetime_threads

    if tqdm.monitor is not None:  # one an earlier test started: this test starts its own
        tqdm.monitor.exit()
        tqdm.monitor = None
    baseline = set(threading.enumerate())
    with tqdm(total=1, disable=True):  # a script's data step: a disabled bar starts the monitor and never stops it
        pass
    assert tqdm.monitor is not None and tqdm.monitor.is_alive()
    assert leftovers(baseline | lifetime_threads(), grace_s=0.2) is None
