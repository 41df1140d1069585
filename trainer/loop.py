"""The train step and what it needs: autocast, a GradScaler only for fp16 (both made by ``trainer.apply``),
accumulation without extra all-reduces, and validation."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from trainer.apply import grad_sync


def train_step(model: nn.Module, batches: Iterator, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler | None, *, accum_steps: int, autocast_ctx,
               cuda_graphs: bool = False) -> torch.Tensor:
    """One optimizer step over ``accum_steps`` micro-batches; returns the mean loss as a device tensor (no sync).

    Every non-final micro-step runs forward *and* backward inside ``no_sync()``, so DDP all-reduces the gradients
    once per optimizer step instead of once per micro-batch (the seed tutorial's loop all-reduced every time).
    Raises StopIteration when ``batches`` runs out before a full step.

    ``cuda_graphs``: the model is compiled with CUDA graphs (``reduce-overhead``). Each step then starts a new
    generation of Inductor's cudagraph trees, so the graphs may reuse the memory of the last step's outputs (its
    logits and gradients, all consumed by then); the loss, the GradScaler and the optimizer step run eager, outside
    the graphs, and with them the scaler's skip of an overflowed step stays on the device.
    """
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    total = None
    for micro in range(accum_steps):
        images, labels = next(batches)
        final = micro == accum_steps - 1
        with grad_sync(model, final=final):
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
