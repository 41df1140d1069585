"""A tiny script for the runtime's tests: a conv net on random images through every runtime helper; what the run
handed it (the DataLoader's workers, DDP's bucket size, autocast's dtype, no_sync on non-final micro-steps) goes to
``$SEEN_OUT`` (rank 0, one JSON object). ``--mode`` breaks it in the ways the bad-input tests need."""

import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainer import runtime


def net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ok",
                   choices=["ok", "no-report", "unread", "fixed-loader", "crash", "short", "val"])
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    declared = {"batch_size": 8}
    if args.mode == "unread":
        declared["decode"] = "pil"  # declared, never read, and no helper of this script applies it
    run = runtime.setup(unit="images", **declared)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 3, 16, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    sampler = DistributedSampler(data)
    if args.mode == "fixed-loader":
        loader = run.loader(DataLoader(data, batch_size=run.batch_size, sampler=sampler, num_workers=0))
    else:
        loader = run.loader(data, batch_size=run.batch_size, sampler=sampler, drop_last=True)
    val = None
    if args.mode == "val":  # a validation loader after the training one, through the same helper, passed each epoch
        held = TensorDataset(torch.randn(64, 3, 16, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
        val = run.loader(held, batch_size=16, num_workers=0, sampler=DistributedSampler(held, shuffle=False))
    model = run.model(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    criterion = nn.CrossEntropyLoss()
    seen = {"num_workers": loader.num_workers, "batch_size": loader.batch_size, "pin_memory": loader.pin_memory,
            "bucket_bytes": model.bucket_bytes_cap, "static_graph": model.static_graph,
            "grad_as_bucket_view": model.gradient_as_bucket_view, "dtypes": [], "sync": [], "channels_last": [],
            "device": str(run.device), "steps": 0, "batch_sums": []}
    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            if args.mode == "crash" and seen["steps"] == 1:
                raise RuntimeError("the script broke on purpose")
            with run.step(optimizer):
                seen["dtypes"].append(str(torch.get_autocast_dtype(run.device.type))
                                      if torch.is_autocast_enabled(run.device.type) else None)
                seen["sync"].append(bool(model.require_backward_grad_sync))  # False inside DDP's no_sync()
                seen["channels_last"].append(images.is_contiguous(memory_format=torch.channels_last))
                loss = criterion(model(images), labels)
                run.backward(loss)
            seen["steps"] += 1
            if len(seen["batch_sums"]) < 4:
                seen["batch_sums"].append(round(float(images.sum()), 3))
            if args.mode == "no-report" or (args.mode == "short" and seen["steps"] > 3):
                continue
            if run.report(len(images), loss):
                break
        if args.mode == "short":
            break
        if val is not None:
            model.eval()
            with torch.no_grad():
                seen.setdefault("val_batches", 0)
                for images, labels in val:
                    criterion(model(images), labels)
                    seen["val_batches"] += 1
            model.train()
    if run.rank == 0 and os.environ.get("SEEN_OUT"):
        with open(os.environ["SEEN_OUT"], "w") as f:
            json.dump(seen, f)
    run.close()


if __name__ == "__main__":
    main()
