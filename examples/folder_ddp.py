"""The seed tutorial's script keeping its own input pipeline: torchvision's ImageFolder with transforms.v2 (PIL
decode in the DataLoader's workers) and a DistributedSampler, handed to ``run.loader`` so that the search tunes the
loader's settings (batch, workers, prefetch, pinned and persistent workers) and measures what this pipeline can feed
— the usual case of a user who has their own Dataset. ``seed_ddp.py`` instead reads its images through
``run.image_loader``, whose pipelines a search may swap (libjpeg-turbo, nvJPEG on the GPU, a split of each batch).

    torchrun --nproc-per-node 4 examples/folder_ddp.py --data /path/to/imagefolder       # runs as it always did
    autotune search --script examples/folder_ddp.py -- --data /path/to/imagefolder

Without ``--data`` it trains on a small generated ImageFolder; without a GPU it defaults to ResNet-18 on 64-px crops.
"""

import argparse

import torch
from demo_data import image_folder
from torch import nn
from torch.utils.data import DistributedSampler
from torchvision import datasets, models
from torchvision.transforms import v2

from trainer import runtime


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="ImageFolder (one sub-folder per class); default: a small generated one")
    p.add_argument("--model", help="torchvision classifier (default: resnet50 on a GPU, resnet18 on the CPU)")
    p.add_argument("--image-size", type=int, help="crop size (default: 224 on a GPU, 64 on the CPU)")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--lr", type=float, default=0.1)
    return p.parse_args()


def image_dataset(path: str, size: int) -> datasets.ImageFolder:
    """The usual ImageFolder: PIL decode, random crop and flip, float32 normalized, all in the loader's workers."""
    return datasets.ImageFolder(path, transform=v2.Compose([
        v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])]))


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    run = runtime.setup(unit="images", precision="fp16" if cuda else "fp32")
    size = args.image_size or (224 if cuda else 64)
    dataset = image_dataset(args.data or image_folder(), size)
    sampler = DistributedSampler(dataset)
    loader = run.loader(dataset, batch_size=64, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    net = models.get_model(args.model or ("resnet50" if cuda else "resnet18"), num_classes=len(dataset.classes))
    model = run.model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
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
