"""An ImageFolder classifier as a user writes one outside the project, adapted to the runtime: its own transforms.v2,
its own DataLoader with its own worker count and DistributedSampler, handed to ``run.loader``; resnet18 at 64 px.

    torchrun --nproc-per-node 2 user_folder.py --data /path/to/imagefolder
    autotune search --script user_folder.py:main -- --data /path/to/imagefolder
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, models
from torchvision.transforms import v2

from trainer import runtime


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--built", action="store_true", help="build the DataLoader here and hand it to run.loader")
    args = p.parse_args()

    run = runtime.setup(unit="images")
    transform = v2.Compose([v2.RandomResizedCrop(args.image_size), v2.RandomHorizontalFlip(), v2.ToImage(),
                            v2.ToDtype(torch.float32, scale=True)])
    dataset = datasets.ImageFolder(args.data, transform=transform)
    sampler = DistributedSampler(dataset)
    if args.built:
        loader = run.loader(DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=args.workers,
                                       drop_last=True))
    else:
        loader = run.loader(dataset, batch_size=32, sampler=sampler, num_workers=args.workers, drop_last=True)
    model = run.model(models.resnet18(num_classes=len(dataset.classes)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            with run.step(optimizer):
                loss = criterion(model(images), labels)
                run.backward(loss)
            if run.report(len(images), loss):
                break
    run.close()


if __name__ == "__main__":
    main()
