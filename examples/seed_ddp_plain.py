"""The seed tutorial's single-node ResNet-50 DDP script, with current APIs: torchrun and LOCAL_RANK, torch.amp,
transforms.v2. ``seed_ddp.py`` is the same script with the ddp-autotune runtime added (the README shows the diff).

    torchrun --nproc-per-node 4 examples/seed_ddp_plain.py --data /path/to/imagefolder

Without ``--data`` it trains on a small generated ImageFolder; without a GPU it defaults to ResNet-18 on 64-px crops
(a CPU demo), with one to ResNet-50 at 224 px as the tutorial does.
"""

import argparse
import os

import torch
import torch.distributed as dist
from demo_data import image_folder
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, models
from torchvision.transforms import v2


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
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    size = args.image_size or (224 if cuda else 64)
    dataset = datasets.ImageFolder(args.data or image_folder(), transform=v2.Compose([
        v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])]))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    net = models.get_model(args.model or ("resnet50" if cuda else "resnet18"), num_classes=len(dataset.classes))
    model = DDP(net.to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
                loss = criterion(model(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
