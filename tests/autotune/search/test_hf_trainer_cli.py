"""A Hugging Face Trainer script through the real command line (2 gloo ranks on the CPU): the example searched as a
function on a live worker, exported and trained, in one run; and the scripts it cannot measure as written (a Trainer
without the run's callback, an argument the adapter cannot apply, a Trainer that raises in trial 0): one line naming
the fix, exit 2, no study."""

from __future__ import annotations

import math

import pytest

from autotune.study.storage import trial_attrs
from tests.autotune.search.test_frameworks_cli import searched_exported_and_trained, what_ran
from tests.autotune.search.test_script_cli import EXAMPLES, LM_ARGS, studies_in
from tests.helpers.cli import autotune

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

STUDY = "script-hf_trainer_lm-main"


def example(tmp_path, old: str, new: str):
    """The example with one change, as a user might have written it."""
    source = (EXAMPLES / "hf_trainer_lm.py").read_text()
    assert old in source
    path = tmp_path / "hf_trainer_lm.py"
    path.write_text(source.replace(old, new))
    return path


def test_the_trainer_example_is_searched_on_a_live_worker_exported_and_trained(tmp_path):
    # As a script written for GPUs leaves use_cpu out (each CPU process would then train alone): in a run the tool
    # started, the run's 2 gloo ranks stand (a line of the run's log says so).
    (tmp_path / "example").mkdir()
    script = example(tmp_path / "example", "bf16=cuda, use_cpu=not cuda,", "bf16=cuda,")

    def searched(cwd, said):
        measured = [t for t in found_trials(cwd) if t.value is not None]
        for t in measured:  # each figure with its interval and the loss of its windows
            attrs = trial_attrs(t)
            assert 0 < attrs["ci_half_width"] < 1 and attrs["ci_low"] <= t.value <= attrs["ci_high"], said
            assert math.isfinite(attrs["loss_start"]) and math.isfinite(attrs["loss_end"]), said
            # The step's loss over the ranks' tokens (near ln(vocab) this early), not one rank's share of it.
            assert math.log(512) / 2 + 0.5 < attrs["loss_start"] < math.log(512) + 0.5, said
            assert 0 <= attrs["data_wait_share"] <= 1, said  # the step's wait for the Trainer's batches, split out
        assert not (cwd / "hf_trainer_lm").exists(), said  # a trial's output stays in its own folder

    found, applies = searched_exported_and_trained(tmp_path, f"{script}:main", STUDY, LM_ARGS[1:], trials=3,
                                                   searched=searched)
    # What the TrainingArguments carry is what the search may change; what the Trainer makes itself is not.
    assert {"precision", "accum_steps", "batch_size", "num_workers", "bucket_cap_mb", "static_graph"} <= applies
    assert not applies & {"channels_last", "gradient_as_bucket_view", "decode"}
    script_attrs = found.user_attrs["script"]
    assert script_attrs["applies"]["batch_size"] == 32 and script_attrs["applies"]["num_workers"] == 1
    assert found.user_attrs["unit"] == "tokens" and script_attrs["loader"] is False
    assert None not in {trial_attrs(t).get("worker") for t in found.get_trials()[1:]}, what_ran(tmp_path, STUDY)
    logs = "".join(p.read_text() for p in (tmp_path / "studies" / STUDY).rglob("log.txt"))
    assert ("autotune: the run has 2 rank(s) on cpu (use_cpu=True): the script's use_cpu=False stands when it runs "
            "on its own") in logs


def found_trials(cwd):
    from tests.autotune.search.test_script_cli import study_of

    return study_of(cwd, STUDY).get_trials()


@pytest.mark.parametrize(("old", "new", "says"), [
    (", callbacks=[run.callback()]", "", "pass callbacks=[run.callback()] to its Trainer"),
    ('report_to="none"', 'report_to="none", auto_find_batch_size=True', "leave auto_find_batch_size out"),
    ('"labels": input_ids.clone()', '"attention_mask": torch.ones_like(input_ids)',
     "The model did not return a loss from the inputs"),
])
def test_a_trainer_script_that_cannot_be_measured_gets_one_line_exit_2_and_no_study(tmp_path, old, new, says):
    script = example(tmp_path, old, new)
    r = autotune("search", "--script", script, "--trials", "3", "--", *LM_ARGS[1:], cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("autotune search: error:")]
    assert len(lines) == 1 and says in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and studies_in(tmp_path) == []
