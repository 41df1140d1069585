"""A non-finite loss: one overflowed step (fp16 + GradScaler skips it) is normal, a loss that stays NaN/inf step after
step is divergence, the only case that makes a trial infeasible."""

from __future__ import annotations

import math

import optuna
import pytest
import torch
from torch import nn

from autotune.study.storage import trial_attrs
from tests.helpers.cli import autotune
from tests.helpers.specs import tiny_spec
from tests.jobutil import kinds, run_job, tiny_config
from trainer.loop import train_step
from trainer.records import DIVERGED_STEPS, count_nonfinite, loss_diverged

NAN, INF = float("nan"), float("inf")


def counters(losses):
    run, total = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    for loss in losses:
        run, total = count_nonfinite(torch.tensor(loss), run, total)
    return int(run), int(total)


def test_the_counters_count_the_final_run_and_the_total():
    assert counters([]) == (0, 0)
    assert counters([1.0, 2.0]) == (0, 0)
    assert counters([1.0, NAN, 1.0, INF, 0.5]) == (0, 2)
    assert counters([1.0, NAN, 1.0, INF, -INF]) == (2, 3)
    assert counters([NAN] * 7) == (7, 7)
    run, total = count_nonfinite(torch.tensor(NAN, dtype=torch.float16), torch.tensor(3), torch.tensor(4))
    assert (run.dtype, int(run), int(total)) == (torch.int64, 4, 5)


def test_diverged_means_the_last_few_steps_all_non_finite():
    assert not loss_diverged(0, 0)  # no step ran (a resumed run already at its end)
    assert not loss_diverged(DIVERGED_STEPS - 1, 100)  # a few overflowed steps in a row: still transient
    assert loss_diverged(DIVERGED_STEPS, 100) and loss_diverged(37, 100)
    assert loss_diverged(3, 3) and not loss_diverged(2, 3)  # shorter than DIVERGED_STEPS: all of them, or not


def test_one_nan_fp16_step_is_skipped_by_the_grad_scaler_and_is_not_divergence():
    """The real mechanism, in one process: a batch whose loss is NaN, under GradScaler, leaves the weights finite and
    the next steps' losses finite; the counters end with run 0, total 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    batches = [(torch.randn(8, 3, 2, 2), torch.randint(0, 4, (8,))) for _ in range(6)]
    batches[2][0][0, 0, 0, 0] = NAN
    it, amp = iter(batches), torch.autocast("cpu", torch.float16)
    run, total = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    losses = []
    for _ in batches:
        loss = train_step(model, it, optimizer, scaler, accum_steps=1, autocast_ctx=amp)
        run, total = count_nonfinite(loss, run, total)
        losses.append(float(loss))
    assert [math.isfinite(v) for v in losses] == [True, True, False, True, True, True]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (int(run), int(total)) == (0, 1) and not loss_diverged(int(run), len(batches))


@pytest.mark.slow
@pytest.mark.parametrize("lr, diverges", [(0.01, False), (1e8, True)])
def test_the_summary_reports_non_finite_steps_and_divergence(tmp_path, lr, diverges):
    cfg = tiny_config(**{"optimizer.lr": lr, "loader.num_workers": 0})  # synthetic data, 2 gloo ranks
    code, records, log = run_job(cfg, tmp_path)
    assert code == 0, log
    (summary,) = kinds(records, "summary")
    if diverges:  # NaN weights: every step after the first few is NaN
        assert summary["loss_finite"] is False and not math.isfinite(summary["loss"])
        assert summary["loss_nonfinite_run"] >= DIVERGED_STEPS
        assert summary["steps"] >= summary["loss_nonfinite_steps"] >= summary["loss_nonfinite_run"]
    else:
        assert summary["loss_finite"] is True and math.isfinite(summary["loss"])
        assert summary["loss_nonfinite_steps"] == summary["loss_nonfinite_run"] == 0


@pytest.mark.slow
def test_a_diverging_trial_is_infeasible_with_a_config_failure(tmp_path):
    # One trial, the baseline, at a learning rate that turns the weights NaN within a few steps.
    spec = tiny_spec(tmp_path, "diverging", **{"base.optimizer": {"lr": 1.0e20}, "budget.trials": 1})
    r = autotune("search", "--spec", spec, cwd=tmp_path, timeout=300)
    # Its one end-to-end trial did not learn: the search found nothing to export, and says why.
    assert r.returncode == 1, r.stdout + r.stderr
    assert "every end-to-end trial of study diverging failed (1: 1 diverged); trial 0: diverged: loss NaN/inf" \
        in r.stderr
    (trial,) = optuna.load_study(study_name="diverging",
                                 storage=f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}").get_trials()
    assert trial.user_attrs["failure_class"] == "diverged" and trial.constraints["failed"] == 1.0
    message = trial_attrs(trial)["failure_message"]
    assert message.startswith("loss NaN/inf")  # in the measured windows, or for the last steps
