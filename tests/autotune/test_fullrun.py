"""`autotune train` on the export of a real CPU-demo search: 2 epochs with 2 gloo ranks, validation, checkpoints;
killed after epoch 1 and resumed, it ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from autotune import fullrun as tr
from tests.helpers.cli import autotune, cli_env

UNBUFFERED = {"PYTHONUNBUFFERED": "1"}


@pytest.fixture
def search_dir(quick_start) -> Path:
    """The quick start's real cpu-demo study and its export (``tests/autotune/conftest.py``), read only."""
    for r in (quick_start.search, quick_start.export):
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return quick_start.folder


# Validation needs held-out images (the demo's generated set has no val/ folder); progress every half second. The
# demo's own measurement settings: windows run across its short epochs, so a 2-epoch run measures its pace.
TRAIN_FLAGS = ("--epochs", "2", "--set", "data.val_fraction=0.2", "--set", "training.log_every_s=0.5",
               "--no-progress")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "result.jsonl").read_text().splitlines() if line.strip()]


def live_pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.mark.slow
@pytest.mark.timeout(1200)  # where it runs first, the quick start's search is part of its set-up
def test_train_validates_checkpoints_and_resumes_exactly(search_dir, tmp_path):
    best = search_dir / "best.yaml"
    exported = yaml.safe_load(best.read_text())["autotune"]
    assert exported["torchrun"]["nproc_per_node"] == 2 and exported["measured"]["imgs_per_s"] > 0

    # Uninterrupted: 2 epochs, validation after each, a checkpoint after each, the closing lines against the search.
    a = tmp_path / "a"
    r = autotune("train", "--config", str(best), "--out", str(a), *TRAIN_FLAGS, cwd=tmp_path, env=UNBUFFERED)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "2 gloo rank(s) on the CPU" in out
    assert "epoch 1: val top1" in out and "epoch 2: val top1" in out
    assert "NVML utilization unavailable (no GPU)" in out
    assert "autotune train: measured: " in out and " imgs/s (95 % interval" in out  # the export measures
    # Set against the figure the export said to trust: its fresh-process re-measure (the search's, without one).
    again = exported["measured"].get("remeasured") or {}
    trusted = again.get("imgs_per_s") or exported["measured"]["imgs_per_s"]
    assert f"{'re-measure' if again.get('imgs_per_s') else 'search'} (study cpu-demo, trial {exported['trial']}" in out
    recs = records(a)
    assert [c["epoch"] for c in recs if c["kind"] == "checkpoint"] == [1, 2]
    vals = [v for v in recs if v["kind"] == "val"]
    assert [v["epoch"] for v in vals] == [1, 2] and all(0 <= v["top1"] <= v["top5"] <= 1 for v in vals)
    assert vals[0]["images"] == 64  # 20 % of 320 generated images, each counted once across the 2 ranks
    assert any(r_["kind"] == "progress" for r_ in recs)
    summary = json.loads((a / "train-summary.json").read_text())
    assert summary["val"]["epoch"] == 2 and summary["gpu"]["util_available"] is False
    assert summary["imgs_per_s"] > 0 and summary["comparable"] is True
    assert summary["ratio"] == pytest.approx(summary["imgs_per_s"] / trusted)
    written = yaml.safe_load((a / "train.yaml").read_text())
    assert written["training"]["mode"] == "train" and written["training"]["epochs"] == 2
    assert "autotune" not in written and written["output_dir"] == str(a)
    final = sorted((a / "checkpoints").glob("ckpt-*.pt"))
    assert len(final) == 2

    # Interrupted: SIGTERM to `autotune train` once epoch 1's checkpoint is written kills the whole job.
    b = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "train", "--config", str(best), "--out", str(b),
                             *TRAIN_FLAGS], cwd=tmp_path, env=cli_env(tmp_path, UNBUFFERED), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if (b / "result.jsonl").exists() and any(x["kind"] == "checkpoint" for x in records(b)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0]
        assert live_pids_mentioning(str(b / "train.yaml")), "the job should be running"
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, text  # 128 + SIGTERM, as a shell reports it
    assert "interrupted: job killed" in text and "--resume" in text
    assert live_pids_mentioning(str(b / "train.yaml")) == []  # torchrun, ranks, loader workers: all gone
    assert [c["epoch"] for c in records(b) if c["kind"] == "checkpoint"] == [1]

    # Without --resume the earlier run's checkpoints are not silently mixed with a new run's.
    r = autotune("train", "--config", str(best), "--out", str(b), *TRAIN_FLAGS, cwd=tmp_path, env=UNBUFFERED)
    assert r.returncode == 2 and "pass --resume" in r.stderr, r.stdout + r.stderr

    r = autotune("train", "--config", str(best), "--out", str(b), "--resume", *TRAIN_FLAGS, cwd=tmp_path,
                 env=UNBUFFERED)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "resumed from" in out and "(epoch 1," in out
    (resume,) = [x for x in records(b) if x["kind"] == "resume"]
    assert resume["epoch"] == 1
    straight = torch.load(final[-1], weights_only=False)
    resumed = torch.load(b / "checkpoints" / final[-1].name, weights_only=False)
    assert (resumed["epoch"], resumed["step"]) == (straight["epoch"], straight["step"])
    for key, value in straight["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_report_of_the_real_search(search_dir, tmp_path):
    r = autotune("report", "--study", "cpu-demo", "--out", str(tmp_path / "r.html"), cwd=search_dir, env=UNBUFFERED)
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / "r.html").read_text()
    for div in ("plot-history", "plot-intervals"):
        assert f'id="{div}"' in page
    assert 'id="empty-util"' in page and "utilization is recorded as unavailable" in page  # CPU study


