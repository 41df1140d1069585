"""The seed tutorial's ResNet-50 as a Lightning script: a LightningDataModule reading an ImageFolder with
transforms.v2, a LightningModule, and a Trainer with DDP under torchrun. ``lightning_ddp.py`` is the same script
tuned by ddp-autotune's Lightning adapter (the README shows the diff).

    torchrun --nproc-per-node 4 examples/lightning_ddp_plain.py --data /path/to/imagefolder

Without ``--data`` it trains on a small generated ImageFolder; without a GPU it defaults to ResNet-18 on 64-px crops.
"""

import argparse
import os

import lightning.pytorch as pl
import torch
from demo_data import image_folder
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, models
from torchvision.transforms import v2


class ImageData(pl.LightningDataModule):
    def __init__(self, root: str, size: int, batch_size: int = 64, num_workers: int = 4):
        super().__init__()
        self.root, self.size, self.batch_size, self.num_workers = root, size, batch_size, num_workers
        self.classes = datasets.ImageFolder(root).classes

    def setup(self, stage: str):
        self.train = datasets.ImageFolder(self.root, transform=v2.Compose([
            v2.RandomResizedCrop(self.size), v2.RandomHorizontalFlip(), v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])]))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
                          pin_memory=True, drop_last=True)


class Classifier(pl.LightningModule):
    def __init__(self, arch: str, num_classes: int, lr: float):
        super().__init__()
        self.save_hyperparameters()
        self.net = models.get_model(arch, num_classes=num_classes)
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, images):
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = self.criterion(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=1e-4)


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
    size = args.image_size or (224 if cuda else 64)
    folder = args.data or image_folder()
    data = ImageData(folder, size)
    model = Classifier(args.model or ("resnet50" if cuda else "resnet18"), len(data.classes), args.lr)
    trainer = pl.Trainer(max_epochs=args.epochs, precision="16-mixed" if cuda else "32-true", strategy="ddp",
                         devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
