"""The optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import TrainConfig


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optimizer
    # No weight decay on norms and biases: the usual ImageNet recipe.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused kernels on every device (CPU included, so the CPU tests run the optimizer the GPUs run): one kernel per
    # step, and under a GradScaler the skip of an overflowed step happens on the device, with no host sync.
    if o.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, fused=True)
        init_momentum_buffers(optimizer)
        return optimizer
    return torch.optim.AdamW(groups, lr=o.lr, fused=True)


def init_momentum_buffers(optimizer: torch.optim.SGD) -> None:
    """Create SGD's momentum buffers as zeros before the first step.

    The fused SGD kernel allocates the buffers uninitialized (``torch.empty_like``) on its first call and fills them
    only when that step runs. Under a GradScaler the first fp16 steps usually overflow and are skipped *on the
    device*, so the first call leaves the buffers holding whatever memory they got, and every later step pours it
    into the weights (on 2xH200 every fp16 ResNet-50 run had a NaN loss from step 3). Zeros make the kernel's
    ordinary update ``buf = momentum * buf + grad`` equal stock SGD's first step ``buf = grad`` (no dampening), and a
    skipped step leaves them zero, as stock SGD leaves them absent."""
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        if group["dampening"] != 0:
            raise ValueError("init_momentum_buffers: with dampening the first step differs from stock SGD's")
        for p in group["params"]:
            optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))


def build_scheduler(cfg: TrainConfig, optimizer, *, total_steps: int, steps_per_epoch: int):
    o = cfg.optimizer
    warmup = round(o.warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if o.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
