"""The runtime a user's script imports: what a run sets reaches the script (the DataLoader's workers, DDP's bucket
size, autocast's dtype, no_sync on non-final micro-steps), the steps it reports are measured by the built-in
job's meter, the stage modes, and the ways a script can fail to be measurable — each a real 2-rank gloo torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import MeasureConfig
from trainer.runtime.request import ENV_REQUEST, Request

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SEEN = REPO / "tests" / "helpers" / "scripts" / "seen.py"
MEASURE = MeasureConfig(warmup_min_steps=2, window_s=0.3, precision=0.05, max_s=1.2, warmup_max_s=20)


def torchrun(script: Path, tmp: Path, *args: str, request: Request | None = None, env: dict | None = None,
             timeout: int = 240):
    """(returncode, records, log, what the script saw)."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "seen.json"
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "SEEN_OUT": str(out),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    result = tmp / "result.jsonl"
    if request is not None:
        request.result = str(result)
        (tmp / "request.json").write_text(request.to_json())
        environ[ENV_REQUEST] = str(tmp / "request.json")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), *args], env=environ, capture_output=True, text=True, timeout=timeout)
    records = [json.loads(x) for x in result.read_text().splitlines()] if result.exists() else []
    seen = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, records, proc.stdout + proc.stderr, seen


def of(records, kind):
    return [r for r in records if r["kind"] == kind]


def test_outside_a_search_the_script_runs_with_its_own_defaults_and_nothing_is_measured(tmp_path):
    code, records, log, seen = torchrun(SEEN, tmp_path, "--epochs", "1")
    assert code == 0, log[-3000:]
    assert records == []  # no request: no result stream
    assert seen["num_workers"] == 0 and seen["batch_size"] == 8  # DataLoader's default workers, the script's batch
    assert seen["bucket_bytes"] == 25 * 1024 * 1024 and seen["static_graph"] is False
    assert set(seen["dtypes"]) == {None} and all(seen["sync"])  # no autocast, every micro-step all-reduces
    assert seen["steps"] == 256 // 2 // 8  # one epoch of the script's own loop


def test_each_setting_of_a_trial_reaches_the_script_and_its_steps_are_measured(tmp_path):
    request = Request(mode="measure", measure=MEASURE, settings={
        "batch_size": 4, "num_workers": 1, "bucket_cap_mb": 7.0, "static_graph": False, "precision": "bf16",
        "accum_steps": 2, "channels_last": True, "gradient_as_bucket_view": True})
    code, records, log, seen = torchrun(SEEN, tmp_path, request=request)
    assert code == 0, log[-3000:]
    assert seen["num_workers"] == 1 and seen["batch_size"] == 4
    assert seen["bucket_bytes"] == 7 * 1024 * 1024 and seen["grad_as_bucket_view"] is True
    assert set(seen["dtypes"]) == {"torch.bfloat16"}
    # Accumulation over 2 micro-steps: the first of each pair inside no_sync (no all-reduce), the second not.
    assert seen["sync"][:6] == [False, True, False, True, False, True]
    assert all(seen["channels_last"])
    settings = of(records, "settings")[0]
    assert settings["unit"] == "images" and settings["loader"] is True
    assert {"batch_size", "num_workers", "precision", "accum_steps", "bucket_cap_mb"} <= set(settings["applied"])
    summary = of(records, "summary")[0]
    windows = of(records, "window")
    assert summary["unit"] == "images" and summary["loss_finite"] is True and summary["imgs_per_s"] > 0
    # The script's waits for its batches are timed as the built-in job's are: its step's split is in the summary.
    assert 0.0 <= summary["data_wait_share"] < 1.0 and all(w["wait_s"] is not None for w in windows)
    # The meter counts optimizer steps, each of 2 micro-batches of 4 images on each of 2 ranks.
    assert all(w["images"] == w["steps"] * 2 * 4 * 2 for w in windows)
    # Told to stop, the script broke out of its loop at once: its micro-steps are the meter's optimizer steps
    # (discarded and measured) times 2 (one step more where the measurement ended as an epoch's turn began: the script
    # learns it at its next report), and it ran more than its 2 epochs (run.epochs goes on until measured).
    measured = of(records, "warmup_done")[0]["steps"] + sum(w["steps"] for w in windows)
    assert 2 * measured <= seen["steps"] <= 2 * (measured + 1)


