"""The real job: torchrun with 2 gloo ranks on a generated JPEG folder."""

import itertools
import math

import pytest
import torch

from tests.jobutil import kinds, make_jpeg_folder, run_job, tiny_config
from trainer.profile import PARTS, largest
from trainer.protocol import COMPILED_ONLY, ErrorRecord, SummaryRecord, WindowRecord

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    return make_jpeg_folder(tmp_path_factory.mktemp("jpegs"), classes=3, per_class=12)


@pytest.mark.parametrize("decode", ["pil", "torchvision-cpu"])
def test_measure_run_streams_windows_and_counts_every_image(jpegs, tmp_path, decode):
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(jpegs), "data.decode": decode,
                         "training.accum_steps": 2})
    code, records, log = run_job(cfg, tmp_path)
    assert code == 0, log
    # A warm-up slower than the meter's heartbeat (a loaded machine) has `steps` records among these: not events.
    events = [r["kind"] for r in records if r["kind"] != "steps"]
    assert events[:4] == ["start", "ready", "first_step", "warmup_done"]
    assert records[0]["world_size"] == 2 and records[0]["backend"] == "gloo"
    windows, (summary,) = kinds(records, "window"), kinds(records, "summary")
    assert len(windows) >= 3
    per_step = 4 * 2 * 2  # batch x accumulation x ranks
    for w in windows:
        assert w["images"] == w["steps"] * per_step
        assert w["t1"] > w["t0"]
        assert w["imgs_per_s"] == pytest.approx(w["images"] / w["seconds"], rel=1e-3)
    used = [windows[i] for i in summary["windows_used"]]
    assert len(used) >= 3 and summary["imgs_per_s_windows"] == [w["imgs_per_s"] for w in windows]
    # The figure: the steady span's samples over its slowest rank's seconds, inside its interval.
    assert summary["imgs_per_s"] == pytest.approx(sum(w["images"] for w in used) / sum(w["seconds"] for w in used),
                                                  rel=1e-3)
    assert summary["ci_low"] < summary["imgs_per_s"] < summary["ci_high"] and summary["ci_half_width"] > 0
    assert summary["loss_finite"] and math.isfinite(summary["loss"])
    # Every window says what the loss was at its start and end (mean over the ranks); the summary, over the windows
    # its figure stands on, so no figure goes without its loss.
    for before, w in itertools.pairwise(windows):
        assert math.isfinite(w["loss_end"]) and w["loss_start"] == before["loss_end"]
    first, last = windows[summary["windows_used"][0]], windows[summary["windows_used"][-1]]
    assert (summary["loss_start"], summary["loss_end"]) == (first["loss_start"], last["loss_end"])
    assert len(summary["peak_mem_bytes"]) == 2
    assert summary["global_batch"] == per_step
    # The records are what trainer.protocol declares, field for field: the contract the tuner reads.
    assert all(set(w) == set(WindowRecord.__annotations__) for w in windows), windows[0]
    assert set(summary) == set(SummaryRecord.__annotations__) - COMPILED_ONLY


@pytest.mark.parametrize("fed", ["slowly", "at once"])
def test_the_summary_splits_the_step_into_its_wait_for_data_and_the_rest(tmp_path, fed):
    """Fed slowly: a tiny model, its large JPEGs decoded in the rank's own process (no loader workers), inside the
    loop's ``next``: the step mostly waits for data. Fed at once: resnet18 on a batch made on the device: it waits
    for none. The profile after the windows (``measure.profile_steps``) splits the step further and names the same
    largest part: waiting for data, or forward and backward."""
    if fed == "slowly":
        big = make_jpeg_folder(tmp_path / "big", classes=2, per_class=4, size=(960, 1280))
        cfg = tiny_config(**{"model.name": "tests.helpers.models:tiny", "data.kind": "imagefolder",
                             "data.path": str(big), "data.decode": "pil", "loader.num_workers": 0,
                             "measure.profile_steps": 3})
    else:
        cfg = tiny_config(**{"data.kind": "synthetic", "loader.num_workers": 0, "measure.profile_steps": 3})
    code, records, log = run_job(cfg, tmp_path)
    assert code == 0, log
    (summary,) = kinds(records, "summary")
    windows = kinds(records, "window")
    steady = [windows[i] for i in summary["windows_used"]]
    assert summary["data_wait_share"] == pytest.approx(sum(w["wait_s"] for w in steady)
                                                       / sum(w["seconds"] for w in steady), abs=1e-4)
    if fed == "slowly":
        assert summary["data_wait_share"] > 0.5, summary
    else:
        assert summary["data_wait_share"] < 0.1, summary
    split = summary["step_split"]
    assert split["steps"] == 3 and split["rank"] in (0, 1)
    assert split["copy"] is None and split["launch"] is None  # CPU ranks: no device timeline
    shares = [split[p] for p in PARTS if split[p] is not None]
    assert all(s >= 0.0 for s in shares) and sum(shares) <= 1.0 + 1e-3, split
    assert largest(split)[0] == ("data" if fed == "slowly" else "compute"), split


