"""A Lightning and an Accelerate script through the real command line (2 gloo ranks on the CPU): each example
searched as a function on a live worker with its trials measured end to end (the Lightning one with its stages),
exported and trained, one cheap run per framework; the Lightning example unchanged under plain torchrun; and a script
whose framework is not installed: one line naming the install, exit 2, no study."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from autotune.study.storage import trial_attrs
from tests.autotune.search.test_script_cli import EXAMPLES, LM_ARGS, studies_in, study_of
from tests.helpers.cli import autotune, cli_env

pytestmark = pytest.mark.slow
pytest.importorskip("lightning")
pytest.importorskip("accelerate")

LIGHTNING_ARGS = ["--model", "resnet18", "--image-size", "32", "--lr", "0.01"]
"""At the example's own lr 0.1, single-step losses of resnet18 at 32 px on its 320 images rose 1.52x over trial 0's
windows once in five runs, and the search stopped: a diverged first run (``trainer.learning.RISE_LIMIT``)."""


def parts_of(cwd, study: str) -> list:
    """The measurements of parts (ceiling, supply) a search ran beside its end-to-end trials."""
    try:
        return study_of(cwd, f"{study}.parts").get_trials()
    except KeyError:
        return []


def searched_exported_and_trained(tmp_path, script: str, study: str, args: list[str], trials: int, searched=None):
    """Search, export, train; ``searched(tmp_path)`` checks what the search alone left."""
    r = autotune("search", "--script", script, "--trials", str(trials), "--", *args, cwd=tmp_path, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    found = study_of(tmp_path, study)
    trials_run = found.get_trials()
    assert len(trials_run) + len(parts_of(tmp_path, study)) == trials
    measured = [t for t in trials_run if t.value is not None]
    assert measured and all(t.value > 0 and trial_attrs(t).get("loss_finite") is not False for t in measured)
    applies = set(found.user_attrs["script"]["applies"])
    if searched is not None:
        searched(tmp_path, r.stdout[-3000:] + r.stderr[-3000:] + what_ran(tmp_path, study))
    r = autotune("export", "best.yaml", "--study", study, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert data["data"]["kind"] == "script" and set(data["script"]["applies"]) == applies
    r = autotune("train", "--config", "best.yaml", "--no-progress", "--out", "run", "--", *args, "--epochs", "2",
                 cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "train-summary.json").read_text())
    assert summary["epochs"] == 2 and summary["steps"] > 0 and summary["loss_finite"] is True
    return found, applies


def what_ran(cwd, study: str) -> str:
    """Each trial and part of a search in a line (its stage, state, figure and why it ended), for a failure's
    message: a test that fails on what a search chose says what it chose."""
    lines = []
    for t in [*study_of(cwd, study).get_trials(), *parts_of(cwd, study)]:
        attrs = trial_attrs(t)
        why = {k: attrs[k] for k in ("settled", "failure_class", "reason", "pruned_before_launch", "launch_s")
               if k in attrs}
        lines.append(f"{t.user_attrs.get('stage')} {t.number} {t.state.name} {t.value} {why}")
    return "\n" + "\n".join(lines)


def nothing_outside_the_trials(cwd, said: str) -> None:
    """What Lightning writes in a search stays in each trial's folder: its default logs, and no checkpoint."""
    trials = cwd / "studies" / "script-lightning_ddp-main"
    assert not (cwd / "lightning_logs").exists(), said
    assert (trials / "trial-1" / "lightning_logs").is_dir(), said
    assert not list(cwd.rglob("*.ckpt")), said