def test_a_trial_asked_for_a_profile_runs_that_many_steps_more_after_its_windows_and_splits_them(tmp_path):
    """``measure.profile_steps``: the script's reports go on past the windows, unmeasured, until that many optimizer
    steps were profiled; the summary holds their split (``trainer.profile``), the waits for ``run.loader``'s batches
    marked as the built-in job's are."""
    from trainer.profile import PARTS

    request = Request(mode="measure", measure=MeasureConfig(**{**MEASURE.__dict__, "profile_steps": 3}),
                      settings={"batch_size": 4, "num_workers": 1, "accum_steps": 2})
    code, records, log, seen = torchrun(SEEN, tmp_path, request=request)
    assert code == 0, log[-3000:]
    (summary,) = of(records, "summary")
    split = summary["step_split"]
    assert split["steps"] == 3 and split["copy"] is None and split["launch"] is None, split
    shares = [split[p] for p in PARTS if split[p] is not None]
    assert all(s >= 0.0 for s in shares) and 0.0 < sum(shares) <= 1.0 + 1e-3, split
    measured = of(records, "warmup_done")[0]["steps"] + sum(w["steps"] for w in of(records, "window"))
    assert 2 * (measured + 3) <= seen["steps"] <= 2 * (measured + 4)


def test_the_supply_mode_measures_the_loader_alone_and_the_ceiling_mode_replays_one_batch(tmp_path):
    code, records, log, seen = torchrun(SEEN, tmp_path / "supply", request=Request(
        mode="supply", measure=MEASURE, settings={"batch_size": 8, "num_workers": 1}))
    assert code == 0, log[-3000:]
    summary = of(records, "summary")[0]
    assert summary["mode"] == "loader" and summary["imgs_per_s"] > 0 and summary["data_wait_share"] is None
    assert seen is None or seen["steps"] == 0  # the trial ended inside the loader: no training step ran
    code, records, log, seen = torchrun(SEEN, tmp_path / "ceiling", request=Request(
        mode="ceiling", measure=MEASURE, settings={"batch_size": 8}))
    assert code == 0, log[-3000:]
    assert of(records, "summary")[0]["imgs_per_s"] > 0
    assert len(set(seen["batch_sums"])) == 1  # the same batch every step


def test_a_validation_loader_made_after_the_training_one_neither_stalls_nor_replaces_it(tmp_path):
    """A second run.loader (a validation loader, 2 batches a rank, passed after each epoch) took the training
    loader's place: trial 0 recorded its batch of 16 and its workers as the script's own, and the meter, cutting
    epochs by the validation loader's, closed one window in 10,000 steps. Each stage mode, and a trial: measured,
    the training loader's settings recorded, the validation passes out of the windows, and the run ends."""
    for mode in ("measure", "supply", "ceiling"):
        code, records, log, seen = torchrun(SEEN, tmp_path / mode, "--mode", "val", "--epochs", "1",
                                            request=Request(mode=mode, measure=MEASURE, settings={}), timeout=120)
        assert code == 0, log[-3000:]
        summary = of(records, "summary")
        assert summary and summary[0]["imgs_per_s"] > 0, (mode, records[-3:])
        if mode != "supply":
            applied = of(records, "settings")[0]["applied"]
            assert (applied["batch_size"], applied["num_workers"]) == (8, 0), (mode, applied)
            assert seen["steps"] > 0 and seen.get("val_batches", 0) % 2 == 0, seen


@pytest.mark.parametrize(("mode", "says"), [
    ("no-report", "reported no step"),
    ("unread", "declares decode but the script never reads run.decode"),
    ("fixed-loader", "DataLoader was built with num_workers=0 (the run sets 1)"),
    ("crash", "the script broke on purpose"),
    ("short", "before it was measured"),
])
def test_a_script_that_cannot_be_measured_says_why_in_an_error_record(tmp_path, mode, says):
    settings = {"num_workers": 1} if mode == "fixed-loader" else {}
    code, records, log, _ = torchrun(SEEN, tmp_path, "--mode", mode, "--epochs", "1",
                                     request=Request(mode="measure", measure=MEASURE, settings=settings))
    errors = of(records, "error")
    assert errors, log[-3000:]
    assert any(says in e["message"] for e in errors), errors
    assert not of(records, "summary")
    if mode == "crash":
        assert errors[0]["class"] == "crash" and "Traceback" in log and code != 0  # its own traceback, in its log
    else:
        assert errors[0]["class"] == "config"


def test_an_entry_function_runs_through_the_trainer_and_a_wrong_signature_is_refused(tmp_path):
    from trainer.runtime.entry import signature_problems

    def needs(data_dir, epochs=3):
        pass

    assert signature_problems("m:needs", needs) == [
        "script.entry='m:needs': needs() requires data_dir, but an entry is called with no arguments: give them "
        "defaults (a script's arguments arrive in sys.argv)"]
    assert signature_problems("m:ok", lambda epochs=3, *args, **kw: None) == []
