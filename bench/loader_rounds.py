"""How steadily a script's own DataLoader feeds, by its worker count: every batch's arrival time from
``examples/folder_ddp.py``'s ImageFolder pipeline (PIL decode and float32 transforms in the workers, pinned,
persistent workers), alone or ahead of ResNet-50 (fp16, channels_last, one GPU), with the machine's CPU time
(busy, steal) over each run. From the arrival times, how much windows of 2, 4 and 8 worker rounds swing (their
coefficient of variation): with the window's length and with the workers, the question behind windows that do not
settle.

    python bench/loader_rounds.py /data/train --out rounds.json alone:16:2 model:16:2 model:14:2 model:12:4
    python bench/loader_rounds.py --summarize rounds.json      # the lines again, from the arrivals kept

A run is ``consumer:workers:prefetch``; each lasts ``--seconds`` after its first batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from folder_ddp import image_dataset


def cpu_times() -> list[int]:
    """The machine's CPU ticks: user, nice, system, idle, iowait, irq, softirq, steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def round_cv(arrivals: list[float], *, batch: int, workers: int, rounds: int) -> float | None:
    """The coefficient of variation of windows of ``rounds`` whole worker rounds, one window starting at every
    round's end (each from one arrival to another): how much such a window's figure swings."""
    steps = rounds * max(1, workers)
    rates = [steps * batch / (arrivals[i + steps] - arrivals[i])
             for i in range(0, len(arrivals) - steps, max(1, workers))]
    return round(statistics.pstdev(rates) / statistics.mean(rates), 4) if len(rates) > 1 else None


def one_run(data: str, spec: str, *, batch: int, size: int, seconds: float, device: torch.device) -> dict:
    consumer, workers, prefetch = spec.split(":")
    workers, prefetch = int(workers), int(prefetch)
    loader = DataLoader(image_dataset(data, size), batch_size=batch, shuffle=True, num_workers=workers,
                        prefetch_factor=prefetch, persistent_workers=True, pin_memory=device.type == "cuda",
                        drop_last=True)
    step = None
    if consumer == "model":
        net = models.resnet50(num_classes=len(loader.dataset.classes)).to(device, memory_format=torch.channels_last)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
        dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

        def step(images, labels):
            images = images.to(device, non_blocking=True, memory_format=torch.channels_last)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype):
                loss = torch.nn.functional.cross_entropy(net(images), labels)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss
    arrivals, turns, loss_first, loss = [], [], None, None
    t_end, cpu0 = None, None
    epoch = 0
    while t_end is None or time.perf_counter() < t_end:
        t_turn = time.perf_counter()
        for i, (images, labels) in enumerate(loader):
            now = time.perf_counter()
            if i == 0 and epoch:
                turns.append(round(now - t_turn, 4))
            if t_end is None:  # the clock starts at the first batch: the workers' spawn is not the question
                t_end, cpu0 = now + seconds, cpu_times()
            arrivals.append(now)
            if step is not None:
                loss = step(images, labels)
                if loss_first is None:
                    loss_first = float(loss.detach())
            if now >= t_end:
                break
            t_turn = time.perf_counter()
        epoch += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    cpu1 = cpu_times()
    ticks = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    total = sum(ticks) or 1
    arrivals = [t - arrivals[0] for t in arrivals]
    warm = arrivals[workers * 2:]  # the first two rounds: the buffer the workers filled before the clock began
    out = {"run": spec, "workers": workers, "prefetch": prefetch, "batches": len(arrivals),
           "imgs_per_s": round((len(warm) - 1) * batch / (warm[-1] - warm[0]), 1) if len(warm) > 1 else None,
           "cpu_busy": round(1 - (ticks[3] + ticks[4]) / total, 3), "cpu_steal": round(ticks[7] / total, 4),
           "epoch_turns_s": turns, "loss_first": loss_first,
           "loss_last": float(loss.detach()) if loss is not None else None,
           "arrivals": [round(t, 4) for t in arrivals]}
    del loader
    return out


def summarize(r: dict, batch: int) -> str:
    """A run's line: its pace, the CPU's, and how much windows of 2, 4 and 8 rounds swing (from its arrivals, after
    the first two rounds: the buffer the workers filled before the clock began)."""
    warm = r["arrivals"][r["workers"] * 2:]
    cv = " / ".join(str(round_cv(warm, batch=batch, workers=r["workers"], rounds=k)) for k in (2, 4, 8))
    return (f"{r['run']:>12}: {r['imgs_per_s']} imgs/s, cpu busy {r['cpu_busy']:.0%} steal {r['cpu_steal']:.1%}; "
            f"CV of windows of 2/4/8 rounds {cv}; turns {r['epoch_turns_s']}; "
            f"loss {r['loss_first']} -> {r['loss_last']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", nargs="?", help="an ImageFolder")
    p.add_argument("runs", nargs="*", help="consumer:workers:prefetch, consumer 'alone' or 'model'")
    p.add_argument("--out", help="the runs' JSON")
    p.add_argument("--summarize", metavar="JSON", help="print the lines of runs written before, and run none")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--seconds", type=float, default=30.0)
    a = p.parse_intermixed_args(argv)
    if a.summarize:
        for r in json.loads(Path(a.summarize).read_text()):
            print(summarize(r, a.batch))
        return 0
    if not (a.data and a.runs and a.out):
        p.error("an ImageFolder, at least one run and --out (or --summarize JSON)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    results = []
    for spec in a.runs:
        r = one_run(a.data, spec, batch=a.batch, size=a.image_size, seconds=a.seconds, device=device)
        results.append(r)
        Path(a.out).write_text(json.dumps(results, indent=1))
        print(summarize(r, a.batch), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
