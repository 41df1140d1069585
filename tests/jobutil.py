"""Helpers for tests that run the real job under torchrun (2 gloo ranks on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from trainer.config import TrainConfig


def make_jpeg_folder(root: Path, *, classes: int = 2, per_class: int = 8, size=(40, 48), seed: int = 0) -> Path:
    """A tiny ImageFolder of smooth, class-tinted JPEGs (decodable by PIL, libjpeg-turbo and nvJPEG)."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = size[0] + 4 * (i % 3), size[1] - 4 * (i % 2)
            base = rng.normal(size=(h // 8 + 1, w // 8 + 1, 3))
            img = np.kron(base, np.ones((8, 8, 1)))[:h, :w] * 40 + 128 + 30 * c
            img += rng.normal(scale=6, size=img.shape)
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(folder / f"{i:03d}.jpg", quality=90)
    return root


def tiny_config(**overrides) -> TrainConfig:
    """resnet18 at 32 px: big enough to be a real conv net with BN, small enough for 2 CPU cores. At lr 0.002 it
    learns: at SGD's default 0.1, batches of 4 make its loss jump between 1.5 and 34 from window to window, a run the
    loss check may rightly void (``trainer.learning.RISE_LIMIT``)."""
    base = {"model.name": "resnet18", "data.image_size": 32, "training.batch_size": 4, "loader.num_workers": 1,
            "optimizer.lr": 0.002,
            "measure.warmup_min_steps": 2, "measure.precision": 0.05, "measure.max_s": 1.5,
            "measure.window_s": 0.3, "ddp.timeout_s": 60.0}
    base.update(overrides)
    return TrainConfig().with_overrides(base)


def run_job(cfg: TrainConfig, tmp: Path, *, nproc: int = 2, extra_args=(), timeout: int = 240):
    """torchrun the job; returns (returncode, records, log text)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config, result = tmp / "run.yaml", tmp / "result.jsonl"
    cfg.to_yaml(config)
    result.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "trainer", "--config", str(config), "--result", str(result), *extra_args],
        env=env, capture_output=True, text=True, timeout=timeout)
    records = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
    return proc.returncode, records, proc.stdout + proc.stderr


def kinds(records, kind):
    return [r for r in records if r["kind"] == kind]
