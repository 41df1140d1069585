"""The Hugging Face Trainer adapter in-process (a world of one on gloo, as ``test_frameworks``): each setting a
trial sets reaches the ``TrainingArguments`` the Trainer reads and nothing it cannot apply is claimed; outside a search
the script's arguments are returned as they are; the callback reports each micro-batch's tokens and each optimizer
step's loss as the Trainer logs it, and stops the training once the trial is measured; an argument the adapter cannot
apply, a Trainer without the callback and a missing ``transformers`` are each one line naming the fix."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from torch.utils.data import Dataset

from tests.trainer.test_frameworks import ended, records, started, world_of_one  # noqa: F401 (fixtures)
from trainer.runtime._base import ScriptError

transformers = pytest.importorskip("transformers")

from trainer.runtime import transformers as tuned  # noqa: E402

TRIAL = {"precision": "bf16", "accum_steps": 2, "batch_size": 4, "num_workers": 1, "prefetch_factor": 3,
         "persistent_workers": True, "bucket_cap_mb": 5.0, "static_graph": True}
SEQ = 8


class Tokens(Dataset):
    def __init__(self, n: int = 64, vocab: int = 32):
        self.tokens = torch.randint(vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i]}


def collate(examples):
    ids = torch.stack([e["input_ids"] for e in examples])
    return {"input_ids": ids, "labels": ids.clone()}


def tiny_lm():
    config = transformers.GPT2Config(vocab_size=32, n_positions=SEQ, n_embd=16, n_layer=1, n_head=1,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def own_args(tmp_path, **kwargs):
    """A script's own arguments, as a CPU user writes them."""
    return transformers.TrainingArguments(output_dir=str(tmp_path / "own"), use_cpu=True, report_to="none",
                                          per_device_train_batch_size=8, **kwargs)


def test_each_trial_setting_reaches_the_training_arguments_and_only_those_are_applied(tmp_path, ended):  # noqa: F811
    run = started(tuned, tmp_path / "trial-1", settings=TRIAL, unit="tokens")
    ended(run)
    args = run.training_args(own_args(tmp_path, num_train_epochs=2, save_steps=10, dataloader_pin_memory=True))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.bf16, args.fp16) == \
        (4, 2, True, False)
    assert (args.dataloader_num_workers, args.dataloader_prefetch_factor, args.dataloader_persistent_workers) == \
        (1, 3, True)
    assert args.dataloader_pin_memory is False  # pinned only with a CUDA device to copy to
    assert (args.ddp_bucket_cap_mb, args.ddp_static_graph) == (5.0, True)
    # A trial trains until it is measured and leaves its output in its own folder, no checkpoint.
    assert args.num_train_epochs == tuned.TRIAL_EPOCHS and args.max_steps == -1
    assert args.save_strategy == "no" and str(tmp_path / "trial-1") in args.output_dir
    # What the Trainer makes itself (its DDP wrapper's other arguments, the model's placement) is not claimed.
    assert set(run.settings()) == {*TRIAL, "pin_memory", "compile"}


def test_outside_a_search_the_training_arguments_are_the_scripts_own(tmp_path, ended):  # noqa: F811
    run = started(tuned, tmp_path, mode="plain", settings={}, unit="tokens")
    ended(run)
    own = own_args(tmp_path, bf16=True, gradient_accumulation_steps=3)
    assert run.training_args(own) is own
    assert run.settings()["precision"] == "bf16" and run.settings()["accum_steps"] == 3  # what a search starts from


def test_a_trainer_reports_its_steps_loss_as_it_logs_it_and_stops_once_measured(tmp_path, ended):  # noqa: F811
    run = started(tuned, tmp_path, settings={"batch_size": 4, "accum_steps": 2}, unit="tokens")
    ended(run)
    logged = []

    class Logged(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(float(logs["loss"]))

    args = run.training_args(own_args(tmp_path, logging_steps=1, num_train_epochs=1, learning_rate=1e-3))
    trainer = transformers.Trainer(model=tiny_lm(), args=args, train_dataset=Tokens(16), data_collator=collate,
                                   callbacks=[run.callback(), Logged()])
    trainer.train()
    assert run.done and trainer.state.epoch > 1  # the script's one epoch ran on until the trial was measured
    # Each optimizer step of 2 micro-batches counted once, its tokens all counted (8 sequences of 8 a step; 2 steps
    # an epoch).
    assert run.steps == trainer.state.global_step
    windows = [r for r in records(tmp_path) if r["kind"] == "window"]
    assert windows and all(w["images"] == w["steps"] * 2 * 4 * SEQ for w in windows)
    # The loss the Trainer logs at its last step (its mean over the micro-batches, rounded to 4 places).
    assert float(run.run.loss) == pytest.approx(logged[-1], abs=1e-4)
    summary = next(r for r in records(tmp_path) if r["kind"] == "summary")
    assert summary["loss_finite"] is True and summary["loss_end"] == pytest.approx(logged[-1], abs=1e-3)
    # The host's waits for the Trainer's batches are timed where its loop asks for them, as a loop of the script's
    # own: the step's split holds them; the Trainer's loader is its own class again once the training ended.
    assert 0 <= summary["data_wait_share"] <= 1 and all(w["wait_s"] is not None for w in windows)
    loader = trainer.callback_handler.train_dataloader
    assert "timed_loader" not in type(loader).__iter__.__qualname__, type(loader)


def test_an_argument_the_adapter_cannot_apply_is_refused_with_the_fix(tmp_path, ended):  # noqa: F811
    run = started(tuned, tmp_path, settings={"batch_size": 4}, unit="tokens")
    ended(run)
    with pytest.raises(ScriptError, match=r"auto_find_batch_size=True.*leave auto_find_batch_size out"):
        run.training_args(own_args(tmp_path, auto_find_batch_size=True))


def test_a_trainer_without_the_callback_is_told_to_pass_it(tmp_path, ended):  # noqa: F811
    run = started(tuned, tmp_path, settings={"batch_size": 4}, unit="tokens")
    ended(run)
    args = run.training_args(own_args(tmp_path))
    trainer = transformers.Trainer(model=tiny_lm(), args=args, train_dataset=Tokens(16), data_collator=collate)
    with pytest.raises(ScriptError, match=r"trains without the run's callback: pass callbacks=\[run.callback\(\)\]"):
        trainer.train()  # at once: in a search it would train without end, reporting nothing
    assert "pass callbacks=[run.callback()] to its Trainer" in run.run.ended()


def test_a_missing_transformers_is_one_line_naming_its_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an import of a package not installed raises
    monkeypatch.delitem(sys.modules, "trainer.runtime.transformers", raising=False)
    with pytest.raises(ScriptError, match=r"pip install 'ddp-autotune\[transformers\]'"):
        importlib.import_module("trainer.runtime.transformers")