def test_loader_mode_measures_the_pipeline_alone(jpegs, tmp_path):
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(jpegs), "data.decode": "torchvision-cpu",
                         "training.mode": "loader"})
    code, records, log = run_job(cfg, tmp_path)
    assert code == 0, log
    assert kinds(records, "summary")[0]["imgs_per_s"] > 0
    assert all(w["images"] == w["steps"] * 4 * 2 for w in kinds(records, "window"))
    assert all(w["loss_start"] is None and w["loss_end"] is None for w in kinds(records, "window"))  # no model
    assert kinds(records, "summary")[0]["data_wait_share"] is None  # the loader alone: no step to split


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_from_checkpoint_equals_uninterrupted_run(jpegs, tmp_path, persistent):
    # Kept workers are not started again for the next epoch: their augmentation must still restart from the epoch's
    # seed, or a run resumed there augments otherwise than the uninterrupted one.
    base = {"data.kind": "imagefolder", "data.path": str(jpegs), "data.decode": "torchvision-cpu",
            "training.mode": "train", "training.validate_every": 0, "training.batch_size": 6,
            "optimizer.lr": 0.05, "loader.persistent_workers": persistent}
    # 36 images / (6 x 2 ranks) = 3 steps per epoch.
    straight = tiny_config(**base, **{"training.epochs": 2, "output_dir": str(tmp_path / "a")})
    code, records, log = run_job(straight, tmp_path / "a")
    assert code == 0, log
    assert [r["epoch"] for r in kinds(records, "checkpoint")] == [1, 2]

    first = tiny_config(**base, **{"training.steps": 3, "output_dir": str(tmp_path / "b")})
    code, _, log = run_job(first, tmp_path / "b")
    assert code == 0, log
    second = first.with_overrides({"training.steps": None, "training.epochs": 2, "checkpoint.resume": True})
    code, records, log = run_job(second, tmp_path / "b")
    assert code == 0, log
    (resumed,) = kinds(records, "resume")
    assert (resumed["step"], resumed["epoch"]) == (3, 1)

    a = torch.load(straight.checkpoint_dir / "ckpt-000000006.pt", weights_only=False)
    b = torch.load(second.checkpoint_dir / "ckpt-000000006.pt", weights_only=False)
    assert (a["step"], a["epoch"]) == (b["step"], b["epoch"]) == (6, 2)
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=0, atol=1e-6, msg=key)


def test_validation_counts_each_image_once(jpegs, tmp_path):
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(jpegs), "data.decode": "pil",
                         "data.val_fraction": 0.25, "training.mode": "train", "training.epochs": 1,
                         "output_dir": str(tmp_path)})
    code, records, log = run_job(cfg, tmp_path)
    assert code == 0, log
    (val,) = kinds(records, "val")
    assert val["images"] == 9  # 3 of each class's 12 held out, split 5/4 across ranks without padding
    assert 0.0 <= val["top1"] <= val["top5"] <= 1.0


def test_bad_config_fails_with_a_config_error_record(tmp_path):
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(tmp_path / "nope")})
    code, records, _log = run_job(cfg, tmp_path)
    assert code != 0
    errors = kinds(records, "error")
    assert errors and {e["class"] for e in errors} == {"config"}
    assert "make-data" in errors[0]["message"]
    assert all(set(e) == set(ErrorRecord.__annotations__) for e in errors)


@pytest.mark.parametrize("decode", ["pil", "torchvision-cpu"])
def test_an_unreadable_image_fails_the_run_naming_the_file(tmp_path, decode):
    folder = make_jpeg_folder(tmp_path / "data", classes=2, per_class=8)
    bad = folder / "class1" / "003.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # cut short, as a copy that died half-way leaves it
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(folder), "data.decode": decode,
                         "loader.num_workers": 1})
    code, records, log = run_job(cfg, tmp_path / "run")
    assert code != 0, log
    errors = kinds(records, "error")
    assert errors, log
    # Whichever rank read it says which file, from inside its loader worker, as a loader failure.
    named = [e for e in errors if str(bad) in e["message"]]
    assert named and named[0]["class"] == "loader", errors
