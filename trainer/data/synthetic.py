"""The ``synthetic`` pipeline: one random batch made on the device and replayed: the compute ceiling, no input cost
at all."""

from __future__ import annotations

import torch

from trainer.config import TrainConfig


class SyntheticPipeline:
    """One fixed random batch, made on the device: measures the model, DDP and the GPU, nothing else."""

    def __init__(self, cfg: TrainConfig, *, device: torch.device, classes: int, steps_per_epoch: int = 1000):
        g = torch.Generator(device="cpu").manual_seed(cfg.training.seed)
        b, s = cfg.training.batch_size, cfg.data.image_size
        fmt = torch.channels_last if cfg.training.channels_last else torch.contiguous_format
        self.images = torch.randn(b, 3, s, s, generator=g).to(device, memory_format=fmt)
        self.labels = torch.randint(0, classes, (b,), generator=g).to(device)
        self.steps = steps_per_epoch

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        while True:  # a train epoch is `len()` steps; measure runs take what they need
            yield self.images, self.labels

    def close(self) -> None:
        pass
