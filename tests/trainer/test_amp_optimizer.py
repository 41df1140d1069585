"""fp16 under a GradScaler: the job's fused optimizer step must give exactly what stock (non-fused, per-tensor)
optimizers give, also when the scaler skips a step because the scaled loss overflowed — the ordinary start of every
fp16 run. Fused SGD with momentum allocates its buffers uninitialized and, when its first step is skipped on the
device, never fills them: the weights then fill with garbage (every fp16 run on 2xH200 had a NaN loss from step 3)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.jobutil import tiny_config
from trainer.apply import grad_scaler
from trainer.loop import train_step
from trainer.optim import build_optimizer

OPTIMIZERS = {
    "sgd-momentum": {"optimizer.name": "sgd", "optimizer.momentum": 0.9},
    "sgd-plain": {"optimizer.name": "sgd", "optimizer.momentum": 0.0},
    "adamw": {"optimizer.name": "adamw", "optimizer.lr": 0.01},
}


def model_and_batches(overflow_steps: tuple[int, ...]):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 4))
    batches = []
    for step in range(6):
        images = torch.randn(8, 3, 6, 6)
        if step in overflow_steps:
            images[0] *= 1e30  # fp16 activations overflow: inf/NaN gradients, the scaler skips this step
        batches.append((images, torch.randint(0, 4, (8,))))
    return model, batches


def stock_like(job_optimizer: torch.optim.Optimizer, job_model: nn.Module, model: nn.Module) -> torch.optim.Optimizer:
    """The job's optimizer (same param groups and hyper-parameters) over ``model``, a copy of ``job_model``, without
    fused or foreach kernels: torch's reference implementation."""
    twin = {id(a): b for a, b in zip(job_model.parameters(), model.parameters(), strict=True)}
    groups = [{**{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")},
               "params": [twin[id(p)] for p in g["params"]]} for g in job_optimizer.param_groups]
    return type(job_optimizer)(groups, fused=False, foreach=False)


def run_steps(model, optimizer, batches):
    scaler = grad_scaler("fp16", torch.device("cpu"))
    amp = torch.autocast("cpu", torch.float16)
    it = iter(batches)
    losses = [float(train_step(model, it, optimizer, scaler, accum_steps=1, autocast_ctx=amp)) for _ in batches]
    return losses, scaler


@pytest.mark.parametrize("which", list(OPTIMIZERS))
@pytest.mark.parametrize("overflow_steps", [(0,), (0, 1), (2,)])
def test_the_jobs_fp16_step_matches_stock_torch_after_skipped_steps(which, overflow_steps):
    cfg = tiny_config(**{"training.precision": "fp16", **OPTIMIZERS[which]})
    model, batches = model_and_batches(overflow_steps)
    reference = copy.deepcopy(model)
    job_opt = build_optimizer(cfg, model)
    stock_opt = stock_like(job_opt, model, reference)
    assert job_opt.defaults["fused"], "the job runs the fused kernels everywhere, so this test runs the GPU's path"

    job_losses, job_scaler = run_steps(model, job_opt, batches)
    stock_losses, stock_scaler = run_steps(reference, stock_opt, batches)

    # The overflowed steps were really skipped (the scale dropped once per overflow), and the others trained.
    assert job_scaler.get_scale() == stock_scaler.get_scale() == 2.0 ** 16 * 0.5 ** len(overflow_steps)
    assert job_losses[-1] == pytest.approx(stock_losses[-1], rel=1e-5)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        job_state, stock_state = job_opt.state[a], stock_opt.state[b]
        for key, value in stock_state.items():
            torch.testing.assert_close(torch.as_tensor(job_state[key]).float(), torch.as_tensor(value).float(),
                                       rtol=1e-5, atol=1e-6, msg=f"{which}: optimizer state {key!r}")


def test_sgd_momentum_buffers_exist_as_zeros_before_the_first_step():
    cfg = tiny_config(**{"optimizer.momentum": 0.9})
    model, _ = model_and_batches(())
    opt = build_optimizer(cfg, model)
    for p in model.parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(p))
