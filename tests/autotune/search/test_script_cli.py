"""`autotune search --script`: the shipped examples tuned, exported and trained through the real command line (2 gloo
ranks on the CPU), the same scripts run unchanged under plain torchrun, and the bad inputs: one line naming the
fix, exit 2, no study made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from autotune.search import script
from autotune.study.storage import open_storage, trial_attrs
from tests.helpers.cli import REPO, autotune, cli_env

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
SEED_ARGS = ["--", "--model", "resnet18", "--image-size", "32"]
LM_ARGS = ["--", "--dim", "32", "--layers", "1", "--seq-len", "16", "--sequences", "512"]


def studies_in(cwd: Path) -> list[str]:
    dbs = list((cwd / "studies").glob("*.db"))
    return [n for db in dbs for n in optuna.study.get_all_study_names(open_storage(f"sqlite:///{db}"))]


def study_of(cwd: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(f"sqlite:///{cwd / 'studies' / 'autotune.db'}"))


def trials_of(cwd: Path, name: str):
    return study_of(cwd, name).get_trials()


@pytest.mark.timeout(1500)  # three commands; CI's slow day took 388 s of the default 600
def test_the_seed_example_is_tuned_exported_and_trained_as_a_fresh_torchrun_per_trial(tmp_path):
    r = autotune("search", "--script", EXAMPLES / "seed_ddp.py", "--trials", "3", *SEED_ARGS, cwd=tmp_path,
                 timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "trial 0 runs the script with its own defaults" in r.stdout
    assert "in images/s; it applies:" in r.stdout and "num_workers" in r.stdout
    trials = trials_of(tmp_path, "script-seed_ddp")
    assert len(trials) == 3
    base = trials[0]
    assert base.user_attrs["stage"] == "baseline" and base.user_attrs["imgs_per_s"] > 0
    # Trial 0 ran the script's own defaults, and its params say exactly that.
    assert base.params["training.batch_size"] == 64 and base.params["training.accum_steps"] == 1
    study = study_of(tmp_path, "script-seed_ddp")
    assert {"batch_size", "num_workers", "precision"} <= set(study.user_attrs["script"]["applies"])
    assert study.user_attrs["unit"] == "images"
    # Every trial was a process of its own: a plain script cannot serve trials.
    assert all(trial_attrs(t).get("worker") is None for t in trials if trial_attrs(t).get("launch_s") is not None)

    r = autotune("export", "best.yaml", "--study", "script-seed_ddp", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert data["script"]["path"] == str(EXAMPLES / "seed_ddp.py") and data["data"]["kind"] == "script"
    command = data["autotune"]["torchrun"]["command"]
    assert command.startswith("AUTOTUNE_CONFIG=<this file> torchrun") and "seed_ddp.py --model resnet18" in command

    r = autotune("train", "--config", "best.yaml", "--no-progress", "--out", "run", "--", "--model", "resnet18",
                 "--image-size", "32", "--epochs", "8", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "seed_ddp.py --model resnet18 --image-size 32 --epochs 8" in r.stdout
    assert ": 8 epoch(s), " in r.stdout  # the script's run.epochs(8), counted
    summary = json.loads((tmp_path / "run" / "train-summary.json").read_text())
    assert summary["epochs"] == 8 and summary["steps"] > 0 and summary["loss"] > 0  # a summary, short or not


def test_the_language_model_example_is_tuned_on_a_live_worker_in_tokens(tmp_path):
    r = autotune("search", "--script", f"{EXAMPLES / 'tiny_lm.py'}:main", "--trials", "4", *LM_ARGS, cwd=tmp_path,
                 timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "in tokens/s" in r.stdout and "trial after trial in one live worker" in r.stdout
    trials = trials_of(tmp_path, "script-tiny_lm-main")  # the function path: a study of its own
    applies = set(trials[0].system_attrs.get("autotune:config", {}).get("script", {}).get("applies", []))
    assert "channels_last" not in applies  # a transformer has no image-shaped weights: no layout to search
    assert {"batch_size", "accum_steps", "precision"} <= applies
    workers = {trial_attrs(t).get("worker") for t in trials[1:] if trial_attrs(t).get("launch_s") is not None}
    assert workers and None not in workers  # after trial 0, the function ran on a live worker
    assert all(trial_attrs(t).get("loss_finite") is not False for t in trials)


def test_the_examples_run_unchanged_under_plain_torchrun(tmp_path):
    env = {**cli_env(tmp_path), "OMP_NUM_THREADS": "1"}
    for example, args in (("seed_ddp.py", ["--model", "resnet18", "--image-size", "32", "--epochs", "1"]),
                          ("tiny_lm.py", [*LM_ARGS[1:], "--epochs", "1"])):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(EXAMPLES / example), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


BROKEN = {
    "import": "import torch\nraise ImportError('no module named fancy_aug: pip install fancy-aug')\n",
    "silent": ("from trainer import runtime\nrun = runtime.setup()\nimport time\ntime.sleep(1)\n"),
    "fixed": ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\nfrom trainer import runtime\n"
              "run = runtime.setup(num_workers=2)\n"
              "print('workers', run.num_workers)\n"
              "data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
              "loader = run.loader(DataLoader(data, batch_size=8, num_workers=0))\n"
              "model = run.model(torch.nn.Linear(4, 1))\n"
              "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "for epoch in run.epochs(2):\n"
              "    for x, y in loader:\n"
              "        with run.step(opt):\n"
              "            loss = torch.nn.functional.mse_loss(model(x), y)\n"
              "            run.backward(loss)\n"
              "        if run.report(len(x), loss):\n"
              "            break\n"),
    "signature": "def main(data_dir):\n    pass\n",
}


@pytest.mark.parametrize(("kind", "says"), [
    ("missing", "no such file"),
    ("import", "no module named fancy_aug: pip install fancy-aug"),
    ("silent", "without reporting a step"),
    ("fixed", "DataLoader was built with num_workers=0 (the run sets 2)"),
    ("signature", "main() requires data_dir, but an entry is called with no arguments"),
])
def test_a_script_that_cannot_be_tuned_gets_one_line_exit_2_and_no_study(tmp_path, kind, says):
    script = tmp_path / "train.py"
    if kind != "missing":
        script.write_text(BROKEN[kind])
    target = f"{script}:main" if kind == "signature" else str(script)
    r = autotune("search", "--script", target, "--trials", "3", cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("autotune search: error:")]
    assert len(lines) == 1 and says in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert studies_in(tmp_path) == []
    if kind == "import":  # the script's own traceback is in the log the line names
        log = Path(lines[0].rsplit("(log: ", 1)[1].rstrip(")"))
        assert "Traceback" in (log if log.is_absolute() else tmp_path / log).read_text()


@pytest.mark.parametrize(("source", "target", "says"), [
    ("def main():\n    pass\n\n\ndef helper():\n    pass\n", "train.py:mian",
     "train.py has no function mian (its functions: helper, main)"),
    ("def helper():\n    mian = 1\n    return mian\n\n\nclass Job:\n    mian = 2\n", "train.py:mian",
     "train.py has no function mian (its functions: helper)"),
    ("import torch\nif True:\n    def main(:\n        pass\n", "train.py", "train.py, line 3: invalid syntax"),
    ("import torch\nif True:\n    def main(:\n        pass\n", "train.py:main", "train.py, line 3: invalid syntax"),
])
def test_a_misnamed_entry_or_a_syntax_error_is_told_before_any_process_starts(tmp_path, monkeypatch, source, target,
                                                                              says):
    (tmp_path / "train.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(script.ScriptError) as e:
        script.check(target)
    assert str(e.value) == f"--script {target}: {says}"


@pytest.mark.parametrize("source", [
    "def main():\n    pass\n",
    "import torch\ntry:\n    from fast import main\nexcept ImportError:\n    main = lambda: None\n",
    "from elsewhere import *\n",
    "class main:\n    pass\n",
    "import torch\nasync def other():\n    pass\nwith open(__file__) as f:\n    for main in [print]:\n        pass\n",
    "import sys\nglobals()['main'] = lambda: None\n",
    "def __getattr__(name):\n    return lambda: None\n",
])
def test_an_entry_bound_at_the_top_level_in_any_form_passes_the_check(tmp_path, monkeypatch, source):
    (tmp_path / "train.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    script.check("train.py:main")