# ---- the parts that need no job ---------------------------------------------------------------------------------


def export_yaml(tmp_path: Path, **section) -> Path:
    from trainer.config import TrainConfig

    data = TrainConfig().with_overrides({"training.epochs": 3, "output_dir": str(tmp_path / "run")}).to_dict()
    data["autotune"] = {"study": "s", "trial": 3, "torchrun": {"nproc_per_node": 2, "args": []},
                        "env": {"OMP_NUM_THREADS": "4", "NCCL_ALGO": "Ring", "CUDA_VISIBLE_DEVICES": "GPU-elsewhere"},
                        "measured": {"imgs_per_s": 100.0}, **section}
    path = tmp_path / "best.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_takes_world_and_env_from_the_export(tmp_path):
    p = tr.plan(tr.TrainOptions(config=export_yaml(tmp_path)))
    assert p.nproc == 2 and p.nnodes == 1 and p.comparable
    assert p.config.training.mode == "train" and p.config.training.epochs == 3
    assert p.extra_env == {"OMP_NUM_THREADS": "4", "NCCL_ALGO": "Ring"}  # the search host's GPU list is dropped
    assert p.out == (tmp_path / "run").resolve() and p.result_path == p.out / "result.jsonl"

    env = p.env(base={"PATH": "/usr/bin"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["OMP_NUM_THREADS"] == "4"
    argv = p.argv()
    assert "--standalone" in argv and argv[argv.index("--nproc-per-node") + 1] == "2"


def test_plan_multi_node_flags_pass_through_and_world_change_is_noted(tmp_path):
    path = export_yaml(tmp_path, torchrun={"nproc_per_node": 2, "args": ["--nnodes", "1", "--max-restarts=0"]})
    p = tr.plan(tr.TrainOptions(config=path, nproc_per_node=1, epochs=1,
                                torchrun_args={"nnodes": "4", "node_rank": "1", "rdzv_endpoint": "h:29500"}))
    assert p.torchrun_args == ["--max-restarts=0", "--nnodes", "4", "--node-rank", "1", "--rdzv-endpoint", "h:29500"]
    assert p.nnodes == 4 and not p.comparable  # a world of 4 ranks, the search measured 2
    assert any("not comparable" in n for n in p.notes)
    assert any("rank 0 runs on another node" in n for n in p.notes)
    assert "OMP_NUM_THREADS" not in p.extra_env  # it was per rank for 2 ranks
    assert "--standalone" not in p.argv()


def test_plan_refuses_unsafe_env_and_missing_epochs(tmp_path):
    from autotune.exceptions import LaunchError

    with pytest.raises(LaunchError, match="NVLS"):
        tr.plan(tr.TrainOptions(config=export_yaml(tmp_path, env={"NCCL_NVLS_ENABLE": "1"})))
    from trainer.config import TrainConfig

    plain = tmp_path / "plain.yaml"
    TrainConfig().to_yaml(plain)
    with pytest.raises(tr.TrainError, match="--epochs"):
        tr.plan(tr.TrainOptions(config=plain))


def test_an_export_that_needs_dali_where_it_is_not_installed_is_one_line_naming_the_extra(tmp_path):
    path = export_yaml(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["data"]["decode"] = "dali"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(tr.TrainError) as e:  # the tests' machine has no DALI (tests/conftest.py)
        tr.plan(tr.TrainOptions(config=path))
    assert str(e.value) == (f"{path}: data.decode=dali needs nvidia.dali, which is not installed: "
                            "pip install 'ddp-autotune[dali]'")


def test_progress_view_draws_a_bar_with_rate_loss_and_val_lines():
    buf = io.StringIO()
    view = tr.ProgressView(out=buf, enabled=True)
    for rec in ({"kind": "start", "world_size": 2, "backend": "gloo", "device": "cpu"},
                {"kind": "window", "imgs_per_s": 1234.5},
                {"kind": "progress", "step": 5, "epoch": 0, "total_steps": 20, "loss": 2.5, "imgs_per_s": 1234.5},
                {"kind": "val", "epoch": 1, "top1": 0.25, "top5": 0.75, "loss": 2.0, "images": 64},
                {"kind": "epoch", "epoch": 1, "step": 10}):
        view.record(rec)
    view.close()
    text = buf.getvalue()
    assert "10/20" in text and "imgs/s=1,234" in text and "loss=2.5000" in text
    assert "epoch 1: val top1 0.2500 top5 0.7500" in text


def test_the_closing_lines_give_the_loss_and_flag_an_unsteady_or_slower_run(tmp_path):
    p = tr.plan(tr.TrainOptions(config=export_yaml(tmp_path)))  # the search measured 100 imgs/s
    steady = {"imgs_per_s": 99.0, "ci_half_width": 0.01, "windows": 12, "epochs": 3, "steps": 60, "loss_start": 2.31,
              "loss_end": 1.42, "loss": 1.40, "loss_finite": True}
    lines, warnings, summary = tr.closing_lines(p, tr.TrainResult(returncode=0, summary=steady, wall_s=60.0))
    assert "loss: 2.31 -> 1.42 over the timed windows, 1.4 at the last step" in lines and warnings == []
    assert (summary["loss_start"], summary["loss_end"]) == (2.31, 1.42)

    unsteady = {**steady, "imgs_per_s": 80.0, "ci_half_width": 0.21}
    _, warnings, _ = tr.closing_lines(p, tr.TrainResult(returncode=0, summary=unsteady, wall_s=60.0))
    wide, slower = warnings
    assert wide.startswith("the run's interval is ± 21.0%, wider than measure.precision (2%)")
    assert str(p.result_path) in wide
    # The log holds the launch lines; each window's figure is in the result stream: point there.
    assert slower.startswith("this run is 20.0% slower") and str(p.result_path) in slower
    assert "train.log" not in slower

    diverged = {**steady, "loss_finite": False}
    lines, _, _ = tr.closing_lines(p, tr.TrainResult(returncode=0, summary=diverged, wall_s=60.0))
    assert any(line.startswith("loss: not finite (NaN/inf): the run diverged") for line in lines)



def test_a_runs_figures_are_given_at_the_tables_precision(tmp_path):
    """`autotune train` printed "measured: 61,726.8 samples/s" and "the search measured 50,829.0" below tables that
    say 61,727 and 50,829; its progress line "step 8 61726.8 samples/s"."""
    view = tr.ProgressView(out=io.StringIO(), enabled=False)
    view.per, view.rate = "samples/s", 61_726.8
    assert view._progress_line({"kind": "progress", "step": 8}, 8) == "step 8 61,727 samples/s"
    p = tr.plan(tr.TrainOptions(config=export_yaml(tmp_path)))  # the search measured 100 imgs/s
    run = {"imgs_per_s": 1_234.56, "ci_half_width": 0.012, "windows": 12, "epochs": 3, "steps": 60, "loss_start": 2.31,
           "loss_end": 1.42, "loss": 1.40, "loss_finite": True}
    lines, _, _ = tr.closing_lines(p, tr.TrainResult(returncode=0, summary=run, wall_s=60.0))
    assert ("measured: 1,235 ± 1.2 % imgs/s (95 % interval, the whole run's samples over its slowest rank's seconds, "
            "12 windows)") in lines, lines
