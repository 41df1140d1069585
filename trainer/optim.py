"""The optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.apply import prepare_optimizer
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
    else:
        optimizer = torch.optim.AdamW(groups, lr=o.lr, fused=True)
    prepare_optimizer(optimizer)  # fused SGD's momentum buffers as zeros (trainer.apply), as for a script's
    return optimizer


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
