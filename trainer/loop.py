"""The train step and what it needs: autocast, a GradScaler only for fp16, accumulation without extra all-reduces,
the optimizer and LR schedule, and validation."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import TrainConfig

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(cfg: TrainConfig, device: torch.device):
    dtype = AUTOCAST_DTYPES.get(cfg.training.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler | None:
    # bf16 has fp32's exponent range, so only fp16 needs loss scaling.
    return torch.amp.GradScaler(device.type) if cfg.training.precision == "fp16" else None


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
    warmup = int(round(o.warmup_epochs * steps_per_epoch))

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if o.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_step(model: nn.Module, batches: Iterator, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler | None, *, accum_steps: int, autocast_ctx) -> torch.Tensor:
    """One optimizer step over ``accum_steps`` micro-batches; returns the mean loss as a device tensor (no sync).

    Every non-final micro-step runs forward *and* backward inside ``no_sync()``, so DDP all-reduces the gradients
    once per optimizer step instead of once per micro-batch (the seed tutorial's loop all-reduced every time).
    Raises StopIteration when ``batches`` runs out before a full step.
    """
    total = None
    for micro in range(accum_steps):
        images, labels = next(batches)
        sync_ctx = model.no_sync() if micro < accum_steps - 1 and hasattr(model, "no_sync") else contextlib.nullcontext()
        with sync_ctx:
            with autocast_ctx:
                loss = nn.functional.cross_entropy(model(images), labels) / accum_steps
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(model: nn.Module, pipeline, *, autocast_ctx, device: torch.device) -> dict[str, float]:
    """Top-1/top-5 over this rank's shard, summed over all ranks (shards do not overlap, nothing is counted twice)."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(4, dtype=torch.float64, device=device)  # top1, top5, n, loss sum
    for images, labels in pipeline:
        with autocast_ctx:
            logits = model(images)
        loss = nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top5 == labels[:, None]
        counts += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(), torch.tensor(labels.numel(), device=device),
                               loss]).to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(counts)
    model.train(was_training)
    top1, top5, n, loss_sum = counts.tolist()
    return {"top1": top1 / max(n, 1), "top5": top5 / max(n, 1), "loss": loss_sum / max(n, 1), "images": int(n)}
