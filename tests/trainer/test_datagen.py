"""The JPEG generator behind `autotune make-data`: ImageNet-like sizes, deterministic, cached, resumable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.cli import REPO
from trainer.datagen import MANIFEST, DatagenError, make_image_folder


def jpegs(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("data") / "set"
    summary = make_image_folder(root, images=40, classes=4, val_fraction=0.2, seed=7, workers=2, progress=False)
    return root, summary


def test_imagenet_like_sizes_and_split(made):
    root, s = made
    files = jpegs(root)
    assert len(files) == 40 and s["images"] == 40 and (s["train"], s["val"]) == (32, 8) and not s["cached"]
    for split, count in (("train", 32), ("val", 8)):
        assert sorted(p.name for p in (root / split).iterdir()) == ["c0000", "c0001", "c0002", "c0003"]
        assert sum(1 for k in files if k.startswith(split)) == count
    kb = np.array([len(b) / 1024 for b in files.values()])
    assert kb.min() > 55 and kb.max() < 125 and 70 < kb.mean() < 110, kb
    assert abs(s["mean_kb"] - kb.mean()) < 0.01
    for name in files:
        with Image.open(root / name) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert min(im.size) >= 300 and max(im.size) <= 500


def test_content_is_structured_not_flat_nor_noise(made):
    root, _ = made
    means, labels = [], []
    for path in sorted(root.glob("train/*/*.jpg")):
        px = np.asarray(Image.open(path), dtype=np.float32)
        small = np.asarray(Image.open(path).reduce(8), dtype=np.float32)  # 8x8 block averages: the structure
        assert small.std() > 15  # not flat colour
        # Neighbouring blocks are alike (pure noise would average to the same grey everywhere, uncorrelated).
        a, b = small[:, :-1].ravel(), small[:, 1:].ravel()
        assert np.corrcoef(a, b)[0, 1] > 0.3  # measured >= 0.5 over 200 images; Gaussian noise gives 0.0
        assert np.abs(np.diff(px, axis=1)).mean() > 4  # and there is fine detail for the decoder to chew on
        means.append(px.reshape(-1, 3).mean(0))
        labels.append(path.parent.name)
    # Classes differ in colour: nearest class mean (leave-one-out) beats chance (25 %) by far.
    means, labels = np.array(means), np.array(labels)
    hits = 0
    for k in range(len(means)):
        rest = np.arange(len(means)) != k
        centres = {c: means[rest & (labels == c)].mean(0) for c in set(labels)}
        hits += min(centres, key=lambda c: np.linalg.norm(means[k] - centres[c])) == labels[k]
    assert hits / len(means) > 0.5


def test_deterministic_whatever_the_workers(made, tmp_path):
    root, _ = made
    make_image_folder(tmp_path / "one", images=40, classes=4, val_fraction=0.2, seed=7, workers=1, progress=False)
    assert jpegs(tmp_path / "one") == jpegs(root)
    make_image_folder(tmp_path / "other", images=8, classes=4, seed=8, workers=1, progress=False)
    assert jpegs(tmp_path / "other")["train/c0000/00000000.jpg"] != jpegs(root)["train/c0000/00000000.jpg"]


def test_second_call_reuses_and_other_arguments_are_refused(made):
    root, first = made
    stamp = {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")}
    again = make_image_folder(root, images=40, classes=4, val_fraction=0.2, seed=7, workers=2, progress=False)
    assert again["cached"] and {k: v for k, v in again.items() if k != "cached"} == \
        {k: v for k, v in first.items() if k != "cached"}
    assert stamp == {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")}
    with pytest.raises(DatagenError, match="other arguments"):
        make_image_folder(root, images=41, classes=4, val_fraction=0.2, seed=7, progress=False)


def test_interrupted_run_resumes(made, tmp_path):
    root, _ = made
    part = tmp_path / "part"
    make_image_folder(part, images=40, classes=4, val_fraction=0.2, seed=7, workers=1, progress=False)
    (part / MANIFEST).unlink()  # as if killed before the end: no manifest, some files missing
    removed = sorted(part.rglob("*.jpg"))[::3]
    for p in removed:
        p.unlink()
    kept = sorted(set(part.rglob("*.jpg")))
    kept_stamp = {p: p.stat().st_mtime_ns for p in kept}
    s = make_image_folder(part, images=40, classes=4, val_fraction=0.2, seed=7, workers=2, progress=False)
    assert not s["cached"] and jpegs(part) == jpegs(root)
    assert kept_stamp == {p: p.stat().st_mtime_ns for p in kept}  # complete files are not rewritten
    assert json.loads((part / MANIFEST).read_text())["summary"]["images"] == 40


def test_bad_arguments_and_foreign_folders(tmp_path):
    for kwargs, message in (({"images": 0, "classes": 2}, "images=0"),
                            ({"images": 10, "classes": 20}, "every class needs at least one"),
                            ({"images": 10, "classes": 4, "val_fraction": 0.1}, "validation images for 4 classes"),
                            ({"images": 10, "classes": 2, "val_fraction": 1.0}, "val_fraction=1.0"),
                            ({"images": 10, "classes": 2, "workers": 0}, "workers=0")):
        with pytest.raises(DatagenError, match=message):
            make_image_folder(tmp_path / "x", progress=False, **kwargs)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DatagenError, match="not made by make-data"):
        make_image_folder(tmp_path / "mine", images=4, classes=2, progress=False)


def test_cli_one_line_summary_and_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "autotune", "make-data", str(tmp_path / "d"), "--images", "12", "--classes", "3",
           "--val-fraction", "0.25", "--workers", "2", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and "12 JPEGs (9 train, 3 val, 3 classes) made in" in r.stdout
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "reused" in r.stdout
    bad = subprocess.run([*cmd[:4], str(tmp_path / "e"), "--images", "5", "--classes", "9"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("autotune make-data: error:") and "Traceback" not in bad.stderr


STOPPED_WHILE_GENERATING = """
import multiprocessing, os, signal, sys, threading, time
from pathlib import Path
from trainer.datagen import make_image_folder

class Stopped(KeyboardInterrupt):
    pass

def stop(signum, frame):  # as `autotune search` handles SIGTERM and SIGHUP (commands/search.py)
    raise Stopped(signum)

signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGHUP, stop)
root = Path(sys.argv[1])

def kill_once_writing():
    while not any(root.rglob("*.jpg")):
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=kill_once_writing, daemon=True).start()
try:
    make_image_folder(root, images=2000, classes=4, workers=2, progress=False)
except Stopped:
    print("stopped; children left:", multiprocessing.active_children())
"""


def test_a_sigterm_while_generating_stops_the_workers_silently(tmp_path):
    """The parent's SIGTERM handler (the search's) is not inherited by the forked workers: stopping the parent
    terminates them without a traceback from each, and leaves none behind."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", STOPPED_WHILE_GENERATING, str(tmp_path / "d")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout == "stopped; children left: []\n", r.stdout + r.stderr
    assert r.stderr == ""  # no worker's traceback
    assert 0 < len(list((tmp_path / "d").rglob("*.jpg"))) < 2000
