"""A user's own segmentation script, adapted to the ddp-autotune runtime as a new user would: a tiny U-Net on an
in-memory dataset of generated shapes with its own augmentation (random flips and a brightness jitter, in the
Dataset), a DistributedSampler, AdamW, bf16 where CUDA is, fp32 otherwise.

    torchrun --nproc-per-node 2 tests/helpers/scripts/segment.py            # runs as it always did
    autotune search --script tests/helpers/scripts/segment.py               # a fresh torchrun per trial
    autotune search --script tests/helpers/scripts/segment.py:main          # one live worker

``--variant`` makes it one of the scripts the defect tests need (``tests/autotune/search/test_script_defects*``):
``own-loader`` builds its own ``DataLoader(num_workers=3)`` while it reads ``run.num_workers``; ``own-group`` starts
its own process group; ``nan`` has a loss that goes NaN after a few steps; ``clip`` clips its gradients (fp16 where
CUDA is); ``short`` has an epoch of a few steps and no persistent workers (each epoch restarts the loader's workers);
``slow`` goes on stepping, but each step after the third takes seconds (a trial too slow for its timeout, not a
hang). With ``SEGMENT_EPOCHS=FILE`` rank 0 appends the wall-clock time each epoch's loop starts to FILE.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer import runtime

VARIANTS = ("plain", "own-loader", "own-group", "nan", "clip", "short", "slow")


class Shapes(Dataset):
    """``n`` images of ``size`` px with a bright disc or square on noise, and its mask; made once, in memory. The
    augmentation is the dataset's own: a random flip of image and mask together, and a brightness jitter."""

    def __init__(self, n: int, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
        self.images = torch.rand(n, 3, size, size, generator=g) * 0.3
        self.masks = torch.zeros(n, size, size, dtype=torch.long)
        for i in range(n):
            cy, cx = torch.randint(size // 4, 3 * size // 4, (2,), generator=g).tolist()
            r = int(torch.randint(2, size // 4, (1,), generator=g))
            disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            square = ((yy - cy).abs() <= r) & ((xx - cx).abs() <= r)
            shape = disc if i % 2 else square
            self.masks[i][shape] = 1 + i % 2
            self.images[i][:, shape] += 0.6

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        image, mask = self.images[i], self.masks[i]
        if torch.rand(()) < 0.5:
            image, mask = image.flip(-1), mask.flip(-1)
        image = (image * (0.8 + 0.4 * torch.rand(()))).clamp(0, 1)
        return image, mask


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyUNet(nn.Module):
    """Two levels down, two up, skips between: a U-Net small enough for a CPU."""

    def __init__(self, width: int = 8, classes: int = 3):
        super().__init__()
        self.down1, self.down2 = block(3, width), block(width, 2 * width)
        self.bottom = block(2 * width, 2 * width)
        self.up2, self.up1 = block(4 * width, width), block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.up2(torch.cat([F.interpolate(b, scale_factor=2), d2], 1))
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2), d1], 1))
        return self.head(u1)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="plain", choices=VARIANTS)
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    if args.variant == "own-group":  # as the script did before the runtime: the runtime finds the group started
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
    precision = ("fp16" if args.variant == "clip" else "bf16") if cuda else "fp32"
    own_loader = args.variant == "own-loader"
    run = runtime.setup(unit="images", precision=precision, **({"num_workers": 2} if own_loader else {}))
    dataset = Shapes(64 if args.variant == "short" else args.images, args.size)
    sampler = DistributedSampler(dataset)
    if own_loader:  # reads the setting, then builds and iterates a DataLoader of its own with another number
        print(f"rank {run.rank}: {run.num_workers} workers", flush=True)
        loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=3, drop_last=True)
    else:
        loader = run.loader(dataset, batch_size=16, sampler=sampler, num_workers=2, drop_last=True,
                            persistent_workers=args.variant != "short")
    model = run.model(TinyUNet())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    done = 0
    epochs_out = os.environ.get("SEGMENT_EPOCHS")  # where a test reads when each epoch's loader started
    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        if epochs_out and run.rank == 0:
            with open(epochs_out, "a") as f:
                f.write(f"{time.time()}\n")
        for step, (x, mask) in enumerate(loader):
            if own_loader:
                x, mask = x.to(run.device), mask.to(run.device)
            with run.step(optimizer):
                loss = F.cross_entropy(model(x), mask)
                if args.variant == "nan" and step >= 3:  # a log of zero, say: NaN from the 4th step on
                    loss = loss + torch.log(torch.zeros((), device=loss.device)) * 0
                run.backward(loss)
                if args.variant == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            done += 1
            if args.variant == "slow" and done > 3:
                time.sleep(4.0)
            if run.report(len(x), loss):
                break
        if run.rank == 0 and not run.in_search:
            print(f"epoch {epoch}: loss {loss.item():.3f}", flush=True)
    run.close()


if __name__ == "__main__":
    main()
