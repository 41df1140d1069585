"""The seed tutorial's single-node ResNet-50 DDP script, with current APIs: torchrun and LOCAL_RANK, torch.amp,
transforms.v2 — and the ddp-autotune runtime added (``seed_ddp_plain.py`` is the script without it). Its images come
through ``run.image_loader``: the same random-resized-crop, flip and normalization as the plain script's ImageFolder,
decoded by the input pipeline a search picks (PIL, libjpeg-turbo, nvJPEG on the GPU, or a split of each batch).

    torchrun --nproc-per-node 4 examples/seed_ddp.py --data /path/to/imagefolder       # runs as it always did
    autotune search --script examples/seed_ddp.py -- --data /path/to/imagefolder       # a fresh process per trial
    autotune search --script examples/seed_ddp.py:main -- --data /path/to/imagefolder  # one live worker

Without ``--data`` it trains on a small generated ImageFolder; without a GPU it defaults to ResNet-18 on 64-px crops
(a CPU demo), with one to ResNet-50 at 224 px as the tutorial does.
"""

import argparse

import torch
from demo_data import image_folder
from torch import nn
from torchvision import models

from trainer import runtime


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="ImageFolder (one sub-folder per class); default: a small generated one")
    p.add_argument("--model", help="torchvision classifier (default: resnet50 on a GPU, resnet18 on the CPU)")
    p.add_argument("--image-size", type=int, help="crop size (default: 224 on a GPU, 64 on the CPU)")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--lr", type=float, default=0.1)
    return p.parse_args()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    run = runtime.setup(unit="images", precision="fp16" if cuda else "fp32")
    size = args.image_size or (224 if cuda else 64)
    loader = run.image_loader(args.data or image_folder(), image_size=size, batch_size=64, num_workers=4,
                              pin_memory=True)
    net = models.get_model(args.model or ("resnet50" if cuda else "resnet18"), num_classes=loader.num_classes)
    model = run.model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss()
    for epoch in run.epochs(args.epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            with run.step(optimizer):
                loss = criterion(model(images), labels)
                run.backward(loss)
            if run.report(len(images), loss):
                break
    run.close()


if __name__ == "__main__":
    main()
