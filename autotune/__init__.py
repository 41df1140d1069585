"""ddp-autotune: finds the fastest DDP training configuration for a job on a node of GPUs."""

__version__ = "0.1.0"