def test_the_lightning_example_is_searched_on_a_live_worker_with_stages_exported_and_trained(tmp_path):
    # As a script written for one device per machine passes it: devices="auto" counts one CPU device, and Lightning
    # refuses a world of two; in a run the tool started, its ranks stand (a line of the run's log says so).
    auto = tmp_path / "example"
    auto.mkdir()
    (auto / "demo_data.py").write_text((EXAMPLES / "demo_data.py").read_text())
    source = (EXAMPLES / "lightning_ddp.py").read_text()
    assert 'devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1))' in source
    (auto / "lightning_ddp.py").write_text(source.replace('devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1))',
                                                          'devices="auto"'))
    found, applies = searched_exported_and_trained(tmp_path, f"{auto / 'lightning_ddp.py'}:main",
                                                   "script-lightning_ddp-main", LIGHTNING_ARGS, trials=4,
                                                   searched=nothing_outside_the_trials)
    logs = "".join(p.read_text() for p in (tmp_path / "studies" / "script-lightning_ddp-main").rglob("log.txt"))
    assert ("autotune: the run has 2 rank(s) (devices=2, num_nodes=1): the script's devices='auto' stands when it "
            "runs on its own") in logs
    # What reaches the Trainer, the DataModule's loader (the run's image pipeline) and the module is what the
    # search may change.
    assert {"precision", "accum_steps", "bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "batch_size",
            "num_workers", "channels_last", "decode"} <= applies
    script = found.user_attrs["script"]
    assert script["applies"]["precision"] == "fp32"  # the script's own 32-true on the CPU
    assert script["applies"]["decode"] == "pil" and script["applies"]["batch_size"] == 64  # its DataLoader's own
    assert found.user_attrs["unit"] == "images" and script["loader"] is True
    # Its train loader alone and its first batch replayed, each through the Trainer's fit, then end to end: every
    # Lightning fit after trial 0 on one live worker, which none of them left anything behind in.
    parts = parts_of(tmp_path, "script-lightning_ddp-main")
    assert {t.user_attrs["stage"] for t in parts} == {"ceiling", "supply"}
    runs = [t for t in [*found.get_trials()[1:], *parts] if trial_attrs(t).get("launch_s") is not None]
    assert len(runs) >= 3 and all(t.value > 0 for t in runs), [(t.number, t.user_attrs) for t in runs]
    assert {trial_attrs(t).get("worker") for t in runs} == {"worker-1"}
    # The trained run is the script's own: its checkpoints where Lightning puts them.
    assert list((tmp_path / "lightning_logs").rglob("*.ckpt"))


def test_the_accelerate_example_is_searched_on_a_live_worker_exported_and_trained(tmp_path):
    found, applies = searched_exported_and_trained(tmp_path, f"{EXAMPLES / 'accelerate_lm.py'}:main",
                                                   "script-accelerate_lm-main", LM_ARGS[1:], trials=3)
    assert {"precision", "accum_steps", "bucket_cap_mb", "batch_size", "num_workers"} <= applies
    assert "channels_last" not in applies  # a language model: no layout to search
    assert found.user_attrs["unit"] == "tokens"
    workers = {trial_attrs(t).get("worker") for t in found.get_trials()[1:]}
    assert None not in workers  # after trial 0, trial after trial on one live worker (Accelerate's state reset)


def test_a_script_whose_framework_is_not_installed_gets_one_line_naming_the_install(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.modules['lightning'] = None  # as if it were not installed\n"
                      "from trainer.runtime import lightning as tuned\n")
    r = autotune("search", "--script", script, "--trials", "3", cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("autotune search: error:")]
    assert len(lines) == 1 and "pip install 'ddp-autotune[lightning]'" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and studies_in(tmp_path) == []


def test_the_lightning_example_runs_unchanged_under_plain_torchrun(tmp_path):
    """Outside a search the runtime is a pass-through: the script's Trainer, its epochs, its checkpoint; its images
    through run.image_loader's default pipeline (PIL), sharded by the run."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(EXAMPLES / "lightning_ddp.py"), *LIGHTNING_ARGS, "--epochs", "2"],
                          env={**cli_env(tmp_path), "OMP_NUM_THREADS": "1"}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "`Trainer.fit` stopped: `max_epochs=2` reached." in proc.stdout + proc.stderr
    # 320 images over 2 ranks at the DataModule's batch of 64: 2 steps an epoch, 2 epochs.
    assert [p.name for p in (tmp_path / "lightning_logs").rglob("*.ckpt")] == ["epoch=1-step=4.ckpt"]
